"""A swap file mapped into memory: how the NVMe tiers show their whole state at once.

``materialized`` (checkpoint load, ``reload_masters``, ``save_16bit_model``) needs every layer's
masters, moments or weights as tensors at the same time. A buffer of the whole state would need
the RAM the tiers exist to save; a mapping of the swap file does not: its pages are the kernel's
page cache, read on first touch and evictable under memory pressure (written back first when
dirty), so a state several times the RAM still maps. ``release`` drops a range's pages from the
process once it is done with them, so the resident set stays near what is in use.

A writable mapping is shared (``MAP_SHARED``): what the block writes is the file's content once
``close`` has flushed it. A read-only one is private (copy on write), so a stray write never
reaches the file. The tiers' pools use O_DIRECT on the same file; they flush before mapping and
forget their buffers after a writable mapping, and ``close`` flushes the mapping's dirty pages to
the file, so neither side ever sees the other's stale bytes.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

__all__ = ["MappedFile"]


class MappedFile:
    """The first ``nbytes`` of ``path`` as a uint8 tensor (``tensor``); ``writable``: shared,
    writes reach the file by ``close``; else private."""

    def __init__(self, path: str, nbytes: int, *, writable: bool) -> None:
        self.writable = writable
        self._map: mmap.mmap | None = None
        if nbytes == 0:  # mmap refuses an empty mapping: nothing to show
            self.tensor = torch.empty(0, dtype=torch.uint8)
            return
        with open(path, "r+b" if writable else "rb") as f:  # the mapping outlives the fd
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY
            self._map = mmap.mmap(f.fileno(), nbytes, access=access)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    def release(self, offset: int, nbytes: int) -> None:
        """Drop the pages of ``[offset, offset + nbytes)`` (4 KiB aligned) from the process: a
        shared mapping's writes stay in the page cache, a private one's are discarded."""
        if self._map is not None and nbytes > 0:
            self._map.madvise(mmap.MADV_DONTNEED, offset, nbytes)

    def close(self) -> None:
        """Flush a writable mapping's writes to the file and unmap. Tensors still viewing it
        keep it mapped until they are gone (the unmapping is left to them)."""
        if self._map is None:
            return
        if self.writable:
            self._map.flush()
        self.tensor = torch.empty(0, dtype=torch.uint8)
        mapping, self._map = self._map, None
        with contextlib.suppress(BufferError):  # a view still alive: unmapped when it dies
            mapping.close()
