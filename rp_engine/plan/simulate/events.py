"""Discrete-event simulation of a Plan on a machine model.

Owns ``Machine`` (device links, P2P, a shared host link, CPU optimizer throughput; presets in
``presets/*.json``), ``simulate`` -> ``SimResult`` (makespan, steady-state iteration, bubble
ratio, per-device timelines, peak device memory, bytes moved), ``quick_times`` (the fast
compute-only timing pass the partitioner uses). ``python -m rp_engine.plan.simulate`` runs the
command line of cli.py.

Model. Each device has a compute stream that runs its plan actions strictly in order, and three
copy streams: weight uploads (H2D), activation uploads (H2D) and downloads (D2H). Copy streams
serve transfers in the order they become ready; concurrent transfers share link bandwidth
(per-device H2D and D2H links, an optional host link shared by every device, P2P links). The
host runs optimizer steps one at a time. Without a machine (the simulation conventions of the
published bubble table) only compute takes time and every cross-device edge adds ``comm_ms``.

Activations of an offloaded plan move as the runtime moves them (plan/traffic.py): besides the
SENDs of cross-device edges, a backward stage's input is stashed on the host after its forward
(D2H on the producer's device) and uploaded again for its recompute (H2D), even on the same
device; the micro-batch itself is uploaded for forward stage 0 and the recompute of layer 0.

Host overhead (``Machine.action_overhead_ms``, default 0): each action occupies the lane that
runs it for that long before its work starts - a compute action its device's compute stream,
each copy (each half of a send through the host) its copy stream, an optimizer step the host's
CPU lane. It stands for what the runtime pays per action that no layer timing or link model
contains (Python issue and bookkeeping, thread hand-offs); it is not compute busy time. With
``Machine.serial_overhead`` the overheads of all lanes instead take turns on one host lane (in
the order they become ready; a compute action's once its inputs are there and the action before
it on its device has finished), and the action starts when its overhead has run: Python work
holds one interpreter lock whichever thread does it, while the kernels and copies do not.

Shared cores (``Machine.host_cores``, CPU virtual devices): a device's compute, the optimizer
and the host overhead all run on the same few cores. Each is then work in core-ms (a device's
profiled time x its share of the cores, the pool's intra-op split; an optimizer step's time x
all cores, as DeepSpeed's CPU Adam was timed; the overhead x one core), served like bytes on a
link: at most its own cores, and an equal share of the host's when more want them than exist.
On a shared host, ``Machine.host_share[k - 1]`` is the cores' worth the run gets while k of its
tasks want them (other processes take the rest; measured during a run); k beyond the table
takes its last entry.

A backward action is two phases: recompute (needs the saved input) and backward (needs the
upstream gradient). RoundPipe starts the recompute as soon as its input exists ("early"); bound
schedules run it after the gradient arrives, as the published conventions do. For display and
the fill/drain figure the early recompute is aligned to end when the gradient arrives:

    d3: |..........|RRRRRR|BBBBBBBBBBB|      recompute ends as the gradient arrives
                        ^ gradient
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..actions import HOST, OPTIMIZER_LAG, Action, Op, Plan, PlanError, format_grid
from ..costs import LayerCosts, StageCosts
from ..lower import lower
from ..memory import memory_events, static_bytes

__all__ = [
    "Machine",
    "Interval",
    "SimResult",
    "simulate",
    "QuickTimes",
    "quick_times",
    "load_machine",
    "preset_names",
]

_PRESETS = Path(__file__).parent.parent / "presets"  # rp_engine/plan/presets
_GB = 1e6  # bytes per millisecond at 1 GB/s
_TOL = 1e-9  # ms: events this close together happen at the same time


@dataclass(frozen=True)
class Machine:
    """Where a plan runs: bandwidths in GB/s (1e9 bytes/s), memory in bytes.

    ``host_link_gbps`` is shared by every host<->device copy of every device (host memory or a
    PCIe root); None = no shared limit. ``compute_scale`` multiplies the profiled compute times
    (e.g. 0.53 to run RTX 4090 measurements on an A800). ``p2p`` sends activations device to
    device at ``p2p_gbps``; without it they go through host memory (D2H, then H2D).
    ``action_overhead_ms``: host time each action holds its lane before its work (see the module
    docstring); 0 in the GPU presets (not measured on CUDA), measured per run on CPU virtual
    devices by ``benchmarks/calibration.py``. ``serial_overhead``: those overheads run one at a
    time on one host lane, whichever stream they are for (Python work of every worker thread
    holds the one interpreter lock; the CPU virtual devices), instead of on each stream's own.
    ``host_cores``: the devices are CPU virtual devices computing on this many host cores, which
    the host optimizer and the host overhead use too (see the module docstring); None: devices
    have their own compute (GPUs). ``host_share``: on a shared host, the cores the run gets while
    k = 1, 2, ... of its tasks want them (benchmarks/host_load.py); empty: all ``host_cores``.
    """

    name: str
    num_devices: int = 8
    h2d_gbps: float = 24.0
    d2h_gbps: float = 26.6
    p2p: bool = False
    p2p_gbps: float = 0.0
    host_link_gbps: float | None = None
    memory_bytes: int | None = None
    cpu_adam_params_per_s: float = 1.4e9
    bytes_per_param: float = 2.0  # uploaded weights are bf16
    compute_scale: float = 1.0
    device_order: tuple[int, ...] | None = None  # Mobius cross mapping over PCIe switches
    action_overhead_ms: float = 0.0
    serial_overhead: bool = False  # every lane's overhead on one host lane (one interpreter lock)
    host_cores: float | None = None  # devices compute on the host's cores (CPU virtual devices)
    host_share: tuple[float, ...] = ()  # cores the run gets with k = 1, 2, ... tasks on them
    info: Mapping[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        positive = {
            "num_devices": self.num_devices,
            "h2d_gbps": self.h2d_gbps,
            "d2h_gbps": self.d2h_gbps,
            "cpu_adam_params_per_s": self.cpu_adam_params_per_s,
            "bytes_per_param": self.bytes_per_param,
            "compute_scale": self.compute_scale,
        }
        if self.p2p:
            positive["p2p_gbps (p2p is on)"] = self.p2p_gbps
        if self.host_link_gbps is not None:
            positive["host_link_gbps"] = self.host_link_gbps
        if self.host_cores is not None:
            positive["host_cores"] = self.host_cores
        bad = {k: v for k, v in positive.items() if not v > 0}
        if bad:
            raise ValueError(f"machine {self.name!r}: these must be > 0: {bad}")
        if any(not v > 0 for v in self.host_share):
            raise ValueError(f"machine {self.name!r}: host_share must be > 0: {self.host_share}")
        if not self.action_overhead_ms >= 0:
            raise ValueError(
                f"machine {self.name!r}: action_overhead_ms must be >= 0, got "
                f"{self.action_overhead_ms}"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Machine:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in data if k not in names and not k.startswith("_"))
        if unknown:
            raise ValueError(f"machine: unknown keys {unknown}; expected some of {sorted(names)}")
        kwargs = {k: v for k, v in data.items() if k in names}
        if kwargs.get("device_order") is not None:
            kwargs["device_order"] = tuple(kwargs["device_order"])
        if kwargs.get("host_share") is not None:
            kwargs["host_share"] = tuple(kwargs["host_share"])
        return cls(**kwargs)


def preset_names() -> list[str]:
    """Names of the machine presets shipped in presets/."""
    return sorted(p.stem for p in _PRESETS.glob("*.json"))


def load_machine(name_or_path: str) -> Machine:
    """A preset by name (see ``preset_names()``) or a JSON file path."""
    path = Path(name_or_path)
    if not path.is_file():
        path = _PRESETS / f"{name_or_path}.json"
    if not path.is_file():
        raise ValueError(
            f"no machine {name_or_path!r}: give a JSON path or one of {preset_names()}"
        )
    return Machine.from_dict(json.loads(path.read_text()))


# ---- results ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Interval:
    """One phase of one action on one lane of a device (``HOST`` for the optimizer)."""

    device: int
    lane: str  # compute, h2d_param, h2d_act, d2h, cpu
    phase: str  # fwd, recompute, bwd, head_fwd, head_bwd, upload, download, send, opt
    start_ms: float
    end_ms: float
    action: Action
    busy: bool  # counted as compute busy time

    @property
    def label(self) -> str:
        a = self.action
        return f"{a.op.value}{a.stage}.{a.microbatch}"


@dataclass(frozen=True)
class SimResult:
    """What a simulation measured. ``iteration_ms`` is the steady-state iteration (several
    iterations) or the makespan (one); ``bubble_ratio`` = 1 - busy / (N * iteration_ms) with
    busy the compute of one iteration. ``bubble_ratio_fill_drain`` (one iteration only) also
    counts each device's time before its first and after its last action as useful, the
    published estimate for an asynchronous optimizer."""

    schedule: str
    num_devices: int
    num_iterations: int
    num_fwd_stages: int
    num_bwd_stages: int
    makespan_ms: float
    iteration_ms: float
    busy_ms: float
    bubble_ratio: float
    bubble_ratio_fill_drain: float | None
    intervals: tuple[Interval, ...]
    peak_memory_bytes: tuple[int, ...]
    bytes_moved: Mapping[str, int]

    def timeline(self, device: int) -> list[Interval]:
        """Intervals of one device (all lanes), by start time."""
        return sorted(
            (i for i in self.intervals if i.device == device), key=lambda i: (i.start_ms, i.lane)
        )

    def to_json(self) -> dict[str, object]:
        return {
            "schedule": self.schedule,
            "num_devices": self.num_devices,
            "num_iterations": self.num_iterations,
            "num_fwd_stages": self.num_fwd_stages,
            "num_bwd_stages": self.num_bwd_stages,
            "makespan_ms": round(self.makespan_ms, 4),
            "iteration_ms": round(self.iteration_ms, 4),
            "busy_ms": round(self.busy_ms, 4),
            "bubble_ratio": round(self.bubble_ratio, 6),
            "bubble_ratio_fill_drain": None
            if self.bubble_ratio_fill_drain is None
            else round(self.bubble_ratio_fill_drain, 6),
            "peak_memory_bytes": list(self.peak_memory_bytes),
            "bytes_moved": dict(self.bytes_moved),
        }


# ---- fast path: compute-only plans under the conventions -------------------------------------
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


# ---- the event simulator ---------------------------------------------------------------------
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
    if machine.host_cores:  # core-ms per ms
        caps[("cores", 0)] = caps[("optcpu", 0)] = machine.host_cores
        caps[("gil", 0)] = 1.0
        for d in range(num_devices):
            caps[("devcpu", d)] = machine.host_cores / num_devices
    return caps


# ---- simulate ----------------------------------------------------------------------------------
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
    if not any(a.op is Op.OPT for a in plan.actions):
        _add_weight_gates(tasks, builder, OPTIMIZER_LAG[optimizer])
    elif global_norm:
        _add_step_barrier(tasks, builder)
    _Engine(tasks, plan, machine).run()
    if align_recompute:
        _align_recompute(tasks)
    return _result(plan, tasks, builder)


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


def _result(plan: Plan, tasks: list[_Task], builder: _Builder) -> SimResult:
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
    seq = [ends[it] for it in sorted(ends)]
    if len(seq) >= 3:
        iteration_ms = (seq[-1] - seq[1]) / (len(seq) - 2)
    elif len(seq) == 2:
        iteration_ms = seq[1] - seq[0]
    else:
        iteration_ms = makespan
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
