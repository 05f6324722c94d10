"""What a device holds while it runs a plan: the one memory rule, as events on action edges.

``validate`` walks these events in each device's execution order (a peak per device before
anything runs); the simulator places the same events at simulated start and end times. Both
count exactly what this module says a device holds:

  weights     an UPLOAD's bytes from its start to the end of its FREE (lowered plans; one
              holding, ``actions.weight_holdings``, may serve several resident groups); in a
              compute-only offloaded plan, the slot's weights while its group computes; a
              bound (not offloaded) device keeps all of its stages from the start
  gradients   a backward group's gradient buffers (``costs.slot_memory``), from the group's
              first action to its FREE (lowered: the holding's first group to its FREE) or
              its last action; bound: from the start
  working set each compute action's, while it runs
  stash       bound schedules keep one boundary activation from a forward's end to the end of
              the backward that consumes it
  received    an activation a SEND brings to a device, from the SEND's start to the end of its
              last consumer on that device

A slot's sizes come from ``StageCosts`` (built with ``costs.slot_memory``), so the partitioner,
validate and the simulator share one definition of what a slot holds.

The simulator places these events at simulated times: one timing. ``validate``'s walk must
bound every timing the executor may take, and in a lowered plan weights move on their own
streams: an UPLOAD starts as soon as the FREE it is gated on has run (possibly long before its
place in the device's order), and a FREE after a gradient download may land long after its
place (the device computes on meanwhile). So for lowered plans ``walk_peak`` counts weights and
gradients with ``held_bound``: at each compute action, the most the holdings can occupy under
the executor's orderings (uploads in issue order on one stream, each after its gates' FREEs;
frees without a download on the compute stream, right after their group; frees after a
download in issue order on the download stream).

Iterations overlap: ``train_batch`` t+1 issues its run while run t's backward tail, gradient
downloads and FREEs are still in flight (engine/pipeline.py). The executor continues the
round-robin across the two runs as one plan would: run t+1's first UPLOADs on a device wait for
run t's last FREEs there, with the prefetch depth's rule (``weight_holdings`` of the two runs
back to back; runtime/executor.py), and its first inputs arrive no earlier than the run t
action two before their consumer (the SEND rule). ``consecutive(plan, plan_next)`` is that pair
as one plan; ``walk_peak`` over it bounds what a device holds with two runs in flight (run
t+1's actions carry the next iteration's number, "#1", in messages). Runs never overlap
deeper: run t+2 is issued after run t has finished.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

from .actions import Action, Holding, Op, Plan, compute_groups, weight_holdings
from .costs import StageCosts

__all__ = [
    "MemoryEvent",
    "memory_events",
    "static_bytes",
    "walk_peak",
    "held_bound",
    "consecutive",
    "cross_run_gates",
]


@dataclass(frozen=True)
class MemoryEvent:
    """``delta`` bytes change on ``action``'s device when it starts (or ends, ``at_end``)."""

    action: Action
    at_end: bool
    delta: int
    held: bool = False  # weights or gradients of a lowered plan's holding (see held_bound)


def static_bytes(plan: Plan, st: StageCosts, device: int) -> int:
    """Bytes resident from the start: a bound (not offloaded) device keeps its forward slots'
    weights and its backward slots' gradients for the whole iteration."""
    if plan.offloaded or _lowered(plan):
        return 0
    slots = {plan.slot(a) for a in plan.per_device(device) if a.is_compute}
    return sum(st.param_bytes[s] if s < plan.num_fwd_stages else st.grad_bytes[s] for s in slots)


