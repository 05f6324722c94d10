"""Layer-by-layer optimizer stepping on a host thread, synchronous or asynchronous (staleness 1).

Versions: step t turns the masters into w_t (w_0 = initial weights). Iteration t reads compute
weights w_{t-1} in sync mode and w_{max(t-2, 0)} in async mode; the runtime waits for them per
layer (``HostStore.wait_version``), never for a whole step.

::

    iteration t backward      |== layer L ==|== ... ==|== layer 0 ==|
    layer_ready(l, t)            add ||g_l||^2; async with one weight buffer: publish w_{t-1}
                                 (the run that read w_{t-2} is done with layer l)
    worker thread (async)             step_t(L) ........ step_t(0)   overlaps iteration t+1
    iteration t+1 forward                          |== layer 0 (reads w_{t-1}) ==| ...

Where w_t is published: in sync mode when step t ends for the layer; in async mode with double-
buffered compute weights (``HostStore.double_buffer_weights``) also when step t ends, into the
buffer iteration t read w_{t-2} from, so iteration t+1 (w_{t-1}) never waits for iteration t's
last backward: the two iterations overlap (engine_pipeline.py). Two steps can then be open at
once: step t accumulates while step t-1's last gradients land; the protocol calls name the step.

Staleness compensation (``roundpipe.staleness_compensation``, async only): the compute weights
published for step t are then a prediction of w_{t+1}, which the synchronous optimizer would
have the iteration read: one more Adam step with step t's own hyper-parameters (never the next
step's, which only the boundary knows: a publish must not wait for it), along the moments at
hand ("predict") or along the moments the next step would make if its gradient repeated step
t's ("lookahead"). Published at step end, it is written slice by slice as Adam steps the layer,
while each slice is in cache (``HostOptimizer.step_params`` with ``publish``); published apart
(one weight buffer, at iteration t+1's ``layer_ready``) step t's gradient is gone, so both
extrapolate along the moments. The masters and moments stay Adam's, and a drain publishes the
masters (``HostStore.publish``). "lookahead_dc" also delay-compensates step t's gradient before
Adam sees it, from the weights iteration t read, which the buffer step t publishes into still
holds (optim/delay_compensation.py): the masters and moments are then Adam's for the
compensated gradients. With one weight buffer it steps as "lookahead" (a warning says so).

Global-norm clipping and fp16 overflow need every layer's gradient: the squared norms are summed
as layers complete (no separate pass; a layer whose whole gradient came down in one download
brings its squared norm computed on the device, runtime/grad_norm.py) and the clip/unscale
coefficient is applied inside each layer's step. Without clipping, fp16 or a torch fallback
optimizer, each layer steps as soon as its gradient is complete.

Data parallel (``dp``, rp_engine/distributed.py): a layer's gradient is first reduced onto the
rank that owns it, only the owner steps it, and the layer is done on every rank once its new
weights have been broadcast; the global norm is summed over the ranks at ``close_step``.

Failures: an exception while a layer steps surfaces at the next engine call, naming the layer and
the step. With a step journal (optim/step_journal.py) the failed step is undone first: every
layer's masters, optimizer moments and compute weights are those of the previous step again, the
step's gradients are dropped, and training can go on. Without one it cannot be undone and every
later call raises (see ``check``).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from rp_engine.host.affinity import CoreSplit, pin_optimizer_thread
from rp_engine.model.host_store import HostParam, HostStore
from rp_engine.optim.delay_compensation import DelayCompensation
from rp_engine.optim.optimizer import PREDICTIONS, HostOptimizer
from rp_engine.optim.step_journal import StepJournal

if TYPE_CHECKING:
    from rp_engine.distributed import DataParallel

__all__ = ["AUTO", "COMPENSATIONS", "OptimizerStepper", "StepResult", "staleness_compensation"]

# ``roundpipe.staleness_compensation`` resolved: the methods (weight predictions) it can run
COMPENSATIONS = ("none", *(p for p in PREDICTIONS if p is not None))
# what "auto" runs where it applies: the method whose worst case over the compensation suite
# (benchmarks/studies/compensation_suite.py) is no worse than plain async (``staleness_compensation``)
AUTO = "lookahead"

log = logging.getLogger("rp_engine.optim")


@dataclass(frozen=True)
class StepResult:
    """Outcome of one boundary step, known as soon as every gradient has landed."""

    step: int
    grad_norm: float  # unscaled global norm before clipping (DeepSpeed's get_global_grad_norm)
    overflow: bool


@dataclass
class _OpenStep:
    step: int
    groups: list[dict[str, Any]]
    loss_scale: float
    ready: set[int]
    # squared gradient norm per layer, summed in layer order at close_step: layers land from
    # several device threads in an order that varies between runs, and a float sum taken in
    # arrival order would make the clipped step (and the weights) differ in the last bit
    layer_sq: dict[int, float] = field(default_factory=dict)

    def sq_norm(self) -> float:
        """The step's squared global norm, summed in layer order (deterministic)."""
        return sum((self.layer_sq[k] for k in sorted(self.layer_sq)), 0.0)


