"""The event simulator: plan actions become tasks on lanes (``_Builder``, one handler per op),
and ``_Engine`` runs them, sharing link bandwidth and host cores between the tasks that hold
them at once (the model of the package docstring)."""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field

from ..actions import HOST, Action, Op, Plan, PlanError, format_grid
from ..costs import LayerCosts, StageCosts
from .machine import Machine

_GB = 1e6  # bytes per millisecond at 1 GB/s
_TOL = 1e-9  # ms: events this close together happen at the same time


@dataclass
class _Task:
    action: Action
    phase: str
    lane: tuple[str, int] | None  # None: a pure delay / instant bookkeeping step
    ms: float = 0.0
    nbytes: float = 0.0
    links: tuple[tuple[str, int], ...] = ()
    busy: bool = False
    kind: str = ""  # bytes_moved category
    lead_ms: float = 0.0  # host overhead: the lane is held this long before the work starts
    deps: list[tuple[int, float]] = field(default_factory=list)
    start: float = math.nan
    end: float = math.nan


class _Builder:
    """Turns plan actions into tasks (one handler per op)."""

    def __init__(
        self, plan: Plan, costs: LayerCosts, machine: Machine | None, comm_ms: float, early: bool
    ) -> None:
        self.plan, self.machine, self.comm, self.early = plan, machine, comm_ms, early
        self.st: StageCosts = costs.stages(plan.fwd_cuts, plan.bwd_cuts, fused_head=plan.fused_head)
        self.scale = machine.compute_scale if machine else 1.0
        self.overhead = machine.action_overhead_ms if machine else 0.0
        self.tasks: list[_Task] = []
        self.first: dict[Action, int] = {}
        self.last: dict[Action, int] = {}
        self.compute_src = {
            (plan.slot(a), a.microbatch, a.iteration): a for a in plan.actions if a.is_compute
        }
        self.batch_bytes = costs.batch_bytes
        self.handlers = {
            Op.FWD: self._fwd,
            Op.HEAD: self._head,
            Op.BWD: self._bwd,
            Op.UPLOAD: self._upload,
            Op.DOWNLOAD: self._download,
            Op.FREE: self._free,
            Op.SEND: self._send,
            Op.OPT: self._opt,
            Op.READ: self._read,
        }
        # the runtime's host-resident activation inputs (plan/traffic.py), offloaded plans only
        self.host_inputs = machine is not None and plan.offloaded
        rows = {d: [a for a in plan.per_device(d) if a.is_compute] for d in range(plan.num_devices)}
        self.rows, self.pos = rows, {a: i for row in rows.values() for i, a in enumerate(row)}
        self.extra: dict[Action, list[int]] = defaultdict(list)  # copies gating a's first phase
        self.replaced: dict[Action, set[Action]] = defaultdict(set)  # plan deps they stand for
        self.idle_sends = self._idle_sends() if self.host_inputs else frozenset()

    def build(self) -> list[_Task]:
        for a in self.plan.actions:
            if self.host_inputs and a.is_compute:
                self._host_inputs(a)
            ids = self.handlers[a.op](a)
            if a.is_compute:  # the action's issue and bookkeeping hold its compute stream
                self.tasks[ids[0]].lead_ms = self.overhead
            self.first[a], self.last[a] = ids[0], ids[-1]
        for a in self.plan.actions:
            self._wire(a)
        if self.machine is not None and self.machine.serial_overhead and self.overhead:
            self._serialise_overhead()
        return self.tasks

    def _serialise_overhead(self) -> None:
        """Move every lead onto one host lane: a task of its own that waits for what its action
        waits for (and, for compute, the action before it on the device), which the action's
        work then waits for."""
        before: dict[int, int] = {}  # first task of a compute action -> last task of the prior
        for row in self.rows.values():
            for prev, nxt in zip(row, row[1:], strict=False):
                before[self.first[nxt]] = self.last[prev]
        for i in range(len(self.tasks)):
            t = self.tasks[i]
            if t.lead_ms <= 0:
                continue
            deps = list(t.deps) + ([(before[i], 0.0)] if i in before else [])
            lead = _Task(t.action, "overhead", ("host", HOST), ms=t.lead_ms, deps=deps)
            t.lead_ms = 0.0
            t.deps.append((self._add(self._on_cores(lead, 1.0, ("gil", 0))), 0.0))

    def _on_cores(self, task: _Task, cores: float, own: tuple[str, int]) -> _Task:
        """With shared host cores: ``task``'s time becomes core-ms of work on ``own`` (its own
        cores) and the host's; unchanged otherwise."""
        if self.machine is None or self.machine.host_cores is None or task.ms <= 0:
            return task
        task.nbytes, task.ms, task.links = task.ms * cores, 0.0, (own, ("cores", 0))
        return task

    def _add(self, task: _Task) -> int:
        self.tasks.append(task)
        return len(self.tasks) - 1

    def _compute(self, a: Action, phase: str, ms: float) -> int:
        lane = ("compute", a.device)
        task = _Task(a, phase, lane, ms=ms * self.scale, busy=True)
        share = (self.machine.host_cores or 0.0) / self.plan.num_devices if self.machine else 0.0
        return self._add(self._on_cores(task, share, ("devcpu", a.device)))

    def _fwd(self, a: Action) -> list[int]:
        return [self._compute(a, "fwd", self.st.pre_ms[a.stage])]

    def _head(self, a: Action) -> list[int]:
        slot = self.plan.slot(a)
        return [
            self._compute(a, "head_fwd", self.st.pre_ms[slot]),
            self._compute(a, "head_bwd", self.st.post_ms[slot]),
        ]

    def _bwd(self, a: Action) -> list[int]:
        slot = self.plan.slot(a)
        pre = [self._compute(a, "recompute", self.st.pre_ms[slot])] if self.st.pre_ms[slot] else []
        return pre + [self._compute(a, "bwd", self.st.post_ms[slot])]

    def _copy(
        self,
        a: Action,
        phase: str,
        lane: tuple[str, int],
        nbytes: float,
        links: tuple[tuple[str, int], ...],
        kind: str,
    ) -> int:
        if self.machine is None:  # conventions: transfers are free
            return self._add(_Task(a, phase, None, kind=kind, nbytes=nbytes))
        host = (("host", 0),) if self.machine.host_link_gbps else ()
        task = _Task(a, phase, lane, nbytes=nbytes, links=links + host, kind=kind)
        task.lead_ms = self.overhead  # each copy is handed to its stream's thread
        return self._add(task)

    def _stashed(self, consumer: Action, dep: Action) -> bool:
        """``dep`` carries the saved input of a backward stage, which the runtime takes from the
        host (stashed after the forward), never from the producer's device."""
        return (
            consumer.op is Op.BWD
            and consumer.stage >= 1
            and dep.op in (Op.FWD, Op.SEND)
            and not self.plan.is_grad_edge(consumer, dep)
        )

    def _idle_sends(self) -> frozenset[Action]:
        """SENDs whose every consumer takes that input from the host instead: never made."""
        sends: set[Action] = set()
        used: set[Action] = set()
        for c in self.plan.actions:
            for dep in self.plan.deps[c] if c.is_compute else ():
                if dep.op is Op.SEND:
                    sends.add(dep)
                    if not self._stashed(c, dep):
                        used.add(dep)
        return frozenset(sends - used)

    def _host_inputs(self, a: Action) -> None:
        """The copies of ``a``'s host-resident input (plan/traffic.py): the micro-batch (forward
        stage 0; the backward stage recomputing from layer 0, which holds the prefix), else a
        backward stage's saved input, downloaded from its producer's device after the forward
        and uploaded again here. The upload waits, as the runtime's does, until the compute
        action two before ``a`` on its device has finished."""
        plan, boundary = self.plan, self.st.boundary_bytes
        h2d = ("h2d", a.device)
        if a.op is Op.FWD and a.stage == 0:
            up = self._copy(a, "batch", ("h2d_act", a.device), self.batch_bytes, (h2d,), "act_h2d")
        elif a.op is Op.BWD and a.stage >= 1:
            inputs = [d for d in plan.deps[a] if self._stashed(a, d)]
            if not inputs:
                return
            self.replaced[a].update(inputs)
            if plan.slot_layers(plan.slot(a)).start == 0:
                up = self._copy(
                    a, "batch", ("h2d_act", a.device), self.batch_bytes, (h2d,), "act_h2d"
                )
            else:
                dep = inputs[0]
                src = (
                    dep
                    if dep.op is Op.FWD
                    else self.compute_src[(dep.stage, dep.microbatch, dep.iteration)]
                )
                d2h = ("d2h", src.device)
                down = self._copy(a, "stash", d2h, boundary, (d2h,), "act_d2h")
                self.tasks[down].deps.append((self.last[src], 0.0))
                up = self._copy(a, "unstash", ("h2d_act", a.device), boundary, (h2d,), "act_h2d")
                self.tasks[up].deps.append((down, 0.0))
        else:
            return
        pos = self.pos[a]
        if pos >= 2:
            self.tasks[up].deps.append((self.last[self.rows[a.device][pos - 2]], 0.0))
        self.extra[a].append(up)

    def _upload(self, a: Action) -> list[int]:
        nbytes = self.st.param_bytes[a.stage]
        return [
            self._copy(
                a, "upload", ("h2d_param", a.device), nbytes, (("h2d", a.device),), "weights_h2d"
            )
        ]

    def _read(self, a: Action) -> list[int]:
        """The slot's weights (the bytes its UPLOAD moves) from NVMe into host memory, on the
        one host-wide NVMe lane; the READ FIFO's order comes from the plan's dependencies."""
        nbytes = self.st.param_bytes[a.stage]
        return [self._copy(a, "read", ("nvme", HOST), nbytes, (("nvme", 0),), "weights_nvme")]

    def _download(self, a: Action) -> list[int]:
        nbytes = self.st.grad_bytes[a.stage]
        return [
            self._copy(a, "download", ("d2h", a.device), nbytes, (("d2h", a.device),), "grads_d2h")
        ]

    def _free(self, a: Action) -> list[int]:
        return [self._add(_Task(a, "free", None))]

    def _send(self, a: Action) -> list[int]:
        if a in self.idle_sends:
            return [self._add(_Task(a, "send", None))]
        src = self.compute_src[(a.stage, a.microbatch, a.iteration)].device
        nbytes, dst = self.st.boundary_bytes, a.device
        if self.machine is None:
            return [self._add(_Task(a, "send", None, ms=self.comm, kind="activations"))]
        if self.machine.p2p:
            return [
                self._add(
                    _Task(
                        a,
                        "send",
                        ("h2d_act", dst),
                        nbytes=nbytes,
                        kind="act_p2p",
                        links=(("p2p_out", src), ("p2p_in", dst)),
                    )
                )
            ]
        down = self._copy(a, "send_d2h", ("d2h", src), nbytes, (("d2h", src),), "act_d2h")
        up = self._copy(a, "send_h2d", ("h2d_act", dst), nbytes, (("h2d", dst),), "act_h2d")
        self.tasks[up].deps.append((down, 0.0))
        return [down, up]

    def _opt(self, a: Action) -> list[int]:
        params = self.st.layer_param_bytes[a.stage] / (
            self.machine.bytes_per_param if self.machine else 2.0
        )
        rate = self.machine.cpu_adam_params_per_s if self.machine else math.inf
        task = _Task(a, "opt", ("cpu", HOST), ms=1e3 * params / rate, lead_ms=self.overhead)
        cores = self.machine.host_cores if self.machine and self.machine.host_cores else 0.0
        return [self._add(self._on_cores(task, cores, ("optcpu", 0)))]

    def _wire(self, a: Action) -> None:
        """Each dependency gates the phase that needs it; later phases follow the first."""
        first, last = self.first[a], self.last[a]
        replaced = self.replaced.get(a, ())
        self.tasks[first].deps.extend((i, 0.0) for i in self.extra.get(a, ()))
        for dep in self.plan.deps[a]:
            if dep in replaced:
                continue
            cross = dep.is_compute and a.is_compute and dep.device != a.device
            delay = self.comm if self.machine is None and cross else 0.0
            target = last if self._gates_last_phase(a, dep) else first
            self.tasks[target].deps.append((self.last[dep], delay))
        if a.is_compute:
            for t in range(first + 1, last + 1):
                self.tasks[t].deps.append((t - 1, 0.0))

    def _gates_last_phase(self, a: Action, dep: Action) -> bool:
        if a.op is Op.SEND:  # the source gates the D2H half; the prefetch gate the H2D half
            source = (self.plan.slot(dep), dep.microbatch, dep.iteration) == (
                a.stage,
                a.microbatch,
                a.iteration,
            )
            return not (dep.is_compute and source)
        return a.op is Op.BWD and self.early and self.plan.is_grad_edge(a, dep)


