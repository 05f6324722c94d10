"""The executor: runs a lowered Plan on a device pool, with real tensors.

The plan is the single source of truth (``plan.schedules.lower``): the executor walks its
actions in the global issue order and dispatches each through a table ``Op -> handler``:

    UPLOAD(slot, m0)@d    one weight upload for the slot's round (group) on d (H2D_PARAM),
                          gated by the plan: the FREE it depends on, and the layers' versions
    FWD / HEAD / BWD      compute (COMPUTE stream) with the group's weights; a HEAD or BWD
                          group accumulates its micro-batches' gradients in device ``.grad``
    DOWNLOAD(slot, m0)@d  the group's accumulated gradients, once, to the host (D2H)
    FREE(slot, m0)@d      weights and gradients of the group released (after the download)
    SEND, OPT             bookkeeping only: activations move along data edges when their
                          consumer is issued (kept on the device when it ran there, else D2H
                          on the producer and H2D_ACT here); optimizer steps follow the
                          per-layer protocol of optim/stepper.py

Per round, weights therefore cross the link once per slot, not once per micro-batch:

    d0 H2D_PARAM |== w(F0) ==|      |== w(H) ==|
    d0 COMPUTE              |F0.0|F0.1|F0.2|F0.3|H.0|H.1|H.2|H.3|      grads add up on d0
    d0 D2H                                                      |== g(H) ==|

Per-layer protocol: an upload of layer l waits until the compute weights of l hold the version
this iteration must read; a gradient download into l's host buffer waits until the previous step
has consumed it; when a run closes an optimizer step, each layer is reported ready the moment its
last gradient download has landed.

Runs overlap: ``start`` issues a run's actions and returns; ``finish`` waits for that run's own
end events (one per stream, recorded right after its last action; streams are FIFO), not for
every stream, so the next run's actions, issued in between, run on the other streams and devices
meanwhile (engine_pipeline.py). ``losses`` waits only for the HEAD actions. ``run`` is
``finish(start(spec))``. A run's byte counts come from its own copies, not device counters.

At the seam the round-robin goes on as in one plan: a run's first UPLOADs on a device wait for
the previous run's last FREEs there by the prefetch depth's rule (``plan.memory.cross_run_gates``),
and its first inputs arrive no earlier than the previous run's compute two before their
consumer. So a device never holds more than ``walk_peak`` over the two runs back to back
(``plan.memory.consecutive``), the bound the planner validates when iterations overlap; work
already done at issue time is not waited for.

A window's forward runs (``RunSpec.keep_weights``: the imperative loop runs a micro-batch's
forward alone when its loss is read) keep their slots' weights on the device instead of freeing
them (the deferred head's gradients handed to the carry first), and the next runs at the same
weight version use them where an UPLOAD of the same slot lands on the same device
(``Executor._kept``): the weights do not change within a window, so a loop that reads every loss
uploads them about once per window, not once per read. Such an UPLOAD moves no byte
(``RunStats.kept_uploads`` counts it: uploads + kept_uploads is the plan's count). A run that
keeps nothing releases what it did not use; a new version releases everything. The planner
allows it only where every weight fits beside the plan's validated peak
(``Planner.keeps_forward_weights``).

Errors: any exception on any stream comes back from ``finish`` (or ``losses``, ``run``) in the
caller's thread as a DeviceError naming the device and the action ("F2.3@1"). ``run`` then resets
the pool itself; after ``finish`` or ``losses`` the caller calls ``reset`` (which discards a run
started in between too), once nothing can block the reset: a later run's closures may be waiting
on the host for something the failed run was to produce (its upload for a weight version,
``HostStore.wait_version``; its accumulation for a gradient buffer, ``GradSink.wait_free``), and
``reset`` waits for every running closure. The caller wakes those first (engine_pipeline.py:
``OptimizerStepper.cancel``, ``HostStore.fail``), then resets::

    caller        finish(t) raises | cancel, fail | reset (drains every stream) | raise
    d0 H2D_PARAM  U(t+1): wait_version(w_t) ......| raises, woken: stream failed, drained

Why one module of about 1,000 lines: what is left here is the dispatch table itself, one
handler per ``Op`` over the state they share (the run's context, the device replicas, the
staging pools, the seam between runs), and a reader follows an action from ``_start`` through
its handler to ``finish`` without leaving it. The parts that stand alone already live beside
it: the run's records (run_state.py), host staging (staging.py), gradient norms
(grad_norm.py), the in-place guard (inplace.py), replicas (replica.py), stage maps
(stages.py), the copies (transfer.py).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rp_engine.device.base import ComputeTimer, Device, DeviceError, Event, StreamRole
from rp_engine.device.cpu import sigint_deferred
from rp_engine.model.base import grad_keys, writable
from rp_engine.model.host_store import GradLanding
from rp_engine.plan.actions import Action, Op, Plan
from rp_engine.plan.memory import cross_run_gates
from rp_engine.runtime.grad_norm import device_norms, sole_downloads, sq_norms_by_owner
from rp_engine.runtime.inplace import InPlaceGuard, versions
from rp_engine.runtime.replica import Replica
from rp_engine.runtime.stages import StageMap
from rp_engine.runtime.staging import HostStaging
from rp_engine.transfer import (
    State,
    WeightUpload,
    download_state,
    upload_state,
    upload_weights,
)

__all__ = [
    "Executor",
    "staging_pools",
    "RunSpec",
    "RunResult",
    "RunStats",
    "RunHandle",
    "TimelineRecord",
    "GradSink",
    "Carry",
    "Resume",
    "layer_seed",
]


from rp_engine.runtime.run_state import (
    Carry,
    GradSink,
    Resume,
    RunHandle,
    RunResult,
    RunSpec,
    RunStats,
    TimelineRecord,
    _Batch,
    _BwdIn,
    _Ctx,
    _FwdOut,
    _Grad,
    _Group,
    _GroupKey,
    _HeadOut,
    _Key,
    _Out,
    _Saved,
)


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
        staging: Mapping[int, HostStaging] | None = None,
    ) -> None:
        """``staging``: per device index, the host staging pool of its downloads (one made per
        device when None). An engine that replaces its executor (a new plan) passes the same
        pools to the next one, so the buffers are reused rather than allocated again."""
        self.modules = list(modules)
        self.stages = stages
        self.devices = list(devices)
        self.sink = sink
        self.store = sink.store
        self.seed = seed
        self.use_rng = use_rng
        self._replicas: dict[tuple[int, int], Replica] = {}
        # per device: host memory for the downloads that cannot land in their fp32 buffer
        self._staging = dict(staging) if staging is not None else staging_pools(self.devices)
        self._saved_at = stages.saved_inputs()
        self._inplace = InPlaceGuard()  # layers writing a kept input in place get a copy
        # a window's forward weights, by (device, forward slot), at _kept_version (docstring)
        self._kept: dict[tuple[int, int], WeightUpload] = {}
        self._kept_version: int | None = None
        # the last run issued: its plan, FREE events and compute ends per device (the seam)
        self._previous: tuple[Plan, dict[_GroupKey, Event], dict[int, list[Event]]] | None = None
        self._handlers: dict[Op, Callable[[_Ctx, Action], None]] = {
            Op.UPLOAD: self._upload,
            Op.FWD: self._forward,
            Op.HEAD: self._head,
            Op.BWD: self._backward,
            Op.DOWNLOAD: self._download,
            Op.FREE: self._free,
            Op.SEND: _bookkeeping,
            Op.OPT: _bookkeeping,
            Op.READ: self._read,
        }

    # --- public -----------------------------------------------------------------------------
    def run(self, spec: RunSpec) -> RunResult:
        """Execute the lowered plan's actions; blocks until all of the run's work is done. On
        an error the devices are reset before it is raised: call it with no other run in
        flight (a run's own closures never wait for a step that only this run would close)."""
        handle = self.start(spec)
        try:
            return self.finish(handle)
        except BaseException:
            self.reset()
            raise

    def start(self, spec: RunSpec) -> RunHandle:
        """Issue every action of the plan to the devices' streams and return at once.

        The work runs on the streams while the caller goes on, e.g. to start the next run,
        whose actions queue behind this one's on each stream (FIFO) and overlap its tail on
        the other streams and devices. ``finish`` waits for this run only.

        A Ctrl-C while it issues is raised once every action is queued (``sigint_deferred``):
        issuing takes the streams' queue locks hundreds of times, and an interrupt raised
        while one is held would leave it held, hanging the reset that follows."""
        with sigint_deferred():
            return self._start(spec)

    def _start(self, spec: RunSpec) -> RunHandle:
        ctx = _Ctx(spec)
        plan = spec.plan
        if spec.version != self._kept_version:
            self.release_kept()
        self._kept_version = spec.version
        for a in plan.actions:
            if a.is_compute:
                ups = [d for d in plan.deps[a] if d.op is Op.UPLOAD]
                if not ups:
                    raise ValueError(f"{a} has no UPLOAD in the plan: run a lowered plan")
                ctx.upload_of[a] = _GroupKey.of(ups[0])
        if spec.train:
            # per layer, the downloads that contribute to its gradient: its own, and those of
            # layers using a weight it owns (a tied weight), so an owner is reported ready only
            # once every stage using the weight has landed its part
            due: dict[int, int] = {}
            slots = [a.stage for a in plan.actions if a.op is Op.DOWNLOAD]
            # the resumed micro-batches' carried head gradients come down too, one download
            # per head device (``_fold_head_grads``)
            carried = {r.carry.head_device for r in spec.resumes if r.carry.head_input is None}
            slots += [plan.num_fwd_stages] * len(carried)
            for slot in slots:
                for layer in self._touched(self._slot_layers(plan, slot)):
                    due[layer] = due.get(layer, 0) + 1
            for layer, n in due.items():
                ctx.remaining.set([layer], n)
            if spec.whole_step:
                ctx.sole = sole_downloads(
                    plan, functools.partial(self._slot_layers, plan), self._owners_of
                )
        # The devices' memory peaks are left alone: their user sets the window (a benchmark
        # resets them at its start), and a reset here would keep only the newest run's peak.
        for device in self.devices:
            ctx.base[device.index] = device.timer()
        heads: dict[int, list[Resume]] = {}
        for microbatch, resume in enumerate(spec.resumes):
            self._resume_from(ctx, resume, microbatch)
            if resume.carry.head_input is None:  # its head's gradients were computed
                heads.setdefault(resume.carry.head_device, []).append(resume)
        for resumes in heads.values():
            self._fold_head_grads(ctx, resumes)
        self._follow_previous(ctx)
        for action in plan.actions:
            self._handlers[action.op](ctx, action)
        self._previous = (plan, ctx.freed, ctx.computed)
        # Streams are FIFO: an event recorded on each now completes when this run's work on it
        # is done, whatever a later run queues behind it.
        if not spec.keep_weights:  # kept weights this run did not use are not needed again
            self.release_kept()
        ends = [d.stream(role).record() for d in self.devices for role in StreamRole]
        return RunHandle(ctx, ends)

    def _follow_previous(self, ctx: _Ctx) -> None:
        """The seam with the run issued before (possibly still in flight): what this run's
        uploads and first inputs wait for (module docstring). Events already reached are left
        out: nothing to wait for, and after a reset they carry the discarded work's error."""
        previous, self._previous = self._previous, None
        if previous is None:
            return
        plan, freed, computed = previous
        for upload, frees in cross_run_gates(plan, ctx.spec.plan).items():
            events = [freed[_GroupKey.of(f)] for f in frees if _GroupKey.of(f) in freed]
            ctx.after_previous[upload] = [e for e in events if not e.query()]
        for device, ends in computed.items():
            ctx.prior_computed[device] = [e for e in ends[-2:] if not e.query()]

    def losses(self, handle: RunHandle) -> list[float]:
        """The run's per-micro-batch losses, as soon as its HEAD actions are done (the backward
        tail may still run). A device error is raised as ``finish`` raises it."""
        try:
            for event in handle.ctx.head_done:
                event.synchronize()
        except BaseException:
            self.finish(handle)  # raises the first DeviceError (the caller resets)
            raise
        return [float(v) for _, v in sorted(handle.ctx.losses.items())]

    def token_stats(self, handle: RunHandle) -> list[dict[str, torch.Tensor]]:
        """The run's per-micro-batch head statistics (``RunSpec.token_stats``), host copies;
        call after ``losses`` (the HEAD actions that fill them are done)."""
        stats = handle.ctx.token_stats
        return [{k: v.cpu() for k, v in stats[m].items()} for m in sorted(stats)]

    def finish(self, handle: RunHandle) -> RunResult:
        """Wait for the run's own work (its end events, not every stream's later work), then
        measure it. Re-raises the first device error and leaves the devices failed: the caller
        wakes what a later run may be waiting for on the host, then calls ``reset`` (module
        docstring). Resetting here, first, would wait forever for such a closure."""
        ctx, spec = handle.ctx, handle.ctx.spec
        errors: list[BaseException] = []
        for event in handle.ends:
            try:
                event.synchronize()
            except BaseException as exc:  # noqa: BLE001 - collected, re-raised below
                errors.append(exc)
        if errors:
            self._previous = None  # its events carry the error (left out anyway: reached)
            raise next((e for e in errors if isinstance(e, DeviceError)), errors[0])
        carry = None
        if spec.defer_head and spec.train:
            out = ctx.head_out
            assert out is not None, "a deferred-head run without a HEAD action"
            carry = Carry(
                ctx.saved, out.device, out.grads, out.grad_in, out.microbatch, out.head_input
            )
        self._measure(ctx)
        timeline, layer_ms, bwd_ms = self._timeline(ctx)
        for r in timeline:  # busy time: the compute spans, on the device's own clock
            if r.stream == "compute":
                ctx.stats.busy_s[r.device] += r.end - r.start
        return RunResult(
            carry=carry,
            losses=[float(ctx.losses[m]) for m in sorted(ctx.losses)],
            timeline=timeline,
            layer_ms=layer_ms,
            bwd_ms=bwd_ms,
            stats=ctx.stats,
            boundary_bytes=ctx.boundary_bytes,
            token_stats=[
                {k: v.cpu() for k, v in ctx.token_stats[m].items()} for m in sorted(ctx.token_stats)
            ],
            outputs=[ctx.outputs[m] for m in sorted(ctx.outputs)],
        )

    def _timeline(
        self, ctx: _Ctx
    ) -> tuple[list[TimelineRecord], dict[int, list[float]], dict[int, list[float]]]:
        """After the drain: every span on the run's time axis, and the profile (per-layer
        forward ms, per-backward-stage ms) from the same timers."""
        records = list(ctx.timeline)
        for a, start, end in self.store.nvme_reads(id(ctx)):  # the NVMe row (parameter tier)
            read = Action(Op.READ, a.stage, a.microbatch, a.device, a.iteration)
            records.append(
                TimelineRecord(a.device, str(read), start - ctx.t0, end - ctx.t0, "nvme")
            )
        bwd_ms: dict[int, list[float]] = {}
        for device, stream, a, timer in ctx.spans:
            start, end = timer.offsets(ctx.base[device])
            records.append(TimelineRecord(device, str(a), start, end, stream))
            if ctx.spec.profile and stream == "compute" and a.op in (Op.BWD, Op.HEAD):
                bwd_ms.setdefault(a.stage, []).append((end - start) * 1e3)
        layer_ms: dict[int, list[float]] = {}
        for layer, timer in ctx.layer_timers:
            layer_ms.setdefault(layer, []).append(timer.seconds() * 1e3)
        return sorted(records, key=lambda r: (r.start, r.device)), layer_ms, bwd_ms

    def _measure(self, ctx: _Ctx) -> None:
        """Wall time from issue to the run's end; the bytes were counted by the run's own copies
        (device counters would mix in an overlapping run's)."""
        ctx.stats.seconds = time.perf_counter() - ctx.t0
        for device in self.devices:
            ctx.stats.busy_s.setdefault(device.index, 0.0)

    def _touched(self, layers: Sequence[int]) -> list[int]:
        """``layers`` and the owners of the trainable weights they use: the layers whose
        gradients a download of ``layers`` adds to."""
        out = set(layers)
        for layer in layers:
            out |= self._owners_of(layer)
        return sorted(out)

    def _owners_of(self, layer: int) -> set[int]:
        """The layers owning the trainable parameters ``layer`` uses (a tied weight's owner)."""
        return {self.store.owner_layer(p) for p in self.store.trainable_of(layer)}

    def _slot_layers(self, plan: Plan, slot: int) -> tuple[int, ...]:
        """Host layer indices a plan slot runs (forward stage s, or backward stage slot - S_f)."""
        if slot < plan.num_fwd_stages:
            return self.stages.fwd[slot]
        return self.stages.bwd[slot - plan.num_fwd_stages]

    def _resume_from(self, ctx: _Ctx, resume: Resume, microbatch: int) -> None:
        """Start micro-batch ``microbatch`` of a backward run from a forward run's carry: hand
        grad_in, scaled by the factor the user's loss implies, to stage 1 (the head's gradients
        come down in ``_fold_head_grads``). The carry's own micro-batch number (its forward
        run's) is renamed."""
        carry = resume.carry
        device = self.devices[carry.head_device]
        compute = device.stream(StreamRole.COMPUTE)
        factor = resume.head_factor

        def scale() -> None:
            for g in (carry.grad_in or {}).values():
                g.mul_(factor)

        compute.submit(scale, label="H.scale")
        done = compute.record()
        for (stage, _), state in carry.saved.items():
            ctx.saved[(stage, microbatch)] = state
            ctx.saved_ev[(stage, microbatch)] = None  # already on the host
        if carry.head_input is not None:  # the head runs again here, from its input
            in_key = _FwdOut(len(self.stages.fwd) - 1, microbatch)
            ctx.acts[in_key] = carry.head_input
            ctx.act_where[in_key] = (carry.head_device, None)
            return
        key = _Grad(1, microbatch)
        grads_of_outputs = resume.output_grads
        if grads_of_outputs is not None:  # a module model: the user's loss seeds the backward
            self._put_host(ctx, key, functools.partial(dict, grads_of_outputs))
        elif carry.grad_in is not None:
            ctx.acts[key] = carry.grad_in
            ctx.act_where[key] = (carry.head_device, done)

    def _fold_head_grads(self, ctx: _Ctx, resumes: Sequence[Resume]) -> None:
        """The head's gradients of the resumed micro-batches whose head ran on one device,
        each scaled by its factor and added up there (fp32 once there are two, as a head group
        accumulates its micro-batches), then downloaded once: a window whose every loss was
        read moves the head's gradients once, as train_batch does, not once per read."""
        head_device = resumes[0].carry.head_device
        device = self.devices[head_device]
        compute = device.stream(StreamRole.COMPUTE)
        folded: dict[int, torch.Tensor] = {}

        def fold() -> None:
            for resume in resumes:
                for key, g in resume.carry.head_grads.items():
                    acc = folded.get(key)
                    if acc is None:
                        folded[key] = g.mul_(resume.head_factor)
                        continue
                    if acc.dtype != torch.float32:
                        device.free(acc, used_by=())
                        acc = folded[key] = acc.float()
                        device.track(acc)
                    acc.add_(g, alpha=resume.head_factor)
                    device.free(g, used_by=())
                resume.carry.head_grads.clear()  # folded: released with the download

        compute.submit(fold, label="H.fold")
        done = compute.record()
        num_fwd = len(self.stages.fwd)
        action = Action(Op.DOWNLOAD, num_fwd, 0, head_device)
        head_layers = self.stages.bwd[0]  # their downloads are due (``start``)
        self._download_grads(ctx, device, lambda: folded, head_layers, done, action=action)

    def release_kept(self) -> None:
        """Release the weights a window's forward runs kept (module docstring), after their
        last use (FIFO on the compute stream that used them)."""
        for (index, _), weights in self._kept.items():
            device = self.devices[index]
            device.stream(StreamRole.COMPUTE).submit(
                functools.partial(weights.release, device), label="kept.release"
            )
        self._kept.clear()

    def _drop_kept(self) -> None:
        """The kept weights released now (the streams are drained or stopped)."""
        for (index, _), weights in self._kept.items():
            with contextlib.suppress(Exception):
                weights.release(self.devices[index])
        self._kept.clear()

    def release(self, carry: Carry) -> None:
        """Drop a forward run's carry whose backward will never run (the imperative loop's
        forward without backward): its device tensors stop counting. The run has finished, so
        nothing queued still writes them."""
        device = self.devices[carry.head_device]
        kept = [*carry.head_grads.values(), *(carry.grad_in or {}).values()]
        kept += [t for t in (carry.head_input or {}).values() if isinstance(t, torch.Tensor)]
        for t in kept:
            device.free(t)
        carry.head_grads.clear()
        carry.saved.clear()
        carry.grad_in = carry.head_input = None

    def reset(self) -> None:
        """After a failed ``finish`` or ``losses``: discard all work queued on the devices (a
        run started later included), clear their failed state and drop the replicas' device
        tensors, so the next run works. Blocks until every running closure has returned: wake
        the host waits a later run may be blocked in first (module docstring). A device that
        cannot be reset is left as it is (its next run raises again)."""
        self._previous = None
        for device in self.devices:
            with contextlib.suppress(Exception):
                device.reset()
                # drained: no copy writes the staging buffers a failed run kept out any more
                self._staging[device.index].reclaim()
        self._drop_kept()
        self._replicas_reset()

    def close(self) -> None:
        self._drop_kept()
        self._replicas.clear()
        self._previous = None
        for staging in self._staging.values():
            staging.clear()

    def staging_bytes(self) -> dict[int, int]:
        """Per device index: bytes of the host staging buffers its downloads allocated so far
        (they are reused: after the first steps this stops growing)."""
        return {index: s.allocated_bytes for index, s in self._staging.items()}

    # --- transfer handlers --------------------------------------------------------------------
    def _upload(self, ctx: _Ctx, a: Action) -> None:
        """UPLOAD: the slot's weights, once for its whole round on this device. Waits for the
        memory the plan frees first (prefetch depth) and for the layers' weight versions."""
        key = _GroupKey.of(a)
        layers = self._slot_layers(ctx.spec.plan, a.stage)
        kept = self._kept.pop((a.device, a.stage), None)
        if kept is not None:  # this window's weights, left here by its last forward run
            ctx.groups[key] = _Group(kept, layers)
            ctx.stats.kept_uploads += 1
            return
        seen: dict[int, torch.Tensor] = {}
        for layer in layers:
            hl = self.store.layers[layer]
            for _, t in itertools.chain(hl.params, hl.buffers):
                seen.setdefault(id(t), t)
        gates = [ctx.freed[_GroupKey.of(d)] for d in ctx.spec.plan.deps[a] if d.op is Op.FREE]
        gates += ctx.after_previous.get(a, [])  # the previous run's FREEs (iterations overlap)
        version = ctx.spec.version
        device = self.devices[a.device]
        timer: list[ComputeTimer] = []
        hosts = list(seen.values())
        readers = self.store.versioned_layers(layers)  # with the owners of shared weights

        sources = self.store.weight_sources(hosts, version)
        leases: list[Any] = []  # weights paged in from NVMe for this copy (parameter tier)

        def wait_versions() -> None:
            for layer in readers:
                self.store.wait_version(layer, version)
            # compute weights on NVMe: pinned in RAM (read now unless the plan's READ got
            # there first) until the copy's end, released through ``page_out`` below
            self.store.page_in((id(ctx), a), layers, version, hosts, sources, leases)
            timer.append(device.timer())  # the copy starts once its versions are there

        weights = upload_weights(
            device, hosts, sources=sources, after=gates, before=wait_versions, label=str(a)
        )
        # a publish into the buffer this upload reads waits for it (HostStore.publish)
        assert weights.event is not None
        self.store.note_read(readers, version, weights.event)
        self.store.page_out(leases, weights.event)

        def copied() -> None:
            timer[0].stop()
            ctx.spans.append((device.index, "h2d_param", a, timer[0]))

        device.stream(StreamRole.H2D_PARAM).submit(copied, label=str(a))
        ctx.groups[key] = _Group(weights, layers)
        ctx.stats.uploads += 1
        ctx.stats.weight_h2d_bytes += weights.nbytes
        ctx.count(weights.nbytes, h2d=True)  # copy threads add to h2d_bytes concurrently

    def _read(self, ctx: _Ctx, a: Action) -> None:
        """READ: the weights of UPLOAD(slot, m0)@d come from NVMe (the parameter tier); queue
        their read now, in plan order, so it runs ahead of the upload as buffers allow."""
        upload = Action(Op.UPLOAD, a.stage, a.microbatch, a.device, a.iteration)
        layers = self._slot_layers(ctx.spec.plan, a.stage)
        self.store.queue_page_in((id(ctx), upload), layers, ctx.spec.version)

    def _download(self, ctx: _Ctx, a: Action) -> None:
        """DOWNLOAD: the gradients the group accumulated on the device, once, to the host."""
        group = ctx.groups[_GroupKey.of(a)]
        device = self.devices[a.device]
        assert group.last_compute is not None, a
        if ctx.spec.defer_head and a.stage == ctx.spec.plan.num_fwd_stages:
            # imperative loop: the head's gradients wait on the device for engine.backward()
            assert ctx.head_out is not None, "the head's forward run left no carry"
            taken = ctx.head_out.grads  # the carry's dict (filled on the compute stream)
            compute = device.stream(StreamRole.COMPUTE)
            compute.submit(lambda: taken.update(group.weights.take_grads()), label=f"{a}.keep")
            group.last_compute = compute.record()  # the FREE must not run before this
            return
        self._download_grads(
            ctx, device, group.weights.grads, group.layers, group.last_compute, action=a,
            sole=ctx.sole.get(a, frozenset()),
        )  # fmt: skip

    def _free(self, ctx: _Ctx, a: Action) -> None:
        """FREE: release the group's weights and gradients, after its last use (the download
        when there is one, FIFO on D2H; else its last compute, FIFO on COMPUTE)."""
        key = _GroupKey.of(a)
        group = ctx.groups.pop(key)
        device = self.devices[a.device]
        if ctx.spec.keep_weights:  # for the window's next runs (the head's grads: handed on)
            self._kept[(a.device, a.stage)] = group.weights
            ctx.freed[key] = device.stream(StreamRole.COMPUTE).record()  # its last use
            return
        downloads = any(d.op is Op.DOWNLOAD for d in ctx.spec.plan.deps[a])
        stream = device.stream(StreamRole.D2H if downloads else StreamRole.COMPUTE)
        if downloads and group.last_compute is not None:
            stream.wait(group.last_compute)

        # (a deferred head's gradients were handed to the carry before: they live on there)
        stream.submit(functools.partial(group.weights.release, device), label=str(a))
        ctx.freed[key] = stream.record()

    # --- handlers -----------------------------------------------------------------------------
    # Each handler names the stage's inputs and outputs and gives the compute body; _launch
    # queues the weight upload, the input arrivals, the compute and records its event.
    def _forward(self, ctx: _Ctx, a: Action) -> None:
        layers, m = self.stages.fwd[a.stage], a.microbatch
        in_key: _Key = _Batch(m) if a.stage == 0 else _FwdOut(a.stage - 1, m)
        if a.stage == 0:
            self._put_host(ctx, in_key, functools.partial(dict, ctx.spec.batches[m]))
        out_key = _FwdOut(a.stage, m)
        train = ctx.spec.train
        saves = {i: self._saved_at[i] for i in layers if i in self._saved_at and train}

        def body(device: Device, weights: WeightUpload) -> None:
            state = x_in = ctx.acts.pop(in_key)
            with torch.no_grad():
                for layer in layers:
                    if layer in saves:  # a backward stage's input: kept for its recompute
                        ctx.acts[_Saved(saves[layer], m)] = state
                    if layer in saves or (layer == 0 and train):  # the batch: read again too
                        state = self._call_keeping(ctx, device, layer, state, m, weights)
                    else:
                        state = self._call(ctx, device, layer, state, m, weights)
            if state is not x_in:  # a pass-through stage hands its input on unchanged
                _free(device, x_in)
                _track(device, state)
            ctx.acts[out_key] = state
            ctx.boundary_bytes = max(ctx.boundary_bytes, _state_bytes(state))

        done = self._launch(ctx, a, layers, [in_key], body)
        ctx.act_where[out_key] = (a.device, done)
        for j in saves.values():
            key = (j, m)
            ctx.saved_ev[key] = download_state(
                self.devices[a.device],
                functools.partial(ctx.acts.pop, _Saved(j, m)),
                _counted(ctx, functools.partial(ctx.saved.__setitem__, key), h2d=False),
                after=done,
                label=f"{a}.save{j}",
                trace=self._trace(ctx, self.devices[a.device], "d2h_act", a),
            )

    def _call_keeping(
        self, ctx: _Ctx, device: Device, layer: int, kept: State, m: int, weights: WeightUpload
    ) -> State:
        """``layer``'s forward on an input that a recomputation reads again: the layer gets a
        copy when it may write its input in place (runtime/inplace.py)."""
        given = self._inplace.given(layer, kept)
        before = versions(given)
        out = self._call(ctx, device, layer, given, m, weights)
        self._inplace.after(layer, kept, given, before)
        return out

    def _head(self, ctx: _Ctx, a: Action) -> None:
        layers, train = self.stages.bwd[0], ctx.spec.train
        in_key = _FwdOut(len(self.stages.fwd) - 1, a.microbatch)
        grads: dict[int, torch.Tensor] = {}
        loss_only = train and ctx.spec.head_loss_only
        handler = self._head_loss if loss_only else self._head_train if train else self._head_eval
        body = functools.partial(handler, ctx, a, in_key, grads)
        if train and ctx.spec.defer_head:  # the imperative loop scales them in backward()
            ctx.head_out = _HeadOut(a.device, grads, None, a.microbatch)
        done = self._launch(ctx, a, layers, [in_key], body, backward=train)
        ctx.act_where[_Grad(1, a.microbatch)] = (a.device, done)
        gives_outputs = not train or ctx.spec.defer_head  # else the head differentiates a loss
        if gives_outputs and _returns_outputs(self.modules[layers[-1]]):  # for the caller
            m, device = a.microbatch, self.devices[a.device]
            done = download_state(
                device,
                functools.partial(ctx.acts.pop, _Out(m)),
                _counted(ctx, functools.partial(ctx.outputs.__setitem__, m), h2d=False),
                after=done,
                label=f"{a}.out",
                trace=self._trace(ctx, device, "d2h_act", a),
            )
        ctx.head_done.append(done)

    def _head_train(
        self, ctx: _Ctx, a: Action, in_key: _Key, grads: dict[int, torch.Tensor],
        device: Device, weights: WeightUpload,
    ) -> None:  # fmt: skip
        """Head-stage blocks forward, fused head forward+loss+backward, blocks backward."""
        layers, m, spec = self.stages.bwd[0], a.microbatch, ctx.spec
        blocks, head = layers[:-1], layers[-1]
        x = ctx.acts.pop(in_key)
        x = _with_grad_input(x) if blocks else x
        head_module: Any = self._load(device, head, weights).module
        if spec.defer_head and _returns_outputs(head_module):
            # a module model's imperative forward: the outputs go to the caller, whose loss
            # (engine.backward) seeds the backward stages; the head stage holds no block
            assert not blocks, f"{a}: an output head's stage must hold no block"
            ctx.acts[_Out(m)] = outputs = head_module.outputs(x)
            ctx.losses[m] = head_module.loss_of(outputs)
            ctx.head_out = _HeadOut(a.device, grads, None, m)
            return
        with torch.enable_grad():
            y = _writable(x) if blocks else x
            for layer in blocks:
                y = self._call(ctx, device, layer, y, m, weights)
            loss, grad = head_module.forward_backward(
                _detached_grad_keys(y),
                grad_scale=1.0 if spec.defer_head else spec.head_scale(m),
                **_stats_kw(ctx, m),
            )
            grad_in = grad if isinstance(grad, dict) else {"hidden": grad}
            if blocks:
                _backprop(y, grad_in)
                grad_in = _input_grads(x)
        ctx.losses[m] = loss.detach()
        _free(device, x)
        if len(self.stages.bwd) > 1:
            ctx.acts[_Grad(1, m)] = grad_in
            _track(device, grad_in)
            if spec.defer_head:
                ctx.head_out = _HeadOut(a.device, grads, grad_in, m)

    def _head_loss(
        self, ctx: _Ctx, a: Action, in_key: _Key, grads: dict[int, torch.Tensor],
        device: Device, weights: WeightUpload,
    ) -> None:  # fmt: skip
        """A loss read (``RunSpec.head_loss_only``): the head stage's loss as training computes
        it (its dropout masks: the same seeds), without its backward; the input stays on the
        device in the carry, for the window's run to run the head from (forward and backward)."""
        x, m, first = ctx.acts[in_key], a.microbatch, self.stages.bwd[0][0]
        ctx.acts[in_key] = given = self._inplace.given(first, x)  # ``x`` survives the call
        before = versions(given)
        self._head_eval(ctx, a, in_key, grads, device, weights)  # pops ``given``
        self._inplace.after(first, x, given, before)
        ctx.head_out = _HeadOut(a.device, grads, None, m, head_input=x)

    def _head_eval(
        self, ctx: _Ctx, a: Action, in_key: _Key, grads: dict[int, torch.Tensor],
        device: Device, weights: WeightUpload,
    ) -> None:  # fmt: skip
        """Evaluation: the head-stage blocks and the head's loss, no gradient."""
        x, layers, m = ctx.acts.pop(in_key), self.stages.bwd[0], a.microbatch
        stats = _stats_kw(ctx, m)
        head_module: Any = self._load(device, layers[-1], weights).module
        outputs = _returns_outputs(head_module)
        with torch.no_grad():
            for layer in layers[:-1] if stats or outputs else layers:
                x = self._call(ctx, device, layer, x, m, weights)
            if outputs:  # a module model: its outputs go to the caller
                ctx.acts[_Out(m)] = x = head_module.outputs(x)
                ctx.losses[m] = head_module.loss_of(x)
                return
            if stats:  # the head called with its statistics dict (no dropout in a head)
                x = {"loss": head_module(x, **stats)}
        ctx.losses[m] = x["loss"].detach()

    def _backward(self, ctx: _Ctx, a: Action) -> None:
        layers, m = self.stages.bwd[a.stage], a.microbatch
        x_key = _BwdIn(a.stage, m)
        if layers[0] == 0:  # the first layer (the prefix, if any) recomputes from the batch
            self._put_host(ctx, x_key, functools.partial(dict, ctx.spec.batches[m]))
        else:
            self._put_saved(ctx, x_key, a)
        g_key, out_key = _Grad(a.stage, m), _Grad(a.stage + 1, m)
        last = a.stage == len(self.stages.bwd) - 1

        def body(device: Device, weights: WeightUpload) -> None:
            x = _with_grad_input(ctx.acts.pop(x_key))
            grad_out = ctx.acts.pop(g_key)
            with torch.enable_grad():
                y = _writable(x)
                if layers[0] == 0 and self._inplace.writes(0) is not False:
                    y = self._inplace.given(0, y)  # the user's micro-batch: left as it is
                for layer in layers:  # recompute, same RNG seeds as the forward
                    y = self._call(ctx, device, layer, y, m, weights)
                _backprop(y, grad_out)
            _free(device, x)
            _free(device, grad_out)
            if not last:  # the last stage's input is the micro-batch: no gradient flows on
                ctx.acts[out_key] = _input_grads(x)
                _track(device, ctx.acts[out_key])

        done = self._launch(ctx, a, layers, [x_key, g_key], body, backward=True)
        ctx.act_where[out_key] = (a.device, done)

    def _launch(
        self,
        ctx: _Ctx,
        a: Action,
        layers: Sequence[int],
        inputs: Sequence[_Key],
        body: Callable[[Device, WeightUpload], None],
        *,
        backward: bool = False,
    ) -> Event:
        """Queue one compute action on its group's weights: its inputs, then ``body`` on the
        compute stream once all have arrived. Returns the event of the compute's end."""
        device = self.devices[a.device]
        group = ctx.groups[ctx.upload_of[a]]
        weights = group.weights
        arrived = [self._arrive(ctx, key, device, a) for key in inputs]
        compute = device.stream(StreamRole.COMPUTE)
        _wait(compute, weights.event, *arrived)

        def run() -> None:
            timer = device.timer()
            body(device, weights)
            if backward:
                weights.fold_grads(device)
            timer.stop()
            ctx.spans.append((device.index, "compute", a, timer))
            self._finish_compute(device, layers)

        compute.submit(run, label=str(a))
        done = compute.record()
        group.last_compute = done
        ctx.computed.setdefault(a.device, []).append(done)
        return done

    # --- building blocks ----------------------------------------------------------------------
    def _put_saved(self, ctx: _Ctx, key: _Key, a: Action) -> None:
        saved = (a.stage, a.microbatch)
        if saved not in ctx.saved_ev:
            raise RuntimeError(f"{a}: its forward input was never saved (plan order?)")
        get = functools.partial(ctx.saved.pop, saved)
        self._put_host(ctx, key, get, ready=ctx.saved_ev[saved])

    @staticmethod
    def _put_host(
        ctx: _Ctx, key: _Key, get: Callable[[], State], *, ready: Event | None = None
    ) -> None:
        """Register a host-resident input (a micro-batch, or a saved stage input whose download
        ``ready`` marks): ``get`` hands it over when the upload runs."""
        ctx.act_where[key] = (-1, ready)
        ctx.host_inputs[key] = get

    def _arrive(self, ctx: _Ctx, key: _Key, device: Device, a: Action) -> Event | None:
        """Make ``ctx.acts[key]`` available on ``device`` for ``a``; returns the event to wait
        for. Traced as a SEND of ``a``'s slot and micro-batch."""
        src_index, event = ctx.act_where[key]
        if src_index == device.index:
            return event
        label = str(a)
        # As the plan's SEND rule: an input arrives while the action before its consumer runs,
        # never earlier, so a device holds the inputs of two actions at most (not of a round);
        # a run's first actions count the previous run's last ones (iterations overlap)
        earlier = ctx.prior_computed.get(device.index, []) + ctx.computed.get(device.index, [])
        if len(earlier) >= 2:
            device.stream(StreamRole.H2D_ACT).wait(earlier[-2])
        if src_index >= 0:  # on another device: through the host (consumer GPUs have no P2P)
            src = self.devices[src_index]
            host: dict[str, State] = {}
            assert event is not None, key
            down = download_state(
                src,
                lambda: ctx.acts.pop(key),
                _counted(ctx, lambda st: host.__setitem__("s", st), h2d=False),
                after=event,
                label=f"{label}.send",
                trace=self._trace(ctx, src, "d2h_act", a),
            )
            stream = device.stream(StreamRole.H2D_ACT)
            stream.wait(down)
            get: Callable[[], State] = lambda: host.pop("s")  # noqa: E731
        else:  # host-resident input (micro-batch or a saved stage input)
            _wait(device.stream(StreamRole.H2D_ACT), event)
            get = ctx.host_inputs.pop(key)
        put = _counted(ctx, functools.partial(ctx.acts.__setitem__, key), h2d=True)
        trace = self._trace(ctx, device, "h2d_act", a)
        return upload_state(device, get, put, label=f"{label}.in", trace=trace)

    @staticmethod
    def _trace(ctx: _Ctx, device: Device, stream: str, a: Action) -> Callable[[ComputeTimer], None]:
        """A transfer's timer lands in the timeline as SEND(slot of ``a``, its micro-batch)."""
        slot = a.stage + (len(ctx.spec.plan.fwd_cuts) if a.op is not Op.FWD else 0)
        send = Action(Op.SEND, slot, a.microbatch, device.index)
        return lambda timer: ctx.spans.append((device.index, stream, send, timer))

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
        timer = device.timer() if ctx.spec.profile else None
        if self.use_rng:
            mb = ctx.spec.global_microbatch(microbatch)
            with device.rng_scope(layer_seed(self.seed, ctx.spec.step, mb, layer)):
                out = replica.module(state)
        else:
            out = replica.module(state)
        if timer is not None:
            timer.stop()
            ctx.layer_timers.append((layer, timer))
        if layer == self.stages.head_index and not isinstance(out, dict):
            return {"loss": out}
        return out

    def _load(self, device: Device, layer: int, weights: WeightUpload) -> Replica:
        key = (device.index, layer)
        replica = self._replicas.get(key)
        if replica is None:
            replica = self._replicas[key] = Replica(self.modules[layer])
        replica.load(weights.tensors, training=self.modules[layer].training, params=weights.params)
        return replica

    def _finish_compute(self, device: Device, layers: Sequence[int]) -> None:
        for layer in layers:  # the group's Parameters keep the weights and grads, not the module
            replica = self._replicas.get((device.index, layer))
            if replica is not None:
                replica.release()

    def _download_grads(
        self,
        ctx: _Ctx,
        device: Device,
        take: Callable[[], dict[int, torch.Tensor]],
        layers: Sequence[int],
        after: Event,
        *,
        action: Action,
        sole: frozenset[int] = frozenset(),
    ) -> None:
        """Queue the download of ``take()`` (device grads by id(host param)) once ``after`` is
        done, and its accumulation into the host buffers on the device's HOST worker once the
        copies have landed (an event, not a blocking sync on the copy thread: the next download
        is already on its way while this one is added up); report layers whose last
        contribution this was.

        ``sole``: owner layers whose whole step gradient this download carries. Their
        per-parameter norms are computed on the D2H stream before the copies and come down with
        them; the host hands each layer's squared norm to the store just before reporting it
        ready, so the optimizer does not read its fp32 buffers again (runtime/grad_norm.py)."""
        d2h = device.stream(StreamRole.D2H)
        d2h.wait(after)
        params = {id(p): p for layer in layers for p in self.store.trainable_of(layer)}
        # a tied weight's buffer belongs to its owner layer, which may sit in another stage
        owners = {key: self.store.owner_layer(p) for key, p in params.items()}
        host: dict[int, torch.Tensor] = {}
        landings: dict[int, GradLanding] = {}  # every gradient's announcement (HostStore)
        normed: list[int] = []  # owner layer of each norm, in the norms' order
        norms: list[torch.Tensor] = []  # the host copy of the device norms
        staging = self._staging[device.index]
        # the staging buffers this download takes: given back by the HOST worker once read; on
        # a failure they stay out (a copy may still write them) until ``reset`` reclaims them
        staged: list[torch.Tensor] = []
        step = ctx.spec.step

        def stage(g: torch.Tensor) -> torch.Tensor:
            buf = staging.take(g.numel(), g.dtype, holder=staged)
            staged.append(buf)
            return device.to_host(g, out=buf.view(g.shape))

        def download() -> None:
            timer = device.timer()
            grads = take()
            # on this stream, after the compute it waited for and before the copies; one fp32
            # per parameter comes down with them (not counted in the run's gradient bytes)
            keys = [k for k in grads if k in params and owners[k] in sole]
            if keys:
                normed.extend(owners[k] for k in keys)
                norms.append(stage(device_norms([grads[k] for k in keys])))
            try:
                for k, g in grads.items():
                    if k not in params:
                        continue
                    # the step's first contribution lands straight in its fp32 buffer (no
                    # temporary, no host copy); a later one comes down into a staging buffer
                    # (reused, pinned on CUDA) and is added by the HOST worker
                    free = self.sink.is_free(owners[k], step)
                    landings[k] = self.store.announce(params[k], g, free=free)
                    target = landings[k].target
                    host[k] = stage(g) if target is None else device.to_host(g, out=target)
                direct = [lg for lg in landings.values() if lg.target is not None]
                if direct:  # a contribution added before this one lands waits for the copies
                    self.store.fenced(direct, device.fence())
            except BaseException:
                self.store.withdraw(landings.values())
                raise
            ctx.count(sum(g.numel() * g.element_size() for g in host.values()), grads=True)
            for grad in grads.values():  # made on the compute stream, read by this copy
                device.free(grad, used_by=(StreamRole.D2H,))
            timer.stop()
            ctx.spans.append((device.index, "d2h", action, timer))

        d2h.submit(download, label=str(action))
        landed = d2h.record()

        def accumulate() -> None:
            try:
                landed.synchronize()  # blocks this HOST worker only, until the copies are done
            except BaseException:
                self.store.withdraw(landings.values())
                raise
            start = time.perf_counter()
            for landing in landings.values():  # first contributions, in place already
                if landing.target is not None:
                    self.store.land(landing)
            # sole owners that had a contribution already: the host pass decides
            mixed: set[int] = set()
            for key, grad in host.items():
                if landings[key].target is not None:
                    continue
                self.sink.wait_free(owners[key], step)
                first = self.store.accumulate(params[key], grad, landing=landings[key])
                if owners[key] in sole and not first:
                    mixed.add(owners[key])  # another run of the step (RunSpec.whole_step wrong)
            host.clear()
            landings.clear()
            sq = sq_norms_by_owner(norms[0].tolist(), normed) if norms else {}
            norms.clear()
            staging.give(staged)  # read, and their copies were done (``landed``): reusable
            staged.clear()
            end = time.perf_counter()
            ctx.timeline.append(
                TimelineRecord(device.index, str(action), start - ctx.t0, end - ctx.t0, "host")
            )
            for layer in ctx.remaining.arrive(self._touched(layers)):
                if ctx.spec.closes_step:
                    if layer in sole and layer not in mixed:  # none landed: 0, as the host pass
                        self.store.note_sq_norm(layer, ctx.spec.step, sq.get(layer, 0.0))
                    self.sink.ready(layer, ctx.spec.step)

        device.stream(StreamRole.HOST).submit(accumulate, label=f"{action}.acc")

    def _replicas_reset(self) -> None:
        for replica in self._replicas.values():
            replica.release()


def staging_pools(devices: Sequence[Device], *, budget: int = 0) -> dict[int, HostStaging]:
    """One empty host staging pool per device, by index (``Executor(staging=)``), each held to
    ``budget`` bytes (0: unbounded; ``HostStaging.take``)."""
    return {d.index: HostStaging(d.host_buffer, budget=budget) for d in devices}


def layer_seed(seed: int, step: int, microbatch: int, layer: int) -> int:
    """The RNG seed of one layer's forward (and its recomputation): dropout masks depend only on
    (seed, step, global micro-batch, layer), never on the device or thread that ran it."""
    return ((seed * 1_000_003 + step * 10_007 + microbatch) * 1_009 + layer) & 0x7FFF_FFFF


def _stats_kw(ctx: _Ctx, microbatch: int) -> dict[str, Any]:
    """The head's ``stats=`` keyword when the run asks for per-token statistics."""
    if not ctx.spec.token_stats:
        return {}
    return {"stats": ctx.token_stats.setdefault(microbatch, {})}


def _bookkeeping(ctx: _Ctx, a: Action) -> None:
    """SEND and OPT: accounted by the plan; the runtime realises them elsewhere (see above)."""


def _wait(stream: Any, *events: Event | None) -> None:
    """Make later work on ``stream`` wait for each event that exists (None: already there)."""
    for event in events:
        if event is not None:
            stream.wait(event)


def _with_grad_input(state: State) -> State:
    """Detach the stage input and make each gradient-carrying value a leaf that collects one."""
    out = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    for k in grad_keys(out):
        out[k].requires_grad_(True)
    return out


def _writable(x: State) -> State:
    """The stage's input as its first layer gets it: each leaf of ``_with_grad_input`` as a
    non-leaf over the same storage (model/base.py ``writable``), so that the layer may write it
    in place (``nn.ReLU(inplace=True)``); the gradients still collect in the leaves."""
    keys = set(grad_keys(x))
    return {k: writable(v) if k in keys else v for k, v in x.items()}


def _detached_grad_keys(state: State) -> State:
    """``state`` with its gradient-carrying values detached (a head's own input leaves)."""
    keys = set(grad_keys(state))
    return {k: v.detach() if k in keys else v for k, v in state.items()}


def _backprop(y: State, grads: Mapping[str, torch.Tensor]) -> None:
    """Backward from a stage's outputs given d(loss)/d(each gradient key). Outputs that need no
    gradient (a parameterless first layer over the raw batch) are skipped, and a stage none of
    whose outputs does is left alone: nothing upstream of it can receive a gradient."""
    pairs = [
        (y[k], g)
        for k, g in grads.items()
        if isinstance(y.get(k), torch.Tensor) and y[k].requires_grad
    ]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def _input_grads(x: State) -> State:
    """The gradients a stage's input leaves collected (keys that received none are left out:
    a zero gradient contributes nothing upstream)."""
    out: State = {}
    for k in grad_keys(x):
        grad = x[k].grad
        if grad is not None:
            out[k] = grad
    return out


def _returns_outputs(module: Any) -> bool:
    """Whether a head hands the model's outputs to the caller (model/module.py OutputHead)."""
    return bool(getattr(module, "returns_outputs", False))


def _counted(ctx: _Ctx, put: Callable[[State], None], *, h2d: bool) -> Callable[[State], None]:
    """``put`` that first adds the state's bytes to the run's H2D or D2H count."""

    def counted(state: State) -> None:
        ctx.count(_state_bytes(state), h2d=h2d)
        put(state)

    return counted


def _state_bytes(state: State) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def _track(device: Device, state: State) -> None:
    for v in state.values():
        if isinstance(v, torch.Tensor):
            device.track(v)


def _free(device: Device, state: State) -> None:
    """Release an activation state from the COMPUTE closure that read it last (every caller is
    a compute body). Only COMPUTE is marked as its user: the state was made there or by an
    H2D_ACT upload (its allocation stream, which the compute waited for), and a D2H_ACT download
    of it (a saved input, a send) holds its own reference and marks its own stream
    (``transfer.download_state``). Marking every stream would also hold the memory back until
    the weight uploads and gradient downloads queued meanwhile are done."""
    for v in state.values():
        if isinstance(v, torch.Tensor):
            device.free(v, used_by=(StreamRole.COMPUTE,))