def memory_events(plan: Plan, st: StageCosts) -> dict[int, list[MemoryEvent]]:
    """Per device, every change of held bytes (see the module docstring), in no set order."""
    lowered = _lowered(plan)
    offloaded = plan.offloaded or lowered
    events: dict[int, list[MemoryEvent]] = defaultdict(list)
    if lowered:
        for d, holdings in weight_holdings(plan).items():
            for h in holdings:
                grads = st.grad_bytes[h.slot]
                if grads and h.free is not None:  # a holding without a FREE keeps its bytes
                    events[d] += [
                        MemoryEvent(h.groups[0][0], False, grads, True),
                        MemoryEvent(h.free, True, -grads, True),
                    ]
    for d, groups in compute_groups(plan).items():
        for g in groups:
            slot = plan.slot(g[0])
            if offloaded and not lowered:
                held = st.grad_bytes[slot] + st.param_bytes[slot]
                events[d] += [MemoryEvent(g[0], False, held), MemoryEvent(g[-1], True, -held)]
            for a in g:
                events[d] += [
                    MemoryEvent(a, False, st.work_bytes[slot]),
                    MemoryEvent(a, True, -st.work_bytes[slot]),
                ]
                if not offloaded:
                    sign = 1 if a.op is Op.FWD else -1
                    events[d].append(MemoryEvent(a, True, sign * st.boundary_bytes))
    consumers: dict[Action, list[Action]] = defaultdict(list)
    for c in plan.actions:
        for dep in plan.deps[c]:
            if dep.op is Op.SEND and c.is_compute:
                consumers[dep].append(c)
    order = {a: i for i, a in enumerate(plan.actions)}
    for a in plan.actions:
        if a.op is Op.UPLOAD:
            events[a.device].append(MemoryEvent(a, False, st.param_bytes[a.stage], True))
        elif a.op is Op.FREE:
            events[a.device].append(MemoryEvent(a, True, -st.param_bytes[a.stage], True))
        elif a.op is Op.SEND:
            last = max(consumers[a], key=order.__getitem__, default=a)
            events[a.device] += [
                MemoryEvent(a, False, st.boundary_bytes),
                MemoryEvent(last, True, -st.boundary_bytes),
            ]
    return dict(events)


def walk_peak(
    plan: Plan, st: StageCosts, device: int, events: dict[int, list[MemoryEvent]] | None = None
) -> tuple[int, Action | None]:
    """Peak bytes on one device walking its actions in execution order, measured as each
    compute action starts; returns (peak, the compute action at the peak). In a lowered plan
    the holdings' weights and gradients are counted by ``held_bound`` (every timing), the rest
    (working sets, received activations) by the walk."""
    on_device = (memory_events(plan, st) if events is None else events).get(device, [])
    lowered = _lowered(plan)
    bound = held_bound(plan, st, device) if lowered else {}
    starts: dict[Action, int] = defaultdict(int)
    ends: dict[Action, int] = defaultdict(int)
    for e in on_device:
        if not (lowered and e.held):
            (ends if e.at_end else starts)[e.action] += e.delta
    level = static_bytes(plan, st, device)
    peak, where = 0, None
    for a in plan.per_device(device):
        level += starts.get(a, 0)
        if a.is_compute and level + bound.get(a, 0) > peak:
            peak, where = level + bound.get(a, 0), a
        level += ends.get(a, 0)
    return peak, where


def held_bound(plan: Plan, st: StageCosts, device: int) -> dict[Action, int]:
    """Per compute action of a lowered plan on ``device``: the most bytes of weights and
    gradients its holdings may occupy while it runs, over every timing the executor allows.

    While group g computes, the uploads that have started are a prefix 0..k of the device's
    holdings (one upload stream, in issue order), k at least g's own holding and at most the
    last whose gates' groups all end before g (a gate's FREE follows its last group). Released
    by then for sure: the gates of holdings 0..k, every holding freed on the download stream
    before a gate freed there (in order), and every holding without a download whose last
    group ended (its FREE runs on the compute stream). A backward holding's gradients exist
    from its first group on. The bound is the largest such total over k.
    """
    holdings = weight_holdings(plan).get(device, [])
    if not holdings:
        return {}
    index = {id(h): i for i, h in enumerate(holdings)}
    pos = {a: i for i, a in enumerate(plan.per_device(device))}

    def free_pos(h: Holding) -> int:
        return pos[h.free] if h.free is not None else len(pos)

    out: dict[Action, int] = {}
    owner = {gi: h for h in holdings for gi in h.group_indices}
    groups = compute_groups(plan).get(device, [])
    for g, group in enumerate(groups):
        mine = index[id(owner[g])]
        freed: set[int] = set()
        d2h_freed = -1  # download-stream FREEs at or before this position have run
        best = 0
        for k, h in enumerate(holdings):
            if any(gate.last >= g for gate in h.gates):
                break  # this upload (and every later one) waits for a FREE after g's compute
            for gate in h.gates:
                freed.add(index[id(gate)])
                if gate.download is not None:
                    d2h_freed = max(d2h_freed, free_pos(gate))
            if k < mine:
                continue
            total = 0
            for i, o in enumerate(holdings[: k + 1]):
                gone = (
                    i in freed
                    or (o.last < g and o.download is None and o.free is not None)
                    or (o.download is not None and free_pos(o) <= d2h_freed)
                )
                if not gone:
                    total += st.param_bytes[o.slot]
                    total += st.grad_bytes[o.slot] if o.first <= g else 0
            best = max(best, total)
        for a in group:
            out[a] = best
    return out


