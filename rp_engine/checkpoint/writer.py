"""Writing a checkpoint in DeepSpeed's ZeRO layout (``save``) and the 16-bit model file
(``save_16bit``).

The model-states file (module, buffers, frozen parameters, counters, LR scheduler, config) and
the optim-states file (DeepSpeed's flat fp32 partitions, the inner optimizer's state in that
flat form, DeepSpeed's loss-scaler object), as the package docstring lays them out; the folder
is committed atomically by commit.py.

The big tensors are never built whole: the flat partitions and moments, and compute weights the
NVMe parameter tier holds, are deferred tensors (streamed.py) filled one parameter at a time
while the file is written, each with its layer resident (``store.reading``: a read into the
tiers' buffer pools; nothing with the state in RAM). RAM used by a save is one layer's state,
whatever the model's size.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from rp_engine.checkpoint.commit import (
    _atomic_torch_save,
    _commit_folder,
    _copy_recovery_scripts,
    _write_atomic,
)
from rp_engine.checkpoint.layout import (
    _BASE_OPTIMIZER_STATE,
    _CLIP_GRAD,
    _FP32_FLAT_GROUPS,
    _GROUP_PADDINGS,
    _LOSS_SCALER,
    _OPTIMIZER_STATE_DICT,
    _OWN_KEYS,
    _PARAM_ALIGNMENT_PADDINGS,
    _PARTITION_COUNT,
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
from rp_engine.checkpoint.streamed import Sink, StreamedSave

__all__ = ["save", "save_16bit"]

log = logging.getLogger("rp_engine.checkpoint")


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
    streamed = StreamedSave()
    model_state = _model_states(
        engine, names, groups, units, streamed, stage=stage, exclude_frozen=exclude_frozen
    )
    model_state.update(client_state)
    files: dict[str, Any] = {model_file_name(stage): model_state}
    if has_optimizer_state(engine):  # a forward-only engine's has none (nor DeepSpeed's)
        files[optim_file_name(bf16=cfg.bf16.enabled)] = _optim_states(
            engine, units, streamed, stage=stage
        )

    os.makedirs(save_dir, exist_ok=True)
    _commit_folder(save_dir, tag, files, streamed)
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


class _Group:
    """One optimizer param group: root names, the fp32 masters and their owning layers, in the
    group's order."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.masters: list[torch.Tensor] = []
        self.params: list[nn.Parameter] = []
        self.layers: list[int] = []


def _optimized_groups(engine: Any, names: _ParamNames) -> list[_Group]:
    """Masters per inner-optimizer group, named. Zero-element parameters are left out, as
    DeepSpeed does (they are recorded with the frozen ones, keeping their shape)."""
    if not has_optimizer_state(engine):
        return []
    owner = {id(hp.master): hp for hp in engine.store.owned_params()}
    groups = []
    for group in engine.host_optimizer.optimizer.param_groups:
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
            g.layers.append(hp.layer)
        groups.append(g)
    return groups


def _model_states(
    engine: Any,
    names: _ParamNames,
    groups: list[_Group],
    units: list[_FlatUnit],
    streamed: StreamedSave,
    *,
    stage: int,
    exclude_frozen: bool,
) -> dict[str, Any]:
    module = engine.module
    store = engine.store
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
        t = _weight(store, streamed, p, name)
        frozen_fragments[name] = t.reshape(-1) if stage >= 3 else t
    if stage >= 3:
        # DeepSpeed ZeRO-3's module holds a 0-element tensor per (partitioned) parameter: its
        # loader copies the state_dict into parameters of shape [0], then fills them from the
        # fp32 partitions (trained) or frozen_param_fragments (frozen).
        for key in [n for n, _ in names.params] + list(names.shared):
            if key in state:
                state[key] = torch.empty(0, dtype=state[key].dtype)
    else:  # full tensors: a weight the parameter tier holds is read layer by layer
        for name, p in names.params:
            if name in state and store.paged_layer(p) is not None:
                state[name] = _weight(store, streamed, p, name)
    scheduler = engine.lr_scheduler
    return {
        "module": _compact(state),
        "buffer_names": _buffer_names(module),
        # DeepSpeed's stage-0 fp32 engine reads its (plain torch) optimizer from here; ZeRO
        # stages keep it in the optim-states file.
        "optimizer": engine.host_optimizer.state_dict() if _plain_stage0(engine) else None,
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
        has_optimizer_state(engine)
        and int(cfg.zero.stage) == 0
        and not cfg.fp16.enabled
        and not cfg.bf16.enabled
    )


def _weight(store: Any, streamed: StreamedSave, p: torch.Tensor, name: str) -> torch.Tensor:
    """``p``'s values for the file: itself when in RAM, a deferred tensor read layer by layer
    when the NVMe parameter tier holds it."""
    layer = store.paged_layer(p)
    if layer is None:
        return p.detach().cpu()

    def fill(sink: Sink) -> None:
        with store.reading(layer):
            sink.write(p)

    return streamed.deferred(p.shape, p.dtype, fill, what=name)


