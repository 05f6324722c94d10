"""DeepSpeedEngine's public names that rp_engine answers through DeepSpeed itself, and the ones it
refuses: both as data, so tests/engine/test_ds_surface.py can hold them against DeepSpeed 0.19.8.

Three kinds of name, besides those ``RoundPipeEngine`` defines itself (api.py, core.py...):

- :data:`CONFIG_ACCESSORS`: DeepSpeed's one-line config getters (``zero_reduce_bucket_size()``,
  ``flops_profiler_enabled()``, ``checkpoint_tag_validation_enabled()``...). They are answered by
  DeepSpeed's *own* function over DeepSpeed's *own* parsing of the same config dict
  (:class:`DeepSpeedConfigView`), so each returns what it returns under DeepSpeed, without a
  second copy of ~100 accessors. DeepSpeed is imported at the first such call, not before.
  They report the config as written: e.g. ``zero_optimization_partition_weights()`` is True at
  stage 3 although rp_engine does not partition (the plan says so at initialize).
- :data:`GAPS`: names rp_engine deliberately does not provide; reading one raises
  :class:`DeepSpeedGap` (an AttributeError, so ``hasattr`` stays False as for a missing name)
  saying why and what to use instead, instead of falling through to the user's module.
- everything else falls through to the user's module, as DeepSpeed's ``__getattr__`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["CONFIG_ACCESSORS", "GAPS", "DeepSpeedConfigView", "DeepSpeedGap"]

# DeepSpeedEngine methods whose body reads only ``self._config`` (or other names of this set):
# listed by hand from deepspeed/runtime/engine.py 0.19.8; the test checks each against its source.
CONFIG_ACCESSORS = frozenset(
    """
    aio_config autotp_size autotuning_enabled autotuning_end_profile_step autotuning_metric
    autotuning_metric_path autotuning_model_info_path autotuning_profile_model_info
    autotuning_start_profile_step bf16_master_weights_and_gradients bf16_optimizer_states
    bfloat16_enabled checkpoint_serialization_enabled checkpoint_tag_validation_enabled
    checkpoint_tag_validation_fail checkpoint_writer_enabled compile_autosp compile_autotp
    compile_zero_optimization_stage cpuadam_cores_perc curriculum_learning_config
    curriculum_learning_enabled data_efficiency_config data_efficiency_enabled
    data_sampling_config data_sampling_enabled dataloader_drop_last dump_state dynamic_loss_scale
    dynamic_loss_scale_args flops_profiler_detailed flops_profiler_enabled
    flops_profiler_module_depth flops_profiler_output_file flops_profiler_profile_step
    flops_profiler_recompute_fwd_factor flops_profiler_top_modules fp16_auto_cast fp16_enabled
    fp16_master_weights_and_gradients get_data_types gradient_accumulation_steps
    gradient_clipping gradient_predivide_factor initial_dynamic_scale is_deepcompile_enabled
    is_first_weights_partition_group is_sanity_checks_enabled load_universal_checkpoint log_level
    loss_scale managed_gradient_accumulation memory_breakdown optimizer_legacy_fusion
    optimizer_params postscale_gradients random_ltd_config random_ltd_enabled scheduler_name
    scheduler_params steps_per_print super_offload swap_tensor_config tensor_parallel_config
    torch_autocast_dtype torch_autocast_enabled torch_autocast_lower_precision_safe_modules
    train_batch_size train_micro_batch_size_per_gpu use_node_local_storage
    uses_parallelization_pass_only wall_clock_breakdown zenflow_config zero_allgather_bucket_size
    zero_allgather_partitions zero_allgather_sequential zero_allow_untested_optimizer
    zero_compute_grad_norm zero_contiguous_gradients zero_cpu_offload zero_elastic_checkpoint
    zero_force_ds_cpu_optimizer zero_gather_16bit_weights_on_model_save zero_hpz_partition_size
    zero_ignore_unused_parameters zero_legacy_stage1 zero_load_from_fp32_weights
    zero_log_trace_cache_warnings zero_max_live_parameters zero_max_reuse_distance
    zero_model_persistence_threshold zero_module_granularity_threshold
    zero_multi_rank_bucket_allreduce zero_offload_optimizer zero_offload_param zero_optimization
    zero_optimization_partition_gradients zero_optimization_partition_weights
    zero_optimization_stage zero_overlap_comm zero_param_persistence_threshold
    zero_parameter_alignment zero_partial_offload zero_prefetch_bucket_size
    zero_quantized_gradients zero_quantized_nontrainable_weights zero_quantized_weights
    zero_reduce_bucket_size zero_reduce_scatter zero_round_robin_gradients
    zero_save_muon_momentum_buffer_in_memory zero_sub_group_size zero_use_cpu_optimizer
    """.split()
)

_ALLREDUCE = (
    "DeepSpeed's gradient-reduction internals: rp_engine accumulates gradients on the host and, "
    "with data parallel, reduces them itself when the step closes (rp_engine/distributed.py); "
    "call engine.backward(loss) and engine.step() only"
)
_COMPILE = (
    "DeepSpeed's compiler integration (DeepCompile / AutoTP / AutoSP) is not supported: "
    "rp_engine runs the model's layers eagerly on its devices; leave compile out"
)
_MOE = "DeepSpeed-MoE expert parallelism is not supported (rp_engine trains MoE layers as dense)"
_DATA_EFFICIENCY = (
    "DeepSpeed's data-efficiency library (curriculum learning, random-LTD, data post-processing) "
    "is not supported: transform the batches in your own loader"
)

# name -> why rp_engine does not provide it and what to use instead
GAPS: Mapping[str, str] = {
    **dict.fromkeys(
        (
            "all_gather_scalar allreduce_and_copy allreduce_bucket allreduce_gradients "
            "allreduce_no_retain buffered_allreduce_fallback sparse_all_gather sparse_allreduce "
            "sparse_allreduce_bucket sparse_allreduce_no_retain coalesce_grad_reduction "
            "data_parallel_group seq_data_parallel_group expert_data_parallel_group "
            "all_to_all_group get_sequence_parallel_group dist_backend use_ds_comm"
        ).split(),
        _ALLREDUCE,
    ),
    **dict.fromkeys(
        (
            "get_autosp_backend get_autotp_backend get_deepcompile_backend "
            "get_deepspeed_compile_backend "
            "get_compile_time register_compile_pass"
        ).split(),
        _COMPILE,
    ),
    **dict.fromkeys(
        "load_moe_state_dict print_forward_breakdown moe_layers gate_modules num_experts".split(),
        _MOE,
    ),
    **dict.fromkeys(
        (
            "random_ltd_initialize random_ltd_scheduler set_custom_curriculum_learning_schedule "
            "set_data_post_process_func"
        ).split(),
        _DATA_EFFICIENCY,
    ),
    "scale": (
        "a manual loss.backward() does not reach rp_engine's devices: the accumulation window "
        "runs as one schedule; call engine.backward(loss) instead of engine.scale(loss).backward()"
    ),
    "clip_fp32_gradients": (
        "clipping happens inside the optimizer step by the config's gradient_clipping; set it "
        "there instead of calling engine.clip_fp32_gradients()"
    ),
    "offload_states": (
        "rp_engine keeps weights, gradients and optimizer state on the host already (NVMe with "
        "the tiers); there is no device state to offload"
    ),
    "reload_states": (
        "rp_engine keeps weights, gradients and optimizer state on the host already (NVMe with "
        "the tiers); there is no device state to reload"
    ),
    "set_train_batch_size": (
        "the batch sizes are fixed at initialize (the plan is built for them): create a new "
        "engine with the new train_batch_size / gradient_accumulation_steps"
    ),
    "set_train_micro_batch_size": (
        "the batch sizes are fixed at initialize (the plan is built for them): create a new "
        "engine with the new train_micro_batch_size_per_gpu"
    ),
    "load_module_state_dict": (
        "the module's weights live in rp_engine's host store (fp32 masters beside them): load "
        "with engine.load_checkpoint(dir, load_module_only=True), or load the state_dict into the "
        "model before rp_engine.initialize"
    ),
    "get_optimizer_configuration": (
        "DeepSpeed's optimizer-construction helper: rp_engine builds its optimizer from the "
        "config's optimizer section (engine.optimizer, engine.basic_optimizer)"
    ),
    "flops_profiler": (
        "DeepSpeed's FlopsProfiler object is not built: use engine.last_step_stats() (bytes, "
        "busy seconds per device) and the wall_clock_breakdown timers"
    ),
    "checkpoint_engine": (
        "checkpoints are written by rp_engine/checkpoint (DeepSpeed's layout): use "
        "engine.save_checkpoint / load_checkpoint"
    ),
    "engine_timers": (
        "DeepSpeed's EngineTimers name lists: the timers themselves are engine.timers, their "
        "last values engine.get_wall_clock_timers()"
    ),
    "torch_autocast_z0_gradscaler": (
        "torch_autocast is not supported: rp_engine casts the module to the fp16/bf16 compute "
        "dtype as DeepSpeed's fp16/bf16 sections do"
    ),
}


class DeepSpeedGap(AttributeError):
    """A DeepSpeedEngine name rp_engine deliberately does not provide (:data:`GAPS`)."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"engine.{name}: DeepSpeedEngine's {name!r} is not provided by rp_engine: {GAPS[name]}"
        )
        self.name = name


