"""DeepSpeed's engine surface that is pure bookkeeping: counters, accessors, checkpoint doors.

``DeepSpeedAccessors`` is the base class of ``RoundPipeEngine``, so core.py reads as the list
of parts it composes. It is given what it reads as one typed object, ``EngineParts`` (the
engine builds its parts, then calls ``DeepSpeedAccessors.__init__(self, EngineParts(...))``):
the parsed config, the ``StepCounters``, the module, the optimizer and its stepper, the host
store and NVMe tiers, the progress timers, the pipeline (the last step's result and stats) and
the exit finaliser. Everything here is a one-liner over those parts or over the few values it
owns itself (``training``, the ``no_sync()`` flag, the step last published to the module).
Checkpoint files are written and read by rp_engine/checkpoint/ (imported on first use: it pulls
in DeepSpeed).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rp_engine.engine.loop import LoopMisuseError
from rp_engine.engine.module_view import ModuleView
from rp_engine.engine.progress import Progress, ThroughputTimer, WallClockTimers
from rp_engine.model.host_store import HostStore
from rp_engine.runtime.counters import StepCounters
from rp_engine.storage.build import Tiers
from rp_engine.storage.optimizer_tier import OptimizerTier

if TYPE_CHECKING:
    import weakref

    from torch import nn

    from rp_engine.config import DSConfig
    from rp_engine.engine.pipeline import Pipeline
    from rp_engine.optim.optimizer import HostOptimizer
    from rp_engine.optim.stepper import OptimizerStepper
    from rp_engine.runtime.executor import TimelineRecord

__all__ = ["DeepSpeedAccessors", "EngineParts", "StepReport"]


@dataclass(frozen=True)
class StepReport:
    """One finished optimizer step, as ``engine.step_report()`` gives it (no waiting)."""

    step: int  # its global_steps number
    grad_norm: float | None  # get_global_grad_norm() of that step
    stats: dict[str, Any]  # last_step_stats() of that step
    timeline: list[TimelineRecord]  # last_timeline() of that step


log = logging.getLogger("rp_engine")


@dataclass(frozen=True, eq=False)
class EngineParts:
    """The engine's parts that DeepSpeed's accessors read, built by ``RoundPipeEngine.__init__``
    (core.py: ``_wire`` makes most of them) and given to ``DeepSpeedAccessors.__init__``. They
    are the very objects the engine holds under its own names (``engine.stepper`` is
    ``parts.stepper``...); this is the accessors' whole view of the engine."""

    config: DSConfig  # the parsed config (config/)
    module: nn.Module  # the model handed to initialize; ``engine.module`` shows it
    counters: StepCounters  # DeepSpeed's step counters and the accumulation boundary
    store: HostStore  # the host weights (materialized() reads NVMe-paged ones into RAM)
    host_optimizer: HostOptimizer  # what the engine drives (its param_groups: lr, betas...)
    client_optimizer: Any  # the optimizer object given to initialize, or None
    stepper: OptimizerStepper  # runs the optimizer steps; ``dp``: data parallel or None
    nvme_tier: OptimizerTier | None  # the optimizer state on NVMe, if swapped there
    tiers: Tiers  # every NVMe tier, as one (flushed by synchronize)
    progress: Progress  # DeepSpeed's timers and progress line (progress.py)
    pipeline: Pipeline  # the runs on the executor and the last step's record (pipeline.py)
    finalizer: weakref.finalize  # the exit shutdown (runtime/shutdown.py); dead after destroy


def _counter(name: str) -> property:
    """A DeepSpeed counter attribute (``engine.global_steps``...) backed by StepCounters."""

    def get(self: DeepSpeedAccessors) -> int:
        return int(getattr(self._parts.counters, name))

    def set_(self: DeepSpeedAccessors, value: int) -> None:  # checkpoint loading sets them
        setattr(self._parts.counters, name, value)

    return property(get, set_, doc=f"DeepSpeed's ``{name}`` counter.")


