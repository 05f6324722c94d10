"""Reading a checkpoint back (``load``): DeepSpeed's files, whichever ZeRO stage wrote them.

Finds the tag folder (``latest``, or the tag; an interrupted save is recovered first), vets both
files before the engine changes (checks.py: complete files that fit the model; safe_load.py: no
code runs), fills ZeRO-3's module placeholders from the fp32 partitions or the frozen fragments,
restores the fp32 masters by name, unflattens the optimizer state of DeepSpeed's flat partitions
into the engine's per-parameter form, and restores the loss scaler, the LR scheduler and the
counters.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from rp_engine.checkpoint import checks as checkpoint_checks
from rp_engine.checkpoint import safe_load
from rp_engine.checkpoint.commit import _listdir, _recover_interrupted
from rp_engine.checkpoint.layout import (
    _BASE_OPTIMIZER_STATE,
    _FP32_FLAT_GROUPS,
    _LOSS_SCALER,
    _OPTIMIZER_STATE_DICT,
    _OWN_KEYS,
    _PARAM_ALIGNMENT_PADDINGS,
    _RP_DATA_PARALLEL,
    _RP_DELAY_COMPENSATION,
    _RP_LOSS_SCALER,
    _SINGLE_PARTITION,
    _ZERO_STAGE,
    _ParamNames,
    has_optimizer_state,
    model_file_name,
    optim_file_name,
)

__all__ = ["load"]

log = logging.getLogger("rp_engine.checkpoint")


def load(
    engine: Any,
    load_dir: str | os.PathLike[str],
    *,
    tag: str | None,
    strict: bool,
    optimizer_states: bool,
    scheduler_states: bool,
    module_only: bool = False,
    trust: bool = False,
) -> tuple[str | None, dict[str, Any] | None]:
    """Restore ``engine`` from a checkpoint; returns (model-states file path, client_state).

    As DeepSpeed: the returned path is the loaded ``*_model_states.pt`` file; with no ``latest``
    file and no tag it warns and returns (None, None). Without ``optimizer_states`` the fp32
    masters are rebuilt from the loaded compute weights (DeepSpeed's ``_restore_from_bit16_
    weights``); ``module_only`` (``load_module_only``) also keeps the engine's counters.
    Afterwards every layer is declared at version ``global_steps``. Files load with
    ``weights_only=True`` (plus DeepSpeed's own classes, see
    :mod:`rp_engine.checkpoint.safe_load`); one holding any other Python global is refused
    before it is unpickled unless ``trust`` (``load_checkpoint(trust_checkpoint=True)``).
    """
    load_dir = os.fspath(load_dir)
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            log.warning(
                "Unable to find latest file at %s, if trying to load latest checkpoint please "
                "ensure this file exists or pass an explicit checkpoint tag when loading a "
                "checkpoint.",
                latest,
            )
            return None, None
        with open(latest) as f:
            tag = f.read().strip()
    _recover_interrupted(load_dir, remove_stale=False)
    folder = _tag_folder(load_dir, str(tag))
    model_path = _find_file(folder, model_file_name(engine._config.zero.stage), "*_model_states.pt")
    checkpoint_checks.check_file(model_path)  # truncated / not torch.save: name the file
    ckpt = safe_load.load(model_path, trust=trust)
    saved = (ckpt.get(_RP_DATA_PARALLEL) or {}).get("dp_world_size", 1)
    now = int(getattr(engine, "dp_world_size", 1))
    if saved != now:  # the files hold the whole state: each rank keeps the layers it owns
        log.info("resharding checkpoint %s: saved at dp world size %s, loading at %d", folder,
                 saved, now)  # fmt: skip
    load_optimizer = optimizer_states and not module_only and has_optimizer_state(engine)
    placeholders = _zero3_placeholders(engine.module, ckpt)
    osd = None
    fragments = ckpt.get("frozen_param_fragments") or {}
    aliases = ckpt.get("shared_params") or {}
    # ZeRO-3 weights not in the model file are in the optim file's fp32 partitions (a forward-
    # only engine's checkpoint has none: every weight is a fragment there)
    trained = [k for k in placeholders if aliases.get(k, k) not in fragments]
    if load_optimizer or trained:
        bf16 = bool(engine._config.bf16.enabled)
        optim_path = _find_file(folder, optim_file_name(bf16=bf16), "*_optim_states.pt")
        # Read (and vet) both files before the engine changes: a refused file leaves it as it was.
        checkpoint_checks.check_file(optim_path)
        osd = safe_load.load(optim_path, trust=trust)[_OPTIMIZER_STATE_DICT]

    module_state = _fill_zero3_placeholders(engine.module, ckpt, placeholders, osd)
    checkpoint_checks.check_module_state(model_path, module_state, engine.module, strict=strict)
    missing, unexpected = engine.module.load_state_dict(module_state, strict=strict)
    if missing or unexpected:
        log.warning("checkpoint module: missing keys %s, unexpected keys %s", missing, unexpected)
    store = engine.store
    store.zero_grads()
    store.reload_masters()
    delay = getattr(engine.stepper, "delay", None)
    if delay is not None:  # the scales belong to the masters just replaced
        delay.load_scales({})
    if load_optimizer and osd is not None:
        _load_optimizer(engine, ckpt, osd, strict=strict)
    if scheduler_states and not module_only and engine.lr_scheduler is not None:
        if ckpt.get("lr_scheduler") is None:
            log.warning("checkpoint %s has no lr_scheduler state; scheduler left as is", folder)
        else:
            engine.lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
    if not module_only:
        engine.global_steps = int(ckpt["global_steps"])
        engine.global_samples = int(
            ckpt.get("global_samples", engine.global_steps * engine._config.train_batch_size)
        )
        engine.skipped_steps = int(ckpt["skipped_steps"])
    engine.stepper.set_step(engine.global_steps)
    client_state = {k: v for k, v in ckpt.items() if k not in _OWN_KEYS}
    log.info("loaded checkpoint %s (global step %d)", folder, engine.global_steps)
    return model_path, client_state


def _tag_folder(load_dir: str, tag: str) -> str:
    folder = os.path.join(load_dir, tag)
    if os.path.isdir(folder):
        return folder
    tags = _available_tags(load_dir)
    aside = sorted(
        n
        for n in _listdir(load_dir)
        if n.startswith(f".{tag}.old-") or n.startswith(f".{tag}.tmp-")
    )
    hint = f"; an interrupted save left {aside} there" if aside else ""
    raise FileNotFoundError(
        f"checkpoint tag folder {folder!r} does not exist; available tags in {load_dir!r}: "
        f"{tags or 'none'}{hint}"
    )


def _available_tags(load_dir: str) -> list[str]:
    def natural(name: str) -> list[Any]:
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]

    return sorted(
        (
            n
            for n in _listdir(load_dir)
            if not n.startswith(".") and os.path.isdir(os.path.join(load_dir, n))
        ),
        key=natural,
    )


def _find_file(folder: str, name: str, pattern: str) -> str:
    """The expected file, else the single file matching ``pattern`` (a checkpoint written with
    another ZeRO stage or precision), else FileNotFoundError."""
    path = os.path.join(folder, name)
    if os.path.isfile(path):
        return path
    found = sorted(n for n in _listdir(folder) if fnmatch.fnmatch(n, pattern))
    if len(found) == 1:
        log.warning("loading %s (this engine would name it %s)", found[0], name)
        return os.path.join(folder, found[0])
    raise FileNotFoundError(
        f"no {name!r} in checkpoint folder {folder!r} (found {found or 'no'} {pattern} files; "
        "checkpoints saved by more than one process are not supported)"
        + ("; pass load_optimizer_states=False to load weights only" if "optim" in name else "")
    )


def _load_optimizer(
    engine: Any, ckpt: Mapping[str, Any], osd: Mapping[str, Any], *, strict: bool
) -> None:
    """fp32 masters (by name: exact), inner optimizer state, loss scaler, overflow flag."""
    stage = int(osd[_ZERO_STAGE])
    flats = osd[_FP32_FLAT_GROUPS] if stage >= 3 else osd[_SINGLE_PARTITION]
    saved = _split_flat(
        ckpt["param_shapes"], list(flats), osd.get(_PARAM_ALIGNMENT_PADDINGS), stage=stage
    )
    names = _ParamNames(engine.module)
    aliases = {alias: primary for alias, primary in names.shared.items()}
    targets = {names.of(hp.param): hp for hp in engine.store.owned_params() if hp.master.numel()}
    loaded = set()
    with torch.no_grad():
        for name, tensor in saved.items():
            hp = targets.get(aliases.get(name, name))
            if hp is None:
                continue
            if tuple(hp.master.shape) != tuple(tensor.shape):
                raise RuntimeError(
                    f"checkpoint fp32 weight {name!r} has shape {tuple(tensor.shape)}, the model's "
                    f"is {tuple(hp.master.shape)}"
                )
            hp.master.copy_(tensor)
            # DeepSpeed refreshes the 16-bit weights from the loaded fp32 partition.
            hp.param.data.copy_(hp.master)
            loaded.add(names.of(hp.param))
    missing = sorted(set(targets) - loaded)
    unexpected = sorted(n for n in saved if aliases.get(n, n) not in targets)
    if missing or unexpected:
        msg = f"checkpoint fp32 masters: missing {missing}, unexpected {unexpected}"
        if strict:
            raise RuntimeError(msg + " (load_module_strict=False tolerates this)")
        log.warning(msg + "; missing masters were rebuilt from the loaded weights")

    inner = osd.get(_BASE_OPTIMIZER_STATE, osd.get(_OPTIMIZER_STATE_DICT))
    if ckpt.get("optimizer") is not None:  # stage 0 fp32: per-parameter, in the model file
        inner = ckpt["optimizer"]
    ids = _flat_ids(inner, list(flats)) if inner is not None else None
    if inner is not None and ids is not None:
        inner = _unflatten_state(engine, ckpt, inner, ids, list(flats), osd, stage=stage)
    if inner is not None:
        try:
            # With the NVMe optimizer tier the state is copied into the tier layer by layer
            # as the load ends (storage/optimizer_tier.py materialized): no copy in RAM first.
            paged = engine.store.pager is not None
            engine.host_optimizer.load_state_dict(inner if paged else _materialize(inner))
        except (ValueError, KeyError) as exc:
            raise RuntimeError(
                f"the checkpoint's optimizer state does not fit this optimizer ({exc}); it was "
                "saved with other param groups or another optimizer type. Pass "
                "load_optimizer_states=False to load weights only"
            ) from exc
    scaler_state = osd.get(_RP_LOSS_SCALER, osd.get(_LOSS_SCALER))
    if scaler_state is not None:
        engine.host_optimizer.loss_scaler.load_state_dict(
            _scaler_dict(scaler_state, engine.host_optimizer.loss_scaler)
        )
    engine.host_optimizer.overflow = bool(osd.get("overflow", False))
    delay = getattr(engine.stepper, "delay", None)
    if delay is not None:  # without saved scales each tensor measures its own again (load)
        scales = osd.get(_RP_DELAY_COMPENSATION) or {}
        delay.load_scales({
            targets[primary].master: float(value)
            for name, value in scales.items()
            if (primary := aliases.get(name, name)) in targets
        })  # fmt: skip


def _zero3_placeholders(module: nn.Module, ckpt: Mapping[str, Any]) -> list[str]:
    """Keys of ``ckpt["module"]`` that are ZeRO-3 placeholders (0 elements where the module's
    tensor has some): DeepSpeed's ZeRO-3 layout, which rp_engine also writes at stage 3."""
    current = module.state_dict()
    return [
        k
        for k, v in ckpt["module"].items()
        if v.numel() == 0 and k in current and current[k].numel() > 0
    ]


