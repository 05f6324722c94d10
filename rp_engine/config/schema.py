"""The typed config users read: frozen dataclasses, one per section, and ``DSConfig``.

Field names are the JSON keys; defaults are DeepSpeed 0.19.8's; metadata (``_m``) gives the
choices, bounds and aliases the parser checks (fields.py). Also the specs of sections that are
validated and then dropped (zero_optimization keys rp_engine does not use, comet,
comms_logger).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rp_engine.config.fields import _m, _Spec
from rp_engine.host.defaults import OPTIMIZER_BUFFERS, PARAM_BUFFERS

# the plan package is pure Python below every other layer; the config reads only its registry
from rp_engine.plan.schedules import ENGINE_SCHEDULES

__all__ = [
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
    "STALENESS_COMPENSATIONS",
]

_OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# roundpipe.staleness_compensation: "auto" resolves to "lookahead" where it applies
STALENESS_COMPENSATIONS = ("none", "auto", "predict", "lookahead", "lookahead_dc")


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
    """zero_optimization.offload_param. "nvme": the compute weights live in a swap file under
    ``nvme_path`` (storage/param_tier.py), except the first layers fitting in ``max_in_cpu``
    elements; "cpu" and "none" keep them in host RAM, rp_engine's normal mode."""

    device: str = field(default="none", metadata=_m(choices=_OFFLOAD_DEVICES))
    nvme_path: str | None = None
    buffer_count: int = field(default=PARAM_BUFFERS, metadata=_m(ge=0))
    buffer_size: int = field(default=100_000_000, metadata=_m(ge=0))
    max_in_cpu: int = field(default=1_000_000_000, metadata=_m(ge=0))
    pin_memory: bool = True


