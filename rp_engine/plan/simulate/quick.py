"""The fast timing pass (``quick_times``): compute-only plans under the conventions of the
published table, in one pass in issue order (the partitioner calls it per candidate); and the
weight gates and recompute convention it shares with the event simulator."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..actions import OPTIMIZER_LAG, Op, Plan
from ..costs import LayerCosts

__all__ = [
    "ASYNC_ITERATIONS",
    "QuickProgram",
    "QuickTimes",
    "WeightTraffic",
    "async_steady_ms",
    "gate_slots",
    "steady_from_ends",
    "steady_period",
    "quick_times",
]


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


@dataclass(frozen=True)
class WeightTraffic:
    """The weight copies of an offloaded plan, for the fast timing pass: per slot the ms its
    weights take to come up and its gradients to go down, and the prefetch depth (as
    ``lower``'s): a group of compute (a slot's round on a device) waits for its upload, which
    is issued when the device starts the group ``prefetch_depth`` back and once the group
    ``prefetch_depth + 1`` back has downloaded its gradients and freed its weights (at most
    ``prefetch_depth + 1`` groups' weights held). At depth 0 the copies run between a device's
    groups, on the critical path; at depth 1 behind the previous group's compute. The link's
    sharing between devices is not modelled here (``estimate.transfer_ms`` bounds it)."""

    upload_ms: tuple[float, ...]
    download_ms: tuple[float, ...]
    prefetch_depth: int = 1


# How the async steady state is measured. With staleness 1, iterations i and i + 1 run side by
# side and i + 2 waits for i's weights, so the iteration times settle into a pattern that
# repeats every few iterations (669, 669, 1338 ms: a pair that overlaps, then one that waits;
# periods of 1-3 are the rule, 5 happens: 2041 x 4, 1684 for 5 slots on 6 devices), after a
# transient of up to several iterations while the rolling device assignment (slot i of round
# r on device (r S + i) mod N) drifts into its worst alignment (1,755 ms growing to 1,942 ms
# over 6 iterations, for 9 slots on 8 devices). So the reading finds the period: the times
# after ``SETTLE`` iterations of an ``ASYNC_ITERATIONS`` run, if they repeat with a period that
# fits twice, else the second half of a ``_LONG_RUN`` run, if it repeats; the mean over one
# period is then exact. The old estimate, 2 iterations from the first end, read 669 ms for
# 892 and 1,755 for 1,942: up to 25 % short on random cost tables, and the partitioner, which
# keeps whatever scores best, went for exactly those plans (forward cuts [15, 9] / backward
# [2, 3 x 7, 1] for the artifact's 20B row: scored 6,177 ms, ran at 6,962 ms).
SETTLE, STEADY_WINDOW = 6, 6
ASYNC_ITERATIONS = SETTLE + STEADY_WINDOW + 1  # an async run long enough to read the window
_LONG_RUN = 41  # iterations of the second run, for a plan still settling or of a long period


def async_steady_ms(iteration_ends: Callable[[int], Sequence[float]]) -> float:
    """The steady-state async iteration (ms) from ``iteration_ends(k)``, the end times of
    ``k`` iterations simulated back to back: the mean over one period of the iteration times
    once they repeat (``steady_period``), read from the last ``STEADY_WINDOW`` of
    ``ASYNC_ITERATIONS``, else from the second half of ``_LONG_RUN``; a run that never
    repeats is read as the mean over that second half."""
    steady = steady_from_ends(iteration_ends(ASYNC_ITERATIONS), SETTLE)
    if steady is None:
        ends = iteration_ends(_LONG_RUN)
        steady = steady_from_ends(ends, _LONG_RUN // 2)
        if steady is None:
            half = _LONG_RUN // 2
            steady = (ends[-1] - ends[half]) / (len(ends) - 1 - half)
    return steady


def steady_from_ends(ends: Sequence[float], settle: int) -> float | None:
    """The mean iteration time over one period of the times after the first ``settle``
    (``steady_period``), None when they do not repeat."""
    times = [b - a for a, b in zip(ends, ends[1:], strict=False)][settle:]
    period = steady_period(times)
    return None if period is None else sum(times[-period:]) / period


def steady_period(times: Sequence[float]) -> int | None:
    """The shortest p such that ``times`` repeats with period p throughout (times[i] equals
    times[i + p] to 1e-6 relative) and holds it at least twice; None when there is none."""
    for p in range(1, len(times) // 2 + 1):
        if all(
            abs(times[i] - times[i + p]) <= 1e-6 * max(abs(times[i]), 1.0)
            for i in range(len(times) - p)
        ):
            return p
    return None


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
    program = QuickProgram.of(plan, early_recompute=early_recompute)
    return program.run(costs, plan.fwd_cuts, plan.bwd_cuts, comm_ms=comm_ms, optimizer=optimizer)


@dataclass(frozen=True)
class QuickProgram:
    """A compute-only plan compiled for ``quick_times``: per action in issue order its device,
    iteration and slot, and its inputs as (action index, crosses devices, is the gradient that
    an early recompute waits for). Which action waits for which does not depend on how many
    layers each stage holds, only on the plan's shape, so the partitioner compiles one program
    per shape (stage counts, devices, micro-batches, rounds) and runs it for every candidate
    cut of that shape (``run``), for as many iterations as it needs (``repeated``)."""

    devices: tuple[int, ...]
    iterations: tuple[int, ...]
    slots: tuple[int, ...]
    inputs: tuple[tuple[tuple[int, bool, bool], ...], ...]
    num_devices: int
    num_fwd: int
    num_slots: int
    fused_head: bool
    times: int = 1  # the block above, run this many times back to back (``repeated``)
    device_shift: int = 0  # devices of repeat i: moved by i x this

    @classmethod
    def of(cls, plan: Plan, *, early_recompute: bool | None = None) -> QuickProgram:
        """Compile ``plan`` (compute actions only; ValueError otherwise)."""
        early = _early_default(plan) if early_recompute is None else early_recompute
        deps, fwd_op, bwd_op = plan.deps, Op.FWD, Op.BWD
        num_fwd, last_fwd = plan.num_fwd_stages, plan.num_fwd_stages - 1
        index = {a: k for k, a in enumerate(plan.actions)}
        devices, iterations, slots, inputs = [], [], [], []
        for a in plan.actions:
            if not a.is_compute:
                raise ValueError("quick_times takes a compute-only plan; use simulate()")
            # a backward waits for its gradient (not a FWD; or the loss of an unfused head)
            grad_from_fwd = a.op is bwd_op and a.stage == 0 and not plan.fused_head
            mine = []
            for dep in deps[a]:
                grad = a.op is bwd_op and (
                    dep.op is not fwd_op or (grad_from_fwd and dep.stage == last_fwd)
                )
                mine.append((index[dep], dep.device != a.device, early and grad))
            devices.append(a.device)
            iterations.append(a.iteration)
            slots.append(a.stage if a.op is fwd_op else num_fwd + a.stage)
            inputs.append(tuple(mine))
        return cls(
            devices=tuple(devices),
            iterations=tuple(iterations),
            slots=tuple(slots),
            inputs=tuple(inputs),
            num_devices=plan.num_devices,
            num_fwd=num_fwd,
            num_slots=plan.num_slots,
            fused_head=plan.fused_head,
        )

    @property
    def num_iterations(self) -> int:
        return len(set(self.iterations)) * self.times

    def repeated(self, times: int, device_shift: int) -> QuickProgram:
        """This one-iteration program as ``times`` iterations back to back, iteration i on the
        devices of iteration 0 moved by i x ``device_shift`` (RoundPipe's rounds roll on:
        ``Plan.next_start_device``). An action only waits for actions of its own iteration
        (weights are the gates of ``run``), so this runs as the k-iteration plan would,
        without building it (``tests/plan/test_plan_partition.py`` compares the two)."""
        if self.times != 1 or len(set(self.iterations)) != 1:
            raise ValueError("repeat a one-iteration program")
        return dataclasses.replace(self, times=times, device_shift=device_shift)

    def run(
        self,
        costs: LayerCosts,
        fwd_cuts: Sequence[int],
        bwd_cuts: Sequence[int],
        *,
        comm_ms: float | None = None,
        optimizer: str = "async",
        weights: WeightTraffic | None = None,
    ) -> QuickTimes:
        """The times of the compiled plan with these cuts (of the compiled stage counts);
        with ``weights``, each group of compute also waits for its weights' upload."""
        if len(fwd_cuts) != self.num_fwd or len(fwd_cuts) + len(bwd_cuts) != self.num_slots:
            raise ValueError(
                f"cuts {list(fwd_cuts)} / {list(bwd_cuts)} do not have the program's "
                f"{self.num_fwd} forward and {self.num_slots - self.num_fwd} backward stages"
            )
        st = costs.stages(fwd_cuts, bwd_cuts, fused_head=self.fused_head)
        pre_ms, post_ms = st.pre_ms, st.post_ms
        comm = costs.comm_ms if comm_ms is None else comm_ms
        lag, num_fwd, num_slots = OPTIMIZER_LAG[optimizer], self.num_fwd, self.num_slots
        gates = (
            gate_slots(fwd_cuts, bwd_cuts, fused_head=self.fused_head)
            if self.num_iterations > lag
            else {}
        )
        n, size = self.num_devices, len(self.devices)
        block = tuple(zip(self.devices, self.iterations, self.slots, self.inputs, strict=True))
        end = [0.0] * (size * self.times)
        free = [0.0] * n
        span = max(self.iterations, default=0) + 1  # iteration numbers of one block
        # (iteration, backward slot) -> when its last micro-batch ended: the weights it updates
        updated = [0.0] * (num_slots * span * self.times)
        ends: dict[int, float] = defaultdict(float)
        first: dict[int, float] = {}
        busy = 0.0
        # per device: the (iteration, slot) of its current group, and of its groups so far
        # when each started and when each released its weights (gradients downloaded)
        group: list[tuple[int, int] | None] = [None] * n
        started: list[list[float]] = [[] for _ in range(n)]
        released: list[list[float]] = [[] for _ in range(n)]
        back = weights.prefetch_depth if weights is not None else 0
        for rep in range(self.times):
            base, shift, it_base = rep * size, rep * self.device_shift, rep * span
            for k, (d, it, slot, inputs) in enumerate(block, start=base):
                d = (d + shift) % n
                it += it_base
                t_in = t_grad = free[d]
                for dep, cross, grad in inputs:
                    arrive = end[dep + base] + comm if cross else end[dep + base]
                    if grad:
                        if arrive > t_grad:
                            t_grad = arrive
                    elif arrive > t_in:
                        t_in = arrive
                ready = 0.0  # when the weights this action reads are on the host, updated
                if it >= lag and gates:
                    row = (it - lag) * num_slots
                    for j in gates[slot]:
                        if updated[row + j] > ready:
                            ready = updated[row + j]
                if weights is not None and group[d] != (it, slot):
                    prev = group[d]
                    if prev is not None:
                        released[d].append(free[d] + weights.download_ms[prev[1]])
                    group[d] = (it, slot)
                    mine, gone = started[d], released[d]
                    issue = mine[-back] if back and len(mine) >= back else 0.0
                    if len(gone) > back:
                        issue = max(issue, gone[-1 - back])
                    ready = max(ready, issue) + weights.upload_ms[slot]
                if ready > t_in:
                    t_in = ready
                pre, post = pre_ms[slot], post_ms[slot]
                t_post = max(t_in + pre, t_grad)
                if d not in first:  # recompute aligned to end at the gradient
                    first[d] = max(t_in, t_post - pre)
                if weights is not None and len(started[d]) < len(released[d]) + 1:
                    started[d].append(max(t_in, t_post - pre))  # the group's first action
                end[k] = free[d] = t = t_post + post
                busy += pre + post
                if t > ends[it]:
                    ends[it] = t
                if slot >= num_fwd and t > updated[it * num_slots + slot]:
                    updated[it * num_slots + slot] = t
        return QuickTimes(
            iteration_ends=tuple(ends[it] for it in sorted(ends)),
            first_start=first,
            last_end={d: free[d] for d in range(n) if d in first},
            busy_ms=busy,
        )


def _weight_gates(plan: Plan) -> dict[int, tuple[int, ...]]:
    """``gate_slots`` of a plan's cuts."""
    return gate_slots(plan.fwd_cuts, plan.bwd_cuts, fused_head=plan.fused_head)


def gate_slots(
    fwd_cuts: Sequence[int], bwd_cuts: Sequence[int], *, fused_head: bool
) -> dict[int, tuple[int, ...]]:
    """For each slot, the backward slots whose weight update its compute must wait for
    (overlapping layers; the head; the prefix updates with layer 0's backward stage)."""
    num_fwd = len(fwd_cuts)
    ranges, start = [], 0
    for n in fwd_cuts:
        ranges.append(range(start, start + n))
        start += n
    end = start
    for n in bwd_cuts:
        ranges.append(range(end - n, end))
        end -= n
    head_slots = {num_fwd} | (set() if fused_head else {num_fwd - 1})
    out: dict[int, tuple[int, ...]] = {}
    for slot, mine in enumerate(ranges):
        if slot == 0:
            mine = range(0, max(mine.stop, 1))
        out[slot] = tuple(
            j
            for j in range(num_fwd, len(ranges))
            if _overlap(mine, ranges[j]) or (slot in head_slots and j == num_fwd)
        )
    return out


def _overlap(a: range, b: range) -> bool:
    return max(a.start, b.start) < min(a.stop, b.stop)


def _early_default(plan: Plan) -> bool:
    """Offloaded (RoundPipe) recomputes start early; bound stages follow the conventions."""
    return not plan.bound
