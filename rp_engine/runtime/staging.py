"""Reusable host staging buffers for gradient downloads that cannot land in their fp32 buffer.

A step's first contribution of a gradient is copied straight into its fp32 arena buffer
(``HostStore.announce``). A later one (a tied weight's second use, a later round's gradients)
and the per-parameter norm vectors come down into host memory of their own, which the HOST
worker adds up and is then done with. ``HostStaging`` keeps that memory: one pool per device,
free buffers by exact (numel, dtype), allocated by ``Device.host_buffer`` (pinned on CUDA, exact
size). The pool only grows when every buffer of a size is in flight, so it is bounded by the
most downloads in flight at once, and once the steps repeat they allocate nothing.

Lifecycle of a buffer: ``take`` (the D2H closure, before issuing the copy into it) -> ``give``
(the HOST worker, once the copy is done and the host has read it). A download or accumulation
that fails does not give its buffers back: a copy into them may still be running. They stay
out until ``reclaim`` (after ``Device.reset`` drained the device: nothing writes them any more),
which puts every buffer not given back on the free lists; nothing is ever freed while out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch

__all__ = ["HostStaging"]


class HostStaging:
    """Host buffers of one device, reused across downloads and steps. Thread-safe.

    ``alloc(numel, dtype)``: a flat host tensor of exactly ``numel`` elements that the device's
    ``to_host`` can copy into (``Device.host_buffer``). ``budget``: bytes the pool may hold (0:
    no bound); see ``take``.
    """

    def __init__(
        self, alloc: Callable[[int, torch.dtype], torch.Tensor], *, budget: int = 0
    ) -> None:
        self._alloc = alloc
        self.budget = budget
        self._cond = threading.Condition()  # the state below, and ``take``'s waits
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._out: dict[int, torch.Tensor] = {}  # id(buffer) -> buffer taken, not given back
        self._holder: dict[int, int] = {}  # id(buffer) -> id of its holder (``take``)
        self._held = 0  # bytes of the buffers the pool holds, free or out
        self.allocated_bytes = 0  # every buffer this pool allocated (never decreases)
        self.waits = 0  # ``take`` calls that waited for the budget

    def take(self, numel: int, dtype: torch.dtype, *, holder: object = None) -> torch.Tensor:
        """A flat buffer of ``numel`` elements of ``dtype`` that nobody else holds or writes:
        a free one if there is one, else a new one. Uninitialised (contents of an earlier use).

        With a ``budget``, a new buffer that would take the pool past it drops free buffers
        of other sizes first, then waits until buffers of other holders are given back
        (``holder``: the download taking it; its own buffers come back only after it, so it
        never waits for them, and a lone holder may pass the budget rather than stop: the
        bound then is one download's gradients)."""
        key = (numel, dtype)
        nbytes = numel * dtype.itemsize
        mine = id(holder)
        buf: torch.Tensor | None
        with self._cond:
            while True:
                free = self._free.get(key)
                if free:
                    buf = free.pop()
                    break
                if not self.budget or self._held + nbytes <= self.budget:
                    buf = None
                    break
                self._drop_free()
                if self._held + nbytes <= self.budget:
                    continue
                if not any(h != mine for h in self._holder.values()):
                    buf = None  # nothing of another holder to wait for
                    break
                self.waits += 1
                self._cond.wait(timeout=1.0)
            if buf is None:
                self._held += nbytes  # reserved before the slow allocation, outside the lock
        if buf is None:
            try:
                buf = self._alloc(numel, dtype)
            except BaseException:
                with self._cond:
                    self._held -= nbytes
                    self._cond.notify_all()
                raise
            with self._cond:
                self.allocated_bytes += buf.numel() * buf.element_size()
        with self._cond:
            self._out[id(buf)] = buf
            self._holder[id(buf)] = mine
        return buf

    def _drop_free(self) -> None:
        """Under the lock: let every free buffer go (its memory back to the allocator)."""
        for free in self._free.values():
            self._held -= sum(b.numel() * b.element_size() for b in free)
        self._free.clear()

    def give(self, buffers: Iterable[torch.Tensor]) -> None:
        """These buffers (as ``take`` returned them) are read and no copy writes them any
        more: free for the next ``take``. Giving back one that is not out is a no-op."""
        with self._cond:
            for buf in buffers:
                if self._out.pop(id(buf), None) is not None:
                    self._holder.pop(id(buf), None)
                    self._free.setdefault((buf.numel(), buf.dtype), []).append(buf)
            self._cond.notify_all()

    def reclaim(self) -> None:
        """Every buffer not given back is free again. Call it only once no copy can still write
        them and nothing will read them (after ``Device.reset`` drained the device)."""
        with self._cond:
            out, self._out = list(self._out.values()), {}
            self._holder.clear()
            for buf in out:
                self._free.setdefault((buf.numel(), buf.dtype), []).append(buf)
            self._cond.notify_all()

    def out(self) -> int:
        """How many buffers are taken and not given back."""
        with self._cond:
            return len(self._out)

    def held_bytes(self) -> int:
        """Bytes of every buffer the pool holds, free or out."""
        with self._cond:
            bufs = [*self._out.values(), *(b for free in self._free.values() for b in free)]
        return sum(b.numel() * b.element_size() for b in bufs)

    def clear(self) -> None:
        """Drop the free buffers (their memory goes back); buffers out stay out, as above."""
        with self._cond:
            self._drop_free()