class _FlatUnit:
    """One flat fp32 partition as DeepSpeed lays it out at dp = 1: ZeRO-1/2 one per param group
    (``single_partition_of_fp32_groups``), ZeRO-3 one per sub-group (``fp32_flat_groups``).

    ``params`` holds (name, master, padding after it), ``layers`` each one's owning layer;
    ``tail`` pads the partition that the inner optimizer steps (Adam's moments have that size)
    beyond the saved fp32 tensor.
    """

    def __init__(self, group: int) -> None:
        self.group = group
        self.params: list[tuple[str, torch.Tensor, int]] = []
        self.layers: list[int] = []
        self.tail = 0

    def flat(
        self,
        engine: Any,
        streamed: StreamedSave,
        value: Callable[[torch.Tensor], torch.Tensor | None],
        *,
        with_tail: bool,
        what: str,
    ) -> torch.Tensor:
        """The unit's flat fp32 tensor of ``value(master)`` per param (None: zeros) with this
        unit's paddings, deferred: each value is read with its layer resident while the file
        is written."""
        store = engine.store
        size = sum(m.numel() + pad for _, m, pad in self.params)
        size += self.tail if with_tail else 0

        def fill(sink: Sink) -> None:
            for (_, master, pad), layer in zip(self.params, self.layers, strict=True):
                with store.reading(layer):
                    t = value(master)
                    if t is None:
                        sink.zeros(4 * master.numel())
                    else:
                        sink.write(t.to(torch.float32))
                sink.zeros(4 * pad)
            if with_tail:
                sink.zeros(4 * self.tail)

        return streamed.deferred((size,), torch.float32, fill, what=what)


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
            for name, master, layer in zip(g.names, g.masters, g.layers, strict=True):
                unit.params.append((name, master, 0))
                unit.layers.append(layer)
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
            unit.layers.append(g.layers[pi])
        unit.tail = (-offset) % _NCCL_START_ALIGNMENT
        units.append(unit)
    return units


def _optim_states(
    engine: Any, units: list[_FlatUnit], streamed: StreamedSave, *, stage: int
) -> dict[str, Any]:
    """The ``*_optim_states.pt`` content in the form DeepSpeed's ZeRO optimizer of ``stage``
    reads back with ``load_state_dict`` (stage3.py ``_rigid_load_state_dict``,
    stage_1_and_2.py ``_load_legacy_checkpoint``): flat fp32 partitions, the inner optimizer's
    state as one flat parameter per partition, DeepSpeed's loss-scaler object."""
    opt = engine.host_optimizer
    scaler = opt.loss_scaler
    flats = [
        u.flat(engine, streamed, lambda m: m, with_tail=False, what=f"fp32 flat group {i}")
        for i, u in enumerate(units)
    ]
    common: dict[str, Any] = {
        _ZERO_STAGE: stage,
        _LOSS_SCALER: _deepspeed_loss_scaler(scaler, fp16=bool(engine._config.fp16.enabled)),
        "dynamic_loss_scale": bool(getattr(scaler, "dynamic", False)),
        "overflow": bool(opt.overflow),
        # rp_engine's own scaler state, exact (DeepSpeed's static scaler keeps the scale only).
        _RP_LOSS_SCALER: dict(scaler.state_dict()),
    }
    delay = getattr(engine.stepper, "delay", None)
    if delay is not None:  # "lookahead_dc": each tensor's scale for its next step
        common[_RP_DELAY_COMPENSATION] = {
            name: scale
            for u in units
            for name, master, _ in u.params
            if (scale := delay.scale(master)) is not None
        }
    inner = _flat_optimizer_state(engine, units, streamed)
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


def _flat_optimizer_state(
    engine: Any, units: list[_FlatUnit], streamed: StreamedSave
) -> dict[str, Any]:
    """The inner optimizer's state_dict as DeepSpeed's ZeRO optimizer holds it: one flat
    parameter per unit, numbered in order; per-parameter state tensors (Adam's moments) are
    flattened like the fp32 partition (padded to the stepped size), other entries (``step``)
    are shared by the unit's parameters and taken from the first one."""
    inner = engine.host_optimizer.optimizer
    saved_groups = engine.host_optimizer.state_dict()["param_groups"]
    state: dict[int, dict[str, Any]] = {}
    for index, unit in enumerate(units):
        per_param = [inner.state.get(m, {}) for _, m, _ in unit.params]
        first = next((st for st in per_param if st), None)
        if first is None:  # not stepped yet: DeepSpeed has no state either
            continue
        entry: dict[str, Any] = {}
        for key, value in first.items():
            if isinstance(value, torch.Tensor) and value.shape == unit.params[0][1].shape:
                # read inside the layer's residency: with the NVMe optimizer tier the state's
                # tensors are views of a pool buffer only then
                entry[key] = unit.flat(
                    engine, streamed, functools.partial(_state_of, inner, key), with_tail=True,
                    what=f"optimizer state {key!r} of flat group {index}",
                )  # fmt: skip
            else:
                _check_shared(key, value, per_param, unit)
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
        state[index] = entry
    groups = []
    for gi, hyper in enumerate(saved_groups):
        ids = [i for i, u in enumerate(units) if u.group == gi]
        groups.append({**{k: v for k, v in hyper.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def _state_of(inner: Any, key: str, master: torch.Tensor) -> torch.Tensor | None:
    return inner.state.get(master, {}).get(key)


def _check_shared(key: str, value: Any, per_param: list[dict[str, Any]], unit: _FlatUnit) -> None:
    # A flat partition has one value of `step` etc.; rp_engine steps all parameters together,
    # so they agree unless a parameter never received a gradient (an unused layer, a frozen
    # branch): DeepSpeed's flat group has one value for them all and says nothing, so neither
    # does rp_engine at its default level (debug: the value kept is the first parameter's).
    differ = [
        name
        for st, (name, _, _) in zip(per_param, unit.params, strict=True)
        if key in st and not _same(st[key], value)
    ]
    missing = [n for st, (n, _, _) in zip(per_param, unit.params, strict=True) if not st]
    if differ or missing:
        log.debug(
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
    pickled object as they find it). One of the classes :mod:`rp_engine.checkpoint.safe_load`
    allows."""
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
