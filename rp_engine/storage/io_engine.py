"""I/O engines: move aligned buffers to and from files, off the Python thread that asks.

Two engines, the same files and the same results:

- ``AioEngine``: DeepSpeed's aio op (libaio, O_DIRECT, its own thread pool), configured by the
  ds_config ``aio`` block (``block_size``, ``queue_depth``, ``intra_op_parallelism``,
  ``single_submit``, ``overlap_events``). Built on first use, not at install: its JIT build takes
  minutes (about 200 s on 2 cores), cached beside CPU Adam. With ``nvme_io_engine`` "auto" (the
  default) a run that finds it unbuilt uses ``ThreadEngine`` and starts one detached, low-priority
  background build (``python -m rp_engine.storage.build_aio --background``, its output in
  ``<extensions cache>/async_io_build.log``): the next run uses the op. ``RP_ENGINE_AIO_BUILD=0``
  turns that background build off (the tests do). "aio" asked explicitly builds it in the
  foreground, with a progress line every ``BUILD_NOTICE_S``. ``make aio`` (or ``python -m
  rp_engine.storage.build_aio``) builds it ahead of time; ``make test`` does.
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
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from rp_engine.host.jit_cache import (
    cpu_adam_cache_dir,
    every,
    extensions_dir,
    op_load_guard,
    recorded_pid,
    try_flock,
)
from rp_engine.storage.aligned import ALIGN, aligned_empty, round_up

__all__ = [
    "AIO_BUILD_ENV",
    "AioEngine",
    "IOEngine",
    "IOStats",
    "ThreadEngine",
    "aio_op_built",
    "load_aio_op",
    "make_io_engine",
]

log = logging.getLogger("rp_engine.storage")

_CHOICES = ("auto", "aio", "threads")

# The aio op's first-use build (see the module docstring).
AIO_BUILD_ENV = "RP_ENGINE_AIO_BUILD"  # "0" (or "false", "no", "off"): no background build
BUILD_LOG = "async_io_build.log"  # in the extensions cache: the background build's output
BUILD_MARKER = "async_io_build.flock"  # flock-held by the running background build; its pid
BUILD_FAILED = "async_io_build.failed"  # left by a background build that failed: not retried
BUILD_NOTICE_S = 15.0  # a foreground build says how far it is this often
BUILD_COMMAND = ("-m", "rp_engine.storage.build_aio", "--background")  # after sys.executable


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
    """DeepSpeed's aio op from the shared extensions cache, building it when it is not there
    (minutes on 2 cores: a warning says so first, and then every ``BUILD_NOTICE_S`` how long it
    has run, so the wait never looks like a hang). Raises when it cannot build (no libaio-dev)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    builder = AsyncIOBuilder()
    cache = cpu_adam_cache_dir()
    with extensions_dir(cache):
        if not builder.is_compatible(verbose=False):
            raise RuntimeError(
                f"DeepSpeed's aio op cannot build here: {_libaio_hint()}, then run "
                "`python -m rp_engine.storage.build_aio` (or `make aio`)"
            )
        # a build lock left by a killed loader never wedges this load (host/jit_cache.py)
        with op_load_guard(builder.name, cache):
            if aio_op_built():  # (built meanwhile by the process the guard waited for)
                return builder.load(verbose=False)
            return _build_in_foreground(builder, os.path.join(cache, builder.name))


def _build_in_foreground(builder: Any, build_dir: str) -> Any:
    """``builder.load`` when it JIT-builds the op: progress warnings while it runs."""
    start = time.monotonic()
    what = "DeepSpeed's aio op (async_io: libaio, O_DIRECT; with its pin_memory op)"
    log.warning(
        "building %s in %s: minutes on 2 cores, once per machine (`make aio` builds it ahead of "
        "time; a compiler error is raised at the end)", what, build_dir,
    )  # fmt: skip

    def progress() -> None:
        log.warning(
            "still building %s in %s: %.0f s so far", what, build_dir, time.monotonic() - start
        )

    with every(BUILD_NOTICE_S, progress, "rp-aio-build-progress"):
        op = builder.load(verbose=False)
    log.warning("built DeepSpeed's aio op in %.0f s", time.monotonic() - start)
    return op


def _libaio_hint() -> str:
    """How to get what the aio op's build needs (libaio's headers and library)."""
    if shutil.which("apt-get"):
        how = "`apt-get install libaio-dev`"
        if os.geteuid() == 0:
            how += " (`make aio` does it, as root)"
        return f"install libaio-dev: {how}"
    return "install libaio's development files (libaio-dev, libaio-devel)"


