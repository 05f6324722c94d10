"""DeepSpeed config -> frozen typed dataclasses (the only reader of the raw ds_config dict).

Owns: reading a config given as a dict, an hjson/JSON file (comments allowed, duplicate keys
rejected) or a urlsafe-base64 JSON string; filling Hugging Face "auto" placeholders from explicit
values; DeepSpeed 0.19.8's defaults, aliases and batch-size inference; validation whose errors
name the key path, the bad value and the fix; and the "roundpipe" section (rp_engine's own knobs).

Strictness follows DeepSpeed: sections DeepSpeed validates with pydantic (zero_optimization,
offload_*, fp16, bf16, monitors, comms_logger) reject unknown keys; activation_checkpointing,
flops_profiler, aio, pipeline and unknown top-level keys are ignored (top-level ones with a
warning). Where DeepSpeed silently turns "auto" into a default, rp_engine asks for a value.
"""

from __future__ import annotations

import base64
import binascii
import copy
import dataclasses
import difflib
import inspect
import json
import logging
import math
import os
import re
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

# the plan package is pure Python below every other layer; the config reads only its registry
from rp_engine.plan.schedules import ENGINE_SCHEDULES

__all__ = [
    "ConfigError",
    "DSConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "FP16Config",
    "BF16Config",
    "OffloadParamConfig",
    "OffloadOptimizerConfig",
    "ZeroConfig",
    "AioConfig",
    "ActivationCheckpointingConfig",
    "WandbConfig",
    "CSVMonitorConfig",
    "TensorBoardConfig",
    "CheckpointConfig",
    "RoundPipeConfig",
    "DEEPSPEED_OPTIMIZERS",
    "DEEPSPEED_LR_SCHEDULES",
    "load_config",
    "resolve_config_arg",
    "hf_auto_values",
]

logger = logging.getLogger("rp_engine.config")


class ConfigError(ValueError):
    """A user error in the DeepSpeed config; the message names the key path and the fix."""


class _ConfigTypeError(ConfigError, TypeError):
    """Raised where DeepSpeed raises TypeError (bad optimizer/scheduler params), so code written
    against DeepSpeed that catches TypeError keeps working."""


