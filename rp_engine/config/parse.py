"""Reading the raw ds_config dict into a ``DSConfig``: ``load_config``, the one reader.

Section by section: the batch-size triplet (inferred as DeepSpeed does), optimizer and scheduler
(DeepSpeed's names or torch classes, their parameters checked against the signatures),
zero_optimization (aliases, deprecated forms, removed keys), fp16/bf16, checkpoint, the
"roundpipe" section, and the top-level keys DeepSpeed reads or removed. The checks that span
keys (the batch triplet, fp16 with bf16, partial offload needs stage 3, the cut sums) are made
where their section is read.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import os
import re
import types
from collections.abc import Mapping
from typing import Any

from rp_engine.config.auto import _apply_auto_values, _find_autos
from rp_engine.config.errors import (
    ConfigError,
    _ConfigAssertError,
    _ConfigTypeError,
    _did_you_mean,
    _show,
    _type_error,
)
from rp_engine.config.fields import _as_section, _build, _coerce, _read, _Spec, _specs_of
from rp_engine.config.schema import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    CSVMonitorConfig,
    DSConfig,
    FP16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    RoundPipeConfig,
    SchedulerConfig,
    TensorBoardConfig,
    WandbConfig,
    ZeroConfig,
    _comet_specs,
    _comms_logger_specs,
    _zero_unused_specs,
)
from rp_engine.config.sources import _load_raw

# every config module logs as "rp_engine.config" (one logger for the config reader)
logger = logging.getLogger("rp_engine.config")

__all__ = ["DEEPSPEED_OPTIMIZERS", "DEEPSPEED_LR_SCHEDULES", "load_config"]

# Names DeepSpeed 0.19.8 lowercases (runtime/config.py DEEPSPEED_OPTIMIZERS); anything else must be
# a torch.optim class name, case-sensitive. The 1-bit optimizers were removed in 0.19.
DEEPSPEED_OPTIMIZERS: tuple[str, ...] = tuple(
    "adagrad adam adamw lamb muadam muadamw musgd lion muon".split()
)
# deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES (copied: importing deepspeed is slow).
DEEPSPEED_LR_SCHEDULES: tuple[str, ...] = (
    "LRRangeTest",
    "OneCycle",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
)

# Top-level keys DeepSpeed 0.19.8 reads. Keys outside this set (and "roundpipe") are ignored with
# a warning; keys inside it that rp_engine does not use are ignored quietly.
_DEEPSPEED_TOP_LEVEL_KEYS = frozenset(
    (
        "train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps "
        "managed_gradient_accumulation optimizer scheduler zero_allow_untested_optimizer "
        "zero_force_ds_cpu_optimizer steps_per_print fp16 bf16 bfloat16 torch_autocast "
        "gradient_clipping communication_data_type seq_parallel_communication_data_type "
        "prescale_gradients gradient_predivide_factor gradient_allreduce_op disable_allgather "
        "dump_state disable_python_gc vocabulary_size wall_clock_breakdown memory_breakdown "
        "zero_optimization activation_checkpointing comms_logger tensorboard wandb csv_monitor "
        "comet flops_profiler autotuning use_data_before_expert_parallelism hybrid_engine "
        "pipeline data_efficiency checkpoint data_types aio dataloader_drop_last log_level "
        "datastates_ckpt weight_quantization compile timers tensor_parallel expert_parallel "
        "sequence_parallel_size allgather_size"
    ).split()
)
# Keys DeepSpeed 0.19.8 rejects because the feature was removed (runtime/config.py).
_REMOVED_TOP_LEVEL_KEYS = types.MappingProxyType(
    {
        "nebula": "Nebula checkpointing was removed",
        "compression_training": "the DeepSpeed compression library was removed",
        "amp": "NVIDIA Apex AMP was removed; use 'fp16' or 'bf16'",
        "quantize_training": "Mixture-of-Quantization (quantize_training) was removed",
        "sparse_gradients": "sparse embedding gradient compression was removed",
        "eigenvalue": "eigenvalue-based Mixture-of-Quantization was removed",
        "sparse_attention": "DeepSpeed Sparse Attention was removed",
        "elasticity": "elastic training was removed; set the batch sizes directly",
        "graph_harvesting": "graph harvesting was removed",
        "curriculum_learning": "top-level curriculum_learning was removed "
        "(DeepSpeed moved it to data_efficiency.data_sampling.curriculum_learning)",
        "progressive_layer_drop": "Progressive Layer Dropping was removed",
    }
)
_REMOVED_ZERO_KEYS = types.MappingProxyType(
    {
        "mics_shard_size": "MiCS ZeRO-3 sharding was removed",
        "mics_hierarchical_params_gather": "MiCS ZeRO-3 sharding was removed",
        "zeropp_loco_param": "LoCo-Zero++ was removed",
    }
)


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


def _parse_batch(raw: Mapping[str, Any], world_size: int) -> tuple[int, int, int]:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    spec = _Spec(int, optional=True)
    tbs, mbs, gas = (_coerce(raw.get(k), k, spec) for k in keys)
    for key, value in zip(keys, (tbs, mbs, gas), strict=True):
        if value is not None and value <= 0:  # DeepSpeed asserts it (_batch_assertion)
            raise _ConfigAssertError(f"{key} = {value} is not valid: expected an integer > 0")
    ws = world_size
    inferred = ""
    if tbs is not None and mbs is not None and gas is not None:
        pass
    elif tbs is not None and mbs is not None:
        gas = tbs // mbs // ws
        inferred = f"gradient_accumulation_steps = {tbs} // {mbs} // {ws} = {gas}"
    elif tbs is not None and gas is not None:
        mbs = tbs // ws // gas
        inferred = f"train_micro_batch_size_per_gpu = {tbs} // {ws} // {gas} = {mbs}"
    elif mbs is not None and gas is not None:
        tbs = mbs * gas * ws
    elif tbs is not None:
        gas, mbs = 1, tbs // ws
        inferred = f"train_micro_batch_size_per_gpu = {tbs} // {ws} = {mbs}"
    elif mbs is not None:
        tbs, gas = mbs * ws, 1
    else:
        raise _ConfigAssertError(
            "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided "
            "(gradient_accumulation_steps alone is not enough): set "
            "train_micro_batch_size_per_gpu (samples per device per step) in the config"
        )
    assert tbs is not None and mbs is not None and gas is not None
    why = f" (inferred: {inferred} with world_size {ws})" if inferred else ""
    for key, value in zip(keys, (tbs, mbs, gas), strict=True):
        if value <= 0:
            raise _ConfigAssertError(
                f"{key} = {value}: has to be greater than 0{why}; choose values with "
                "train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps "
                "* world_size, all three > 0"
            )
    if tbs != mbs * gas * ws:
        raise _ConfigAssertError(
            "Check batch related parameters: train_batch_size is not equal to "
            "train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size: "
            f"{tbs} != {mbs} * {gas} * {ws}{why}. Set train_batch_size = {mbs * gas * ws}, or "
            "give only two of the three values and let the third be inferred"
        )
    return tbs, mbs, gas


def _torch_optimizers() -> dict[str, type]:
    import torch.optim  # lazy: keeps `import rp_engine.config` cheap

    base = torch.optim.Optimizer
    return {
        n: c
        for n in dir(torch.optim)
        if isinstance(c := getattr(torch.optim, n), type) and issubclass(c, base) and c is not base
    }


def _torch_lr_schedulers() -> dict[str, type]:
    import torch.optim.lr_scheduler as sched

    base = sched.LRScheduler
    return {
        n: c
        for n in dir(sched)
        if not n.startswith("_")
        and isinstance(c := getattr(sched, n), type)
        and issubclass(c, base)
        and c is not base
    }


def _check_signature(cls: type, params: Mapping[str, Any], path: str, skip_first: str) -> None:
    """Reject params the class cannot take (DeepSpeed would raise TypeError on construction)."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):  # pragma: no cover - builtin without a signature
        return
    accepted = [p for p in sig.parameters.values() if p.name != skip_first]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted):
        return
    names = [p.name for p in accepted if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    for key in params:
        if key not in names:
            raise _ConfigTypeError(
                f"{path}.params.{key}: {cls.__name__} has no parameter {key!r}"
                f"{_did_you_mean(key, names)}. Valid: {', '.join(names)}"
            )
    for p in accepted:
        required = p.default is inspect.Parameter.empty and p.kind not in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        )
        if required and p.name not in params:
            raise _ConfigTypeError(
                f"{path}.params.{p.name} is required by {cls.__name__}: add it to {path}.params"
            )


