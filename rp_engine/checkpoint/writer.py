"""Checkpoints in DeepSpeed's ZeRO layout, plus the training data loader helpers.

Owns ``save`` / ``load`` (``engine.save_checkpoint`` / ``load_checkpoint``), ``save_16bit``
(``save_16bit_model``), ``build_dataloader`` and ``repeat`` (DeepSpeed's ``deepspeed_io`` and
``RepeatingLoader`` for one process). The layout is what users' tools glob for::

    save_dir/
      latest                                        text: the tag (default global_step{N})
      zero_to_fp32.py, zero_to_torch.py             copied from the installed DeepSpeed
      <tag>/
        mp_rank_00_model_states.pt                  ZeRO stage 0-2
        zero_pp_rank_0_mp_rank_00_model_states.pt   ZeRO stage 3
        [bf16_]zero_pp_rank_0_mp_rank_00_optim_states.pt

so ``deepspeed.utils.zero_to_fp32``, Hugging Face's resume (``global_step*``) and DeepSpeed's own
``engine.load_checkpoint`` (ZeRO 1-3 and fp32 stage 0, with optimizer states; tests/
test_checkpoint_interop.py)
work unchanged. The files are what DeepSpeed's engine of the configured stage writes at data-
parallel world size 1 (recorded as ``dp_world_size``):

- ``*_optim_states.pt``: the fp32 masters as DeepSpeed's flat partitions (ZeRO-1/2: one per param
  group, ``single_partition_of_fp32_groups`` with ``group_paddings`` / ``param_alignment_
  paddings``; ZeRO-3: one per sub-group of ``sub_group_size``, ``fp32_flat_groups``), the inner
  optimizer's state_dict with one flat parameter per partition (Adam's moments flattened alike,
  ``step`` per partition), DeepSpeed's loss-scaler object and, for rp_engine, its own full
  scaler state (``rp_loss_scaler``).
- ZeRO-3's ``module`` holds 0-element placeholders for the parameters, as DeepSpeed's (its loader
  copies the state_dict into partitioned parameters of shape [0]); weights come back from the
  optim file (also for ``load_module_only``) or ``frozen_param_fragments``. Stage 0-2 ``module``
  holds the full compute-dtype state_dict.
- Stage 0 fp32: the optimizer's per-parameter state_dict is in the model file's ``optimizer``
  (where DeepSpeed's stage-0 engine reads it); the optim file still holds the fp32 masters
  (zero_to_fp32 reads them) but no optimizer state (not twice). Otherwise ``optimizer`` is None.

Choices where DeepSpeed's own output would be less useful:

- The fp32 masters always go to a ``*_optim_states.pt`` file, also at stage 0 (DeepSpeed writes
  none there, and zero_to_fp32 cannot read such a checkpoint). Stage 0 with fp16/bf16 keeps the
  ZeRO-1 layout (DeepSpeed's FP16_Optimizer / BF16_Optimizer layouts are not written).
- Frozen parameters are recorded (``frozen_param_shapes`` / ``frozen_param_fragments``) at every
  stage, not only from stage 2, so zero_to_fp32 returns them too (in the compute dtype).
- ``param_slice_mappings`` (for DeepSpeed's universal-checkpoint converter) is not written.
- Files load with ``torch.load(weights_only=True)`` plus the DeepSpeed classes allowed by
  :mod:`rp_engine.checkpoint.safe_load` (the optim file pickles DeepSpeed's ``LossScaler`` /
  ``DynamicLossScaler``, which DeepSpeed's optimizers use as they find them). Loading never runs
  code from a file; anything beyond the allowlist needs the caller's opt-in.

Writes are atomic: files go to ``save_dir/.<tag>.tmp-<pid>``, are fsynced, and the folder is renamed
to ``<tag>``; ``latest`` is replaced last. A crash leaves the previous checkpoint and ``latest``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib.metadata
import importlib.util
import logging
import math
import os
import re
import shutil
import stat
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from rp_engine.checkpoint import checks as checkpoint_checks
from rp_engine.checkpoint import safe_load

__all__ = [
    "save",
    "load",
    "save_16bit",
    "model_file_name",
    "optim_file_name",
]

log = logging.getLogger("rp_engine.checkpoint")

# DeepSpeed's key names (deepspeed/checkpoint/constants.py), spelled out so that importing this
# module does not import DeepSpeed.
_OPTIMIZER_STATE_DICT = "optimizer_state_dict"
_BASE_OPTIMIZER_STATE = "base_optimizer_state"
_SINGLE_PARTITION = "single_partition_of_fp32_groups"
_FP32_FLAT_GROUPS = "fp32_flat_groups"
_ZERO_STAGE = "zero_stage"
_PARTITION_COUNT = "partition_count"
_GROUP_PADDINGS = "group_paddings"
_PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"
_LOSS_SCALER = "loss_scaler"
_CLIP_GRAD = "clip_grad"
# Not DeepSpeed's: rp_engine's full loss-scaler state, next to DeepSpeed's scaler object.
_RP_LOSS_SCALER = "rp_loss_scaler"
# Not DeepSpeed's: the data-parallel world that trained and its shard layout (layer owners).
# DeepSpeed's own ``dp_world_size`` keeps its meaning for its loaders: the number of optimizer
# partition files, always 1 here (rank 0 writes the whole state, which loads at any world size).
_RP_DATA_PARALLEL = "rp_data_parallel"

# Top-level keys of the model-states file that belong to DeepSpeed (never client state).
_OWN_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "frozen_param_fragments",
        "shared_params",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "ds_config",
        "ds_version",
        "checkpoint_parallel_dimensions",
        _RP_DATA_PARALLEL,
    }
)
_RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


# --- file names --------------------------------------------------------------------------------
def model_file_name(zero_stage: int) -> str:
    """DeepSpeed's model-states file name (stage 3 names it like a ZeRO partition)."""
    if zero_stage >= 3:
        return "zero_pp_rank_0_mp_rank_00_model_states.pt"
    return "mp_rank_00_model_states.pt"


