"""The executor: runs a Plan's compute actions on a device pool, with real tensors.

For each action, in the plan's global issue order, a handler (table ``Op -> method``) queues work
on the action's device: weight upload (H2D_PARAM, gated by the layer's version), input arrival
(kept on the device when the producer ran there, else D2H on the producer and H2D_ACT here),
compute, and downloads (saved stage inputs, gradients). Streams only meet through events, so a
device computes stage k while stage k+1's weights upload and stage k-1's gradients download.

Per-layer protocol (see optim/stepper.py): an upload of layer l waits until the compute weights
of l hold the version this iteration must read; a gradient download into l's host buffer waits
until the previous step has consumed it; when a run closes an optimizer step, each layer is
reported ready the moment its last gradient has landed.

Errors: any exception on any stream comes back from ``run`` in the caller's thread as a
DeviceError naming the device and the action ("F2.3@1"); the pool is reset so the next run works.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rp_engine.device.base import Device, DeviceError, Event, StreamRole
from rp_engine.model.host_store import HostStore
from rp_engine.plan.actions import Action, Op
from rp_engine.runtime.replica import Replica
from rp_engine.runtime.stages import StageMap
from rp_engine.transfer import (
    State,
    WeightUpload,
    download_state,
    upload_state,
    upload_weights,
)

__all__ = ["Executor", "RunSpec", "RunResult", "TimelineRecord", "GradSink", "Carry", "layer_seed"]


@dataclass(frozen=True)
class TimelineRecord:
    """One compute action as it ran: device, action text, start/end seconds from run start."""

    device: int
    action: str
    start: float
    end: float


class GradSink:
    """Where gradients go: the host store plus the optimizer protocol hooks.

    ``wait_free(layer)`` blocks until the layer's buffer may receive this step's gradients;
    ``ready(layer)`` is called once the layer's gradient for a closing run is complete.
    """

    def __init__(
        self,
        store: HostStore,
        *,
        wait_free: Callable[[int], None] = lambda layer: None,
        ready: Callable[[int], None] = lambda layer: None,
    ) -> None:
        self.store = store
        self.wait_free = wait_free
        self.ready = ready


@dataclass
class RunSpec:
    """One call of ``Executor.run``."""

    actions: Sequence[Action]  # compute actions (FWD/HEAD/BWD) in a valid global issue order
    batches: Sequence[State]  # host micro-batches, indexed by Action.microbatch
    version: int  # compute-weight version every upload must see
    step: int  # boundary step these gradients belong to (RNG seeds, bookkeeping)
    train: bool = True
    grad_scale: float = 1.0  # multiplies d(loss) in the fused head backward
    closes_step: bool = False  # report layers ready to the optimizer when their grads land
    defer_head: bool = False  # keep the head's gradients on the device (imperative loop)
    microbatch_offset: int = 0  # global micro-batch number of batches[0] (RNG seeds)
    profile: bool = False
    carry: Carry | None = None  # from the forward run of the imperative loop
    head_factor: float = 1.0  # d(user loss)/d(our loss), applied to the carried head gradients


@dataclass
class Carry:
    """What a forward run of the imperative loop leaves for its backward run: the saved stage
    inputs (host) and the head's device-side gradients, kept unscaled until the user's loss
    scaling is known at ``engine.backward(loss)``."""

    saved: dict[tuple[int, int], State]
    head_device: int
    head_grads: dict[int, torch.Tensor]
    grad_in: torch.Tensor | None
    microbatch: int


@dataclass
class RunResult:
    losses: list[float]
    timeline: list[TimelineRecord]
    layer_ms: dict[int, list[float]] = field(default_factory=dict)  # fwd ms per layer
    bwd_ms: dict[int, list[float]] = field(default_factory=dict)  # backward ms per bwd stage
    carry: Carry | None = None


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


class _Ctx:
    """Per-run scratch space. Producers write before recording the event consumers wait on."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.acts: dict[Any, Any] = {}  # device (or host) states by key; see the handlers
        self.act_where: dict[Any, tuple[int, Event | None]] = {}  # key -> (device|-1, ready)
        self.saved: dict[tuple[int, int], State] = {}  # (bwd stage, mb) -> host input
        self.saved_ev: dict[tuple[int, int], Event | None] = {}
        self.host_inputs: dict[Any, Callable[[], State]] = {}  # key -> host state, on demand
        self.losses: dict[int, torch.Tensor] = {}
        self.timeline: list[TimelineRecord] = []
        self.layer_ms: dict[int, list[float]] = {}
        self.bwd_ms: dict[int, list[float]] = {}
        self.remaining = Countdown()  # backward contributions still due, per layer
        self.head_out: tuple[int, dict[int, torch.Tensor], torch.Tensor | None, int] | None = None
        self.t0 = time.perf_counter()


