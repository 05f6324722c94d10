"""The optimizer tier: fp32 masters and Adam moments on NVMe, streamed layer by layer.

With ``offload_optimizer.device: "nvme"`` no master or moment lives in RAM between steps. Each
layer owns one record in a swap file (per owned parameter: master, exp_avg, exp_avg_sq, fp32,
64-byte aligned; the record 4 KiB aligned for O_DIRECT). A small pool of aligned buffers
(``buffer_count``, each the size of the largest layer's record) carries them:

::

    gradient of layer l complete -> prefetch(l, next layers in step order): read record -> buffer
    optimizer worker: resident(l, dirty=True): masters and moments become views of the buffer
                      CPU Adam steps them in place; the compute weights are published from them
                      on exit: the views go back to empty placeholders, the buffer is written back
    a later read of l waits for that write; a buffer still holding l is reused without a read

Between steps the masters (``HostParam.master``) and the optimizer's ``exp_avg``/``exp_avg_sq``
keep their shapes and identities (the optimizer, LR schedulers and checkpoint code hold them)
but own no memory: their storage has size 0, so reading one outside ``resident`` fails loudly
instead of returning stale numbers. ``materialized`` brings every layer into RAM at once, for the
rare callers that need the whole state (checkpoint save/load, ``reload_masters``).

The stepper steps one layer at a time on one thread, in the same order on every run, with the
same CPU Adam kernel on the same bytes: the tier changes where the state lives, never a result
(tests/engine/test_nvme_tier.py holds it bit for bit against the host-resident engine).

Host memory of the tier: ``buffer_count`` x the largest record, whatever the model's size; the
swap file is scratch of one run (checkpoints are what resumes) and is removed at close.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from rp_engine.storage.aligned import aligned_empty, round_up
from rp_engine.storage.io_engine import IOEngine, IOStats
from rp_engine.storage.swap_file import SwapFile

__all__ = ["OptimizerTier", "placeholder", "tier_bytes"]

log = logging.getLogger("rp_engine.storage")

_ELEM_ALIGN = 16  # fp32 elements: 64-byte aligned tensors inside a record (SIMD loads)
_KINDS = ("master", "exp_avg", "exp_avg_sq")


def placeholder(shape: torch.Size) -> torch.Tensor:
    """A CPU fp32 tensor of ``shape`` that owns no memory (storage of size 0)."""
    t = torch.empty(shape, dtype=torch.float32)
    t.untyped_storage().resize_(0)
    return t


@dataclass
class _Record:
    """One layer's state in the swap file."""

    layer: int
    offset: int  # bytes, in the file
    nbytes: int  # 4 KiB multiple
    # per owned parameter: (HostParam, element offset of its master; m and v follow, padded)
    params: list[tuple[Any, int, int]] = field(default_factory=list)  # (hp, start, padded n)


@dataclass(eq=False)
class _Buffer:
    data: torch.Tensor  # aligned uint8
    layer: int = -1  # whose record it holds (or is being read), -1: none
    read: Future[None] | None = None
    write: Future[None] | None = None  # write-back of ``layer`` in flight (or done)
    pins: int = 0  # resident() holders
    wanted: bool = False  # prefetched for a step, not yet used
    dirty: bool = False  # modified while pinned: written back at the last unpin
    used: int = 0  # LRU clock


def _layouts(store: Any) -> list[_Record | None]:
    records: list[_Record | None] = []
    offset = 0
    for layer in store.layers:
        if not layer.owned:
            records.append(None)
            continue
        rec = _Record(layer.index, offset, 0)
        elems = 0
        for hp in layer.owned:
            n = round_up(hp.master.numel(), _ELEM_ALIGN)
            rec.params.append((hp, elems, n))
            elems += 3 * n
        rec.nbytes = round_up(elems * 4)
        offset += rec.nbytes
        records.append(rec)
    return records


def tier_bytes(store: Any, buffer_count: int) -> tuple[int, int]:
    """(bytes on disk, bytes of host buffers) the optimizer tier needs for ``store``."""
    records = [r for r in _layouts(store) if r is not None]
    disk = sum(r.nbytes for r in records)
    largest = max((r.nbytes for r in records), default=0)
    return disk, largest * max(2, buffer_count)


