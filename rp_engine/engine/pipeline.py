"""The engine's runs on the executor (``engine.pipeline``): drained, or overlapping iterations.

``train_batch`` with overlapping iterations: the round-robin goes on across calls, no drain.

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
  same way (``Pipeline.issue``), at its boundary's ``backward``; its ``step()`` applies the
  boundary.

- Non-finite steps (``roundpipe.on_nonfinite`` "raise", the default, or "skip"): the boundary
  is applied in flight
  (boundary.py). A non-finite loss is known at once (skipped, raised from the same
  call, as drained); a non-finite gradient norm is known when the step closes, and the schedule
  and counters are put back to where DeepSpeed would have them; "raise" then raises from the
  next call.

- fp16: the same, and the next run, issued with the scale of before the overflow, is run
  again with the lowered scale (``Pipeline.reissue``), as DeepSpeed would have run it.

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from rp_engine.engine.boundary import Boundary, BoundaryState
from rp_engine.engine.record import StepRecord
from rp_engine.plan.actions import Op
from rp_engine.runtime.executor import Executor, RunHandle, RunSpec

if TYPE_CHECKING:
    from torch import nn

    from rp_engine.autotune import ProfileCheck
    from rp_engine.engine.progress import Progress
    from rp_engine.optim.nonfinite import NonFiniteGuard
    from rp_engine.optim.optimizer import HostOptimizer
    from rp_engine.optim.stepper import OptimizerStepper
    from rp_engine.plan.actions import Plan
    from rp_engine.runtime.counters import StepCounters
    from rp_engine.runtime.executor import RunResult
    from rp_engine.runtime.planning import Planner

__all__ = ["Pipeline", "InFlightBox", "FORWARD_OPS", "BACKWARD_OPS"]

log = logging.getLogger("rp_engine")

FORWARD_OPS = frozenset({Op.FWD, Op.HEAD})  # a forward-only run's actions (eval, a loss read)
BACKWARD_OPS = frozenset({Op.BWD})


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


class Pipeline:
    """The engine's runs on the executor (``engine.pipeline``): drained ones (:meth:`run`,
    :meth:`eval_run`) and overlapping ones (:meth:`issue`: run t issued, run t-1 finished),
    the run in flight (``box``) and the record of the last closed step (``record``).

    It owns the executor (a re-plan replaces it: ``make_executor``) and calls only the parts it
    is given: the stepper, the planner, the optimizer's loss scale, the boundary, the counters.
    Two hooks reach the imperative loop without a reference to it: a provisional run's
    callback (a prefetched window's run: :meth:`issue`) and ``on_abort`` (its open window is
    lost with the steps in flight)."""

    def __init__(
        self,
        *,
        make_executor: Callable[[], Executor],
        stepper: OptimizerStepper,
        planner: Planner,
        optimizer: HostOptimizer,
        boundary: Boundary,
        counters: StepCounters,
        guard: NonFiniteGuard,
        progress: Progress,
        record: StepRecord,
        module: nn.Module,
        layers: Callable[[], Iterable[nn.Module]],
        gas: int,
        overlap: bool,
        autotune: ProfileCheck | None,
    ) -> None:
        self.make_executor = make_executor
        self.executor = make_executor()
        self.stepper = stepper
        self.planner = planner
        self.optimizer = optimizer  # its cur_scale is each run's grad_scale
        self.boundary = boundary
        self.counters = counters
        self.guard = guard
        self.progress = progress
        self.record = record
        self.module = module  # its training flag is the layers' mode (sync_mode)
        self.layers = layers  # the layer modules the executor runs (LayerSequence.modules)
        self.gas = gas
        self.overlap = overlap  # whether train_batch may leave a run in flight (core.py)
        self.autotune = autotune
        self.box = InFlightBox(guard)  # the shutdown finaliser holds the box, not the engine
        # the open window of the imperative loop is lost with the steps in flight (loop.py)
        self.on_abort: Callable[[BaseException], None] = lambda _error: None
        # a prefetched window's run whose factors are not all checked yet (loop.py), and what a
        # drain calls instead of closing its step (its gradients run again at the boundary).
        # Held here, not in the run's record: the finaliser holds that (it must not hold this)
        self._provisional: tuple[_InFlight, Callable[[], None]] | None = None

    @property
    def inflight(self) -> _InFlight | None:
        return self.box.run

    @inflight.setter
    def inflight(self, run: _InFlight | None) -> None:
        self.box.run = run

    # --- train_batch's step -----------------------------------------------------------------------
    def train_step(self, batches: list[Any]) -> list[float]:
        """One optimizer step over the GAS micro-batches (``engine.train_batch``), the counters
        advanced; its losses. In flight when iterations overlap (module docstring)."""
        gas = self.gas
        profile = self.planner.profile_left > 0
        if self.overlap and not profile:
            # two open steps from here on, which the step journal's undo does not cover (it was
            # not asked for explicitly: core.py); the loop's overlapped window drops it too
            self.stepper.journal = None
            losses = self.issue(batches, unit=1 / gas)
            self.counters.whole_step(applied=self.apply_in_flight(None))
            self.guard.raise_failed()  # this step's losses, or the previous step's late skip
            return losses
        self.drain()
        result = self.run(
            self.planner.plan(gas), batches, step=self.counters.global_steps + 1,
            closes_step=True, grad_scale=self.optimizer.cur_scale / gas, profile=profile,
        )  # fmt: skip
        self.counters.whole_step(applied=self.boundary.apply(None, self.record.last))
        self.guard.raise_failed()
        self.after_run(result, profile)
        return result.losses

    # --- drained runs -----------------------------------------------------------------------------
    def run(
        self, plan: Plan, batches: list[Any], *, step: int, closes_step: bool, **kw: Any
    ) -> RunResult:
        """One run of ``plan``, after the run in flight is finished; it closes step ``step``
        when ``closes_step``. A failed run drops the step's gradients (:meth:`abort_step`)."""
        self.drain()
        self.sync_mode()
        if closes_step:
            self.stepper.open_step(step)
        kw.setdefault("microbatch_offset", self.counters.micro_steps)
        spec = RunSpec(
            plan=plan,
            batches=batches,
            version=self.stepper.required_version(step),
            step=step,
            closes_step=closes_step,
            **kw,
        )
        try:
            result = self.executor.run(spec)
        except BaseException:
            # Nothing half-done survives a failed run: this step's gradients are dropped (the
            # weights are untouched), so the next call starts clean.
            self.abort_step()
            raise
        self.guard.observe(result.losses, spec.microbatch_offset, self.gas)
        self.progress.observe_losses(result.losses)  # floats the run returned: nothing forced
        if closes_step:
            self.record.last = self.stepper.close_step(step=step, skip=self.guard.force_skip())
        self.record.timeline = result.timeline
        self.record.add(result.stats)
        if closes_step:
            self.record.closed()
        return result

    def eval_run(self, batches: list[Any], **kw: Any) -> RunResult:
        """A forward-only run of ``batches`` (no gradients), at the newest weights."""
        self.drain()
        self.sync_mode()
        step = self.counters.global_steps + 1
        spec = RunSpec(
            plan=self.planner.plan(len(batches), ops=FORWARD_OPS), batches=batches,
            version=self.stepper.required_version(step), step=step, train=False, **kw,
        )  # fmt: skip
        self.stepper.synchronize()
        return self.executor.run(spec)

    def abort_step(self) -> None:
        """A drained run failed: the open step's gradients are dropped."""
        with contextlib.suppress(Exception):  # the run's own error is the one to report
            self.stepper.wait_all()
        self.stepper.abandon_step()
        self.stepper.store.zero_grads()
        self.guard.reset()
        log.warning(
            "run failed: gradients accumulated for step %d were discarded",
            self.counters.global_steps + 1,
        )

    def sync_mode(self) -> None:
        """The layers run in the module's own mode (``model.eval()``: dropout off), as DeepSpeed
        runs the module itself. The executor takes each layer's mode from the layer modules,
        and the wrappers to_layers builds around the model's parts are not its submodules, so
        ``model.train()/.eval()`` does not reach them: their own flag is set here before each
        run (not recursively: the model's submodules already carry the caller's modes)."""
        mode = self.module.training
        for layer in self.layers():
            layer.training = mode

    def renew_executor(self) -> None:
        """New cuts: a new executor (nothing may be in flight on the old one)."""
        self.executor = self.make_executor()

    # --- the overlapped step --------------------------------------------------------------------
    def issue(
        self, batches: list[Any], *, unit: float, factors: list[float] | None = None,
        first_microbatch: int | None = None, microbatches: list[int] | None = None,
        token_stats: bool = False, provisional: Callable[[], None] | None = None,
    ) -> list[float]:  # fmt: skip
        """Issue run t (one whole step: it closes it), finish run t-1, wait for run t's losses
        (and the head's per-token statistics, ``token_stats``). The run's grad_scale is the loss
        scale times ``unit``; ``factors`` multiply it per micro-batch (the imperative loop's
        window). The boundary is applied by the caller (:meth:`apply_in_flight`). A
        ``provisional`` run's step is not closed by a drain: it calls ``provisional`` instead."""
        step = self.counters.global_steps + 1
        first = self.counters.micro_steps if first_microbatch is None else first_microbatch
        self.sync_mode()  # (a run in flight was issued in the same mode: train_batch sets it)
        self.stepper.open_step(step)
        spec = RunSpec(
            plan=self.planner.plan(len(batches)), batches=batches,
            version=self.stepper.required_version(step), step=step, closes_step=True,
            grad_scale=self.optimizer.cur_scale * unit, factors=factors,
            microbatch_offset=first, microbatches=microbatches, token_stats=token_stats,
        )  # fmt: skip
        executor = self.executor
        previous = self.inflight
        try:
            handle = executor.start(spec)
        except BaseException:
            self.abort()
            raise
        current = self.inflight = _InFlight(executor, handle, step, unit)
        if provisional is not None:
            self._provisional = (current, provisional)
        if previous is not None:
            try:
                self.complete(previous)  # run t-1 (its failure aborts run t as well)
            except BaseException:
                self.abort()
                raise
            if spec.grad_scale != self.optimizer.cur_scale * unit:  # t-1 overflowed (fp16)
                self.reissue(current, spec)
        try:
            losses = executor.losses(current.handle)  # (a reissued run has a new handle)
        except BaseException:
            self.abort()
            raise
        self.guard.observe(losses, first, self.gas)
        self.progress.observe_losses(losses)  # the progress line's loss (floats: nothing forced)
        current.skip = self.guard.force_skip()
        return losses

    def token_stats(self) -> list[dict[str, Any]]:
        """The head's per-token statistics of the run in flight (issued with ``token_stats``)."""
        run = self.inflight
        assert run is not None, "no run in flight"
        return run.executor.token_stats(run.handle)

    def confirm(self) -> None:
        """The provisional run in flight is the step's after all: a drain closes its step."""
        self._provisional = None

    def apply_in_flight(self, lr_kwargs: dict[str, Any] | None) -> bool:
        """DeepSpeed's counters and LR schedule at the boundary of the run in flight, applied
        before its step closes: the next call finishes it (boundary.py). Returns whether the
        step counts as applied; the caller advances the counters."""
        current = self.inflight
        assert current is not None and not current.counted, "no issued step to count"
        if (self.guard.active or self.stepper.fp16) and not current.skip:
            current.before = self.boundary.state()  # its close may still skip it
        applied = self.boundary.apply(lr_kwargs, self.record.last, in_flight=current.skip)
        current.counted = True
        return applied

    def uncounted_in_flight(self) -> bool:
        """Whether the run in flight is the open step's, its boundary not applied yet (the
        imperative loop issued its window at the boundary's backward; step() applies it)."""
        run = self.inflight
        return run is not None and not run.counted and run.step == self.counters.global_steps + 1

    def reissue(self, current: _InFlight, spec: RunSpec) -> None:
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
            again = replace(spec, grad_scale=self.optimizer.cur_scale * current.unit)
            current.handle = current.executor.start(again)
        except BaseException:
            self.abort()
            raise
        log.info("step %d: issued again with the loss scale lowered by step %d's overflow",
                 spec.step, spec.step - 1)  # fmt: skip

    def complete(self, inflight: _InFlight) -> None:
        """Finish an in-flight run and close its step (the counters already count it)."""
        try:
            result = inflight.executor.finish(inflight.handle)
        except BaseException:
            self.abort(inflight)
            raise
        if self.inflight is inflight:
            self.inflight = None
        last = self.record.last = self.stepper.close_step(step=inflight.step, skip=inflight.skip)
        if inflight.before is not None and last.overflow:
            self.boundary.skipped_late(inflight.step, inflight.before, last)
        self.record.add(result.stats)
        self.record.timeline = result.timeline
        self.record.closed()
        self.after_run(result, profile=False)

    def after_run(self, result: RunResult, profile: bool) -> None:
        """What the planner learns from a finished training run: the round size (budget) and,
        while profiling, the measured times (a better plan gets a new executor)."""
        self.planner.fit_round_size(result.boundary_bytes)
        if not profile:
            return
        changed = self.planner.observe(result.layer_ms, result.bwd_ms)
        if self.autotune is not None:  # after the profile's last run: the advice checked
            changed = self.autotune.check(self.planner) or changed
        if changed:
            self.renew_executor()

    def drain(self) -> None:
        """Finish the run in flight, if any (before anything that needs a quiet pipeline)."""
        inflight = self.inflight
        if inflight is None:
            return
        provisional = self._provisional
        if provisional is not None and provisional[0] is inflight:
            # a prefetched window's run whose factors are not all checked yet (loop.py): its
            # gradients cannot close the step; they run again at the window's boundary
            provisional[1]()
            if self.inflight is not inflight:  # discarded
                return
        self.complete(inflight)

    def discard(self, step: int) -> None:
        """Finish the run in flight if it is step ``step``'s and drop its gradients and open
        step (a prefetched window's run that is not the step's after all)."""
        run = self.inflight
        if run is None or run.step != step:
            return
        self.inflight = None
        try:
            run.executor.finish(run.handle)
        except BaseException:
            self.abort(run)
            raise
        self.stepper.wait_all()  # the previous step's optimizer reads the other buffer
        self.stepper.abandon_step(step)
        self.stepper.store.zero_grads()

    def abort(self, finishing: _InFlight | None = None) -> None:
        """A run failed with iterations in flight: stop everything, discard every open step's
        gradients, count the in-flight steps the counters already count (``finishing``, the run
        being finished, and the one in flight) as skipped, and go on from the last applied
        step's weights. The caller re-raises the error."""
        runs = {id(r): r for r in (finishing, self.inflight) if r is not None}
        self.inflight = None
        reason = RuntimeError("a training run failed; the steps in flight were discarded")
        # In this order: the reset waits for every running stream closure, and a later run's
        # closures may be blocked waiting for the failed run's step, which will not close
        # (sync mode: its uploads wait for w_t; async with one weight buffer: for w_{t-1},
        # published at run t's layer_ready). Woken first, they raise, and the reset can drain.
        self.stepper.cancel(reason)  # runtime threads waiting for a step that will not close
        self.stepper.store.fail(reason)  # uploads waiting for a version that will not come
        executors = {id(r.executor): r.executor for r in runs.values()}
        executors.setdefault(id(self.executor), self.executor)
        for executor in executors.values():  # one pool; each executor has its own replicas
            executor.reset()
        with contextlib.suppress(Exception):  # an optimizer failure stays, check() raises it
            self.stepper.wait_all()
        self.stepper.store.zero_grads()
        self.counters.skipped_steps += sum(r.counted and not r.skip for r in runs.values())
        self.stepper.restart(self.counters.global_steps)
        self.guard.reset()
        self.on_abort(reason)