def optim_file_name(*, bf16: bool) -> str:
    """DeepSpeed's optimizer-states file name (``bf16_`` prefix when bf16 is enabled)."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_0_mp_rank_00_optim_states.pt"


# --- save --------------------------------------------------------------------------------------
def save(
    engine: Any,
    save_dir: str | os.PathLike[str],
    *,
    tag: str | None,
    client_state: Mapping[str, Any],
    save_latest: bool,
    exclude_frozen: bool = False,
) -> None:
    """Write a checkpoint of ``engine`` (already synchronized: module weights are the newest).

    ``engine`` is a RoundPipeEngine (duck-typed): ``module``, ``store``, ``optimizer``,
    ``lr_scheduler``, counters and ``_config`` are read. ``exclude_frozen``
    (``exclude_frozen_parameters``) leaves frozen weights out, as DeepSpeed: a LoRA checkpoint
    then holds the adapters only and loads with ``load_module_strict=False``.
    """
    save_dir = os.fspath(save_dir)
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty path, got {save_dir!r}")
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    _check_tag(tag)
    clash = sorted(set(client_state) & _OWN_KEYS)
    if clash:
        raise ValueError(
            f"client_state key(s) {clash} would overwrite DeepSpeed's own checkpoint entries; "
            "rename them"
        )
    cfg = engine._config
    stage = int(cfg.zero.stage)
    names = _ParamNames(engine.module)
    groups = _optimized_groups(engine, names)
    units = _flat_units(engine, groups, stage=stage)
    model_state = _model_states(
        engine, names, groups, units, stage=stage, exclude_frozen=exclude_frozen
    )
    model_state.update(client_state)
    files: dict[str, Any] = {model_file_name(stage): model_state}
    if engine.optimizer is not None:
        files[optim_file_name(bf16=cfg.bf16.enabled)] = _optim_states(engine, units, stage=stage)

    os.makedirs(save_dir, exist_ok=True)
    _commit_folder(save_dir, tag, files)
    try:
        _copy_recovery_scripts(save_dir)
    except OSError as exc:  # a convenience copy must not keep `latest` from moving on
        log.warning("could not copy zero_to_fp32.py into %s: %s", save_dir, exc)
    if save_latest:
        _write_atomic(os.path.join(save_dir, "latest"), tag.encode())
    log.info("saved checkpoint %s", os.path.join(save_dir, tag))


def _check_tag(tag: str) -> None:
    # Tags become one folder name; separators would break the atomic rename.
    if not tag or tag in {".", ".."} or "/" in tag or os.sep in tag or tag.startswith("."):
        raise ValueError(
            f"checkpoint tag {tag!r} must be a plain folder name (no path separators, not "
            "starting with '.'), e.g. 'global_step100'"
        )


class _ParamNames:
    """Root names of a module's parameters by identity, and tied aliases (DeepSpeed's
    ``shared_params``: alias name -> name of the first occurrence, which holds the data)."""

    def __init__(self, module: nn.Module) -> None:
        self.primary: dict[int, str] = {}
        self.shared: dict[str, str] = {}
        self.params: list[tuple[str, nn.Parameter]] = []
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in self.primary:
                self.shared[name] = self.primary[id(p)]
            else:
                self.primary[id(p)] = name
                self.params.append((name, p))

    def of(self, param: torch.Tensor) -> str:
        try:
            return self.primary[id(param)]
        except KeyError:
            raise ValueError(
                f"an optimized parameter of shape {tuple(param.shape)} is not a parameter of "
                "engine.module; it cannot be named in the checkpoint"
            ) from None


class _Group:
    """One optimizer param group: root names and the fp32 masters, in the group's order."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.masters: list[torch.Tensor] = []
        self.params: list[nn.Parameter] = []


