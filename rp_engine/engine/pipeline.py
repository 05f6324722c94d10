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
  of the last call, as DeepSpeed's: they finish run t first (a drain, so a logger that reads
  them every step loses the overlap); ``step_report()`` gives the newest finished step (t-1)
  without waiting, labelled with its step (rp-train's W&B rows and HF Trainer's fast path
  read it that way: api.py, integrations/hf.py).
- Everything that reads weights or needs a quiet pipeline drains first (finishes the run in
  flight): ``synchronize()``, ``engine.module``, checkpoints, eval, a loss of the loop read
  before its window's boundary, and ``destroy()``. The imperative loop's window is issued the
  same way (``_issue``), at its boundary's ``backward``; its ``step()`` applies the boundary.

- Non-finite steps (``roundpipe.on_nonfinite`` "raise", the default, or "skip"): the boundary
  is applied in flight
  (boundary.py). A non-finite loss is known at once (skipped, raised from the same
  call, as drained); a non-finite gradient norm is known when the step closes, and the schedule
  and counters are put back to where DeepSpeed would have them; "raise" then raises from the
  next call.

- fp16: the same, and the next run, issued with the scale of before the overflow, is run
  again with the lowered scale (``_reissue``), as DeepSpeed would have run it.

Not overlapped (each ``train_batch`` drains, as before): profiling iterations (the re-plan reads
their timing), a scheduler that cannot be restored where steps can be skipped, a model with
dropout on CPU devices (their dropout draws from torch's one CPU generator, which the caller's
code between calls shares: core.py), and ``roundpipe.overlap_iterations: false``. On GPUs the
run in flight draws its dropout masks from each training GPU's default generator: random
numbers the caller draws between calls should come from the CPU or its own ``torch.Generator``.

Failures: a device error in run t's tail surfaces at the next call that finishes it; the steps
in flight are then discarded (counted as skipped, weights as the last applied step) and the
engine goes on cleanly from there.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from rp_engine.engine.boundary import BoundaryState
from rp_engine.runtime.executor import Executor, RunHandle, RunSpec, RunStats