def _section_params(section: Mapping[str, Any], path: str) -> dict[str, Any]:
    params = section.get("params")
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise _type_error(f"{path}.params", params, "an object {...} of keyword arguments")
    return dict(params)


def _parse_optimizer(section: Any) -> OptimizerConfig | None:
    if section is None:
        return None
    section = _as_section(section, "optimizer")
    for key in section:
        if key not in ("type", "params", "legacy_fusion"):
            logger.warning("ignoring unknown key optimizer.%s", key)
    name = section.get("type")
    if name is None:
        raise ConfigError(
            'optimizer.type is missing: set it (e.g. "AdamW") or remove the optimizer section'
        )
    if not isinstance(name, str):
        raise _type_error("optimizer.type", name, 'an optimizer name such as "AdamW"')
    torch_optims: dict[str, type] | None = None
    if name.lower() in DEEPSPEED_OPTIMIZERS:
        name = name.lower()
    else:
        torch_optims = _torch_optimizers()
        if name not in torch_optims:
            valid = [*DEEPSPEED_OPTIMIZERS, *sorted(torch_optims)]
            raise _ConfigAssertError(
                f"optimizer.type = {_show(name)}: {name} is not a supported DeepSpeed Optimizer"
                f"{_did_you_mean(name, valid)}. Valid types: {', '.join(DEEPSPEED_OPTIMIZERS)} "
                "(any case), or a torch.optim class name, case-sensitive: "
                f"{', '.join(sorted(torch_optims))}"
            )
    params = _section_params(section, "optimizer")
    if "max_grad_norm" in params:
        raise ConfigError(
            "optimizer.params.max_grad_norm is not supported as an optimizer parameter: remove "
            'it and use the top-level "gradient_clipping" key instead (e.g. "gradient_clipping": '
            f"{_show(params['max_grad_norm'])})"
        )
    number = _Spec(float)
    for key in ("lr", "eps", "weight_decay"):
        if key in params:
            _coerce(params[key], f"optimizer.params.{key}", number)
    for key in ("adam_w_mode", "torch_adam"):
        if key in params:
            _coerce(params[key], f"optimizer.params.{key}", _Spec(bool))
    betas = params.get("betas")
    if betas is not None and not (
        isinstance(betas, list | tuple)
        and len(betas) == 2
        and all(isinstance(b, int | float) and not isinstance(b, bool) for b in betas)
    ):
        raise _type_error("optimizer.params.betas", betas, "a list of two numbers [b1, b2]")
    if torch_optims is not None:
        _check_signature(torch_optims[name], params, "optimizer", "params")
    return OptimizerConfig(type=name, params=params)


