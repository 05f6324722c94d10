"""A pool of aligned host buffers caching the fixed records of one swap file.

Both NVMe tiers keep their state as records at fixed offsets of a swap file and move them through
a few aligned buffers: the optimizer tier (optimizer_tier.py: a layer's fp32 masters and Adam
moments) and the parameter tier (param_tier.py: a layer's compute weights, one record per weight
buffer). The pool owns the caching rules they share:

- ``pin(records)`` makes every record of the set resident in a buffer at once (reading the ones
  no buffer holds) and returns their bytes; the set is pinned atomically, so two holders can never
  each hold part of what the other waits for. A buffer that still holds a record is reused
  without a read (a hit).
- ``unpin(records, dirty=)``: the last holder of a dirty buffer starts its write-back; a later
  read of that record, or a reuse of the buffer, waits for the write first.
- ``unpin_after(records, event)``: the same once a device event completed (an upload still
  copying from the buffer), reaped lazily when a buffer is needed or ``flush``.
- ``prefetch(records)``: a non-blocking hint that starts reads into free buffers, in order,
  always leaving one buffer unclaimed.

``grow``: when one ``pin`` asks for more records than there are buffers, the pool grows to that
many (the parameter tier pins a whole slot's layers for one upload, a size known only to the
plan); otherwise such a ``pin`` is an error.

Two size classes (``size_classes``, plan/host_ram.py): records up to twice the median's share
``buffer_count`` buffers of the largest of them; the few larger ones (an embedding, an LM head:
often 10x a decoder layer) get two buffers of their own size. So the pool's memory follows the
ordinary layers, not the largest tensor. A record only ever uses a buffer of its class; a
``pin`` of several records claims them all at once, across both classes, under one lock.

``lazy`` (the gradient tier, grad_tier.py: scratch that mostly never needs the disk): a changed
record is written back only when its buffer is taken for another record (an eviction, LRU among
the unpinned buffers), never at its last unpin nor at ``flush``; ``discard`` forgets a record
whose bytes are no longer needed, so it is never written at all. ``try_pin`` pins a record only
when that needs no wait (it is held, or a clean buffer is free). ``alloc(nbytes)``: the buffers'
allocator (default the engine's aligned one; the gradient tier's CUDA pool passes pinned memory).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from rp_engine.plan.host_ram import PoolSizes
from rp_engine.storage.io_engine import IOEngine, IOStats
from rp_engine.storage.swap_file import SwapFile

__all__ = ["PooledTier", "Record", "RecordPool"]


@dataclass(eq=False)
class Record:
    """``nbytes`` (a 4 KiB multiple) at ``offset`` of the pool's file; ``key`` is the owner's.
    ``extents``: when set, the record is these (file offset, bytes) pieces instead (4 KiB
    multiples, summing to ``nbytes``), laid end to end in its buffer: a slice of a layer whose
    state is spread over the file (optimizer_tier.py's sliced records)."""

    key: Any
    offset: int
    nbytes: int
    extents: tuple[tuple[int, int], ...] = ()


@dataclass(eq=False)
class _Buffer:
    data: torch.Tensor  # aligned uint8
    big: bool = False  # the big size class's
    record: Record | None = None  # whose bytes it holds (or is reading); None: none
    read: Future[None] | None = None
    write: Future[None] | None = None  # write-back of ``record`` in flight (or done)
    pins: int = 0
    wanted: bool = False  # prefetched, not yet pinned
    dirty: bool = False  # changed while pinned: written back at the last unpin
    used: int = 0  # LRU clock


class RecordPool:
    """See the module docstring. ``sizes``: the buffer sizes (``size_classes`` of the records);
    ``buffer_count`` buffers of the ordinary class (at least 2)."""

    def __init__(
        self, path: str, engine: IOEngine, *, buffer_count: int, sizes: PoolSizes,
        grow: bool = False, lazy: bool = False, alloc: Callable[[int], torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        self.path = path
        self.engine = engine
        self.sizes = sizes
        self._bytes = max(sizes.ordinary, 4096)
        self._big_bytes = sizes.big
        self._grow = grow
        self._lazy = lazy
        self._alloc = alloc or engine.alloc
        self._buffers = [_Buffer(self._alloc(self._bytes)) for _ in range(max(2, buffer_count))]
        self._buffers += [
            _Buffer(self._alloc(self._big_bytes), big=True) for _ in range(sizes.big_count)
        ]
        self._cond = threading.Condition()
        self._clock = 0
        # (event, records getter) to unpin once the event is done (``unpin_after``)
        self._deferred: list[tuple[Any, Callable[[], Sequence[Record]]]] = []
        # called as ``on_read(record, start, end)`` (perf_counter seconds) when a read completes
        self.on_read: Callable[[Record, float, float], None] | None = None

    @property
    def buffer_bytes(self) -> int:
        """Host bytes the pool's buffers hold (all of them)."""
        return sum(self._big_bytes if b.big else self._bytes for b in self._buffers)

    def is_big(self, rec: Record) -> bool:
        """Whether ``rec`` belongs to the big size class (raises when no buffer can hold it)."""
        if rec.nbytes > self._bytes and rec.nbytes > self._big_bytes:
            raise ValueError(
                f"record {rec.key} of {rec.nbytes} bytes is larger than the pool's buffers"
            )
        return rec.nbytes > self._bytes

    # --- pinning ------------------------------------------------------------------------------
    def pin(
        self, records: Sequence[Record], *, fresh: bool = False,
        on_first: Callable[[Record, torch.Tensor], None] | None = None,
    ) -> list[torch.Tensor]:  # fmt: skip
        """Pin every record of ``records`` (distinct) at once; returns their bytes, in order.
        ``fresh``: the caller overwrites the records whole, so a miss reads nothing.
        ``on_first(record, bytes)`` runs for each record this call pinned first (no other
        holder), after its read. Blocks while the buffers are pinned elsewhere."""
        if not records:
            return []
        with self._cond:
            bufs = self._claim(records, fresh)
            for buf in bufs:
                buf.pins += 1
                buf.wanted = False
            firsts = [buf.pins == 1 for buf in bufs]
            waits = [
                (buf.read, buf.write if first else None)
                for buf, first in zip(bufs, firsts, strict=True)
            ]
        try:
            for read, write in waits:
                if read is not None:
                    read.result()
                if write is not None:
                    write.result()  # the write-back reads the buffer: no change before it ends
        except BaseException:
            with self._cond:
                for buf in bufs:
                    buf.pins -= 1
                    if buf.pins == 0:
                        buf.record, buf.read = None, None
                self._cond.notify_all()
            raise
        views = [buf.data[: rec.nbytes] for buf, rec in zip(bufs, records, strict=True)]
        if on_first is not None:
            for rec, view, first in zip(records, views, firsts, strict=True):
                if first:
                    on_first(rec, view)
        return views

    def unpin(
        self, records: Sequence[Record], *, dirty: bool = False,
        on_last: Callable[[Record, torch.Tensor], None] | None = None,
    ) -> None:  # fmt: skip
        """Release one pin of each record. ``dirty``: the holder changed them; the last holder
        of a changed record starts its write-back. ``on_last(record, bytes)`` runs before that
        for each record losing its last pin."""
        for rec in records:
            with self._cond:
                buf = self._holding(rec)
                assert buf is not None and buf.pins > 0, f"unpin of a record not pinned: {rec.key}"
                buf.dirty = buf.dirty or dirty
                last = buf.pins == 1
            if last and on_last is not None:
                on_last(rec, buf.data[: rec.nbytes])
            with self._cond:
                buf.pins -= 1
                self._clock += 1
                buf.used = self._clock
                if buf.pins == 0 and buf.dirty and not self._lazy:
                    buf.dirty = False
                    buf.write = self._io(self.engine.write, buf, rec)
                self._cond.notify_all()

    def unpin_after(self, records: Callable[[], Sequence[Record]], event: Any) -> None:
        """``unpin(records())`` once ``event`` (a device Event: ``query``/``synchronize``) is
        done: a copy reads the buffers until then. ``records`` is asked late: the caller may
        register this before the copy's thread pinned them (an upload issued, not yet run);
        what it returns must be pinned before ``event`` completes."""
        with self._cond:
            self._deferred.append((event, records))
            self._cond.notify_all()

    def prefetch(self, records: Iterable[Record]) -> None:
        """Start reading these records, in order, into free buffers, without blocking; always
        one buffer stays unclaimed so ``pin`` can make progress."""
        self._reap(block=False)
        with self._cond:
            for rec in records:
                if self._holding(rec) is not None:
                    continue
                big = self.is_big(rec)
                free = [b for b in self._buffers if b.pins == 0 and not b.wanted and b.big == big]
                if len(free) <= 1:
                    return
                idle = [b for b in free if all(f is None or f.done() for f in (b.write, b.read))]
                if not idle:
                    return
                buf = min(idle, key=lambda b: (b.record is not None, b.used))
                self._load(buf, rec, fresh=False)
                buf.wanted = True

    def holds(self, record: Record) -> bool:
        """Whether a buffer holds (or is reading) ``record``: a ``pin`` would not read it."""
        with self._cond:
            return self._holding(record) is not None

    def try_pin(self, record: Record, *, fresh: bool = False) -> torch.Tensor | None:
        """``pin([record], fresh=fresh)`` when it needs no wait: a buffer holds ``record`` with
        no I/O in flight, or (``fresh`` only) a clean free buffer with none can take it; else
        None and nothing changes. For callers that must not block (a copy thread choosing
        between a direct landing and a staging buffer)."""
        with self._cond:
            buf = self._holding(record)
            if buf is None:
                if not fresh:
                    return None
                big = self.is_big(record)
                free = [b for b in self._buffers if b.pins == 0 and not b.wanted and b.big == big]
                free = [b for b in free if not b.dirty and _quiet(b)]
                if not free:
                    return None
                buf = min(free, key=lambda b: (b.record is not None, b.used))
                self._load(buf, record, fresh=True)
            elif not _quiet(buf):
                return None
            buf.pins += 1
            buf.wanted = False
            return buf.data[: record.nbytes]

    def discard(self, record: Record) -> None:
        """``record``'s bytes will never be read again: a buffer holding it (unpinned) forgets
        it without writing it back. What the file holds for it is stale from now on."""
        with self._cond:
            buf = self._holding(record)
            if buf is not None and buf.pins == 0:
                # with I/O in flight the buffer keeps holding the record, so a new pin of it
                # waits for that I/O here instead of racing it from another buffer
                if _quiet(buf):
                    buf.record, buf.read = None, None
                buf.dirty = False
                self._cond.notify_all()

    def drop(self, record: Record) -> None:
        """Forget ``record`` entirely, pinned or not (a failed run's pins that will never be
        released): its buffer is free, its bytes lost. The caller knows no copy still writes
        into the buffer, or that whatever does is discarded with it."""
        with self._cond:
            buf = self._holding(record)
            if buf is not None:
                buf.pins, buf.dirty, buf.wanted = 0, False, False
                if _quiet(buf):  # else as ``discard``
                    buf.record, buf.read = None, None
                self._cond.notify_all()

    # --- whole-file operations ----------------------------------------------------------------
    def flush(self) -> None:
        """Reap every deferred unpin and wait for every write-back; raises the first I/O error.
        (A lazy pool's changed buffers stay unwritten: its records are scratch.)"""
        self._reap(block=True)
        self.settle()

    def settle(self) -> None:
        """Wait for the write-backs in flight (no new one starts); raises the first I/O error."""
        for buf in self._buffers:
            if buf.write is not None:
                buf.write.result()

    def forget(self) -> None:
        """Drop every cached copy (the file changed under the pool). Nothing may be pinned."""
        self.flush()
        for buf in self._buffers:  # a prefetch still landing: it must not land after a reuse
            if buf.read is not None:
                with contextlib.suppress(Exception):
                    buf.read.result()
        with self._cond:
            if any(b.pins for b in self._buffers):
                raise RuntimeError("the NVMe tier's file was rewritten while a record is resident")
            for buf in self._buffers:
                buf.record, buf.read, buf.wanted = None, None, False

    def pinned(self) -> bool:
        with self._cond:
            return any(b.pins for b in self._buffers)

    # --- internals ----------------------------------------------------------------------------
    def _holding(self, rec: Record) -> _Buffer | None:
        for buf in self._buffers:
            if buf.record is rec:
                return buf
        return None

    def _write_back(self, buf: _Buffer) -> None:
        """Under the lock: start writing ``buf``'s record to the file (a lazy eviction)."""
        rec = buf.record
        assert rec is not None
        buf.dirty = False
        buf.write = self._io(self.engine.write, buf, rec)

    def _io(
        self, op: Callable[[str, torch.Tensor, int], Future[None]], buf: _Buffer, rec: Record
    ) -> Future[None]:
        """``op`` (the engine's read or write) of ``rec``'s bytes in ``buf``: one call, or one
        per extent with a future done when all are (the first error, if any)."""
        if not rec.extents:
            return op(self.path, buf.data[: rec.nbytes], rec.offset)
        parts, pos = [], 0
        for offset, nbytes in rec.extents:
            parts.append(op(self.path, buf.data[pos : pos + nbytes], offset))
            pos += nbytes
        return _all_of(parts)

    def _load(self, buf: _Buffer, rec: Record, *, fresh: bool) -> None:
        """Under the lock: make ``buf`` hold ``rec`` (its previous write-back is finished)."""
        buf.record, buf.write, buf.dirty = rec, None, False
        if fresh:
            buf.read = None
            return
        start = time.perf_counter()
        buf.read = self._io(self.engine.read, buf, rec)
        if self.on_read is not None:
            hook = self.on_read
            buf.read.add_done_callback(lambda _f: hook(rec, start, time.perf_counter()))

    def _claim(self, records: Sequence[Record], fresh: bool) -> list[_Buffer]:
        """Under the lock: a buffer of its class for each record, loading the missing ones;
        waits (without the lock) for buffers pinned elsewhere, deferred unpins and pending
        write-backs. All or nothing: no buffer is taken while another is waited for."""
        for big in (False, True):
            want = sum(1 for r in records if self.is_big(r) == big)
            have = sum(1 for b in self._buffers if b.big == big)
            if want > have:
                if not self._grow:
                    raise RuntimeError(
                        f"{want} records pinned at once, but the pool has only {have} "
                        f"{'big ' if big else ''}buffers"
                    )
                size = self._big_bytes if big else self._bytes
                self._buffers += [_Buffer(self._alloc(size), big=big) for _ in range(want - have)]
        while True:
            held = {id(rec): self._holding(rec) for rec in records}
            taken = {id(b) for b in held.values() if b is not None}
            plan: list[tuple[_Buffer, Record]] = []
            short = False
            for big in (False, True):
                missing = [r for r in records if held[id(r)] is None and self.is_big(r) == big]
                if not missing:
                    continue
                free = [
                    b for b in self._buffers
                    if b.pins == 0 and id(b) not in taken and b.big == big
                ]  # fmt: skip
                # clean buffers before changed ones (a lazy pool's eviction costs a write), LRU
                free.sort(key=lambda b: (b.wanted, b.record is not None, b.dirty, b.used))
                if len(free) < len(missing):
                    short = True
                    break
                plan += list(zip(free[: len(missing)], missing, strict=True))
            if short:
                if not self._reap_locked(block=True):
                    # copies end without waking anyone: look again soon
                    self._cond.wait(0.005)
                continue
            chosen = [b for b, _ in plan]
            evict = [b for b in chosen if b.dirty and b.record is not None]
            for buf in evict:  # lazy: the record leaves RAM now, so it goes to the file first
                self._write_back(buf)
            # A write-back must reach the file before its buffer is reused, and a read still
            # landing in it (a prefetch whose record nobody pinned) must land first: issued
            # next to it, the new read could finish first and then be overwritten by the old.
            pending = [
                f for b in chosen for f in (b.write, b.read) if f is not None and not f.done()
            ]
            if pending:
                self._cond.release()
                try:
                    for write in pending:
                        write.result()
                finally:
                    self._cond.acquire()
                continue  # look again: things moved meanwhile
            for buf, rec in plan:
                self._load(buf, rec, fresh=fresh)
            out = [self._holding(rec) for rec in records]
            assert all(b is not None for b in out)
            return [b for b in out if b is not None]

    def _reap(self, *, block: bool) -> None:
        with self._cond:
            while self._reap_locked(block=block) and block:
                pass

    def _reap_locked(self, *, block: bool) -> bool:
        """Under the lock: unpin the deferred records whose events are done; with ``block``,
        wait (without the lock) for the oldest one that holds pins first. Returns whether any
        was reaped. Never waits for an entry that pinned nothing yet: its copy may itself be
        waiting (upstream in the pipeline) for a buffer."""
        if not self._deferred:
            return False
        done = [d for d in self._deferred if d[0].query()]
        if not done and block:
            holding = [d for d in self._deferred if d[1]()]
            if not holding:
                return False
            oldest = holding[0]
            self._cond.release()
            try:
                with contextlib.suppress(Exception):  # a failed copy reads nothing more
                    oldest[0].synchronize()
            finally:
                self._cond.acquire()
            done = [d for d in self._deferred if d[0].query() or d is oldest]
        if not done:
            return False
        self._deferred = [d for d in self._deferred if not any(d is x for x in done)]
        self._cond.release()
        try:
            for _event, records in done:
                self.unpin(records())
        finally:
            self._cond.acquire()
        return True


def _all_of(parts: Sequence[Future[None]]) -> Future[None]:
    """A future done when every one of ``parts`` is, failed with the first failure if any."""
    out: Future[None] = Future()
    left = [len(parts)]
    lock = threading.Lock()

    def one_done(_f: Future[None]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        errors = [e for e in (f.exception() for f in parts) if e is not None]
        if errors:
            out.set_exception(errors[0])
        else:
            out.set_result(None)

    for part in parts:
        part.add_done_callback(one_done)
    return out


def _quiet(buf: _Buffer) -> bool:
    """No read or write-back of ``buf`` in flight."""
    return all(f is None or f.done() for f in (buf.read, buf.write))


class PooledTier:
    """What the tiers share: an I/O engine, their swap file, a ``RecordPool`` over it. Each
    tier builds the three and hands them to ``__init__`` before it writes anything."""

    # the tier writes its whole file at initialize (the initial state); the gradient tier
    # writes only what it evicts
    writes_initially = True

    def __init__(self, *, engine: IOEngine, file: SwapFile, pool: RecordPool) -> None:
        self.engine = engine
        self.file = file
        self.pool = pool

    @property
    def stats(self) -> IOStats:
        """The tier's I/O since it started (its own engine's totals)."""
        return self.engine.stats

    def flush(self) -> None:
        """Wait for every write-back; raises the first I/O error."""
        self.pool.flush()

    def close(self) -> None:
        """Wait for the writes, stop the engine, remove the swap file (idempotent)."""
        with contextlib.suppress(Exception):
            self.flush()
        self.engine.close()
        self.file.close()