def _optimized_groups(engine: Any, names: _ParamNames) -> list[_Group]:
    """Masters per inner-optimizer group, named. Zero-element parameters are left out, as
    DeepSpeed does (they are recorded with the frozen ones, keeping their shape)."""
    if engine.optimizer is None:
        return []
    owner = {id(hp.master): hp for hp in engine.store.owned_params()}
    groups = []
    for group in engine.optimizer.optimizer.param_groups:
        g = _Group()
        for master in group["params"]:
            hp = owner.get(id(master))
            if hp is None:
                raise ValueError(
                    "the optimizer holds a tensor that is not an fp32 master of engine.store "
                    f"(shape {tuple(master.shape)}); cannot checkpoint it"
                )
            if master.numel() == 0:
                continue
            g.names.append(names.of(hp.param))
            g.masters.append(master)
            g.params.append(hp.param)
        groups.append(g)
    return groups


def _model_states(
    engine: Any,
    names: _ParamNames,
    groups: list[_Group],
    units: list[_FlatUnit],
    *,
    stage: int,
    exclude_frozen: bool,
) -> dict[str, Any]:
    module = engine.module
    optimized = {id(p) for g in groups for p in g.params}
    frozen_shapes: OrderedDict[str, torch.Size] = OrderedDict()
    frozen_fragments: OrderedDict[str, torch.Tensor] = OrderedDict()
    state = module.state_dict()
    for name, p in names.params:
        if id(p) in optimized:
            continue
        if exclude_frozen:
            if not p.requires_grad:  # DeepSpeed's module_state_dict(exclude_frozen_parameters)
                for key in [name, *(a for a, primary in names.shared.items() if primary == name)]:
                    state.pop(key, None)
            continue
        frozen_shapes[name] = p.shape
        # zero_to_fp32 concatenates ZeRO-3 fragments along dim 0 (they are flat partitions);
        # stage <= 2 fragments are used as they are.
        t = p.detach().cpu()
        frozen_fragments[name] = t.reshape(-1) if stage >= 3 else t
    if stage >= 3:
        # DeepSpeed ZeRO-3's module holds a 0-element tensor per (partitioned) parameter: its
        # loader copies the state_dict into parameters of shape [0], then fills them from the
        # fp32 partitions (trained) or frozen_param_fragments (frozen).
        for key in [n for n, _ in names.params] + list(names.shared):
            if key in state:
                state[key] = torch.empty(0, dtype=state[key].dtype)
    scheduler = engine.lr_scheduler
    return {
        "module": _compact(state),
        "buffer_names": _buffer_names(module),
        # DeepSpeed's stage-0 fp32 engine reads its (plain torch) optimizer from here; ZeRO
        # stages keep it in the optim-states file.
        "optimizer": engine.optimizer.state_dict() if _plain_stage0(engine) else None,
        # DeepSpeed records one entry per flat fp32 group (ZeRO-3: per sub-group).
        "param_shapes": [OrderedDict((n, m.shape) for n, m, _ in unit.params) for unit in units],
        "frozen_param_shapes": None if exclude_frozen else frozen_shapes,
        "frozen_param_fragments": None if exclude_frozen else _compact(frozen_fragments),
        "shared_params": dict(names.shared),
        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": int(engine.skipped_steps),
        "global_steps": int(engine.global_steps),
        "global_samples": int(engine.global_samples),
        "dp_world_size": 1,
        "mp_world_size": 1,
        _RP_DATA_PARALLEL: _dp_layout(engine),
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": _plain(engine._config.raw),
        "ds_version": _ds_version(),
    }