def _ds_schedule_specs(name: str) -> dict[str, _Spec]:
    lr = _Spec(float, per_group=True)
    last = _Spec(int)
    warmup = {
        "warmup_min_lr": lr,
        "warmup_max_lr": _Spec(float, per_group=True, optional=True),
        "warmup_num_steps": _Spec(int, gt=0),
        "warmup_type": _Spec(str, choices=("log", "linear")),
        "last_batch_iteration": last,
    }
    total = {"total_num_steps": _Spec(int, gt=0, required=True)}
    table: dict[str, dict[str, _Spec]] = {
        "LRRangeTest": {
            "lr_range_test_min_lr": lr,
            "lr_range_test_step_size": _Spec(int, gt=0),
            "lr_range_test_step_rate": _Spec(float),
            "lr_range_test_staircase": _Spec(bool),
            "last_batch_iteration": last,
        },
        "OneCycle": {
            "cycle_min_lr": _Spec(float, per_group=True, required=True),
            "cycle_max_lr": _Spec(float, per_group=True, required=True),
            "decay_lr_rate": _Spec(float),
            "cycle_first_step_size": _Spec(int, gt=0),
            "cycle_second_step_size": _Spec(int, gt=0, optional=True),
            "cycle_first_stair_count": _Spec(int, ge=0),
            "cycle_second_stair_count": _Spec(int, ge=0, optional=True),
            "decay_step_size": _Spec(int, ge=0),
            "cycle_momentum": _Spec(bool),
            "cycle_min_mom": _Spec(float, per_group=True),
            "cycle_max_mom": _Spec(float, per_group=True),
            "decay_mom_rate": _Spec(float),
            "last_batch_iteration": last,
        },
        "WarmupLR": warmup,
        "WarmupDecayLR": {**total, **warmup},
        "WarmupCosineLR": {
            **total,
            "warmup_min_ratio": _Spec(float),
            "warmup_num_steps": _Spec(int, gt=0),
            "cos_min_ratio": _Spec(float),
            "warmup_type": _Spec(str, choices=("log", "linear")),
            "last_batch_iteration": last,
        },
    }
    return table[name]


