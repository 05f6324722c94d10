"""The simulator's per-action host overhead (``Machine.action_overhead_ms``) and the runtime's
host-resident activation inputs (the stash of a backward stage's input): charged where the
runtime pays them, as documented in rp_engine/plan/simulate/."""

from __future__ import annotations

import dataclasses

import pytest

from rp_engine.plan import schedules, simulate
from rp_engine.plan.actions import Op, Plan
from rp_engine.plan.partition import LayerCosts
from rp_engine.plan.simulate import events as sim_events

H = 0.25  # ms of host overhead per action


def _costs(boundary_bytes: int = 0) -> LayerCosts:
    return LayerCosts.uniform(
        4,
        fwd_ms=2.0,
        bwd_ms=4.0,
        head_fwd_ms=1.0,
        head_bwd_ms=2.0,
        param_bytes=1_000,
        head_param_bytes=1_000,
        boundary_bytes=boundary_bytes,
    )


def _fast(devices: int, overhead: float = 0.0) -> simulate.Machine:
    """Links and the CPU optimizer so fast that only compute (and the overhead) takes time."""
    return simulate.Machine(
        "fast",
        num_devices=devices,
        h2d_gbps=1e6,
        d2h_gbps=1e6,
        cpu_adam_params_per_s=1e18,
        action_overhead_ms=overhead,
    )


def _two_devices(*, iterations: int, microbatches: int) -> Plan:
    """RoundPipe on two devices, cuts [2, 2] / [0, 2, 2], ``iterations`` back to back."""
    return schedules.build(
        "roundpipe", num_iterations=iterations, fwd_cuts=[2, 2], bwd_cuts=[0, 2, 2],
        num_devices=2, num_microbatches=microbatches,
    )  # fmt: skip


def _compute(result: simulate.SimResult, device: int) -> list[simulate.Interval]:
    return [iv for iv in result.timeline(device) if iv.lane == "compute"]


def test_every_compute_action_holds_its_stream_for_the_overhead() -> None:
    """One device runs N compute actions back to back: with the overhead its last compute ends
    (N + 1) x H later (N actions, and the first upload ahead of the first one), the work itself
    (busy time, each phase's length) is unchanged, and consecutive actions are H apart."""
    plan = schedules.roundpipe(
        fwd_cuts=[2, 2], bwd_cuts=[0, 2, 2], num_devices=1, num_microbatches=4
    )
    base = simulate.simulate(plan, _costs(), machine=_fast(1), optimizer="sync")
    slow = simulate.simulate(plan, _costs(), machine=_fast(1, H), optimizer="sync")
    n = sum(1 for a in plan.actions if a.is_compute)
    last = max(iv.end_ms for iv in _compute(base, 0))
    assert max(iv.end_ms for iv in _compute(slow, 0)) == pytest.approx(last + (n + 1) * H)
    assert slow.busy_ms == pytest.approx(base.busy_ms)
    firsts = {}
    for iv in _compute(slow, 0):  # the first phase of each action
        firsts.setdefault(iv.action, iv)
    ordered = sorted(firsts.values(), key=lambda iv: iv.start_ms)
    ends = {iv.action: iv.end_ms for iv in _compute(slow, 0)}
    for prev, nxt in zip(ordered, ordered[1:], strict=False):
        assert nxt.start_ms - ends[prev.action] >= H - 1e-9


def test_default_overhead_is_zero_and_negative_is_refused() -> None:
    assert simulate.Machine("m").action_overhead_ms == 0.0
    plan = schedules.roundpipe(
        fwd_cuts=[2, 2], bwd_cuts=[0, 2, 2], num_devices=2, num_microbatches=4
    )
    explicit = simulate.simulate(plan, _costs(), machine=_fast(2, 0.0))
    default = simulate.simulate(plan, _costs(), machine=dataclasses.replace(_fast(2), name="d"))
    assert explicit.makespan_ms == default.makespan_ms
    with pytest.raises(ValueError, match="action_overhead_ms"):
        simulate.Machine("m", action_overhead_ms=-1.0)


def test_a_copy_holds_its_stream_before_its_bytes_move() -> None:
    """A copy's bytes take size / bandwidth after the overhead: the upload's interval (its
    bytes) is as long as without, and starts H after the stream took it."""
    plan = schedules.roundpipe(fwd_cuts=[4], bwd_cuts=[2, 2], num_devices=1, num_microbatches=1)
    machine = dataclasses.replace(_fast(1, H), h2d_gbps=1e-3)  # 1,000 bytes: 1 ms
    result = simulate.simulate(plan, _costs(), machine=machine, optimizer="sync")
    ups = [iv for iv in result.intervals if iv.phase == "upload"]
    first = min(ups, key=lambda iv: iv.start_ms)
    assert first.start_ms == pytest.approx(H)  # the stream took it at 0
    nbytes = _costs().stages(plan.fwd_cuts, plan.bwd_cuts).param_bytes[first.action.stage]
    assert first.end_ms - first.start_ms == pytest.approx(nbytes / 1_000)  # 1,000 B per ms