def _fill_zero3_placeholders(
    module: nn.Module,
    ckpt: Mapping[str, Any],
    placeholders: list[str],
    osd: Mapping[str, Any] | None,
) -> Mapping[str, torch.Tensor]:
    """``ckpt["module"]`` with ZeRO-3's empty placeholders filled in.

    A ZeRO-3 model file holds a 0-element tensor per partitioned parameter: trained weights live
    in the optim file as fp32 partitions (``osd``; cast to the module's dtype here, as
    DeepSpeed's ``load_optimizer_states=False`` path does with zero_to_fp32; with optimizer
    states the fp32 masters are then loaded exactly), frozen ones in ``frozen_param_fragments``.
    Files with full tensors pass through unchanged.
    """
    saved = ckpt["module"]
    if not placeholders:
        return saved
    current = module.state_dict()
    fragments = ckpt.get("frozen_param_fragments") or {}
    trained: Mapping[str, torch.Tensor] = {}
    if osd is not None:
        stage = int(osd[_ZERO_STAGE])
        flats = osd[_FP32_FLAT_GROUPS] if stage >= 3 else osd[_SINGLE_PARTITION]
        trained = _split_flat(
            ckpt["param_shapes"], list(flats), osd.get(_PARAM_ALIGNMENT_PADDINGS), stage=stage
        )
    aliases = ckpt.get("shared_params") or {}
    filled = dict(saved)
    unrestorable = []
    for key in placeholders:
        source = aliases.get(key, key)
        if source in fragments:
            filled[key] = fragments[source].reshape(current[key].shape)
        elif source in trained:
            filled[key] = trained[source].to(current[key].dtype)
        else:
            unrestorable.append(key)
    if unrestorable:
        raise RuntimeError(
            f"checkpoint module entries {unrestorable[:5]}{' ...' if len(unrestorable) > 5 else ''}"
            " are ZeRO-3 placeholders whose weights are in neither the optim-states file nor "
            "frozen_param_fragments; convert the checkpoint with zero_to_fp32.py or load it with "
            "load_module_strict=False"
        )
    return filled


