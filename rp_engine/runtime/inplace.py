"""Layers that write their input in place, and the inputs a recomputation reads again.

A training forward runs without autograd and keeps some stage inputs for the backward stages'
recomputation: the input of each backward stage's first layer (``StageMap.saved_inputs``,
downloaded after the forward stage's compute) and the micro-batch itself (the last backward
stage recomputes from it). A first layer that writes its input in place (``nn.ReLU(inplace=
True)``, ``x.mul_(2)``) would change the kept values before they are read again, and the
recomputation would start from the written ones: wrong gradients, silently (an idempotent write
such as a ReLU's happens to give the same result). DeepSpeed's pipeline clones every stage input
before its forward; cloning every kept input would cost a copy of each per micro-batch, so
:class:`InPlaceGuard` learns, per layer, whether it writes its input, from the tensors' version
counters (``Tensor._version``, bumped by every in-place op):

- the first time a layer is seen it gets a copy, and the copy's versions tell;
- a layer that wrote gets a copy every time (as DeepSpeed's, for those layers only);
- a layer that did not gets the kept tensors themselves, and its call is checked afterwards:
  one that writes only on some micro-batches raises rather than train on wrong gradients.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from rp_engine.model.base import State

__all__ = ["InPlaceGuard"]


class InPlaceGuard:
    """Per layer index: whether its forward writes its input state's tensors in place."""

    def __init__(self) -> None:
        self._writes: dict[int, bool] = {}
        self._lock = threading.Lock()  # device threads may meet the same layer first together

    def writes(self, layer: int) -> bool | None:
        """Whether ``layer`` wrote its input in place (None: not seen yet)."""
        return self._writes.get(layer)

    def given(self, layer: int, kept: State) -> State:
        """What ``layer`` is called with when ``kept`` must survive its call unchanged: a copy,
        unless the layer is known not to write its input (then ``kept`` itself)."""
        if self._writes.get(layer) is False:
            return kept
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kept.items()}

    def after(self, layer: int, kept: State, given: State, before: dict[str, int]) -> None:
        """Learn from (or check) the call of ``layer`` on ``given`` (``before``: the versions of
        ``given`` before the call, :func:`versions`)."""
        wrote = versions(given) != before
        with self._lock:
            known = self._writes.setdefault(layer, wrote)
        if given is kept and wrote and known is False:
            raise RuntimeError(
                f"layer {layer} wrote its input in place on this micro-batch but not on its "
                "first one: the input kept for its recomputation in backward is lost. Make the "
                "in-place write unconditional, or write out of place (x = x.mul(2), not "
                "x.mul_(2))"
            )


def versions(state: State) -> dict[str, int]:
    """Each tensor's version counter (bumped by every in-place write of its storage)."""
    return {k: _version(v) for k, v in state.items() if isinstance(v, torch.Tensor)}


def _version(t: Any) -> int:
    return int(t._version)