class Executor:
    """Runs plans for one model on one pool. Holds replicas; all state lives in the store."""

    def __init__(
        self,
        *,
        modules: Sequence[torch.nn.Module],
        stages: StageMap,
        devices: Sequence[Device],
        sink: GradSink,
        seed: int = 0,
        use_rng: bool = False,
        prefetch_depth: int = 1,
    ) -> None:
        self.modules = list(modules)
        self.stages = stages
        self.devices = list(devices)
        self.sink = sink
        self.store = sink.store
        self.seed = seed
        self.use_rng = use_rng
        self.prefetch_depth = prefetch_depth
        self._replicas: dict[tuple[int, int], Replica] = {}
        self._saved_at = stages.saved_inputs()
        self._handlers: dict[Op, Callable[[_Ctx, Action], None]] = {
            Op.FWD: self._forward,
            Op.HEAD: self._head,
            Op.BWD: self._backward,
        }
        self._compute_done: dict[int, list[Event]] = {}

    # --- public -----------------------------------------------------------------------------
    def run(self, spec: RunSpec) -> RunResult:
        """Execute the plan's compute actions; blocks until every stream has drained."""
        ctx = _Ctx(spec)
        self._compute_done = {d.index: [] for d in self.devices}
        if spec.train:
            for j, idx in enumerate(self.stages.bwd):
                n = sum(1 for a in spec.actions if _is_bwd(a) and a.stage == j)
                ctx.remaining.set(idx, n)
        for device in self.devices:
            device.reset_peak()
        if spec.carry is not None:
            self._resume_from(ctx, spec.carry)
        for action in spec.actions:
            handler = self._handlers.get(action.op)
            if handler is not None:  # transfer/optimizer actions are lowered by the handlers
                handler(ctx, action)
        self._drain()
        carry = None
        if spec.defer_head and spec.train:
            carry = Carry(ctx.saved, *ctx.head_out)  # type: ignore[misc]
        return RunResult(
            carry=carry,
            losses=[float(ctx.losses[m]) for m in sorted(ctx.losses)],
            timeline=sorted(ctx.timeline, key=lambda r: (r.start, r.device)),
            layer_ms=ctx.layer_ms,
            bwd_ms=ctx.bwd_ms,
        )

    def _resume_from(self, ctx: _Ctx, carry: Carry) -> None:
        """Start a backward run from a forward run's carry: scale the head's gradients by the
        factor the user's loss implies, queue their download, hand grad_in to stage 1."""
        device = self.devices[carry.head_device]
        compute = device.stream(StreamRole.COMPUTE)
        factor = ctx.spec.head_factor

        def scale() -> None:
            for g in carry.head_grads.values():
                g.mul_(factor)
            if carry.grad_in is not None:
                carry.grad_in.mul_(factor)

        compute.submit(scale, label="H.scale")
        done = compute.record()
        ctx.saved.update(carry.saved)
        for saved in carry.saved:
            ctx.saved_ev[saved] = None  # already on the host
        if carry.grad_in is not None:
            key = ("G", 1, carry.microbatch)
            ctx.acts[key] = {"hidden": carry.grad_in}
            ctx.act_where[key] = (carry.head_device, done)
        head_layers = self.stages.bwd[0]
        ctx.remaining.set(head_layers, 1)
        self._download_grads(ctx, device, carry.head_grads, head_layers, done, label="H.grads")

    def close(self) -> None:
        self._replicas.clear()

    # --- handlers -----------------------------------------------------------------------------
    # Each handler names the stage's inputs and outputs and gives the compute body; _launch
    # queues the weight upload, the input arrivals, the compute and records its event.
    def _forward(self, ctx: _Ctx, a: Action) -> None:
        layers, m = self.stages.fwd[a.stage], a.microbatch
        in_key = ("B", m) if a.stage == 0 else ("F", a.stage - 1, m)
        if a.stage == 0:
            self._put_host(ctx, in_key, functools.partial(dict, ctx.spec.batches[m]))
        out_key = ("F", a.stage, m)
        train = ctx.spec.train
        saves = {i: self._saved_at[i] for i in layers if i in self._saved_at and train}

        def body(device: Device, weights: WeightUpload) -> None:
            state = x_in = ctx.acts.pop(in_key)
            with torch.no_grad():
                for layer in layers:
                    if layer in saves:  # a backward stage's input: kept for its recompute
                        ctx.acts[("S", saves[layer], m)] = state
                    state = self._call(ctx, device, layer, state, m, weights)
            if state is not x_in:  # a pass-through stage hands its input on unchanged
                _free(device, x_in)
                _track(device, state)
            ctx.acts[out_key] = state

        done = self._launch(ctx, a, layers, [in_key], body)
        ctx.act_where[out_key] = (a.device, done)
        for j in saves.values():
            key = (j, m)
            ctx.saved_ev[key] = download_state(
                self.devices[a.device],
                functools.partial(ctx.acts.pop, ("S", *key)),
                functools.partial(ctx.saved.__setitem__, key),
                after=done,
                label=f"{a}.save{j}",
            )

    def _head(self, ctx: _Ctx, a: Action) -> None:
        layers, train = self.stages.bwd[0], ctx.spec.train
        in_key = ("F", len(self.stages.fwd) - 1, a.microbatch)
        grads: dict[int, torch.Tensor] = {}
        body = functools.partial(
            self._head_train if train else self._head_eval, ctx, a, in_key, grads
        )
        done = self._launch(ctx, a, layers, [in_key], body, backward=train)
        ctx.act_where[("G", 1, a.microbatch)] = (a.device, done)
        if not train:
            return
        if ctx.spec.defer_head:  # the imperative loop scales and downloads them in backward()
            ctx.head_out = (a.device, grads, None, a.microbatch)
            return
        self._download_grads(ctx, self.devices[a.device], grads, layers, done, label=f"{a}.grads")

    def _head_train(
        self, ctx: _Ctx, a: Action, in_key: Any, grads: dict[int, torch.Tensor],
        device: Device, weights: WeightUpload,
    ) -> None:  # fmt: skip
        """Head-stage blocks forward, fused head forward+loss+backward, blocks backward."""
        layers, m, spec = self.stages.bwd[0], a.microbatch, ctx.spec
        blocks, head = layers[:-1], layers[-1]
        x = ctx.acts.pop(in_key)
        x = _with_grad_input(x) if blocks else x
        with torch.enable_grad():
            y = x
            for layer in blocks:
                y = self._call(ctx, device, layer, y, m, weights)
            head_module: Any = self._load(device, head, weights).module
            loss, grad_in = head_module.forward_backward(
                {**y, "hidden": y["hidden"].detach()},
                grad_scale=1.0 if spec.defer_head else spec.grad_scale,
            )
            if blocks:
                torch.autograd.backward(y["hidden"], grad_in)
                grad_in = x["hidden"].grad
        ctx.losses[m] = loss.detach()
        _free(device, x)
        grads.update(self._grads(device, layers))
        if grad_in is not None and len(self.stages.bwd) > 1:
            ctx.acts[("G", 1, m)] = {"hidden": grad_in}
            _track(device, ctx.acts[("G", 1, m)])
            if spec.defer_head:
                ctx.head_out = (a.device, grads, grad_in, m)

    def _head_eval(
        self, ctx: _Ctx, a: Action, in_key: Any, grads: dict[int, torch.Tensor],
        device: Device, weights: WeightUpload,
    ) -> None:  # fmt: skip
        """Evaluation: the head-stage blocks and the head's loss, no gradient."""
        x = ctx.acts.pop(in_key)
        with torch.no_grad():
            for layer in self.stages.bwd[0]:
                x = self._call(ctx, device, layer, x, a.microbatch, weights)
        ctx.losses[a.microbatch] = x["loss"].detach()

    def _backward(self, ctx: _Ctx, a: Action) -> None:
        layers, m = self.stages.bwd[a.stage], a.microbatch
        x_key: Any = ("X", a.stage, m)
        if layers[0] == 0 and self.stages.has_prefix:  # the prefix recomputes from the batch
            self._put_host(ctx, x_key, functools.partial(dict, ctx.spec.batches[m]))
        else:
            self._put_saved(ctx, x_key, a)
        g_key, out_key = ("G", a.stage, m), ("G", a.stage + 1, m)
        last = a.stage == len(self.stages.bwd) - 1
        grads: dict[int, torch.Tensor] = {}

        def body(device: Device, weights: WeightUpload) -> None:
            x = _with_grad_input(ctx.acts.pop(x_key))
            grad_out = ctx.acts.pop(g_key)["hidden"]
            with torch.enable_grad():
                y = x
                for layer in layers:  # recompute, same RNG seeds as the forward
                    y = self._call(ctx, device, layer, y, m, weights)
                torch.autograd.backward(y["hidden"], grad_out)
            _free(device, x)
            _free(device, {"hidden": grad_out})
            grads.update(self._grads(device, layers))
            if not last:
                ctx.acts[out_key] = {"hidden": x["hidden"].grad}
                _track(device, ctx.acts[out_key])

        done = self._launch(ctx, a, layers, [x_key, g_key], body, backward=True)
        ctx.act_where[out_key] = (a.device, done)
        self._download_grads(ctx, self.devices[a.device], grads, layers, done, label=f"{a}.grads")

    def _launch(
        self,
        ctx: _Ctx,
        a: Action,
        layers: Sequence[int],
        inputs: Sequence[Any],
        body: Callable[[Device, WeightUpload], None],
        *,
        backward: bool = False,
    ) -> Event:
        """Queue one compute action: its weights, its inputs, then ``body`` on the compute
        stream once all have arrived. Returns the event of the compute's end."""
        device = self.devices[a.device]
        weights = self._upload(ctx, device, layers, a)
        arrived = [self._arrive(ctx, key, device, str(a)) for key in inputs]
        compute = device.stream(StreamRole.COMPUTE)
        _wait(compute, weights.event, *arrived)

        def run() -> None:
            start = time.perf_counter()
            body(device, weights)
            self._finish_compute(ctx, device, weights, layers, a, start, backward=backward)

        compute.submit(run, label=str(a))
        done = compute.record()
        self._compute_done[a.device].append(done)
        return done

    # --- building blocks ----------------------------------------------------------------------
    def _upload(self, ctx: _Ctx, device: Device, layers: Sequence[int], a: Action) -> WeightUpload:
        """Queue the stage's weights; waits for the memory of the stage two slots back."""
        seen: dict[int, torch.Tensor] = {}
        for layer in layers:
            hl = self.store.layers[layer]
            for _, t in itertools.chain(hl.params, hl.buffers):
                seen.setdefault(id(t), t)
        # Prefetch depth d: this upload may start once the compute d+1 slots back on this device
        # has finished, so at most d+1 stages' weights are resident at once.
        done = self._compute_done[device.index]
        depth = self.prefetch_depth
        after = [done[-(depth + 1)]] if len(done) > depth else []
        version = ctx.spec.version

        def wait_versions() -> None:
            for layer in layers:
                self.store.wait_version(layer, version)

        return upload_weights(
            device, list(seen.values()), after=after, before=wait_versions, label=str(a)
        )

    def _put_saved(self, ctx: _Ctx, key: Any, a: Action) -> None:
        saved = (a.stage, a.microbatch)
        if saved not in ctx.saved_ev:
            raise RuntimeError(f"{a}: its forward input was never saved (plan order?)")
        get = functools.partial(ctx.saved.pop, saved)
        self._put_host(ctx, key, get, ready=ctx.saved_ev[saved])

    @staticmethod
    def _put_host(
        ctx: _Ctx, key: Any, get: Callable[[], State], *, ready: Event | None = None
    ) -> None:
        """Register a host-resident input (a micro-batch, or a saved stage input whose download
        ``ready`` marks): ``get`` hands it over when the upload runs."""
        ctx.act_where[key] = (-1, ready)
        ctx.host_inputs[key] = get

    def _arrive(self, ctx: _Ctx, key: Any, device: Device, label: str) -> Event | None:
        """Make ``ctx.acts[key]`` available on ``device``; returns the event to wait for."""
        src_index, event = ctx.act_where[key]
        if src_index == device.index:
            return event
        if src_index >= 0:  # on another device: through the host (consumer GPUs have no P2P)
            src = self.devices[src_index]
            host: dict[str, State] = {}
            assert event is not None, key
            down = download_state(
                src,
                lambda: ctx.acts.pop(key),
                lambda st: host.__setitem__("s", st),
                after=event,
                label=f"{label}.send",
            )
            stream = device.stream(StreamRole.H2D_ACT)
            stream.wait(down)
            return self._upload_to(ctx, device, key, lambda: host.pop("s"), label)
        # host-resident input (micro-batch or a saved stage input)
        _wait(device.stream(StreamRole.H2D_ACT), event)
        return self._upload_to(ctx, device, key, ctx.host_inputs.pop(key), label)

    @staticmethod
    def _upload_to(
        ctx: _Ctx, device: Device, key: Any, get: Callable[[], State], label: str
    ) -> Event:
        put = functools.partial(ctx.acts.__setitem__, key)
        return upload_state(device, get, put, label=f"{label}.in")

    def _call(
        self,
        ctx: _Ctx,
        device: Device,
        layer: int,
        state: State,
        microbatch: int,
        weights: WeightUpload,
    ) -> State:
        replica = self._load(device, layer, weights)
        start = time.perf_counter()
        if self.use_rng:
            mb = ctx.spec.microbatch_offset + microbatch
            with device.rng_scope(layer_seed(self.seed, ctx.spec.step, mb, layer)):
                out = replica.module(state)
        else:
            out = replica.module(state)
        if ctx.spec.profile:
            ctx.layer_ms.setdefault(layer, []).append((time.perf_counter() - start) * 1e3)
        if layer == self.stages.head_index and not isinstance(out, dict):
            return {"loss": out}
        return out

    def _load(self, device: Device, layer: int, weights: WeightUpload) -> Replica:
        key = (device.index, layer)
        replica = self._replicas.get(key)
        if replica is None:
            replica = self._replicas[key] = Replica(self.modules[layer])
        replica.load(weights.tensors, training=self.modules[layer].training)
        return replica

    def _grads(self, device: Device, layers: Sequence[int]) -> dict[int, torch.Tensor]:
        grads: dict[int, torch.Tensor] = {}
        for layer in layers:
            replica = self._replicas[(device.index, layer)]
            grads.update(replica.grads())
        return grads

    def _finish_compute(
        self,
        ctx: _Ctx,
        device: Device,
        weights: WeightUpload,
        layers: Sequence[int],
        a: Action,
        start: float,
        *,
        backward: bool = False,
    ) -> None:
        for layer in layers:
            replica = self._replicas.get((device.index, layer))
            if replica is not None:
                replica.release()
        weights.release(device)
        end = time.perf_counter()
        if ctx.spec.profile and backward:
            ctx.bwd_ms.setdefault(a.stage, []).append((end - start) * 1e3)
        ctx.timeline.append(TimelineRecord(device.index, str(a), start - ctx.t0, end - ctx.t0))

    def _download_grads(
        self,
        ctx: _Ctx,
        device: Device,
        grads: dict[int, torch.Tensor],
        layers: Sequence[int],
        after: Event,
        *,
        label: str,
    ) -> None:
        stream = device.stream(StreamRole.D2H)
        stream.wait(after)
        params = {id(p): p for layer in layers for p in self.store.trainable_of(layer)}
        # a tied weight's buffer belongs to its owner layer, which may sit in another stage
        owners = {key: self.store.owner_layer(p) for key, p in params.items()}

        def run() -> None:
            host = {k: device.to_host(g) for k, g in grads.items() if k in params}
            device.host_sync()  # the copies must land before host code adds them up
            for key, grad in host.items():
                self.sink.wait_free(owners[key])
                self.store.accumulate(params[key], grad)
            for grad in grads.values():
                device.free(grad)
            grads.clear()
            for layer in ctx.remaining.arrive(layers):
                if ctx.spec.closes_step:
                    self.sink.ready(layer)

        stream.submit(run, label=label)

    def _drain(self) -> None:
        """Wait for every stream of every device; re-raise the first device error."""
        errors: list[BaseException] = []
        for device in self.devices:
            for role in StreamRole:
                try:
                    device.stream(role).record().synchronize()
                except BaseException as exc:  # noqa: BLE001 - collected, re-raised below
                    errors.append(exc)
        if errors:
            for device in self.devices:
                device.reset()
            self._replicas_reset()
            first = next((e for e in errors if isinstance(e, DeviceError)), errors[0])
            raise first

    def _replicas_reset(self) -> None:
        for replica in self._replicas.values():
            replica.release()


def layer_seed(seed: int, step: int, microbatch: int, layer: int) -> int:
    """The RNG seed of one layer's forward (and its recomputation): dropout masks depend only on
    (seed, step, global micro-batch, layer), never on the device or thread that ran it."""
    return ((seed * 1_000_003 + step * 10_007 + microbatch) * 1_009 + layer) & 0x7FFF_FFFF


def _wait(stream: Any, *events: Event | None) -> None:
    """Make later work on ``stream`` wait for each event that exists (None: already there)."""
    for event in events:
        if event is not None:
            stream.wait(event)


def _is_bwd(a: Action) -> bool:
    return a.op in (Op.BWD, Op.HEAD)


def _with_grad_input(state: State) -> State:
    """Detach the stage input and make its floating 'hidden' a leaf that collects a gradient."""
    out = {k: v.detach() for k, v in state.items()}
    hidden = out.get("hidden")
    if hidden is not None and hidden.is_floating_point():
        hidden.requires_grad_(True)
    return out


def _track(device: Device, state: State) -> None:
    for v in state.values():
        if isinstance(v, torch.Tensor):
            device.track(v)


def _free(device: Device, state: State) -> None:
    for v in state.values():
        if isinstance(v, torch.Tensor):
            device.free(v)