def _parse_scheduler(section: Any) -> SchedulerConfig | None:
    if section is None:
        return None
    section = _as_section(section, "scheduler")
    for key in section:
        if key not in ("type", "params"):
            logger.warning("ignoring unknown key scheduler.%s", key)
    name = section.get("type")
    if name is None:
        raise ConfigError(
            'scheduler.type is missing: set it (e.g. "WarmupLR") or remove the scheduler section'
        )
    if not isinstance(name, str):
        raise _type_error("scheduler.type", name, 'a scheduler name such as "WarmupLR"')
    params = _section_params(section, "scheduler")
    if name in DEEPSPEED_LR_SCHEDULES:
        specs = _ds_schedule_specs(name)
        for key in params:
            if key not in specs:
                raise _ConfigTypeError(
                    f"scheduler.params.{key}: {name} has no parameter {key!r}"
                    f"{_did_you_mean(key, specs)}. Valid: {', '.join(specs)}"
                )
        for key, spec in specs.items():
            if spec.required and key not in params:
                what = (
                    "set it to the number of optimizer steps of the run (Hugging Face fills it "
                    "from num_training_steps)"
                    if key == "total_num_steps"
                    else "add it to scheduler.params"
                )
                raise _ConfigTypeError(f"scheduler.params.{key} is required by {name}: {what}")
        params = _read(params, "scheduler.params", specs, strict=True, fill_defaults=False)
        return SchedulerConfig(type=name, params=params, source="deepspeed")
    torch_scheds = _torch_lr_schedulers()
    if name not in torch_scheds:
        valid = [*DEEPSPEED_LR_SCHEDULES, *sorted(torch_scheds)]
        raise ConfigError(
            f"scheduler.type = {_show(name)}: DeepSpeed does not recognize LR scheduler {name}"
            f"{_did_you_mean(name, valid)}. Valid types: {', '.join(DEEPSPEED_LR_SCHEDULES)} "
            "(DeepSpeed's), or a torch.optim.lr_scheduler class name: "
            f"{', '.join(sorted(torch_scheds))}"
        )
    _check_signature(torch_scheds[name], params, "scheduler", "optimizer")
    return SchedulerConfig(type=name, params=params, source="torch")


def _parse_offload(section: Any, path: str, cls: type) -> Any:
    if section is None:
        return None
    return _build(cls, _read(section, path, _specs_of(cls), strict=True))


def _parse_zero(section: Any) -> ZeroConfig:
    path = "zero_optimization"
    if isinstance(section, bool):
        logger.warning(
            '"zero_optimization": %s is a deprecated form; it means {"stage": %d}',
            _show(section),
            1 if section else 0,
        )
        section = {"stage": 1 if section else 0}
    section = _as_section(section, path)
    if "aio" in section:
        raise ConfigError(
            'zero_optimization.aio: "aio" belongs at the top level of the config, not inside '
            'zero_optimization: move the "aio" block out to the top level. DeepSpeed rejects '
            "it there too ('extra fields not permitted', DeepSpeed issue 2721)"
        )
    for key, why in _REMOVED_ZERO_KEYS.items():
        if key in section:
            raise ConfigError(
                f"zero_optimization.{key}: {why} from DeepSpeed (0.19.8 rejects it too): "
                "remove the key"
            )
    specs = {**_specs_of(ZeroConfig), **_zero_unused_specs()}
    values = _read(section, path, specs, strict=True)
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old not in section:
            continue
        if new in section:
            raise ConfigError(
                f"zero_optimization.{old} and zero_optimization.{new} both given: {old} is the "
                f"deprecated form of {new}; keep only {new}"
            )
        logger.warning(
            'zero_optimization.%s is deprecated; use "%s": {"device": "cpu"}',
            old,
            new,
        )
        values[new] = {"device": "cpu"} if values[old] else None
    if section.get("cpu_offload_use_pin_memory") is not None:
        logger.warning(
            "zero_optimization.cpu_offload_use_pin_memory is deprecated; use "
            "pin_memory in offload_param / offload_optimizer"
        )
    if "stage3_gather_fp16_weights_on_model_save" in section:
        logger.warning(
            "zero_optimization.stage3_gather_fp16_weights_on_model_save is "
            "deprecated; use stage3_gather_16bit_weights_on_model_save"
        )
    values["offload_param"] = _parse_offload(
        values["offload_param"], f"{path}.offload_param", OffloadParamConfig
    )
    values["offload_optimizer"] = _parse_offload(
        values["offload_optimizer"], f"{path}.offload_optimizer", OffloadOptimizerConfig
    )
    stage = values["stage"]
    if values["overlap_comm"] is None:
        values["overlap_comm"] = stage == 3
    opt = values["offload_optimizer"]
    if opt is not None and opt.ratio < 1.0 and stage != 3:
        raise ConfigError(
            f"zero_optimization.offload_optimizer.ratio = {opt.ratio:g}: partial optimizer "
            f"offload needs ZeRO stage 3 (stage is {stage}); set ratio to 1.0 or stage to 3"
        )
    if not values["compute_grad_norm"] and stage not in (1, 2):
        raise ConfigError(
            "zero_optimization.compute_grad_norm = false is supported only with ZeRO stage 1 "
            f"or 2 (stage is {stage}): remove it"
        )
    return _build(ZeroConfig, values)


