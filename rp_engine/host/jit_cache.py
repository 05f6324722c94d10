"""Where rp_engine's JIT-built native code is cached: DeepSpeed's CPU Adam and aio ops and the
publish kernels of optim/publish_kernel.py all build once per machine into one user cache, so CI
runs and later sessions reuse builds that take minutes on 2 cores. Its own module because the
optimizer, the publish kernels and the storage tier all need it and none of them should import
another for it.

Every build runs the ninja of this interpreter's environment (the ``ninja`` package rp_engine
depends on), whatever PATH says: ninja keys each object by a hash of its command that differs
between ninja versions (1.11 and 1.13 disagree), so a build by another ninja on PATH (a system
one) rebuilds every op in the shared cache, and the next build by the first ninja rebuilds them
again (the aio op: 2-10 minutes on 2 cores). Where DeepSpeed builds its own ops into this cache
(the tests' reference runs, some benchmarks), the entry point puts the same ninja first on PATH
with ``with_own_ninja``.

rp_engine loads DeepSpeed's ops (CPU Adam in optim/optimizer.py, aio in storage/io_engine.py)
under ``op_load_guard``: torch's JIT loader takes ``<ext_dir>/<op>/lock`` (a FileBaton: created
with O_CREAT|O_EXCL, no owner recorded) even when the op is already built, and waits for it
forever, without a word, when it exists. A process killed in that window (an OOM kill while loading) used to wedge every later run
on the machine. The guard clears such a lock when no live process holds it, and otherwise says
what it waits for."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

__all__ = [
    "cpu_adam_cache_dir",
    "every",
    "extensions_dir",
    "op_load_guard",
    "recorded_pid",
    "try_flock",
    "with_own_ninja",
]

log = logging.getLogger("rp_engine.optim")  # its name before the move: log settings keep working

BUILD_LOCK = "lock"  # torch's FileBaton in the op's build folder (cpp_extension._jit_compile)
LOADER_FLOCK = "rp_loader.flock"  # ours, beside it: flock-held by the rp_engine process loading
# A lock no live process holds is stale once at least this old. torch keeps the lock's fd open
# from creating it to removing it, so a live holder shows in /proc at once; the age only covers a
# torch that would close it early (and holders /proc hides: other users' processes).
STALE_AFTER_S = 2.0
_POLL_S = 0.25  # how often a wait looks again
_FIRST_NOTICE_S = 2.0  # a normal wait (a neighbour loading the op: about a second) stays quiet
NOTICE_EVERY_S = 10.0  # then a log line this often, so a long wait never looks like a hang


def cpu_adam_cache_dir() -> str:
    """Where DeepSpeed's JIT-built CPU Adam lives: $TORCH_EXTENSIONS_DIR when the user set it,
    else a user cache outside any checkout, so CI runs and later sessions on one machine reuse
    the ~1-2 minute build. Reads the environment, never writes it."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "rp_engine", "torch_extensions")
    return os.environ.get("TORCH_EXTENSIONS_DIR") or default


@contextlib.contextmanager
def extensions_dir(path: str) -> Iterator[None]:
    """DeepSpeed's JIT loader reads TORCH_EXTENSIONS_DIR from the environment only: set it for
    the build/load and put the user's environment back afterwards (DeepSpeed keeps the loaded
    op in-process, so later optimizers do not look again)."""
    before = {key: os.environ.get(key) for key in ("TORCH_EXTENSIONS_DIR", "PATH")}
    os.environ["TORCH_EXTENSIONS_DIR"] = path
    os.environ["PATH"] = with_own_ninja(before["PATH"] or "")  # torch runs `ninja` off PATH
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def with_own_ninja(path: str) -> str:
    """``path`` (a PATH value) with the folder of this environment's ninja first (see the module
    docstring), or unchanged when the ``ninja`` package is not installed."""
    try:
        import ninja
    except ImportError:
        return path
    own = str(ninja.BIN_DIR)
    rest = [entry for entry in path.split(os.pathsep) if entry and entry != own]
    return os.pathsep.join([own, *rest])