def consecutive(plan: Plan, then: Plan) -> Plan:
    """Two runs issued back to back, as one plan: ``then``'s actions, renumbered to the
    iterations after ``plan``'s, follow ``plan``'s (each device's order is its order in
    ``plan`` and then in ``then``). Its ``weight_holdings`` gate ``then``'s first uploads on a
    device on ``plan``'s last FREEs there, with the prefetch depth's rule: the cross-run gates
    the executor adds when iterations overlap. Both must be the same plan shape (cuts, devices,
    prefetch depth, lowering); ``then`` may start on another device (the rolling start)."""
    same = (plan.fwd_cuts, plan.bwd_cuts, plan.num_devices, plan.prefetch_depth) == (
        then.fwd_cuts,
        then.bwd_cuts,
        then.num_devices,
        then.prefetch_depth,
    )
    if not same:
        raise ValueError("consecutive: both runs need the same cuts, devices and prefetch depth")
    shift = _shift(plan, then)
    moved = tuple(
        dataclasses.replace(a, iteration=a.iteration + shift) if shift else a for a in then.actions
    )
    return dataclasses.replace(
        plan, actions=plan.actions + moved, next_start_device=then.next_start_device
    )


def cross_run_gates(previous: Plan, plan: Plan) -> dict[Action, list[Action]]:
    """Per UPLOAD of ``plan`` issued right after ``previous`` (runs that may overlap): the FREEs
    of ``previous`` it must wait for, so a device holds no more than ``walk_peak`` over
    ``consecutive(previous, plan)`` says. Same shape: the holdings' rule across the two runs
    (an upload waits for the holdings ended ``prefetch_depth + 1`` groups before its first).
    Another prefetch depth (the planner changed it between them; ``consecutive`` refuses): every
    upload without a gate in ``plan`` waits for all of ``previous``'s FREEs on its device, so
    the seam holds no more than either run alone."""
    try:
        both = consecutive(previous, plan)
    except ValueError:
        frees: dict[int, list[Action]] = defaultdict(list)
        for a in previous.actions:
            if a.op is Op.FREE:
                frees[a.device].append(a)
        gated = {h.upload for hs in weight_holdings(plan).values() for h in hs if h.gates}
        return {
            a: list(frees[a.device])
            for a in plan.actions
            if a.op is Op.UPLOAD and a not in gated and frees[a.device]
        }
    mine, shift = set(previous.iterations), _shift(previous, plan)
    out: dict[Action, list[Action]] = {}
    for holdings in weight_holdings(both).values():
        for h in holdings:
            if h.upload is None or h.upload.iteration in mine:
                continue
            gates = [g.free for g in h.gates if g.free is not None and g.free.iteration in mine]
            if gates:
                out[dataclasses.replace(h.upload, iteration=h.upload.iteration - shift)] = gates
    return out


def _shift(plan: Plan, then: Plan) -> int:
    """What ``consecutive`` adds to ``then``'s iteration numbers (after ``plan``'s)."""
    return max(plan.iterations, default=-1) + 1 - min(then.iterations, default=0)


def _lowered(plan: Plan) -> bool:
    return any(a.op is Op.UPLOAD for a in plan.actions)
