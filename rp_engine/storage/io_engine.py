"""I/O engines: move aligned buffers to and from files, off the Python thread that asks.

Two engines, the same files and the same results:

- ``AioEngine``: DeepSpeed's aio op (libaio, O_DIRECT, its own thread pool), configured by the
  ds_config ``aio`` block (``block_size``, ``queue_depth``, ``intra_op_parallelism``,
  ``single_submit``, ``overlap_events``). Used when the op is already built: its first JIT build
  takes minutes, so ``initialize`` never starts one (``make install`` builds it once, cached
  beside CPU Adam; ``python -m rp_engine.storage.build_aio`` does it by hand).
- ``ThreadEngine``: threads doing ``os.preadv``/``os.pwritev`` on files opened with O_DIRECT, in
  ``block_size`` pieces (both calls release the GIL). Where the filesystem refuses O_DIRECT
  (tmpfs), the same calls go through the page cache; ``direct`` says which.

Every operation is submitted from any thread and returns a ``Future``; ``stats`` counts bytes and
the time at least one operation was in flight (``busy_s``): the NVMe row of the timeline.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from rp_engine.optim.jit_cache import cpu_adam_cache_dir, extensions_dir, op_load_guard
from rp_engine.storage.aligned import ALIGN, aligned_empty, round_up

__all__ = ["AioEngine", "IOEngine", "IOStats", "ThreadEngine", "aio_op_built", "make_io_engine"]

log = logging.getLogger("rp_engine.storage")

_CHOICES = ("auto", "aio", "threads")


@dataclass
class IOStats:
    """Totals since the engine started (take differences for a window)."""

    read_bytes: int = 0
    write_bytes: int = 0
    busy_s: float = 0.0  # wall time with at least one operation in flight
    reads: int = 0
    writes: int = 0

    def minus(self, before: IOStats) -> IOStats:
        return self.plus(before, sign=-1)

    def plus(self, other: IOStats, *, sign: int = 1) -> IOStats:
        """Field by field ``self + sign * other`` (two engines' totals; a window's)."""
        return IOStats(
            self.read_bytes + sign * other.read_bytes,
            self.write_bytes + sign * other.write_bytes,
            self.busy_s + sign * other.busy_s,
            self.reads + sign * other.reads,
            self.writes + sign * other.writes,
        )


class IOEngine:
    """Base: a pool of worker threads running ``_pread``/``_pwrite``; counts bytes and busy time.

    ``read(path, buffer, offset)`` fills ``buffer`` (a contiguous uint8 tensor from
    ``aligned_empty``, length a multiple of 4 KiB) from ``path`` at ``offset`` (4 KiB aligned);
    ``write`` is the reverse. Both return a ``Future`` whose ``result()`` raises the I/O error
    (an ``OSError`` naming the file).
    """

    name = "base"
    direct = True

    def __init__(self, workers: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"rp-{self.name}")
        self._lock = threading.Lock()
        self._stats = IOStats()
        self._inflight = 0
        self._since = 0.0

    @property
    def stats(self) -> IOStats:
        with self._lock:
            busy = self._stats.busy_s
            if self._inflight:
                busy += time.perf_counter() - self._since
            return IOStats(
                self._stats.read_bytes, self._stats.write_bytes, busy,
                self._stats.reads, self._stats.writes,
            )  # fmt: skip

    def read(self, path: str, buffer: torch.Tensor, offset: int) -> Future[None]:
        return self._submit(self._pread, path, buffer, offset, write=False)

    def write(self, path: str, buffer: torch.Tensor, offset: int) -> Future[None]:
        return self._submit(self._pwrite, path, buffer, offset, write=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def describe(self) -> str:
        return self.name

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` this engine moves fastest (4 KiB aligned uint8)."""
        return aligned_empty(nbytes)

    # --- for subclasses ----------------------------------------------------------------------
    def _pread(self, path: str, buffer: torch.Tensor, offset: int) -> None:
        raise NotImplementedError

    def _pwrite(self, path: str, buffer: torch.Tensor, offset: int) -> None:
        raise NotImplementedError

    def _submit(
        self, fn: Callable[[str, torch.Tensor, int], None], path: str, buffer: torch.Tensor,
        offset: int, *, write: bool,
    ) -> Future[None]:  # fmt: skip
        _check_aligned(buffer, offset)

        def run() -> None:
            self._begin()
            try:
                fn(path, buffer, offset)
            finally:
                self._end(buffer.numel(), write=write)

        return self._pool.submit(run)

    def _begin(self) -> None:
        with self._lock:
            if self._inflight == 0:
                self._since = time.perf_counter()
            self._inflight += 1

    def _end(self, nbytes: int, *, write: bool) -> None:
        with self._lock:
            self._inflight -= 1
            if self._inflight == 0:
                self._stats.busy_s += time.perf_counter() - self._since
            if write:
                self._stats.write_bytes += nbytes
                self._stats.writes += 1
            else:
                self._stats.read_bytes += nbytes
                self._stats.reads += 1


