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

A window announced ahead (Hugging Face's Trainer) is run before its forwards: prefetch.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rp_engine.engine.deferred import Leaf
from rp_engine.runtime.run_state import Carry, Resume

__all__ = ["Entry", "Window"]


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
