"""The parameter tier: compute weights on NVMe, read in plan order ahead of their uploads.

With ``offload_param.device: "nvme"`` the compute weights (bf16/fp16/fp32, the bytes uploads copy)
of a layer live in a swap file instead of RAM. Per layer and per weight buffer (two with
double-buffered weights: versions v and v-1 coexist, model/host_store.py) one record holds every
parameter only that layer uses, frozen or trainable (but the frozen ones served from their
files, below), each 64-byte aligned; the records of buffer
0 come first in the file, so ``materialized`` reads them in one piece.

::

    plan  READ R_s.m (issue order) -> queue_reads: reads start into free pool buffers, in order
    upload U_s.m on its weight stream: acquire(layers, version) pins the records (a hit when the
           READ got there first), the copy reads the buffers; release_after(copy's event)
    optimizer publish of version v: written into record (layer, v % 2), then written back

What stays in RAM: layers that fit in ``max_in_cpu`` elements (DeepSpeed's key: the first layers
in order), parameters shared by several layers (tied embeddings), and module buffers. What stays
in its file: frozen weights served from a model folder's file mapping (model/folder.py's
``served_from_files``: a LoRA base loaded from its ``save_pretrained`` folder) get no record:
they are on disk already, nothing writes them, and uploads read them from the mapping as they
read the weights kept in RAM (page-cache pages, evictable, never pinned); a layer holding only
such weights and buffers does not page at all. They count against no ``max_in_cpu``. The module's
paged parameters keep their identity, shape and dtype but own no memory (storage of size 0), so a
stray host read fails loudly; ``materialized`` points them into the swap file mapped into memory
for the few whole-model readers (checkpoint load, ``reload_masters``, state_dict), and
``reading`` one layer at a time into the pool (a streamed checkpoint save).

Host memory of the tier: its buffer pool, at least one slot's records (the pool grows to what one
upload pins at once), whatever the model's size.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rp_engine.model.folder import served_from_files
from rp_engine.model.host_store import placeholder
from rp_engine.plan.host_ram import PoolSizes, size_classes
from rp_engine.storage.aligned import round_up
from rp_engine.storage.heap import return_freed_memory
from rp_engine.storage.io_engine import IOEngine
from rp_engine.storage.mapped import MappedFile
from rp_engine.storage.record_pool import PooledTier, Record, RecordPool
from rp_engine.storage.swap_file import SwapFile

__all__ = ["ParamTier", "WeightLease", "param_tier_plan"]

log = logging.getLogger("rp_engine.storage")

_BYTE_ALIGN = 64
_COPY_CHUNK = 64 << 20  # bytes copied (and released) at a time between weight buffers
# the initial write releases the module's weights in batches of this many bytes (flushed first)
_RELEASE_BYTES = 256 << 20


@dataclass(eq=False)
class _Record(Record):
    """One layer's paged weights of one buffer (``key``: (layer, buffer))."""

    tensors: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (param, byte offset)


@dataclass(frozen=True)
class ParamTierPlan:
    """Which tensors page, and where: computed before anything is written."""

    paged: dict[int, list[torch.Tensor]]  # layer -> its paged parameters, in record order
    record_bytes: dict[int, int]  # layer -> bytes of one record (4 KiB multiple)
    cached_elements: int  # elements kept in RAM by ``max_in_cpu``
    file_elements: int = 0  # frozen elements served from their files' mappings: no record

    def disk_bytes(self, copies: int) -> int:
        return copies * sum(self.record_bytes.values())

    def largest(self) -> int:
        return max(self.record_bytes.values(), default=4096)

    def sizes(self) -> PoolSizes:
        """The pool's buffer sizes: ordinary layers' records apart from the few big ones."""
        return size_classes(self.record_bytes.values())


