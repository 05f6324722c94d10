"""Tests for rp_engine.plan.schedules: dispatch rules of each schedule, a sampled grid of
(layers, devices, micro-batches) where every plan validates, lowering, and validate's errors."""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict

import pytest

from rp_engine.plan import schedules
from rp_engine.plan.actions import HOST, Action, Op, Plan, PlanError
from rp_engine.plan.partition import LayerCosts, balanced_stage_layers


def _balanced(n: int, k: int) -> list[int]:
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


# ---- RoundPipe ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n,m,start", [(1, 3, 0), (3, 7, 2), (4, 8, 1), (8, 16, 5)])
def test_roundpipe_round_robin_dispatch(n: int, m: int, start: int) -> None:
    fwd, bwd = [3, 2], [0, 1, 2, 2]
    plan = schedules.roundpipe(
        fwd_cuts=fwd, bwd_cuts=bwd, num_devices=n, num_microbatches=m, start_device=start
    )
    num_slots = len(fwd) + len(bwd)
    for a in plan.actions:
        round_ = a.microbatch // n
        g0 = (start + round_ * num_slots) % n
        assert a.device == (g0 + plan.slot(a)) % n
    rounds = -(-m // n)
    assert plan.next_start_device == (start + rounds * num_slots) % n
    # within a round, a slot runs all its micro-batches back to back on its device
    for d in range(n):
        row = plan.per_device(d)
        for prev, nxt in zip(row, row[1:], strict=False):
            if plan.slot(prev) == plan.slot(nxt) and prev.microbatch // n == nxt.microbatch // n:
                assert nxt.microbatch == prev.microbatch + 1


def test_roundpipe_rounds_roll_across_iterations() -> None:
    kwargs = dict(fwd_cuts=[4], bwd_cuts=[1, 3], num_devices=4, num_microbatches=4)
    plan = schedules.build("roundpipe", num_iterations=3, **kwargs)
    first = schedules.roundpipe(**kwargs)
    second = next(a for a in plan.actions if a.iteration == 1)
    assert second.device == first.next_start_device == 3
    third = next(a for a in plan.actions if a.iteration == 2)
    assert third.device == (3 + 3) % 4
    schedules.validate(plan)


def test_roundpipe_head_is_backward_stage_zero() -> None:
    plan = schedules.roundpipe(fwd_cuts=[2], bwd_cuts=[1, 1], num_devices=2, num_microbatches=1)
    assert [str(a) for a in plan.actions] == ["F0.0@0", "H0.0@1", "B1.0@0"]
    assert plan.fused_head and plan.num_fwd_stages == 1 and plan.num_bwd_stages == 2


# ---- bound schedules ---------------------------------------------------------------------------
def test_one_f_one_b_matches_pytorch_order() -> None:
    n, m = 4, 6
    plan = schedules.one_f_one_b(stage_layers=[1] * n, num_devices=n, num_microbatches=m)
    for rank in range(n):
        ops = [a.op for a in plan.per_device(rank)]
        warmup = min(m, n - rank)
        assert ops[:warmup] == [Op.FWD] * warmup
        assert ops[warmup] is Op.BWD  # then backward / forward alternate
        steady = ops[warmup : warmup + 2 * (m - warmup)]
        assert steady == [Op.BWD, Op.FWD] * (m - warmup)


def _pytorch_interleaved(rank: int, n: int, v: int, m: int) -> list[tuple[str, int, int]]:
    """ScheduleInterleaved1F1B._calculate_single_rank_operations, transcribed (no padding)."""
    rounds = max(1, m // n)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (n - 1 - rank), v * m)
    total = v * m

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * n + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * n + rank

    fwd_mb: dict[int, int] = defaultdict(int)
    bwd_mb: dict[int, int] = defaultdict(int)
    ops = []
    for op in range(total + warmup):
        if op < total:
            s = fwd_stage(op)
            ops.append(("F", s, fwd_mb[s]))
            fwd_mb[s] += 1
        if op >= warmup:
            s = bwd_stage(op)
            ops.append(("B", s, bwd_mb[s]))
            bwd_mb[s] += 1
    return ops


@pytest.mark.parametrize("n,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 12), (8, 3, 16), (3, 2, 3)])
def test_interleaved_matches_pytorch(n: int, v: int, m: int) -> None:
    k = n * v
    plan = schedules.interleaved_1f1b(stage_layers=[1] * k, num_devices=n, num_microbatches=m)
    for rank in range(n):
        ours = [
            (
                "F" if a.op is Op.FWD else "B",
                a.stage if a.op is Op.FWD else k - 1 - a.stage,
                a.microbatch,
            )
            for a in plan.per_device(rank)
        ]
        assert ours == _pytorch_interleaved(rank, n, v, m)


def test_looped_bfs_order() -> None:
    plan = schedules.looped_bfs(stage_layers=[1] * 6, num_devices=3, num_microbatches=2)
    row = [str(a) for a in plan.per_device(1)]
    # bound stages 1 and 4 live on device 1; backward stage j is bound stage 5 - j
    assert row == ["F1.0@1", "F1.1@1", "F4.0@1", "F4.1@1", "B1.0@1", "B1.1@1", "B4.0@1", "B4.1@1"]


def test_mobius_binds_blocks_with_cross_mapping() -> None:
    blocks = [4, 4, 3, 3, 3, 3, 3, 5]
    plan = schedules.mobius(fwd_cuts=blocks, num_devices=8, num_microbatches=8)
    assert schedules.cross_mapping(8) == [0, 4, 1, 5, 2, 6, 3, 7]
    fwd_dev = {a.stage: a.device for a in plan.actions if a.op is Op.FWD}
    assert [fwd_dev[k] for k in range(8)] == [0, 4, 1, 5, 2, 6, 3, 7]
    for a in plan.actions:
        if a.op in (Op.HEAD, Op.BWD):
            assert a.device == fwd_dev[7 - a.stage]  # backward of block k on block k's GPU
    assert plan.bwd_cuts == tuple(reversed(blocks))
    for d in range(8):  # GPipe clock order: every forward of a GPU before its backwards
        ops = [a.op for a in plan.per_device(d)]
        assert ops == sorted(ops, key=lambda op: op is not Op.FWD)
    with pytest.raises(ValueError, match="reversed"):
        schedules.mobius(fwd_cuts=[1, 2], bwd_cuts=[1, 2], num_devices=2, num_microbatches=2)


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match="one stage per device"):
        schedules.one_f_one_b(stage_layers=[1, 1, 1], num_devices=2, num_microbatches=2)
    with pytest.raises(ValueError, match="multiple of"):
        schedules.interleaved_1f1b(stage_layers=[1, 1, 1], num_devices=2, num_microbatches=2)
    with pytest.raises(ValueError, match="both must cover"):
        schedules.roundpipe(fwd_cuts=[2], bwd_cuts=[1], num_devices=1, num_microbatches=1)
    with pytest.raises(ValueError, match="unknown schedule"):
        schedules.build("zero-bubble", num_devices=1)


# ---- the grid ----------------------------------------------------------------------------------
def _grid_plan(name: str, layers: int, n: int, m: int, rng: random.Random) -> Plan | None:
    costs = LayerCosts.uniform(layers, fwd_ms=1.0, bwd_ms=2.0, head_fwd_ms=3.0, head_bwd_ms=6.0)
    if name == "roundpipe":
        kf = rng.randint(1, max(1, layers // 2))
        h = rng.randint(0, min(2, layers - 1))
        kb = rng.randint(1, layers - h)
        return schedules.roundpipe(
            fwd_cuts=_balanced(layers, kf),
            bwd_cuts=[h, *_balanced(layers - h, kb)],
            num_devices=n,
            num_microbatches=m,
            start_device=rng.randrange(n),
        )
    v = 2 if name in ("interleaved-1f1b", "looped-bfs") else 1
    if v * n > layers + 1:
        return None
    stage_layers = balanced_stage_layers(costs, v * n)
    if name == "mobius":
        return schedules.mobius(fwd_cuts=stage_layers, num_devices=n, num_microbatches=m)
    return schedules.build(name, stage_layers=stage_layers, num_devices=n, num_microbatches=m)


def _grid() -> list[tuple[str, int, int, int]]:
    """A sample of layers 4..96 x devices 1..8 x micro-batches 1..32, edges always included."""
    rng = random.Random(7)
    layers = [4, 5, 13, 28, 61, 96]
    devices = [1, 2, 3, 5, 8]
    mbs = [1, 2, 7, 8, 16, 32]
    cells = [(l_, n, m) for l_ in layers for n in devices for m in mbs]
    picked = [c for c in cells if c[0] in (4, 96) or c[1] in (1, 8)]
    picked += rng.sample([c for c in cells if c not in picked], 30)
    names = ["roundpipe", "mobius", "gpipe", "1f1b", "interleaved-1f1b", "looped-bfs"]
    return [(name, *cell) for cell in picked for name in names]


def test_every_grid_plan_validates() -> None:
    rng = random.Random(11)
    checked = 0
    for name, layers, n, m in _grid():
        plan = _grid_plan(name, layers, n, m, rng)
        if plan is None:
            continue
        schedules.validate(plan)
        # one compute action per (slot, micro-batch): nothing lost or duplicated
        compute = [a for a in plan.actions if a.is_compute]
        assert len(compute) == m * (plan.num_fwd_stages + plan.num_bwd_stages)
        checked += 1
    assert checked > 300


def test_lowered_grid_plans_validate() -> None:
    rng = random.Random(3)
    costs_for = {}
    for name, layers, n, m in _grid()[::7]:
        plan = _grid_plan(name, layers, n, m, rng)
        if plan is None:
            continue
        costs = costs_for.setdefault(
            layers,
            LayerCosts.uniform(
                layers,
                fwd_ms=1.0,
                bwd_ms=2.0,
                param_bytes=1000,
                act_bytes=100,
                head_param_bytes=3000,
                boundary_bytes=10,
            ),
        )
        lowered = schedules.lower(plan, optimizer="async")
        peaks = schedules.validate(lowered, costs=costs)
        assert len(peaks) == n and max(peaks) > 0


# ---- lowering ----------------------------------------------------------------------------------
def test_lower_adds_transfers_for_every_edge_and_group() -> None:
    plan = schedules.build(
        "roundpipe",
        num_iterations=2,
        fwd_cuts=[2, 2],
        bwd_cuts=[1, 1, 2],
        num_devices=3,
        num_microbatches=4,
    )
    lowered = schedules.lower(plan, optimizer="async")
    schedules.validate(lowered)
    ops = defaultdict(list)
    for a in lowered.actions:
        ops[a.op].append(a)
    # every cross-device data edge of the compute plan is now a SEND to the consumer's device
    for consumer in plan.actions:
        for src in plan.deps[consumer]:
            if src.device != consumer.device:
                send = Action(
                    Op.SEND, plan.slot(src), src.microbatch, consumer.device, src.iteration
                )
                assert send in lowered.deps[consumer]
    assert len(ops[Op.UPLOAD]) == len(ops[Op.FREE])
    backward_uploads = [u for u in ops[Op.UPLOAD] if u.stage >= plan.num_fwd_stages]
    assert len(ops[Op.DOWNLOAD]) == len(backward_uploads)
    assert len(ops[Op.OPT]) == 2 * (plan.num_layers + 1)
    assert all(o.device == HOST for o in ops[Op.OPT])
    # async: iteration 1's uploads do not wait for any optimizer step; sync: they do
    assert not any(d.op is Op.OPT for u in ops[Op.UPLOAD] for d in lowered.deps[u])
    synced = schedules.lower(plan, optimizer="sync")
    waits = [u for u in synced.actions if u.op is Op.UPLOAD and u.iteration == 1]
    assert all(any(d.op is Op.OPT for d in synced.deps[u]) for u in waits)


def test_lower_bound_schedule_keeps_weights_resident() -> None:
    plan = schedules.gpipe(stage_layers=[1, 1], num_devices=2, num_microbatches=2)
    lowered = schedules.lower(plan)
    assert {a.op for a in lowered.actions} == {Op.FWD, Op.BWD, Op.SEND}
    schedules.validate(lowered)


# ---- validate's errors -------------------------------------------------------------------------
def _small() -> Plan:
    return schedules.roundpipe(fwd_cuts=[2], bwd_cuts=[1, 1], num_devices=2, num_microbatches=2)


def test_validate_reports_missing_actions_with_the_grid() -> None:
    plan = _small()
    broken = dataclasses.replace(plan, actions=plan.actions[:-1])
    with pytest.raises(PlanError, match="missing") as err:
        schedules.validate(broken)
    assert "d0:" in str(err.value) and "d1:" in str(err.value)


def test_validate_marks_an_out_of_order_step() -> None:
    plan = _small()
    actions = list(plan.actions)
    head = next(i for i, a in enumerate(actions) if a.op is Op.HEAD)
    actions.insert(0, actions.pop(head))  # the head before the forward that feeds it
    with pytest.raises(PlanError, match="not topological") as err:
        schedules.validate(dataclasses.replace(plan, actions=tuple(actions)))
    assert ">>H0.0@1<<" in str(err.value)


def test_validate_requires_every_upload_released() -> None:
    lowered = schedules.lower(_small(), optimizer="")
    free = next(a for a in lowered.actions if a.op is Op.FREE)
    broken = dataclasses.replace(lowered, actions=tuple(a for a in lowered.actions if a != free))
    with pytest.raises(PlanError, match="never released"):
        schedules.validate(broken)


def test_validate_checks_device_memory() -> None:
    costs = LayerCosts.uniform(
        2, fwd_ms=1.0, bwd_ms=2.0, param_bytes=1 << 20, act_bytes=4 << 20, head_param_bytes=2 << 20
    )
    plan = _small()
    peaks = schedules.validate(plan, costs=costs)
    assert max(peaks) > 4 << 20
    with pytest.raises(PlanError, match="over the budget") as err:
        schedules.validate(plan, costs=costs, memory_budget_bytes=max(peaks) - 1)
    assert ">>" in str(err.value)
    schedules.validate(plan, costs=costs, memory_budget_bytes=max(peaks))


def test_validate_rejects_bad_devices() -> None:
    plan = _small()
    bad = dataclasses.replace(plan, actions=(Action(Op.FWD, 0, 0, 5),) + plan.actions[1:])
    with pytest.raises(PlanError, match="outside"):
        schedules.validate(bad)


def test_deadlocked_bound_order_is_reported() -> None:
    def backward_first(rank: int, k: int, n: int, m: int) -> list[tuple[str, int, int]]:
        return [("B", rank, 0), ("F", rank, 0)]

    with pytest.raises(PlanError, match="deadlock") as err:
        schedules._bound_plan(
            "broken", backward_first, [1, 1], 2, 1, iteration=0, device_order=None
        )
    assert ">>" in str(err.value)
