"""Tests for rp_engine.plan.simulate: the published Qwen3-1.7B bubble table, the fast timing
pass against the event simulator, bubble trends over the grid, the machine model, the CLI."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from rp_engine.plan import cli, schedules, simulate
from rp_engine.plan.actions import Action, Op, Plan, PlanError
from rp_engine.plan.partition import LayerCosts, balanced_stage_layers, load_costs
from rp_engine.plan.traffic import activation_traffic

QWEN_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "costs" / "qwen3_1_7b.json"
BOUND_8 = (3, 3, 4, 4, 4, 4, 4, 2)
VIRTUAL_24 = (1,) * 18 + (2,) * 5 + (0,)
RP_FWD, RP_BWD = (7, 7, 7, 7), (0, 3, 3, 3, 3, 3, 3, 3, 3, 2, 2)


@pytest.fixture(scope="module")
def qwen() -> LayerCosts:
    return load_costs(QWEN_PATH)


# ---- the published table -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,stage_layers,published",
    [
        ("gpipe", BOUND_8, 36.1),
        ("1f1b", BOUND_8, 35.2),
        ("interleaved-1f1b", VIRTUAL_24, 27.8),
        ("looped-bfs", VIRTUAL_24, 25.0),
    ],
)
def test_bound_schedules_reproduce_the_published_bubble(
    qwen: LayerCosts, name: str, stage_layers: tuple[int, ...], published: float
) -> None:
    plan = schedules.build(name, stage_layers=stage_layers, num_devices=8, num_microbatches=16)
    got = 100 * simulate.simulate(plan, qwen).bubble_ratio
    assert got == pytest.approx(published, abs=0.1)  # acceptance: 2 points


def test_roundpipe_reproduces_the_published_bubbles(qwen: LayerCosts) -> None:
    kwargs = dict(fwd_cuts=RP_FWD, bwd_cuts=RP_BWD, num_devices=8, num_microbatches=16)
    one = simulate.simulate(schedules.roundpipe(**kwargs), qwen)
    assert 100 * one.bubble_ratio == pytest.approx(19.1, abs=0.1)  # acceptance: 2.5 points
    assert 100 * one.bubble_ratio_fill_drain == pytest.approx(4.1, abs=0.1)
    steady = simulate.simulate(
        schedules.build("roundpipe", num_iterations=4, **kwargs), qwen, optimizer="async"
    )
    assert abs(100 * steady.bubble_ratio - 4.1) <= 2.5
    assert steady.iteration_ms < one.makespan_ms
    assert steady.busy_ms == pytest.approx(one.busy_ms)


# ---- the fast pass is the simulator -------------------------------------------------------------
def _random_plans(rng: random.Random) -> list[tuple[Plan, str]]:
    out = []
    for _ in range(6):
        layers, n, m = rng.randint(3, 20), rng.randint(1, 6), rng.randint(1, 12)
        kf, kb = rng.randint(1, layers), rng.randint(1, layers)
        fwd = [layers // kf + (i < layers % kf) for i in range(kf)]
        bwd = [0] + [layers // kb + (i < layers % kb) for i in range(kb)]
        opt = rng.choice(["sync", "async"])
        out.append(
            (
                schedules.build(
                    "roundpipe",
                    num_iterations=rng.randint(1, 3),
                    fwd_cuts=fwd,
                    bwd_cuts=bwd,
                    num_devices=n,
                    num_microbatches=m,
                ),
                opt,
            )
        )
        costs = LayerCosts.uniform(layers, fwd_ms=1.0, bwd_ms=2.0)
        for name in ("1f1b", "looped-bfs"):
            k = n if name == "1f1b" else min(2 * n, layers + 1)
            out.append(
                (
                    schedules.build(
                        name,
                        stage_layers=balanced_stage_layers(costs, k),
                        num_devices=n,
                        num_microbatches=m,
                    ),
                    "sync",
                )
            )
    return out


def test_quick_times_match_the_event_simulator() -> None:
    rng = random.Random(5)
    for plan, opt in _random_plans(rng):
        costs = LayerCosts(
            fwd_ms=[rng.uniform(1, 3) for _ in range(plan.num_layers)],
            bwd_ms=[rng.uniform(2, 5) for _ in range(plan.num_layers)],
            head_fwd_ms=rng.uniform(1, 5),
            head_bwd_ms=rng.uniform(2, 9),
            comm_ms=rng.choice([0.0, 0.3]),
        )
        quick = simulate.quick_times(plan, costs, optimizer=opt)
        full = simulate.simulate(plan, costs, optimizer=opt)
        ends: dict[int, float] = {}
        for iv in full.intervals:
            ends[iv.action.iteration] = max(ends.get(iv.action.iteration, 0.0), iv.end_ms)
        assert list(quick.iteration_ends) == pytest.approx([ends[i] for i in sorted(ends)])
        assert quick.busy_ms == pytest.approx(full.busy_ms * len(plan.iterations))
        if len(plan.iterations) == 1:
            n, mk = plan.num_devices, full.makespan_ms
            expected = (n * mk - full.busy_ms - quick.fill_drain_ms(n)) / (n * mk)
            assert full.bubble_ratio_fill_drain == pytest.approx(expected)


# ---- trends over the grid -----------------------------------------------------------------------
def _plan(name: str, costs: LayerCosts, n: int, m: int, iterations: int = 1) -> Plan:
    if name == "roundpipe":
        L = costs.num_layers
        fwd = [L // 4 + (i < L % 4) for i in range(4)]
        bwd = [0] + [L // 8 + (i < L % 8) for i in range(8)]
        return schedules.build(
            "roundpipe",
            num_iterations=iterations,
            fwd_cuts=fwd,
            bwd_cuts=bwd,
            num_devices=n,
            num_microbatches=m,
        )
    v = 2 if name in ("interleaved-1f1b", "looped-bfs") else 1
    stage_layers = balanced_stage_layers(costs, v * n)
    if name == "mobius":
        return schedules.mobius(fwd_cuts=stage_layers, num_devices=n, num_microbatches=m)
    return schedules.build(name, stage_layers=stage_layers, num_devices=n, num_microbatches=m)


NAMES = ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "mobius", "roundpipe"]


@pytest.mark.parametrize("layers", [8, 30, 96])
def test_one_device_has_no_schedule_bubble(layers: int) -> None:
    costs = LayerCosts.uniform(
        layers, fwd_ms=1.0, bwd_ms=2.0, head_fwd_ms=4.0, head_bwd_ms=8.0, comm_ms=0.5
    )
    for name in NAMES:
        for m in (1, 5, 32):
            result = simulate.simulate(_plan(name, costs, 1, m), costs)
            assert result.bubble_ratio == pytest.approx(0.0, abs=1e-12), (name, m)
    steady = simulate.simulate(
        _plan("roundpipe", costs, 1, 4, iterations=3), costs, optimizer="async"
    )
    assert steady.bubble_ratio == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("layers,n", [(8, 2), (28, 4), (61, 8), (96, 8)])
def test_bubble_falls_as_microbatches_grow(layers: int, n: int) -> None:
    rng = random.Random(layers)
    costs = LayerCosts(
        fwd_ms=[rng.uniform(5, 9) for _ in range(layers)],
        bwd_ms=[rng.uniform(10, 18) for _ in range(layers)],
        head_fwd_ms=20.0,
        head_bwd_ms=40.0,
        comm_ms=1.0,
    )
    for name in NAMES:
        bubbles = [
            simulate.simulate(_plan(name, costs, n, k * n), costs).bubble_ratio for k in (1, 2, 4)
        ]
        assert bubbles[0] > bubbles[1] > bubbles[2] > 0, (name, bubbles)
    steady = [
        simulate.simulate(
            _plan("roundpipe", costs, n, m, iterations=3), costs, optimizer="async"
        ).bubble_ratio
        for m in (1, n, 4 * n)
    ]
    assert steady[0] >= steady[1] - 1e-9 and steady[1] >= steady[2] - 1e-9


# ---- the machine model --------------------------------------------------------------------------
def _bytes_costs(layers: int = 8) -> LayerCosts:
    mb = 1_000_000
    return LayerCosts.uniform(
        layers,
        fwd_ms=10.0,
        bwd_ms=20.0,
        head_fwd_ms=20.0,
        head_bwd_ms=40.0,
        param_bytes=200 * mb,
        act_bytes=100 * mb,
        head_param_bytes=600 * mb,
        boundary_bytes=16 * mb,
        comm_ms=1.0,
    )


def test_presets_load() -> None:
    assert {"rtx4090_pcie4_8x", "a800_nvlink_8x"} <= set(simulate.preset_names())
    rtx = simulate.load_machine("rtx4090_pcie4_8x")
    assert (rtx.h2d_gbps, rtx.d2h_gbps, rtx.p2p) == (24.0, 26.6, False)
    assert rtx.device_order == (0, 4, 1, 5, 2, 6, 3, 7)
    a800 = simulate.load_machine("a800_nvlink_8x")
    assert a800.p2p and a800.p2p_gbps == 400.0 and a800.compute_scale < 1
    with pytest.raises(ValueError, match="no machine"):
        simulate.load_machine("tpu-v9")


def test_machine_moves_the_bytes_the_plan_implies() -> None:
    costs = _bytes_costs()
    plan = schedules.roundpipe(
        fwd_cuts=[4, 4], bwd_cuts=[0, 2, 2, 2, 2], num_devices=4, num_microbatches=8
    )
    machine = simulate.load_machine("rtx4090_pcie4_8x")
    result = simulate.simulate(plan, costs, machine=machine, optimizer="sync")
    lowered = schedules.lower(plan, optimizer="sync")
    st = costs.stages(plan.fwd_cuts, plan.bwd_cuts)
    uploads = sum(st.param_bytes[a.stage] for a in lowered.actions if a.op is Op.UPLOAD)
    assert result.bytes_moved["weights_h2d"] == uploads
    assert result.bytes_moved["grads_d2h"] == sum(
        st.grad_bytes[a.stage] for a in lowered.actions if a.op is Op.DOWNLOAD
    )
    # activations move as the runtime moves them: every backward stage's input is stashed on
    # the host after its forward and uploaded again, on the same device too (plan/traffic.py)
    traffic = activation_traffic(plan, costs)
    assert result.bytes_moved["act_d2h"] == traffic["act_d2h"]
    assert result.bytes_moved["act_h2d"] == traffic["act_h2d"]
    sends = sum(1 for a in lowered.actions if a.op is Op.SEND)
    assert traffic["act_h2d"] > sends * 16_000_000  # more than the cross-device SENDs alone
    # a weight upload of 400 MB at 24 GB/s takes 16.7 ms, at least
    ups = [iv for iv in result.intervals if iv.phase == "upload" and iv.action.stage == 0]
    assert all(iv.end_ms - iv.start_ms >= 400e6 / 24e9 * 1e3 - 1e-6 for iv in ups)
    assert 0 < max(result.peak_memory_bytes) < machine.memory_bytes
    nvlink = simulate.simulate(
        plan, costs, machine=dataclasses.replace(machine, p2p=True, p2p_gbps=400.0)
    )
    # peer to peer carries the cross-device sends; the stash still goes through the host
    assert nvlink.bytes_moved["act_p2p"] > 0
    assert 0 < nvlink.bytes_moved["act_d2h"] < result.bytes_moved["act_d2h"]
    assert nvlink.makespan_ms <= result.makespan_ms


def test_shared_host_link_and_slow_links_cost_time() -> None:
    costs = _bytes_costs()
    plan = schedules.roundpipe(
        fwd_cuts=[4, 4], bwd_cuts=[0, 2, 2, 2, 2], num_devices=4, num_microbatches=4
    )
    fast = simulate.Machine(name="fast", num_devices=4, h2d_gbps=100.0, d2h_gbps=100.0)
    slow = dataclasses.replace(fast, name="slow", h2d_gbps=2.0, d2h_gbps=2.0)
    shared = dataclasses.replace(fast, name="shared", host_link_gbps=4.0)
    t_fast, t_slow, t_shared = (
        simulate.simulate(plan, costs, machine=m).makespan_ms for m in (fast, slow, shared)
    )
    assert t_fast < t_shared and t_fast < t_slow


def test_async_optimizer_overlaps_the_cpu_step() -> None:
    costs = _bytes_costs()
    machine = simulate.Machine(name="m", num_devices=4, cpu_adam_params_per_s=2e10)
    kwargs = dict(fwd_cuts=[4, 4], bwd_cuts=[0, 2, 2, 2, 2], num_devices=4, num_microbatches=8)
    plan = schedules.build("roundpipe", num_iterations=4, **kwargs)
    sync = simulate.simulate(plan, costs, machine=machine, optimizer="sync")
    asyn = simulate.simulate(plan, costs, machine=machine, optimizer="async")
    assert asyn.iteration_ms < sync.iteration_ms
    assert any(iv.lane == "cpu" for iv in sync.intervals)
    slower_cpu = dataclasses.replace(machine, cpu_adam_params_per_s=2e9)
    assert (
        simulate.simulate(plan, costs, machine=slower_cpu, optimizer="sync").iteration_ms
        > sync.iteration_ms
    )


def test_simulate_reports_a_stuck_plan() -> None:
    plan = schedules.roundpipe(fwd_cuts=[1], bwd_cuts=[1], num_devices=1, num_microbatches=1)
    swapped = dataclasses.replace(plan, actions=tuple(reversed(plan.actions)))
    with pytest.raises(PlanError, match="cannot progress") as err:
        simulate.simulate(swapped, LayerCosts.uniform(1, fwd_ms=1.0, bwd_ms=1.0))
    assert ">>" in str(err.value)


def test_recompute_is_aligned_to_the_gradient(qwen: LayerCosts) -> None:
    plan = schedules.roundpipe(fwd_cuts=RP_FWD, bwd_cuts=RP_BWD, num_devices=8, num_microbatches=8)
    result = simulate.simulate(plan, qwen)
    phases: dict[Action, dict[str, tuple[float, float]]] = {}
    for iv in result.intervals:
        phases.setdefault(iv.action, {})[iv.phase] = (iv.start_ms, iv.end_ms)
    for spans in phases.values():
        if "recompute" in spans:
            assert spans["recompute"][1] == pytest.approx(spans["bwd"][0])


# ---- the command line ---------------------------------------------------------------------------
def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert (
        cli.main(
            ["--costs", str(QWEN_PATH), "--devices", "8", "--microbatches", "16", *args, "--json"]
        )
        == 0
    )
    return json.loads(capsys.readouterr().out)


def test_cli_published_rows(capsys: pytest.CaptureFixture[str]) -> None:
    out = _cli(capsys, "--schedule", "looped-bfs", "--stage-layers", ",".join(map(str, VIRTUAL_24)))
    assert out["schedule"] == "looped-bfs" and out["num_fwd_stages"] == 24
    assert 100 * out["bubble_ratio"] == pytest.approx(25.0, abs=0.1)
    out = _cli(
        capsys,
        "--schedule",
        "roundpipe-async",
        "--fwd-cuts",
        "7,7,7,7",
        "--bwd-cuts",
        ",".join(map(str, RP_BWD)),
    )
    assert (out["num_fwd_stages"], out["num_bwd_stages"]) == (4, 11)
    assert 0 <= out["bubble_ratio"] <= 1 and out["makespan_ms"] > 0
    assert 100 * out["bubble_ratio_fill_drain"] == pytest.approx(4.1, abs=0.1)


def test_cli_partitioner_and_outputs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    out = _cli(capsys, "--schedule", "roundpipe-sync", "--trace", str(trace), "--png", str(png))
    assert out["partitioner"] is True and 100 * out["bubble_ratio"] < 19.1
    assert json.loads(trace.read_text())["traceEvents"] and png.stat().st_size > 1000
    out = _cli(capsys, "--schedule", "mobius", "--machine", "rtx4090_pcie4_8x")
    assert out["machine"].startswith("8x RTX 4090") and out["bubble_ratio"] > 0
