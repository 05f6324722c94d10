"""``train_batch`` with overlapping iterations: the round-robin goes on across calls, no drain.

``train_batch`` t issues run t (``Executor.start``: every action queued on the devices' streams),
then finishes run t-1 (its end events; close_step(t-1), stats, timeline), then waits only for
run t's HEAD actions, whose losses it returns. Run t's backward tail, its gradient accumulation
and the optimizer keep running while the caller prepares the next batch, and run t+1's first
forward slots start on the next devices of the round-robin while they run::

    d0 COMPUTE  ...|B2.3 (t)|B1.3 (t)|          |F0.0 (t+1)|F1.0 (t+1)| ...
    d1 COMPUTE  ...|H.3 (t)|B3.3 (t)|   |F0.0 (t+1)| ...            (start device rolls on)
    host        ...acc (t) ........|close_step(t-1), opt(t-1) ... opt(t)
    train_batch t returns ^ (losses of t)     train_batch t+1 returns ^

What stays exact:
- Weights: iteration t+1 reads w_{t-1} (async) or w_t (sync) exactly. Async needs two weight
  versions at once: ``HostStore.double_buffer_weights`` (decided by free host memory, as the
  gradients' second arena); without it, w_{t-1} is published at run t's ``layer_ready`` and
  run t+1's first forward waits for run t's last backward of that layer (less overlap).
- Counters, LR schedule, loss scale: DeepSpeed's, advanced when ``train_batch`` returns (the
  step's hyper-parameters were frozen when it was issued, as without overlap).
- ``get_global_grad_norm()``, ``last_step_stats()`` and ``last_timeline()`` describe the step
  before the last one (run t is finished by the next call): one step late.
- Everything that reads weights or needs a quiet pipeline drains first (finishes the run in
  flight): ``synchronize()``, ``engine.module``, checkpoints, eval, the imperative
  forward/backward/step loop and ``destroy()``.

Not overlapped (each ``train_batch`` drains, as before): fp16 (the next step's loss scale
depends on this step's overflow), ``roundpipe.on_nonfinite`` "raise"/"skip" (whether the step is
skipped, which decides the LR schedule and the counters, is known only once all its gradients
have landed), profiling iterations (the re-plan reads their timing) and
``roundpipe.overlap_iterations: false``.

Failures: a device error in run t's tail surfaces at the next call that finishes it; the steps
in flight are then discarded (counted as skipped, weights as the last applied step) and the
engine goes on cleanly from there.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rp_engine.runtime.executor import Executor, RunHandle, RunSpec, RunStats

if TYPE_CHECKING:
    from rp_engine.config import DSConfig
    from rp_engine.data import DataFeed
    from rp_engine.device import DevicePool
    from rp_engine.monitor import Monitor
    from rp_engine.optim.nonfinite import NonFiniteGuard
    from rp_engine.optim.optimizer import HostOptimizer
    from rp_engine.optim.stepper import OptimizerStepper, StepResult
    from rp_engine.runtime.counters import StepCounters
    from rp_engine.runtime.executor import RunResult, TimelineRecord
    from rp_engine.runtime.planning import Planner

__all__ = ["PipelinedIterations", "InFlightBox"]

log = logging.getLogger("rp_engine")


@dataclass
class _InFlight:
    """A training run issued and not finished: its executor (a re-plan may have replaced the
    engine's), its handle, its step, and whether the counters already count that step."""

    executor: Executor
    handle: RunHandle
    step: int
    counted: bool = False


class InFlightBox:
    """The training run in flight, held apart from the engine: the shutdown finaliser
    (runtime/shutdown.py) holds this box, never the engine, and applies the step in flight when
    a script ends (or the engine is collected) without ``destroy()``."""

    def __init__(self) -> None:
        self.run: _InFlight | None = None

    def finish(self, stepper: OptimizerStepper) -> None:
        """Finish the run in flight and close its step (no engine bookkeeping: the counters
        and the LR already count it). Errors are dropped: the caller is shutting down."""
        run, self.run = self.run, None
        if run is None:
            return
        try:
            run.executor.finish(run.handle)
            stepper.close_step(step=run.step)
        except Exception as exc:  # noqa: BLE001 - shutdown goes on; the step is lost
            log.warning("the training step in flight could not be finished at shutdown: %r", exc)


class PipelinedIterations:
    """``train_batch`` of ``deepspeed.PipelineEngine``, with iterations that overlap."""

    _overlap = False  # set by the engine: whether train_batch may leave a run in flight
    _box: InFlightBox  # made by the engine before its finaliser

    @property
    def _inflight(self) -> _InFlight | None:
        return self._box.run

    @_inflight.setter
    def _inflight(self, run: _InFlight | None) -> None:
        self._box.run = run

    if TYPE_CHECKING:  # provided by RoundPipeEngine
        _config: DSConfig
        _counters: StepCounters
        _executor: Executor
        _feed: DataFeed
        _guard: NonFiniteGuard
        _last: StepResult | None
        _stats_open: RunStats
        _step_stats: RunStats | None
        _timeline: list[TimelineRecord]
        _carry: Any
        _carry_batch: Any
        global_steps: int
        global_samples: int
        micro_steps: int
        monitor: Monitor
        optimizer: HostOptimizer
        planner: Planner
        pool: DevicePool
        stepper: OptimizerStepper

        def _batch_of(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]: ...
        def _run(
            self, plan: Any, batches: list[Any], *, step: int, closes_step: bool, **kw: Any
        ) -> RunResult: ...
        def _apply_boundary(self, lr_kwargs: dict[str, Any] | None) -> bool: ...
        def _make_executor(self) -> Executor: ...
        def last_step_stats(self) -> dict[str, Any]: ...
        def _dp_mean(self, value: float) -> float: ...
        def gradient_accumulation_steps(self) -> int: ...
        def train(self, mode: bool = True) -> Any: ...

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over GAS micro-batches in one RoundPipe schedule; mean loss.

        With overlap on (see the module docstring) it returns once this step's losses are
        known, with the step's backward tail and optimizer still running."""
        self.stepper.check()
        self.train()
        gas = self.gradient_accumulation_steps()
        batches = [self._batch_of((b,), {}) for b in self._feed.take(data_iter, gas)]
        profile = self.planner.profile_left > 0
        if self._overlap and not profile:
            losses = self._issue_step(batches, gas)
        else:
            self._drain_pipeline()
            result = self._run(
                self.planner.plan(gas), batches, step=self.global_steps + 1, closes_step=True,
                grad_scale=self.optimizer.cur_scale / gas, profile=profile,
            )  # fmt: skip
            self._counters.whole_step(applied=self._apply_boundary(None))
            self._guard.raise_failed()
            self._after_run(result, profile)
            losses = result.losses
        loss = torch.tensor(self._dp_mean(sum(losses) / len(losses)))  # over dp ranks too
        self.monitor.write_events([("Train/Samples/train_loss", float(loss), self.global_samples)])
        return loss

    # --- the overlapped step --------------------------------------------------------------------
    def _issue_step(self, batches: list[Any], gas: int) -> list[float]:
        """Issue run t, finish run t-1, wait for run t's losses, advance the counters."""
        step = self.global_steps + 1
        self.stepper.open_step(step)
        spec = RunSpec(
            plan=self.planner.plan(gas), batches=batches,
            version=self.stepper.required_version(step), step=step, closes_step=True,
            grad_scale=self.optimizer.cur_scale / gas, microbatch_offset=self.micro_steps,
        )  # fmt: skip
        executor = self._executor
        previous = self._inflight
        try:
            handle = executor.start(spec)
        except BaseException:
            self._abort_pipeline()
            raise
        current = self._inflight = _InFlight(executor, handle, step)
        if previous is not None:
            self._complete(previous)  # run t-1 (its failure aborts run t as well)
        try:
            losses = executor.losses(handle)
        except BaseException:
            self._abort_pipeline()
            raise
        # DeepSpeed's counters and LR schedule at the boundary; the step itself closes when its
        # run is finished, by the next call (it cannot be skipped: no fp16, no guard here).
        self._counters.whole_step(applied=self._apply_boundary(None))
        current.counted = True
        return losses

    def _complete(self, inflight: _InFlight) -> None:
        """Finish an in-flight run and close its step (the counters already count it)."""
        try:
            result = inflight.executor.finish(inflight.handle)
        except BaseException:
            self._abort_pipeline(inflight)
            raise
        if self._inflight is inflight:
            self._inflight = None
        self._last = self.stepper.close_step(step=inflight.step)
        self._stats_open.add(result.stats)
        self._step_stats, self._stats_open = self._stats_open, RunStats()
        self._timeline = result.timeline
        self.monitor.write_step_stats(self.last_step_stats(), self.global_samples)
        self._after_run(result, profile=False)

    def _after_run(self, result: RunResult, profile: bool) -> None:
        """What the planner learns from a finished training run: the round size (budget) and,
        while profiling, the measured times (a better plan gets a new executor)."""
        self.planner.fit_round_size(result.boundary_bytes)
        if profile and self.planner.observe(result.layer_ms, result.bwd_ms):
            self._executor = self._make_executor()

    def _drain_pipeline(self) -> None:
        """Finish the run in flight, if any (before anything that needs a quiet pipeline)."""
        inflight = self._inflight
        if inflight is not None:
            self._complete(inflight)

    def _abort_pipeline(self, finishing: _InFlight | None = None) -> None:
        """A run failed with iterations in flight: stop everything, discard every open step's
        gradients, count the in-flight steps the counters already count (``finishing``, the run
        being finished, and the one in flight) as skipped, and go on from the last applied
        step's weights. The caller re-raises the error."""
        runs = {id(r): r for r in (finishing, self._inflight) if r is not None}
        self._inflight = None
        reason = RuntimeError("a training run failed; the steps in flight were discarded")
        self.stepper.cancel(reason)  # runtime threads waiting for a step that will not close
        self.stepper.store.fail(reason)  # uploads waiting for a version that will not come
        for device in self.pool.devices:
            with contextlib.suppress(Exception):
                device.reset()
        with contextlib.suppress(Exception):  # an optimizer failure stays, check() raises it
            self.stepper.wait_all()
        self.stepper.store.zero_grads()
        self._counters.skipped_steps += sum(r.counted for r in runs.values())
        self.stepper.restart(self.global_steps)
        self._guard.reset()
        self._carry = self._carry_batch = None