def _parse_precision(raw: Mapping[str, Any], zero_stage: int) -> tuple[FP16Config, BF16Config]:
    fp16 = _build(FP16Config, _read(raw.get("fp16"), "fp16", _specs_of(FP16Config), strict=True))
    if "bf16" in raw and "bfloat16" in raw:
        raise ConfigError(
            'both "bf16" and "bfloat16" sections given: "bfloat16" is the old name of "bf16"; '
            "keep only bf16"
        )
    bf16_key = "bfloat16" if "bfloat16" in raw else "bf16"
    bf16 = _build(
        BF16Config, _read(raw.get(bf16_key), bf16_key, _specs_of(BF16Config), strict=True)
    )
    if fp16.enabled and bf16.enabled:
        raise _ConfigAssertError(
            f"fp16.enabled and {bf16_key}.enabled are both true: bfloat16 and fp16 modes cannot "
            "be enabled together; set one of them to false"
        )
    if fp16.enabled and fp16.loss_scale == 0:
        for key in ("loss_scale_window", "min_loss_scale"):
            if getattr(fp16, key) <= 0:
                raise ConfigError(
                    f"fp16.{key} = {getattr(fp16, key)}: must be > 0 when dynamic loss scaling "
                    "is enabled (fp16.loss_scale = 0)"
                )
    needs_zero = [
        ("fp16.fp16_master_weights_and_grads", fp16.fp16_master_weights_and_grads),
        (f"{bf16_key}.bf16_master_weights_and_grads", bf16.bf16_master_weights_and_grads),
        (f"{bf16_key}.bf16_optimizer_states", bf16.bf16_optimizer_states),
    ]
    for key, on in needs_zero:
        if on and zero_stage == 0:
            raise _ConfigAssertError(f"{key} = true is only supported with ZeRO stage 1, 2 or 3")
    if bf16.bf16_optimizer_states and not bf16.bf16_master_weights_and_grads:
        raise _ConfigAssertError(
            f"{bf16_key}.bf16_optimizer_states = true requires "
            f"{bf16_key}.bf16_master_weights_and_grads = true"
        )
    return fp16, bf16


def _parse_checkpoint(section: Any) -> CheckpointConfig:
    path = "checkpoint"
    values = _read(section, path, _specs_of(CheckpointConfig), strict=False)
    tag = values["tag_validation"]
    modes = ("WARN", "IGNORE", "FAIL")
    if not isinstance(tag, str) or tag.upper() not in modes:
        raise _type_error(f"{path}.tag_validation", tag, "one of Warn, Ignore, Fail")
    values["tag_validation"] = tag.upper()
    parallel_write = _as_section(_as_section(section, path).get("parallel_write"), path)
    if "pipeline_stage" in parallel_write:
        _coerce(
            parallel_write["pipeline_stage"], f"{path}.parallel_write.pipeline_stage", _Spec(bool)
        )
    return _build(CheckpointConfig, values)


