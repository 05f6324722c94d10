"""The fast timing pass (``quick_times``): compute-only plans under the conventions of the
published table, in one pass in issue order (the partitioner calls it per candidate); and the
weight gates and recompute convention it shares with the event simulator."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from ..actions import OPTIMIZER_LAG, Action, Op, Plan
from ..costs import LayerCosts

__all__ = ["QuickTimes", "quick_times"]


@dataclass(frozen=True)
class QuickTimes:
    """What the fast timing pass measures: each iteration's end, and per device the (aligned)
    start of its first action and the end of its last (for the fill/drain figure)."""

    iteration_ends: tuple[float, ...]
    first_start: Mapping[int, float]
    last_end: Mapping[int, float]
    busy_ms: float

    @property
    def makespan_ms(self) -> float:
        return self.iteration_ends[-1]

    def fill_drain_ms(self, num_devices: int) -> float:
        """Sum over devices of the time before their first and after their last action."""
        mk = self.makespan_ms
        return sum(
            self.first_start.get(d, mk) + mk - self.last_end.get(d, 0.0) for d in range(num_devices)
        )


def quick_times(
    plan: Plan,
    costs: LayerCosts,
    *,
    comm_ms: float | None = None,
    early_recompute: bool | None = None,
    optimizer: str = "async",
) -> QuickTimes:
    """Timing of a compute-only plan under the conventions, in one pass in issue order.

    The issue order is topological and each device runs its actions in that order, so every
    start is max(device free, inputs arrived, weights updated). Same times as ``simulate``
    without a machine, in a fraction of the time (the partitioner calls it per candidate).
    """
    st = costs.stages(plan.fwd_cuts, plan.bwd_cuts, fused_head=plan.fused_head)
    comm = costs.comm_ms if comm_ms is None else comm_ms
    early = _early_default(plan) if early_recompute is None else early_recompute
    lag, num_fwd = OPTIMIZER_LAG[optimizer], plan.num_fwd_stages
    gates = _weight_gates(plan) if len(plan.iterations) > lag else {}
    deps, fwd_op, bwd_op, last_fwd = plan.deps, Op.FWD, Op.BWD, num_fwd - 1
    end: dict[Action, float] = {}
    free: dict[int, float] = defaultdict(float)
    updated: dict[tuple[int, int], float] = defaultdict(float)  # (iteration, bwd slot) -> end
    ends: dict[int, float] = defaultdict(float)
    first: dict[int, float] = {}
    busy = 0.0
    for a in plan.actions:
        if not a.is_compute:
            raise ValueError("quick_times takes a compute-only plan; use simulate()")
        d, it = a.device, a.iteration
        slot = a.stage if a.op is fwd_op else num_fwd + a.stage
        t_in = t_grad = free[d]
        # a backward waits for its gradient (not a FWD; or the loss of an unfused head)
        grad_from_fwd = a.op is bwd_op and a.stage == 0 and not plan.fused_head
        for dep in deps[a]:
            arrive = end[dep] + (comm if dep.device != d else 0.0)
            grad = a.op is bwd_op and (
                dep.op is not fwd_op or (grad_from_fwd and dep.stage == last_fwd)
            )
            if early and grad:
                t_grad = max(t_grad, arrive)
            else:
                t_in = max(t_in, arrive)
        if it >= lag and gates:
            t_in = max([t_in] + [updated[(it - lag, j)] for j in gates[slot]])
        pre, post = st.pre_ms[slot], st.post_ms[slot]
        t_post = max(t_in + pre, t_grad)
        first.setdefault(d, max(t_in, t_post - pre))  # recompute aligned to end at the gradient
        end[a] = free[d] = t = t_post + post
        busy += pre + post
        ends[it] = max(ends[it], t)
        if slot >= num_fwd:
            updated[(it, slot)] = max(updated[(it, slot)], t)
    return QuickTimes(
        iteration_ends=tuple(ends[it] for it in sorted(ends)),
        first_start=first,
        last_end=dict(free),
        busy_ms=busy,
    )


def _weight_gates(plan: Plan) -> dict[int, tuple[int, ...]]:
    """For each slot, the backward slots whose weight update its compute must wait for
    (overlapping layers; the head; the prefix updates with layer 0's backward stage)."""
    num_fwd = plan.num_fwd_stages
    head_slots = {num_fwd} | (set() if plan.fused_head else {num_fwd - 1})
    out: dict[int, tuple[int, ...]] = {}
    for slot in range(plan.num_slots):
        mine = plan.slot_layers(slot)
        if slot == 0:
            mine = range(0, max(mine.stop, 1))
        out[slot] = tuple(
            j
            for j in range(num_fwd, plan.num_slots)
            if _overlap(mine, plan.slot_layers(j)) or (slot in head_slots and j == num_fwd)
        )
    return out


def _overlap(a: range, b: range) -> bool:
    return max(a.start, b.start) < min(a.stop, b.stop)


def _early_default(plan: Plan) -> bool:
    """Offloaded (RoundPipe) recomputes start early; bound stages follow the conventions."""
    return not plan.bound
