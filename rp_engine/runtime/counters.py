"""DeepSpeed's step counters and the gradient-accumulation boundary, as one small state machine.

``micro_steps`` counts micro-batches, ``global_steps`` optimizer boundaries (applied or skipped),
``global_samples`` samples seen at boundaries, ``skipped_steps`` boundaries whose step was not
applied (fp16 overflow). The boundary falls every GAS micro-batches unless the caller overrides
it (``set_gradient_accumulation_boundary``, as Hugging Face Accelerate does). The engine owns one
and exposes the counters under DeepSpeed's attribute names.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepCounters"]


@dataclass
class StepCounters:
    """Counters of one engine; ``gas`` micro-batches and ``samples_per_step`` samples a step."""

    gas: int
    samples_per_step: int
    micro_steps: int = 0
    global_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0
    step_applied: bool = False
    boundary_override: bool | None = None

    def is_boundary(self) -> bool:
        """Whether the current micro-batch closes an optimizer step."""
        if self.boundary_override is not None:
            return self.boundary_override
        return (self.micro_steps + 1) % self.gas == 0

    def step(self, *, applied: bool | None) -> None:
        """``engine.step()`` after a micro-batch. At a boundary ``applied`` says whether the
        optimizer step was applied (False: skipped, e.g. fp16 overflow); None: no boundary."""
        if applied is None:
            self.step_applied = False
        else:
            self.step_applied = applied
            self.skipped_steps += 0 if applied else 1
            self.global_steps += 1
            self.global_samples += self.samples_per_step
        self.micro_steps += 1

    def unmanaged_step(self, *, applied: bool, micro_batches: int) -> None:
        """``step()`` with ``managed_gradient_accumulation: false``: every call is a boundary,
        closing the ``micro_batches`` backward passes since the last one; samples are counted
        per micro-batch (DeepSpeed 0.19.8's ``_unmanaged_backward_count``)."""
        self.step_applied = applied
        self.skipped_steps += 0 if applied else 1
        self.global_steps += 1
        self.global_samples += self.samples_per_step // self.gas * micro_batches
        self.micro_steps += 1

    def whole_step(self, *, applied: bool) -> None:
        """``train_batch``: GAS micro-batches, the last of them a boundary."""
        self.micro_steps += self.gas - 1
        self.step(applied=applied)