class OptimizerTier:
    """See the module docstring. ``store``: the HostStore (built with paged masters);
    ``optimizer``: the HostOptimizer (per-layer CPU Adam); ``folder``: the checked nvme_path;
    ``engine``: the I/O engine (storage/io_engine.py); ``buffer_count`` >= 2."""

    def __init__(
        self, store: Any, optimizer: Any, *, folder: str, rank: int, engine: IOEngine,
        buffer_count: int,
    ) -> None:  # fmt: skip
        self.store = store
        self.inner = optimizer.optimizer
        self.engine = engine
        self._records = _layouts(store)
        disk, _ = tier_bytes(store, buffer_count)
        largest = max((r.nbytes for r in self._records if r is not None), default=4096)
        self.file = SwapFile(folder, f"rp_engine/rank{rank}/optimizer.swp", disk)
        self.path = self.file.path
        self.disk_bytes = disk
        self._buffers = [_Buffer(engine.alloc(largest)) for _ in range(max(2, buffer_count))]
        self.buffer_bytes = largest * len(self._buffers)
        self._cond = threading.Condition()
        self._clock = 0
        self._materialized: bool | None = None  # inside materialized(): whether writable
        self._placeholders = {id(hp): placeholder(hp.master.shape) for hp in store.owned_params()}
        try:
            self._write_initial()
        except BaseException:
            self.close()
            raise

    # --- what the optimizer and the host store call ------------------------------------------
    @contextlib.contextmanager
    def resident(self, layer: int, *, dirty: bool = False) -> Iterator[None]:
        """The layer's masters and moments are views of a buffer for the block (read first
        when no buffer holds them). ``dirty``: the block changes them; the buffer is written
        back when the last holder leaves. Nestable, from any thread."""
        rec = self._records[layer]
        if rec is None:
            yield
            return
        buf = self._pin(rec)
        try:
            yield
        finally:
            self._unpin(rec, buf, dirty)

    def prefetch(self, layers: Iterable[int]) -> None:
        """Start reading these layers' records (in this order) into free buffers, without
        blocking: a hint for what the optimizer steps next; always one buffer stays unclaimed
        so ``resident`` can make progress."""
        with self._cond:
            for layer in layers:
                rec = self._records[layer]
                if rec is None or self._holding(layer) is not None:
                    continue
                free = [b for b in self._buffers if b.pins == 0 and not b.wanted]
                if len(free) <= 1:
                    return
                idle = [b for b in free if b.write is None or b.write.done()]
                if not idle:
                    return
                buf = min(idle, key=lambda b: (b.layer != -1, b.used))
                self._load(buf, rec)
                buf.wanted = True

    def flush(self) -> None:
        """Wait for every write-back; raises the first I/O error."""
        for buf in self._buffers:
            if buf.write is not None:
                buf.write.result()

    @contextlib.contextmanager
    def materialized(self, *, writable: bool) -> Iterator[None]:
        """Every layer's masters and moments in RAM for the block (one read of the file).
        ``writable``: what the block leaves in them (checkpoint load: new tensors put into the
        optimizer's state included) is written back to the file at exit. No step may run.
        Nested blocks share the outermost one (a writable one needs a writable outer block)."""
        if self._materialized is not None:
            if writable and not self._materialized:
                raise RuntimeError("a writable materialized() inside a read-only one")
            yield
            return
        self.flush()
        with self._cond:
            if any(b.pins for b in self._buffers):
                raise RuntimeError("materialized() while a layer is resident")
        whole = aligned_empty(self.disk_bytes)
        if self.disk_bytes:
            self.engine.read(self.path, whole, 0).result()
        live = [r for r in self._records if r is not None]
        for rec in live:
            self._attach(rec, whole[rec.offset : rec.offset + rec.nbytes])
        self._materialized = writable
        try:
            yield
        finally:
            self._materialized = None
            for rec in live:
                self._detach(rec, whole[rec.offset : rec.offset + rec.nbytes], ingest=writable)
            if writable:
                with self._cond:
                    for buf in self._buffers:  # their copies are older than the file now
                        buf.layer, buf.read, buf.wanted = -1, None, False
                if self.disk_bytes:
                    self.engine.write(self.path, whole, 0).result()

    @property
    def stats(self) -> IOStats:
        return self.engine.stats

    def close(self) -> None:
        """Wait for the writes, stop the engine, remove the swap file (idempotent)."""
        with contextlib.suppress(Exception):
            self.flush()
        self.engine.close()
        self.file.close()

    # --- internals ----------------------------------------------------------------------------
    def _write_initial(self) -> None:
        """Masters from the compute weights (as a host-resident master is made), zero moments,
        through the buffers in turn: RAM never holds more than the pool."""
        start = last = time.monotonic()
        live = [r for r in self._records if r is not None]
        for i, rec in enumerate(live):
            buf = self._buffers[i % len(self._buffers)]
            if buf.write is not None:
                buf.write.result()
            view = buf.data[: rec.nbytes]
            view.zero_()
            floats = view.view(torch.float32)
            for hp, s, _n in rec.params:
                floats[s : s + hp.master.numel()].copy_(hp.param.detach().reshape(-1))
            buf.write = self.engine.write(self.path, view, rec.offset)
            buf.layer, buf.read = rec.layer, None  # it still holds the layer: a hit later
            if time.monotonic() - last > 15:
                last = time.monotonic()
                log.warning(
                    "NVMe tier: writing the initial optimizer state, layer %d of %d (%.0f s)",
                    i + 1, len(live), last - start,
                )  # fmt: skip
        self.flush()

    def _holding(self, layer: int) -> _Buffer | None:
        for buf in self._buffers:
            if buf.layer == layer:
                return buf
        return None

    def _load(self, buf: _Buffer, rec: _Record) -> None:
        """Under the lock: make ``buf`` read ``rec`` (its previous write-back is finished)."""
        buf.layer, buf.write, buf.dirty = rec.layer, None, False
        buf.read = self.engine.read(self.path, buf.data[: rec.nbytes], rec.offset)

    def _pin(self, rec: _Record) -> _Buffer:
        with self._cond:
            while True:
                buf = self._holding(rec.layer)
                if buf is not None:
                    break
                free = [b for b in self._buffers if b.pins == 0 and not b.wanted]
                if not free:
                    free = [b for b in self._buffers if b.pins == 0]
                if not free:  # every buffer is resident elsewhere: wait for one
                    self._cond.wait()
                    continue
                buf = min(free, key=lambda b: (b.layer != -1, b.used))
                pending = buf.write
                if pending is not None and not pending.done():
                    self._cond.release()
                    try:
                        pending.result()  # its data must reach the file before reuse
                    finally:
                        self._cond.acquire()
                    continue  # look again: things moved meanwhile
                self._load(buf, rec)
                break
            buf.pins += 1
            buf.wanted = False
            first = buf.pins == 1
            read, write = buf.read, buf.write
        try:
            if read is not None:
                read.result()
            if first and write is not None:
                write.result()  # the write-back reads the buffer: no change before it is done
        except BaseException:
            with self._cond:
                buf.pins -= 1
                buf.layer, buf.read = -1, None
                self._cond.notify_all()
            raise
        if first:
            self._attach(rec, buf.data[: rec.nbytes])
        return buf

    def _unpin(self, rec: _Record, buf: _Buffer, dirty: bool) -> None:
        with self._cond:
            buf.dirty = buf.dirty or dirty
            last = buf.pins == 1
        if last:
            self._detach(rec, buf.data[: rec.nbytes], ingest=False)
        with self._cond:
            buf.pins -= 1
            self._clock += 1
            buf.used = self._clock
            if buf.pins == 0 and buf.dirty:
                buf.dirty = False
                buf.write = self.engine.write(self.path, buf.data[: rec.nbytes], rec.offset)
            self._cond.notify_all()

    def _attach(self, rec: _Record, data: torch.Tensor) -> None:
        floats = data.view(torch.float32)
        for hp, s, n in rec.params:
            views = [floats[s + k * n : s + k * n + hp.master.numel()].view(hp.master.shape)
                     for k in range(3)]  # fmt: skip
            hp.master.data = views[0]
            state = self.inner.state[hp.master]
            if not state:  # never stepped: the kernel starts from step 0 and zero moments
                state["step"] = 0
            state["exp_avg"], state["exp_avg_sq"] = views[1], views[2]

    def _detach(self, rec: _Record, data: torch.Tensor, *, ingest: bool) -> None:
        floats = data.view(torch.float32)
        for hp, s, n in rec.params:
            state = self.inner.state.get(hp.master)
            if ingest:  # a load put its own tensors in place of the views: copy them in
                for k, kind in enumerate(_KINDS):
                    src = hp.master if k == 0 else (state or {}).get(kind)
                    dst = floats[s + k * n : s + k * n + hp.master.numel()].view(hp.master.shape)
                    if src is None:
                        dst.zero_()
                    elif src.data_ptr() != dst.data_ptr():
                        dst.copy_(src)
            ph = self._placeholders[id(hp)]
            hp.master.data = ph
            if state is None:
                continue
            if not state.get("step"):  # never stepped: no state, as in a host-resident run
                self.inner.state.pop(hp.master, None)
            else:
                state["exp_avg"], state["exp_avg_sq"] = ph, ph


def ordered(layers: Sequence[int], start: int, *, descending: bool) -> list[int]:
    """``layers`` from ``start`` on in stepping order (for prefetch hints)."""
    if descending:
        return [layer for layer in reversed(layers) if layer <= start]
    return [layer for layer in layers if layer >= start]
