"""The optimizer boundary: loss scale, LR schedule and the step's fate, as DeepSpeed decides them.

At each accumulation boundary DeepSpeed updates the loss scale, steps the LR scheduler unless the
step was skipped, and counts the step as applied or skipped. Drained, the engine knows the step's
fate (fp16 overflow, ``roundpipe.on_nonfinite``) when it reaches the boundary, because the step
closed first. With overlapping iterations (pipeline.py) ``train_batch`` t returns while
step t's last gradients are still landing, so its boundary is applied *in flight*:

* a non-finite loss is known from the run's losses: the step will be skipped, so the boundary is
  a skipped one at once (no scheduler step; "raise" raises from the same call, as drained);
* otherwise the step is assumed applied, and the boundary remembers what it changed (the
  scheduler's state, every group's hyper-parameters, the loss scaler's state). If its close
  then finds a non-finite gradient norm or an fp16 overflow (a step skipped *late*),
  :meth:`Boundary.skipped_late` puts them back, applies the skipped boundary instead (fp16: the scale
  drops), counts the step as skipped and re-freezes the next open step's hyper-parameters,
  which is exactly where DeepSpeed would have been. "raise" raises from the call that finished
  the step (the next ``train_batch``, after its own boundary) or, if a drain finished it, the
  next training call; if that call's own step has a non-finite loss, its one error names both
  steps. With no training call left (``destroy()``, exit), the error is logged instead.

fp16: the next run was issued with the loss scale of before the overflow. DeepSpeed would have
run it with the lowered scale, so pipeline.py runs it again (``Pipeline.reissue``): one extra
iteration per overflow (a handful at the start of training, then one per ``loss_scale_window``
at most), and every loss, gradient and weight stays DeepSpeed's.

A scheduler without ``state_dict``/``load_state_dict`` cannot be put back: where a step can be
skipped (fp16 or a guard) such an engine drains every ``train_batch`` (``boundary_in_flight_ok``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rp_engine.engine.progress import Progress
    from rp_engine.monitor import Monitor
    from rp_engine.optim.nonfinite import NonFiniteGuard
    from rp_engine.optim.optimizer import HostOptimizer
    from rp_engine.optim.stepper import OptimizerStepper, StepResult
    from rp_engine.runtime.counters import StepCounters

__all__ = ["Boundary", "BoundaryState", "boundary_in_flight_ok"]

log = logging.getLogger("rp_engine")


@dataclass(frozen=True)
class BoundaryState:
    """What a boundary applied in flight changed, to be put back if its step is skipped late."""

    scheduler: dict[str, Any] | None  # the LR scheduler's state_dict before it stepped
    groups: list[dict[str, Any]]  # every group's hyper-parameters before it stepped
    scaler: dict[str, Any]  # the loss scaler's state before it was updated


def boundary_in_flight_ok(scheduler: Any, *, can_skip: bool) -> bool:
    """Whether boundaries may be applied with their step in flight: always when no step can be
    skipped late, else when the scheduler's state can be put back (module docstring)."""
    restorable = scheduler is None or (
        hasattr(scheduler, "state_dict") and hasattr(scheduler, "load_state_dict")
    )
    return restorable or not can_skip


