"""References that see a gradient's scale (issue 41): Adam divides a constant factor of the
gradient out, so a reference run compared by its Adam losses and weights alone passes a doubled
1/GAS, a mis-scaled seed gradient or a loss scale left in. These record the global gradient norm
of every step as plain PyTorch computes it (``torch.nn.utils.clip_grad_norm_``'s total norm,
before clipping: what DeepSpeed's ``get_global_grad_norm`` returns), clip as DeepSpeed does
(coefficient ``clip / (norm + 1e-6)`` when below 1), and train with SGD, whose step is the
gradient's own scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["StepNorms", "clip_and_measure", "sgd_reference"]


class StepNorms:
    """``make_optimizer`` for ``engine_helpers.reference_losses``: ``build(params)``'s
    optimizer, whose ``step`` first records the global norm of the gradients it is given
    (``norms``, one per step) and clips them at ``clip`` (0: no clipping)."""

    def __init__(self, build: Callable[[Any], torch.optim.Optimizer], *, clip: float = 0.0) -> None:
        self.build = build
        self.clip = clip
        self.norms: list[float] = []

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        opt = self.build(params)
        inner_step = opt.step

        def step(*args: Any, **kwargs: Any) -> Any:
            self.norms.append(clip_and_measure(opt, self.clip))
            return inner_step(*args, **kwargs)

        opt.step = step  # type: ignore[method-assign]
        return opt


def clip_and_measure(opt: torch.optim.Optimizer, clip: float) -> float:
    """The global norm of ``opt``'s gradients, which are then clipped at ``clip`` (0: none)."""
    params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
    return float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf))


def sgd_reference(
    model: nn.Module,
    batches: Sequence[Any],
    *,
    steps: int,
    gas: int,
    lr: float,
    momentum: float = 0.0,
    clip: float = 0.0,
    loss_of: Callable[[nn.Module, Any], torch.Tensor],
) -> tuple[list[float], list[float]]:
    """Plain PyTorch SGD on one device, staleness 0: per step, GAS micro-batches' ``(loss /
    gas).backward()``, the global norm recorded, clipping at ``clip``, ``torch.optim.SGD``.
    Returns the per-step mean losses and norms; ``model`` is left with the final weights."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    it = iter(batches)
    losses, norms = [], []
    for _ in range(steps):
        total = 0.0
        for _ in range(gas):
            loss = loss_of(model, next(it))
            (loss / gas).backward()
            total += float(loss.detach())
        norms.append(clip_and_measure(opt, clip))
        opt.step()
        opt.zero_grad()
        losses.append(total / gas)
    return losses, norms
