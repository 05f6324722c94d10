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
  :meth:`_skipped_late` puts them back, applies the skipped boundary instead (fp16: the scale
  drops), counts the step as skipped and re-freezes the next open step's hyper-parameters,
  which is exactly where DeepSpeed would have been. "raise" raises from the call that finished
  the step (the next ``train_batch``, after its own boundary) or, if a drain finished it, the
  next training call; if that call's own step has a non-finite loss, its one error names both
  steps. With no training call left (``destroy()``, exit), the error is logged instead.

fp16: the next run was issued with the loss scale of before the overflow. DeepSpeed would have
run it with the lowered scale, so pipeline.py runs it again (``_reissue``): one extra
iteration per overflow (a handful at the start of training, then one per ``loss_scale_window``
at most), and every loss, gradient and weight stays DeepSpeed's.

A scheduler without ``state_dict``/``load_state_dict`` cannot be put back: where a step can be
skipped (fp16 or a guard) such an engine drains every ``train_batch`` (``boundary_in_flight_ok``).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rp_engine.config import DSConfig
    from rp_engine.engine.progress import Progress
    from rp_engine.monitor import Monitor
    from rp_engine.optim.nonfinite import NonFiniteGuard
    from rp_engine.optim.optimizer import HostOptimizer
    from rp_engine.optim.stepper import OptimizerStepper, StepResult
    from rp_engine.runtime.counters import StepCounters

__all__ = ["OptimizerBoundary", "BoundaryState", "boundary_in_flight_ok"]

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


class OptimizerBoundary:
    """``_apply_boundary`` and its late-skip repair, mixed into ``RoundPipeEngine``."""

    if TYPE_CHECKING:  # provided by RoundPipeEngine
        _config: DSConfig
        _counters: StepCounters
        _guard: NonFiniteGuard
        _last: StepResult | None
        global_steps: int
        global_samples: int
        lr_scheduler: Any
        monitor: Monitor
        host_optimizer: HostOptimizer
        stepper: OptimizerStepper

        skipped_steps: int
        _progress: Progress

        def train_batch_size(self) -> int: ...
        def get_lr(self) -> list[float]: ...
        def get_mom(self) -> list[Any]: ...
        def _note_stale_model(self) -> None: ...

    def _apply_boundary(
        self, lr_kwargs: dict[str, Any] | None, *, in_flight: bool | None = None
    ) -> bool:
        """Close an optimizer step: loss scale, LR schedule, logs. Returns whether it applied
        (False: skipped); the caller advances the counters.

        ``in_flight`` None: the step has closed (``self._last`` is its result). True/False: its
        run is still in flight and the step is known to be skipped (a non-finite loss) / assumed
        applied (a late skip is repaired by :meth:`_skipped_late`)."""
        result = self._last if in_flight is None else None
        overflow = bool(result and result.overflow) if in_flight is None else in_flight
        self.host_optimizer.overflow = overflow
        self.host_optimizer.loss_scaler.update(overflow)
        if not overflow:
            self.host_optimizer.note_step_applied()  # before any scheduler, the engine's or the user's
        if not overflow and self.lr_scheduler is not None:
            self.host_optimizer.step_scheduler(self.lr_scheduler, **(lr_kwargs or {}))
        self._note_stale_model()
        step, samples = self.global_steps + 1, self.global_samples + self.train_batch_size()
        every = self._config.steps_per_print
        if every and step % every == 0:
            # in flight: the newest finished step's norm (get_global_grad_norm() would drain)
            done = self._last
            norm = None if done is None else done.grad_norm
            of = "" if done is None or done.step == step else f" (of step {done.step})"
            log.info("step %d lr %s grad_norm %s%s", step, self.get_lr(), norm, of)
        # DeepSpeed's progress line (printed on rank 0 at steps_per_print steps: progress.py)
        self._progress.boundary(
            step, skipped=self.skipped_steps + int(overflow), lr=self.get_lr(), mom=self.get_mom()
        )
        self.monitor.write_events([("Train/Samples/lr", self.get_lr()[0], samples)])
        if in_flight is not False:  # an assumed-applied step is judged when it closes
            self._guard.conclude(step, result)
        return not overflow

    def _boundary_state(self) -> BoundaryState:
        """What the next boundary will change (taken just before it, for ``_skipped_late``)."""
        sched = self.lr_scheduler
        state = copy.deepcopy(sched.state_dict()) if sched is not None else None
        scaler = self.host_optimizer.loss_scaler.state_dict()
        return BoundaryState(scheduler=state, groups=self.host_optimizer.snapshot(), scaler=scaler)

    def _skipped_late(self, step: int, before: BoundaryState, result: StepResult) -> None:
        """Step ``step``, whose boundary was applied in flight as applied, closed skipped (a
        non-finite gradient norm, an fp16 overflow): undo its scheduler step and loss-scale
        update, apply the overflow's update, count it skipped, re-freeze the next step's
        hyper-parameters and let the guard judge it. Its boundary is the latest one (a run is
        finished before the next boundary is applied)."""
        assert step == self.global_steps, (step, self.global_steps)
        with self.host_optimizer.hyperparams_lock:  # a torch step may have its groups swapped in
            if self.lr_scheduler is not None and before.scheduler is not None:
                self.lr_scheduler.load_state_dict(before.scheduler)
            for live, frozen in zip(self.host_optimizer.param_groups, before.groups, strict=True):
                live.update(frozen)
        self.host_optimizer.overflow = True
        self.host_optimizer.loss_scaler.load_state_dict(before.scaler)
        self.host_optimizer.loss_scaler.update(True)  # raises at the minimum scale, as drained
        self._counters.skipped_steps += 1
        self._counters.step_applied = False
        self.stepper.refreeze(step + 1)
        self._guard.conclude(step, result)
