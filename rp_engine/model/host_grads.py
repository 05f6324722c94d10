"""The gradient side of the host store (host_store.py): each trainable parameter's fp32
gradient buffer in the store's arena (``GradBuffers``, grad_buffers.py) and the protocol that
fills it. ``HostGrads`` owns the per-layer locks, the announced contributions and the direct
landings (``announce`` / ``fenced`` / ``land`` / ``withdraw``), the host-side adds
(``accumulate``, ``grad_slot``), the step's lifecycle (``seal_grads``, ``attach_grads``,
``release_grads``, ``zero_grads``) and the squared norms (``note_sq_norm``, ``grad_sq_norm``).
It shares nothing with the weights and versions but the layers and their masters: the store
builds one and delegates its gradient methods to it, so callers keep calling the store.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from rp_engine.model.grad_buffers import GradBuffers
from rp_engine.model.host_layers import HostLayer, HostParam
from rp_engine.model.sq_norm import sq_norm

if TYPE_CHECKING:
    from rp_engine.device.base import Event

__all__ = ["GradLanding", "HostGrads"]


@dataclass(eq=False)
class GradLanding:
    """One announced contribution to a parameter's current-step gradient (``announce``).

    ``target`` is where its device copy lands when it is the step's first contribution: a view
    of the fp32 buffer (for a 2-byte gradient, the upper half of the buffer's bytes, widened in
    place by ``land``). None: the copy goes to memory of the caller's own, which it then hands
    to ``accumulate(..., landing=)``.
    """

    param: nn.Parameter
    slot: int
    layer: int  # the owner layer (its lock guards the landing)
    dtype: torch.dtype
    target: torch.Tensor | None = None
    copy: int = 0  # the arena copy ``target`` lies in
    fence: Event | None = None  # done when the copy into ``target`` is (``fenced``)
    settled: bool = False  # landed or withdrawn


class HostGrads:
    """The gradients of a host store's ``layers``: ``owner`` maps ``id(parameter)`` to the
    ``HostParam`` that owns it, ``grads`` is the store's ``GradBuffers``. Thread-safe: each
    layer's lock guards its parameters' buffers and landings."""

    def __init__(
        self, layers: list[HostLayer], owner: dict[int, HostParam], grads: GradBuffers
    ) -> None:
        self.layers = layers
        self._owner = owner
        self.grads = grads
        self._grad_locks = [threading.Lock() for _ in self.layers]
        # per layer, on its grad lock: woken when a direct landing is fenced, landed or withdrawn
        self._grad_conds = [threading.Condition(lock) for lock in self._grad_locks]
        # per slot: contributions announced but not yet landed, accumulated or withdrawn
        slots = sum(len(layer.owned) for layer in self.layers)
        self._announced: list[set[GradLanding]] = [set() for _ in range(slots)]
        self._direct: dict[int, GradLanding] = {}  # slot -> its direct landing not landed yet
        self._noted: dict[tuple[int, int], float] = {}  # (layer, step) -> note_sq_norm's value

    # --- gradients (master.grad is the buffer from a step's first contribution until the step
    # is consumed or discarded, None otherwise) ------------------------------------------------
    def accumulate(
        self, param: nn.Parameter, grad: torch.Tensor, *, landing: GradLanding | None = None
    ) -> bool:
        """Add a downloaded gradient into the owner's fp32 buffer (called on a host thread);
        returns whether it was the step's first contribution.

        The step's first contribution is copied (converted) into the buffer, later ones are added
        through a per-thread conversion scratch: no gradient-sized allocation. Several devices'
        download threads may add into one buffer at once (a tied weight, or the same stage of
        two rounds): the owner layer's lock makes each add whole. A direct landing announced
        before (``announce``) is the first contribution: this waits for its copy and lands it.
        ``landing``: the announcement of this contribution (its ``target`` None), now settled.
        """
        owner = self._owner[id(param)]
        cond = self._grad_conds[owner.layer]
        with cond:
            try:
                self._settle_direct(owner.slot, cond)
                first = not self.grads.has(owner.slot)
                self.grads.write(owner.slot, grad)
            finally:
                if landing is not None:
                    self._announced[owner.slot].discard(landing)
                    landing.settled = True
            if first:
                self._expose(owner)
        return first

    # --- direct landings: a first contribution copied by the device straight into its buffer
    def announce(self, param: nn.Parameter, grad: torch.Tensor, *, free: bool) -> GradLanding:
        """Announce one contribution to the parameter's current-step gradient, ``grad`` (on any
        device: only its dtype and shape are read), before its download is issued (on the copy
        thread). Every announcement ends in exactly one of
        ``land`` (a direct landing), ``accumulate(..., landing=)`` or ``withdraw``;
        ``zero_grads`` forgets the ones left over by a failed run.

        It lands directly (``target`` set) when it is the step's first contribution: none has
        landed and none is announced and still unsettled (one announced earlier stays first, as
        before), the gradient has the parameter's shape and a dtype that can land
        (``GradBuffers.landing``), and ``free``: the caller knows the buffer may take this
        step's gradient now (the optimizer is done reading the previous step's from it). Then issue the copy into ``target``, call
        ``fenced`` with an event completed after it, and ``land`` once that event is done; a
        contribution accumulated meanwhile waits for that event and lands it first itself.
        """
        owner = self._owner[id(param)]
        slot = owner.slot
        landing = GradLanding(param, slot, owner.layer, grad.dtype)
        fits = grad.shape == owner.master.shape  # else ``write`` names the mismatch
        with self._grad_locks[owner.layer]:
            if free and fits and not self.grads.has(slot) and not self._announced[slot]:
                landing.target = self.grads.landing(slot, grad.dtype)
                if landing.target is not None:
                    landing.copy = self.grads.current(slot)
                    self._direct[slot] = landing
            self._announced[slot].add(landing)
        return landing

    def fenced(self, landings: Iterable[GradLanding], fence: Event) -> None:
        """The copies into these direct landings were issued; ``fence`` completes after them."""
        for landing in landings:
            cond = self._grad_conds[landing.layer]
            with cond:
                landing.fence = fence
                cond.notify_all()

    def land(self, landing: GradLanding) -> None:
        """The copy into a direct landing is complete (its fence is done): it becomes the
        step's first contribution, unless a contribution that came meanwhile landed it first."""
        cond = self._grad_conds[landing.layer]
        with cond:
            if self._direct.get(landing.slot) is landing:
                self._land_locked(landing, cond)

    def withdraw(self, landings: Iterable[GradLanding]) -> None:
        """These announced contributions will not land (their download failed): forget them.
        A direct copy that was issued may still write into its buffer; the run failed, so the
        caller discards the step's gradients (``zero_grads``)."""
        for landing in landings:
            cond = self._grad_conds[landing.layer]
            with cond:
                if not landing.settled:
                    landing.settled = True
                    self._announced[landing.slot].discard(landing)
                    if self._direct.get(landing.slot) is landing:
                        del self._direct[landing.slot]
                        self.grads.unland(landing.slot, landing.copy)
                cond.notify_all()

    def _settle_direct(self, slot: int, cond: threading.Condition) -> None:
        """Holding the owner's lock: land the slot's pending direct landing (waiting, without
        the lock, for its copy) so that what follows finds the first contribution in place."""
        while (direct := self._direct.get(slot)) is not None:
            fence = direct.fence
            if fence is None:  # its copy is being issued: ``fenced`` or ``withdraw`` follows
                cond.wait()
                continue
            cond.release()
            try:
                fence.synchronize()  # the copy failed: raises (the run fails)
            finally:
                cond.acquire()
            if self._direct.get(slot) is direct:
                self._land_locked(direct, cond)

    def _land_locked(self, landing: GradLanding, cond: threading.Condition) -> None:
        self.grads.land(landing.slot, landing.copy, landing.dtype)
        del self._direct[landing.slot]
        self._announced[landing.slot].discard(landing)
        landing.settled = True
        if landing.copy == self.grads.current(landing.slot):
            self._expose(self._owner[id(landing.param)])
        cond.notify_all()

    def grad_buffer(self, param: nn.Parameter) -> torch.Tensor:
        """The fp32 buffer receiving the parameter's current-step gradient: a fixed view into an
        arena (double-buffered: one of two fixed views, alternating with each sealed step). Write
        it via ``grad_slot``, which also says whether to copy or add."""
        return self.grads.buffer(self._owner[id(param)].slot)

    @contextmanager
    def grad_slot(self, param: nn.Parameter) -> Iterator[tuple[torch.Tensor, bool]]:
        """Write a contribution into the fp32 buffer yourself: yields ``(buffer, first)``.

        Holds the owner layer's lock for the block. ``first`` means no contribution landed yet
        this step: the caller must *overwrite* the buffer (copy), otherwise *add* to it. The write
        must be complete when the block exits (synchronise a device copy first); the parameter
        then counts as contributed. If the block raises, nothing is recorded (a half-written
        first copy is ignored, since the next contribution overwrites it again).
        """
        owner = self._owner[id(param)]
        cond = self._grad_conds[owner.layer]
        with cond:
            self._settle_direct(owner.slot, cond)
            with self.grads.writing(owner.slot) as (buf, first):
                yield buf, first
            if first:
                self._expose(owner)

    def _expose(self, owner: HostParam) -> None:
        # Single-buffered, master.grad shows the buffer as soon as it holds a gradient. Double-
        # buffered, only the optimizer sets it (attach_grads): step t+1's contributions must not
        # swap the tensor under step t's optimizer.
        if self.grads.copies == 1:
            owner.master.grad = self.grads.buffer(owner.slot)

    @property
    def double_buffered(self) -> bool:
        return self.grads.copies == 2

    def has_grad(self, param: nn.Parameter) -> bool:
        """Whether the parameter received a gradient contribution in the current step."""
        return self.grads.has(self._owner[id(param)].slot)

    def seal_grads(self, layer: int) -> None:
        """The layer's gradients for the current step are complete (after ``grad_sq_norm``):
        the optimizer will read them; double-buffered, new contributions go to the other arena
        (the caller must not contribute again before the optimizer released that one)."""
        with self._grad_locks[layer]:
            for hp in self.layers[layer].owned:
                self.grads.seal(hp.slot)

    def attach_grads(self, layers: Iterable[int] | None = None) -> None:
        """Set ``master.grad`` for the optimizer from the sealed step: its buffer, a zero-filled
        buffer for a parameter that had gradients in earlier steps but none in that one, None if
        it never had any (it is not stepped). Called by the optimizer worker before stepping."""
        for index in range(len(self.layers)) if layers is None else layers:
            self.attach_param_grads(self.layers[index].owned)

    def attach_param_grads(self, owned: Iterable[HostParam]) -> None:
        """``attach_grads`` for these parameters only (a sliced optimizer tier steps a layer
        piece by piece, so that only a piece's gradient record is pinned at a time)."""
        for hp in owned:
            hp.master.grad = self.grads.attach(hp.slot)

    def release_grads(self, layers: Iterable[int]) -> None:
        """The optimizer has consumed the sealed step of ``layers``: forget those gradients (no
        memory is touched; the next contribution to that buffer is copied in)."""
        for index in layers:
            self.release_param_grads(index, self.layers[index].owned)

    def release_param_grads(self, layer: int, owned: Sequence[HostParam]) -> None:
        """``release_grads`` for these parameters of ``layer`` only, each once per step."""
        with self._grad_locks[layer]:
            self.grads.release([hp.slot for hp in owned])
        for hp in owned:
            hp.master.grad = None

    def zero_grads(self, layers: Iterable[int] | None = None) -> None:
        """Discard every gradient of ``layers`` (all by default), sealed or accumulating: the
        next contribution is copied in, so no memory is touched; ``master.grad`` becomes None."""
        for index in range(len(self.layers)) if layers is None else layers:
            owned = self.layers[index].owned
            cond = self._grad_conds[index]
            with cond:
                self.grads.clear([hp.slot for hp in owned])
                for key in [k for k in self._noted if k[0] == index]:
                    del self._noted[key]
                for hp in owned:  # a failed run's announcements will never settle
                    for landing in self._announced[hp.slot]:
                        landing.settled = True
                    self._announced[hp.slot].clear()
                    self._direct.pop(hp.slot, None)
                cond.notify_all()
            for hp in owned:
                hp.master.grad = None

    def note_sq_norm(self, layer: int, step: int, sq_norm: float) -> None:
        """Record the squared norm of the layer's complete gradient of step ``step``, computed on
        the device that downloaded it whole (runtime/grad_norm.py), for ``take_sq_norm``: call it
        after the layer's last contribution, just before reporting the layer ready. Keyed by
        step: with overlapping iterations the next step's note may come first."""
        with self._grad_locks[layer]:
            self._noted[(layer, step)] = sq_norm

    def take_sq_norm(self, layer: int, step: int) -> float | None:
        """The squared norm noted for the layer's gradient of step ``step`` (forgotten now), or
        None when there is none: then ``grad_sq_norm`` reads the fp32 buffers."""
        with self._grad_locks[layer]:
            return self._noted.pop((layer, step), None)

    def grad_sq_norm(self, layer: int) -> float:
        """Sum of squared fp32 gradients the layer owns (inf/nan propagate); a parameter without a
        contribution this step counts as a zero gradient. A full read of the layer's buffers:
        prefer a noted device-side norm (``take_sq_norm``) when there is one."""
        total = 0.0
        for hp in self.layers[layer].owned:
            if self.grads.has(hp.slot):
                # one read of the gradient, no temporary copy; float64 to fp32 rounding
                with self.grads.reading(hp.slot) as buf:
                    total += sq_norm(buf)
        return total