_DEVICES_RE = re.compile(r"^(cpu:[1-9][0-9]*|cuda|cuda:[0-9]+(,[0-9]+)*)$")


def _parse_cuts(value: Any, key: str, *, first_may_be_zero: bool) -> tuple[int, ...] | None:
    if value is None:
        return None
    what = "a non-empty list of positive integers (layers per stage)"
    if first_may_be_zero:
        what += "; the first entry (layers fused with the head) may be 0"
    if not isinstance(value, list | tuple) or not value:
        raise _type_error(key, value, what)
    cuts = tuple(_coerce(v, f"{key}[{i}]", _Spec(int)) for i, v in enumerate(value))
    for i, c in enumerate(cuts):
        if c < 0 or (c == 0 and not (first_may_be_zero and i == 0)):
            raise _type_error(key, list(value), what)
    return cuts


def _parse_roundpipe(section: Any) -> RoundPipeConfig:
    path = "roundpipe"
    values = _read(section, path, _specs_of(RoundPipeConfig), strict=True)
    devices = values["devices"]
    if devices is not None:
        expected = (
            '"cuda" (all visible GPUs), "cuda:0,1,..." (distinct GPU indices), "cpu:N" (N '
            "virtual CPU devices) or null (all GPUs, else cpu:2)"
        )
        if not isinstance(devices, str) or not _DEVICES_RE.match(devices):
            raise _type_error(f"{path}.devices", devices, expected)
        ids = devices.removeprefix("cuda:").split(",") if devices.startswith("cuda:") else []
        if len(set(ids)) != len(ids):
            raise _type_error(f"{path}.devices", devices, expected, " (a GPU is listed twice)")
    fwd = _parse_cuts(values["fwd_cuts"], f"{path}.fwd_cuts", first_may_be_zero=False)
    bwd = _parse_cuts(values["bwd_cuts"], f"{path}.bwd_cuts", first_may_be_zero=True)
    if fwd is not None and bwd is not None and sum(fwd) != sum(bwd):
        raise ConfigError(
            f"{path}.fwd_cuts (sum {sum(fwd)}) and {path}.bwd_cuts (sum {sum(bwd)}) must cover "
            "the same number of decoder layers: make both sum to the model's layer count"
        )
    values.update(fwd_cuts=fwd, bwd_cuts=bwd)
    points = values["split_points"]
    if points is not None:
        if (
            not isinstance(points, list | tuple)
            or not points
            or not all(isinstance(p, str) and p for p in points)
        ):
            raise _type_error(
                f"{path}.split_points", points,
                'a non-empty list of module names, as in model.named_modules() (e.g. '
                '["layers.4", "layers.8"])',
            )  # fmt: skip
        values["split_points"] = tuple(points)
    return _build(RoundPipeConfig, values)


def _check_top_level_keys(raw: Mapping[str, Any]) -> None:
    for key, why in _REMOVED_TOP_LEVEL_KEYS.items():
        if key in raw:
            raise ConfigError(f"{key}: {why} from DeepSpeed (0.19.8 rejects it too): remove it")
    known = _DEEPSPEED_TOP_LEVEL_KEYS | {"roundpipe"}
    for key in raw:
        if key not in known:
            logger.warning(
                "unknown top-level key %r is ignored (as DeepSpeed does)%s",
                key,
                _did_you_mean(str(key), known),
            )


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------

_TOP_LEVEL_SCALARS = (
    "gradient_clipping",
    "steps_per_print",
    "wall_clock_breakdown",
    "dataloader_drop_last",
    "managed_gradient_accumulation",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
)


def load_raw_config(
    config: Mapping[str, Any] | str | os.PathLike[str] | DSConfig | None,
) -> dict[str, Any]:
    """The config as a plain dict before validation (a copy; a DSConfig's ``raw``): for
    callers that must read it before ``load_config`` fills its "auto" values (autotune.py).
    Raises ConfigError for a source that cannot be read, as ``load_config`` does."""
    if isinstance(config, DSConfig):
        return copy.deepcopy(dict(config.raw))
    return _load_raw(config)