def _dp_layout(engine: Any) -> dict[str, Any]:
    """The data-parallel world size and the owner rank of each layer's optimizer state."""
    dp = getattr(engine.stepper, "dp", None)
    if dp is not None:
        return dict(dp.layout())
    layers = len(engine.store.layers)
    return {"scheme": "layer_owner", "dp_world_size": 1, "owners": [0] * layers}


def _plain_stage0(engine: Any) -> bool:
    """ZeRO stage 0 without fp16/bf16: DeepSpeed steps the user's optimizer on the module's own
    parameters and saves its per-parameter state_dict in the model file (``optimizer``)."""
    cfg = engine._config
    return (
        engine.optimizer is not None
        and int(cfg.zero.stage) == 0
        and not cfg.fp16.enabled
        and not cfg.bf16.enabled
    )


class _FlatUnit:
    """One flat fp32 partition as DeepSpeed lays it out at dp = 1: ZeRO-1/2 one per param group
    (``single_partition_of_fp32_groups``), ZeRO-3 one per sub-group (``fp32_flat_groups``).

    ``params`` holds (name, master, padding after it); ``tail`` pads the partition that the inner
    optimizer steps (Adam's moments have that size) beyond the saved fp32 tensor.
    """

    def __init__(self, group: int) -> None:
        self.group = group
        self.params: list[tuple[str, torch.Tensor, int]] = []
        self.tail = 0

    def flat(self, tensors: list[torch.Tensor], *, with_tail: bool) -> torch.Tensor:
        """``tensors`` (one per param, shaped like it) flattened with this unit's paddings."""
        parts: list[torch.Tensor] = []
        for t, (_, _, pad) in zip(tensors, self.params, strict=True):
            parts.append(t.detach().reshape(-1).float())
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.float32))
        if with_tail and self.tail:
            parts.append(torch.zeros(self.tail, dtype=torch.float32))
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32)


# DeepSpeed ZeRO-1/2 aligns each flat group to nccl_start_alignment_factor x dp elements
# (stage_1_and_2.py: 4-byte alignment / sizeof(fp16) = 2).
_NCCL_START_ALIGNMENT = 2


def _flat_units(engine: Any, groups: list[_Group], *, stage: int) -> list[_FlatUnit]:
    """DeepSpeed's flat partitions for ``groups`` at dp = 1 (see _FlatUnit)."""
    units: list[_FlatUnit] = []
    if stage >= 3:
        # stage3.py _create_fp16_sub_groups: close a sub-group once it reaches sub_group_size.
        limit = int(engine._config.zero.sub_group_size)
        for gi, g in enumerate(groups):
            total = sum(m.numel() for m in g.masters)
            unit, size = _FlatUnit(gi), 0
            for name, master in zip(g.names, g.masters, strict=True):
                unit.params.append((name, master, 0))
                size += master.numel()
                if limit < total and size >= limit:
                    units.append(unit)
                    unit, size = _FlatUnit(gi), 0
            if unit.params or not g.masters:
                units.append(unit)
        return units
    zero_raw = engine._config.raw.get("zero_optimization") or {}
    aligned = bool(zero_raw.get("parameter_alignment", False))
    for gi, g in enumerate(groups):
        unit = _FlatUnit(gi)
        offset = 0
        for pi, (name, master) in enumerate(zip(g.names, g.masters, strict=True)):
            offset += master.numel()
            # stage_1_and_2.py: parameter_alignment pads every parameter but the last to 16
            # bytes of the compute dtype.
            element = g.params[pi].element_size()
            align = 16 // math.gcd(16, element) if aligned else 1
            pad = 0 if pi == len(g.masters) - 1 else (-offset) % align
            offset += pad
            unit.params.append((name, master, pad))
        unit.tail = (-offset) % _NCCL_START_ALIGNMENT
        units.append(unit)
    return units