def _check_aligned(buffer: torch.Tensor, offset: int) -> None:
    if buffer.dtype != torch.uint8 or not buffer.is_contiguous():
        raise ValueError("I/O buffers are contiguous uint8 tensors (storage.aligned_empty)")
    if buffer.data_ptr() % ALIGN or buffer.numel() % ALIGN or offset % ALIGN:
        raise ValueError(
            f"O_DIRECT needs 4 KiB alignment: buffer at {buffer.data_ptr():#x}, "
            f"{buffer.numel()} bytes, file offset {offset}"
        )


class ThreadEngine(IOEngine):
    """The built-in engine: O_DIRECT ``preadv``/``pwritev`` on worker threads (see the module
    docstring). ``threads`` operations run at once; each moves ``block_size`` bytes per call."""

    name = "threads"

    def __init__(self, *, block_size: int = 1 << 20, threads: int = 2) -> None:
        super().__init__(max(1, threads))
        self.block_size = max(ALIGN, block_size - block_size % ALIGN)
        self._fds: dict[str, int] = {}
        self._fd_lock = threading.Lock()
        self.direct = True

    def describe(self) -> str:
        mode = "O_DIRECT" if self.direct else "buffered (the filesystem refuses O_DIRECT)"
        return f"built-in threads, {mode}, {self.block_size >> 10} KiB blocks"

    def _fd(self, path: str) -> int:
        with self._fd_lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._open(path)
                self._fds[path] = fd
            return fd

    def _open(self, path: str) -> int:
        if self.direct:
            try:
                return os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.warning("%s: the filesystem refuses O_DIRECT; using buffered I/O", path)
                self.direct = False
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def _pread(self, path: str, buffer: torch.Tensor, offset: int) -> None:
        fd, view = self._fd(path), _bytes_of(buffer)
        for start in range(0, len(view), self.block_size):
            piece = view[start : start + self.block_size]
            got = os.preadv(fd, [piece], offset + start)
            if got != len(piece):
                raise OSError(
                    errno.EIO, f"short read: {got} of {len(piece)} bytes at {offset + start}", path
                )

    def _pwrite(self, path: str, buffer: torch.Tensor, offset: int) -> None:
        fd, view = self._fd(path), _bytes_of(buffer)
        for start in range(0, len(view), self.block_size):
            piece = view[start : start + self.block_size]
            done = 0
            while done < len(piece):  # a full disk shows as a short write, then ENOSPC
                done += os.pwritev(fd, [piece[done:]], offset + start + done)

    def close(self) -> None:
        super().close()
        with self._fd_lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _bytes_of(buffer: torch.Tensor) -> memoryview:
    """The tensor's bytes, shared (no copy), for os.preadv/os.pwritev."""
    return memoryview(buffer.numpy()).cast("B")  # type: ignore[arg-type]