@contextlib.contextmanager
def op_load_guard(name: str, ext_dir: str) -> Iterator[None]:
    """Wrap one load of DeepSpeed's op ``name`` (``OpBuilder.NAME``: "cpu_adam", "async_io")
    whose build folder is ``<ext_dir>/<name>`` (torch's, with TORCH_EXTENSIONS_DIR=ext_dir, as
    ``extensions_dir(ext_dir)`` sets it).

    Contract: on entry the caller holds this machine's rp_engine loader lock for the op (an
    ``flock`` on ``<ext_dir>/<name>/rp_loader.flock``, which the kernel drops when the process
    dies), and torch's build lock ``<ext_dir>/<name>/lock`` is gone: removed with a warning naming
    it when no live process holds it (no open fd on it, nobody running in the build folder, at
    least ``STALE_AFTER_S`` old), else waited for. Every wait logs, after a short grace and then
    every ``NOTICE_EVERY_S`` seconds, what it waits for, for how long, and how to end it by hand.
    A lock left behind during the load (another program's loader dying in the build folder) is
    cleared the same way. An op already loaded in this process (DeepSpeed keeps it) is not looked
    at again: nothing is taken."""
    if _op_loaded(name):
        yield
        return
    build_dir = os.path.join(ext_dir, name)
    with _loader_flock(build_dir, name):
        _settle_build_lock(build_dir, name)
        with _orphan_watch(build_dir, name):
            yield


def _op_loaded(name: str) -> bool:
    """Whether DeepSpeed already loaded op ``name`` in this process (its ``load`` then returns
    it without touching the build folder). False when DeepSpeed's cache cannot be read."""
    try:
        from deepspeed.ops.op_builder.builder import OpBuilder
    except ImportError:
        return False
    return name in getattr(OpBuilder, "_loaded_ops", {})


