"""The gradient tier: fp32 gradient buffers from a bounded pool, spilled to a gradient file.

With the NVMe optimizer tier the masters and moments leave RAM, but a whole-model fp32 gradient
arena (4 B per trainable parameter, 8 B double-buffered) would stay. Here each layer's gradient
of each step copy (two copies: step t+1's contributions land while step t's optimizer reads,
model/grad_buffers.py) is a *record* of a gradient file, carried by a few buffers:

::

    first contribution of layer l, copy c: a buffer taken fresh (nothing read)
    later contributions (other micro-batch rounds, a tied weight): added in the buffer
    the optimizer consumes (l, c): its buffer is released and forgotten, never written
    buffers all in use: the least recently used unpinned record is written to the file first
    (an eviction), and read back when it is needed again

So gradients touch the disk only when more of them are alive at once than the pool holds:
a step whose norm must be known before any layer steps (clipping, the non-finite guard) holds
every layer's gradient until the last one lands, and those beyond the pool spill. Nothing else
changes: the bytes read back are the bytes written, so results are bit-identical to the arena.

The pool's two size classes (record_pool.py) keep its RAM at the size of ordinary layers: host
memory of the tier is ``buffer_count`` x the largest ordinary layer's fp32 gradient, plus 2 x the
largest big one (an embedding, an LM head), whatever the number of layers. The file (2 x 4 B per
trainable parameter, reserved) is scratch of one run and removed at close.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from rp_engine.plan.host_ram import size_classes
from rp_engine.storage.aligned import ALIGN, round_up
from rp_engine.storage.io_engine import IOEngine
from rp_engine.storage.record_pool import PooledTier, Record, RecordPool
from rp_engine.storage.swap_file import SwapFile

__all__ = ["GradTier", "grad_records"]

log = logging.getLogger("rp_engine.storage")

COPIES = 2  # step t's gradients (read by the optimizer) and step t+1's (landing)


def grad_records(group_bytes: Sequence[int]) -> dict[tuple[int, int], Record]:
    """The gradient file's layout: record (copy, group) of every group owning gradients, each
    4 KiB aligned, copy 0's groups first."""
    records: dict[tuple[int, int], Record] = {}
    offset = 0
    for copy in range(COPIES):
        for group, nbytes in enumerate(group_bytes):
            if nbytes:
                records[(copy, group)] = Record((copy, group), offset, round_up(nbytes))
                offset += round_up(nbytes)
    return records


class GradTier(PooledTier):
    """The gradient records of ``group_bytes`` (per layer, fp32 bytes of the gradients it owns)
    in ``COPIES`` copies, under ``folder``; ``buffer_count`` buffers of the ordinary class;
    ``alloc(nbytes)`` allocates a buffer (4 KiB aligned uint8; pinned on CUDA). Implements the
    ``GradBlocks`` protocol of model/grad_buffers.py."""

    writes_initially = False  # scratch: written only when a record is evicted

    def __init__(
        self, group_bytes: Sequence[int], *, folder: str, rank: int, engine: IOEngine,
        buffer_count: int, alloc: Callable[[int], torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        self._records = grad_records(group_bytes)
        self.disk_bytes = sum(r.nbytes for r in self._records.values())
        file = SwapFile(folder, f"rp_engine/rank{rank}/grads.swp", max(self.disk_bytes, ALIGN))
        self.path = file.path
        sizes = size_classes(group_bytes)
        self.buffer_count = buffer_count
        self.big_count = sizes.big_count
        try:
            pool = RecordPool(
                self.path, engine, buffer_count=buffer_count, sizes=sizes, lazy=True, alloc=alloc
            )
        except BaseException:
            file.close()
            raise
        super().__init__(engine=engine, file=file, pool=pool)
        self.buffer_bytes = self.pool.buffer_bytes
        log.info(
            "gradient tier: %d buffers of %.1f MiB%s, file %s",
            buffer_count, sizes.ordinary / 2**20,
            f" + {self.big_count} of {sizes.big / 2**20:.1f} MiB" if sizes.big else "", self.path,
        )  # fmt: skip

    # --- the GradBlocks protocol (model/grad_buffers.py) -------------------------------------
    def size_class(self, group: int) -> int:
        """0: ``group``'s records share the ordinary buffers; 1: the big ones."""
        return 1 if self.pool.is_big(self._records[(0, group)]) else 0

    def capacity(self, size_class: int) -> int:
        """Buffers of a size class."""
        return self.big_count if size_class else self.buffer_count

    def pin(self, copy: int, group: int, *, fresh: bool) -> torch.Tensor:
        """The fp32 bytes of record (copy, group), pinned (read back from the file unless
        ``fresh``: the caller overwrites what it reads). Blocks while every buffer is pinned."""
        (data,) = self.pool.pin([self._records[(copy, group)]], fresh=fresh)
        return data.view(torch.float32)

    def try_pin(self, copy: int, group: int, *, fresh: bool) -> torch.Tensor | None:
        """``pin`` when it needs no wait or I/O, else None."""
        data = self.pool.try_pin(self._records[(copy, group)], fresh=fresh)
        return None if data is None else data.view(torch.float32)

    def unpin(self, copy: int, group: int, *, dirty: bool) -> None:
        self.pool.unpin([self._records[(copy, group)]], dirty=dirty)

    def discard(self, copy: int, group: int) -> None:
        """The record's bytes are consumed: forget them (never written)."""
        self.pool.discard(self._records[(copy, group)])

    def drop(self, copy: int, group: int) -> None:
        """A failed run's record: forget it and every pin on it."""
        self.pool.drop(self._records[(copy, group)])

    # --- tier ---------------------------------------------------------------------------------
    def flush(self) -> None:
        """Nothing to make durable (gradients are scratch): waits for evictions in flight."""
        self.pool.settle()