def background_build_enabled() -> bool:
    """Whether a run may start the aio op's background build (``RP_ENGINE_AIO_BUILD``, on when
    unset)."""
    value = os.environ.get(AIO_BUILD_ENV, "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def aio_op_buildable() -> bool:
    """Whether DeepSpeed's aio op can build here: DeepSpeed's own check, a test program that
    compiles and links against libaio (about a second). False when DeepSpeed cannot say."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        return bool(AsyncIOBuilder().is_compatible(verbose=False))
    except Exception as exc:  # a broken toolchain: no build either
        log.debug("DeepSpeed's aio compatibility check failed: %s", exc)
        return False


def spawn_background_build(
    command: list[str], *, log_path: str, env: dict[str, str], keep_fd: int
) -> int:
    """Start ``command`` detached (its own session: it outlives this run, and a Ctrl-C here does
    not reach it), stdin closed, stdout and stderr appended to ``log_path``, with ``keep_fd`` (the
    flock-held marker) inherited so the lock lives as long as the build. Returns its pid."""
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            cwd=os.path.dirname(log_path), start_new_session=True, pass_fds=(keep_fd,),
        )  # fmt: skip
    _children.append(proc)  # reaped by subprocess when it ends; never waited for here
    return proc.pid


_children: list[subprocess.Popen[bytes]] = []
_first_use_checked = False  # this process looked once already (several tiers: one message)


def _start_first_use_build() -> None:
    """The aio op is not built and "auto" runs without it: start its build in the background
    (once per process, one at a time per machine), or say why not. Never raises."""
    global _first_use_checked
    if _first_use_checked:
        return
    _first_use_checked = True
    if not background_build_enabled():
        log.info(
            "DeepSpeed's aio op is not built and %s=0: no background build (`make aio` builds "
            "it); the NVMe tier uses its built-in engine", AIO_BUILD_ENV,
        )  # fmt: skip
        return
    cache = cpu_adam_cache_dir()
    log_path = os.path.join(cache, BUILD_LOG)
    if os.path.exists(os.path.join(cache, BUILD_FAILED)):
        log.warning(
            "DeepSpeed's aio op is not built: its background build failed earlier (log: %s); "
            "the NVMe tier uses its built-in engine. `make aio` or `python -m "
            "rp_engine.storage.build_aio` tries again", log_path,
        )  # fmt: skip
        return
    if not aio_op_buildable():
        log.info(
            "DeepSpeed's aio op cannot build here: the NVMe tier uses its built-in engine. For "
            "the aio op, %s; the next run then builds it", _libaio_hint(),
        )  # fmt: skip
        return
    try:
        _spawn_once(cache, log_path)
    except OSError as exc:
        log.warning(
            "could not start the background build of DeepSpeed's aio op (%s); the NVMe tier "
            "uses its built-in engine (`make aio` builds the op)", exc,
        )  # fmt: skip


def _spawn_once(cache: str, log_path: str) -> None:
    """Start the background build unless one is running: the marker file's flock says so (the
    build inherits the locked descriptor; the kernel drops the lock when it ends)."""
    os.makedirs(cache, exist_ok=True)
    marker = os.path.join(cache, BUILD_MARKER)
    fd = os.open(marker, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        if not try_flock(fd):
            log.warning(
                "DeepSpeed's aio op is being built in the background by process %s (log: %s); "
                "this run uses the NVMe tier's built-in engine, runs started after the build "
                "ends use the aio op", recorded_pid(marker), log_path,
            )  # fmt: skip
            return
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["TORCH_EXTENSIONS_DIR"] = cache
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, env.get("PYTHONPATH", "")) if p
        )  # this rp_engine, whatever the build's folder
        pid = spawn_background_build(
            [sys.executable, *BUILD_COMMAND], log_path=log_path, env=env, keep_fd=fd
        )
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{pid}\n".encode(), 0)
        log.warning(
            "DeepSpeed's aio op is not built yet: building it in the background (process %d, low "
            "priority, a few minutes; log: %s). This run uses the NVMe tier's built-in engine; "
            "the next run uses the aio op. (%s=0 turns this off; `make aio` builds it ahead)",
            pid, log_path, AIO_BUILD_ENV,
        )  # fmt: skip
    finally:
        os.close(fd)  # the build keeps its inherited copy, and with it the lock


def make_io_engine(choice: str, aio: Any) -> IOEngine:
    """The engine ``choice`` names ("auto", "aio", "threads"), configured by ``aio`` (the
    ds_config AioConfig). "auto": the aio op when it is built, else the built-in threads (and
    the op's background build starts: see the module docstring); "aio" builds the op when it
    must (minutes, with progress lines) and raises when it cannot load. Logs once which engine
    runs."""
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
    elif choice == "auto":
        _start_first_use_build()
    if engine is None:
        threads = max(2, aio.intra_op_parallelism)
        engine = ThreadEngine(block_size=aio.block_size, threads=threads)
    log.info("NVMe tier I/O engine: %s", engine.describe())
    return engine