def load_config(
    config: Mapping[str, Any] | str | os.PathLike[str] | DSConfig | None,
    *,
    world_size: int = 1,
    auto_values: Mapping[str, Any] | None = None,
) -> DSConfig:
    """Read and validate a DeepSpeed config.

    config: a dict (copied, not modified), a path to an hjson/JSON file, a urlsafe-base64 JSON
    string, or an already loaded DSConfig (returned as is unless world_size/auto_values differ).
    world_size: the data-parallel world size for the batch triplet. auto_values: values for
    "auto" placeholders keyed by dotted path (see `hf_auto_values`). Raises ConfigError (a
    ValueError) naming the key path, the bad value and the fix.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size = {world_size!r}: expected an integer >= 1")
    if isinstance(config, DSConfig):
        if world_size == config.world_size and not auto_values:
            return config
        config = config.raw  # re-derive for another world size
    raw = _load_raw(config)
    if raw.get("steps_per_print") == math.inf:
        # Accelerate's DeepSpeedPlugin sets it to infinity to mean "never print": as absent.
        del raw["steps_per_print"]
    _check_top_level_keys(raw)
    if auto_values:
        _apply_auto_values(raw, auto_values)
    autos = _find_autos(raw, "")
    if autos:
        raise ConfigError(
            f'"auto" values left unfilled at: {", ".join(autos)}. "auto" is a Hugging Face '
            "placeholder that only its Trainer fills; pass initialize(..., auto_values={"
            f'"{autos[0]}": ...}}) (rp_engine.config.hf_auto_values(...) computes them as '
            "Hugging Face does), use rp-train which fills them as Hugging Face does, or write "
            "the values into the config"
        )

    tbs, mbs, gas = _parse_batch(raw, world_size)
    zero = _parse_zero(raw.get("zero_optimization"))
    fp16, bf16 = _parse_precision(raw, zero.stage)
    top = _read(raw, "", _specs_of(DSConfig, only=_TOP_LEVEL_SCALARS), strict=False)
    flops = _read(
        raw.get("flops_profiler"),
        "flops_profiler",
        {"enabled": _Spec(bool, default=False)},
        strict=False,
    )
    comm_type = raw.get("communication_data_type")
    if comm_type is not None:
        if not isinstance(comm_type, str) or comm_type.lower() not in ("fp16", "bf16", "fp32"):
            raise _type_error(
                "communication_data_type", comm_type, '"fp16", "bf16", "fp32" or null'
            )
        comm_type = comm_type.lower()
    _read(raw.get("comet"), "comet", _comet_specs(), strict=True)
    _read(raw.get("comms_logger"), "comms_logger", _comms_logger_specs(), strict=True)

    def section(cls: type, key: str, *, strict: bool) -> Any:
        return _build(cls, _read(raw.get(key), key, _specs_of(cls), strict=strict))

    cfg = DSConfig(
        train_batch_size=tbs,
        train_micro_batch_size_per_gpu=mbs,
        gradient_accumulation_steps=gas,
        world_size=world_size,
        optimizer=_parse_optimizer(raw.get("optimizer")),
        scheduler=_parse_scheduler(raw.get("scheduler")),
        fp16=fp16,
        bf16=bf16,
        gradient_clipping=top["gradient_clipping"],
        zero=zero,
        aio=section(AioConfig, "aio", strict=False),
        activation_checkpointing=section(
            ActivationCheckpointingConfig, "activation_checkpointing", strict=False
        ),
        wandb=section(WandbConfig, "wandb", strict=True),
        csv_monitor=section(CSVMonitorConfig, "csv_monitor", strict=True),
        tensorboard=section(TensorBoardConfig, "tensorboard", strict=True),
        steps_per_print=top["steps_per_print"],
        # DeepSpeed turns the breakdown on when the flops profiler is on.
        wall_clock_breakdown=top["wall_clock_breakdown"] or flops["enabled"],
        checkpoint=_parse_checkpoint(raw.get("checkpoint")),
        dataloader_drop_last=top["dataloader_drop_last"],
        managed_gradient_accumulation=top["managed_gradient_accumulation"],
        zero_allow_untested_optimizer=top["zero_allow_untested_optimizer"],
        zero_force_ds_cpu_optimizer=top["zero_force_ds_cpu_optimizer"],
        communication_data_type=comm_type,
        roundpipe=_parse_roundpipe(raw.get("roundpipe")),
        raw=raw,
    )
    if zero.offload_param_device != "none" and zero.stage != 3:
        logger.warning(
            "zero_optimization.offload_param is only valid with stage 3 "
            "(stage is %d); DeepSpeed ignores it",
            zero.stage,
        )
    return cfg