class AioEngine(IOEngine):
    """DeepSpeed's aio op (see the module docstring). One handle, used by one worker thread of
    ours (a handle waits for all its operations at once); its own ``intra_op_parallelism``
    threads and ``queue_depth`` libaio requests do the parallel I/O."""

    name = "aio"

    def __init__(
        self, op: Any, *, block_size: int, queue_depth: int, intra_op_parallelism: int,
        single_submit: bool, overlap_events: bool,
    ) -> None:  # fmt: skip
        super().__init__(1)
        self._handle = op.aio_handle(
            block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism
        )
        self._locked: list[torch.Tensor] = []
        self._desc = (
            f"DeepSpeed aio (libaio, O_DIRECT), block_size {block_size >> 10} KiB, queue_depth "
            f"{queue_depth}, intra_op_parallelism {intra_op_parallelism}, single_submit "
            f"{single_submit}, overlap_events {overlap_events}"
        )

    def describe(self) -> str:
        return self._desc

    def alloc(self, nbytes: int) -> torch.Tensor:
        """Page-locked memory from the op's own allocator: the op copies any other buffer
        through a bounce buffer it allocates and locks per operation (3x slower here). Falls
        back to plain aligned memory where locking is refused (RLIMIT_MEMLOCK)."""
        size = round_up(max(nbytes, 1))
        try:
            buf = self._handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
        except RuntimeError as exc:
            log.warning(
                "aio: no page-locked buffer of %d bytes (%s); using plain memory", size, exc
            )
            return aligned_empty(size)
        self._locked.append(buf)
        return buf

    def close(self) -> None:
        super().close()
        for buf in self._locked:  # the tier is closed: nothing reads its buffers any more
            self._handle.free_cpu_locked_tensor(buf)
        self._locked.clear()

    def _pread(self, path: str, buffer: torch.Tensor, offset: int) -> None:
        if self._handle.sync_pread(buffer, path, offset) < 0:
            raise OSError(errno.EIO, f"aio read of {buffer.numel()} bytes at {offset} failed", path)

    def _pwrite(self, path: str, buffer: torch.Tensor, offset: int) -> None:
        if self._handle.sync_pwrite(buffer, path, offset) < 0:
            raise OSError(
                errno.EIO, f"aio write of {buffer.numel()} bytes at {offset} failed", path
            )


def aio_op_built() -> bool:
    """Whether DeepSpeed's aio op is built in the extensions cache (loading it is then quick)."""
    for _dirpath, _, files in os.walk(cpu_adam_cache_dir()):
        if "async_io.so" in files:
            return True
    return False


def load_aio_op() -> Any:
    """DeepSpeed's aio op from the shared extensions cache (building it when it is not there:
    minutes on 2 cores). Raises when it cannot build (no libaio-dev)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    builder = AsyncIOBuilder()
    cache = cpu_adam_cache_dir()
    with extensions_dir(cache):
        if not builder.is_compatible(verbose=False):
            raise RuntimeError(
                "DeepSpeed's aio op cannot build here: install libaio-dev (apt-get install "
                "libaio-dev) and run `python -m rp_engine.storage.build_aio`"
            )
        # a build lock left by a killed loader never wedges this load (optim/jit_cache.py)
        with op_load_guard(builder.name, cache):
            return builder.load(verbose=False)


def make_io_engine(choice: str, aio: Any) -> IOEngine:
    """The engine ``choice`` names ("auto", "aio", "threads"), configured by ``aio`` (the
    ds_config AioConfig). "auto": the aio op when it is built, else the built-in threads; "aio"
    raises when the op cannot load. Logs once which engine runs."""
    if choice not in _CHOICES:
        raise ValueError(f"io engine {choice!r}: expected one of {', '.join(_CHOICES)}")
    engine: IOEngine | None = None
    if choice == "aio" or (choice == "auto" and aio_op_built()):
        try:
            engine = AioEngine(
                load_aio_op(), block_size=aio.block_size, queue_depth=aio.queue_depth,
                intra_op_parallelism=aio.intra_op_parallelism, single_submit=aio.single_submit,
                overlap_events=aio.overlap_events,
            )  # fmt: skip
        except Exception as exc:
            if choice == "aio":
                raise
            log.warning("DeepSpeed's aio op did not load (%s); using the built-in engine", exc)
    if engine is None:
        threads = max(2, aio.intra_op_parallelism)
        engine = ThreadEngine(block_size=aio.block_size, threads=threads)
    log.info("NVMe tier I/O engine: %s", engine.describe())
    return engine