def _optim_states(engine: Any, units: list[_FlatUnit], *, stage: int) -> dict[str, Any]:
    """The ``*_optim_states.pt`` content in the form DeepSpeed's ZeRO optimizer of ``stage``
    reads back with ``load_state_dict`` (stage3.py ``_rigid_load_state_dict``,
    stage_1_and_2.py ``_load_legacy_checkpoint``): flat fp32 partitions, the inner optimizer's
    state as one flat parameter per partition, DeepSpeed's loss-scaler object."""
    opt = engine.optimizer
    scaler = opt.loss_scaler
    flats = [u.flat([m for _, m, _ in u.params], with_tail=False) for u in units]
    common: dict[str, Any] = {
        _ZERO_STAGE: stage,
        _LOSS_SCALER: _deepspeed_loss_scaler(scaler, fp16=bool(engine._config.fp16.enabled)),
        "dynamic_loss_scale": bool(getattr(scaler, "dynamic", False)),
        "overflow": bool(opt.overflow),
        # rp_engine's own scaler state, exact (DeepSpeed's static scaler keeps the scale only).
        _RP_LOSS_SCALER: dict(scaler.state_dict()),
    }
    inner = _flat_optimizer_state(engine, units)
    if _plain_stage0(engine):  # the state is in the model file (DeepSpeed's place): not twice
        inner = {"state": {}, "param_groups": inner["param_groups"]}
    if stage >= 3:
        # DeepSpeed ZeRO-3 (stage3.py _rigid_state_dict): partition_count is an int.
        osd = {
            **common,
            _PARTITION_COUNT: 1,
            _OPTIMIZER_STATE_DICT: inner,
            _FP32_FLAT_GROUPS: flats,
        }
    else:
        # DeepSpeed ZeRO-1/2 (stage_1_and_2.py state_dict): one partition per group, saved
        # without its tail padding; partition_count is a list per group.
        osd = {
            **common,
            _CLIP_GRAD: float(engine._config.gradient_clipping),
            _BASE_OPTIMIZER_STATE: inner,
            _SINGLE_PARTITION: flats,
            _GROUP_PADDINGS: [u.tail for u in units],
            _PARAM_ALIGNMENT_PADDINGS: [[pad for _, _, pad in u.params] for u in units],
            _PARTITION_COUNT: [1] * len(units),
            "ds_version": _ds_version(),
        }
    return {
        _OPTIMIZER_STATE_DICT: osd,
        "ds_config": _plain(engine._config.raw),
        "ds_version": _ds_version(),
    }