@dataclass(frozen=True, kw_only=True)
class OffloadOptimizerConfig:
    """zero_optimization.offload_optimizer. cpu/nvme means DeepSpeed would use DeepSpeedCPUAdam."""

    device: str = field(default="none", metadata=_m(choices=_OFFLOAD_DEVICES))
    nvme_path: str | None = None
    buffer_count: int = field(default=OPTIMIZER_BUFFERS, metadata=_m(ge=0))
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
    """Top-level `aio`: how the NVMe tier's I/O engine reads and writes (storage/io_engine.py)."""

    block_size: int = field(default=1_048_576, metadata=_m(gt=0))
    queue_depth: int = field(default=8, metadata=_m(gt=0))
    # "thread_count" is its old name (DeepSpeed dropped the alias, so the old key is ignored there)
    intra_op_parallelism: int = field(default=1, metadata=_m(gt=0, aliases=("thread_count",)))
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
    # CPU virtual devices: count every storage their compute creates (activations, temporaries,
    # logits) against device_memory_gb, so a device holds no more host RAM than it. None
    # (default): on exactly when device_memory_gb is set; false: only the runtime's weights,
    # gradients and states count (faster on tiny models, but a device may then hold more)
    meter_cpu_compute: bool | None = None
    pcie_gbps: float | None = field(default=None, metadata=_m(gt=0))
    round_size: int | None = field(default=None, metadata=_m(gt=0))  # M_R; None: GAS
    head_chunk_tokens: int = field(default=1024, metadata=_m(gt=0))
    # any nn.Module: cut its traced graph before these modules (names as in named_modules());
    # None: before each child of its largest repeated ModuleList / Sequential (model/module.py)
    split_points: tuple[str, ...] | None = field(default=None, metadata=_m(custom=True))
    profile_iterations: int = field(default=2, metadata=_m(ge=0))
    # DeepSpeed's "autotuning" block, answered by the advisor (autotune.py): the tokens per
    # sequence the run trains with (needed to fill "auto" batch sizes), the machine to plan for
    # (a preset name or JSON; None: the devices in use), and how far the first steps' measured
    # compute may stray from the advisor's cost model before the engine re-plans
    seq_len: int | None = field(default=None, metadata=_m(gt=0))
    machine: str | None = None
    autotune_tolerance: float = field(default=0.25, metadata=_m(gt=0))
    seed: int = field(default=42, metadata=_m(ge=0))
    # bf16/fp32 step with a non-finite loss or gradient norm: raise (step skipped), skip, ignore
    on_nonfinite: str = field(default="raise", metadata=_m(choices=("raise", "skip", "ignore")))
    # train_batch t+1 starts while iteration t's backward tail and optimizer run (no drain),
    # fp16 and on_nonfinite "raise"/"skip" included (a step skipped late is undone:
    # engine/boundary.py). null (default) / true: on; false: each train_batch drains. Off under
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
    # host memory this run may use, in GiB (null: no budget): the preflight holds the run to the
    # smallest of this, the cgroup's limit, RLIMIT_AS and the host's free memory
    # (host/memory_limit.py), counted against the process's resident memory
    host_memory_gb: float | None = field(default=None, metadata=_m(gt=0))
    # DeepSpeed's CPU Adam kernel called without the GIL, so the pipeline threads issue work
    # while it runs (bit-identical; optim/nogil_adam.py); false: through DeepSpeed's binding,
    # which holds the GIL for each slice
    release_gil: bool = True
    # cores for the optimizer's thread and its OpenMP team, the rest for the pipeline threads
    # (host/affinity.py): null = derived from the core and device counts (no split on CPU
    # virtual devices, which compute on the same cores), 0 = no split, N = N cores
    optimizer_cores: int | None = field(default=None, metadata=_m(ge=0))
    # with the NVMe optimizer tier, fp32 gradients live in a bounded pool of layer-sized buffers,
    # spilled to a gradient file beside the optimizer's when more are alive than it holds
    # (storage/grad_tier.py): null = on with the tier, 2 x devices + 4 buffers; N = N buffers
    # (at least devices + 2); 0 = the whole-model gradient arena in RAM (4-8 B per parameter)
    grad_buffers: int | None = field(default=None, metadata=_m(ge=0))
    # with the NVMe optimizer tier, the largest piece of a layer's fp32 masters and Adam moments
    # its buffers carry, in MiB: null = whole layers, sliced only as far as the memory limit
    # needs (host_preflight.py); N = slices of at most N MiB, stepped one after the other
    # (bit-identical; storage/optimizer_tier.py). Not with staleness_compensation "lookahead_dc"
    optimizer_slice_mb: float | None = field(default=None, metadata=_m(gt=0))
    # the NVMe tier's I/O: DeepSpeed's aio op when built ("auto"), or the built-in O_DIRECT threads
    nvme_io_engine: str = field(default="auto", metadata=_m(choices=("auto", "aio", "threads")))
    # the asynchronous optimizer's stale weights (iteration t reads w_{t-2}): "none" reads them
    # as they are (RoundPipe's rule); "predict" and "lookahead" publish compute weights one Adam
    # step ahead, along the moments at hand or along the next moments if the last gradient
    # repeated (optim/stepper.py; the masters stay Adam's); "lookahead_dc" also moves each
    # gradient from the weights it was taken at to the masters it is applied at (optim/
    # delay_compensation.py); "auto": "lookahead" where it applies (async CPU Adam/AdamW, one
    # process), else "none" (chosen by its worst case over benchmarks/studies/compensation_suite.py)
    staleness_compensation: str = field(
        default="none", metadata=_m(choices=STALENESS_COMPENSATIONS)
    )


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
    # DeepSpeed 0.19.8: false makes every step() the accumulation boundary (the caller owns it)
    managed_gradient_accumulation: bool = True
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
            f"{head}: rp_engine keeps weights and gradients in host memory (its normal mode); "
            "ZeRO partitioning settings are not used"
        )
        if z.offload_optimizer is not None and odev == "nvme":
            text += (
                f"; fp32 masters and Adam moments live on NVMe ({z.offload_optimizer.nvme_path}: "
                "storage/optimizer_tier.py)"
            )
        else:
            text += "; the optimizer state stays in host memory"
        if z.offload_param is not None and pdev == "nvme":
            text += (
                f"; compute weights live on NVMe ({z.offload_param.nvme_path}: "
                f"storage/param_tier.py), the first {z.offload_param.max_in_cpu:,} elements "
                "kept in RAM (max_in_cpu)"
            )
        return text
