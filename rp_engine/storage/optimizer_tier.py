"""The optimizer tier: fp32 masters and Adam moments on NVMe, streamed layer by layer.

With ``offload_optimizer.device: "nvme"`` no master or moment lives in RAM between steps. Each
layer owns one record in a swap file (per owned parameter: master, exp_avg, exp_avg_sq, fp32,
64-byte aligned; the record 4 KiB aligned for O_DIRECT). A small pool of aligned buffers
(``buffer_count``, each the size of the largest ordinary layer's record, plus 2 of the size of
a record much larger than the rest, an embedding's or an LM head's: record_pool.py) carries them:

::

    gradient of layer l complete -> prefetch(l, next layers in step order): read record -> buffer
    optimizer worker: resident(l, dirty=True): masters and moments become views of the buffer
                      CPU Adam steps them in place; the compute weights are published from them
                      on exit: the views go back to empty placeholders, the buffer is written back
    a later read of l waits for that write; a buffer still holding l is reused without a read

Between steps the masters (``HostParam.master``) and the optimizer's ``exp_avg``/``exp_avg_sq``
keep their shapes and identities (the optimizer, LR schedulers and checkpoint code hold them)
but own no memory: their storage has size 0, so reading one outside ``resident`` fails loudly
instead of returning stale numbers. ``materialized`` shows every layer at once, as views of the
swap file mapped into memory (mapped.py), for the rare callers that need the whole state
(checkpoint load, ``reload_masters``); a checkpoint save reads layer by layer (``resident``).

The stepper steps one layer at a time on one thread, in the same order on every run, with the
same CPU Adam kernel on the same bytes: the tier changes where the state lives, never a result
(tests/engine/test_nvme_tier.py holds it bit for bit against the host-resident engine).

**Sliced** (``slice_bytes``: ``roundpipe.optimizer_slice_mb``, or what the preflight chose to fit
a memory limit, host_preflight.py): a buffer carries a *slice* of a layer's state, never more
than ``slice_bytes``, so the pool's RAM no longer follows the layers' width. Every tensor is
then 4 KiB aligned in the file; a slice is a run of whole tensors, or a piece of one tensor
larger than a slice, cut at multiples of 1,024 elements (plan/host_ram.py's ``pack_pieces``, the gradient tier's pieces
too: a slice never needs two gradient records), each piece's master, exp_avg and exp_avg_sq
side by side in the buffer, read and written as that many extents (record_pool.py). The
stepper steps a sliced layer slice after slice (``resident_slice``: flat ``StateSegment`` views,
``HostOptimizer.step_segments``), bit-identical because Adam is elementwise and the cuts are
multiples of its SIMD span (tests/engine/test_sliced_optimizer.py). Outside its step a sliced
layer's masters are views of the swap file mapped read-only (``resident``: the publish of
unchanged masters, a streamed checkpoint save). Not with delay compensation (it needs each
tensor's norms before its first element steps).

Host memory of the tier: ``buffer_count`` x the largest ordinary record (+ 2 big ones), whatever
the number of layers (sliced: ``buffer_count`` x ``slice_bytes``, whatever their width too); the
swap file is scratch of one run (checkpoints are what resumes) and is removed at close.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rp_engine.model.host_store import placeholder
from rp_engine.optim.optimizer import StateSegment
from rp_engine.plan.host_ram import PIECE_ALIGN, PoolSizes, pack_pieces, size_classes
from rp_engine.storage.aligned import round_up
from rp_engine.storage.io_engine import IOEngine
from rp_engine.storage.mapped import MappedFile
from rp_engine.storage.record_pool import PooledTier, Record, RecordPool
from rp_engine.storage.swap_file import SwapFile

__all__ = ["OptimizerTier", "tier_bytes"]

log = logging.getLogger("rp_engine.storage")

_ELEM_ALIGN = 16  # fp32 elements: 64-byte aligned tensors inside a record (SIMD loads)
# sliced: every state tensor and every cut 4 KiB aligned (``pack_pieces``), so each extent of a
# slice is a direct I/O of its own, and a cut splits a tensor's vector and scalar parts exactly
# as the whole does (bit-identical steps, optim/optimizer.py)
_SLICE_ALIGN = PIECE_ALIGN
_KINDS = ("master", "exp_avg", "exp_avg_sq")


@dataclass(eq=False)
class _Record(Record):
    """One layer's state in the swap file (``key``: the layer)."""

    # per owned parameter: (HostParam, element offset of its master; m and v follow, padded)
    params: list[tuple[Any, int, int]] = field(default_factory=list)  # (hp, start, padded n)