def _flat_ids(inner: Mapping[str, Any], flats: list[torch.Tensor]) -> list[int] | None:
    """The inner optimizer's parameter ids, one per flat fp32 partition, when its state is in
    DeepSpeed's ZeRO form (ZeRO 1-3 step one flat partition per group or ZeRO-3 sub-group);
    None for a per-parameter state_dict (rp_engine files written before the ZeRO form; a file
    whose groups hold one parameter each reads correctly either way)."""
    ids = [i for g in inner.get("param_groups") or [] for i in g["params"]]
    if not flats or len(ids) != len(flats):
        return None
    for i, flat in zip(ids, flats, strict=True):
        for value in (inner.get("state") or {}).get(i, {}).values():
            if isinstance(value, torch.Tensor) and value.dim() > 1:
                return None  # shaped like a parameter: per-parameter state
            if isinstance(value, torch.Tensor) and 1 < value.numel() < flat.numel():
                return None
    return ids


def _unflatten_state(
    engine: Any,
    ckpt: Mapping[str, Any],
    inner: Mapping[str, Any],
    ids: list[int],
    flats: list[torch.Tensor],
    osd: Mapping[str, Any],
    *,
    stage: int,
) -> dict[str, Any]:
    """DeepSpeed's flat-partition optimizer state as a per-parameter state_dict of
    ``engine.host_optimizer``: state tensors the size of a flat partition (Adam's moments; ZeRO-1/2
    ones include the partition's tail padding) are split like the fp32 partitions (zero_to_fp32's
    layout); other entries (``step``) go to every parameter of the partition."""
    flat_states = [inner["state"].get(i, {}) for i in ids]
    state: dict[int, dict[str, Any]] = {}
    if not any(flat_states):  # saved before the first step
        return {"state": state, "param_groups": _groups_like(engine, inner, lambda _: None, state)}
    if not all(flat_states):
        raise RuntimeError(
            "the checkpoint's optimizer has state for some flat groups only; it cannot be split "
            "per parameter. Pass load_optimizer_states=False to load weights only"
        )

    def is_flat(value: Any, flat: torch.Tensor) -> bool:
        return (
            isinstance(value, torch.Tensor)
            and value.dim() == 1
            and value.numel() >= max(flat.numel(), 2)
        )

    first = flat_states[0]
    tensors = [k for k, v in first.items() if is_flat(v, flats[0])]
    paddings = osd.get(_PARAM_ALIGNMENT_PADDINGS)
    split = {
        k: _split_flat(
            ckpt["param_shapes"],
            [
                st[k].reshape(-1).narrow(0, 0, f.numel())
                for st, f in zip(flat_states, flats, strict=True)
            ],
            paddings,
            stage=stage,
        )
        for k in tensors
    }
    # Partition-wide scalars, per parameter name (every partition has its own `step`).
    scalars: dict[str, dict[str, Any]] = {}
    for shapes_index, names in enumerate(_flat_names(ckpt["param_shapes"], flats, stage=stage)):
        st = flat_states[shapes_index]
        for name in names:
            scalars[name] = {k: v for k, v in st.items() if k not in tensors}

    def per_param(name: str) -> dict[str, Any] | None:
        if not all(name in split[k] for k in tensors):
            return None
        return {**scalars.get(name, {}), **{k: split[k][name] for k in tensors}}

    groups = _groups_like(engine, inner, per_param, state)
    return {"state": state, "param_groups": groups}


