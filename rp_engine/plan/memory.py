"""What a device holds while it runs a plan: the one memory rule, as events on action edges.

``validate`` walks these events in each device's execution order (a peak per device before
anything runs); the simulator places the same events at simulated start and end times. Both
count exactly what this module says a device holds:

  weights     an UPLOAD's bytes from its start to the end of its FREE (lowered plans); in a
              compute-only offloaded plan, the slot's weights while its group computes; a
              bound (not offloaded) device keeps all of its stages from the start
  gradients   a backward group's gradient buffers (``costs.slot_memory``), from the group's
              first action to its FREE (lowered) or its last action; bound: from the start
  working set each compute action's, while it runs
  stash       bound schedules keep one boundary activation from a forward's end to the end of
              the backward that consumes it
  received    an activation a SEND brings to a device, from the SEND's start to the end of its
              last consumer on that device

A slot's sizes come from ``StageCosts`` (built with ``costs.slot_memory``), so the partitioner,
validate and the simulator share one definition of what a slot holds.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .actions import Action, Op, Plan, compute_groups
from .costs import StageCosts

__all__ = ["MemoryEvent", "memory_events", "static_bytes", "walk_peak"]


@dataclass(frozen=True)
class MemoryEvent:
    """``delta`` bytes change on ``action``'s device when it starts (or ends, ``at_end``)."""

    action: Action
    at_end: bool
    delta: int


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
    frees = {
        (a.stage, a.microbatch, a.device, a.iteration): a for a in plan.actions if a.op is Op.FREE
    }
    events: dict[int, list[MemoryEvent]] = defaultdict(list)
    for d, groups in compute_groups(plan).items():
        for g in groups:
            slot = plan.slot(g[0])
            if offloaded:
                held = st.grad_bytes[slot] + (0 if lowered else st.param_bytes[slot])
                events[d].append(MemoryEvent(g[0], False, held))
                key = (slot, g[0].microbatch, d, g[0].iteration)
                release = frees.get(key) if lowered else g[-1]
                if release is not None:  # a lowered group without a FREE keeps its bytes
                    events[d].append(MemoryEvent(release, True, -held))
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
            events[a.device].append(MemoryEvent(a, False, st.param_bytes[a.stage]))
        elif a.op is Op.FREE:
            events[a.device].append(MemoryEvent(a, True, -st.param_bytes[a.stage]))
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
    compute action starts; returns (peak, the compute action at the peak)."""
    on_device = (memory_events(plan, st) if events is None else events).get(device, [])
    starts: dict[Action, int] = defaultdict(int)
    ends: dict[Action, int] = defaultdict(int)
    for e in on_device:
        (ends if e.at_end else starts)[e.action] += e.delta
    level = static_bytes(plan, st, device)
    peak, where = 0, None
    for a in plan.per_device(device):
        level += starts.get(a, 0)
        if a.is_compute and level > peak:
            peak, where = level, a
        level += ends.get(a, 0)
    return peak, where


def _lowered(plan: Plan) -> bool:
    return any(a.op is Op.UPLOAD for a in plan.actions)
