"""Tests for rp_engine.plan.partition: layer costs, the asymmetric search (quality against the
published Qwen3-1.7B cuts, memory budget, errors), explicit cuts, bound-stage balancing."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rp_engine.plan import schedules
from rp_engine.plan.partition import (
    LayerCosts,
    Partition,
    balanced_stage_layers,
    estimate_iteration_ms,
    fitted_round_size,
    load_costs,
    partition,
    transfer_ms,
)

QWEN = Path(__file__).resolve().parents[2] / "benchmarks" / "costs" / "qwen3_1_7b.json"
PUBLISHED = ((7, 7, 7, 7), (0, 3, 3, 3, 3, 3, 3, 3, 3, 2, 2))


def test_costs_from_json_scalars_and_lists(tmp_path: Path) -> None:
    costs = load_costs(QWEN)
    assert costs.num_layers == 28 and costs.fwd_ms[5] == 7.43 and costs.recompute_ms == costs.fwd_ms
    assert costs.head_bwd_ms == 43.71 and costs.comm_ms == 1.6 and costs.param_bytes == (0,) * 28
    path = tmp_path / "c.json"
    path.write_text(
        json.dumps({"fwd_ms": [1, 2, 3], "bwd_ms": 2, "param_bytes": 10, "pcie_gbps": 24})
    )
    costs = load_costs(path)
    assert costs.fwd_ms == (1.0, 2.0, 3.0) and costs.bwd_ms == (2.0,) * 3
    assert costs.param_bytes == (10, 10, 10)


@pytest.mark.parametrize(
    "data,match",
    [
        ({"fwd_ms": 1, "bwd_ms": 1}, "num_layers"),
        ({"num_layers": 2, "fwd_ms": [1], "bwd_ms": 1}, "1 entries"),
        ({"num_layers": 2, "fwd_ms": 1, "bwd_ms": 1, "fwd_msec": 3}, "unknown keys"),
        ({"num_layers": 2, "bwd_ms": 1}, "required"),
    ],
)
def test_costs_errors_name_the_key(data: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LayerCosts.from_dict(data)


def test_stage_costs_fold_layers_onto_slots() -> None:
    costs = LayerCosts.uniform(
        4,
        fwd_ms=1.0,
        bwd_ms=2.0,
        head_fwd_ms=5.0,
        head_bwd_ms=7.0,
        param_bytes=10,
        act_bytes=3,
        head_param_bytes=100,
        prefix_param_bytes=1000,
    )
    st = costs.stages((3, 1), (1, 3))
    # As the runtime runs it: layer 3 belongs to the HEAD slot, which computes it once (forward
    # + backward, no recompute), so forward slot 1 only passes its input on; the prefix rides
    # with forward slot 0 and with the last backward slot (its recompute).
    assert st.pre_ms == (3.0, 0.0, 5.0 + 1.0, 3.0)
    assert st.post_ms == (0.0, 0.0, 7.0 + 2.0, 6.0)
    assert st.param_bytes == (1030, 0, 110, 1030) and st.grad_bytes == (0, 0, 110, 1030)
    bound = costs.stages((3, 1), (1, 3), fused_head=False)
    assert bound.pre_ms[1] == 1.0 + 5.0  # head forward in the last forward stage
    assert bound.post_ms[2] == 2.0 + 7.0


def test_partitioner_beats_the_published_cuts_on_qwen3_1_7b() -> None:
    costs = load_costs(QWEN)
    for async_optimizer in (False, True):
        ours = partition(costs, num_devices=8, num_microbatches=16, async_optimizer=async_optimizer)
        published = estimate_iteration_ms(
            costs, *PUBLISHED, num_devices=8, num_microbatches=16, async_optimizer=async_optimizer
        )
        assert ours.est_iteration_ms <= published
        assert sum(ours.fwd_cuts) == sum(ours.bwd_cuts) == 28
        schedules.validate(
            schedules.roundpipe(
                fwd_cuts=ours.fwd_cuts, bwd_cuts=ours.bwd_cuts, num_devices=8, num_microbatches=16
            )
        )


def test_asymmetric_cuts_backward_stages_smaller() -> None:
    costs = load_costs(QWEN)
    ours = partition(costs, num_devices=8, num_microbatches=16, async_optimizer=False)
    assert ours.num_bwd_stages > ours.num_fwd_stages
    assert max(ours.bwd_cuts) < min(ours.fwd_cuts)


def test_explicit_cuts_are_checked_and_estimated() -> None:
    costs = load_costs(QWEN)
    got = partition(
        costs,
        num_devices=8,
        num_microbatches=16,
        fwd_cuts=PUBLISHED[0],
        bwd_cuts=PUBLISHED[1],
        async_optimizer=False,
    )
    assert got == Partition(PUBLISHED[0], PUBLISHED[1], got.est_iteration_ms)
    # the estimate of given cuts is the timing model's makespan of those very cuts
    assert got.est_iteration_ms == pytest.approx(
        estimate_iteration_ms(
            costs, *PUBLISHED, num_devices=8, num_microbatches=16, async_optimizer=False
        )
    )
    with pytest.raises(ValueError, match="both"):
        partition(costs, num_devices=8, num_microbatches=16, fwd_cuts=PUBLISHED[0])
    with pytest.raises(ValueError, match="summing to L=28"):
        partition(costs, num_devices=8, num_microbatches=16, fwd_cuts=(7, 7), bwd_cuts=(28,))


def test_memory_budget_caps_every_stage() -> None:
    mib = 1 << 20
    costs = LayerCosts.uniform(
        12,
        fwd_ms=1.0,
        bwd_ms=2.0,
        head_fwd_ms=3.0,
        head_bwd_ms=6.0,
        param_bytes=100 * mib,
        act_bytes=50 * mib,
        head_param_bytes=300 * mib,
    )
    budget = 800 * mib
    got = partition(costs, num_devices=4, num_microbatches=8, memory_budget_bytes=budget)
    plan = schedules.roundpipe(
        fwd_cuts=got.fwd_cuts, bwd_cuts=got.bwd_cuts, num_devices=4, num_microbatches=8
    )
    st = costs.stages(got.fwd_cuts, got.bwd_cuts)
    for slot in range(plan.num_slots):
        assert st.param_bytes[slot] + st.grad_bytes[slot] + st.work_bytes[slot] <= budget
    assert max(got.bwd_cuts[1:]) <= 3  # 2 x 100 MiB weights+grads + 50 MiB acts per layer
    free = partition(costs, num_devices=4, num_microbatches=8)
    assert free.est_iteration_ms <= got.est_iteration_ms


def test_a_layer_that_cannot_fit_is_named() -> None:
    mib = 1 << 20
    costs = LayerCosts(
        fwd_ms=(1.0, 1.0, 1.0), bwd_ms=(2.0, 2.0, 2.0), param_bytes=(10 * mib, 900 * mib, 10 * mib)
    )
    with pytest.raises(ValueError, match=r"layer 1 needs 1\.76 GiB .* budget is 1\.00 GiB"):
        partition(costs, num_devices=2, num_microbatches=2, memory_budget_bytes=1 << 30)
    head_heavy = LayerCosts.uniform(2, fwd_ms=1.0, bwd_ms=1.0, head_param_bytes=2 << 30)
    with pytest.raises(ValueError, match="LM head"):
        partition(head_heavy, num_devices=2, num_microbatches=2, memory_budget_bytes=1 << 30)


@pytest.mark.parametrize("layers,n,m", [(1, 1, 1), (2, 3, 1), (5, 2, 4), (9, 8, 3), (17, 4, 8)])
def test_small_shapes_partition_and_validate(layers: int, n: int, m: int) -> None:
    rng = random.Random(layers * 100 + n)
    costs = LayerCosts(
        fwd_ms=[rng.uniform(1, 3) for _ in range(layers)],
        bwd_ms=[rng.uniform(2, 6) for _ in range(layers)],
        head_fwd_ms=2.0,
        head_bwd_ms=4.0,
        comm_ms=0.1,
    )
    for async_optimizer in (False, True):
        got = partition(costs, num_devices=n, num_microbatches=m, async_optimizer=async_optimizer)
        assert min(got.fwd_cuts) >= 1 and min(got.bwd_cuts[1:], default=1) >= 1
        schedules.validate(
            schedules.roundpipe(
                fwd_cuts=got.fwd_cuts, bwd_cuts=got.bwd_cuts, num_devices=n, num_microbatches=m
            )
        )


def test_partition_search_on_94_layers_finishes() -> None:
    # the time is reported by benchmarks/studies/bubble_table.py, never asserted here
    rng = random.Random(94)
    costs = LayerCosts(
        fwd_ms=[rng.uniform(8, 12) for _ in range(94)],
        bwd_ms=[rng.uniform(16, 24) for _ in range(94)],
        head_fwd_ms=30.0,
        head_bwd_ms=60.0,
        comm_ms=1.6,
    )
    got = partition(costs, num_devices=8, num_microbatches=16, async_optimizer=False)
    # asymmetric, as RoundPipe's backward is about twice the forward (section 4.4)
    assert got.num_bwd_stages > got.num_fwd_stages
    # and no worse than the naive symmetric cut of the same stage count
    even = [94 // 8 + (1 if i < 94 % 8 else 0) for i in range(8)]
    naive = estimate_iteration_ms(
        costs, even, [0, *even[::-1]], num_devices=8, num_microbatches=16, async_optimizer=False
    )
    assert got.est_iteration_ms <= naive


def test_balanced_stage_layers() -> None:
    costs = load_costs(QWEN)
    assert balanced_stage_layers(costs, 24) == (1,) * 18 + (2,) * 5 + (0,)  # the published
    eight = balanced_stage_layers(costs, 8)
    assert len(eight) == 8 and sum(eight) == 28
    uniform = LayerCosts.uniform(6, fwd_ms=1.0, bwd_ms=1.0)
    assert balanced_stage_layers(uniform, 3) == (2, 2, 2)
    assert balanced_stage_layers(uniform, 7) == (1, 1, 1, 1, 1, 1, 0)
    with pytest.raises(ValueError, match="num_stages"):
        balanced_stage_layers(uniform, 8)


def _link_costs() -> LayerCosts:
    mb = 2**20
    return LayerCosts.uniform(
        8, fwd_ms=1.0, bwd_ms=2.0, param_bytes=20 * mb, act_bytes=4 * mb,
        head_param_bytes=40 * mb, head_fwd_ms=1.0, head_bwd_ms=2.0, boundary_bytes=2 * mb,
    )  # fmt: skip


def test_the_choice_responds_to_link_bandwidth() -> None:
    """Transfers enter the objective: on a slow link the search trades compute balance for
    fewer bytes on the busiest link (fewer boundaries crossed, the head stage's blocks never
    uploaded for a forward); with no link given (or a fast one) it balances compute."""
    costs = _link_costs()
    kw = {"num_devices": 2, "num_microbatches": 8, "min_bwd_stages": 2}
    free = partition(costs, **kw)
    slow = partition(costs, **kw, link_gbps=1.0)
    assert (slow.fwd_cuts, slow.bwd_cuts) != (free.fwd_cuts, free.bwd_cuts)

    def link(p: Partition) -> float:
        return transfer_ms(costs, p.fwd_cuts, p.bwd_cuts, 2, 8, 8, 1.0)

    def compute(p: Partition) -> float:
        return estimate_iteration_ms(costs, p.fwd_cuts, p.bwd_cuts, num_devices=2,
                                     num_microbatches=8)  # fmt: skip

    assert link(slow) < link(free) and compute(slow) > compute(free)
    assert slow.est_iteration_ms >= link(slow)  # the estimate is at least the link's time


def test_transfer_time_counts_rounds_and_the_busiest_link() -> None:
    """Weights once per round per slot, gradients once per round per backward slot; one
    device carries every slot."""
    costs = LayerCosts.uniform(2, fwd_ms=1.0, bwd_ms=1.0, param_bytes=1_000_000)
    st = costs.stages((1, 1), (1, 1))
    for rounds in (1, 4):
        ms = transfer_ms(costs, (1, 1), (1, 1), 1, 4, 4 // rounds, 1.0)
        assert ms == pytest.approx(rounds * sum(st.param_bytes) / 1e6)
    # two devices, 4 slots: device d always gets slots d and d + 2 (F0 and H on one, F1 and
    # B1 on the other); F1's block belongs to the head stage, so the first link is the busiest
    assert st.param_bytes[1] == 0
    assert transfer_ms(costs, (1, 1), (1, 1), 2, 4, 4, 1.0) == pytest.approx(
        (st.param_bytes[0] + st.param_bytes[2]) / 1e6
    )


def test_round_size_follows_the_activation_memory_left() -> None:
    costs = _link_costs()
    st = costs.stages((4, 4), (2, 3, 3))
    largest = max(
        w + g + k for w, g, k in zip(st.param_bytes, st.grad_bytes, st.work_bytes, strict=True)
    )
    state = costs.boundary_bytes
    assert fitted_round_size(costs, (4, 4), (2, 3, 3), 8, None) == 8
    assert fitted_round_size(costs, (4, 4), (2, 3, 3), 8, largest + 8 * state) == 4
    assert fitted_round_size(costs, (4, 4), (2, 3, 3), 8, largest + 2 * state) == 1


def test_the_embedding_prefix_counts_in_the_budget() -> None:
    """A stage holding layer 0 carries the prefix (forward stage 0, the last backward stage):
    cuts that fit without its bytes fail with them (the search used to leave them out)."""
    plain = LayerCosts.uniform(4, fwd_ms=1.0, bwd_ms=2.0, param_bytes=1000)
    with_prefix = LayerCosts.uniform(4, fwd_ms=1.0, bwd_ms=2.0, param_bytes=1000,
                                     prefix_param_bytes=5000)  # fmt: skip
    need = with_prefix.stages((2, 2), (0, 2, 2))
    budget = max(
        w + g + k
        for w, g, k in zip(need.param_bytes, need.grad_bytes, need.work_bytes, strict=True)
    )
    kw = {"num_devices": 2, "num_microbatches": 2, "fwd_cuts": (2, 2), "bwd_cuts": (0, 2, 2)}
    partition(with_prefix, memory_budget_bytes=budget, **kw)
    partition(plain, memory_budget_bytes=budget - 5000, **kw)
    with pytest.raises(ValueError, match="exceeds the memory budget"):
        partition(with_prefix, memory_budget_bytes=budget - 1, **kw)
