"""What one run of the executor is made of: its spec, its per-run scratch, its results.

``RunSpec`` says what to run (a lowered plan, micro-batches, the step it belongs to);
``_Ctx`` is the run's scratch while its actions execute on the streams (the states that cross
between actions, keyed by small named types, the groups' device state, the events each action
waits for, the byte counts); ``RunHandle`` is what ``Executor.start`` returns and ``finish``
consumes; ``RunResult``/``RunStats``/``TimelineRecord`` are what a finished run reports.
``GradSink`` is the executor's view of the host store and optimizer protocol. The executor
(executor.py) holds the behaviour; this module holds only data and the run's byte counting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from rp_engine.device.base import ComputeTimer, Event
from rp_engine.model.host_store import HostStore
from rp_engine.plan.actions import Action, Plan
from rp_engine.transfer import State, WeightUpload

__all__ = [
    "Carry",
    "Countdown",
    "Resume",
    "GradSink",
    "RunHandle",
    "RunResult",
    "RunSpec",
    "RunStats",
    "TimelineRecord",
]


@dataclass(frozen=True)
class TimelineRecord:
    """One action as it ran on one stream: device, action text ("F2.3@1", "U4.0@1" for an
    upload, "D5.0@1" a gradient download, "S2.3@0" an activation transfer), start/end seconds
    from the run's start, and the stream ("compute", "h2d_param", "h2d_act", "d2h", "d2h_act",
    or "host": gradient accumulation). On CUDA, device-stream times come from timing events
    (GPU execution, not host issue); host spans use the host clock."""

    device: int
    action: str
    start: float
    end: float
    stream: str = "compute"


class GradSink:
    """Where gradients go: the host store plus the optimizer protocol hooks.

    ``wait_free(layer, step)`` blocks until the layer's buffer may receive step ``step``'s
    gradients, ``is_free(layer, step)`` says whether it would return at once (a download may
    then land straight in the buffer); ``ready(layer, step)`` is called once the layer's
    gradient of a closing run is complete. The step is the run's own (``RunSpec.step``): with
    overlapping iterations the engine's counters have already moved on when a run's gradients
    land.
    """

    def __init__(
        self,
        store: HostStore,
        *,
        wait_free: Callable[[int, int], None] | None = None,
        is_free: Callable[[int, int], bool] | None = None,
        ready: Callable[[int, int], None] = lambda layer, step: None,
    ) -> None:
        self.store = store
        self.wait_free = wait_free or (lambda layer, step: None)
        # without an answer, a buffer counts as free only when nothing ever waits for it
        self.is_free = is_free or (lambda layer, step: wait_free is None)
        self.ready = ready


@dataclass
class RunSpec:
    """One call of ``Executor.run``."""

    plan: Plan  # a lowered plan (plan.schedules.lower), or a subset of one iteration's actions
    batches: Sequence[State]  # host micro-batches, indexed by Action.microbatch
    version: int  # compute-weight version every upload must see
    step: int  # boundary step these gradients belong to (RNG seeds, bookkeeping)
    train: bool = True
    grad_scale: float = 1.0  # multiplies d(loss) in the fused head backward (the loss scale)
    # per micro-batch, d(caller's loss)/d(the head's loss) (the imperative loop's window: 1/GAS
    # for DeepSpeed's loop, a token share for Trainer's); multiplies grad_scale. None: 1
    factors: Sequence[float] | None = None
    closes_step: bool = False  # report layers ready to the optimizer when their grads land
    defer_head: bool = False  # keep the head's gradients on the device (imperative loop)
    # a window's forward run (the imperative loop's read): its slots' weights stay on their
    # devices for the window's next runs at the same version (Executor._kept)
    keep_weights: bool = False
    # with defer_head: the head computes the loss only (no backward) and the carry keeps its
    # input; the window's run resumes such a micro-batch at its HEAD (Planner.plan rerun_head)
    head_loss_only: bool = False
    microbatch_offset: int = 0  # global micro-batch number of batches[0] (RNG seeds)
    # or each micro-batch's own global number (the loop's window, where an entry run alone
    # before leaves a gap); default offset + index
    microbatches: Sequence[int] | None = None
    profile: bool = False
    # backward runs of the imperative loop: micro-batch m resumes from resumes[m], the carry of
    # its forward run (the plan holds backward actions only)
    resumes: Sequence[Resume] = ()
    token_stats: bool = False  # the head also reports per-token statistics (RunResult)
    sole: bool = True  # no other run lands gradients of this step (False: the loop's earlier ones)

    @property
    def whole_step(self) -> bool:
        """Whether this run makes every gradient contribution of its step: a training run that
        closes its step, resumes no forward run and follows no other run of the step
        (``train_batch``'s one run per step, the imperative loop's window run when it is the
        step's only one). Only then may a download's device-side norm stand for the layer's
        whole gradient (runtime/grad_norm.py)."""
        return self.train and self.closes_step and not self.resumes and self.sole

    def global_microbatch(self, microbatch: int) -> int:
        """The engine-wide number of this run's micro-batch ``microbatch`` (dropout seeds)."""
        if self.microbatches is not None:
            return self.microbatches[microbatch]
        return self.microbatch_offset + microbatch

    def head_scale(self, microbatch: int) -> float:
        """What d(loss) of micro-batch ``microbatch`` is multiplied by in the head's backward."""
        if self.factors is None:
            return self.grad_scale
        return self.grad_scale * self.factors[microbatch]


@dataclass
class Carry:
    """What a forward run of the imperative loop leaves for its backward run: the saved stage
    inputs (host) and the head's device-side gradients, kept unscaled until the user's loss
    scaling is known at ``engine.backward(loss)``."""

    saved: dict[tuple[int, int], State]
    head_device: int
    head_grads: dict[int, torch.Tensor]
    grad_in: State | None  # d(our loss)/d(each gradient-carrying key of the head's input)
    microbatch: int
    # a loss-only head (RunSpec.head_loss_only): the head stage's input, on ``head_device``,
    # from which the window's run runs the head again (forward and backward); no head grads
    head_input: State | None = None


@dataclass(frozen=True)
class Resume:
    """A backward run's micro-batch that resumes from a forward run's carry: ``head_factor``
    (d(caller's loss)/d(the head's loss), times the loss scale) scales the carried head
    gradients; a module model's ``output_grads`` (d(caller's loss)/d(each output), host tensors
    keyed as the outputs were) seed the backward stages instead of a head."""

    carry: Carry
    head_factor: float = 1.0
    output_grads: State | None = None


@dataclass
class RunStats:
    """What one run moved and computed, measured by the devices themselves."""

    h2d_bytes: int = 0  # every host-to-device byte (weights + activations)
    d2h_bytes: int = 0
    weight_h2d_bytes: int = 0
    grad_d2h_bytes: int = 0
    uploads: int = 0  # weight uploads (one per UPLOAD action that copied)
    kept_uploads: int = 0  # UPLOAD actions served by weights a window's forward run kept
    downloads: int = 0  # gradient downloads (one per DOWNLOAD action)
    seconds: float = 0.0  # wall time of the run, issue to its end (overlapping the next one's)
    busy_s: dict[int, float] = field(default_factory=dict)  # per device: compute time

    @property
    def activation_bytes(self) -> int:
        """Activation traffic both ways (micro-batches, stage inputs, boundary states)."""
        return self.h2d_bytes - self.weight_h2d_bytes + self.d2h_bytes - self.grad_d2h_bytes

    def add(self, other: RunStats) -> None:
        """Accumulate another run (the imperative loop's runs of one optimizer step)."""
        for name in ("h2d_bytes", "d2h_bytes", "weight_h2d_bytes", "grad_d2h_bytes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.uploads += other.uploads
        self.kept_uploads += other.kept_uploads
        self.downloads += other.downloads
        self.seconds += other.seconds
        for d, s in other.busy_s.items():
            self.busy_s[d] = self.busy_s.get(d, 0.0) + s


@dataclass
class RunResult:
    losses: list[float]
    timeline: list[TimelineRecord]
    layer_ms: dict[int, list[float]] = field(default_factory=dict)  # fwd ms per layer
    bwd_ms: dict[int, list[float]] = field(default_factory=dict)  # backward ms per bwd stage
    carry: Carry | None = None
    stats: RunStats = field(default_factory=RunStats)
    boundary_bytes: int = 0  # the largest state a forward stage handed on (one micro-batch)
    # per micro-batch, with RunSpec.token_stats: the head's per-token statistics (host tensors)
    token_stats: list[dict[str, torch.Tensor]] = field(default_factory=list)
    # per micro-batch, from a head that returns the model's outputs (OutputHead): host copies
    outputs: list[State] = field(default_factory=list)


class Countdown:
    """Per-layer count of gradient contributions still to land. Download threads of several
    devices report at once; ``arrive`` is atomic, so each layer completes exactly once."""

    def __init__(self) -> None:
        self._left: dict[int, int] = {}
        self._lock = threading.Lock()

    def set(self, layers: Sequence[int], n: int) -> None:
        with self._lock:
            for layer in layers:
                self._left[layer] = n

    def arrive(self, layers: Sequence[int]) -> list[int]:
        """One contribution for each of ``layers``; returns those that just reached zero."""
        done = []
        with self._lock:
            for layer in layers:
                self._left[layer] = self._left.get(layer, 1) - 1
                if self._left[layer] == 0:
                    done.append(layer)
        return done


# ---- scratch keys: where one micro-batch's states live between actions --------------------
@dataclass(frozen=True)
class _Batch:
    """The host micro-batch, input of forward stage 0 (and of the prefix's recompute)."""

    microbatch: int


@dataclass(frozen=True)
class _FwdOut:
    """The output of forward stage ``stage`` (input of the next forward stage or the head)."""

    stage: int
    microbatch: int


@dataclass(frozen=True)
class _Saved:
    """Backward stage ``stage``'s input, computed inside a forward stage, before its download."""

    stage: int
    microbatch: int


@dataclass(frozen=True)
class _BwdIn:
    """Backward stage ``stage``'s input on its device, ready for the recompute."""

    stage: int
    microbatch: int


@dataclass(frozen=True)
class _Grad:
    """The gradient flowing into backward stage ``stage`` (from the head or stage - 1)."""

    stage: int
    microbatch: int


@dataclass(frozen=True)
class _Out:
    """A module model's outputs (OutputHead), on the head's device before their download."""

    microbatch: int


_Key = _Batch | _FwdOut | _Saved | _BwdIn | _Grad | _Out


@dataclass
class _HeadOut:
    """What the head's forward run leaves for the imperative loop's backward run."""

    device: int
    grads: dict[int, torch.Tensor]  # filled on the compute stream (the group's accumulators)
    grad_in: State | None
    microbatch: int
    head_input: State | None = None


@dataclass(frozen=True)
class _GroupKey:
    """One slot's round on one device: the unit of UPLOAD / DOWNLOAD / FREE (slot, first mb)."""

    slot: int
    microbatch: int
    device: int

    @classmethod
    def of(cls, a: Action) -> _GroupKey:
        return cls(a.stage, a.microbatch, a.device)


@dataclass
class _Group:
    """A group's device state: its weight upload (Parameters holding the accumulated .grad),
    the event of its last compute, and the event of its release."""

    weights: WeightUpload
    layers: tuple[int, ...]
    last_compute: Event | None = None


class _Ctx:
    """Per-run scratch space. Producers write before recording the event consumers wait on."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.acts: dict[_Key, State] = {}  # device (or host) states; see the handlers
        self.act_where: dict[_Key, tuple[int, Event | None]] = {}  # -> (device|-1, ready)
        self.saved: dict[tuple[int, int], State] = {}  # (bwd stage, mb) -> host input
        self.saved_ev: dict[tuple[int, int], Event | None] = {}
        self.host_inputs: dict[_Key, Callable[[], State]] = {}  # host state, on demand
        self.losses: dict[int, torch.Tensor] = {}
        self.token_stats: dict[int, dict[str, torch.Tensor]] = {}  # mb -> the head's statistics
        self.head_done: list[Event] = []  # HEAD compute ends: the losses are known after them
        self.timeline: list[TimelineRecord] = []  # host-clock spans (HOST stream)
        self.spans: list[tuple[int, str, Action, ComputeTimer]] = []  # (device, stream, ...)
        self.base: dict[int, ComputeTimer] = {}  # per device: the run's time origin
        self.layer_timers: list[tuple[int, ComputeTimer]] = []  # (layer, forward timer)
        self.remaining = Countdown()  # gradient downloads still due, per layer
        # per DOWNLOAD: the owner layers whose whole step gradient it carries (whole-step runs):
        # their squared norm is computed on the device (runtime/grad_norm.py)
        self.sole: dict[Action, frozenset[int]] = {}
        self.groups: dict[_GroupKey, _Group] = {}
        self.freed: dict[_GroupKey, Event] = {}
        self.upload_of: dict[Action, _GroupKey] = {}  # compute action -> its group
        self.computed: dict[int, list[Event]] = {}  # per device: compute ends, in issue order
        # the previous run's work this one waits for (see the module docstring): per UPLOAD
        # its FREEs, per device its last compute ends (not yet done when this run was issued)
        self.after_previous: dict[Action, list[Event]] = {}
        self.prior_computed: dict[int, list[Event]] = {}
        self.stats = RunStats()
        self._count_lock = threading.Lock()  # copy threads of every device count at once
        self.head_out: _HeadOut | None = None
        self.outputs: dict[int, State] = {}  # mb -> an OutputHead's outputs, on the host
        self.boundary_bytes = 0
        self.t0 = time.perf_counter()

    def count(self, nbytes: int, *, h2d: bool = False, grads: bool = False) -> None:
        """Add one copy's bytes to the run's stats (``grads``: a gradient download)."""
        with self._count_lock:
            if h2d:
                self.stats.h2d_bytes += nbytes
            else:
                self.stats.d2h_bytes += nbytes
            if grads:
                self.stats.grad_d2h_bytes += nbytes
                self.stats.downloads += 1


class RunHandle:
    """A run issued by ``Executor.start``: its scratch and the events that end it."""

    def __init__(self, ctx: _Ctx, ends: list[Event]) -> None:
        self.ctx = ctx
        self.ends = ends

    @property
    def spec(self) -> RunSpec:
        return self.ctx.spec