def test_the_optimizer_step_pays_the_overhead_on_the_host() -> None:
    """Optimizer steps run one at a time on the host lane, each H after the lane took it: every
    step is there, and consecutive steps' work is at least H apart."""
    plan = schedules.roundpipe(
        fwd_cuts=[2, 2], bwd_cuts=[0, 2, 2], num_devices=1, num_microbatches=2
    )
    machine = dataclasses.replace(_fast(1, H), cpu_adam_params_per_s=1e6)  # 500 params: 0.5 ms
    result = simulate.simulate(plan, _costs(), machine=machine, optimizer="sync")
    opts = sum(1 for a in schedules.lower(plan, optimizer="sync").actions if a.op is Op.OPT)
    cpu = sorted((iv for iv in result.intervals if iv.lane == "cpu"), key=lambda iv: iv.start_ms)
    assert len(cpu) == opts
    for prev, nxt in zip(cpu, cpu[1:], strict=False):
        assert nxt.start_ms - prev.end_ms >= H - 1e-9


def test_a_stashed_input_crosses_the_link_even_on_the_same_device() -> None:
    """On one device a backward stage's recompute reads its input back from the host: it starts
    only after that input's upload ("unstash"), which follows its download after the forward."""
    plan = schedules.roundpipe(fwd_cuts=[4], bwd_cuts=[0, 2, 2], num_devices=1, num_microbatches=1)
    machine = dataclasses.replace(_fast(1), h2d_gbps=1e-3, d2h_gbps=1e-3)  # 1 ms per 1,000 B
    result = simulate.simulate(plan, _costs(boundary_bytes=5_000), machine=machine)
    stash = [iv for iv in result.intervals if iv.phase == "stash"]
    unstash = [iv for iv in result.intervals if iv.phase == "unstash"]
    assert len(stash) == len(unstash) == 1  # backward stage 1 (layers 2-3); stage 2 has layer 0
    assert unstash[0].end_ms - unstash[0].start_ms >= 5.0 - 1e-9  # 5,000 B at 1,000 B/ms
    assert unstash[0].start_ms >= stash[0].end_ms - 1e-9
    recompute = next(
        iv for iv in result.intervals if iv.phase == "recompute" and iv.action.stage == 1
    )
    bwd = next(iv for iv in result.intervals if iv.phase == "bwd" and iv.action.stage == 1)
    # the recompute is displayed aligned to the gradient; its earliest start is the upload's end
    assert bwd.start_ms >= unstash[0].end_ms + 2 * 2.0 - 1e-9
    assert recompute.start_ms >= unstash[0].end_ms - 1e-9


def test_serial_overhead_takes_turns_on_one_host_lane() -> None:
    """With ``serial_overhead`` no two actions' overheads run at once, whatever their devices
    and streams: the iteration lasts at least (every compute action, copy and optimizer step)
    x H, which per-stream overheads on two devices undercut."""
    plan = schedules.roundpipe(
        fwd_cuts=[2, 2], bwd_cuts=[0, 2, 2], num_devices=2, num_microbatches=4
    )
    big = 50.0  # overhead-bound: compute and links take next to nothing
    lanes = simulate.simulate(plan, _costs(), machine=_fast(2, big), optimizer="sync")
    shared = dataclasses.replace(_fast(2, big), serial_overhead=True)
    serial = simulate.simulate(plan, _costs(), machine=shared, optimizer="sync")
    lowered = schedules.lower(plan, optimizer="sync")
    builder = sim_events._Builder(lowered, _costs(), shared, 0.0, True)  # noqa: SLF001
    counted = sum(1 for t in builder.build() if t.phase == "overhead")  # one per action/copy
    assert counted > sum(1 for a in lowered.actions if a.is_compute or a.op is Op.OPT)
    assert serial.makespan_ms >= counted * big - 1e-6
    assert lanes.makespan_ms < counted * big
    assert serial.busy_ms == pytest.approx(lanes.busy_ms)  # the work itself is unchanged
    assert not any(iv.phase == "overhead" for iv in serial.intervals)