def _flat_names(
    param_shapes: list[Mapping[str, Any]], flats: list[torch.Tensor], *, stage: int
) -> list[list[str]]:
    """Parameter names held by each flat partition (by element ranges when the ZeRO-3
    param_shapes groups do not line up with the sub-groups)."""
    if len(param_shapes) == len(flats):
        return [list(shapes) for shapes in param_shapes]
    ends, total = [], 0
    for f in flats:
        total += f.numel()
        ends.append(total)
    out: list[list[str]] = [[] for _ in flats]
    offset, part = 0, 0
    for shapes in param_shapes:
        for name, shape in shapes.items():
            while part < len(ends) - 1 and offset >= ends[part]:
                part += 1
            out[part].append(name)
            offset += math.prod(shape)
    return out


def _groups_like(
    engine: Any,
    inner: Mapping[str, Any],
    per_param: Callable[[str], dict[str, Any] | None],
    state: dict[int, dict[str, Any]],
) -> list[dict[str, Any]]:
    """``engine.host_optimizer``'s param groups in state_dict form (params numbered in order), with
    the saved hyper-parameters; ``state[index] = per_param(name)`` where that is not None."""
    names = _ParamNames(engine.module)
    owner = {id(hp.master): hp for hp in engine.store.owned_params()}
    saved = inner["param_groups"]
    groups: list[dict[str, Any]] = []
    index = 0
    for gi, group in enumerate(engine.host_optimizer.optimizer.param_groups):
        ids = []
        for master in group["params"]:
            entry = per_param(names.of(owner[id(master)].param))
            if entry is not None:
                state[index] = entry
            ids.append(index)
            index += 1
        # DeepSpeed has one flat group per param group (ZeRO-3 sub-groups share the settings).
        groups.append({**saved[min(gi, len(saved) - 1)], "params": ids})
    return groups


