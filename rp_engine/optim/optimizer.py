"""The host optimizer: DeepSpeed's CPU Adam (or a torch.optim class) over fp32 master weights.

``HostOptimizer`` is what ``initialize`` returns as the optimizer. Its ``param_groups`` are the
inner torch optimizer's groups over the fp32 masters, so DeepSpeed's and torch's LR schedulers
drive it unchanged (``.optimizer`` exposes the inner optimizer, which is how
``deepspeed.runtime.lr_schedules.get_torch_optimizer`` unwraps wrappers).

Adam/AdamW step *per layer* through DeepSpeedCPUAdam's own C++ kernel (``adam_update``), with the
hyper-parameters snapshotted when the step was issued: that is what lets the asynchronous worker
step layer l of iteration T while the LR scheduler has already moved on. Other torch optimizers
cannot step a subset of their parameters, so they step all layers at once (``per_layer`` False).

DeepSpeed 0.19.8 binds ``adam_update`` without releasing the GIL: one call on a large tensor
would freeze every Python thread of the pipeline (compute, uploads, downloads) for its whole
duration. So the same C++ function is called without the GIL (optim/nogil_adam.py,
``roundpipe.release_gil``, on by default), and each parameter is stepped in bounded slices
(``adam_slice``: elements per call by the kind of devices trained on, smaller on GPUs where the
binding holds the GIL), bit-identical to one call: the kernel is elementwise, a slice boundary
that is a multiple of its SIMD span (at most 16 lanes x 8) splits its vector and scalar parts exactly as the whole
tensor does, and calls with the same step number leave its beta^t state untouched. The
unscale x clip coefficient multiplies each slice of the gradient right before its Adam call,
while the slice is in cache (one pass over the gradient, not two). Likewise the compute weights
the stepper publishes at step end are written right after each slice's Adam call
(``step_params`` with ``publish``): the cast of the masters, or the weight prediction of
``roundpipe.staleness_compensation``, by the vectorized kernels of optim/publish_kernel.py,
reading the slice Adam has just written from the CPU's caches (a 2M-element slice's w, g, m, v
and compute weight, 36 MiB, fit a server's last-level cache; smaller slices would fit the
per-core caches but cost more in per-call overhead than they save: benchmarks/RESULTS.md).
With delay compensation ("lookahead_dc") the slice is instead stepped by ``adam_step``, one
compiled pass per 64K-element block doing compensation, DeepSpeed's Adam formula and the
look-ahead while the block is in the core's L2 (equal to ``adam_update`` to fp32 rounding; it
also runs without the GIL, ctypes releasing it).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rp_engine.host.jit_cache import cpu_adam_cache_dir, every, extensions_dir, op_load_guard
from rp_engine.optim.delay_compensation import BLOCK, DelayCompensation
from rp_engine.optim.loss_scaler import LossScaler
from rp_engine.optim.nogil_adam import gil_free_adam
from rp_engine.optim.publish_kernel import (
    AdamTerms,
    adam_step,
    write_copy,
    write_lookahead,
    write_prediction,
)
from rp_engine.optim.step_journal import StepJournal

__all__ = [
    "ADAM_SLICE",
    "CUDA_ADAM_SLICE",
    "adam_slice",
    "HostOptimizer",
    "PREDICTIONS",
    "StateSegment",
    "build_inner_optimizer",
    "snapshot_groups",
]

log = logging.getLogger("rp_engine.optim")

# Elements per adam_update call (28 B of memory traffic per element), by the kind of devices
# trained on (``adam_slice``); multiples of the kernel's widest SIMD span (16 x 8). A call holds
# the GIL throughout: 1.5-10 ms for 2M elements on a busy host.
ADAM_SLICE = 1 << 21  # CPU virtual devices (and the default of a HostOptimizer)
CUDA_ADAM_SLICE = 1 << 19  # GPUs: a quarter of the GIL hold, between kernel launches
_SIMD_SPAN = 128


def adam_slice(device_kind: str, *, release_gil: bool = False) -> int:
    """Elements per CPU Adam call when the engine trains on ``device_kind`` ("cpu", "cuda").

    ``release_gil``: the kernel runs without the GIL (``roundpipe.release_gil``, optim/
    nogil_adam.py), so a call stalls no other thread and GPUs take ``ADAM_SLICE`` too (its
    size then only keeps a slice's publish reading from cache). Otherwise:

    On GPUs the device threads launch every kernel and copy from Python, so each call that
    holds the GIL stalls all launches for its length and the GPU can run dry behind it:
    ``CUDA_ADAM_SLICE`` (512K) holds it a quarter as long as 2M, at the cost of 4x the calls
    (about 13 us of Python each, making the four slice views, beside 0.9 ms for a 512K call on
    one core of the 2-core CI host: 1-2 %, more where many cores make the call shorter). CPU
    virtual devices compute on the host cores themselves, in torch ops that drop the GIL: a
    stall there idles no accelerator, so they keep ``ADAM_SLICE`` (fewer calls)."""
    if device_kind == "cuda":
        return ADAM_SLICE if release_gil else CUDA_ADAM_SLICE
    if device_kind == "cpu":
        return ADAM_SLICE
    raise ValueError(f"device_kind {device_kind!r}: expected 'cpu' or 'cuda'")


_ADAM_TYPES = {"adam", "adamw"}
# DeepSpeed optimizer names that need GPU kernels or communication we do not have on the host.
_UNSUPPORTED = {
    "lamb",
    "onebitadam",
    "zerooneadam",
    "onebitlamb",
    "muadam",
    "muadamw",
    "musgd",
    "muon",
}


def build_inner_optimizer(
    opt_type: str,
    params: Mapping[str, Any],
    groups: list[dict[str, Any]],
) -> tuple[torch.optim.Optimizer, bool]:
    """Build the torch optimizer over master param groups; returns (optimizer, per_layer).

    ``opt_type`` is the normalised DeepSpeed type ("adam", "adamw", "adagrad", "lion", or a
    torch.optim class name such as "SGD"). Unknown keyword params raise TypeError as in DeepSpeed.
    """
    kwargs = dict(params)
    if opt_type in _ADAM_TYPES:
        # DeepSpeed: "Adam" means AdamW behaviour unless adam_w_mode is false; torch_adam selects
        # torch's implementation instead of the CPU kernel.
        adamw_mode = bool(kwargs.pop("adam_w_mode", True)) if opt_type == "adam" else True
        torch_adam = bool(kwargs.pop("torch_adam", False))
        if torch_adam:
            cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
            return cls(groups, **kwargs), False
        return _cpu_adam(groups, adamw_mode=adamw_mode, **kwargs), True
    if opt_type in _UNSUPPORTED:
        raise ValueError(
            f"optimizer.type {opt_type!r} needs DeepSpeed GPU/communication kernels that do not "
            "run on host-resident weights; use Adam/AdamW (DeepSpeed CPU Adam) or a torch.optim name"
        )
    torch_names = {"adagrad": "Adagrad", "lion": "Lion"}
    torch_cls = getattr(torch.optim, torch_names.get(opt_type, opt_type), None)
    if torch_cls is None:
        raise ValueError(f"optimizer.type {opt_type!r} is not available in torch.optim")
    return torch_cls(groups, **kwargs), False


def _cpu_adam(
    groups: list[dict[str, Any]], *, adamw_mode: bool, **kwargs: Any
) -> torch.optim.Optimizer:
    cache = cpu_adam_cache_dir()
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError as exc:  # pragma: no cover - deepspeed is a dependency
        raise RuntimeError("deepspeed is required for Adam/AdamW (DeepSpeedCPUAdam)") from exc
    # the guard: a build lock left by a killed loader never wedges this load (jit_cache.py)
    with extensions_dir(cache), op_load_guard("cpu_adam", cache):
        if _is_cpu_adam_built(cache):
            return DeepSpeedCPUAdam(groups, adamw_mode=adamw_mode, **kwargs)
        log.warning("building DeepSpeed's CPU Adam once (about 1-2 minutes; cached in %s)", cache)
        with _heartbeat("still building DeepSpeed's CPU Adam"):
            return DeepSpeedCPUAdam(groups, adamw_mode=adamw_mode, **kwargs)


@contextlib.contextmanager
def _heartbeat(message: str, every_s: float = 15.0) -> Iterator[None]:
    """Log ``message`` with the elapsed time every ``every_s`` seconds until the block ends, so
    a long one-time build never looks like a hang."""
    start = time.monotonic()

    def beat() -> None:
        log.warning("%s (%.0f s)", message, time.monotonic() - start)

    with every(every_s, beat, "rp-heartbeat"):
        yield


def _is_cpu_adam_built(root: str) -> bool:
    for _dirpath, _, files in os.walk(root):
        if "cpu_adam.so" in files:
            return True
    return False


def snapshot_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Hyper-parameters of every group (no params), frozen at the moment a step is issued."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


@dataclass(frozen=True)
class StateSegment:
    """Elements ``[start, stop)`` of ``master`` (flat) with its state: ``w`` the master's
    values, ``exp_avg`` and ``exp_avg_sq`` its Adam moments there (contiguous fp32 views the
    step changes in place). What a sliced optimizer tier (storage/optimizer_tier.py) hands to
    ``HostOptimizer.step_segments``: the master itself may own no memory meanwhile."""

    master: torch.Tensor
    start: int
    stop: int
    w: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class HostOptimizer:
    """DeepSpeed-style optimizer wrapper over fp32 masters; see the module docstring."""

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        *,
        per_layer: bool,
        scaler: LossScaler,
        slice_elems: int = ADAM_SLICE,
        step_fn: Callable[[], Any] | None = None,
        release_gil: bool = True,
    ) -> None:
        """``step_fn``: what steps ``inner`` (all groups at once) when it is not per-layer;
        default ``inner.step``. A client's optimizer passes its original ``step``: user code
        calling ``inner.step()`` gets a no-op guard instead (rp_engine.optim.build).

        ``release_gil`` (``roundpipe.release_gil``): DeepSpeed's CPU Adam kernel is called
        without the GIL (optim/nogil_adam.py; bit-identical); False: through DeepSpeed's own
        binding, which holds it for each slice."""
        if slice_elems <= 0 or slice_elems % _SIMD_SPAN:
            raise ValueError(
                f"slice_elems={slice_elems}: must be a positive multiple of {_SIMD_SPAN} (the CPU "
                "Adam kernel's SIMD span), or slices would not be bit-identical to one call"
            )
        self.slice_elems = slice_elems
        self.optimizer = inner
        kernel = getattr(inner, "ds_opt_adam", None)
        self._nogil = gil_free_adam(kernel) if release_gil and kernel is not None else None
        self.releases_gil = self._nogil is not None
        self._step_fn = step_fn
        self.per_layer = per_layer
        self.loss_scaler = scaler
        self.overflow = False
        # undo log of a step in progress (optim/step_journal.py), set by build_optimizer; the
        # stepper records into it before each layer steps
        self.journal: StepJournal | None = None
        self._group_of = {id(p): i for i, g in enumerate(inner.param_groups) for p in g["params"]}
        # A torch optimizer steps all groups with the hyper-parameters frozen when the step was
        # issued, swapped into the live groups for the call: the LR scheduler (main thread) and
        # the snapshot of the next step must not see or overwrite the swapped-in values.
        self.hyperparams_lock = threading.Lock()

    def step_scheduler(self, scheduler: Any, **kwargs: Any) -> None:
        """Step an LR scheduler, never while a torch step has swapped its groups in.

        The engine steps the scheduler only at a step boundary, and with overlapping iterations
        that boundary comes before the step's optimizer work has run: torch's "scheduler before
        optimizer" warning (for scripts that order the two wrongly) does not apply, so the flag
        it reads is set here."""
        with self.hyperparams_lock:
            self.optimizer._opt_called = True  # type: ignore[attr-defined]
            scheduler.step(**kwargs)

    def note_step_applied(self) -> None:
        """The engine closed a step that applies (its optimizer work may still be running in the
        background): set the flag torch's LR schedulers read to warn that the scheduler stepped
        before the optimizer, so a scheduler the user built on the client's optimizer and steps
        after ``engine.step()`` (as under DeepSpeed) does not warn."""
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    def snapshot(self) -> list[dict[str, Any]]:
        """The hyper-parameters of every group now (frozen into a step when it is issued)."""
        with self.hyperparams_lock:
            return snapshot_groups(self.optimizer)

    # --- DeepSpeed / torch surface -------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def empty(self) -> bool:
        """No parameter to step: the forward-only engine's (``initialize`` without an
        optimizer; optim/build.py's ``NoOptimizer``)."""
        return not self.optimizer.param_groups

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.cur_scale

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.cur_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: the engine owns gradient buffers and clears them after each step."""

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        raise RuntimeError(
            "call engine.step() (DeepSpeed semantics): rp_engine steps the optimizer itself, "
            "layer by layer, at the gradient-accumulation boundary"
        )

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
        _resync_cpu_adam(self.optimizer)

    # --- stepping (called by the optimizer worker) -------------------------------------------
    @torch.no_grad()
    def step_params(
        self,
        params: Sequence[torch.Tensor],
        *,
        groups: list[dict[str, Any]],
        grad_coef: float,
        publish: Callable[[torch.Tensor], torch.Tensor] | None = None,
        predict: str | None = None,
        delay: DelayCompensation | None = None,
        fix_coef: float = 1.0,
    ) -> None:
        """Step ``params`` (masters with ``.grad``; None = not stepped) with ``groups``.

        ``grad_coef`` (unscale x clip) scales the gradients in place. With CPU Adam it is applied
        slice by slice right before each slice's update, while it is hot in cache: the gradients
        are never traversed a second time for clipping.

        ``publish(master)``: the compute weight to write each master's new value into (the
        stepper's publish of the new version, ``HostStore.publishing``), or None. With CPU Adam
        each slice is written right after its update, while the slice is still in cache: the
        cast of the masters, or a weight prediction one more Adam step ahead with the step's
        own hyper-parameters (``predict``, ``roundpipe.staleness_compensation``): "predict"
        along the moments the update just made (``predict_into``), "lookahead" along the
        moments the next update would make if its gradient repeated this one
        (``_lookahead_terms``). Every param gets its compute weight written, stepped or not (a
        param without a gradient is extrapolated along its moments, there being no gradient to
        repeat).

        ``delay`` (with ``publish`` and CPU Adam; ``predict`` "lookahead_dc"): each slice's
        gradient is delay-compensated right before its Adam update (optim/
        delay_compensation.py), from the compute weights ``publish`` is about to overwrite,
        which must hold the weights the gradient was taken at (the stepper's double-buffered
        publish). ``fix_coef``: the clip coefficient inside ``grad_coef`` (``grad_coef`` times
        the loss scale). Compensation, Adam and look-ahead then run as one pass per cache-sized
        block (``adam_step``, publish_kernel.py): DeepSpeed's ``adam_update`` cannot share its
        loop, and three passes cost 2x the plain step (benchmarks/RESULTS.md). That Adam is
        DeepSpeed's formula in DeepSpeed's order, equal to its ``adam_update`` to fp32
        rounding, not bit for bit: the compensated gradients have no uncompensated reference
        to be bit-identical to.
        """
        if predict not in PREDICTIONS:
            raise ValueError(f"predict {predict!r}: expected one of {PREDICTIONS}")
        if delay is not None and (publish is None or predict != "lookahead_dc"):
            raise ValueError('delay compensation needs publish and predict "lookahead_dc"')
        live = [p for p in params if p.grad is not None]
        if self.per_layer:
            self._cpu_adam_step(live, groups, grad_coef, publish, predict, delay, fix_coef)
        else:
            if grad_coef != 1.0:
                for p in live:
                    p.grad.mul_(grad_coef)  # type: ignore[union-attr]
            self._torch_step(groups)
        if publish is not None:
            written = {id(p) for p in live} if self.per_layer else set()
            for p in params:
                if id(p) not in written:
                    dst = publish(p)
                    if not (predict and self.predict_into(p, dst, groups)):
                        write_copy(p, dst)
        # torch's LR schedulers check this flag (set by their wrapper of optimizer.step, which
        # the per-layer path does not call) to warn about stepping the scheduler first.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    def _cpu_adam_step(
        self,
        params: Iterable[torch.Tensor],
        groups: list[dict[str, Any]],
        grad_coef: float,
        publish: Callable[[torch.Tensor], torch.Tensor] | None,
        predict: str | None,
        delay: DelayCompensation | None = None,
        fix_coef: float = 1.0,
    ) -> None:
        inner: Any = self.optimizer
        for p in params:
            g = groups[self._group_of[id(p)]]
            state = inner.state[p]
            if len(state) == 0:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["step"] += 1
            assert p.grad is not None  # ``live``: the params with a gradient
            tensors: tuple[torch.Tensor, ...] = (
                p.data,
                p.grad.data,
                state["exp_avg"],
                state["exp_avg_sq"],
            )
            terms = dc = None
            if publish is not None:
                tensors += (publish(p),)
                if predict == "predict":
                    terms = self._prediction_terms(p, g)
                elif predict in ("lookahead", "lookahead_dc"):
                    terms = self._lookahead_terms(p, g)
                if delay is not None:
                    dc = delay.terms(p, state["step"] - 1, g, fix_coef)
            w_sq_sum = 0.0  # the masters' squared sum before the step: the tensor's scale
            # the compensation keeps norms per block of the tensor: slices of whole blocks
            size = self.slice_elems if dc is None else max(1, self.slice_elems // BLOCK) * BLOCK
            adam = None if dc is None else self._adam_terms(g, int(state["step"]))
            for param, grad, exp_avg, exp_avg_sq, *out in _slices(tensors, size):
                if grad_coef != 1.0:
                    grad.mul_(grad_coef)
                if dc is not None and adam is not None:
                    # compensation (out[0] still holds the weights the gradient was taken at),
                    # Adam and look-ahead in one pass over the slice (``adam_step``)
                    w_sq_sum += adam_step(
                        grad, param, exp_avg, exp_avg_sq, out[0], adam=adam, block=BLOCK,
                        delay=(dc.vcoef, dc.eps, dc.h),
                        publish=None if terms is None else "lookahead", terms=terms,
                    )[2]  # fmt: skip
                    continue
                self._adam_update(
                    g, state, (param, grad, exp_avg, exp_avg_sq, *out), predict, terms
                )
            if dc is not None and delay is not None:
                delay.record(p, w_sq_sum)

    def _adam_update(
        self, g: dict[str, Any], state: dict[str, Any], tensors: tuple[torch.Tensor, ...],
        predict: str | None, terms: dict[str, float] | None,
    ) -> None:  # fmt: skip
        """One call of DeepSpeed's own C++ kernel on ``tensors`` (param, grad, exp_avg,
        exp_avg_sq, and the compute weight to publish into, if any), with DeepSpeedCPUAdam.step's
        arguments: without the GIL (nogil_adam.py), or through its binding, holding the GIL for
        this slice; then the slice's publish while it is in cache (``step_params``)."""
        inner: Any = self.optimizer
        param, grad, exp_avg, exp_avg_sq, *out = tensors
        beta1, beta2 = g["betas"]
        update = inner.ds_opt_adam.adam_update if self._nogil is None else self._nogil.update
        update(
            inner.opt_id, state["step"], g["lr"], beta1, beta2, g["eps"],
            g["weight_decay"], g["bias_correction"], param, grad, exp_avg, exp_avg_sq,
        )  # fmt: skip
        if not out:
            return
        if terms is None:
            write_copy(param, out[0])
        elif predict == "predict":
            write_prediction(param, exp_avg, exp_avg_sq, out[0], **terms)
        else:
            write_lookahead(param, grad, exp_avg, exp_avg_sq, out[0], **terms)

    @torch.no_grad()
    def step_segments(
        self,
        segments: Sequence[StateSegment],
        *,
        groups: list[dict[str, Any]],
        grad_coef: float,
        publish: Callable[[torch.Tensor], torch.Tensor] | None = None,
        predict: str | None = None,
    ) -> None:
        """``step_params`` for parts of masters (a sliced optimizer tier): each segment's
        elements stepped by CPU Adam with ``groups``, its gradient (the master's ``.grad``,
        whole) scaled by ``grad_coef`` there, and with ``publish`` its compute weight's
        elements written right after (``predict``: as in ``step_params``; a master without a
        gradient gets the cast or the prediction only). A master's step count advances at its
        segment starting at element 0, so its segments must come in order, all in one step.
        Bit-identical to ``step_params`` on whole tensors: Adam is elementwise and segment
        bounds are multiples of the kernel's SIMD span. No delay compensation (it needs the
        whole tensor's norms)."""
        if not self.per_layer or predict not in (None, "predict", "lookahead"):
            raise ValueError(
                f"stepping state segments needs DeepSpeed CPU Adam and predict in "
                f"(None, 'predict', 'lookahead'), not predict={predict!r}"
            )
        inner: Any = self.optimizer
        for seg in segments:
            p = seg.master
            g = groups[self._group_of[id(p)]]
            out = None if publish is None else publish(p).view(-1)[seg.start : seg.stop]
            state = inner.state[p]
            if p.grad is None:
                if out is None:
                    continue
                terms = self._prediction_terms(p, g) if predict and self.can_predict else None
                if terms is None:
                    write_copy(seg.w, out)
                else:
                    write_prediction(seg.w, seg.exp_avg, seg.exp_avg_sq, out, **terms)
                continue
            if seg.start == 0:
                state["step"] += 1
            terms = None
            if out is not None and predict == "predict":
                terms = self._prediction_terms(p, g)
            elif out is not None and predict == "lookahead":
                terms = self._lookahead_terms(p, g)
            grad = p.grad.view(-1)[seg.start : seg.stop]
            tensors = (seg.w, grad, seg.exp_avg, seg.exp_avg_sq) + (() if out is None else (out,))
            for part in _slices(tensors, self.slice_elems):
                if grad_coef != 1.0:
                    part[1].mul_(grad_coef)
                self._adam_update(g, state, part, predict, terms)
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    def _adam_terms(self, g: dict[str, Any], step: int) -> AdamTerms:
        """Step ``step``'s scalars with group hyper-parameters ``g``, folded as DeepSpeed's CPU
        Adam folds them (``AdamTerms``)."""
        lr, wd = float(g["lr"]), float(g["weight_decay"])
        beta1, beta2 = g["betas"]
        bc1 = 1.0 - beta1**step if g["bias_correction"] else 1.0
        bc2 = 1.0 / math.sqrt(1.0 - beta2**step) if g["bias_correction"] else 1.0
        return AdamTerms(
            b1=float(beta1), b2=float(beta2), step_size=-lr / bc1, bc2=bc2, eps=float(g["eps"]),
            w_decay=-lr * wd if wd > 0 and self._adamw else 0.0,
            l2=wd if wd > 0 and not self._adamw else 0.0,
        )  # fmt: skip

    @property
    def can_predict(self) -> bool:
        """Whether ``predict_into`` extrapolates (DeepSpeed CPU Adam/AdamW, per layer): the
        weight prediction of ``roundpipe.staleness_compensation`` needs Adam's moments."""
        return self.per_layer and hasattr(self.optimizer, "ds_opt_adam")

    def _prediction_terms(self, master: torch.Tensor, g: dict[str, Any]) -> dict[str, float] | None:
        """``decay``, ``coef`` and ``eps`` of ``write_prediction`` for one more Adam step of
        ``master`` with group hyper-parameters ``g`` along its moments now; None when there is
        nothing to extrapolate along (no Adam state yet) or the step would move nothing (LR 0).

        With moments m, v after s applied steps, the next step's moments for a gradient equal to
        m_hat = m / (1 - b1^s) are m', v' with m'/(1 - b1^(s+1)) = m_hat and v'/(1 - b2^(s+1)) =
        v_hat: the next step's bias-corrected moments are this step's, so the predicted weight is
        ``w (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)`` (AdamW's decoupled decay; with Adam's
        L2 mode the decay is already inside the gradients m averages). m_hat / (sqrt(v_hat) +
        eps) = (sqrt(bc2) / bc1) m / (sqrt(v) + eps sqrt(bc2)): two scalars fold the bias
        corrections."""
        state = self.optimizer.state.get(master)
        if not state or int(state.get("step", 0)) == 0 or float(g["lr"]) == 0.0:
            return None
        return self._step_terms(g, int(state["step"]))

    def _step_terms(self, g: dict[str, Any], step: int) -> dict[str, float]:
        """``decay``, ``coef`` and ``eps`` of one Adam step with bias corrections of ``step``
        and group hyper-parameters ``g`` (see ``_prediction_terms``)."""
        lr = float(g["lr"])
        beta1, beta2 = g["betas"]
        bc1 = 1.0 - beta1**step if g["bias_correction"] else 1.0
        rbc2 = math.sqrt(1.0 - beta2**step if g["bias_correction"] else 1.0)
        wd = float(g["weight_decay"])
        return {
            "decay": 1.0 - lr * wd if wd > 0 and self._adamw else 1.0,
            "coef": -lr * rbc2 / bc1,
            "eps": float(g["eps"]) * rbc2,
        }

    @property
    def _adamw(self) -> bool:
        return bool(getattr(self.optimizer, "adam_w_mode", True))

    def _lookahead_terms(self, master: torch.Tensor, g: dict[str, Any]) -> dict[str, float] | None:
        """``write_lookahead``'s scalars for the step after the one ``master`` has just applied
        (its state counts it), with group hyper-parameters ``g``: that step's bias corrections
        folded as in ``_prediction_terms``, the betas, and Adam's L2 decay (0 for AdamW, whose
        decay is the ``decay`` factor). None at LR 0 (the step would move nothing)."""
        state = self.optimizer.state.get(master)
        if not state or float(g["lr"]) == 0.0:
            return None
        beta1, beta2 = g["betas"]
        wd = float(g["weight_decay"])
        return {
            **self._step_terms(g, int(state.get("step", 0)) + 1),
            "b1": float(beta1),
            "b2": float(beta2),
            "l2": wd if wd > 0 and not self._adamw else 0.0,
        }

    @torch.no_grad()
    def predict_into(
        self, master: torch.Tensor, dst: torch.Tensor, groups: list[dict[str, Any]]
    ) -> bool:
        """Write into ``dst`` (the compute weight: bf16, fp16 or fp32) the weights one more Adam
        step of ``master`` with ``groups``'s hyper-parameters would give if its gradient equalled
        the bias-corrected mean of the ones so far (SpecTrain-style weight prediction; the terms:
        ``_prediction_terms``); True when it did, False when ``dst`` was left alone (no Adam
        state yet, LR 0, or not CPU Adam: the caller copies the master). Under a constant
        gradient stream it is exactly that step's result, to fp32 rounding. Reads ``master`` and
        the moments once and changes neither: the prediction exists only in ``dst``. Must run
        where the moments hold their values (``HostStore.resident``). The stepper's fused path
        (``step_params`` with ``publish``) writes the same values slice by slice."""
        if not self.can_predict:
            return False
        terms = self._prediction_terms(master, groups[self._group_of[id(master)]])
        if terms is None:
            return False
        state = self.optimizer.state[master]
        tensors = (master, state["exp_avg"], state["exp_avg_sq"], dst)
        for w, m, v, out in _slices(tensors, PREDICT_CHUNK):
            write_prediction(w, m, v, out, **terms)
        return True

    def _torch_step(self, groups: list[dict[str, Any]]) -> None:
        # Step with the snapshot, then put back whatever the LR scheduler has set since: torch's
        # chainable schedulers read the current group lr, so it must not be rewound.
        with self.hyperparams_lock:  # see __init__: the scheduler waits for this step
            live_groups = self.optimizer.param_groups
            current = snapshot_groups(self.optimizer)
            for live, frozen in zip(live_groups, groups, strict=True):
                live.update(frozen)
            try:
                (self._step_fn or self.optimizer.step)()
            finally:
                for live, now in zip(live_groups, current, strict=True):
                    live.update(now)