class DeepSpeedAccessors:
    """Accessors of ``deepspeed.DeepSpeedEngine`` over the engine's parts (``EngineParts``)."""

    mp_world_size = 1
    # DeepSpeed's engine attributes with one value here (no MoE, sequence or pipeline
    # parallelism across processes; gradients always averaged and reduced by the engine)
    sequence_parallel_size = 1
    has_moe_layers = False
    pipeline_parallelism = False
    gradient_average = True
    enable_backward_allreduce = True
    dont_change_device = False
    warn_unscaled_loss = True
    mpu = None  # no model-parallel unit: DeepSpeed's value when initialize gets none
    losses = None  # DeepSpeed's per-step loss holder (None after each step there too)
    loaded_checkpoint_dp_world_size: int | None = None
    loaded_checkpoint_mp_world_size: int | None = None

    micro_steps = _counter("micro_steps")
    global_steps = _counter("global_steps")
    global_samples = _counter("global_samples")
    skipped_steps = _counter("skipped_steps")

    def __init__(self, parts: EngineParts) -> None:
        self._parts = parts
        self.training = parts.module.training  # train() / eval() set it, as nn.Module's
        self._published_step = 0  # global_steps when the newest weights were last published
        self._in_no_sync = False  # inside ``no_sync()``: step() raises there, as DeepSpeed's

    # --- data parallel (distributed.py; one process per node drives every local device) ------
    @property
    def dp_world_size(self) -> int:
        dp = self._parts.stepper.dp
        return dp.world if dp is not None else 1

    world_size = dp_world_size

    @property
    def global_rank(self) -> int:
        dp = self._parts.stepper.dp
        return dp.rank if dp is not None else 0

    @property
    def local_rank(self) -> int:
        return (
            int(os.environ.get("LOCAL_RANK", "0") or 0) if self._parts.stepper.dp is not None else 0
        )

    def _dp_mean(self, value: float) -> float:
        """``value`` averaged over the data-parallel ranks (DeepSpeed's pipeline engine returns
        the loss of ``train_batch`` so)."""
        dp = self._parts.stepper.dp
        return dp.mean(value) if dp is not None else value

    def synchronize(self) -> None:
        """Finish the run and the optimizer steps in flight and publish the newest weights to
        the module; the NVMe tier's write-backs are on disk too."""
        self._parts.pipeline.drain()
        self._parts.stepper.synchronize()
        self._parts.tiers.flush()
        self._published_step = self.global_steps

    @property
    def module(self) -> nn.Module:
        """The model handed to ``initialize``, holding the newest weights.

        In async mode (or with overlapping iterations) the last optimizer step is still running
        when a training call returns (the model shows an earlier step). Then this is a view of
        the model (module_view.py) that waits for that step, and publishes it as
        ``synchronize()`` does, only when weights are read: a call, a method, a tensor. Its
        submodules and plain attributes (``engine.module.model``, ``.config``) are read without
        waiting. With nothing in flight it is the model itself.
        """
        if self._module_is_stale():
            return ModuleView(self._parts.module, self._publish_newest)  # type: ignore[return-value]
        return self._parts.module

    def _module_is_stale(self) -> bool:
        """Whether an optimizer step the module does not show yet may be in flight."""
        stale = self._parts.stepper.async_mode or self._parts.pipeline.inflight is not None
        # after destroy() the weights are already the newest
        return stale and self._published_step != self.global_steps and self._parts.finalizer.alive

    def _publish_newest(self) -> None:
        """Wait for the steps in flight and publish them to the module, if it is behind."""
        if self._module_is_stale():
            self.synchronize()

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The module's Parameter objects, without draining the optimizer (training loops such
        as Hugging Face Trainer's ask for them every step; their values are the last published
        ones: read ``engine.module`` for the newest)."""
        return self._parts.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """As :meth:`parameters`, with names."""
        return self._parts.module.named_parameters(*args, **kwargs)

    # --- counters and the boundary -------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch closes an optimizer step. With
        ``managed_gradient_accumulation: false`` the caller owns the boundary: only ``step()``
        is one, so this is False outside it (as DeepSpeed)."""
        if not self._parts.config.managed_gradient_accumulation:
            return False
        return self._parts.counters.is_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary of the next micro-batches (Hugging Face Accelerate sets it
        before each backward); refused with ``managed_gradient_accumulation: false``."""
        if not self._parts.config.managed_gradient_accumulation:
            raise LoopMisuseError(
                "set_gradient_accumulation_boundary() is not supported with "
                "managed_gradient_accumulation=false: the caller owns the boundary by calling "
                "step() (as DeepSpeed)"
            )
        self._parts.counters.boundary_override = is_boundary

    def was_step_applied(self) -> bool:
        return self._parts.counters.step_applied

    def get_global_grad_norm(self) -> float | None:
        """The last optimizer step's global gradient norm (unscaled, before clipping), as
        DeepSpeed's. With that step still in flight (overlapping ``train_batch`` calls) this
        finishes it first, a drain: read it at logging intervals, or use ``step_report()``."""
        self._parts.pipeline.drain()
        last = self._parts.pipeline.record.last
        return None if last is None else last.grad_norm

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self._parts.host_optimizer.param_groups]

    # --- config -----------------------------------------------------------------------------------
    def train_micro_batch_size_per_gpu(self) -> int:
        return self._parts.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._parts.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self._parts.config.train_batch_size

    def get_batch_info(self) -> tuple[int, int, int]:
        return (
            self.train_batch_size(),
            self.train_micro_batch_size_per_gpu(),
            self.gradient_accumulation_steps(),
        )

    def gradient_clipping(self) -> float:
        return self._parts.config.gradient_clipping

    def fp16_enabled(self) -> bool:
        return self._parts.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self._parts.config.bf16.enabled

    def zero_optimization_stage(self) -> int:
        return self._parts.config.zero.stage

    def steps_per_print(self) -> int | None:
        return self._parts.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self._parts.config.wall_clock_breakdown

    def dynamic_loss_scale(self) -> bool:
        """fp16's dynamic loss scaling (``loss_scale`` 0), as DeepSpeed's (whatever fp16)."""
        return self._parts.config.fp16.loss_scale == 0

    def managed_gradient_accumulation(self) -> bool:
        return self._parts.config.managed_gradient_accumulation

    def dataloader_drop_last(self) -> bool:
        return self._parts.config.dataloader_drop_last

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: the config's, else the compute dtype."""
        named = self._parts.config.communication_data_type
        if named is not None:
            return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(named, torch.float32)
        if self.fp16_enabled():
            return torch.float16
        return torch.bfloat16 if self.bfloat16_enabled() else torch.float32

    def optimizer_name(self) -> str | None:
        """The client optimizer's class name, else the config's optimizer type (lower case, as
        DeepSpeed's parsed config has it)."""
        if self._parts.client_optimizer is not None:
            return type(self._parts.client_optimizer).__name__
        opt = self._parts.config.optimizer
        return None if opt is None else opt.type.lower()

    def get_mom(self) -> list[Any]:
        """Each group's momentum (SGD, RMSprop) or Adam betas, as DeepSpeed's."""
        key = "momentum" if (self.optimizer_name() or "").lower() in ("sgd", "rmsprop") else "betas"
        return [g.get(key, 0.0) for g in self._parts.host_optimizer.param_groups]

    def get_type(self) -> list[Any]:
        return [g.get("type", 0.0) for g in self._parts.host_optimizer.param_groups]

    def get_wall_clock_timers(self) -> dict[str, float]:
        """The wall clock timers' last values in ms (with ``wall_clock_breakdown``; engine/
        progress.py says what they cover)."""
        return self._parts.progress.wall_clock_cache

    # --- DeepSpeed's engine attributes over this engine's parts --------------------------------
    @property
    def tput_timer(self) -> ThroughputTimer:
        """DeepSpeed's throughput timer (``update_epoch_count()``, ``avg_samples_per_sec()``...)."""
        return self._parts.progress.tput_timer

    @property
    def timers(self) -> WallClockTimers:
        """DeepSpeed's ``SynchronizedWallClockTimer``: ``timers(name).start()/stop()/elapsed()``."""
        return self._parts.progress.timers

    @property
    def engine_timers_cache(self) -> dict[str, float]:
        return self._parts.progress.wall_clock_cache

    @property
    def inside_no_sync_ctxt(self) -> bool:
        return self._in_no_sync

    @property
    def seq_dp_world_size(self) -> int:
        return self.dp_world_size

    def get_data_parallel_rank(self) -> int:
        return self.global_rank

    def get_model_parallel_rank(self) -> int:
        return 0  # no tensor or pipeline model parallelism across processes

    def get_tensor_parallel_rank(self) -> int:
        return 0

    @property
    def is_compiled(self) -> bool:
        return False  # DeepSpeed's engine.compile() is not supported (ds_surface.GAPS)

    def is_deepcompile_active(self) -> bool:
        return False

    def empty_partition_cache(self) -> None:
        """Nothing is partitioned: no cache to empty (DeepSpeed's call is a no-op then too)."""

    def collect_python_gc(self) -> int:
        """Run Python's cyclic garbage collector now (DeepSpeed's safe-boundary hook)."""
        return gc.collect()

    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        return isinstance(obj, torch.utils.data.IterableDataset)

    def deepspeed_io(
        self, dataset: Any, batch_size: int | None = None, route: str = "train",
        pin_memory: bool = True, data_sampler: Any = None, collate_fn: Any = None,
        num_local_io_workers: int | None = None,
    ) -> Any:  # fmt: skip
        """DeepSpeed's loader over ``dataset`` (as ``initialize(training_data=)`` builds it):
        the micro-batch size, ``dataloader_drop_last`` and a distributed sampler. A batch size
        other than the micro-batch size, a sampler or workers are refused, naming the fix."""
        from rp_engine.data import build_dataloader

        mbs = self.train_micro_batch_size_per_gpu()
        if (batch_size not in (None, mbs)) or data_sampler is not None or num_local_io_workers:
            raise ValueError(
                f"deepspeed_io(batch_size={batch_size}, data_sampler={data_sampler!r}, "
                f"num_local_io_workers={num_local_io_workers}): rp_engine's loader takes "
                f"micro-batches of train_micro_batch_size_per_gpu ({mbs}) with its own sampler in "
                "this process; build a torch DataLoader yourself for anything else"
            )
        return build_dataloader(dataset, self._parts.config, collate_fn)

    def module_state_dict(
        self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """The module's state_dict with the newest weights (waits for a step in flight)."""
        self.synchronize()
        with self._parts.store.materialized(writable=False):  # weights on NVMe: read into RAM here
            sd = self._parts.module.state_dict(
                destination=destination, prefix=prefix, keep_vars=keep_vars
            )
        if exclude_frozen_parameters:
            for name, p in self._parts.module.named_parameters():
                if not p.requires_grad:
                    sd.pop(prefix + name, None)
        return sd

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's deprecated name of :meth:`save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    def zero_nvme_offload_optimizer(self) -> bool:
        """Whether the optimizer state is swapped to NVMe (rp_engine's optimizer tier)."""
        return self._parts.nvme_tier is not None

    # --- modes --------------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> Any:
        self._parts.module.train(mode)
        self.training = mode
        return self

    def eval(self) -> Any:
        return self.train(False)

    def zero_grad(self) -> None:
        """DeepSpeed clears gradients itself after each step; accumulation buffers live on the
        host and are cleared by the optimizer step, so this is a no-op between micro-batches."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DeepSpeed's context without gradient reduction for the backwards inside it: refused
        with ZeRO stage 2/3 and when nested, and ``step()`` inside it raises, as DeepSpeed's.
        Within one process there is nothing to reduce; with data parallel the reduction
        happens when the step closes (distributed.py), outside the context by rule."""
        stage = self._parts.config.zero.stage
        if stage >= 2:
            raise LoopMisuseError(
                f"no_sync context manager is incompatible with gradient partitioning logic of "
                f"ZeRO stage {stage} (as DeepSpeed); use zero_optimization.stage 0 or 1, or "
                "simply leave it out: rp_engine accumulates on the host either way"
            )
        if self._in_no_sync:
            raise LoopMisuseError("no_sync context manager reentry is unsupported")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    # --- what the last step did ------------------------------------------------------------------
    def last_step_stats(self) -> dict[str, Any]:
        """What the last optimizer step moved and computed, measured by the devices: bytes
        each way (all, weights, gradients, activations), weight uploads, wall seconds of its
        runs, and per device the compute busy seconds (CUDA: timing events on the compute
        stream) and busy fraction. Empty before the first step. Finishes a step in flight
        first, as ``get_global_grad_norm()`` does."""
        self._parts.pipeline.drain()
        return self._parts.pipeline.record.stats_dict()

    def last_timeline(self) -> list[TimelineRecord]:
        """Every stream's spans of the last run: device, action text, start/end s, stream.
        Finishes a step in flight first, as ``get_global_grad_norm()`` does."""
        self._parts.pipeline.drain()
        return list(self._parts.pipeline.record.timeline)

    def step_report(self) -> StepReport | None:
        """The newest *finished* step's norm, stats and timeline, without waiting: with
        overlapping iterations that is the step before the last call's (``report.step`` says
        which), so a logger can label it right and keep the overlap. None before the first."""
        record = self._parts.pipeline.record
        last = record.last
        if last is None:
            return None
        return StepReport(last.step, last.grad_norm, record.stats_dict(), list(record.timeline))

    # --- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(
        self, save_dir: str, tag: str | None = None, client_state: dict[str, Any] | None = None,
        save_latest: bool = True, exclude_frozen_parameters: bool = False,
    ) -> bool:  # fmt: skip
        self.synchronize()
        dp = self._parts.stepper.dp
        # data parallel: rank 0 writes the whole state (the one-process layout, any world size
        # loads it), the owners' optimizer shards gathered onto it for the write
        writes = dp is None or dp.gather_state(self._parts.host_optimizer)
        ok = False
        try:
            if writes:  # streamed layer by layer out of the NVMe tiers (checkpoint/writer.py)
                _ckpt().save(
                    self, save_dir, tag=tag, client_state=client_state or {},
                    save_latest=save_latest, exclude_frozen=exclude_frozen_parameters,
                )  # fmt: skip
            ok = True
        finally:
            if dp is not None:
                dp.drop_foreign_state(self._parts.host_optimizer)
                dp.all_ok(ok, "save_checkpoint")
        return True

    def load_checkpoint(
        self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
        load_module_only: bool = False, custom_load_fn: Any = None, *,
        trust_checkpoint: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]:  # fmt: skip
        """DeepSpeed's load_checkpoint. Files load with ``weights_only=True`` (DeepSpeed-written
        ones too, through an allowlist of its classes); a file holding any other Python global is
        refused unless ``trust_checkpoint=True``, which unpickles it fully (only for files you
        trust: unpickling can run code)."""
        self.synchronize()
        with self._parts.store.materialized(writable=True):  # the NVMe tier is refilled from it
            loaded = _ckpt().load(
                self, load_dir, tag=tag, strict=load_module_strict,
                optimizer_states=load_optimizer_states and not load_module_only,
                scheduler_states=load_lr_scheduler_states and not load_module_only,
                module_only=load_module_only, trust=trust_checkpoint,
            )  # fmt: skip
        if self._parts.stepper.dp is not None:  # any world size: keep the state of the owned layers
            self._parts.stepper.dp.drop_foreign_state(self._parts.host_optimizer)
        return loaded

    def save_16bit_model(
        self,
        save_dir: str,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        self.synchronize()
        with self._parts.store.materialized(writable=False):  # weights on NVMe: read into RAM here
            return _ckpt().save_16bit(
                self, save_dir, save_filename, exclude_frozen=exclude_frozen_parameters
            )

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's flag (``stage3_gather_16bit_weights_on_model_save``), which Hugging Face
        reads to choose between saving model files and a full checkpoint. The weights here are
        never partitioned, so either way costs no gather."""
        return self._parts.config.zero.stage3_gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor]:
        """The module's whole state_dict in the compute dtype, newest weights (DeepSpeed's
        ZeRO-3 gather; Hugging Face's save path calls it)."""
        self.synchronize()
        with self._parts.store.materialized(writable=False):  # weights on NVMe: read into RAM here
            state = self._parts.module.state_dict()  # its tensors keep that RAM after the block
        if exclude_frozen_parameters:
            for name, p in self._parts.module.named_parameters(remove_duplicate=False):
                if not p.requires_grad:
                    state.pop(name, None)
        return state


def _ckpt() -> Any:
    # Imported on first use: checkpointing pulls in DeepSpeed's modules, which cost seconds.
    from rp_engine import checkpoint

    return checkpoint
