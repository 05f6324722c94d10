"""What a non-finite loss or gradient norm does in bf16/fp32: ``roundpipe.on_nonfinite``.

fp16 has DeepSpeed's answer (the dynamic loss scaler skips an overflowing step and lowers the
scale); bf16 and fp32 have none, so a model with NaN weights would train on with NaN losses and
no word. The guard watches every training micro-batch's loss and, through the stepper, the step's
gradient norm:

* ``"raise"`` (default): the step is not applied (the weights and optimizer state stay as they
  were; it counts as a skipped step, like an fp16 overflow) and the call that closed it
  (``train_batch()`` or ``step()``) raises :class:`NonFiniteError` naming the step and the
  micro-batch(es). The engine stays usable: the next step starts clean. With overlapping
  iterations two skipped steps can come due at one call (one skipped late, the next for its
  loss: engine/boundary.py); that call raises one error naming both, none is dropped.
* ``"skip"``: the same skip, with a warning instead of an error.
* ``"ignore"``: the step is applied whatever its numbers (DeepSpeed's bf16/fp32 behaviour).

With "raise" or "skip" each layer's update waits for the step's global gradient norm (as it does
with gradient clipping or fp16), so that no layer can step before the step is known to be finite.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from rp_engine.optim.stepper import StepResult

__all__ = ["NonFiniteError", "NonFiniteGuard", "MODES"]

log = logging.getLogger("rp_engine")

MODES = ("raise", "skip", "ignore")


class NonFiniteError(FloatingPointError):
    """A bf16/fp32 step had a non-finite loss or gradient norm and was not applied."""


class NonFiniteGuard:
    """Collects the losses of the open accumulation window and judges each closed step."""

    def __init__(self, mode: str, *, fp16: bool) -> None:
        if mode not in MODES:
            raise ValueError(f"roundpipe.on_nonfinite must be one of {MODES}, got {mode!r}")
        self.mode = mode
        # fp16 keeps DeepSpeed's overflow skipping; "ignore" watches nothing.
        self.active = mode != "ignore" and not fp16
        self._bad: list[tuple[int, float]] = []  # (micro-batch within the step, loss)
        # "step N: what" of each step judged under "raise" and not raised yet: with overlapping
        # iterations a late skip and the next step's non-finite loss come due at one call
        self._failed: list[str] = []

    def observe(self, losses: Sequence[float], first_microbatch: int, gas: int) -> None:
        """Losses of a training run whose first micro-batch is ``first_microbatch`` (counted
        from the engine's start); micro-batches are reported by their index within the step."""
        if not self.active:
            return
        for i, loss in enumerate(losses):
            if not math.isfinite(loss):
                self._bad.append(((first_microbatch + i) % gas, loss))

    def force_skip(self) -> bool:
        """Whether the step about to close must be skipped whatever its gradient norm."""
        return bool(self._bad)

    def conclude(self, step: int, result: StepResult | None) -> None:
        """Judge step ``step`` (its result from the stepper; None while its run is in flight,
        engine/boundary.py): warn ("skip") or keep the error for :meth:`raise_failed`
        ("raise"). Clears the window."""
        bad, self._bad = self._bad, []
        if not self.active:
            return
        # result None: the step is still in flight (overlap), judged by its losses alone
        finite_norm = result is None or math.isfinite(result.grad_norm)
        if not bad and finite_norm:
            return
        if bad:
            shown = ", ".join(f"{mb} (loss {loss})" for mb, loss in bad[:8])
            what = f"non-finite loss in micro-batch(es) {shown}"
            if not finite_norm:
                what += " and a non-finite gradient norm"
        else:
            what = "non-finite gradient norm (every micro-batch's loss was finite)"
        if self.mode == "skip":
            log.warning("%s", _text([f"step {step}: {what}"]))
        else:
            self._failed.append(f"step {step}: {what}")

    def raise_failed(self) -> None:
        """Raise one error for the steps kept by :meth:`conclude` (each once); call it after the
        engine's counters are up to date, so that the engine is consistent when it raises."""
        failed, self._failed = self._failed, []
        if failed:
            raise NonFiniteError(_text(failed))

    def report_unraised(self) -> None:
        """Log, as an error, the steps kept by :meth:`conclude` that no training call will
        raise now: the engine is shutting down, and a step skipped late under "raise" was found
        by the drain of ``destroy()`` or of the exit finaliser (or of a drain before them, with no
        training call since). Drained, every error is raised by its own call and none is left."""
        failed, self._failed = self._failed, []
        if failed:
            log.error("%s (found after the last training call)", _text(failed))

    def reset(self) -> None:
        """Forget the open window (a failed run discarded its gradients)."""
        self._bad = []


def _text(failed: list[str]) -> str:
    """The message for skipped steps, each given as "step N: what"."""
    which = "the step was" if len(failed) == 1 else "the steps were"
    return (
        f"{'; '.join(failed)}; {which} skipped (weights and optimizer state unchanged). "
        "Look for NaN/inf weights (a bad checkpoint), a learning rate that diverged, or a "
        "micro-batch whose labels are all -100; roundpipe.on_nonfinite = 'skip' skips such "
        "steps with a warning, 'ignore' applies them"
    )