# ``step_params``'s ``predict``: what each slice's publish writes (None: the masters' cast)
PREDICTIONS = (None, "predict", "lookahead", "lookahead_dc")

# Elements per call of the publish kernel outside that loop (``predict_into``): its torch
# fallback's temporaries stay bounded.
PREDICT_CHUNK = 1 << 18


def _slices(tensors: tuple[torch.Tensor, ...], size: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """Matching flat slices of at most ``size`` elements of same-shaped tensors.

    Non-contiguous tensors cannot be sliced into views the kernel writes through (it would update
    a contiguous copy): they come back whole, as DeepSpeedCPUAdam would pass them.
    """
    n = tensors[0].numel()
    if n <= size or not all(t.is_contiguous() for t in tensors):
        yield tensors
        return
    flat = [t.view(-1) for t in tensors]
    for start in range(0, n, size):
        yield tuple(t[start : start + size] for t in flat)


def _resync_cpu_adam(inner: Any) -> None:
    """Bring DeepSpeed CPU Adam's C++ bias-correction cache to the loaded step, bit-exactly.

    The kernel keeps beta^t per optimizer and updates it by one multiplication per step; a fresh
    optimizer asked for step t computes ``pow(beta, t)`` instead, which can differ in the last
    bit, and so would every update after a resume. Replaying steps 1..t on empty tensors rebuilds
    the cache exactly as training did (microseconds per step; nothing else is touched).
    """
    kernel = getattr(inner, "ds_opt_adam", None)
    steps = [int(s["step"]) for s in inner.state.values() if "step" in s]
    if kernel is None or not steps or not inner.param_groups:
        return
    g = inner.param_groups[0]  # one C++ state per optimizer: the betas of the first group
    beta1, beta2 = g["betas"]
    empty = torch.empty(0, dtype=torch.float32)
    for step in range(1, max(steps) + 1):
        kernel.adam_update(
            inner.opt_id, step, g["lr"], beta1, beta2, g["eps"], g["weight_decay"],
            g["bias_correction"], empty, empty, empty, empty,
        )  # fmt: skip