class DeepSpeedConfigView:
    """DeepSpeed's own parsing of the config (``deepspeed.runtime.config.DeepSpeedConfig``), built
    at the first :meth:`accessor` call, and DeepSpeedEngine's config getters over it.

    The batch triplet is handed over as the micro-batch size and accumulation steps only, so
    DeepSpeed's world-size arithmetic agrees whatever process group exists; rp_engine's own
    ``roundpipe`` block is left out."""

    def __init__(self, raw: Mapping[str, Any], *, micro_batch: int, gas: int) -> None:
        self._raw = {
            **{k: v for k, v in raw.items() if k not in ("roundpipe", "train_batch_size")},
            "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": gas,
        }
        self._shim: Any = None

    def accessor(self, name: str) -> Callable[..., Any]:
        """``engine.<name>`` for a name of :data:`CONFIG_ACCESSORS`: a callable that parses the
        config on its first call (DeepSpeed is imported then)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            return getattr(self._engine_view(), name)(*args, **kwargs)

        call.__name__ = call.__qualname__ = name
        call.__doc__ = f"DeepSpeedEngine.{name}() over DeepSpeed's parsing of this config."
        return call

    def _engine_view(self) -> Any:
        if self._shim is None:
            from deepspeed.runtime.config import DeepSpeedConfig
            from deepspeed.runtime.engine import DeepSpeedEngine

            try:
                parsed = DeepSpeedConfig(dict(self._raw))
            except Exception as exc:  # a config rp_engine accepts and DeepSpeed does not
                raise ValueError(
                    f"DeepSpeed 0.19.8 cannot parse this config for its config getters ({exc}); "
                    "read the value from engine.config (the config dict) instead"
                ) from exc
            self._shim = _EngineShim(parsed, DeepSpeedEngine)
        return self._shim


class _EngineShim:
    """Just enough of a DeepSpeedEngine for its config getters: ``_config``, and the getters
    themselves bound to this object (some call each other)."""

    def __init__(self, parsed: Any, engine_cls: type) -> None:
        self._config = parsed
        self._engine_cls = engine_cls

    def __getattr__(self, name: str) -> Any:
        if name not in CONFIG_ACCESSORS:
            raise AttributeError(name)
        return getattr(self._engine_cls, name).__get__(self)