def _split_flat(
    param_shapes: list[Mapping[str, Any]],
    flats: list[torch.Tensor],
    paddings: list[list[int]] | None,
    *,
    stage: int,
) -> OrderedDict[str, torch.Tensor]:
    """name -> fp32 tensor from flat groups, following zero_to_fp32's reconstruction (dp = 1)."""
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    if stage >= 3 and len(param_shapes) != len(flats):
        # ZeRO-3 sub-groups need not match the shape groups: read them as one sequence.
        flats = [torch.cat([f.reshape(-1) for f in flats])] if flats else []
        merged: OrderedDict[str, Any] = OrderedDict()
        for shapes in param_shapes:
            merged.update(shapes)
        param_shapes = [merged]
    if len(param_shapes) != len(flats):
        raise RuntimeError(
            f"checkpoint has {len(flats)} flat fp32 groups but {len(param_shapes)} param_shapes "
            "groups; it was not written by one process"
        )
    for gi, (shapes, flat) in enumerate(zip(param_shapes, flats, strict=True)):
        offset = 0
        pads = paddings[gi] if paddings is not None and stage < 3 else None
        for pi, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            out[name] = flat.narrow(0, offset, numel).view(tuple(shape))
            offset += numel + (pads[pi] if pads else 0)
        if offset > flat.numel():
            raise RuntimeError(f"flat fp32 group {gi} is shorter than its param_shapes")
    return out


def _materialize(state: Any) -> Any:
    """Copy tensors out of the memory-mapped file (optimizer state must not stay file-backed)."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _materialize(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_materialize(v) for v in state]
    return state


def _scaler_dict(saved: Any, scaler: Any) -> dict[str, Any]:
    """A loss-scaler dict for ``scaler``; DeepSpeed's own files pickle a LossScaler object."""
    raw = saved if isinstance(saved, Mapping) else vars(saved)
    known = set(vars(scaler))
    return {k: v for k, v in raw.items() if k in known}