def test_shared_host_cores_slow_what_runs_at_once() -> None:
    """CPU virtual devices on the host's cores, each device profiled on its share of them: the
    devices alone run at their profiled speed; the host overhead (one core) running while both
    compute takes its core from them, so compute stretches and the iteration grows, and no
    compute ever runs faster than profiled."""
    plan = _two_devices(iterations=2, microbatches=8)
    own = simulate.simulate(plan, _costs(), machine=_fast(2), optimizer="async")
    cores = dataclasses.replace(_fast(2), host_cores=2.0)
    alone = simulate.simulate(plan, _costs(), machine=cores, optimizer="async")
    assert alone.makespan_ms == pytest.approx(own.makespan_ms)
    serial = dataclasses.replace(_fast(2, H), serial_overhead=True)
    free = simulate.simulate(plan, _costs(), machine=serial, optimizer="async")
    shared = dataclasses.replace(serial, host_cores=2.0)
    taken = simulate.simulate(plan, _costs(), machine=shared, optimizer="async")
    assert taken.makespan_ms > free.makespan_ms
    profiled = {(iv.action, iv.phase): iv.end_ms - iv.start_ms for iv in own.intervals if iv.busy}
    stretched = 0
    for iv in taken.intervals:
        if iv.busy:
            span = iv.end_ms - iv.start_ms
            assert span >= profiled[(iv.action, iv.phase)] - 1e-6
            stretched += span > profiled[(iv.action, iv.phase)] + 1e-6
    assert stretched > 0
    with pytest.raises(ValueError, match="host_cores"):
        simulate.Machine("m", host_cores=0.0)


def test_the_share_other_processes_leave_slows_what_runs_at_once() -> None:
    """``host_share``: the cores' worth the run gets while k of its tasks want them. With
    (1, 1) a device alone keeps its core, two devices at once share one core: each runs at half
    speed where they overlap, never slower, and the iteration grows; with a share of all cores
    nothing changes."""
    plan = _two_devices(iterations=1, microbatches=4)
    cores = dataclasses.replace(_fast(2), host_cores=2.0)
    own = simulate.simulate(plan, _costs(), machine=cores, optimizer="sync")
    full = dataclasses.replace(cores, host_share=(1.0, 2.0))
    same = simulate.simulate(plan, _costs(), machine=full, optimizer="sync")
    assert same.makespan_ms == pytest.approx(own.makespan_ms)
    half = dataclasses.replace(cores, host_share=(1.0, 1.0))
    slow = simulate.simulate(plan, _costs(), machine=half, optimizer="sync")
    assert slow.makespan_ms > own.makespan_ms
    profiled = {(iv.action, iv.phase): iv.end_ms - iv.start_ms for iv in own.intervals if iv.busy}
    spans = [(iv, iv.end_ms - iv.start_ms) for iv in slow.intervals if iv.busy]
    for iv, span in spans:
        base = profiled[(iv.action, iv.phase)]
        assert base - 1e-6 <= span <= 2 * base + 1e-6
    first = min(spans, key=lambda x: x[0].start_ms)  # device 1 waits for its input: alone
    assert first[1] == pytest.approx(profiled[(first[0].action, first[0].phase)])
    assert any(span > profiled[(iv.action, iv.phase)] + 1e-6 for iv, span in spans)
    with pytest.raises(ValueError, match="host_share"):
        simulate.Machine("m", host_cores=2.0, host_share=(0.0,))


def test_global_norm_holds_every_optimizer_step_until_the_last_gradient() -> None:
    """``global_norm`` (clipping by the global norm, as optim/stepper.py steps at close_step):
    no layer's OPT starts before the iteration's last gradient download ends. Without it the
    first layers to finish step while other gradients are still on their way, and a sync
    iteration (whose next uploads wait for the steps) ends sooner."""
    plan = _two_devices(iterations=2, microbatches=4)
    costs = dataclasses.replace(_costs(), param_bytes=(2_000_000,) * 4)
    machine = dataclasses.replace(_fast(2), h2d_gbps=1.0, d2h_gbps=1.0, cpu_adam_params_per_s=1e9)
    free = simulate.simulate(plan, costs, machine=machine, optimizer="sync")
    held = simulate.simulate(plan, costs, machine=machine, optimizer="sync", global_norm=True)

    def spans(result: simulate.SimResult, phase: str) -> dict[int, list[simulate.Interval]]:
        out: dict[int, list[simulate.Interval]] = {}
        for iv in result.intervals:
            if iv.phase == phase:
                out.setdefault(iv.action.iteration, []).append(iv)
        return out

    for result, barrier in ((free, False), (held, True)):
        downloads, steps = spans(result, "download"), spans(result, "opt")
        for it, opts in steps.items():
            last = max(iv.end_ms for iv in downloads[it])
            early = [iv for iv in opts if iv.start_ms < last - 1e-6]
            assert bool(early) is not barrier, (barrier, it)
    assert held.makespan_ms > free.makespan_ms