class Boundary:
    """The engine's optimizer boundary (``engine.boundary``): applies one, drained or in flight,
    and repairs one whose step closed skipped late. It calls only the parts it is given; the
    pipeline (pipeline.py) and the imperative loop (loop.py) call it, the caller advancing the
    counters with what :meth:`apply` returns."""

    def __init__(
        self,
        *,
        optimizer: HostOptimizer,
        scheduler: Any,
        stepper: OptimizerStepper,
        counters: StepCounters,
        guard: NonFiniteGuard,
        progress: Progress,
        monitor: Monitor,
        steps_per_print: int | None,
        batch_size: int,
        momentum: Callable[[], list[Any]],
    ) -> None:
        self.optimizer = optimizer
        self.scheduler = scheduler  # engine.lr_scheduler reads and sets it
        self.stepper = stepper
        self.counters = counters
        self.guard = guard
        self.progress = progress
        self.monitor = monitor
        self.steps_per_print = steps_per_print
        self.batch_size = batch_size  # DeepSpeed's train_batch_size: the samples of a step
        self.momentum = momentum  # engine.get_mom (which key depends on the optimizer's name)
        self._stale_noted = False

    def lr(self) -> list[float]:
        """Each group's learning rate (DeepSpeed's ``get_lr``)."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def apply(
        self,
        lr_kwargs: dict[str, Any] | None,
        last: StepResult | None,
        *,
        in_flight: bool | None = None,
    ) -> bool:
        """Close an optimizer step: loss scale, LR schedule, logs. Returns whether it applied
        (False: skipped); the caller advances the counters.

        ``last`` is the newest closed step's result. ``in_flight`` None: the step has closed
        (``last`` is its result). True/False: its run is still in flight and the step is known
        to be skipped (a non-finite loss) / assumed applied (a late skip is repaired by
        :meth:`skipped_late`)."""
        result = last if in_flight is None else None
        overflow = bool(result and result.overflow) if in_flight is None else in_flight
        opt = self.optimizer
        opt.overflow = overflow
        opt.loss_scaler.update(overflow)
        if not overflow:
            opt.note_step_applied()  # before any scheduler, the engine's or the user's
        if not overflow and self.scheduler is not None:
            opt.step_scheduler(self.scheduler, **(lr_kwargs or {}))
        self._note_stale_model()
        counters = self.counters
        step, samples = counters.global_steps + 1, counters.global_samples + self.batch_size
        every = self.steps_per_print
        if every and step % every == 0:
            # in flight: the newest finished step's norm (get_global_grad_norm() would drain)
            norm = None if last is None else last.grad_norm
            of = "" if last is None or last.step == step else f" (of step {last.step})"
            log.info("step %d lr %s grad_norm %s%s", step, self.lr(), norm, of)
        # DeepSpeed's progress line (printed on rank 0 at steps_per_print steps: progress.py)
        self.progress.boundary(
            step, skipped=counters.skipped_steps + int(overflow), lr=self.lr(),
            mom=self.momentum(),
        )  # fmt: skip
        self.monitor.write_events([("Train/Samples/lr", self.lr()[0], samples)])
        if in_flight is not False:  # an assumed-applied step is judged when it closes
            self.guard.conclude(step, result)
        return not overflow

    def state(self) -> BoundaryState:
        """What the next boundary will change (taken just before it, for :meth:`skipped_late`)."""
        sched = self.scheduler
        state = copy.deepcopy(sched.state_dict()) if sched is not None else None
        scaler = self.optimizer.loss_scaler.state_dict()
        return BoundaryState(scheduler=state, groups=self.optimizer.snapshot(), scaler=scaler)

    def skipped_late(self, step: int, before: BoundaryState, result: StepResult) -> None:
        """Step ``step``, whose boundary was applied in flight as applied, closed skipped (a
        non-finite gradient norm, an fp16 overflow): undo its scheduler step and loss-scale
        update, apply the overflow's update, count it skipped, re-freeze the next step's
        hyper-parameters and let the guard judge it. Its boundary is the latest one (a run is
        finished before the next boundary is applied)."""
        counters, opt = self.counters, self.optimizer
        assert step == counters.global_steps, (step, counters.global_steps)
        with opt.hyperparams_lock:  # a torch step may have its groups swapped in
            if self.scheduler is not None and before.scheduler is not None:
                self.scheduler.load_state_dict(before.scheduler)
            for live, frozen in zip(opt.param_groups, before.groups, strict=True):
                live.update(frozen)
        opt.overflow = True
        opt.loss_scaler.load_state_dict(before.scaler)
        opt.loss_scaler.update(True)  # raises at the minimum scale, as drained
        counters.skipped_steps += 1
        counters.step_applied = False
        self.stepper.refreeze(step + 1)
        self.guard.conclude(step, result)

    def _note_stale_model(self) -> None:
        """Once, at the first async step: say how to read the model object itself."""
        if self._stale_noted or not self.stepper.async_mode:
            return
        self._stale_noted = True
        log.warning(
            "async_optimizer: each optimizer step finishes in the background while the next "
            "iteration runs, so the model object passed to initialize lags one step behind "
            "during training. Read it through engine.module (which waits for the step), or call "
            "engine.synchronize() before using the model object directly (save_pretrained, "
            "state_dict, evaluation)."
        )
