"""One memory rule: the partitioner, StageCosts, validate and the simulator count the same bytes."""

from __future__ import annotations

import pytest

from rp_engine.plan import schedules, simulate
from rp_engine.plan.costs import LayerCosts, slot_memory
from rp_engine.plan.partition import CutsError, partition
from rp_engine.plan.schedules import SCHEDULES

MB = 1 << 20


def _costs() -> LayerCosts:
    return LayerCosts(
        fwd_ms=(1.0, 2.0, 1.5, 1.0),
        bwd_ms=(2.0, 4.0, 3.0, 2.0),
        param_bytes=(3 * MB, 5 * MB, 4 * MB, 2 * MB),
        act_bytes=(1 * MB, 2 * MB, 1 * MB, 3 * MB),
        head_fwd_ms=0.5,
        head_bwd_ms=1.0,
        head_param_bytes=6 * MB,
        head_act_bytes=2 * MB,
        boundary_bytes=MB // 4,
    )


def test_stage_costs_are_the_slot_rule() -> None:
    costs = _costs()
    fwd, bwd = (1, 3), (1, 2, 1)
    st = costs.stages(fwd, bwd)
    ranges = [range(0, 1), range(1, 3), range(3, 4), range(1, 3), range(0, 1)]
    for slot, layers in enumerate(ranges):
        backward = slot >= len(fwd)
        held = slot_memory(costs, layers, backward=backward, head=slot == len(fwd))
        assert (st.param_bytes[slot], st.grad_bytes[slot], st.work_bytes[slot]) == (
            held.weights,
            held.grads,
            held.work,
        )


def test_the_partitioner_rejects_exactly_the_stages_over_the_rule() -> None:
    """Given cuts fit a budget iff every slot's ``slot_memory`` total does."""
    costs = _costs()
    fwd, bwd = (2, 2), (1, 3)
    st = costs.stages(fwd, bwd)
    need = max(st.param_bytes[s] + st.grad_bytes[s] + st.work_bytes[s] for s in range(4))
    kw = {"num_devices": 2, "num_microbatches": 2, "fwd_cuts": fwd, "bwd_cuts": bwd}
    partition(costs, memory_budget_bytes=need, **kw)
    with pytest.raises(CutsError, match="exceeds the memory budget"):
        partition(costs, memory_budget_bytes=need - 1, **kw)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_validate_and_the_simulator_walk_the_same_bytes(name: str) -> None:
    """On a compute-only plan each device's memory changes only at its own compute actions,
    which run in order, so validate's walk and the simulated timeline must peak alike."""
    spec = SCHEDULES[name]
    costs = _costs()
    kw: dict[str, object] = {"num_devices": 2, "num_microbatches": 3}
    if spec.cuts == "fwd_bwd":
        kw.update(fwd_cuts=(2, 2), bwd_cuts=(1, 2, 1))
    elif spec.cuts == "blocks":
        kw["fwd_cuts"] = (2, 2)
    else:
        kw["stage_layers"] = (1, 1, 1, 1) if spec.stages_per_device > 1 else (2, 2)
    plan = schedules.build(name, **kw)
    peaks = schedules.validate(plan, costs=costs)
    assert min(peaks) > 0
    assert simulate.simulate(plan, costs).peak_memory_bytes == peaks


def test_received_activations_count_in_validate_as_in_the_simulator() -> None:
    """Activations a SEND brings stay on the device until their last consumer ends; validate
    counts them (it used to count only working sets: 2 boundaries per device here)."""
    b = MB
    costs = LayerCosts.uniform(4, fwd_ms=1.0, bwd_ms=2.0, boundary_bytes=b)
    plan = schedules.roundpipe(
        fwd_cuts=(2, 2), bwd_cuts=(1, 3), num_devices=2, num_microbatches=4, round_size=2
    )
    lowered = schedules.lower(plan, optimizer="sync")
    peaks = schedules.validate(lowered, costs=costs)
    assert min(peaks) > 2 * b  # a working set (input and output boundary) plus received ones
    machine = simulate.load_machine("rtx4090_pcie4_8x")
    assert simulate.simulate(lowered, costs, machine=machine).peak_memory_bytes == peaks
