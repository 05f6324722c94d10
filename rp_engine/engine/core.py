"""RoundPipeEngine: DeepSpeed's engine API over the RoundPipe runtime. It wires, it holds no algorithm.

Parts, each owned elsewhere::

    config.DSConfig --> Planner (cuts, plans)        --> Executor (runs plans on the DevicePool)
    model --> LayerSequence --> HostStore (weights, masters, grads, versions) <-- OptimizerStepper
    host_optimizer: HostOptimizer (DeepSpeedCPUAdam kernel per layer), LR scheduler, LossScaler
    checkpoint/ (DeepSpeed layout), monitor.py (W&B / CSV)

and the engine's own parts, which DeepSpeed's methods delegate to (the package docstring has
who calls whom): ``engine.loop`` (WindowRunner, loop.py) --> ``engine.pipeline`` (Pipeline,
pipeline.py; its ``record``, record.py) --> ``engine.boundary`` (Boundary, boundary.py).

Two ways to train, with identical gradients and the same schedule:
- ``loss = engine(batch); engine.backward(loss); engine.step()`` (DeepSpeed's loop: ``step()``
  after every micro-batch, boundary every GAS micro-batches; the window's micro-batches are
  queued and run as one RoundPipe schedule at the boundary, loop.py);
- ``loss = engine.train_batch(data_iter)`` (PipelineEngine API; all GAS micro-batches in one
  call).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from rp_engine.autotune import ProfileCheck
from rp_engine.config import DSConfig
from rp_engine.config.errors import _NoOptimizerError
from rp_engine.data import DataFeed, WindowLoader, build_dataloader
from rp_engine.device import make_devices
from rp_engine.device.cuda import pin as cuda_pin
from rp_engine.device.cuda import pinned_empty
from rp_engine.distributed import data_parallel, dp_world
from rp_engine.engine.api import DeepSpeedAccessors, EngineParts
from rp_engine.engine.boundary import Boundary, boundary_in_flight_ok
from rp_engine.engine.ds_surface import CONFIG_ACCESSORS, GAPS, DeepSpeedConfigView, DeepSpeedGap
from rp_engine.engine.loop import LoopMisuseError, WindowRunner
from rp_engine.engine.module_view import view_or_value
from rp_engine.engine.pipeline import Pipeline
from rp_engine.engine.prefetch import ReadyGate
from rp_engine.engine.progress import (
    BACKWARD_GLOBAL,
    BACKWARD_MICRO,
    FORWARD_GLOBAL,
    FORWARD_MICRO,
    STEP_GLOBAL,
    STEP_MICRO,
    Progress,
    TimerFlags,
)
from rp_engine.engine.record import StepRecord
from rp_engine.host.affinity import available_cores, pin_pipeline, pin_process, split_cores
from rp_engine.host_preflight import TierFit, check_tiers
from rp_engine.model.batches import BatchAdapter, compute_dtype
from rp_engine.model.host_store import HostStore
from rp_engine.model.layers import LayerSequence, to_layers, uses_dropout
from rp_engine.model.module import Layering
from rp_engine.monitor import Monitor
from rp_engine.optim.build import (
    build_optimizer,
    build_scheduler,
    has_optimizer,
    returned_optimizer,
)
from rp_engine.optim.nonfinite import NonFiniteGuard
from rp_engine.optim.stepper import OptimizerStepper, staleness_compensation
from rp_engine.plan.host_ram import HostRam, PoolCounts
from rp_engine.plan.schedules import SCHEDULES
from rp_engine.runtime.counters import StepCounters
from rp_engine.runtime.executor import Executor, GradSink, RunResult, staging_pools
from rp_engine.runtime.planning import ModelShape, Planner
from rp_engine.runtime.shutdown import watch
from rp_engine.storage.build import (
    Tiers,
    build_grad_tier,
    build_optimizer_tier,
    build_param_tier,
    grad_buffer_count,
    wants_optimizer_tier,
    wants_param_tier,
)
from rp_engine.storage.grad_tier import GradTier
from rp_engine.storage.heap import bound_heap
from rp_engine.storage.optimizer_tier import OptimizerTier
from rp_engine.storage.param_tier import ParamTier

__all__ = ["RoundPipeEngine"]

log = logging.getLogger("rp_engine")


class RoundPipeEngine(DeepSpeedAccessors):
    """Drop-in for ``deepspeed.DeepSpeedEngine`` (build it with ``rp_engine.initialize``); the
    imperative loop is in loop.py, accessors and checkpoint doors in api.py; the runs on the
    executor (train_batch's overlapping iterations) are ``engine.pipeline`` (pipeline.py), the
    optimizer boundary ``engine.boundary`` (boundary.py)."""

    boundary: Boundary  # the optimizer boundary (boundary.py), made last in __init__
    pipeline: Pipeline  # the runs on the executor, drained or in flight (pipeline.py)

    def __init__(
        self,
        *,
        model: nn.Module,
        config: DSConfig,
        optimizer: Any = None,
        model_parameters: Any = None,
        lr_scheduler: Any = None,
        training_data: Any = None,
        collate_fn: Any = None,
    ) -> None:
        cfg, rp = config, config.roundpipe
        self._config = cfg
        self.config = dict(cfg.raw)
        summary = cfg.offload_summary()
        if summary:  # the user must know their ZeRO settings do not do what they say
            log.warning(summary)
        # DeepSpeed casts the module at initialize; the host copy *is* the compute weights.
        model.to(compute_dtype(cfg))
        self._module = model  # read through the `module` property, which waits for the optimizer
        budget = int(rp.device_memory_gb * 2**30) if rp.device_memory_gb else None
        self.pool = make_devices(
            rp.devices, pcie_gbps=rp.pcie_gbps, capacity_bytes=budget,
            meter_cpu_compute=rp.meter_cpu_compute,
        )  # fmt: skip
        try:
            scheduler = self._wire(cfg, model, optimizer, model_parameters, lr_scheduler, budget)
            loader = (
                None if training_data is None else build_dataloader(training_data, cfg, collate_fn)
            )
            self._feed = DataFeed(loader)  # train_batch reads its windows itself
            # the loop's loader announces each window ahead: loss reads cost nothing (data.py)
            self.training_dataloader = (
                None
                if loader is None
                else WindowLoader(
                    loader, ahead=self._window_ahead, announce=self.expect_micro_batches
                )
            )
            self.monitor = Monitor.from_config(cfg)
        except BaseException:
            # a bad model/config must not leave device or optimizer threads behind
            if hasattr(self, "stepper"):
                self.stepper.close()
            Tiers(
                getattr(self, "nvme_tier", None), getattr(self, "grad_tier", None),
                getattr(self, "param_tier", None),
            ).close()  # fmt: skip
            self.pool.close()
            raise
        self._counters = StepCounters(cfg.gradient_accumulation_steps, cfg.train_batch_size)
        # DeepSpeed's names for what initialize was given
        self.client_lr_scheduler = lr_scheduler
        self.training_data = training_data
        self.collate_fn = collate_fn
        self._progress = Progress(
            steps_per_print=cfg.steps_per_print, wall_clock_breakdown=cfg.wall_clock_breakdown,
            batch_size=cfg.train_batch_size, flags=TimerFlags.from_raw(cfg.raw),
            rank0=self.stepper.dp is None or self.stepper.dp.rank == 0,
            memory=self._device_memory,
        )  # fmt: skip
        if cfg.steps_per_print:  # progress asked for: the plan is its first line
            layers = f"{self.seq.kind}, {len(list(self.seq.modules()))} layers"
            self._progress.note(f"rp_engine plan ({layers}): {self.planner.summary()}")
        # DeepSpeed's config getters answered by DeepSpeed itself (ds_surface.py)
        self._ds_view = DeepSpeedConfigView(
            cfg.raw, micro_batch=cfg.train_micro_batch_size_per_gpu,
            gas=cfg.gradient_accumulation_steps,
        )  # fmt: skip
        self.boundary = Boundary(
            optimizer=self.host_optimizer, scheduler=scheduler, stepper=self.stepper,
            counters=self._counters, guard=self._guard, progress=self._progress,
            monitor=self.monitor, steps_per_print=cfg.steps_per_print,
            batch_size=cfg.train_batch_size, momentum=self.get_mom,
        )  # fmt: skip
        self.pipeline = Pipeline(
            make_executor=self._make_executor, stepper=self.stepper, planner=self.planner,
            optimizer=self.host_optimizer, boundary=self.boundary, counters=self._counters,
            guard=self._guard, progress=self._progress,
            record=StepRecord(tiers=self.tiers, monitor=self.monitor, counters=self._counters),
            module=model, layers=self.seq.modules,
            gas=cfg.gradient_accumulation_steps, overlap=self._overlap, autotune=self._autotune,
        )  # fmt: skip
        self.device = self.pool[0].torch_device
        self.loop = WindowRunner(
            pipeline=self.pipeline, planner=self.planner, stepper=self.stepper,
            optimizer=self.host_optimizer, counters=self._counters, guard=self._guard,
            batches=self._batches, batch_of=self._batch_of, module=model, device=self.device,
            gate=self._gate, gas=cfg.gradient_accumulation_steps,
            managed=cfg.managed_gradient_accumulation, overlap=self._overlap,
        )  # fmt: skip
        self.pipeline.on_abort = self.loop.window_lost  # the loop's open window is lost with it
        self._finalizer = watch(
            self, stepper=self.stepper, pool=self.pool, inflight=self.pipeline.box,
            tier=self.tiers,
        )  # fmt: skip
        # Last: DeepSpeed's accessors (api.py) get the parts they read; this also marks the
        # engine as fully built (attribute fall-through needs that).
        DeepSpeedAccessors.__init__(
            self,
            EngineParts(
                config=cfg, module=model, counters=self._counters, store=self.store,
                host_optimizer=self.host_optimizer, client_optimizer=optimizer,
                stepper=self.stepper, nvme_tier=self.nvme_tier, tiers=self.tiers,
                progress=self._progress, pipeline=self.pipeline, finalizer=self._finalizer,
            ),
        )  # fmt: skip

    def _wire(
        self, cfg: DSConfig, model: nn.Module, optimizer: Any, model_parameters: Any,
        lr_scheduler: Any, budget: int | None,
    ) -> Any:  # fmt: skip
        """Compose the parts: layers, host store, optimizer, stepper, planner, executor.
        Returns the LR scheduler (the boundary's, made once the counters and logs are).

        Without an optimizer (``has_optimizer``) the engine is forward-only, as DeepSpeed's:
        no masters, gradient buffers, optimizer tier, scheduler or second weight buffer."""
        rp = cfg.roundpipe
        trains = has_optimizer(cfg, optimizer)
        self.seq: LayerSequence = to_layers(
            model, loss_fn=getattr(model, "loss_fn", None), head_chunk_tokens=rp.head_chunk_tokens,
            split_points=rp.split_points,
        )  # fmt: skip
        self.layering = self.seq.layering or Layering("shape", f"a {self.seq.kind} model")
        modules = list(self.seq.modules())
        on_cuda = self.pool.kind == "cuda"
        nvme = wants_optimizer_tier(cfg) and trains
        # fp32 gradients in a bounded pool spilling beside the optimizer tier (grad_tier.py)
        grad_buffers = grad_buffer_count(cfg, trains=trains, num_devices=len(self.pool))
        self.store = HostStore(
            modules,
            pin=cuda_pin if on_cuda else None,
            alloc=pinned_empty if on_cuda else None,  # uninitialised: written before read
            paged_masters=nvme,  # masters and moments live on NVMe (storage/optimizer_tier.py)
            trainable=trains,
            grad_pool=grad_buffers > 0,
        )
        # a sync-only schedule (the Mobius baseline) steps synchronously, as Mobius does
        async_mode = rp.async_optimizer and not SCHEDULES[rp.schedule].sync_only and trains
        self.host_ram: HostRam | None = None  # predicted with the tiers (host_preflight.py)
        # the NVMe pools' buffers (the config's, or fewer to fit the limit that binds), their
        # predicted host RAM and the least the run can work with
        self.tier_fit: TierFit | None = None
        counts: PoolCounts | None = None
        if wants_optimizer_tier(cfg) or wants_param_tier(cfg):
            fit = check_tiers(
                self.store, cfg, devices=len(self.pool), grad_buffers=grad_buffers,
                weight_copies=2 if async_mode else 1,
                device_bytes=budget or 0, cpu_devices=self.pool.kind == "cpu",
            )  # fmt: skip
            self.tier_fit, self.host_ram, counts = fit, fit.need, fit.counts
            grad_buffers = counts.grad
            # large freed blocks go back to the OS, not into malloc's arenas: the host memory
            # the tiers bound is what is alive (storage/heap.py)
            bound_heap()
        self.host_optimizer = build_optimizer(
            cfg, self.store, model=model, client_optimizer=optimizer,
            model_parameters=model_parameters, device_kind=self.pool.kind,
        )  # fmt: skip
        self.nvme_tier: OptimizerTier | None = None
        if nvme:
            self.host_optimizer.journal = None  # its undo copies are what the tier moves out
            self.nvme_tier = build_optimizer_tier(
                cfg, self.store, self.host_optimizer, rank=0,
                data_parallel=dp_world() > 1,
                buffer_count=counts.optimizer if counts else None,
                slice_bytes=counts.optimizer_slice if counts else None,
            )  # fmt: skip
            self.store.pager = self.nvme_tier
        self.grad_tier: GradTier | None = None
        if grad_buffers and counts is not None and counts.optimizer_slice:
            # the gradients in records of the optimizer's slices' elements, whole parameters
            self.store.slice_grads(counts.optimizer_slice // 12)
        if grad_buffers:
            self.grad_tier = build_grad_tier(
                cfg, self.store, buffer_count=grad_buffers, rank=0,
                alloc=(lambda n: pinned_empty(n, torch.uint8)) if on_cuda else None,
            )  # fmt: skip
            # each device's host thread and the optimizer's may wait for a buffer while holding
            # a layer's lock: that many buffers are kept from the direct landings
            self.store.use_grad_blocks(self.grad_tier, reserve=len(self.pool) + 1)
        # DeepSpeed's names: the caller's optimizer argument, and the unwrapped optimizer (the
        # client's own object when one was given) that ``self.host_optimizer`` drives
        self.client_optimizer = optimizer
        self.basic_optimizer = self.host_optimizer.optimizer if trains else None
        # what DeepSpeed's engine.optimizer is (and initialize returns): the client's object
        # itself at ZeRO-0 fp32, else the wrapper; the engine itself drives host_optimizer
        self.optimizer = returned_optimizer(
            self.host_optimizer, cfg, client_given=optimizer is not None
        )
        scheduler = build_scheduler(cfg, self.host_optimizer, client_scheduler=lr_scheduler)
        dp = data_parallel(self.store)  # None in one process
        self.cores = split_cores(
            rp.optimizer_cores, cores=available_cores(), device_kind=self.pool.kind,
            num_devices=len(self.pool), processes=dp_world(),
        )  # fmt: skip
        if self.cores.active:
            self._cores_before = available_cores()  # given back by destroy
            log.info("host cores: %s (roundpipe.optimizer_cores)", self.cores.describe())
            pin_pipeline(self.cores)  # before the optimizer thread takes its own cores
        self.stepper = OptimizerStepper(
            self.store,
            self.host_optimizer,
            clip=cfg.gradient_clipping,
            async_mode=async_mode,
            fp16=cfg.fp16.enabled,
            guard_nonfinite=rp.on_nonfinite != "ignore",
            dp=dp,
            compensation=staleness_compensation(
                rp.staleness_compensation, async_mode=async_mode,
                can_predict=self.host_optimizer.can_predict, data_parallel=dp is not None,
            ),
            cores=self.cores,
        )  # fmt: skip
        self._guard = NonFiniteGuard(rp.on_nonfinite, fp16=cfg.fp16.enabled)
        # overlap applies boundaries in flight (boundary.py); async overlap wants two
        # weight versions at once, when host memory allows. Data parallel: collectives assume
        # one open step; the step journal's undo likewise: it goes at the first overlapped
        # train_batch or loop window; an explicit "on" wins over overlap
        can_skip = cfg.fp16.enabled or self._guard.active  # a step may close skipped, late
        in_flight = boundary_in_flight_ok(scheduler, can_skip=can_skip)
        wanted = rp.overlap_iterations is not False
        # CPU devices draw dropout masks from torch's one CPU generator, which the caller's code
        # uses between train_batch calls (a shuffling sampler's seed, torch.randint batches): a
        # run in flight would race with it (its backward's recomputed masks differ from its
        # forward's, and the caller's stream is rewound by the scope's restore), so it drains
        self._dropout = uses_dropout(model)  # the executor seeds each layer's RNG then
        shared_rng = self.pool.kind == "cpu" and self._dropout
        self._overlap = (
            wanted and in_flight and not shared_rng and self.stepper.dp is None
            and rp.step_journal != "on" and trains
        )  # fmt: skip
        if self.stepper.dp is not None:
            self.stepper.journal = None
        # with the parameter tier, the paged layers' second buffer lives on disk, not in RAM
        paged_weights = wants_param_tier(cfg)
        # delay compensation reads the weights a gradient was taken at from the second buffer
        if (self._overlap or self.stepper.delay is not None) and self.stepper.async_mode:
            self.store.double_buffer_weights(allocate=not paged_weights)
        if nvme and self.stepper.async_mode:
            # w_{t-1} is published when step t-1 ends, while the tier holds its masters, not at
            # iteration t's backward, when they are back on NVMe (optim/stepper.py)
            self.store.double_buffer_weights(True, allocate=not paged_weights)
        self.param_tier: ParamTier | None = None
        if paged_weights:  # compute weights on NVMe (storage/param_tier.py)
            self.param_tier = build_param_tier(
                cfg, self.store, rank=0, data_parallel=dp_world() > 1,
                buffer_count=counts.param if counts else None,
            )  # fmt: skip
            self.store.allocate_shadows()  # the layers max_in_cpu keeps in RAM
        self.tiers = Tiers(self.nvme_tier, self.grad_tier, self.param_tier)
        self.planner = Planner(
            ModelShape.from_sequence(self.seq, self.store),
            num_devices=len(self.pool),
            num_microbatches=cfg.gradient_accumulation_steps,
            schedule=rp.schedule,
            fwd_cuts=rp.fwd_cuts,
            bwd_cuts=rp.bwd_cuts,
            memory_budget_bytes=budget,
            profile_iterations=rp.profile_iterations,
            async_optimizer=self.stepper.async_mode,
            round_size=rp.round_size,
            link_gbps=rp.pcie_gbps,
            overlap_iterations=self._overlap,  # memory validated with two runs in flight
            # every upload reads its weights from NVMe first (a layer max_in_cpu keeps in RAM
            # has nothing to read: its READ is a no-op)
            nvme_slots=self.param_tier is not None,
            cuda=on_cuda,  # workspaces and allocator slack count on GPUs
            # the stages' weights the NVMe pools and staging were fitted to (host_preflight.py)
            stage_weight_bytes=counts.stage if counts and counts.stage else None,
        )
        # DeepSpeed's autotuning block: the first steps' profile against the advisor's cost
        # model, re-planning on a disagreement (autotune.py); None when not asked for
        self._autotune = ProfileCheck.for_engine(cfg.raw, model, cfg.train_micro_batch_size_per_gpu)
        # shared by every executor made; with the NVMe tiers held to the host-RAM model's share
        # (a download then waits for the host to add up earlier ones: speed, never results)
        staging = dict(self.host_ram.parts).get("download staging", 0) if self.host_ram else 0
        self._staging = staging_pools(self.pool.devices, budget=staging // len(self.pool))
        # the loop's prefetched windows hold their gradients here (read the stepper at each
        # call: tests and data parallel wrap its layer_ready)
        self._gate = ReadyGate(lambda layer, step: self.stepper.layer_ready(layer, step))
        self._batches = BatchAdapter(self.seq, compute_dtype(cfg), pin=self.pool.kind == "cuda")
        return scheduler

    # --- the parts' state under the names DeepSpeed code and the tests read ------------------
    @property
    def _executor(self) -> Executor:
        return self.pipeline.executor

    def expect_micro_batches(self, batches: list[Any]) -> None:
        """A hint: the next training forwards take these micro-batches, in this order (loop.py
        ``WindowRunner.expect_micro_batches``; Hugging Face's Trainer passes them)."""
        self.loop.expect_micro_batches(batches)

    def _window_ahead(self) -> int:
        return self.loop.window_ahead()

    @property
    def _prefetch(self) -> Any:
        """The imperative loop's announced window (prefetch.py ``Prefetch``), or None."""
        return self.loop.prefetch

    @property
    def _inflight(self) -> Any:
        """The training run in flight (pipeline.py ``_InFlight``), or None."""
        return self.pipeline.inflight

    @property
    def _eval_run(self) -> Callable[..., RunResult]:
        return self.pipeline.eval_run

    @_eval_run.setter
    def _eval_run(self, run: Callable[..., RunResult]) -> None:  # a test counts the calls
        self.pipeline.eval_run = run  # type: ignore[method-assign]

    @property
    def _reissue(self) -> Callable[..., None]:
        return self.pipeline.reissue

    @_reissue.setter
    def _reissue(self, reissue: Callable[..., None]) -> None:  # a test counts the calls
        self.pipeline.reissue = reissue  # type: ignore[method-assign]

    @property
    def lr_scheduler(self) -> Any:
        """The LR scheduler the boundary steps (DeepSpeed's ``engine.lr_scheduler``)."""
        return self.boundary.scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        self.boundary.scheduler = scheduler

    def _make_executor(self) -> Executor:
        return Executor(
            modules=list(self.seq.modules()),
            stages=self.planner.stages,
            devices=list(self.pool.devices),
            sink=GradSink(
                self.store,
                wait_free=lambda layer, step: self.stepper.wait_grads_free(layer, step),
                is_free=lambda layer, step: self.stepper.grads_free(layer, step),
                ready=self._gate,  # held while a prefetched window's factors are unchecked
            ),
            seed=self._config.roundpipe.seed,
            use_rng=self._dropout,
            staging=self._staging,
        )

    # --- DeepSpeed's imperative loop (loop.py), timed (engine/progress.py) -------------------
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.forward(*inputs, **kwargs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        progress = self._progress
        progress.tput_timer.start()  # as DeepSpeed's forward (its loader starts it otherwise)
        progress.start(FORWARD_MICRO, FORWARD_GLOBAL)
        try:
            return self.loop.forward(*inputs, **kwargs)
        finally:
            progress.stop(FORWARD_MICRO, FORWARD_GLOBAL)

    def backward(
        self, loss: Any, retain_graph: bool = False, scale_wrt_gas: bool = True, **kwargs: Any
    ) -> torch.Tensor:
        self._progress.start(BACKWARD_MICRO, BACKWARD_GLOBAL)
        try:
            self._need_optimizer("backward")
            return self.loop.backward(loss, retain_graph, scale_wrt_gas, **kwargs)
        finally:
            self._progress.stop(BACKWARD_MICRO, BACKWARD_GLOBAL)

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Called after every micro-batch; applies the optimizer at the accumulation boundary
        (with ``managed_gradient_accumulation: false``, at every call): loop.py."""
        managed = self._config.managed_gradient_accumulation
        boundary = self.is_gradient_accumulation_boundary() or not managed
        self._progress.start(STEP_MICRO, STEP_GLOBAL)
        try:
            self._need_optimizer("step")
            if self._in_no_sync:
                raise LoopMisuseError(
                    "It is illegal to call engine.step() inside the no_sync context manager "
                    "(as DeepSpeed): leave the `with engine.no_sync():` block first"
                )
            self.loop.step(lr_kwargs)
        finally:
            self._progress.stop(STEP_MICRO, STEP_GLOBAL)
        self._progress.after_step(boundary=boundary)

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over GAS micro-batches in one RoundPipe schedule; mean loss
        (``deepspeed.PipelineEngine``'s). With overlapping iterations (pipeline.py) it returns
        once this step's losses are known, its backward tail and optimizer still running."""
        self._progress.start_train_batch()
        self._need_optimizer("train_batch")
        self.stepper.check()
        self.train()
        gas = self.gradient_accumulation_steps()
        batches = [self._batch_of((b,), {}, fed=True) for b in self._feed.take(data_iter, gas)]
        losses = self.pipeline.train_step(batches)
        loss = torch.tensor(self._dp_mean(sum(losses) / len(losses)))  # over dp ranks too
        self.monitor.write_events([("Train/Samples/train_loss", float(loss), self.global_samples)])
        batch = self.train_batch_size()
        self._progress.after_train_batch(self.global_steps, float(loss), batch_size=batch)
        return loss

    def _device_memory(self) -> tuple[int, int]:
        """(allocated, peak allocated) bytes on the first compute device, for the throughput
        line's MemAllocated (0 on CPU devices, as DeepSpeed's CPU accelerator reports)."""
        if self.pool.kind != "cuda":
            return 0, 0
        return torch.cuda.memory_allocated(self.device), torch.cuda.max_memory_allocated(
            self.device
        )

    # --- PipelineEngine API (train_batch: pipeline.py) ----------------------------------------
    def eval_batch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Forward only over ``num_micro_batches`` (default GAS) micro-batches; mean loss."""
        if return_logits or not compute_loss:
            raise NotImplementedError(
                "eval_batch computes the loss in the fused LM head; logits are never materialised "
                "(use return_logits=False, compute_loss=True)"
            )
        n = num_micro_batches or self.gradient_accumulation_steps()
        batches = [self._batch_of((b,), {}, fed=True) for b in self._feed.take(data_iter, n)]
        was_training = self._module.training
        self.eval()
        try:
            losses = self.pipeline.eval_run(batches).losses
        finally:
            self.train(was_training)
        if reduce_output is None:
            return [torch.tensor(x) for x in losses]
        return torch.tensor(self._dp_mean(sum(losses) / len(losses)))  # mean over dp ranks too

    # --- internals ------------------------------------------------------------------------------
    def _need_optimizer(self, call: str) -> None:
        """Raise unless the engine can train: ``call`` ("backward", "step", "train_batch") of
        a forward-only engine (``initialize`` without an optimizer) fails first thing, as
        DeepSpeed's asserts (an AssertionError too), naming the missing section and the fix."""
        if not self.host_optimizer.empty:
            return
        raise _NoOptimizerError(
            f"engine.{call}() needs an optimizer, and initialize() was given none (no "
            '"optimizer" section in the config, no optimizer= argument): this engine runs '
            'forwards only (DeepSpeed: "must provide optimizer during init in order to use '
            f'{call}"). To train, add an "optimizer" section to the config (e.g. {{"type": '
            '"AdamW", "params": {"lr": 1e-4}}) or pass optimizer= to initialize()'
        )

    def _batch_of(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any], *, fed: bool = False
    ) -> dict[str, Any]:
        """One micro-batch's state: the arguments of ``engine(...)``, or with ``fed`` a
        micro-batch ``train_batch`` / ``eval_batch`` took from the data iterator (a module
        model's tuple is then its positional arguments: ``BatchAdapter.to_dict``)."""
        batch = self._batches.to_dict(inputs, kwargs, fed=fed)
        if self.planner.tokens is None:
            self._fit_tokens(batch)
        return batch

    def _fit_tokens(self, batch: dict[str, Any]) -> None:
        """The first micro-batch's size completes the memory rule (activations, attention,
        the LM head: ``Planner.fit_tokens``) before any plan of it is issued; new cuts get a
        new executor (nothing is in flight yet)."""
        ids = next((batch[k] for k in ("input_ids", "input", "inputs_embeds") if k in batch), None)
        if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
            return
        if self.planner.fit_tokens(int(ids.shape[0]), int(ids.shape[1])):
            self.pipeline.renew_executor()

    def destroy(self) -> None:
        """Finish in-flight steps, publish the newest weights, stop workers and devices.

        Optional: the same shutdown runs when the engine is collected or the process exits
        (runtime/shutdown.py). Idempotent. Under on_nonfinite "raise", a step found skipped
        late after the last training call (no call is left to raise it) is logged as an error.
        """
        try:
            self.pipeline.drain()  # the step in flight is applied, as without overlap
        finally:
            self.loop.discard_window()  # queued micro-batches no step() will close
            self._finalizer()  # InFlightBox.finish logs a late skip no call is left to raise
        self._published_step = self.global_steps
        self.pipeline.executor.close()
        self.monitor.close()
        before = self.__dict__.pop("_cores_before", None)
        if before is not None:  # the cores the split took from the caller's threads
            pin_process(before)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: fall through to the wrapped module, as DeepSpeed
        # does (engine.generate(...), engine.config attributes of HF models...).
        if name == "module" or name.startswith("__") or "_parts" not in self.__dict__:
            raise AttributeError(name)  # (also while __init__ runs: hasattr must not recurse)
        # DeepSpeedEngine's own names never reach the module: answered, or refused (ds_surface)
        if name in CONFIG_ACCESSORS:
            return self.__dict__["_ds_view"].accessor(name)
        if name in GAPS:
            raise DeepSpeedGap(name)
        module = self.__dict__["_module"]
        # What reads weights (methods: save_pretrained, state_dict, generate...; tensors) sees
        # the newest ones; plain attributes (config, dtype...) and submodules (model.model) do
        # not wait for the optimizer step in flight (module_view.py)
        return view_or_value(
            getattr(module, name), self._publish_newest, lambda: getattr(self.module, name)
        )
