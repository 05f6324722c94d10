"""``simulate``: a plan through the event simulator, then what it measured (``SimResult``):
steady-state iteration, bubble, per-device timelines, peak memory (memory.py's events at the
simulated times), bytes moved."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from ..actions import OPTIMIZER_LAG, Action, Op, Plan
from ..costs import LayerCosts
from ..lower import lower
from ..memory import memory_events, static_bytes
from .events import _Builder, _Engine, _Task
from .machine import Machine
from .quick import ASYNC_ITERATIONS, SETTLE, _early_default, _weight_gates, steady_from_ends
from .results import Interval, SimResult

__all__ = ["simulate"]


def simulate(
    plan: Plan,
    costs: LayerCosts,
    *,
    machine: Machine | None = None,
    optimizer: str | None = None,
    early_recompute: bool | None = None,
    align_recompute: bool = True,
    comm_ms: float | None = None,
    global_norm: bool = False,
) -> SimResult:
    """Simulate ``plan`` (one or several iterations) with ``costs``.

    Without a machine: the conventions of the published table (compute only, ``comm_ms`` -
    default ``costs.comm_ms`` - on every cross-device edge). With one: a compute-only plan is
    lowered first (transfers, optimizer steps) and every transfer moves bytes over links.
    ``optimizer`` "sync": iteration i computes on the weights of step i-1; "async" (staleness
    1): on those of step i-2, so the optimizer overlaps the next iteration. Default: the
    plan's, else "sync". ``global_norm``: no layer's optimizer step starts before every
    gradient of its iteration is in (global-norm clipping, fp16 overflow checks, a non-finite
    guard: optim/stepper.py steps them at ``close_step``); else each layer steps as soon as its
    own gradient is complete.
    """
    optimizer = optimizer or plan.optimizer or "sync"
    if optimizer not in ("sync", "async"):
        raise ValueError(f"optimizer must be 'sync' or 'async', got {optimizer!r}")
    if machine is not None and machine.num_devices < plan.num_devices:
        raise ValueError(
            f"the plan uses {plan.num_devices} devices, machine {machine.name!r} has "
            f"{machine.num_devices}"
        )
    if machine is not None and all(a.is_compute for a in plan.actions):
        plan = lower(plan, optimizer=optimizer)
    early = _early_default(plan) if early_recompute is None else early_recompute
    comm = costs.comm_ms if comm_ms is None else comm_ms
    builder = _Builder(plan, costs, machine, comm, early)
    tasks = builder.build()
    # the lag the weights follow: the OPT actions' of a lowered plan (Plan.deps), else the
    # optimizer's (the weight gates)
    has_opt = any(a.op is Op.OPT for a in plan.actions)
    lag = OPTIMIZER_LAG.get(plan.optimizer if has_opt else optimizer, OPTIMIZER_LAG[optimizer])
    if not has_opt:
        _add_weight_gates(tasks, builder, lag)
    elif global_norm:
        _add_step_barrier(tasks, builder)
    _Engine(tasks, plan, machine).run()
    if align_recompute:
        _align_recompute(tasks)
    return _result(plan, tasks, builder, lag)


def _add_step_barrier(tasks: list[_Task], builder: _Builder) -> None:
    """Every OPT of an iteration waits for what any OPT of that iteration waits for (all the
    iteration's gradients: the global norm is known only then)."""
    plan = builder.plan
    needs: dict[int, set[int]] = defaultdict(set)
    for a in plan.actions:
        if a.op is Op.OPT:
            needs[a.iteration].update(builder.last[d] for d in plan.deps[a])
    for a in plan.actions:
        if a.op is Op.OPT:
            tasks[builder.first[a]].deps.extend((i, 0.0) for i in sorted(needs[a.iteration]))


def _add_weight_gates(tasks: list[_Task], builder: _Builder, lag: int) -> None:
    """Without OPT actions: compute of iteration i waits until the backward slots holding its
    layers finished iteration i - lag (the optimizer step itself takes no time)."""
    plan, num_fwd = builder.plan, builder.plan.num_fwd_stages
    finished: dict[tuple[int, int], list[int]] = defaultdict(list)
    for a in plan.actions:
        if a.is_compute and plan.slot(a) >= num_fwd:
            finished[(a.iteration, plan.slot(a))].append(builder.last[a])
    barrier = {}
    for key, ids in finished.items():
        barrier[key] = len(tasks)
        tasks.append(_Task(tasks[ids[0]].action, "weights", None, deps=[(i, 0.0) for i in ids]))
    gates = _weight_gates(plan)
    for a in plan.actions:
        if a.is_compute and a.iteration >= lag:
            for j in gates[plan.slot(a)]:
                if (a.iteration - lag, j) in barrier:
                    tasks[builder.first[a]].deps.append((barrier[(a.iteration - lag, j)], 0.0))


def _align_recompute(tasks: list[_Task]) -> None:
    """Move each early recompute to end when its backward phase starts (display, fill)."""
    for i, t in enumerate(tasks[:-1]):
        nxt = tasks[i + 1]
        if t.phase == "recompute" and nxt.phase == "bwd" and nxt.action == t.action:
            gap = nxt.start - t.end
            if gap > 0:
                t.start, t.end = t.start + gap, t.end + gap


def _result(plan: Plan, tasks: list[_Task], builder: _Builder, lag: int) -> SimResult:
    n, iters = plan.num_devices, len(plan.iterations)
    intervals = tuple(
        Interval(
            t.lane[1] if t.lane else t.action.device,
            t.lane[0] if t.lane else "none",
            t.phase,
            t.start,
            t.end,
            t.action,
            t.busy,
        )
        for t in tasks
        if t.lane is not None and t.end > t.start and t.phase != "overhead"
    )
    busy = [iv for iv in intervals if iv.busy]
    makespan = max((t.end for t in tasks), default=0.0)
    busy_total = sum(iv.end_ms - iv.start_ms for iv in busy)
    ends: dict[int, float] = defaultdict(float)
    for iv in busy:
        ends[iv.action.iteration] = max(ends[iv.action.iteration], iv.end_ms)
    iteration_ms = _steady_iteration_ms([ends[it] for it in sorted(ends)], lag, makespan)
    busy_per_iter = busy_total / max(iters, 1)
    bubble = 1.0 - busy_per_iter / (n * iteration_ms) if iteration_ms > 0 else 0.0
    return SimResult(
        schedule=plan.schedule,
        num_devices=n,
        num_iterations=iters,
        num_fwd_stages=plan.num_fwd_stages,
        num_bwd_stages=plan.num_bwd_stages,
        makespan_ms=makespan,
        iteration_ms=iteration_ms,
        busy_ms=busy_per_iter,
        bubble_ratio=bubble,
        bubble_ratio_fill_drain=_fill_drain(busy, n, makespan, busy_total) if iters == 1 else None,
        intervals=intervals,
        peak_memory_bytes=_peak_memory(plan, tasks, builder),
        bytes_moved=_bytes_moved(tasks),
    )


def _steady_iteration_ms(ends: Sequence[float], lag: int, makespan: float) -> float:
    """The steady-state iteration from the iterations' end times: the time between the ends of
    two iterations ``w`` apart, divided by ``w``, over the widest window of whole multiples of
    ``lag`` (the optimizer lag) that leaves out the first iteration's end (the fill), else one
    that starts at it; with no such window (one iteration, or an async pair), the makespan per
    iteration.

    Why whole multiples of the lag: iteration i waits for the weights of iteration i - lag, so
    with an async optimizer (lag 2) iterations i and i + 1 do not wait for each other and run
    side by side where devices allow; their ends then advance in pairs (ends 83, 82, 270, 262,
    ...), and a window of one iteration measures a whole pair's time (or none) as one
    iteration. A sync run (lag 1) is measured as before: (end[-1] - end[1]) / (count - 2) from
    three iterations, end[1] - end[0] from two.
    """
    count = len(ends)
    if lag > 1 and count >= ASYNC_ITERATIONS:  # long enough to have settled (quick.py)
        steady = steady_from_ends(ends, SETTLE)
        half = count // 2
        return steady if steady is not None else (ends[-1] - ends[half]) / (count - 1 - half)
    window = max(count - 2, 0) // lag * lag or max(count - 1, 0) // lag * lag
    if window == 0:
        return makespan / max(count, 1)
    return (ends[-1] - ends[-1 - window]) / window


def _fill_drain(busy: Sequence[Interval], n: int, makespan: float, busy_total: float) -> float:
    edge = 0.0
    for d in range(n):
        mine = [iv for iv in busy if iv.device == d]
        if mine:
            edge += min(iv.start_ms for iv in mine) + makespan - max(iv.end_ms for iv in mine)
        else:
            edge += makespan
    return (n * makespan - busy_total - edge) / (n * makespan) if makespan > 0 else 0.0


def _bytes_moved(tasks: Sequence[_Task]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for t in tasks:
        if t.kind and t.nbytes:
            out[t.kind] += int(t.nbytes)
    return dict(out)


def _peak_memory(plan: Plan, tasks: Sequence[_Task], builder: _Builder) -> tuple[int, ...]:
    """Peak bytes per device over time: the events of memory.py (the rule validate walks) at
    simulated start and end times."""
    peaks = []
    events = memory_events(plan, builder.st)
    for d in range(plan.num_devices):
        timed = [(0.0, static_bytes(plan, builder.st, d))]
        for e in events.get(d, []):
            timed.append((_edge_time(tasks, builder, e.action, e.at_end), e.delta))
        level = peak = 0
        for _, delta in sorted(timed, key=lambda e: (e[0], e[1])):  # frees first
            level += delta
            peak = max(peak, level)
        peaks.append(peak)
    return tuple(peaks)


def _edge_time(tasks: Sequence[_Task], builder: _Builder, a: Action, at_end: bool) -> float:
    """When ``a`` starts or ends; a SEND starts holding memory when it arrives (its last
    phase: the H2D half of a copy through the host)."""
    if at_end:
        return tasks[builder.last[a]].end
    return tasks[builder.last[a] if a.op is Op.SEND else builder.first[a]].start
