"""Two runs in flight (iterations overlap): the memory walk over the seam of two runs issued back
to back (``memory.consecutive``) and the gates that make it a bound (``cross_run_gates``)."""

from __future__ import annotations

import pytest

from rp_engine.plan import schedules
from rp_engine.plan.actions import Op, PlanError, weight_holdings
from rp_engine.plan.costs import LayerCosts
from rp_engine.plan.memory import consecutive, cross_run_gates, held_bound, walk_peak

MB = 1 << 20


def _runs(*, depth: int, devices: int = 1, gas: int = 1, then_depth: int | None = None):
    kw = {"fwd_cuts": (1,) * 4, "bwd_cuts": (1,) * 4, "num_devices": devices,
          "num_microbatches": gas, "round_size": 1}  # fmt: skip
    first = schedules.lower(schedules.roundpipe(**kw), optimizer="", prefetch_depth=depth)
    second = schedules.roundpipe(**kw, start_device=first.next_start_device)
    depth2 = depth if then_depth is None else then_depth
    return first, schedules.lower(second, optimizer="", prefetch_depth=depth2)


def _costs(layer0: int = 8 * MB) -> LayerCosts:
    """Layer 0 (the embedding, say) large: the last backward slot (layer 0's weights and
    gradients) of one run meets the next run's first forward slot (layer 0's weights)."""
    return LayerCosts(
        fwd_ms=(1.0,) * 4, bwd_ms=(2.0,) * 4, param_bytes=(layer0, MB, MB, MB),
        act_bytes=(0,) * 4, head_fwd_ms=1.0, head_bwd_ms=2.0, head_param_bytes=2 * MB,
    )  # fmt: skip


def test_consecutive_appends_the_next_run_renumbered() -> None:
    first, second = _runs(depth=1, devices=2, gas=2)
    both = consecutive(first, second)
    assert both.iterations == (0, 1)
    for d in range(2):
        row = both.per_device(d)
        n = len(first.per_device(d))
        assert row[:n] == first.per_device(d)
        assert [(a.op, a.stage, a.microbatch, a.device) for a in row[n:]] == [
            (a.op, a.stage, a.microbatch, a.device) for a in second.per_device(d)
        ]
        assert {a.iteration for a in row[n:]} == {1}
    with pytest.raises(ValueError, match="same cuts"):
        consecutive(first, _runs(depth=2, devices=2, gas=2)[1])


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_the_next_runs_first_uploads_wait_for_the_last_frees_by_the_prefetch_rule(
    depth: int,
) -> None:
    """Upload j of the next run on a device waits for the FREE of the previous run's holding
    ``depth + 1`` groups before it there (counting across the seam), as within one run; the
    uploads after the first ``depth + 1`` wait only inside their run."""
    first, second = _runs(depth=depth, devices=2, gas=2)
    gates = cross_run_gates(first, second)
    back = depth + 1
    for d in range(2):
        mine = weight_holdings(first)[d]
        ups = [h.upload for h in weight_holdings(second)[d]]
        for j, up in enumerate(ups):
            expected = [mine[len(mine) - back + j].free] if j < back else None
            assert gates.get(up) == expected, (d, j, up)
    assert all(f.op is Op.FREE and f in first.deps for fs in gates.values() for f in fs)


def test_the_seam_holds_more_than_either_run_and_validate_counts_it() -> None:
    """One device, one micro-batch, depth 1: while the last backward slot (layer 0: 8 MiB of
    weights and 8 of gradients) computes, the next run's first upload (layer 0 again, gated on
    the FREE two groups back, which has run) may land: 24 MiB, where one run peaks at 18 MiB."""
    first, second = _runs(depth=1)
    costs = _costs()
    assert schedules.validate(first, costs=costs) == (18 * MB,)
    assert schedules.validate(first, costs=costs, then=second) == (24 * MB,)
    both = consecutive(first, second)
    st = costs.stages(first.fwd_cuts, first.bwd_cuts, fused_head=first.fused_head)
    peak, where = walk_peak(both, st, 0)
    assert (peak, str(where)) == (24 * MB, "B3.0@0")  # the last backward of the first run
    bound = held_bound(both, st, 0)
    assert bound[where] == 24 * MB
    # and while the next run's first forward computes on it: the gradients' download (and the
    # FREE behind it) may still run
    first_forward = next(a for a in both.per_device(0) if a.is_compute and a.iteration == 1)
    assert (str(first_forward), bound[first_forward]) == ("F0.0@0#1", 24 * MB)
    schedules.validate(first, costs=costs, memory_budget_bytes=18 * MB)
    with pytest.raises(PlanError, match=r"device 0 needs 24\.0 MiB at B3\.0@0 \(two runs in "
                       r"flight: iterations overlap\), over the budget of 18\.0 MiB"):  # fmt: skip
        schedules.validate(first, costs=costs, memory_budget_bytes=18 * MB, then=second)


def test_a_changed_lowering_waits_for_every_free_of_the_previous_run() -> None:
    """The planner changed the prefetch depth between the runs: the next run's uploads that
    have no gate of their own wait for all of the previous run's FREEs on their device."""
    first, second = _runs(depth=2, devices=2, gas=2, then_depth=0)
    gates = cross_run_gates(first, second)
    for d in range(2):
        frees = [a for a in first.per_device(d) if a.op is Op.FREE]
        holdings = weight_holdings(second)[d]
        assert gates[holdings[0].upload] == frees
        assert all(h.upload not in gates for h in holdings if h.gates)


def test_a_planner_with_overlap_validates_the_seam() -> None:
    """``Planner(overlap_iterations=True)`` validates two runs back to back: never less than
    one run, and the same for a uniform model (the seam is like any point of a run)."""
    from rp_engine.runtime.planning import ModelShape, Planner

    shape = ModelShape(8, True, (100_000,) * 8, 40_000, 30_000)
    kw = {"num_devices": 2, "num_microbatches": 2, "fwd_cuts": (2,) * 4,
          "bwd_cuts": (0,) + (1,) * 8, "memory_budget_bytes": 2**30}  # fmt: skip
    one = Planner(shape, **kw).validated_peak()
    two = Planner(shape, **kw, overlap_iterations=True).validated_peak()
    assert two == one > 0