def _flat_optimizer_state(engine: Any, units: list[_FlatUnit]) -> dict[str, Any]:
    """The inner optimizer's state_dict as DeepSpeed's ZeRO optimizer holds it: one flat
    parameter per unit, numbered in order; per-parameter state tensors (Adam's moments) are
    flattened like the fp32 partition (padded to the stepped size), other entries (``step``)
    are shared by the unit's parameters and taken from the first one."""
    inner = engine.optimizer.optimizer
    saved_groups = engine.optimizer.state_dict()["param_groups"]
    state: dict[int, dict[str, Any]] = {}
    for index, unit in enumerate(units):
        per_param = [inner.state.get(m, {}) for _, m, _ in unit.params]
        first = next((st for st in per_param if st), None)
        if first is None:  # not stepped yet: DeepSpeed has no state either
            continue
        entry: dict[str, Any] = {}
        for key, value in first.items():
            if isinstance(value, torch.Tensor) and value.shape == unit.params[0][1].shape:
                tensors = [
                    st[key] if key in st else torch.zeros_like(m)
                    for st, (_, m, _) in zip(per_param, unit.params, strict=True)
                ]
                entry[key] = unit.flat(tensors, with_tail=True)
            else:
                _check_shared(key, value, per_param, unit)
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
        state[index] = entry
    groups = []
    for gi, hyper in enumerate(saved_groups):
        ids = [i for i, u in enumerate(units) if u.group == gi]
        groups.append({**{k: v for k, v in hyper.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def _check_shared(key: str, value: Any, per_param: list[dict[str, Any]], unit: _FlatUnit) -> None:
    # A flat partition has one value of `step` etc.; rp_engine steps all parameters together,
    # so they agree unless a parameter never received a gradient.
    differ = [
        name
        for st, (name, _, _) in zip(per_param, unit.params, strict=True)
        if key in st and not _same(st[key], value)
    ]
    missing = [n for st, (n, _, _) in zip(per_param, unit.params, strict=True) if not st]
    if differ or missing:
        log.warning(
            "optimizer state %r differs across the parameters of one flat group (%s) or is "
            "missing (%s); the checkpoint keeps the first parameter's value for all of them",
            key,
            differ[:3],
            missing[:3],
        )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return bool(torch.equal(torch.as_tensor(a), torch.as_tensor(b)))
    return bool(a == b)


def _deepspeed_loss_scaler(scaler: Any, *, fp16: bool) -> Any:
    """DeepSpeed's loss-scaler object for rp_engine's ``scaler`` (its ZeRO optimizers assign the
    pickled object as they find it). One of the classes :mod:`rp_engine.checkpoint.safe_load` allows."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    if not (fp16 and scaler.dynamic):
        return LossScaler(scale=float(scaler.cur_scale) if fp16 else 1.0)
    ds = DynamicLossScaler(
        init_scale=float(scaler.cur_scale),
        scale_window=int(scaler.scale_window),
        min_scale=float(scaler.min_scale),
        delayed_shift=int(scaler.delayed_shift),
        consecutive_hysteresis=bool(scaler.consecutive_hysteresis),
        raise_error_at_min_scale=True,  # as rp_engine, which raises at the minimum scale
        dtype=torch.float16,
    )
    ds.cur_iter = int(scaler.cur_iter)
    ds.last_overflow_iter = int(scaler.last_overflow_iter)
    ds.cur_hysteresis = int(scaler.cur_hysteresis)
    return ds


def _buffer_names(module: nn.Module) -> list[str]:
    """Persistent buffers by root name (DeepSpeed's ``_get_buffer_names``)."""
    out: list[str] = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                out.append(f"{prefix}.{name}" if prefix else name)
    return out


def _compact(state: Mapping[str, torch.Tensor]) -> OrderedDict[str, torch.Tensor]:
    """Copy tensors that are views into a larger storage (torch.save would write the whole
    storage); tensors sharing one exact view (tied weights) stay shared."""
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    seen: dict[tuple[Any, ...], torch.Tensor] = {}
    for key, t in state.items():
        nbytes = t.numel() * t.element_size()
        if t.untyped_storage().nbytes() <= nbytes:
            out[key] = t
            continue
        view = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if view not in seen:
            seen[view] = t.clone()
        out[key] = seen[view]
    return out


def _plain(value: Any) -> Any:
    """The config as plain dicts/lists (weights_only-loadable, like json)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _ds_version() -> str:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - deepspeed is a dependency
        return "0.0.0"


# --- atomic writes -----------------------------------------------------------------------------
def _commit_folder(save_dir: str, tag: str, files: Mapping[str, Any]) -> None:
    """Write ``files`` (name -> object) into ``save_dir/<tag>`` all-or-nothing."""
    final = os.path.join(save_dir, tag)
    tmp = os.path.join(save_dir, f".{tag}.tmp-{os.getpid()}")
    old = os.path.join(save_dir, f".{tag}.old-{os.getpid()}")
    _recover_interrupted(save_dir, remove_stale=True)
    try:
        os.makedirs(tmp)
        for name, obj in files.items():
            with open(os.path.join(tmp, name), "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        if os.path.isdir(final):
            # Two renames: between them no folder named <tag> exists; a crash right there leaves
            # the old one as .<tag>.old-<pid>, which the next save or load renames back.
            os.rename(final, old)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(save_dir)
    shutil.rmtree(old, ignore_errors=True)


_ASIDE = re.compile(r"^\.(?P<tag>.+)\.(?P<kind>old|tmp)-(?P<pid>\d+)$")


def _recover_interrupted(folder: str, *, remove_stale: bool) -> None:
    """Undo what a save killed mid-way left behind: a tag folder renamed aside but not replaced
    (``.<tag>.old-<pid>`` without ``<tag>``) is renamed back; with ``remove_stale``, half-written
    folders and replaced old folders of processes no longer running are deleted."""
    for name in _listdir(folder):
        m = _ASIDE.match(name)
        if m is None:
            continue
        path, final = os.path.join(folder, name), os.path.join(folder, m["tag"])
        if m["kind"] == "old" and not os.path.exists(final):
            log.warning("restoring checkpoint %s from an interrupted save (%s)", final, name)
            os.rename(path, final)
        elif remove_stale and (int(m["pid"]) == os.getpid() or not _pid_alive(int(m["pid"]))):
            shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but belongs to someone else, or the platform cannot tell
        return True
    return True


def _write_atomic(path: str, data: bytes) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(path) or ".")


def _atomic_torch_save(obj: Any, path: str) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(path) or ".")


def _fsync_dir(path: str) -> None:
    # Makes the renames durable; not every platform/filesystem lets a directory be opened.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _copy_recovery_scripts(save_dir: str) -> None:
    """Copy DeepSpeed's zero_to_fp32.py (and zero_to_torch.py) next to the tags, as DeepSpeed."""
    spec = importlib.util.find_spec("deepspeed")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        log.warning("deepspeed is not installed: zero_to_fp32.py not copied into %s", save_dir)
        return
    for script in _RECOVERY_SCRIPTS:
        src = os.path.join(locations[0], "utils", script)
        if not os.path.isfile(src):
            continue
        dst = os.path.join(save_dir, script)
        with open(src, "rb") as f:
            _write_atomic(dst, f.read())
        with contextlib.suppress(OSError):
            os.chmod(dst, os.stat(dst).st_mode | stat.S_IEXEC)


# --- load --------------------------------------------------------------------------------------
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
    ``weights_only=True`` (plus DeepSpeed's own classes, see :mod:`rp_engine.checkpoint.safe_load`); one
    holding any other Python global is refused before it is unpickled unless ``trust``
    (``load_checkpoint(trust_checkpoint=True)``).
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
    load_optimizer = optimizer_states and not module_only and engine.optimizer is not None
    placeholders = _zero3_placeholders(engine.module, ckpt)
    osd = None
    if load_optimizer or placeholders:
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


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


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
            engine.optimizer.load_state_dict(_materialize(inner))
        except (ValueError, KeyError) as exc:
            raise RuntimeError(
                f"the checkpoint's optimizer state does not fit this optimizer ({exc}); it was "
                "saved with other param groups or another optimizer type. Pass "
                "load_optimizer_states=False to load weights only"
            ) from exc
    scaler_state = osd.get(_RP_LOSS_SCALER, osd.get(_LOSS_SCALER))
    if scaler_state is not None:
        engine.optimizer.loss_scaler.load_state_dict(
            _scaler_dict(scaler_state, engine.optimizer.loss_scaler)
        )
    engine.optimizer.overflow = bool(osd.get("overflow", False))


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
    ``engine.optimizer``: state tensors the size of a flat partition (Adam's moments; ZeRO-1/2
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
    """``engine.optimizer``'s param groups in state_dict form (params numbered in order), with
    the saved hyper-parameters; ``state[index] = per_param(name)`` where that is not None."""
    names = _ParamNames(engine.module)
    owner = {id(hp.master): hp for hp in engine.store.owned_params()}
    saved = inner["param_groups"]
    groups: list[dict[str, Any]] = []
    index = 0
    for gi, group in enumerate(engine.optimizer.optimizer.param_groups):
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


# --- 16-bit weights ----------------------------------------------------------------------------
def save_16bit(
    engine: Any,
    save_dir: str | os.PathLike[str],
    save_filename: str,
    *,
    exclude_frozen: bool,
) -> bool:
    """``torch.save`` the module's state_dict in the compute dtype to ``save_dir/save_filename``.

    Always saves and returns True, also at ZeRO-3 without
    ``stage3_gather_16bit_weights_on_model_save`` (DeepSpeed then skips and returns False): the
    weights are never partitioned here, so there is nothing to gather.
    """
    save_dir = os.fspath(save_dir)
    os.makedirs(save_dir, exist_ok=True)
    state = engine.module.state_dict()
    if exclude_frozen:
        for name, p in engine.module.named_parameters(remove_duplicate=False):
            if not p.requires_grad:
                state.pop(name, None)
    path = os.path.join(save_dir, save_filename)
    _atomic_torch_save(_compact(state), path)
    log.info("saved 16-bit model weights to %s", path)
    return True
