"""Tests for rp_engine.plan.actions: action text form, Plan text round trip, golden plans,
dependency rules."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from rp_engine.plan import schedules
from rp_engine.plan.actions import HOST, Action, Op, Plan, PlanError, format_grid, parse_action

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def test_action_text_examples() -> None:
    assert str(Action(Op.FWD, 3, 1, 2)) == "F3.1@2"
    assert str(Action(Op.BWD, 3, 1, 2, iteration=1)) == "B3.1@2#1"
    assert str(Action(Op.HEAD, 0, 7, 0)) == "H0.7@0"
    assert str(Action(Op.OPT, 12, 0, HOST, 3)) == "O12.0@h#3"
    assert parse_action("F3.1@2") == Action(Op.FWD, 3, 1, 2, 0)


def test_action_text_round_trips_for_every_op() -> None:
    devices = (HOST, 0, 1, 7, 12)
    for op, stage, mb, dev, it in itertools.product(Op, (0, 5, 31), (0, 3), devices, (0, 1, 9)):
        a = Action(op, stage, mb, dev, it)
        assert parse_action(str(a)) == a
        assert hash(parse_action(str(a))) == hash(a)


@pytest.mark.parametrize("bad", ["", "F3@2", "Q1.2@3", "F1.2@x", "F-1.2@0", "F1.2@0#"])
def test_parse_action_rejects_garbage(bad: str) -> None:
    with pytest.raises(ValueError, match="not an action"):
        parse_action(bad)


def _plans() -> list[Plan]:
    return [
        schedules.roundpipe(
            fwd_cuts=[2, 2],
            bwd_cuts=[0, 1, 1, 2],
            num_devices=3,
            num_microbatches=5,
            start_device=1,
        ),
        schedules.one_f_one_b(stage_layers=[1, 2, 1], num_devices=3, num_microbatches=4),
        schedules.interleaved_1f1b(stage_layers=[1, 1, 1, 0], num_devices=2, num_microbatches=3),
        schedules.mobius(fwd_cuts=[2, 1, 1, 1], num_devices=4, num_microbatches=4),
        schedules.lower(
            schedules.build(
                "roundpipe",
                num_iterations=2,
                fwd_cuts=[2],
                bwd_cuts=[1, 1],
                num_devices=2,
                num_microbatches=2,
            )
        ),
    ]


@pytest.mark.parametrize("plan", _plans(), ids=lambda p: p.schedule)
def test_plan_text_round_trips(plan: Plan) -> None:
    back = Plan.from_text(plan.to_text())
    assert back == plan
    assert back.deps == plan.deps
    assert back.next_start_device == plan.next_start_device


def test_per_device_is_the_issue_order_filtered() -> None:
    plan = _plans()[0]
    for d in range(plan.num_devices):
        assert plan.per_device(d) == [a for a in plan.actions if a.device == d]
    assert sum(len(plan.per_device(d)) for d in range(plan.num_devices)) == len(plan.actions)


def test_plan_rejects_cuts_covering_different_layers() -> None:
    with pytest.raises(PlanError, match="same L"):
        Plan(actions=(), num_devices=1, num_microbatches=1, fwd_cuts=(2,), bwd_cuts=(1,))


def test_roundpipe_dependencies_follow_the_data() -> None:
    # layers 0-3 forward in two stages; backward: head + 1, then 1, then 2
    plan = schedules.roundpipe(
        fwd_cuts=[2, 2], bwd_cuts=[1, 1, 2], num_devices=2, num_microbatches=1
    )
    by_name = {f"{a.op.value}{a.stage}": a for a in plan.actions}
    deps = {name: {f"{d.op.value}{d.stage}" for d in plan.deps[a]} for name, a in by_name.items()}
    assert deps["F0"] == set()
    assert deps["F1"] == {"F0"}
    assert deps["H0"] == {"F1"}  # input of layer 3 comes out of forward stage 1
    assert deps["B1"] == {"F1", "H0"}  # input of layer 2: forward stage 1 (starts there) ...
    assert deps["B2"] == {"F0", "B1"}  # the prefix output for layers 0-1
    assert plan.is_grad_edge(by_name["B1"], by_name["H0"])
    assert not plan.is_grad_edge(by_name["B1"], by_name["F1"])


def test_bound_backward_waits_for_the_next_stage_and_its_own_forward() -> None:
    plan = schedules.gpipe(stage_layers=[1, 1, 0], num_devices=3, num_microbatches=1)
    fwd = {a.stage: a for a in plan.actions if a.op is Op.FWD}
    bwd = {a.stage: a for a in plan.actions if a.op is Op.BWD}
    assert set(plan.deps[bwd[0]]) == {fwd[2]}  # loss from the head-only last stage
    assert set(plan.deps[bwd[1]]) == {fwd[1], bwd[0]}  # its input stays on its device
    assert not plan.fused_head


def test_format_grid_marks_a_step() -> None:
    plan = _plans()[1]
    mark = plan.per_device(1)[2]
    grid = format_grid(plan, mark=mark)
    assert f">>{mark}<<" in grid
    assert grid.splitlines()[0].startswith("d0: ")


# ---- golden plans ----------------------------------------------------------------------------
def _golden_cases() -> dict[str, Plan]:
    return {
        # S = 5 slots on 3 devices: the second round starts on device (0 + 5) mod 3 = 2
        "roundpipe_3dev_5mb.txt": schedules.roundpipe(
            fwd_cuts=[3, 3], bwd_cuts=[0, 3, 3], num_devices=3, num_microbatches=5
        ),
        "one_f_one_b_4dev.txt": schedules.one_f_one_b(
            stage_layers=[2, 2, 2, 1], num_devices=4, num_microbatches=6
        ),
        "roundpipe_lowered_2dev.txt": schedules.lower(
            schedules.roundpipe(fwd_cuts=[2], bwd_cuts=[1, 1], num_devices=2, num_microbatches=2),
            optimizer="sync",
        ),
    }


@pytest.mark.parametrize("name", sorted(_golden_cases()))
def test_golden_plans(name: str) -> None:
    plan = _golden_cases()[name]
    path = GOLDEN / name
    if os.environ.get("RP_UPDATE_GOLDEN"):
        path.write_text(plan.to_text())
    assert path.exists(), f"missing {path}: run with RP_UPDATE_GOLDEN=1 to create it"
    text = path.read_text()
    assert plan.to_text() == text, f"{name} changed; if intended, RP_UPDATE_GOLDEN=1 rewrites it"
    assert Plan.from_text(text) == plan
    schedules.validate(Plan.from_text(text))


def test_plan_package_is_pure_python() -> None:
    """No torch in plan/, and matplotlib only inside a function (render.write_png)."""
    import ast

    package = Path(__file__).resolve().parents[2] / "rp_engine" / "plan"
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            roots = {name.split(".")[0] for name in names}
            assert "torch" not in roots, f"{path.name} imports torch"
            if "matplotlib" in roots:
                assert path.name == "render.py" and id(node) not in top_level, path.name