class _ConfigArgError(ConfigError, AssertionError):
    """Raised where deepspeed.initialize asserts about its config arguments."""


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
_OFFLOAD_DEVICES = ("none", "cpu", "nvme")

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
# Sections whose values rp_engine reads; an "auto" left in any of them is an error.
_CONSUMED_TOP_LEVEL_KEYS = frozenset(
    (
        "train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps optimizer "
        "scheduler zero_allow_untested_optimizer zero_force_ds_cpu_optimizer steps_per_print fp16 "
        "bf16 bfloat16 gradient_clipping communication_data_type wall_clock_breakdown "
        "zero_optimization activation_checkpointing comms_logger tensorboard wandb csv_monitor "
        "comet flops_profiler checkpoint aio dataloader_drop_last roundpipe"
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
# DeepSpeed's own defaults that are the literal string "auto": not Hugging Face placeholders.
_LEGIT_AUTO_PATHS = frozenset({"pipeline.stages", "data_types.keep_in_fp32_modules"})

_AUTO = "auto"


# --------------------------------------------------------------------------------------------
# Field specs: the dataclasses below are the schema. A field's type annotation gives its kind,
# its default is DeepSpeed's default, and metadata adds choices, bounds and aliases.
# --------------------------------------------------------------------------------------------


def _m(
    *,
    choices: tuple[Any, ...] = (),
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    aliases: tuple[str, ...] = (),
    custom: bool = False,
    nullable: bool = False,
) -> dict[str, Any]:
    """Field metadata: custom=True means the section parser handles the value itself."""
    return {
        "choices": choices,
        "ge": ge,
        "gt": gt,
        "le": le,
        "aliases": aliases,
        "custom": custom,
        "nullable": nullable,
    }


@dataclass(frozen=True)
class _Spec:
    kind: type  # bool | int | float | str | dict | list | object (= pass through)
    default: Any = None
    optional: bool = False  # null accepted
    required: bool = False
    choices: tuple[Any, ...] = ()
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    aliases: tuple[str, ...] = ()
    per_group: bool = False  # a number, or a list of numbers (one per param group)


def _specs_of(cls: type, *, only: Iterable[str] | None = None) -> dict[str, _Spec]:
    hints = get_type_hints(cls)
    wanted = set(only) if only is not None else None
    specs: dict[str, _Spec] = {}
    for f in dataclasses.fields(cls):
        if wanted is not None and f.name not in wanted:
            continue
        meta: Mapping[str, Any] = f.metadata or {}
        kind, optional = _kind_of(hints[f.name])
        if meta.get("custom"):
            kind = object
        if meta.get("nullable"):
            default = None  # resolved by the section parser (e.g. overlap_comm: stage == 3)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        specs[f.name] = _Spec(
            kind=kind,
            default=default,
            optional=optional or bool(meta.get("nullable")),
            choices=tuple(meta.get("choices", ())),
            ge=meta.get("ge"),
            gt=meta.get("gt"),
            le=meta.get("le"),
            aliases=tuple(meta.get("aliases", ())),
        )
    return specs


def _kind_of(hint: Any) -> tuple[type, bool]:
    origin = get_origin(hint)
    if origin is Union or origin is types.UnionType:
        args = [a for a in get_args(hint) if a is not type(None)]
        kind, _ = _kind_of(args[0]) if len(args) == 1 else (object, False)
        return kind, True
    if hint in (bool, int, float, str):
        return hint, False
    return object, False


# --------------------------------------------------------------------------------------------
# Typed config
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """`optimizer` section. `type` is lowercased for DeepSpeed's names (adam, adamw, ...), else a
    torch.optim class name. `params` is kept as given (adam_w_mode / torch_adam included)."""

    type: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """`scheduler` section. `source` is "deepspeed" (deepspeed.runtime.lr_schedules) or "torch"
    (torch.optim.lr_scheduler); integral floats in DeepSpeed schedules' int params become ints."""

    type: str
    params: Mapping[str, Any] = field(default_factory=dict)
    source: str = "deepspeed"


@dataclass(frozen=True, kw_only=True)
class FP16Config:
    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = field(default=0.0, metadata=_m(ge=0))  # 0 = dynamic loss scaling
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: int = 1
    fp16_master_weights_and_grads: bool = False


@dataclass(frozen=True, kw_only=True)
class BF16Config:
    enabled: bool = False
    immediate_grad_update: bool = False
    check_grad_overflow: bool = True
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False


@dataclass(frozen=True, kw_only=True)
class OffloadParamConfig:
    """zero_optimization.offload_param. rp_engine keeps weights in host RAM whatever the device."""

    device: str = field(default="none", metadata=_m(choices=_OFFLOAD_DEVICES))
    nvme_path: str | None = None
    buffer_count: int = field(default=5, metadata=_m(ge=0))
    buffer_size: int = field(default=100_000_000, metadata=_m(ge=0))
    max_in_cpu: int = field(default=1_000_000_000, metadata=_m(ge=0))
    pin_memory: bool = True


@dataclass(frozen=True, kw_only=True)
class OffloadOptimizerConfig:
    """zero_optimization.offload_optimizer. cpu/nvme means DeepSpeed would use DeepSpeedCPUAdam."""

    device: str = field(default="none", metadata=_m(choices=_OFFLOAD_DEVICES))
    nvme_path: str | None = None
    buffer_count: int = field(default=4, metadata=_m(ge=0))
    pin_memory: bool = True
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = field(default=1.0, metadata=_m(ge=0, le=1))
    super_offload: bool = False
    cpuadam_cores_perc: float = field(default=0.8, metadata=_m(ge=0, le=1))


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """zero_optimization. Fields use the JSON key names; DeepSpeed's pydantic field names
    (prefetch_bucket_size, ...) are accepted as aliases, as DeepSpeed does."""

    stage: int = field(default=0, metadata=_m(choices=(0, 1, 2, 3)))
    offload_param: OffloadParamConfig | None = field(default=None, metadata=_m(custom=True))
    offload_optimizer: OffloadOptimizerConfig | None = field(default=None, metadata=_m(custom=True))
    # DeepSpeed's default is "stage == 3"; resolved when parsing.
    overlap_comm: bool = field(default=False, metadata=_m(nullable=True))
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = field(default=500_000_000, metadata=_m(gt=0))
    allgather_partitions: bool = True
    allgather_bucket_size: int = field(default=500_000_000, metadata=_m(ge=0))
    load_from_fp32_weights: bool = True
    sub_group_size: int = field(default=1_000_000_000, metadata=_m(ge=0))
    stage3_prefetch_bucket_size: int = field(
        default=50_000_000, metadata=_m(ge=0, aliases=("prefetch_bucket_size",))
    )
    stage3_param_persistence_threshold: int = field(
        default=100_000, metadata=_m(ge=0, aliases=("param_persistence_threshold",))
    )
    stage3_max_live_parameters: int = field(
        default=1_000_000_000, metadata=_m(ge=0, aliases=("max_live_parameters",))
    )
    stage3_max_reuse_distance: int = field(
        default=1_000_000_000, metadata=_m(ge=0, aliases=("max_reuse_distance",))
    )
    stage3_gather_16bit_weights_on_model_save: bool = field(
        default=False,
        metadata=_m(
            aliases=(
                "gather_16bit_weights_on_model_save",
                "stage3_gather_fp16_weights_on_model_save",  # the pre-0.6 name
            )
        ),
    )
    ignore_unused_parameters: bool = True
    round_robin_gradients: bool = False

    @property
    def offload_param_device(self) -> str:
        """ "none", "cpu" or "nvme"."""
        return self.offload_param.device if self.offload_param is not None else "none"

    @property
    def offload_optimizer_device(self) -> str:
        """ "none", "cpu" or "nvme"."""
        return self.offload_optimizer.device if self.offload_optimizer is not None else "none"


# zero_optimization keys DeepSpeed accepts that rp_engine does not use: validated, then dropped.
def _zero_unused_specs() -> dict[str, _Spec]:
    b = _Spec(bool)
    ob = _Spec(bool, optional=True)
    return {
        "use_multi_rank_bucket_allreduce": b,
        "compute_grad_norm": _Spec(bool, default=True),
        "elastic_checkpoint": b,
        "zenflow": _Spec(dict, optional=True),
        "cpu_offload_param": ob,
        "cpu_offload_use_pin_memory": ob,
        "cpu_offload": ob,
        "stage3_model_persistence_threshold": _Spec(
            int, ge=0, aliases=("model_persistence_threshold",)
        ),
        "stage3_module_granularity_threshold": _Spec(
            int, aliases=("module_granularity_threshold",)
        ),
        "stage3_use_all_reduce_for_fetch_params": _Spec(
            bool, aliases=("use_all_reduce_for_fetch_params",)
        ),
        "stage3_allgather_sequential": _Spec(bool, aliases=("allgather_sequential",)),
        "legacy_stage1": b,
        "parameter_alignment": b,
        "zero_hpz_partition_size": _Spec(int, ge=0),
        "zero_quantized_weights": b,
        "zero_quantized_nontrainable_weights": b,
        "zero_quantized_gradients": b,
        "memory_efficient_linear": b,
        "pipeline_loading_checkpoint": b,
        "override_module_apply": b,
        "log_trace_cache_warnings": b,
        "enable_sanity_checks": b,
        "save_muon_momentum_buffer_in_memory": b,
        "leaf_module": _Spec(dict, optional=True),
    }


@dataclass(frozen=True, kw_only=True)
class AioConfig:
    """Top-level `aio` (NVMe async I/O). Accepted; rp_engine does not use the NVMe tier."""

    block_size: int = field(default=1_048_576, metadata=_m(gt=0))
    queue_depth: int = field(default=8, metadata=_m(gt=0))
    intra_op_parallelism: int = field(default=1, metadata=_m(gt=0))
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointingConfig:
    partition_activations: bool = False
    number_checkpoints: int | None = None
    contiguous_memory_optimization: bool = False
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    cpu_checkpointing: bool = False


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


@dataclass(frozen=True, kw_only=True)
class CSVMonitorConfig:
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass(frozen=True, kw_only=True)
class TensorBoardConfig:
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


def _comet_specs() -> dict[str, _Spec]:
    os_ = _Spec(str, optional=True)
    return {
        "enabled": _Spec(bool),
        "samples_log_interval": _Spec(int, default=100),
        "project": os_,
        "workspace": os_,
        "api_key": os_,
        "experiment_name": os_,
        "experiment_key": os_,
        "online": _Spec(bool, optional=True),
        "mode": os_,
    }


def _comms_logger_specs() -> dict[str, _Spec]:
    return {
        "enabled": _Spec(bool),
        "prof_all": _Spec(bool, default=True),
        "prof_ops": _Spec(list, default=[]),
        "verbose": _Spec(bool),
        "debug": _Spec(bool),
    }


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    tag_validation: str = field(default="WARN", metadata=_m(custom=True))  # WARN|IGNORE|FAIL
    load_universal: bool = False
    use_node_local_storage: bool = False


@dataclass(frozen=True, kw_only=True)
class RoundPipeConfig:
    """The "roundpipe" section: rp_engine's own knobs (DeepSpeed ignores unknown top-level keys,
    so a config with this section still works with DeepSpeed)."""

    devices: str | None = field(
        default=None, metadata=_m(custom=True)
    )  # None: all GPUs, else cpu:2
    # the schedules the engine runs, from the one registry (plan.schedules.SCHEDULES)
    schedule: str = field(default="roundpipe", metadata=_m(choices=ENGINE_SCHEDULES))
    async_optimizer: bool = True
    fwd_cuts: tuple[int, ...] | None = field(default=None, metadata=_m(custom=True))
    bwd_cuts: tuple[int, ...] | None = field(default=None, metadata=_m(custom=True))
    device_memory_gb: float | None = field(default=None, metadata=_m(gt=0))
    pcie_gbps: float | None = field(default=None, metadata=_m(gt=0))
    round_size: int | None = field(default=None, metadata=_m(gt=0))  # M_R; None: GAS
    head_chunk_tokens: int = field(default=1024, metadata=_m(gt=0))
    profile_iterations: int = field(default=2, metadata=_m(ge=0))
    seed: int = field(default=42, metadata=_m(ge=0))
    # bf16/fp32 step with a non-finite loss or gradient norm: raise (step skipped), skip, ignore
    on_nonfinite: str = field(default="raise", metadata=_m(choices=("raise", "skip", "ignore")))
    # train_batch t+1 starts while iteration t's backward tail and optimizer run (no drain),
    # fp16 and on_nonfinite "raise"/"skip" included (a step skipped late is undone:
    # engine_boundary.py). null (default) / true: on; false: each train_batch drains. Off under
    # data parallel, step_journal "on", a client LR scheduler without state_dict where a step
    # can be skipped, or a model with dropout on CPU devices (one RNG shared with the caller)
    overlap_iterations: bool | None = None
    # undo log making a failed optimizer step all-or-nothing (+12 B/trainable param, Adam):
    # default: only when host memory allows (optim/step_journal.py)
    step_journal: str = field(
        default="if_memory_allows", metadata=_m(choices=("if_memory_allows", "on", "off"))
    )
    # initialize refuses a model whose host state would not fit in available memory
    host_preflight: bool = True


@dataclass(frozen=True, kw_only=True)
class DSConfig:
    """A parsed, validated DeepSpeed config. `raw` is the parsed dict with "auto" filled (treat it
    as read-only; `to_dict()` gives a copy for checkpoints)."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int = 1  # data-parallel world size used for the batch triplet
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    gradient_clipping: float = field(default=1.0, metadata=_m(ge=0))  # 1.0 since 0.19.3
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    wandb: WandbConfig = field(default_factory=WandbConfig)
    csv_monitor: CSVMonitorConfig = field(default_factory=CSVMonitorConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    steps_per_print: int | None = field(default=None, metadata=_m(gt=0))  # None: no progress log
    wall_clock_breakdown: bool = False
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dataloader_drop_last: bool = False
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    communication_data_type: str | None = field(default=None, metadata=_m(custom=True))
    roundpipe: RoundPipeConfig = field(default_factory=RoundPipeConfig)
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """A deep copy of the parsed config dict (autos filled), e.g. for checkpoint ds_config."""
        return copy.deepcopy(dict(self.raw))

    def offload_summary(self) -> str | None:
        """One line saying how ZeRO / ZeRO-Infinity settings map onto rp_engine (None when the
        config asks for no ZeRO stage and no offload)."""
        z = self.zero
        pdev, odev = z.offload_param_device, z.offload_optimizer_device
        if z.stage == 0 and pdev == "none" and odev == "none":
            return None
        offloads = [f"{k}={d}" for k, d in (("offload_param", pdev), ("offload_optimizer", odev))]
        offloads = [o for o in offloads if not o.endswith("=none")]
        head = f"zero_optimization stage {z.stage}"
        if offloads:
            head += " with " + ", ".join(offloads)
        text = (
            f"{head}: rp_engine keeps all weights and optimizer state in host memory "
            "(its normal mode); ZeRO partitioning settings are not used"
        )
        if "nvme" in (pdev, odev):
            paths = sorted(
                {
                    str(c.nvme_path)
                    for c in (z.offload_param, z.offload_optimizer)
                    if c is not None and c.device == "nvme" and c.nvme_path
                }
            )
            where = f" ({', '.join(paths)})" if paths else ""
            text += (
                f"; NVMe offload{where} is accepted but rp_engine keeps state in host RAM "
                "(NVMe tier not used)"
            )
        return text


# --------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _nearest(word: str, candidates: Iterable[str]) -> str | None:
    cands = list(candidates)
    lowered = {c.lower(): c for c in cands}
    hits = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    if hits:
        return lowered[hits[0]]
    # A truncated key ("job" for "job_name") scores low on similarity but is an obvious match.
    prefixed = sorted(
        (c for c in lowered if len(word) >= 3 and c.startswith(word.lower())), key=len
    )
    return lowered[prefixed[0]] if prefixed else None


def _did_you_mean(word: str, candidates: Iterable[str]) -> str:
    hit = _nearest(word, candidates)
    return f" (did you mean {hit!r}?)" if hit else ""


def _unknown_key_error(path: str, key: str, valid: Iterable[str]) -> ConfigError:
    valid = sorted(valid)
    where = path or "the top level"
    return ConfigError(
        f"{_join(path, key)}: unknown key {key!r} in {where}{_did_you_mean(key, valid)}. "
        f"Valid keys: {', '.join(valid)}. DeepSpeed rejects unknown keys here too "
        "('extra fields not permitted')."
    )


def _type_error(key: str, value: Any, expected: str, hint: str = "") -> ConfigError:
    return ConfigError(f"{key} = {_show(value)} is not valid: expected {expected}{hint}")


def _expected(spec: _Spec) -> str:
    if spec.choices:
        text = "one of " + ", ".join(_show(c) for c in spec.choices)
        if spec.kind is int:
            text = "an integer, " + text
    else:
        text = {
            bool: "true or false",
            int: "an integer",
            float: "a number",
            str: "a string",
            dict: "an object {...}",
            list: "a list [...]",
        }.get(spec.kind, "a value")
        if spec.per_group:
            text += " or a list of numbers (one per param group)"
    return text + (" or null" if spec.optional else "")


def _quote_hint(value: Any, kind: type) -> str:
    if isinstance(value, str):
        low = value.strip().lower()
        if kind is bool and low in {"true", "false", "yes", "no", "on", "off", "1", "0"}:
            return " (write true or false, without quotes)"
        if kind in (int, float):
            try:
                float(value)
            except ValueError:
                return ""
            return " (write the number without quotes)"
    return ""


# --------------------------------------------------------------------------------------------
# Generic section reading
# --------------------------------------------------------------------------------------------


def _coerce(value: Any, key: str, spec: _Spec) -> Any:
    if value is None:
        if spec.optional or spec.kind is object:
            return None
        raise _type_error(key, value, _expected(spec))
    if spec.kind is object:
        return value
    if spec.per_group and isinstance(value, list):
        item = dataclasses.replace(spec, per_group=False, optional=False)
        return [_coerce(v, f"{key}[{i}]", item) for i, v in enumerate(value)]
    v: Any
    if spec.kind is bool:
        if not isinstance(value, bool):
            raise _type_error(key, value, _expected(spec), _quote_hint(value, bool))
        v = value
    elif spec.kind is int:
        ok = isinstance(value, int) or (
            isinstance(value, float) and math.isfinite(value) and value.is_integer()
        )
        if isinstance(value, bool) or not ok:
            hint = _quote_hint(value, int)
            if isinstance(value, float) and not isinstance(value, bool):
                hint = " (it must be a whole number)"
            raise _type_error(key, value, _expected(spec), hint)
        v = int(value)
    elif spec.kind is float:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(float(value))
        ):
            raise _type_error(key, value, _expected(spec), _quote_hint(value, float))
        v = float(value)
    elif spec.kind in (str, dict, list):
        if not isinstance(value, spec.kind):
            raise _type_error(key, value, _expected(spec))
        v = value
    else:  # pragma: no cover - every kind is handled above
        raise AssertionError(spec.kind)
    if spec.choices and v not in spec.choices:
        hint = _did_you_mean(v, [str(c) for c in spec.choices]) if isinstance(v, str) else ""
        raise _type_error(key, value, _expected(spec), hint)
    if spec.ge is not None and v < spec.ge:
        raise _type_error(key, value, f"a value >= {spec.ge:g}")
    if spec.gt is not None and v <= spec.gt:
        raise _type_error(key, value, f"a value > {spec.gt:g}")
    if spec.le is not None and v > spec.le:
        raise _type_error(key, value, f"a value <= {spec.le:g}")
    return v


def _as_section(section: Any, path: str) -> Mapping[str, Any]:
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ConfigError(
            f"{path} = {_show(section)} is not valid: expected an object {{...}} of settings"
        )
    return section


def _read(
    section: Any,
    path: str,
    specs: Mapping[str, _Spec],
    *,
    strict: bool,
    fill_defaults: bool = True,
) -> dict[str, Any]:
    """Validate `section` against `specs`; returns canonical name -> coerced value.

    strict: unknown keys raise (DeepSpeed's pydantic sections); otherwise they are ignored.
    """
    section = _as_section(section, path)
    alias_of = {a: name for name, s in specs.items() for a in s.aliases}
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in section.items():
        name = alias_of.get(key, key)
        if name not in specs:
            if strict:
                raise _unknown_key_error(path, key, [*specs, *alias_of])
            continue
        if name in given_as:
            raise ConfigError(
                f"{_join(path, key)} and {_join(path, given_as[name])} are the same setting "
                "(one is an alias of the other): keep only one"
            )
        given_as[name] = key
        out[name] = _coerce(value, _join(path, key), specs[name])
    for name, spec in specs.items():
        if name not in out:
            if spec.required:
                raise _type_error(_join(path, name), None, _expected(spec))
            if fill_defaults:
                out[name] = copy.copy(spec.default)
    return out


def _build(cls: type, values: Mapping[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _no_duplicates(source: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        dups: list[str] = []
        for k, v in pairs:
            if k in out and k not in dups:
                dups.append(k)
            out[k] = v
        if dups:
            raise ConfigError(
                f"Duplicate keys in DeepSpeed config {source}: {dups}. A key may appear only "
                "once per object (JSON would silently keep the last one): remove the extra one"
            )
        return out

    return hook


def _parse_text(text: str, source: str) -> Any:
    import hjson  # installed with deepspeed; imported here to keep import of this module cheap

    try:
        return hjson.loads(text, object_pairs_hook=_no_duplicates(source))
    except ConfigError:
        raise
    except ValueError as e:  # HjsonDecodeError is a ValueError
        raise ConfigError(f"Could not parse DeepSpeed config {source}: {e}") from e


def _load_raw(config: Any) -> dict[str, Any]:
    if config is None:
        raise ConfigError(
            "No DeepSpeed config given: pass config= a dict, a path to a ds_config.json, or a "
            "base64 JSON string (or --deepspeed_config on the command line)"
        )
    if isinstance(config, Mapping):
        parsed: Any = copy.deepcopy(dict(config))
        source = "dict"
    elif isinstance(config, str | os.PathLike):
        text = os.fspath(config)
        # os.path (not Path) checks: they return False instead of raising for names too long
        # to be paths, such as a large base64 config.
        if isinstance(config, str) and not os.path.exists(text):
            parsed, source = _decode_base64(text), "(base64 string)"
        elif os.path.isfile(text):
            source = text
            parsed = _parse_text(Path(text).read_text(encoding="utf-8"), source)
        else:
            what = "is a directory" if os.path.isdir(text) else "does not exist"
            raise ConfigError(f"DeepSpeed config file {text!r} {what}: give the path of a file")
    else:
        raise ConfigError(
            f"DeepSpeed config must be a dict, a path or a base64 JSON string, got "
            f"{type(config).__name__}"
        )
    if not isinstance(parsed, dict):
        raise ConfigError(
            f"DeepSpeed config {source} must be a JSON object {{...}} at the top level, "
            f"got {_show(parsed)[:80]}"
        )
    return parsed


def _decode_base64(text: str) -> Any:
    short = text if len(text) <= 80 else text[:77] + "..."
    looks_like_path = "/" in text or os.sep in text or re.search(r"\.h?json$", text) is not None
    not_found = ConfigError(
        f"DeepSpeed config {short!r} is not an existing file (cwd: {os.getcwd()}) nor a "
        "urlsafe-base64 JSON string: check the path"
    )
    if looks_like_path:
        raise not_found
    if text.lstrip().startswith("{"):
        raise ConfigError(
            "DeepSpeed config looks like inline JSON text; pass a dict (json.loads(text)), a "
            "path, or base64.urlsafe_b64encode(text) as DeepSpeed accepts"
        )
    try:
        decoded = base64.urlsafe_b64decode(text).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise not_found from None
    try:
        parsed = _parse_text(decoded, "(base64 string)")
    except ConfigError as e:
        if "Duplicate keys" in str(e):
            raise
        raise not_found from e
    if not isinstance(parsed, dict):
        raise not_found
    return parsed


# --------------------------------------------------------------------------------------------
# "auto"
# --------------------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value


def _apply_auto_values(raw: dict[str, Any], auto_values: Mapping[str, Any]) -> None:
    """Replace "auto" at each dotted key path with the given value (None removes the key, so the
    value is inferred or defaulted). Paths that are absent or not "auto" are left alone."""
    for dotted, value in auto_values.items():
        if not isinstance(dotted, str) or not dotted:
            raise ConfigError(
                f"auto_values keys must be dotted key paths like 'optimizer.params.lr', "
                f"got {dotted!r}"
            )
        parts = dotted.split(".")
        if parts[0] == "bf16" and "bf16" not in raw and "bfloat16" in raw:
            parts[0] = "bfloat16"  # DeepSpeed's old section name
        node: Any = raw
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or parts[-1] not in node:
            continue
        current = node[parts[-1]]
        if _is_auto(current):
            if value is None:
                del node[parts[-1]]
            else:
                node[parts[-1]] = _jsonable(value)
        elif current != _jsonable(value):
            logger.info(
                "auto_values[%r] = %s not used: the config sets %s = %s",
                dotted,
                _show(value),
                dotted,
                _show(current),
            )


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == _AUTO


def _find_autos(node: Any, path: str) -> list[str]:
    if path in _LEGIT_AUTO_PATHS:
        return []
    if _is_auto(node):
        return [path]
    found: list[str] = []
    if isinstance(node, dict):
        for k, v in node.items():
            if not path and k not in _CONSUMED_TOP_LEVEL_KEYS:
                continue  # ignored sections: their values never reach rp_engine
            found += _find_autos(v, _join(path, str(k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += _find_autos(v, f"{path}[{i}]")
    return found


def hf_auto_values(
    *,
    hidden_size: int | None,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    fp16: bool = False,
    bf16: bool = False,
    gradient_clipping: float = 1.0,
    world_size: int = 1,
) -> dict[str, Any]:
    """The values Hugging Face's DeepSpeed integration puts in place of "auto"
    (transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig), keyed by dotted path."""
    values: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "train_batch_size": micro_batch_size * gradient_accumulation_steps * world_size,
        "gradient_clipping": gradient_clipping,
        "optimizer.params.lr": lr,
        "optimizer.params.betas": [betas[0], betas[1]],
        "optimizer.params.eps": eps,
        "optimizer.params.weight_decay": weight_decay,
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": lr,
        # HF keeps it positive: DeepSpeed >= 0.19.6 rejects warmup_num_steps <= 0.
        "scheduler.params.warmup_num_steps": max(1, warmup_steps),
        "fp16.enabled": fp16,
        "bf16.enabled": bf16,
    }
    if total_steps is not None:
        values["scheduler.params.total_num_steps"] = total_steps
    if hidden_size is not None:
        values["zero_optimization.reduce_bucket_size"] = hidden_size * hidden_size
        values["zero_optimization.stage3_prefetch_bucket_size"] = int(
            0.9 * hidden_size * hidden_size
        )
        values["zero_optimization.stage3_param_persistence_threshold"] = 10 * hidden_size
    return values


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


def _parse_batch(raw: Mapping[str, Any], world_size: int) -> tuple[int, int, int]:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    spec = _Spec(int, optional=True)
    tbs, mbs, gas = (_coerce(raw.get(k), k, spec) for k in keys)
    for key, value in zip(keys, (tbs, mbs, gas), strict=True):
        if value is not None and value <= 0:
            raise _type_error(key, value, "an integer > 0")
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
        raise ConfigError(
            "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided "
            "(gradient_accumulation_steps alone is not enough): set "
            "train_micro_batch_size_per_gpu (samples per device per step) in the config"
        )
    assert tbs is not None and mbs is not None and gas is not None
    why = f" (inferred: {inferred} with world_size {ws})" if inferred else ""
    for key, value in zip(keys, (tbs, mbs, gas), strict=True):
        if value <= 0:
            raise ConfigError(
                f"{key} = {value}: has to be greater than 0{why}; choose values with "
                "train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps "
                "* world_size, all three > 0"
            )
    if tbs != mbs * gas * ws:
        raise ConfigError(
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
            raise ConfigError(
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
        raise ConfigError(
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
            raise ConfigError(f"{key} = true is only supported with ZeRO stage 1, 2 or 3")
    if bf16.bf16_optimizer_states and not bf16.bf16_master_weights_and_grads:
        raise ConfigError(
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
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
)


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


def resolve_config_arg(args: Any, config: Any, config_params: Any) -> Any:
    """Pick the config source as deepspeed.initialize does: `config_params` is an alias of
    `config`; `args.deepspeed_config` (or the deprecated `args.deepscale_config`) is used when no
    config is passed. `args` is not modified. Raises ConfigError (also an AssertionError, as
    DeepSpeed asserts) when both or neither are given."""
    if config is None:
        config = config_params
    elif config_params is not None and config_params is not config:
        logger.warning(
            "both config and config_params given; using config "
            "(config_params is its deprecated alias)"
        )
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    deepscale = getattr(args, "deepscale_config", None) if args is not None else None
    if deepscale is not None:
        if from_args is not None:
            raise _ConfigArgError(
                "both --deepscale_config and --deepspeed_config given: --deepscale_config is "
                "the deprecated name of --deepspeed_config; keep only --deepspeed_config"
            )
        logger.warning("--deepscale_config is deprecated; use --deepspeed_config")
        from_args = deepscale
    if from_args is not None:
        if config is not None:
            raise _ConfigArgError(
                f"two DeepSpeed configs given: args.deepspeed_config = {from_args!r} and the "
                "config= argument of initialize(); pass only one (drop --deepspeed_config or "
                "the config argument)"
            )
        config = from_args
    if config is None:
        raise _ConfigArgError(
            "no DeepSpeed config given: pass initialize(..., config=ds_config) (a dict, a path to "
            "a ds_config.json or a base64 JSON string) or --deepspeed_config ds_config.json on "
            "the command line"
        )
    return config