@dataclass(eq=False)
class _Slice(Record):
    """Part of a layer's state (``key``: (layer, index)): per segment (HostParam, first and
    end element), its master's elements, then exp_avg's, then exp_avg_sq's, segment after
    segment in the buffer (a slice of whole tensors is then laid out as the layer's record)."""

    segments: list[tuple[Any, int, int]] = field(default_factory=list)


def _layouts(store: Any, *, align: int = _ELEM_ALIGN) -> list[_Record | None]:
    records: list[_Record | None] = []
    offset = 0
    for layer in store.layers:
        if not layer.owned:
            records.append(None)
            continue
        rec = _Record(layer.index, offset, 0)
        elems = 0
        for hp in layer.owned:
            n = round_up(hp.master.numel(), align)
            rec.params.append((hp, elems, n))
            elems += 3 * n
        rec.nbytes = round_up(elems * 4)
        offset += rec.nbytes
        records.append(rec)
    return records


def _slices(records: Sequence[_Record | None], slice_bytes: int) -> list[list[_Slice]]:
    """Per layer, the slices of its record (none for a layer owning nothing): their extents
    are the pieces of the layer's master, exp_avg and exp_avg_sq tensors they hold, adjacent
    pieces merged (a layer that fits one slice is one extent: its whole record)."""
    out: list[list[_Slice]] = []
    for rec in records:
        if rec is None:
            out.append([])
            continue
        cuts = pack_pieces([hp.master.numel() for hp, _, _ in rec.params], slice_bytes // 12)
        layer: list[_Slice] = []
        for k, segments in enumerate(cuts):
            pieces: list[tuple[int, int]] = []
            for i, a, b in segments:
                _hp, s, n = rec.params[i]
                for kind in range(3):
                    start = rec.offset + 4 * (s + kind * n + a)
                    if pieces and pieces[-1][0] + pieces[-1][1] == start:
                        pieces[-1] = (pieces[-1][0], pieces[-1][1] + 4 * (b - a))
                    else:
                        pieces.append((start, 4 * (b - a)))
            nbytes = sum(n for _, n in pieces)
            sl = _Slice((rec.key, k), pieces[0][0], nbytes, tuple(pieces))
            sl.segments = [(rec.params[i][0], a, b) for i, a, b in segments]
            layer.append(sl)
        out.append(layer)
    return out


def tier_bytes(store: Any, buffer_count: int, *, slice_bytes: int = 0) -> tuple[int, int]:
    """(bytes on disk, bytes of host buffers) the optimizer tier needs for ``store``;
    ``slice_bytes``: see ``OptimizerTier``."""
    if slice_bytes:
        records = [r for r in _layouts(store, align=_SLICE_ALIGN) if r is not None]
        largest = max(
            (s.nbytes for layer in _slices(records, slice_bytes) for s in layer), default=0
        )
        return sum(r.nbytes for r in records), max(2, buffer_count) * round_up(largest)
    records = [r for r in _layouts(store) if r is not None]
    disk = sum(r.nbytes for r in records)
    sizes = size_classes(r.nbytes for r in records)
    return disk, sizes.ordinary * max(2, buffer_count) + sizes.big * sizes.big_count


class OptimizerTier(PooledTier):
    """See the module docstring. ``store``: the HostStore (built with paged masters);
    ``optimizer``: the HostOptimizer (per-layer CPU Adam); ``folder``: the checked nvme_path;
    ``engine``: the I/O engine (storage/io_engine.py); ``buffer_count`` >= 2."""

    def __init__(
        self, store: Any, optimizer: Any, *, folder: str, rank: int, engine: IOEngine,
        buffer_count: int, slice_bytes: int = 0,
    ) -> None:  # fmt: skip
        self.store = store
        self.inner = optimizer.optimizer
        self._records = _layouts(store, align=_SLICE_ALIGN if slice_bytes else _ELEM_ALIGN)
        live = [r for r in self._records if r is not None]
        # sliced: the pool carries slices of at most ``slice_bytes``, never a whole layer
        self._slices = _slices(self._records, slice_bytes) if slice_bytes else None
        if self._slices is not None:
            largest = max((sl.nbytes for layer in self._slices for sl in layer), default=0)
            sizes = PoolSizes(round_up(max(largest, 1)))
        else:
            sizes = size_classes(r.nbytes for r in live)
        self.slice_bytes = slice_bytes
        self.disk_bytes = sum(r.nbytes for r in live)
        file = SwapFile(folder, f"rp_engine/rank{rank}/optimizer.swp", self.disk_bytes)
        self.path = file.path
        pool = RecordPool(self.path, engine, buffer_count=buffer_count, sizes=sizes)
        super().__init__(engine=engine, file=file, pool=pool)
        self.buffer_bytes = self.pool.buffer_bytes
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
        if rec is None or self._materialized is not None:  # materialized: already in RAM
            yield
            return
        held: Record = rec
        if self._slices is not None:
            if len(self._slices[layer]) > 1:
                if dirty:
                    raise RuntimeError(
                        f"layer {layer}'s optimizer state is sliced: step it slice by slice "
                        "(resident_slice)"
                    )
                with self._mapped_layer(rec):
                    yield
                return
            held = self._slices[layer][0]  # one slice: laid out as the layer's record
        self.pool.pin([held], on_first=lambda _r, data: self._attach(rec, data))
        try:
            yield
        finally:
            self.pool.unpin([held], dirty=dirty, on_last=lambda _r, data: self._detach(rec, data))

    def slice_count(self, layer: int) -> int:
        """How many slices the optimizer steps ``layer``'s state in (``resident_slice``); 0
        when it is held whole (``resident``)."""
        return 0 if self._slices is None else len(self._slices[layer])

    @contextlib.contextmanager
    def resident_slice(self, layer: int, index: int) -> Iterator[list[StateSegment]]:
        """Slice ``index`` of ``layer``'s masters and moments, read into a buffer (when none
        holds it) for the block, as flat segments of its tensors the block changes in place;
        written back after. The masters themselves stay placeholders."""
        assert self._slices is not None and self._materialized is None
        sl = self._slices[layer][index]
        (data,) = self.pool.pin([sl])
        segments: list[StateSegment] = []
        try:
            floats = data.view(torch.float32)
            pos = 0
            for hp, a, b in sl.segments:
                span = b - a
                stop = min(b, hp.master.numel())
                views = [floats[pos + k * span : pos + k * span + stop - a] for k in range(3)]
                segments.append(StateSegment(hp.master, a, stop, *views))
                pos += 3 * span
            for hp, _a, _b in sl.segments:  # the optimizer keeps a stepped master's count
                state = self.inner.state[hp.master]
                if not state:
                    ph = self._placeholders[id(hp)]
                    state.update(step=0, exp_avg=ph, exp_avg_sq=ph)
            yield segments
        finally:
            for seg in segments:  # never stepped (no gradient): no state, as ``_ingest`` does
                if not self.inner.state.get(seg.master, {}).get("step"):
                    self.inner.state.pop(seg.master, None)
            self.pool.unpin([sl], dirty=True)

    def prefetch(self, layers: Iterable[int]) -> None:
        """Start reading these layers' records (in this order) into free buffers, without
        blocking: a hint for what the optimizer steps next."""
        if self._slices is not None:
            self.pool.prefetch(sl for layer in layers for sl in self._slices[layer])
            return
        self.pool.prefetch(r for r in (self._records[layer] for layer in layers) if r is not None)

    @contextlib.contextmanager
    def _mapped_layer(self, rec: _Record) -> Iterator[None]:
        """``rec``'s masters and moments as views of the swap file mapped into memory, read
        only (page cache, not anonymous memory): a sliced layer outside its step (the publish
        of unchanged masters, a streamed checkpoint save)."""
        self.pool.flush()  # the slices written back: the file holds the state
        mapped = MappedFile(self.path, rec.offset + rec.nbytes, writable=False)
        try:
            self._attach(rec, mapped.tensor[rec.offset : rec.offset + rec.nbytes])
            try:
                yield
            finally:
                self._ingest(rec, mapped.tensor[rec.offset : rec.offset + rec.nbytes], ingest=False)
                mapped.release(rec.offset, rec.nbytes)
        finally:
            mapped.close()

    @contextlib.contextmanager
    def materialized(self, *, writable: bool) -> Iterator[None]:
        """Every layer's masters and moments as tensors for the block: views of the swap file
        mapped into memory (mapped.py: page cache, not a copy of the state in RAM).
        ``writable``: what the block leaves in them (checkpoint load: new tensors put into the
        optimizer's state included) is the file's content at exit. No step may run. Nested
        blocks share the outermost one (a writable one needs a writable outer block)."""
        if self._materialized is not None:
            if writable and not self._materialized:
                raise RuntimeError("a writable materialized() inside a read-only one")
            yield
            return
        self.flush()
        if self.pool.pinned():
            raise RuntimeError("materialized() while a layer is resident")
        mapped = MappedFile(self.path, self.disk_bytes, writable=writable)
        whole = mapped.tensor
        live = [r for r in self._records if r is not None]
        for rec in live:
            self._attach(rec, whole[rec.offset : rec.offset + rec.nbytes])
        self._materialized = writable
        try:
            yield
        finally:
            self._materialized = None
            for rec in live:  # one layer at a time: its pages leave the process after it
                self._ingest(rec, whole[rec.offset : rec.offset + rec.nbytes], ingest=writable)
                mapped.release(rec.offset, rec.nbytes)
            del whole
            if writable:
                self.pool.forget()  # the buffers' copies are older than the file now
            mapped.close()

    # --- internals ----------------------------------------------------------------------------
    def _write_initial(self) -> None:
        """Masters from the compute weights (as a host-resident master is made), zero moments,
        one record at a time through the pool: RAM never holds more than the pool."""
        start = last = time.monotonic()
        live = [r for r in self._records if r is not None]
        for i, rec in enumerate(live):
            for piece, spans in self._initial_pieces(rec):
                (view,) = self.pool.pin([piece], fresh=True)
                view.zero_()
                floats = view.view(torch.float32)
                for hp, a, stop, pos in spans:
                    floats[pos : pos + stop - a].copy_(hp.param.detach().reshape(-1)[a:stop])
                self.pool.unpin([piece], dirty=True)  # it stays cached: a hit later
            if time.monotonic() - last > 15:
                last = time.monotonic()
                log.warning(
                    "NVMe tier: writing the initial optimizer state, layer %d of %d (%.0f s)",
                    i + 1, len(live), last - start,
                )  # fmt: skip
        self.flush()

    def _initial_pieces(
        self, rec: _Record
    ) -> Iterator[tuple[Record, list[tuple[Any, int, int, int]]]]:
        """The pool records ``rec`` is written through (itself, or its slices), each with where
        its masters go: (HostParam, first element, end element, element offset in the piece)."""
        if self._slices is None:
            yield rec, [(hp, 0, hp.master.numel(), s) for hp, s, _n in rec.params]
            return
        for sl in self._slices[rec.key]:
            spans, pos = [], 0
            for hp, a, b in sl.segments:
                spans.append((hp, a, min(b, hp.master.numel()), pos))
                pos += 3 * (b - a)
            yield sl, spans

    def _attach(self, rec: Record, data: torch.Tensor) -> None:
        assert isinstance(rec, _Record)
        floats = data.view(torch.float32)
        for hp, s, n in rec.params:
            views = [floats[s + k * n : s + k * n + hp.master.numel()].view(hp.master.shape)
                     for k in range(3)]  # fmt: skip
            hp.master.data = views[0]
            state = self.inner.state[hp.master]
            if not state:  # never stepped: the kernel starts from step 0 and zero moments
                state["step"] = 0
            state["exp_avg"], state["exp_avg_sq"] = views[1], views[2]

    def _detach(self, rec: Record, data: torch.Tensor) -> None:
        self._ingest(rec, data, ingest=False)

    def _ingest(self, rec: Record, data: torch.Tensor, *, ingest: bool) -> None:
        """Point the record's masters and moments back at their placeholders; ``ingest``: copy
        what the caller put in their place into the record's bytes first."""
        assert isinstance(rec, _Record)
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