def param_tier_plan(store: Any, max_in_cpu: int) -> ParamTierPlan:
    """The layers whose weights page to NVMe: every parameter used by one layer only and not
    served from a file (frozen and file backed: ``served_from_files``), of the layers left once
    the first ones fitting in ``max_in_cpu`` elements stay in RAM."""
    users = store.param_users()
    params = {id(p): p for layer in store.layers for _, p in layer.params}
    in_files = served_from_files(params.values())
    paged: dict[int, list[torch.Tensor]] = {}
    sizes: dict[int, int] = {}
    budget, cached = max_in_cpu, 0
    for layer in store.layers:
        own = [
            p for _, p in layer.params
            if users[id(p)] == 1 and p.numel() and id(p) not in in_files
        ]  # fmt: skip
        elems = sum(p.numel() for p in own)
        if not own:
            continue
        if elems <= budget:  # DeepSpeed's max_in_cpu: this much stays in RAM
            budget -= elems
            cached += elems
            continue
        paged[layer.index] = own
        sizes[layer.index] = round_up(
            sum(round_up(p.numel() * p.element_size(), _BYTE_ALIGN) for p in own)
        )
    files = sum(params[key].numel() for key in in_files)
    return ParamTierPlan(paged, sizes, cached, files)


class WeightLease:
    """Records an upload pinned: ``views`` maps ``id(param)`` to its bytes for the copy."""

    def __init__(self, records: list[Record], views: dict[int, torch.Tensor]) -> None:
        self.records = records
        self.views = views