class OptimizerStepper:
    """Owns the optimizer worker thread and the per-layer 'step done' protocol."""

    def __init__(
        self,
        store: HostStore,
        optimizer: HostOptimizer,
        *,
        clip: float,
        async_mode: bool,
        fp16: bool,
        guard_nonfinite: bool = False,
        dp: DataParallel | None = None,
        journal: StepJournal | None = None,
        compensation: str = "none",
        cores: CoreSplit | None = None,
    ) -> None:
        """``compensation``: ``roundpipe.staleness_compensation`` resolved (one of
        ``COMPENSATIONS``; module docstring). ``cores``: the optimizer's share of the host
        cores (host/affinity.py), taken by the worker thread before its first step."""
        if compensation not in COMPENSATIONS:
            raise ValueError(f"compensation {compensation!r}: expected one of {COMPENSATIONS}")
        if compensation != "none" and async_mode and not optimizer.can_predict:
            raise ValueError(
                f'roundpipe.staleness_compensation "{compensation}" extrapolates along Adam\'s '
                "moments: it needs Adam/AdamW on DeepSpeed's CPU Adam (not torch_adam or another "
                'optimizer); use "none"'
            )
        self.store = store
        self.optimizer = optimizer
        self.clip = clip
        self.async_mode = async_mode
        self.fp16 = fp16
        self.guard_nonfinite = guard_nonfinite  # skip a step whose global norm is not finite
        self._num_layers = len(store.layers)
        self._done = [0] * self._num_layers  # last step applied (or skipped) per layer
        self._sealed = [0] * self._num_layers  # last step whose gradient is complete per layer
        self._cond = threading.Condition()
        self._open: dict[int, _OpenStep] = {}  # two at once while iterations overlap
        self._error: BaseException | None = None
        self._cancelled: BaseException | None = None  # set by cancel(): blocked waits raise it
        self._failed_step = 0  # the step whose layer raised (with _error)
        self._counted = 0  # the last step close_step returned: the engine counted it
        # undo log of the step being applied (None: failures stick); the optimizer's by default
        self.journal = journal if journal is not None else optimizer.journal
        self._tasks: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._pending = 0
        # Weight prediction (staleness compensation, module docstring): only the asynchronous
        # optimizer reads stale weights. _hp: the hyper-parameters each recent step ran with
        # (frozen when it opened), which the prediction of its weights extrapolates with
        self.predicts = compensation != "none" and async_mode
        self.compensation = compensation
        self._hp: dict[int, list[dict[str, Any]]] = {}
        # "lookahead_dc": the gradients are also delay-compensated, from the weights they were
        # taken at, which only the double-buffered publish still holds (optim/
        # delay_compensation.py); published apart, the step has only the look-ahead
        dc = self.predicts and compensation == "lookahead_dc"
        self.delay = DelayCompensation() if dc else None
        self._undelayed_warned = False
        self._cores = cores if cores is not None else CoreSplit()
        self._thread = threading.Thread(target=self._run, name="rp-optimizer", daemon=True)
        self._thread.start()
        # Data parallel (distributed.py): gradients reduced onto each layer's owner rank, which
        # alone steps it; the weights are broadcast back before the layer counts as done.
        self.dp = dp
        if dp is not None:
            if not optimizer.per_layer:
                self.close()
                raise ValueError(
                    "data parallel needs the per-layer host optimizer (Adam/AdamW on "
                    "DeepSpeedCPUAdam); a client torch optimizer steps all layers at once"
                )
            dp.start(self._dp_failed, lambda: self._error is not None)

    # --- the protocol used by the runtime ----------------------------------------------------
    @property
    def immediate(self) -> bool:
        """Whether a layer can step before the global norm is known."""
        guarded = self.fp16 or self.guard_nonfinite
        return self.optimizer.per_layer and self.clip <= 0 and not guarded

    def required_version(self, step: int) -> int:
        """Weights version that iteration ``step`` (1-based boundary step) must read."""
        return max(step - 2, 0) if self.async_mode else step - 1

    @property
    def publishes_at_step_end(self) -> bool:
        """Whether w_t is published when step t ends (sync mode, or async with double-buffered
        compute weights) rather than at iteration t+1's ``layer_ready``."""
        return not self.async_mode or self.store.weight_copies == 2

    def open_step(self, step: int) -> None:
        """Begin accumulating step ``step``; hyper-parameters are frozen now (same LR as sync)."""
        self.check()
        st = _OpenStep(step, self.optimizer.snapshot(), self.optimizer.cur_scale, set())
        with self._cond:
            self._open[step] = st
            self._hp[step] = st.groups
            for old in [k for k in self._hp if k < step - 2]:
                del self._hp[old]  # a publish reads at most the step before the open ones
            self._cond.notify_all()

    def refreeze(self, step: int) -> None:
        """Freeze open step ``step``'s hyper-parameters again, from the optimizer's groups now
        (the boundary before it was undone: a step skipped late, engine_boundary.py). No-op if
        the step is not open. Only for a step none of whose layers has been issued (a guarded
        or clipped step issues its layers at ``close_step``)."""
        assert not self.immediate, "an immediate step may have stepped layers already"
        groups = self.optimizer.snapshot()
        with self._cond:
            st = self._open.get(step)
            if st is not None:
                st.groups = groups
            if step in self._hp:
                self._hp[step] = groups

    def _step(self, step: int | None) -> _OpenStep:
        with self._cond:
            if step is None:
                assert self._open, "no open step"
                step = min(self._open)
            st = self._open.get(step)
        assert st is not None, f"step {step} is not open"
        return st

    def wait_grads_free(self, layer: int, step: int) -> None:
        """Block until ``layer``'s gradient buffer may receive step ``step``'s contributions.

        Single-buffered: once step ``step - 1`` has consumed it. Double-buffered: once step
        ``step - 1``'s gradient is complete (its buffer sealed) and step ``step - 2``, which used
        the same buffer, has consumed it; step ``step - 1``'s optimizer may still be running.
        """
        if not self.store.double_buffered:
            self._wait_done(layer, step - 1)
            return
        with self._cond:
            while self._sealed[layer] < step - 1:
                if self._cancelled is not None:
                    raise self._cancelled
                if self._error is not None:
                    raise RuntimeError(
                        f"optimizer worker failed; layer {layer} cannot take step {step}"
                    ) from self._error
                self._cond.wait(timeout=0.1)
        self._wait_done(layer, step - 2)

    def grads_free(self, layer: int, step: int) -> bool:
        """Whether ``wait_grads_free(layer, step)`` would return at once (never blocks; False
        after a failure or a cancellation). Once True it stays True for that step."""
        with self._cond:
            if self._cancelled is not None or self._error is not None:
                return False
            if not self.store.double_buffered:
                return self._done[layer] >= step - 1
            return self._sealed[layer] >= step - 1 and self._done[layer] >= step - 2

    def layer_ready(self, layer: int, step: int | None = None) -> None:
        """Layer's gradient for open step ``step`` (default: the oldest) is complete (called from
        a runtime host thread)."""
        st = self._step(step)
        if self.dp is not None:  # reduce first, in backward order, on the gradient thread
            self.dp.reduce(layer, partial(self._layer_ready, st, layer))
            return
        self._layer_ready(st, layer)

    def _layer_ready(self, st: _OpenStep, layer: int) -> None:
        if not self.publishes_at_step_end:
            # Iteration st.step no longer reads this layer: expose w_{t-1} for iteration t+1.
            self._wait_done(layer, st.step - 1)
            self.store.publish(layer, st.step - 1, predict=self._predictor(st.step - 1))
        # the squared norm: computed on the device with the download when that download was the
        # layer's whole gradient (runtime/grad_norm.py), else one read of the fp32 buffers. Data
        # parallel: the norm is of the reduced gradient, which only the owner holds (close_step
        # sums the ranks), so a device norm of this rank's part does not count.
        sq = self.store.take_sq_norm(layer, st.step)
        if self.dp is not None:
            sq = self.store.grad_sq_norm(layer) if self.dp.owns(layer) else 0.0
        elif sq is None:
            sq = self.store.grad_sq_norm(layer)
        self.store.seal_grads(layer)
        with self._cond:
            st.layer_sq[layer] = st.layer_sq.get(layer, 0.0) + sq
            st.ready.add(layer)
            self._sealed[layer] = max(self._sealed[layer], st.step)
            self._cond.notify_all()
        if self.immediate:
            self._enqueue(layer, st, coef=1.0, skip=False)

    def close_step(self, *, step: int | None = None, skip: bool = False) -> StepResult:
        """All gradients of open step ``step`` (default: the oldest) have landed: decide
        clip/overflow, issue the steps. ``skip`` (or a non-finite norm in fp16 or with
        ``guard_nonfinite``) skips the step: it reports ``overflow`` and no layer's weights
        change."""
        st = self._step(step)
        if self.dp is not None:  # every layer reduced; the norm and skip over all ranks
            reduced, skip = self.dp.finish_reduce(
                lambda layer: partial(self._layer_ready, st, layer), st.sq_norm, skip
            )
            st.layer_sq = {-1: reduced}  # the ranks' sum replaces this rank's per-layer parts
        missing = set(range(self._num_layers)) - st.ready
        for layer in sorted(missing):  # layers that saw no gradient (frozen, unused) still step
            self.layer_ready(layer, st.step)
        with self._cond:
            del self._open[st.step]
        sq = st.sq_norm()
        norm = math.sqrt(sq) / st.loss_scale if math.isfinite(sq) else math.inf
        overflow = skip or ((self.fp16 or self.guard_nonfinite) and not math.isfinite(norm))
        if not self.immediate:
            coef = 1.0 / st.loss_scale
            if self.clip > 0 and math.isfinite(norm) and norm > self.clip:
                coef *= self.clip / (norm + 1e-6)
            if self.optimizer.per_layer:
                for layer in range(self._num_layers):  # layer 0 first: the next forward needs it
                    self._enqueue(layer, st, coef=coef, skip=overflow)
            else:
                self._enqueue_all(st, coef=coef, skip=overflow)
        if not self.async_mode:
            self.wait_all()
        self._counted = st.step
        if not self.async_mode and self.journal is not None:
            self.journal.commit(st.step)  # counted and applied (the worker is idle)
        return StepResult(st.step, norm, overflow)

    # --- synchronisation ----------------------------------------------------------------------
    def wait_all(self) -> None:
        """Wait until every issued step has been applied; re-raise a worker error."""
        with self._cond:
            while self._pending and self._error is None:
                self._cond.wait(timeout=0.1)
        self.check()

    def synchronize(self) -> None:
        """Drain and publish the newest weights (save, eval, destroy): after it, the module's
        weights are the latest step's, and the staleness window restarts from them."""
        self.wait_all()
        for layer in range(self._num_layers):
            self.store.publish(layer, self._done[layer], everywhere=True)

    def check(self) -> None:
        """Raise the worker's error, if any, in the calling thread (never during a run).

        With a journal, the failed step is undone first (``_undo``) and the error is raised once:
        the engine is back at the last step it counted and the next call trains. Without one, a
        failed step leaves layers at different versions, so the error stays: every later call
        raises it too (load a checkpoint into a new engine to go on) instead of training on
        inconsistent weights or waiting for a version that will never come.
        """
        if self._error is None:
            return
        if self.journal is None:
            raise self._error
        self._wait_idle()
        err, failed = self._error, self._failed_step
        restored = self._undo(failed, keep=self._counted)
        log.warning("%s; undid step %d on %d layer(s)", err, failed, len(restored))
        self._error = None
        self.store.fail(None)
        if self._counted >= failed:  # async: the engine had moved on past the failed step
            now = f"as before it; step {failed} counts as skipped (its update dropped)"
        else:
            now = f"those of step {self._counted} again"
        raise RuntimeError(
            f"{err}; step {failed} was undone ({len(restored)} layer(s) had started stepping): "
            f"weights, masters and optimizer state are {now}, its gradients were dropped, and "
            "training can go on"
        ) from err.__cause__

    def abandon_step(self, step: int | None = None) -> None:
        """Forget open step ``step`` (default: every open step) after a failed run (its
        gradients are discarded by the caller)."""
        with self._cond:
            if step is None:
                dropped = list(self._open.values())
                self._open.clear()
            else:
                one = self._open.pop(step, None)
                dropped = [one] if one is not None else []
        if self.dp is not None:
            self.dp.abandon()
        # Layers that already stepped (per-layer stepping starts while the backward still runs)
        # are undone when there is a journal (never with overlapping iterations or data
        # parallel: the engine turns it off there); the worker is waited for first.
        for st in dropped:
            if self.journal is None or self._error is not None:
                break
            self._wait_idle()
            if self._error is None and self.journal.step == st.step:
                restored = self._undo(st.step, keep=self._counted)
                log.warning(
                    "undid the optimizer step of %d layer(s) of step %d", len(restored), st.step
                )

    def cancel(self, reason: BaseException) -> None:
        """Make every runtime thread blocked in ``wait_grads_free``/``layer_ready`` raise
        ``reason`` (a failure with iterations in flight: their steps will not close); cleared by
        ``restart``."""
        with self._cond:
            self._cancelled = reason
            self._cond.notify_all()

    def restart(self, step: int) -> None:
        """After a failure with steps in flight (overlapping iterations): forget the open steps
        and declare every layer at ``step`` (steps not closed count as skipped), with the
        masters, which hold the last applied step, published into every weight buffer. Call it
        after ``wait_all`` and with the gradients discarded."""
        self.abandon_step()
        self._declare(step, uncancel=True)
        with self._cond:
            self._hp.clear()
        self.store.set_versions(-1)  # forget the held versions, then publish the masters
        for layer in range(self._num_layers):
            self.store.publish(layer, step, everywhere=True)
        self.store.fail(self._error)  # clears a cancellation; an optimizer failure stays

    def set_step(self, step: int) -> None:
        """After loading a checkpoint: every layer has applied ``step`` and shows w_step."""
        self._declare(step)
        with self._cond:
            self._hp.clear()  # the loaded step's weights are published as they are
        self._counted = step
        if self.journal is not None and self.journal.step is not None:
            self.journal.commit(self.journal.step)  # the loaded masters replace what it holds
        self.store.set_versions(step)

    @property
    def thread(self) -> threading.Thread:
        """The optimizer worker thread."""
        return self._thread

    def close(self) -> None:
        """Run (or, after a failure, skip) the queued steps, then stop and join the worker.

        The join has no timeout: a worker left running at interpreter exit aborts the process
        (see runtime/shutdown.py), and a queued step always finishes. Idempotent.
        """
        if self._thread.is_alive():
            self._tasks.put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join()
        if self.dp is not None:
            self.dp.close()

    # --- internals ----------------------------------------------------------------------------
    def _declare(self, step: int, *, uncancel: bool = False, forget_open: bool = False) -> None:
        """Every layer has applied (and sealed) ``step``; waiters re-check. ``uncancel`` clears
        a ``cancel``; ``forget_open`` drops the open steps too."""
        with self._cond:
            self._done = [step] * self._num_layers
            self._sealed = [step] * self._num_layers
            if uncancel:
                self._cancelled = None
            if forget_open:
                self._open.clear()
            self._cond.notify_all()

    def _wait_idle(self) -> None:
        with self._cond:
            while self._pending:
                self._cond.wait(timeout=0.1)

    def _undo(self, failed: int, *, keep: int) -> set[int]:
        """Roll step ``failed`` back (worker idle, no run in flight): journaled masters and
        optimizer state are restored, so every master holds w_{failed-1}; compute weights that
        had been published at ``failed`` or later get them back. The engine counted steps up to
        ``keep`` (``failed`` in async mode, whose boundary was applied before the step ran: it
        becomes a step whose update was dropped, like an fp16 overflow skip; ``failed - 1`` when
        it was not counted), so every layer is declared done at ``keep`` and gradients in
        flight are dropped. Returns the layers whose optimizer step was undone."""
        assert self.journal is not None
        restored = self.journal.rollback(failed)
        for layer in range(self._num_layers):
            # a layer that failed part-way through its step had also written part of its
            # compute weights (the publish runs inside the step): rewind it as well
            if self.store.version(layer) >= failed or layer in restored:
                self.store.rewind(layer, keep)
        self.store.zero_grads()
        self._declare(keep, forget_open=True)
        return restored

    def _wait_done(self, layer: int, step: int) -> None:
        with self._cond:
            while self._done[layer] < step:
                if self._cancelled is not None:
                    raise self._cancelled
                if self._error is not None:
                    raise RuntimeError(  # name the root cause: the layer that failed
                        f"layer {layer} cannot reach step {step}: {self._error}"
                    ) from self._error
                self._cond.wait(timeout=0.1)

    def _enqueue(self, layer: int, st: _OpenStep, *, coef: float, skip: bool) -> None:
        if self.dp is not None:
            self._enqueue_dp(layer, st, coef=coef, skip=skip)
            return
        masters = [hp.master for hp in self.store.layers[layer].owned]
        slices = self.store.slice_count(layer)

        def task() -> None:
            if slices and not skip and masters:
                self._step_sliced(layer, slices, st, coef=coef)
                return
            # the masters and moments hold their values inside ``resident`` (the NVMe tier
            # reads them before and writes them back after; in RAM it does nothing)
            with self.store.resident(layer, dirty=not skip):
                if skip or not masters:
                    self._finish([layer], st.step)  # publishes the unchanged masters
                    return
                if self.journal is not None:
                    self.journal.record(st.step, layer, masters)
                self.store.attach_grads([layer])
                if not self.publishes_at_step_end:
                    self._warn_undelayed()
                    self.optimizer.step_params(masters, groups=st.groups, grad_coef=coef)
                    self._finish([layer], st.step)
                    return
                # w_t is published as the layer steps: each Adam slice is written (or, with
                # weight prediction, extrapolated) into the compute weights while in cache
                owned = {id(hp.master): hp for hp in self.store.layers[layer].owned}
                with self.store.publishing(
                    layer, st.step, predicted=self.predicts, keep=self.delay is not None
                ) as dst:
                    self.optimizer.step_params(
                        masters, groups=st.groups, grad_coef=coef,
                        publish=None if dst is None else (lambda p: dst(owned[id(p)])),
                        predict=self.compensation if self.predicts else None,
                        delay=None if dst is None else self.delay, fix_coef=coef * st.loss_scale,
                    )  # fmt: skip
                self._finish([layer], st.step, published=True)

        self._submit(task, f"layer {layer}", st.step)
        # the tier starts reading this layer and the ones stepped after it: immediate steps
        # come in backward order, a closed step's in layer order (``close_step``)
        if self.immediate:
            self.store.prefetch(range(layer, -1, -1))
        else:
            self.store.prefetch(range(layer, self._num_layers))

    def _step_sliced(self, layer: int, slices: int, st: _OpenStep, *, coef: float) -> None:
        """Step ``layer`` slice by slice (a sliced NVMe tier: its state never is in RAM
        whole), each slice's compute weights published as it steps. No step journal (the tier
        turns it off) and no delay compensation (refused with a sliced tier)."""
        owned = {id(hp.master): hp for hp in self.store.layers[layer].owned}
        predict = self.compensation if self.predicts else None

        def step(dst: Callable[[HostParam], torch.Tensor] | None) -> None:
            for k in range(slices):
                with self.store.resident_slice(layer, k) as segments:
                    # a piece's gradients are attached at its first slice and released at its
                    # last (plan/host_ram.py's pack_pieces: one gradient record at a time)
                    self.store.attach_param_grads(
                        owned[id(s.master)] for s in segments if s.start == 0
                    )
                    self.optimizer.step_segments(
                        segments, groups=st.groups, grad_coef=coef, predict=predict,
                        publish=None if dst is None else (lambda p: dst(owned[id(p)])),
                    )  # fmt: skip
                    done = [owned[id(s.master)] for s in segments if s.stop == s.master.numel()]
                    self.store.release_param_grads(layer, done)

        if not self.publishes_at_step_end:
            step(None)
            self._finish([layer], st.step, released=True)
            return
        with self.store.publishing(layer, st.step, predicted=self.predicts) as dst:
            step(dst)
        self._finish([layer], st.step, published=True, released=True)

    def _warn_undelayed(self) -> None:
        """Once: "lookahead_dc" with one compute-weight buffer steps without the delay
        compensation (the weights the gradient was taken at are gone by then)."""
        if self.delay is not None and not self._undelayed_warned:
            self._undelayed_warned = True
            log.warning(
                'roundpipe.staleness_compensation "lookahead_dc": the compute weights are not '
                "double-buffered (too little free host memory for a second copy), so the "
                'gradients cannot be delay-compensated; stepping with "lookahead" alone'
            )

    def _enqueue_dp(self, layer: int, st: _OpenStep, *, coef: float, skip: bool) -> None:
        """Data parallel: the owner rank steps the layer; then every rank receives its weights
        (weights thread) and only then finishes the layer (done, published)."""
        dp = self.dp
        assert dp is not None
        masters = [hp.master for hp in self.store.layers[layer].owned]
        stepped = threading.Event()

        def task() -> None:
            try:
                if not skip and masters and dp.owns(layer):
                    self.store.attach_grads([layer])
                    self.optimizer.step_params(masters, groups=st.groups, grad_coef=coef)
            finally:
                stepped.set()

        def done() -> None:
            self._finish([layer], st.step)
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

        with self._cond:
            self._pending += 1  # the broadcast: wait_all waits for it too
        self._submit(task, f"layer {layer}", st.step)
        dp.broadcast(layer, stepped, done)

    def _dp_failed(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()
        self.store.fail(exc)

    def _enqueue_all(self, st: _OpenStep, *, coef: float, skip: bool) -> None:
        masters = [hp.master for hp in self.store.owned_params()]

        def task() -> None:
            if not skip:
                if self.journal is not None:
                    for layer in range(self._num_layers):
                        owned = [hp.master for hp in self.store.layers[layer].owned]
                        self.journal.record(st.step, layer, owned)
                self.store.attach_grads()
                self.optimizer.step_params(masters, groups=st.groups, grad_coef=coef)
            self._finish(list(range(self._num_layers)), st.step)

        self._submit(task, "all layers", st.step)

    def _finish(
        self, layers: list[int], step: int, *, published: bool = False, released: bool = False
    ) -> None:
        """The layers have applied step ``step`` (or skipped it): mark them done and, when w_t
        is published at step end and the step did not already (``published``: the fused publish
        of ``_enqueue``), publish it: the masters, as they are after a skipped step (its update
        was dropped, so nothing is extrapolated) or a step of a torch optimizer or of data
        parallel (no moments on this rank to extrapolate along). ``released``: the step
        released the layers' gradients itself (``_step_sliced``)."""
        if not released:
            self.store.release_grads(layers)
        with self._cond:
            for layer in layers:
                self._done[layer] = step
            self._cond.notify_all()
        if self.publishes_at_step_end and not published:
            for layer in layers:
                self.store.publish(layer, step)
        if self.journal is not None and min(self._done) >= step and self._counted >= step:
            # every layer has stepped and the engine counted the step: nothing left to undo (a
            # step applied in full by a run that then failed is undone; else the next step's
            # first record drops the records)
            self.journal.commit(step)

    def _predictor(self, step: int) -> Callable[[HostParam, torch.Tensor], bool] | None:
        """With weight prediction, what ``HostStore.publish`` extrapolates the weights of step
        ``step`` with when it publishes them apart from the step (one weight buffer: at the
        next iteration's ``layer_ready``): one more Adam step along the moments at hand with
        the hyper-parameters step ``step`` ran with, as the fused publish at step end does
        (``HostOptimizer.step_params``). None without prediction or when they are not known
        (the first step, or just after a load or a restart: the masters are published)."""
        if not self.predicts:
            return None
        with self._cond:
            groups = self._hp.get(step)
        if groups is None:
            return None
        optimizer = self.optimizer
        return lambda hp, dst: optimizer.predict_into(hp.master, dst, groups)

    def _submit(self, task: Callable[[], None], what: str, step: int) -> None:
        def guarded() -> None:
            try:
                task()
            except BaseException as exc:  # surfaces at the next engine call
                err = RuntimeError(f"optimizer step failed on {what} (step {step}): {exc!r}")
                err.__cause__ = exc
                with self._cond:
                    self._error = err
                    self._failed_step = step
                    self._cond.notify_all()
                self.store.fail(err)  # weight uploads waiting for this step must not hang

        with self._cond:
            self._pending += 1
        self._tasks.put(guarded)

    def _run(self) -> None:
        pin_optimizer_thread(self._cores)
        while True:
            task = self._tasks.get()
            if task is None:
                return
            if self._error is None:
                task()
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()


def staleness_compensation(
    wanted: str, *, async_mode: bool, can_predict: bool, data_parallel: bool
) -> str:
    """``roundpipe.staleness_compensation`` resolved for this engine: one of ``COMPENSATIONS``.

    "auto" is ``AUTO`` ("lookahead") where it applies (the asynchronous optimizer on DeepSpeed's
    CPU Adam, one process) and "none" elsewhere. It was chosen by its worst case over the tasks
    of benchmarks/studies/compensation_suite.py (issue 43; benchmarks/RESULTS.md): on every task no
    worse than plain async, closing 66 % of its gap to sync on average. "lookahead_dc", the
    previous "auto", was far worse than plain async on a task without binding clipping (+8 % of
    the loss); delay compensation only on the steps where clipping binds met the criteria with a
    worse worst case. An explicit method where it cannot run raises (ValueError); with the
    synchronous optimizer nothing is stale, so it resolves to "none"."""
    if wanted == "none" or not async_mode:
        return "none"
    fits = can_predict and not data_parallel
    if wanted == "auto":
        return AUTO if fits else "none"
    if not fits:
        why = (
            "data parallel (the weights are stepped on one rank and broadcast)"
            if data_parallel
            else "an optimizer other than Adam/AdamW on DeepSpeed's CPU Adam (torch_adam, a "
            "torch.optim class or a client optimizer)"
        )
        raise ValueError(
            f'roundpipe.staleness_compensation "{wanted}" extrapolates the weights along Adam\'s '
            f'moments and does not support {why}; use "auto" (which falls back to "none" '
            'there) or "none"'
        )
    return wanted
