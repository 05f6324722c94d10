"""Delay compensation of the asynchronous optimizer's stale gradients (``roundpipe.
staleness_compensation: "lookahead_dc"``): the per-tensor state and the scalars of each step.

With staleness 1, step t applies a gradient g taken at the compute weights w_read that
iteration t read (w_{t-2}'s look-ahead prediction) to masters w that have moved on since.
Delay compensation moves the gradient toward where it is applied with a diagonal curvature
model scaled like Adam's own preconditioner, before Adam sees it:

    f = (sqrt(v_hat) + eps) / (rho * rms(w)) * (w - w_read),    g <- (g + f) |g| / |g + f|

(v_hat: the bias-corrected second moment before this update; rms(w): the tensor's root mean
square; the norms over blocks of ``BLOCK`` elements.) The fix points from w_read toward the
masters, so Adam's step pulls the masters back toward the point the gradients are taken at: the
masters and the weights iterations read stay in agreement, which is what staleness breaks.
Keeping the raw gradient's norm is what makes it stable: without it the fix, whose scale grows
with sqrt(v), feeds v and diverges unless clipping bounds it; with a ratio measured at an
earlier step (per tensor, or global two steps back: all a layer's step can know without a
second pass) the gain is lost (benchmarks/RESULTS.md, issue 28). So the norms are exact, per
block: ``adam_step`` (optim/publish_kernel.py) measures a block and rescales it, then steps
Adam on it and publishes its look-ahead, while the block is in the core's cache, in the slice
loop of ``HostOptimizer.step_params``. w_read is the compute-weight buffer the step is about to
publish into (with double-buffered weights it still holds what iteration t read).

rms(w) is the tensor's at its previous step (measured in the same pass: the first step of a
tensor only measures it), so no step waits for a pass over a whole tensor. ``RHO`` = 0.01 was
the best of 0.005-0.05 over three learning rates (RESULTS.md). ``BLOCK`` divides both Adam slice
sizes (optim/optimizer.py), so the blocks, and the result, do not depend on the device kind.

The masters and the moments are exactly what Adam computes from the gradients it receives; the
compensation changes which gradient that is. The state is one float per master tensor (its
scale); checkpoints carry it by parameter name (``scale`` / ``load_scales``, rp_engine/
checkpoint), so a resumed run compensates its first step as the run that saved would have. A
checkpoint without it (older, or saved without compensation) leaves each tensor to measure its
scale again for one step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BLOCK", "RHO", "DelayCompensation", "DelayTerms"]

RHO = 0.01
BLOCK = 1 << 16  # elements per norm-keeping block: a 64K block's five arrays fit a core's L2


@dataclass(frozen=True)
class DelayTerms:
    """The compensation's scalars for one tensor's step (``adam_step``'s ``delay``; h = 0: the
    gradient is left as it is). The blocks are always ``BLOCK`` elements."""

    vcoef: float
    eps: float
    h: float


class DelayCompensation:
    """Per master tensor, the scale its next compensated step needs (module docstring). Used
    by the optimizer worker thread only."""

    def __init__(self, rho: float = RHO) -> None:
        if rho <= 0:
            raise ValueError(f"rho must be positive, got {rho}")
        self.rho = rho
        self._rms: dict[int, float] = {}

    def terms(
        self, master: torch.Tensor, moments_step: int, group: dict[str, Any], fix_coef: float
    ) -> DelayTerms:
        """The compensation's scalars for ``master``'s step now: ``moments_step`` is the
        number of steps its moments hold (0: none yet, nothing to scale the curvature by),
        ``group`` the step's hyper-parameters, ``fix_coef`` the clip coefficient the gradient
        was scaled by (the fix is in the clipped gradient's units; without clipping 1). h = 0
        (the gradient left as it is) until the tensor's scale is known."""
        rms = self._rms.get(id(master), 0.0)
        if moments_step == 0 or rms == 0.0:
            return DelayTerms(1.0, 0.0, 0.0)
        _, beta2 = group["betas"]
        vcoef = 1.0 / math.sqrt(1.0 - beta2**moments_step) if group["bias_correction"] else 1.0
        h = fix_coef / (self.rho * rms)
        return DelayTerms(vcoef, float(group["eps"]), h)

    def scale(self, master: torch.Tensor) -> float | None:
        """``master``'s recorded scale (rms of its masters before its last step), or None
        before its first step. Read by the checkpoint writer, once the steps are drained."""
        return self._rms.get(id(master))

    def load_scales(self, scales: Mapping[torch.Tensor, float]) -> None:
        """Replace every recorded scale with ``scales`` (master -> scale, a checkpoint's): the
        masters not in it measure theirs again at their next step."""
        self._rms = {id(master): float(value) for master, value in scales.items()}

    def record(self, master: torch.Tensor, w_sq_sum: float) -> None:
        """``master``'s step is done; ``w_sq_sum``: the sum of its squared masters before the
        step, over the whole tensor (the last of ``adam_step``'s sums, added over the slices)."""
        self._rms[id(master)] = math.sqrt(w_sq_sum / max(master.numel(), 1))
