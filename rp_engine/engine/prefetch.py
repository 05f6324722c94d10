"""A prefetched accumulation window and the gate that holds its gradients from the optimizer.

``engine.expect_micro_batches`` announces the next window's micro-batches (Hugging Face's
Trainer fetches each step's micro-batches up front). The imperative loop (loop.py) then runs the
whole window at its first forward, each micro-batch's d(loss) scaled by a *predicted* factor:

- :class:`Prefetch`: the announced window, its run's values and what its run assumed;
- :class:`FactorModel`: the factor predicted for each micro-batch, fitted to the last window;
- :class:`ReadyGate`: holds that run's "layer l's gradient is complete" reports from the
  optimizer until every backward has confirmed its factor (or drops them).

Pure bookkeeping: nothing here runs anything (loop.py decides; the executor reports to the gate).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FactorModel", "Prefetch", "ReadyGate"]


@dataclass(eq=False)
class Prefetch:
    """A window announced before its forwards (``engine.expect_micro_batches``; Hugging Face's
    Trainer fetches each step's micro-batches up front). Its first forward runs the whole window
    at once, so every forward returns a real value (Trainer and TRL read them at once), with
    each micro-batch's d(loss) scaled by a *predicted* factor (:class:`FactorModel`, fitted to
    the previous window's backwards; at first, Trainer's token-weighted mean). Each
    ``backward`` checks its factor;
    the step's gradients reach the optimizer only once all matched (``ReadyGate``). A mismatch,
    or anything that needs a quiet pipeline before the boundary, discards them (``live``
    False): the window's gradients then run again at the boundary with the factors known."""

    batches: list[dict[str, Any]]  # the announced micro-batches (the engine's form)
    counts: list[int] = field(default_factory=list)  # their loss tokens
    index: int = 0  # the next forward's micro-batch
    keys: frozenset[str] = frozenset()  # the batch keys the first forward passed
    num_items: Any = None  # its Trainer token count (the same for the whole window)
    fused: bool = False  # its TRL fused-head request
    losses: list[float] = field(default_factory=list)  # from the window's run
    stats: list[dict[str, Any]] = field(default_factory=list)  # per-token statistics
    predicted: list[float] = field(default_factory=list)  # the factors the run used
    step: int = 0  # the optimizer step the run belongs to
    issued: bool = False
    live: bool = False  # the run's gradients are still the step's candidate
    # while the planner profiles its first steps: the window's run, drained (not in flight)
    # and not closing its step, so that the planner can learn from it once it is confirmed
    profiled: Any = None

    @property
    def done(self) -> bool:
        return self.index >= len(self.batches)


@dataclass(frozen=True)
class FactorModel:
    """What a prefetched window's micro-batch m is predicted to contribute: d(caller's
    loss)/d(its head loss).

    ``"tokens"``: k * n_m / N, n_m its loss tokens and N the window's (``num_items_in_batch``
    when the call passes it, else the sum of n_m): Hugging Face's Trainer and TRL's
    ``SFTTrainer`` (k = 1) weigh micro-batches by their tokens. ``"uniform"``: k for every
    micro-batch: DeepSpeed's loop (k = 1/GAS)."""

    kind: str = "tokens"
    k: float = 1.0

    def predict(self, counts: Sequence[int], num_items: Any) -> list[float]:
        if self.kind == "uniform":
            return [self.k] * len(counts)
        total = float(num_items) if num_items is not None else float(sum(counts))
        return [self.k * n / total if total else 0.0 for n in counts]

    @classmethod
    def fit(
        cls, factors: Sequence[float], counts: Sequence[int], num_items: Any
    ) -> FactorModel | None:
        """The model a whole window's factors follow (token-weighted first), or None."""
        fractions = cls("tokens", 1.0).predict(counts, num_items)
        ratios = [f / t for f, t in zip(factors, fractions, strict=True) if t]
        zeros_fit = all(f == 0 for f, t in zip(factors, fractions, strict=True) if not t)
        if ratios and zeros_fit and _all_close(ratios):
            return cls("tokens", ratios[0])
        if factors and _all_close(list(factors)):
            return cls("uniform", factors[0])
        return None


def _all_close(values: list[float]) -> bool:
    return all(math.isclose(v, values[0], rel_tol=1e-6, abs_tol=0) for v in values)


class ReadyGate:
    """Between the executor's "layer l's gradient of step t is complete" and the optimizer.

    For a step whose gradients may still be discarded (a prefetched window's, see
    :class:`Prefetch`) the reports are held; ``release`` passes them on (from the caller's
    thread), ``drop`` forgets them. Reports of other steps pass straight through. Thread-safe:
    the executor's host workers report while the caller releases."""

    def __init__(self, ready: Callable[[int, int], None]) -> None:
        self._ready = ready
        self._lock = threading.Lock()
        self._held: int | None = None
        self._buffer: list[int] = []

    def __call__(self, layer: int, step: int) -> None:
        with self._lock:
            if step == self._held:
                self._buffer.append(layer)
                return
        self._ready(layer, step)

    def hold(self, step: int) -> None:
        with self._lock:
            self._held, self._buffer = step, []

    def release(self) -> None:
        with self._lock:
            step, layers = self._held, self._buffer
            self._held, self._buffer = None, []
        for layer in layers:
            assert step is not None
            self._ready(layer, step)

    def drop(self) -> None:
        with self._lock:
            self._held, self._buffer = None, []