class ParamTier(PooledTier):
    """See the module docstring. ``store``: the HostStore, after its weight buffers are decided
    (``weight_copies``); ``folder``: the checked nvme_path; ``buffer_count`` >= 2."""

    def __init__(
        self, store: Any, plan: ParamTierPlan, *, folder: str, rank: int, engine: IOEngine,
        buffer_count: int,
    ) -> None:  # fmt: skip
        self.store = store
        self.copies = store.weight_copies
        self.plan = plan
        self._records: dict[tuple[int, int], _Record] = {}
        offset = 0
        for copy in range(self.copies):
            for layer, tensors in plan.paged.items():
                rec = _Record((layer, copy), offset, plan.record_bytes[layer])
                at = 0
                for p in tensors:
                    rec.tensors.append((p, at))
                    at += round_up(p.numel() * p.element_size(), _BYTE_ALIGN)
                self._records[(layer, copy)] = rec
                offset += rec.nbytes
        self.disk_bytes = offset
        file = SwapFile(folder, f"rp_engine/rank{rank}/params.swp", self.disk_bytes)
        self.path = file.path
        pool = RecordPool(
            self.path, engine, buffer_count=buffer_count, sizes=plan.sizes(), grow=True
        )
        super().__init__(engine=engine, file=file, pool=pool)
        self._owner = {id(p): layer for layer, ts in plan.paged.items() for p in ts}
        self._placeholders = {
            id(p): placeholder(p.shape, p.dtype) for ts in plan.paged.values() for p in ts
        }
        self._queue: list[tuple[Any, list[Record]]] = []  # plan-order reads not yet started
        # the timeline's NVMe row: which upload asked for a record last, and the reads done
        self._asker: dict[int, Any] = {}  # id(record) -> key
        self._reads: list[tuple[Any, float, float]] = []  # (key, start, end), perf_counter
        self._lock = threading.Lock()  # before the hook that takes it
        self.pool.on_read = self._note_read
        self._materialized: bool | None = None
        try:
            self._write_initial()
        except BaseException:
            self.close()
            raise

    # --- queries ------------------------------------------------------------------------------
    def paged(self, layer: int) -> bool:
        return layer in self.plan.paged

    def layer_of(self, param: torch.Tensor) -> int | None:
        """The layer whose records hold ``param``; None when it stays in RAM."""
        return self._owner.get(id(param))

    def views_of(self, layer: int) -> set[int]:
        """``id`` of every parameter of ``layer`` that lives in the tier."""
        return {id(p) for p in self.plan.paged.get(layer, ())}

    @property
    def buffer_bytes(self) -> int:
        return self.pool.buffer_bytes

    def _layer_records(self, layers: Iterable[int], version: int) -> list[Record]:
        copy = version % self.copies
        return [self._records[(layer, copy)] for layer in layers if layer in self.plan.paged]

    # --- uploads ------------------------------------------------------------------------------
    def queue_reads(self, key: Any, layers: Sequence[int], version: int) -> None:
        """A plan READ: the upload ``key`` will need these layers at ``version``; read them in
        this order, behind the reads queued before, as buffers free up (non-blocking)."""
        records = self._layer_records(layers, version)
        if records:
            with self._lock:
                self._queue.append((key, records))
                self._asker.update((id(r), key) for r in records)
            self._pump()

    def acquire(self, key: Any, layers: Sequence[int], version: int) -> WeightLease | None:
        """Pin the layers' records of ``version``'s buffer for an upload (blocking: reads what no
        buffer holds). None when none of the layers pages."""
        records = self._layer_records(layers, version)
        with self._lock:
            self._queue = [q for q in self._queue if q[0] != key]
            self._asker.update((id(r), key) for r in records)
        if not records:
            return None
        views: dict[int, torch.Tensor] = {}
        for rec, data in zip(records, self.pool.pin(records), strict=True):
            assert isinstance(rec, _Record)
            for p, at in rec.tensors:
                views[id(p)] = _view(data, at, p)
        return WeightLease(records, views)

    def release_after(self, leases: list[WeightLease], event: Any) -> None:
        """The upload's copies read ``leases``' buffers until ``event`` completes. Registered
        when the upload is issued: ``leases`` fills later, on its copy thread, before ``event``."""
        self.pool.unpin_after(lambda: [r for lease in leases for r in lease.records], event)
        self._pump()

    def take_reads(self, run: Any) -> list[tuple[Any, float, float]]:
        """The reads done for uploads whose key is ``(run, action)``, as ``(action, start,
        end)`` in perf_counter seconds; forgotten now (the timeline's NVMe row)."""
        with self._lock:
            mine = [(k[1], s, e) for k, s, e in self._reads if k[0] == run]
            self._reads = [r for r in self._reads if r[0][0] != run]
        return mine

    def _note_read(self, record: Record, start: float, end: float) -> None:
        with self._lock:
            key = self._asker.get(id(record))
            if isinstance(key, tuple):
                self._reads.append((key, start, end))
                del self._reads[:-4096]  # bounded, should nobody take them

    def _pump(self) -> None:
        """Start the queued reads that fit in free buffers, oldest first."""
        with self._lock:
            queue = list(self._queue)
        for _key, records in queue:
            if not all(self.pool.holds(r) for r in records):
                self.pool.prefetch(records)
                if not all(self.pool.holds(r) for r in records):
                    return  # no room: the next release pumps again

    # --- publishing (the optimizer) -----------------------------------------------------------
    @contextlib.contextmanager
    def buffer(
        self, layer: int, copy: int, *, overwrite: bool, keep: bool = False
    ) -> Iterator[dict[int, torch.Tensor]]:
        """The layer's paged weights in buffer ``copy`` as views (``id(param)`` -> tensor) for
        the block; ``overwrite``: the block writes the trainable ones, written back after;
        ``keep``: it reads their old values first (so the buffer is read in even then)."""
        rec = self._records[(layer, copy)]
        with self._lock:
            self._asker.pop(id(rec), None)  # a read for the optimizer: not on an upload's row
        # a record holding frozen weights is read first: the block rewrites only part of it
        # (frozen weights served from their files have no place in a record: not read for them)
        fresh = overwrite and not keep and all(p.requires_grad for p, _ in rec.tensors)
        (data,) = self.pool.pin([rec], fresh=fresh)
        try:
            yield {id(p): _view(data, at, p) for p, at in rec.tensors}
        finally:
            self.pool.unpin([rec], dirty=overwrite)

    # --- whole-state access -------------------------------------------------------------------
    @contextlib.contextmanager
    def reading(self, layer: int) -> Iterator[None]:
        """The layer's paged parameters hold buffer 0's weights for the block (a pool buffer,
        read if no buffer holds it), to be read; placeholders again after. Within
        ``materialized`` they already hold them."""
        if self._materialized is not None or layer not in self.plan.paged:
            yield
            return
        rec = self._records[(layer, 0)]
        (data,) = self.pool.pin([rec])
        try:
            for p, at in rec.tensors:
                p.data = _view(data, at, p)
            yield
        finally:
            for p, _ in rec.tensors:
                p.data = self._placeholders[id(p)]
            self.pool.unpin([rec])

    @contextlib.contextmanager
    def materialized(self, *, writable: bool) -> Iterator[None]:
        """The module's paged parameters hold buffer 0's weights for the block: views of the
        swap file mapped into memory (mapped.py). ``writable``: what the block leaves in them
        becomes every buffer's weights. Nested blocks share the outermost one."""
        if self._materialized is not None:
            if writable and not self._materialized:
                raise RuntimeError("a writable materialized() inside a read-only one")
            yield
            return
        self.pool.flush()
        region = sum(self.plan.record_bytes.values())
        mapped = MappedFile(self.path, self.disk_bytes, writable=writable)
        whole = mapped.tensor
        for layer in self.plan.paged:
            rec = self._records[(layer, 0)]
            for p, at in rec.tensors:
                p.data = _view(whole, rec.offset + at, p)
        self._materialized = writable
        try:
            yield
        finally:
            self._materialized = None
            for ts in self.plan.paged.values():
                for p in ts:
                    p.data = self._placeholders[id(p)]
            if writable:
                self.pool.forget()
                for start in range(0, region, _COPY_CHUNK):  # buffer 0 -> the other buffers
                    n = min(_COPY_CHUNK, region - start)
                    for copy in range(1, self.copies):
                        at = copy * region + start
                        whole[at : at + n].copy_(whole[start : start + n])
                        mapped.release(at, n)
                    mapped.release(start, n)
            del whole
            mapped.close()

    # --- internals ----------------------------------------------------------------------------
    def _write_initial(self) -> None:
        """Every buffer's records from the module's weights, layer by layer; a layer's paged
        parameters become placeholders once its records are in the file (in batches of
        ``_RELEASE_BYTES``, each flushed first), and the freed memory goes back to the OS: the
        user's model is the peak, not the model plus a copy. On a failure, the layers already
        released are read back into the module (else they would be lost with the file)."""
        released: list[int] = []
        pending: list[int] = []
        pending_bytes = 0
        try:
            for layer in self.plan.paged:
                for copy in range(self.copies):
                    rec = self._records[(layer, copy)]
                    (data,) = self.pool.pin([rec], fresh=True)
                    data.zero_()
                    for p, at in rec.tensors:
                        _view(data, at, p).copy_(p.detach())
                    self.pool.unpin([rec], dirty=True)
                pending.append(layer)
                pending_bytes += self.plan.record_bytes[layer]
                if pending_bytes >= _RELEASE_BYTES:
                    self._release(pending, released)
                    pending_bytes = 0
            self._release(pending, released)
        except BaseException:
            self._restore(released)
            raise

    def _release(self, layers: list[int], released: list[int]) -> None:
        """``layers``' records are written: once in the file, their parameters become
        placeholders."""
        self.pool.flush()
        for layer in layers:
            for p in self.plan.paged[layer]:
                p.data = self._placeholders[id(p)]
        released.extend(layers)
        layers.clear()
        return_freed_memory()

    def _restore(self, layers: list[int]) -> None:
        """A failed initial write: put the released layers' weights back into the module."""
        lost = []
        for layer in layers:
            rec = self._records[(layer, 0)]
            try:
                (data,) = self.pool.pin([rec])
                try:
                    for p, at in rec.tensors:
                        p.data = _view(data, at, p).clone()
                finally:
                    self.pool.unpin([rec])
            except Exception:  # noqa: BLE001 - report every layer that could not come back
                lost.append(layer)
        if lost:
            log.error(
                "NVMe parameter tier: the initial write failed and the weights of layers %s "
                "could not be read back from %s: the module passed to initialize lost them",
                lost, self.path,
            )  # fmt: skip


def _view(data: torch.Tensor, at: int, p: torch.Tensor) -> torch.Tensor:
    nbytes = p.numel() * p.element_size()
    return data[at : at + nbytes].view(p.dtype).view(p.shape)