class _Engine:
    """Event loop over tasks: strict-order compute lanes, ready-order copy and CPU lanes,
    bandwidth shared on links."""

    def __init__(self, tasks: list[_Task], plan: Plan, machine: Machine | None) -> None:
        self.tasks, self.plan = tasks, plan
        self.caps = _link_caps(machine, plan.num_devices) if machine else {}
        # the cores' worth the run gets beside other processes, by how many of its tasks want them
        self.share = tuple(machine.host_share) if machine and machine.host_cores else ()
        self.waiting = [len(t.deps) for t in tasks]
        self.ready_at = [0.0] * len(tasks)
        self.succ: list[list[tuple[int, float]]] = [[] for _ in tasks]
        for i, t in enumerate(tasks):
            for dep, delay in t.deps:
                self.succ[dep].append((i, delay))
        self.strict: dict[tuple[str, int], list[int]] = defaultdict(list)
        for i, t in enumerate(tasks):
            if t.lane is not None and t.lane[0] == "compute":
                self.strict[t.lane].append(i)
        self.cursor = dict.fromkeys(self.strict, 0)
        self.queues: dict[tuple[str, int], list[tuple[float, int]]] = defaultdict(list)
        self.running: dict[tuple[str, int], int | None] = {}
        self.timers: list[tuple[float, int, int]] = []  # (time, 0=end 1=wake 2=bytes, task)
        self.copies: dict[int, float] = {}  # task -> bytes remaining
        self.rates: dict[int, float] = {}
        self.dirty: set[tuple[str, int]] = set(self.strict)
        self.done = 0

    def run(self) -> None:
        now = 0.0
        for i, n in enumerate(self.waiting):
            if n == 0:
                self._ready(i, now)
        while self.done < len(self.tasks):
            self._dispatch(now)
            t_next = self.timers[0][0] if self.timers else math.inf
            if self.copies:
                t_next = min(t_next, now + min(r / self.rates[i] for i, r in self.copies.items()))
            if t_next == math.inf:
                self._deadlock()
            self._progress(t_next - now)
            now = t_next
            self._finish_copies(now)
            while self.timers and self.timers[0][0] <= now + _TOL:
                _, kind, i = heapq.heappop(self.timers)
                if kind == 0:
                    self._finish(i, now)
                elif kind == 2:
                    self._begin_copy(i)
                elif (lane := self.tasks[i].lane) is not None:
                    self.dirty.add(lane)

    def _ready(self, i: int, now: float) -> None:
        t = self.tasks[i]
        at = self.ready_at[i]
        if t.lane is None:
            t.start = at
            heapq.heappush(self.timers, (at + t.ms, 0, i))
            return
        if t.lane[0] != "compute":
            heapq.heappush(self.queues[t.lane], (at, i))
        if at > now:
            heapq.heappush(self.timers, (at, 1, i))
        self.dirty.add(t.lane)

    def _dispatch(self, now: float) -> None:
        dirty, self.dirty = self.dirty, set()
        for lane in dirty:
            if self.running.get(lane) is not None:
                continue
            i = self._next(lane, now)
            if i is not None:
                self._start(i, now, lane)

    def _next(self, lane: tuple[str, int], now: float) -> int | None:
        if lane in self.strict:
            order, k = self.strict[lane], self.cursor[lane]
            ready = k < len(order) and self.waiting[order[k]] == 0
            if ready and self.ready_at[order[k]] <= now + _TOL:
                self.cursor[lane] = k + 1
                return order[k]
            return None
        queue = self.queues[lane]
        if queue and queue[0][0] <= now + _TOL:
            return heapq.heappop(queue)[1]
        return None

    def _start(self, i: int, now: float, lane: tuple[str, int]) -> None:
        t = self.tasks[i]
        t.start = now + t.lead_ms  # the lane is held from now; the work starts after the lead
        self.running[lane] = i
        if t.nbytes > 0 and t.links:
            if t.lead_ms > 0:
                heapq.heappush(self.timers, (t.start, 2, i))
            else:
                self._begin_copy(i)
        else:
            heapq.heappush(self.timers, (t.start + t.ms, 0, i))

    def _begin_copy(self, i: int) -> None:
        self._progress(0.0)
        self.copies[i] = float(self.tasks[i].nbytes)
        self._rebalance()

    def _progress(self, dt: float) -> None:
        for i in self.copies:
            self.copies[i] -= self.rates[i] * dt

    def _rebalance(self) -> None:
        load: dict[tuple[str, int], int] = defaultdict(int)
        for i in self.copies:
            for link in self.tasks[i].links:
                load[link] += 1
        caps = self.caps
        k = load.get(("cores", 0), 0)
        if self.share and k:  # what other processes leave the run's k tasks on the cores
            got = self.share[min(k, len(self.share)) - 1]
            caps = {**caps, ("cores", 0): min(caps[("cores", 0)], got)}
        self.rates = {
            i: min(caps[link] / load[link] for link in self.tasks[i].links) for i in self.copies
        }

    def _finish_copies(self, now: float) -> None:
        # done: within rounding of its size, or less than _TOL ms of bytes left (on a very fast
        # link the float clock cannot advance by what is left, and the loop would never end)
        finished = [
            i
            for i, r in self.copies.items()
            if r <= 1e-6 * max(1.0, self.tasks[i].nbytes) or r <= self.rates[i] * _TOL
        ]
        for i in finished:
            del self.copies[i]
        if finished:
            self._rebalance()
        for i in finished:
            self._finish(i, now)

    def _finish(self, i: int, now: float) -> None:
        t = self.tasks[i]
        t.end = now
        self.done += 1
        if t.lane is not None:
            self.running[t.lane] = None
            self.dirty.add(t.lane)
        for s, delay in self.succ[i]:
            self.ready_at[s] = max(self.ready_at[s], now + delay)
            self.waiting[s] -= 1
            if self.waiting[s] == 0:
                self._ready(s, now)

    def _deadlock(self) -> None:
        pending = [i for i, t in enumerate(self.tasks) if math.isnan(t.end)]
        stuck = self.tasks[min(pending, key=lambda i: (self.waiting[i] > 0, i))].action
        raise PlanError(
            f"{self.plan.schedule}: the simulation cannot progress at {stuck}\n"
            + format_grid(self.plan, mark=stuck, limit=24)
        )


def _link_caps(machine: Machine, num_devices: int) -> dict[tuple[str, int], float]:
    caps: dict[tuple[str, int], float] = {}
    for d in range(num_devices):
        caps[("h2d", d)] = machine.h2d_gbps * _GB
        caps[("d2h", d)] = machine.d2h_gbps * _GB
        caps[("p2p_out", d)] = caps[("p2p_in", d)] = (machine.p2p_gbps or 1e-9) * _GB
    if machine.host_link_gbps:
        caps[("host", 0)] = machine.host_link_gbps * _GB
    caps[("nvme", 0)] = machine.nvme_read_gbps * _GB
    if machine.host_cores:  # core-ms per ms
        caps[("cores", 0)] = caps[("optcpu", 0)] = machine.host_cores
        caps[("gil", 0)] = 1.0
        for d in range(num_devices):
            caps[("devcpu", d)] = machine.host_cores / num_devices
    return caps
