"""The imperative loop's accumulation window: the training micro-batches of the open step.

Each ``engine(batch)`` in training mode adds an :class:`Entry`; loop.py decides when its work
runs. An entry goes through these states::

    queued   forward called, nothing ran; its loss is a deferred value (``leaf``)
      | backward(loss): ``factor`` = d(caller's loss)/d(head loss)  (no read needed)
    ready    waits for the window's run: every ready entry runs in ONE schedule (train_batch's)
      | the window runs (at the boundary's backward, at step(), or when a value is read)
    landed   its gradient is in the host buffers; its loss value is known

    queued or ready --(its value read, or a loss not affine in it)--> resumed:
    its forward runs alone, now (a forward run that keeps a carry: the saved stage inputs and
    the head's gradients); its backward is queued (``resume``, once its factor is known) and
    runs in the window's one schedule, where the resumed micro-batches run their backward
    stages only and the others run whole (``Planner.plan(resumed=)``).

So a read costs one forward pass of the micro-batch it needs, whatever the read pattern;
the window's weights are uploaded once more for the backward of all. A module model (its
forward returns outputs for the caller's criterion) cannot defer its forward: the caller needs
the outputs. Its forward runs at once and keeps its carry, and its backward is queued
(``resume``) the same way.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rp_engine.engine.deferred import Leaf
from rp_engine.runtime.run_state import Carry, Resume

__all__ = ["Entry", "FactorModel", "Prefetch", "ReadyGate", "Window"]


@dataclass(eq=False)
class Entry:
    """One training micro-batch of the open window (module docstring)."""

    batch: dict[str, Any]
    share: float  # its share of the caller's loss tokens (Trainer's num_items_in_batch), or 1
    micro_step: int  # the engine's micro_steps when its forward was called (RNG seeds)
    fused: bool = False  # TRL's fused-LM-head output wanted (per-token statistics)
    leaf: Leaf | None = None  # its loss, deferred
    factor: float | None = None  # d(caller's loss)/d(head loss), 1/GAS included; after backward
    carry: Carry | None = None  # eager: its forward run's carry, until its backward runs
    resume: Resume | None = None  # a module model's backward, queued for the window's run
    landed: bool = False  # its gradient is in the host buffers (or it will never have one)
    backward_called: bool = False
    speculative: bool = False  # its gradient came with a prefetched window's run (predicted)
    stats: dict[str, Any] = field(default_factory=dict)  # the head's per-token statistics
    # eager entries: the real loss leaf the caller's graph reaches (TRL's fused output), or a
    # module model's output leaves (keyed as the outputs), whose gradients backward() reads
    real_leaf: torch.Tensor | None = None
    output_leaves: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        """Deferred, its backward called: runs whole (forward and backward) with the window."""
        return (
            self.carry is None and self.resume is None and self.factor is not None
            and not self.landed
        )  # fmt: skip

    @property
    def awaits_backward(self) -> bool:
        """Its forward was called and its backward not yet."""
        return not self.backward_called and not self.landed


class Window:
    """The entries of the open accumulation window, in call order, and what the step's runs
    so far have done (loop.py runs them)."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.runs = 0  # training runs that landed gradients of the open step
        self.closed = False  # a run closed the open step (its boundary is step()'s to apply)
        self.failed: BaseException | None = None  # a run of the open step failed (it is lost)

    def add(self, entry: Entry) -> Entry:
        self.entries.append(entry)
        return entry

    def last(self) -> Entry | None:
        return self.entries[-1] if self.entries else None

    def ready(self) -> list[Entry]:
        """Deferred entries whose backward was called and whose work has not run."""
        return [e for e in self.entries if e.ready]

    def resumes(self) -> list[Entry]:
        """Entries whose forward ran alone and whose backward is queued."""
        return [e for e in self.entries if e.resume is not None and not e.landed]

    def pending(self) -> bool:
        """Whether some queued work would land gradients of the open step."""
        return any(e.ready or (e.resume is not None and not e.landed) for e in self.entries)

    def close(self) -> list[Entry]:
        """The step closed (or was given up): start the next window. Returns the entries."""
        entries, self.entries = self.entries, []
        self.runs = 0
        self.closed = False
        self.failed = None
        return entries


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