if TYPE_CHECKING:
    from rp_engine.autotune import ProfileCheck
    from rp_engine.config import DSConfig
    from rp_engine.data import DataFeed
    from rp_engine.engine.progress import Progress
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
    engine's), its handle, its step, whether the counters already count that step, whether it is
    known to be skipped (a non-finite loss) and, when assumed applied under a non-finite guard,
    what its boundary changed (to undo if it closes skipped)."""

    executor: Executor
    handle: RunHandle
    step: int
    unit: float  # the run's grad_scale per unit of loss scale (1/GAS for train_batch)
    counted: bool = False
    skip: bool = False
    before: BoundaryState | None = None


class InFlightBox:
    """The training run in flight, held apart from the engine: the shutdown finaliser
    (runtime/shutdown.py) holds this box, never the engine, and applies the step in flight when
    a script ends (or the engine is collected) without ``destroy()``."""

    def __init__(self, guard: NonFiniteGuard) -> None:
        self.run: _InFlight | None = None
        self.guard = guard  # judges a step found skipped at shutdown (no call left to raise)

    def finish(self, stepper: OptimizerStepper) -> None:
        """Finish the run in flight and close its step (no engine bookkeeping: the counters
        and the LR already count it). A step skipped late, and any error still owed, is logged
        (``NonFiniteGuard.report_unraised``). Errors are dropped: the caller is shutting down."""
        run, self.run = self.run, None
        try:
            if run is not None:
                run.executor.finish(run.handle)
                result = stepper.close_step(step=run.step, skip=run.skip)
                if run.before is not None and result.overflow:  # skipped late
                    self.guard.conclude(run.step, result)
            self.guard.report_unraised()
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
        _progress: Progress
        _stats_open: RunStats
        _step_stats: RunStats | None

        def _close_nvme_window(self) -> None: ...

        _timeline: list[TimelineRecord]
        global_steps: int
        global_samples: int
        micro_steps: int
        monitor: Monitor
        host_optimizer: HostOptimizer
        planner: Planner
        stepper: OptimizerStepper
        _autotune: ProfileCheck | None

        def _batch_of(
            self, inputs: tuple[Any, ...], kwargs: dict[str, Any], *, fed: bool = False
        ) -> dict[str, Any]: ...
        def _need_optimizer(self, call: str) -> None: ...
        def _run(
            self, plan: Any, batches: list[Any], *, step: int, closes_step: bool, **kw: Any
        ) -> RunResult: ...
        def _apply_boundary(
            self, lr_kwargs: dict[str, Any] | None, *, in_flight: bool | None = None
        ) -> bool: ...
        def _boundary_state(self) -> BoundaryState: ...
        def _skipped_late(self, step: int, before: BoundaryState, result: StepResult) -> None: ...
        def _make_executor(self) -> Executor: ...
        def _sync_mode(self) -> None: ...
        def _stats_dict(self) -> dict[str, Any]: ...
        def _dp_mean(self, value: float) -> float: ...
        def _window_lost(self, error: BaseException) -> None: ...
        def _discard_prefetch(self) -> None: ...

        _prefetch: Any

        def gradient_accumulation_steps(self) -> int: ...
        def train(self, mode: bool = True) -> Any: ...

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over GAS micro-batches in one RoundPipe schedule; mean loss.

        With overlap on (see the module docstring) it returns once this step's losses are
        known, with the step's backward tail and optimizer still running."""
        self._need_optimizer("train_batch")
        self.stepper.check()
        self.train()
        gas = self.gradient_accumulation_steps()
        batches = [self._batch_of((b,), {}, fed=True) for b in self._feed.take(data_iter, gas)]
        profile = self.planner.profile_left > 0
        if self._overlap and not profile:
            # two open steps from here on, which the step journal's undo does not cover (it was
            # not asked for explicitly: core.py); the loop's overlapped window drops it too
            self.stepper.journal = None
            losses = self._issue_step(batches, gas)
        else:
            self._drain_pipeline()
            result = self._run(
                self.planner.plan(gas), batches, step=self.global_steps + 1, closes_step=True,
                grad_scale=self.host_optimizer.cur_scale / gas, profile=profile,
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
        losses = self._issue(batches, unit=1 / gas)
        self._counters.whole_step(applied=self._apply_in_flight(None))
        self._guard.raise_failed()  # this step's losses, or the previous step's late skip
        return losses

    def _issue(
        self, batches: list[Any], *, unit: float, factors: list[float] | None = None,
        first_microbatch: int | None = None, microbatches: list[int] | None = None,
        token_stats: bool = False,
    ) -> list[float]:  # fmt: skip
        """Issue run t (one whole step: it closes it), finish run t-1, wait for run t's losses
        (and the head's per-token statistics, ``token_stats``). The run's grad_scale is the loss
        scale times ``unit``; ``factors`` multiply it per micro-batch (the imperative loop's
        window). The boundary is applied by the caller (``_apply_in_flight``)."""
        step = self.global_steps + 1
        first = self.micro_steps if first_microbatch is None else first_microbatch
        self._sync_mode()  # (a run in flight was issued in the same mode: train_batch sets it)
        self.stepper.open_step(step)
        spec = RunSpec(
            plan=self.planner.plan(len(batches)), batches=batches,
            version=self.stepper.required_version(step), step=step, closes_step=True,
            grad_scale=self.host_optimizer.cur_scale * unit, factors=factors,
            microbatch_offset=first, microbatches=microbatches, token_stats=token_stats,
        )  # fmt: skip
        executor = self._executor
        previous = self._inflight
        try:
            handle = executor.start(spec)
        except BaseException:
            self._abort_pipeline()
            raise
        current = self._inflight = _InFlight(executor, handle, step, unit)
        if previous is not None:
            try:
                self._complete(previous)  # run t-1 (its failure aborts run t as well)
            except BaseException:
                self._abort_pipeline()
                raise
            if spec.grad_scale != self.host_optimizer.cur_scale * unit:  # t-1 overflowed (fp16)
                self._reissue(current, spec)
        try:
            losses = executor.losses(current.handle)  # (a reissued run has a new handle)
        except BaseException:
            self._abort_pipeline()
            raise
        self._guard.observe(losses, first, self.gradient_accumulation_steps())
        self._progress.observe_losses(losses)  # the progress line's loss (floats: nothing forced)
        current.skip = self._guard.force_skip()
        return losses

    def _apply_in_flight(self, lr_kwargs: dict[str, Any] | None) -> bool:
        """DeepSpeed's counters and LR schedule at the boundary of the run in flight, applied
        before its step closes: the next call finishes it (boundary.py). Returns whether the
        step counts as applied; the caller advances the counters."""
        current = self._inflight
        assert current is not None and not current.counted, "no issued step to count"
        if (self._guard.active or self.stepper.fp16) and not current.skip:
            current.before = self._boundary_state()  # its close may still skip it
        applied = self._apply_boundary(lr_kwargs, in_flight=current.skip)
        current.counted = True
        return applied

    def _uncounted_in_flight(self) -> bool:
        """Whether the run in flight is the open step's, its boundary not applied yet (the
        imperative loop issued its window at the boundary's backward; step() applies it)."""
        run = self._inflight
        return run is not None and not run.counted and run.step == self.global_steps + 1

    def _reissue(self, current: _InFlight, spec: RunSpec) -> None:
        """fp16: run t was issued with the loss scale of before step t-1's overflow, found when
        step t-1 closed; DeepSpeed runs step t with the lowered scale. Let run t end, drop its
        gradients and open step, and issue it again (same batches, seeds and weights: step t-1
        was skipped, so w_{t-1} = w_{t-2})."""
        try:
            current.executor.finish(current.handle)
            self.stepper.wait_all()
            self.stepper.store.zero_grads()
            self.stepper.restart(spec.step - 1)  # declared at t-1, masters published
            self.stepper.open_step(spec.step)
            again = replace(spec, grad_scale=self.host_optimizer.cur_scale * current.unit)
            current.handle = current.executor.start(again)
        except BaseException:
            self._abort_pipeline()
            raise
        log.info("step %d: issued again with the loss scale lowered by step %d's overflow",
                 spec.step, spec.step - 1)  # fmt: skip

    def _complete(self, inflight: _InFlight) -> None:
        """Finish an in-flight run and close its step (the counters already count it)."""
        try:
            result = inflight.executor.finish(inflight.handle)
        except BaseException:
            self._abort_pipeline(inflight)
            raise
        if self._inflight is inflight:
            self._inflight = None
        self._last = self.stepper.close_step(step=inflight.step, skip=inflight.skip)
        if inflight.before is not None and self._last.overflow:
            self._skipped_late(inflight.step, inflight.before, self._last)
        self._stats_open.add(result.stats)
        self._step_stats, self._stats_open = self._stats_open, RunStats()
        self._close_nvme_window()
        self._timeline = result.timeline
        self.monitor.write_step_stats(self._stats_dict(), self.global_samples)
        self._after_run(result, profile=False)

    def _after_run(self, result: RunResult, profile: bool) -> None:
        """What the planner learns from a finished training run: the round size (budget) and,
        while profiling, the measured times (a better plan gets a new executor)."""
        self.planner.fit_round_size(result.boundary_bytes)
        if not profile:
            return
        changed = self.planner.observe(result.layer_ms, result.bwd_ms)
        if self._autotune is not None:  # after the profile's last run: the advice checked
            changed = self._autotune.check(self.planner) or changed
        if changed:
            self._executor = self._make_executor()

    def _drain_pipeline(self) -> None:
        """Finish the run in flight, if any (before anything that needs a quiet pipeline)."""
        inflight = self._inflight
        if inflight is None:
            return
        fetched = self._prefetch
        if fetched is not None and fetched.live and inflight.step == fetched.step:
            # a prefetched window's run whose factors are not all checked yet (loop.py): its
            # gradients cannot close the step; they run again at the window's boundary
            self._discard_prefetch()
            return
        self._complete(inflight)

    def _abort_pipeline(self, finishing: _InFlight | None = None) -> None:
        """A run failed with iterations in flight: stop everything, discard every open step's
        gradients, count the in-flight steps the counters already count (``finishing``, the run
        being finished, and the one in flight) as skipped, and go on from the last applied
        step's weights. The caller re-raises the error."""
        runs = {id(r): r for r in (finishing, self._inflight) if r is not None}
        self._inflight = None
        reason = RuntimeError("a training run failed; the steps in flight were discarded")
        # In this order: the reset waits for every running stream closure, and a later run's
        # closures may be blocked waiting for the failed run's step, which will not close
        # (sync mode: its uploads wait for w_t; async with one weight buffer: for w_{t-1},
        # published at run t's layer_ready). Woken first, they raise, and the reset can drain.
        self.stepper.cancel(reason)  # runtime threads waiting for a step that will not close
        self.stepper.store.fail(reason)  # uploads waiting for a version that will not come
        executors = {id(r.executor): r.executor for r in runs.values()}
        executors.setdefault(id(self._executor), self._executor)
        for executor in executors.values():  # one pool; each executor has its own replicas
            executor.reset()
        with contextlib.suppress(Exception):  # an optimizer failure stays, check() raises it
            self.stepper.wait_all()
        self.stepper.store.zero_grads()
        self._counters.skipped_steps += sum(r.counted and not r.skip for r in runs.values())
        self.stepper.restart(self.global_steps)
        self._guard.reset()
        self._window_lost(reason)