@contextlib.contextmanager
def _loader_flock(build_dir: str, name: str) -> Iterator[None]:
    """Hold the rp_engine loader lock of ``build_dir`` for the block (waiting for another
    process's, with notices), with this pid written in it for the waiters' messages. Without a
    writable build folder the block runs unguarded: torch cannot take its lock there either."""
    path = os.path.join(build_dir, LOADER_FLOCK)
    try:
        os.makedirs(build_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        log.debug("no loader lock for %s (%s); loading unguarded", build_dir, exc)
        yield
        return
    try:
        _wait_until(
            lambda: try_flock(fd),
            lambda waited: log.warning(
                "waiting for process %s (another rp_engine run) to finish loading DeepSpeed's "
                "%s op in %s: %.0f s so far. It holds %s, which is released when it ends; if it "
                "hangs, end that process",
                recorded_pid(path), name, build_dir, waited, path,
            ),
        )  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # drops the flock


def try_flock(fd: int) -> bool:
    """Take the exclusive flock on ``fd`` if nobody holds it; never blocks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def recorded_pid(path: str) -> str:
    """The pid the holder of the lock file ``path`` wrote in it, or "?"."""
    try:
        with open(path) as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"


def _settle_build_lock(build_dir: str, name: str) -> None:
    """Return once torch's build lock in ``build_dir`` is gone: removed here when stale, else
    waited for with notices naming it and its holder."""
    lock = os.path.join(build_dir, BUILD_LOCK)
    holder: list[int | None] = [None]

    def gone() -> bool:
        cleared, holder[0] = _clear_if_stale(build_dir, name)
        return cleared

    def notice(waited: float) -> None:
        who = f"process {holder[0]}" if holder[0] is not None else "no live process seen"
        log.warning(
            "waiting for torch's build lock %s of DeepSpeed's %s op, held by %s: %.0f s so far. "
            "If no process is building or loading it, remove it by hand: rm %s",
            lock, name, who, waited, lock,
        )  # fmt: skip

    _wait_until(gone, notice)


def _clear_if_stale(build_dir: str, name: str) -> tuple[bool, int | None]:
    """(whether torch's build lock in ``build_dir`` is gone now, the live holder seen if not).
    Removes the lock, with a warning, when it is at least ``STALE_AFTER_S`` old and no live
    process holds it. The caller holds the rp_engine loader lock, so no rp_engine loader can."""
    lock = os.path.join(build_dir, BUILD_LOCK)
    try:
        before = os.stat(lock)
    except FileNotFoundError:
        return True, None
    holder = _lock_holder(build_dir, lock)
    age = time.time() - before.st_mtime  # torch never touches it after creating it
    if holder is not None or age < STALE_AFTER_S:
        return False, holder
    try:
        # the same file still (a loader elsewhere may have released it and taken a new one)
        if os.stat(lock).st_ino != before.st_ino:
            return False, None
        os.remove(lock)
    except FileNotFoundError:
        return True, None
    except OSError as exc:  # not ours to remove (another user's cache): say so and keep waiting
        log.warning("cannot remove the stale build lock %s (%s)", lock, exc)
        return False, None
    log.warning(
        "removed a stale build lock left by a process that died while loading DeepSpeed's %s "
        "op: %s (%.0f s old; no live process held it or was building in %s)",
        name, lock, age, build_dir,
    )  # fmt: skip
    return True, None


def _lock_holder(build_dir: str, lock: str) -> int | None:
    """A live process (this one included) that holds torch's build lock ``lock``: one with it
    open (torch's FileBaton keeps the fd from creating the file to removing it) or running in
    ``build_dir`` (torch runs ninja, and ninja the compilers, there). None when /proc shows none
    (processes of other users are not visible to a non-root user: the age test covers them)."""
    real_dir = os.path.realpath(build_dir)
    real_lock = os.path.realpath(lock)
    try:
        pids = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:  # no /proc: the age alone decides
        return None
    for pid in pids:
        if _runs_in(pid, real_dir) or _has_open(pid, real_lock):
            return int(pid)
    return None


def _runs_in(pid: str, folder: str) -> bool:
    """Whether process ``pid``'s working directory is ``folder`` or below it."""
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:  # gone, or not ours to look at
        return False
    return cwd == folder or cwd.startswith(folder + os.sep)


def _has_open(pid: str, path: str) -> bool:
    """Whether process ``pid`` has ``path`` open."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(os.path.join(fd_dir, fd)) == path:
                return True
        except OSError:
            continue
    return False


@contextlib.contextmanager
def _orphan_watch(build_dir: str, name: str) -> Iterator[None]:
    """For the block (the load), every ``NOTICE_EVERY_S`` seconds clear torch's build lock in
    ``build_dir`` if it went stale meanwhile: another program's loader (a DeepSpeed run, which
    takes no rp_engine lock) may have taken it after ``_settle_build_lock`` looked and then
    died, and torch would wait for it forever. A live holder (this load itself) is left alone."""
    with every(NOTICE_EVERY_S, lambda: _clear_if_stale(build_dir, name), f"rp-{name}-lock-watch"):
        yield


@contextlib.contextmanager
def every(seconds: float, fn: Callable[[], object], name: str) -> Iterator[None]:
    """Call ``fn`` every ``seconds`` on a daemon thread named ``name`` while the block runs
    (the first call ``seconds`` after it starts); the thread is joined when the block ends."""
    done = threading.Event()

    def run() -> None:
        while not done.wait(seconds):
            fn()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _wait_until(ready: Callable[[], bool], notice: Callable[[float], None]) -> None:
    """Poll ``ready`` every ``_POLL_S`` seconds until it is true; while waiting, call ``notice``
    with the seconds waited after ``_FIRST_NOTICE_S`` and then every ``NOTICE_EVERY_S``."""
    start = time.monotonic()
    next_notice = _FIRST_NOTICE_S
    while not ready():
        waited = time.monotonic() - start
        if waited >= next_notice:
            notice(waited)
            next_notice = waited + NOTICE_EVERY_S
        time.sleep(_POLL_S)
