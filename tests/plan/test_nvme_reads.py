"""NVMe reads in the plan (the parameter tier): ``Op.READ`` feeds each UPLOAD of a slot whose
weights live on NVMe, ``nvme_read_ahead`` uploads ahead; validate, the simulator and render
count them, and a plan lowered without NVMe slots is what it always was."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rp_engine.plan import render, schedules, simulate
from rp_engine.plan.actions import HOST, Action, Op, Plan, PlanError, format_grid, parse_action
from rp_engine.plan.costs import LayerCosts
from rp_engine.runtime.planning import ModelShape, Planner

MB = 1_000_000


def _costs() -> LayerCosts:
    return LayerCosts.uniform(
        4, fwd_ms=1.0, bwd_ms=2.0, param_bytes=4 * MB, head_param_bytes=2 * MB,
        boundary_bytes=MB // 10,
    )  # fmt: skip


def _compute(devices: int = 2, gas: int = 4, round_size: int = 2, iterations: int = 1) -> Plan:
    return schedules.build(
        "roundpipe", num_iterations=iterations, fwd_cuts=(2, 2), bwd_cuts=(1, 1, 2),
        num_devices=devices, num_microbatches=gas, round_size=round_size,
    )  # fmt: skip


def _ops(plan: Plan, op: Op) -> list[Action]:
    return [a for a in plan.actions if a.op is op]


def _key(a: Action) -> tuple[int, int, int, int]:
    return (a.stage, a.microbatch, a.device, a.iteration)


def test_read_text_form_round_trips() -> None:
    read = Action(Op.READ, 3, 1, 2, 1)
    assert str(read) == "R3.1@2#1"
    assert parse_action("R3.1@2#1") == read
    assert parse_action(str(Action(Op.READ, 0, 4, 0))) == Action(Op.READ, 0, 4, 0)
    # appended: the letters (and golden files) of the other ops are unchanged
    assert [op.value for op in Op] == ["F", "B", "H", "U", "D", "S", "O", "X", "R"]


@pytest.mark.parametrize("read_ahead", [1, 2, 3])
def test_each_upload_gets_one_read_read_ahead_uploads_before_it(read_ahead: int) -> None:
    plan = schedules.lower(
        _compute(iterations=2), optimizer="async", nvme_slots=True, nvme_read_ahead=read_ahead
    )
    uploads, reads = _ops(plan, Op.UPLOAD), _ops(plan, Op.READ)
    # one READ per UPLOAD, same slot, micro-batch, device and iteration, in the uploads' order
    assert [_key(r) for r in reads] == [_key(u) for u in uploads] and len(uploads) > read_ahead
    pos = {a: i for i, a in enumerate(plan.actions)}
    assert [pos[r] for r in reads[:read_ahead]] == list(range(read_ahead))  # at the front
    for k in range(read_ahead, len(reads)):  # right after nvme upload k - R
        assert pos[reads[k]] == pos[uploads[k - read_ahead]] + 1
    assert (plan.nvme_slots, plan.nvme_read_ahead) == (tuple(range(plan.num_slots)), read_ahead)
    schedules.validate(plan, costs=_costs())
    assert Plan.from_text(plan.to_text()) == plan


def test_dependencies_of_reads_and_uploads() -> None:
    plan = schedules.lower(_compute(), optimizer="", nvme_slots=True, nvme_read_ahead=2)
    uploads, reads = _ops(plan, Op.UPLOAD), _ops(plan, Op.READ)
    for k, (r, u) in enumerate(zip(reads, uploads, strict=True)):
        assert r in plan.deps[u]  # the UPLOAD copies what its READ staged
        # FIFO, and the staging buffer of READ k - 2 is free once its UPLOAD is done
        expected = ([reads[k - 1]] if k else []) + ([uploads[k - 2]] if k >= 2 else [])
        assert set(plan.deps[r]) == set(expected)


def test_only_the_named_slots_are_read() -> None:
    plan = schedules.lower(_compute(), optimizer="", nvme_slots=(1, 3), nvme_read_ahead=3)
    reads = {_key(r) for r in _ops(plan, Op.READ)}
    for u in _ops(plan, Op.UPLOAD):
        assert (_key(u) in reads) == (u.stage in (1, 3))
        assert any(d.op is Op.READ for d in plan.deps[u]) == (u.stage in (1, 3))
    schedules.validate(plan)
    text = plan.to_text()
    assert " nvme=1,3 read_ahead=3" in text.splitlines()[0]
    assert "\nnvme: R" in text and Plan.from_text(text) == plan
    with pytest.raises(ValueError, match=r"nvme_slots \[9\]"):
        schedules.lower(_compute(), nvme_slots=(9,))
    with pytest.raises(ValueError, match="nvme_read_ahead"):
        schedules.lower(_compute(), nvme_slots=True, nvme_read_ahead=0)
    with pytest.raises(ValueError, match="offloaded"):
        schedules.lower(_compute(), offload=False, nvme_slots=True)


def test_without_nvme_slots_the_plan_is_unchanged() -> None:
    for compute in (_compute(iterations=2), schedules.mobius(
        fwd_cuts=(1, 1, 2), num_devices=3, num_microbatches=3
    )):  # fmt: skip
        plain = schedules.lower(compute)
        for off in (False, (), None):
            same = schedules.lower(compute, nvme_slots=off)  # type: ignore[arg-type]
            assert same == plain and same.to_text() == plain.to_text()
        assert "nvme" not in plain.to_text() and "R" not in format_grid(plain)
        # the reads are the only change: the rest of the issue order is the plain plan's
        read = schedules.lower(compute, nvme_slots=True)
        assert tuple(a for a in read.actions if a.op is not Op.READ) == plain.actions


def test_validate_names_a_missing_or_stray_read() -> None:
    plan = schedules.lower(_compute(), optimizer="", nvme_slots=True)
    reads = _ops(plan, Op.READ)
    victim = reads[3]
    missing = dataclasses.replace(plan, actions=tuple(a for a in plan.actions if a != victim))
    upload = Action(Op.UPLOAD, *_key(victim))
    with pytest.raises(PlanError, match=rf">>{upload}<<") as err:
        schedules.validate(missing)
    assert f"{upload} uploads NVMe slot {victim.stage} with no READ" in str(err.value)
    # a READ issued after its UPLOAD does not feed it
    late = [a for a in plan.actions if a != victim]
    late.insert(late.index(upload) + 1, victim)
    with pytest.raises(PlanError, match="with no READ"):
        schedules.validate(dataclasses.replace(plan, actions=tuple(late)))
    # a READ no UPLOAD consumes
    stray = Action(Op.READ, 0, 99, 0)
    with pytest.raises(PlanError, match=rf"{stray} feeds no later UPLOAD"):
        schedules.validate(dataclasses.replace(plan, actions=plan.actions + (stray,)))
    # a READ of a slot the plan does not keep on NVMe
    with pytest.raises(PlanError, match="not an NVMe slot"):
        schedules.validate(dataclasses.replace(plan, nvme_slots=(0,)))


def test_simulated_reads_take_the_nvme_lane_at_its_bandwidth() -> None:
    costs, compute = _costs(), _compute(iterations=2)
    gbps = 0.5  # slow enough to hold up the uploads
    machine = simulate.Machine("m", num_devices=2, h2d_gbps=20.0, d2h_gbps=20.0,
                               nvme_read_gbps=gbps)  # fmt: skip
    plain = simulate.simulate(schedules.lower(compute, optimizer="sync"), costs, machine=machine)
    plan = schedules.lower(compute, optimizer="sync", nvme_slots=True)
    result = simulate.simulate(plan, costs, machine=machine)
    assert result.makespan_ms > plain.makespan_ms
    assert not any(iv.lane == "nvme" for iv in plain.intervals)
    lane = sorted((iv for iv in result.intervals if iv.lane == "nvme"), key=lambda iv: iv.start_ms)
    assert [iv.action for iv in lane] == _ops(plan, Op.READ)  # one at a time, in issue order
    assert all(iv.device == HOST and iv.phase == "read" for iv in lane)
    assert all(a.end_ms <= b.start_ms + 1e-9 for a, b in zip(lane, lane[1:], strict=False))
    st = costs.stages(plan.fwd_cuts, plan.bwd_cuts)
    total = sum(st.param_bytes[r.stage] for r in _ops(plan, Op.READ))
    busy = sum(iv.end_ms - iv.start_ms for iv in lane)
    assert busy == pytest.approx(total / (gbps * 1e6))  # ms at GB/s
    assert result.bytes_moved["weights_nvme"] == total == result.bytes_moved["weights_h2d"]
    read_end = {iv.action: iv.end_ms for iv in lane}
    for iv in result.intervals:  # each upload copies what its READ staged
        if iv.phase == "upload":
            assert iv.start_ms >= read_end[Action(Op.READ, *_key(iv.action))] - 1e-9
    # drawn on its own host row, like the optimizer's
    grid = render.text_grid(result, width=50, lanes=("compute", "cpu", "nvme"))
    rows = {r.split("|")[0].strip(): r for r in grid.splitlines() if "|" in r}
    assert "host" in rows and "R" in rows["nvme"].split("|")[1] and "R=read" in grid
    trace = render.chrome_trace(result)
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert "nvme" in threads and json.dumps(trace)


def test_machine_nvme_bandwidth() -> None:
    assert simulate.Machine("m").nvme_read_gbps == 3.5
    assert simulate.load_machine("rtx4090_pcie4_8x").nvme_read_gbps == 3.5
    with pytest.raises(ValueError, match="nvme_read_gbps"):
        simulate.Machine("m", nvme_read_gbps=0.0)


def test_measured_reads_are_drawn_on_the_nvme_row() -> None:
    @dataclasses.dataclass
    class Rec:
        device: int
        action: str
        start: float
        end: float
        stream: str

    result = render.measured_result(
        [Rec(0, "R1.0@0", 0.0, 0.002, "h2d_param"), Rec(0, "U1.0@0", 0.002, 0.003, "h2d_param")]
    )
    (read,) = [iv for iv in result.intervals if iv.action.op is Op.READ]
    assert (read.device, read.lane, read.phase) == (HOST, "nvme", "read")
    assert "nvme |R" in render.text_grid(result, width=10, lanes=("h2d_param", "nvme"))


def test_the_planner_lowers_with_nvme_slots() -> None:
    shape = ModelShape(4, False, (1000,) * 4, 3000, 0)
    kw = {"num_devices": 2, "num_microbatches": 4, "fwd_cuts": (2, 2), "bwd_cuts": (1, 1, 2)}
    plain = Planner(shape, **kw).plan(4)  # type: ignore[arg-type]
    assert not _ops(plain, Op.READ) and plain.nvme_slots == ()
    planner = Planner(shape, **kw, nvme_slots=True, nvme_read_ahead=3)  # type: ignore[arg-type]
    plan = planner.plan(4)
    assert len(_ops(plan, Op.READ)) == len(_ops(plan, Op.UPLOAD)) > 0
    assert plan.nvme_read_ahead == 3
    assert tuple(a for a in plan.actions if a.op is not Op.READ) == plain.actions
    assert not _ops(planner.plan(4, nvme_slots=False), Op.READ)  # a per-call override
    schedules.validate(plan)
