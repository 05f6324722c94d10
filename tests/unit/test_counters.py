"""StepCounters: DeepSpeed's counters and boundary, without an engine."""

from __future__ import annotations

from rp_engine.runtime.counters import StepCounters


def _loop(c: StepCounters, n: int, *, applied: bool = True) -> list[bool]:
    seen = []
    for _ in range(n):
        boundary = c.is_boundary()
        seen.append(boundary)
        c.step(applied=applied if boundary else None)
    return seen


def test_boundary_every_gas_micro_batches() -> None:
    c = StepCounters(gas=3, samples_per_step=6)
    assert _loop(c, 6) == [False, False, True, False, False, True]
    assert (c.micro_steps, c.global_steps, c.global_samples, c.skipped_steps) == (6, 2, 12, 0)
    assert c.step_applied
    c.step(applied=None)
    assert not c.step_applied  # between boundaries DeepSpeed reports no applied step


def test_skipped_step_counts_but_is_not_applied() -> None:
    c = StepCounters(gas=1, samples_per_step=4)
    c.whole_step(applied=False)
    assert not c.step_applied
    c.whole_step(applied=True)
    assert (c.global_steps, c.skipped_steps, c.global_samples, c.micro_steps) == (2, 1, 8, 2)


def test_override_wins_until_cleared() -> None:
    c = StepCounters(gas=4, samples_per_step=4)
    c.boundary_override = True
    assert c.is_boundary()
    c.boundary_override = False
    c.micro_steps = 3
    assert not c.is_boundary()
    c.boundary_override = None
    assert c.is_boundary()


def test_whole_step_equals_gas_micro_steps() -> None:
    a, b = StepCounters(gas=4, samples_per_step=8), StepCounters(gas=4, samples_per_step=8)
    a.whole_step(applied=True)
    assert _loop(b, 4) == [False, False, False, True]
    assert a == b
