"""Issue 42 item 6: a killed JIT build never wedges later runs.

torch's JIT loader takes ``<TORCH_EXTENSIONS_DIR>/<op>/lock`` (a FileBaton: O_CREAT|O_EXCL, no
owner recorded) even to load an op already built, and waits forever, silently, while it exists. A
loader killed in that window (an OOM kill) left the file, and every later run on the machine slept
in ``baton.wait()``. ``op_load_guard`` (rp_engine/host/jit_cache.py) clears a lock no live
process holds and says what it waits for otherwise.

The killed loader is a real child process, SIGKILLed while it holds the rp_engine loader flock and
torch's lock (fd open, as torch's FileBaton keeps it): the child does at the OS level what a
guarded load does, so it starts in a fraction of a second (no torch import). The guarded "load"
in this process is torch's own ``FileBaton.try_acquire``: False is what sends torch into its
endless wait. Waits run in a thread joined with a generous timeout, so a regression fails the
test instead of hanging the suite; no other timing is asserted.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.utils.file_baton import FileBaton

from rp_engine.host.jit_cache import (
    BUILD_LOCK,
    LOADER_FLOCK,
    STALE_AFTER_S,
    cpu_adam_cache_dir,
    op_load_guard,
)

_ROOT = Path(__file__).resolve().parents[2]
_OP = "rp_test_op"  # never a DeepSpeed op name: no in-process "already loaded" shortcut
_HANG_S = 90.0  # a guarded load taking this long counts as a hang

# A loader mid-load, as op_load_guard + torch leave the build folder: the rp_engine loader flock
# held (pid written), torch's lock created O_CREAT|O_EXCL with its fd kept open. "hold" then
# waits for a line on stdin and releases like torch (remove the lock, then drop the flock),
# reporting whether the lock was still there; "die" just waits to be killed.
_LOADER = textwrap.dedent(
    """
    import fcntl, os, sys
    build_dir, flock_name, lock_name, mode = sys.argv[1:5]
    os.makedirs(build_dir, exist_ok=True)
    fd = os.open(os.path.join(build_dir, flock_name), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{os.getpid()}\\n".encode())
    lock = os.path.join(build_dir, lock_name)
    baton = os.open(lock, os.O_CREAT | os.O_EXCL)
    print("ready", flush=True)
    sys.stdin.readline()
    if mode == "hold":
        print("intact" if os.path.exists(lock) else "removed", flush=True)
        os.close(baton)
        os.remove(lock)
        os.close(fd)
    """
)

# A build step of another program running in the build folder (ninja, a compiler): it holds no
# lock of ours and has torch's lock not open, only its working directory shows it is alive.
_BUILDER = "import sys; print('ready', flush=True); sys.stdin.readline()"


class _Records(logging.Handler):
    """The rp_engine.optim log records, from any thread."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def wait_for(self, text: str, timeout: float = _HANG_S) -> str:
        deadline = time.monotonic() + timeout
        while True:  # looks at least once
            for message in list(self.messages):
                if text in message:
                    return message
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        raise AssertionError(f"no log message with {text!r}; got {self.messages}")


@pytest.fixture
def records() -> Iterator[_Records]:
    handler = _Records()
    logger = logging.getLogger("rp_engine.optim")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _start(script: str, *args: str, cwd: Path | None = None) -> subprocess.Popen[str]:
    """A child running ``script``, once it printed "ready"."""
    child = subprocess.Popen(
        [sys.executable, "-c", script, *args], cwd=cwd, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    return child


def _killed_loader(build_dir: Path) -> None:
    """Leave ``build_dir`` as a loader SIGKILLed mid-load leaves it: torch's lock, no holder."""
    child = _start(_LOADER, str(build_dir), LOADER_FLOCK, BUILD_LOCK, "die")
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=_HANG_S)
    assert (build_dir / BUILD_LOCK).exists()


class _GuardedLoad(threading.Thread):
    """``op_load_guard(_OP, ext_dir)`` around torch's baton, in a thread: ``acquired`` is what
    torch's ``try_acquire`` answered inside the guard (None until the body ran)."""

    def __init__(self, ext_dir: Path) -> None:
        super().__init__(daemon=True)
        self.ext_dir = ext_dir
        self.acquired: bool | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with op_load_guard(_OP, str(self.ext_dir)):
                baton = FileBaton(str(self.ext_dir / _OP / BUILD_LOCK))
                self.acquired = bool(baton.try_acquire())
                if self.acquired:
                    baton.release()
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def finish(self) -> bool:
        self.join(_HANG_S)
        assert not self.is_alive(), f"the guarded load still waits after {_HANG_S:.0f} s"
        if self.error is not None:
            raise self.error
        assert self.acquired is not None
        return self.acquired


def _send_line(child: subprocess.Popen[str]) -> str:
    """Tell a waiting child to go on; its next line of output."""
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write("go\n")
    child.stdin.flush()
    return child.stdout.readline().strip()


def test_a_lock_left_by_a_killed_loader_is_cleared(tmp_path: Path, records: _Records) -> None:
    """The killed loader's flock died with it, nobody has the lock open or builds there: the
    next guarded load removes it, says so naming it, and torch's baton is free inside."""
    _killed_loader(tmp_path / _OP)
    load = _GuardedLoad(tmp_path)
    load.start()
    assert load.finish(), "torch's lock was still there: torch would wait for it forever"
    removed = records.wait_for("removed a stale build lock", timeout=0)
    assert str(tmp_path / _OP / BUILD_LOCK) in removed
    assert not (tmp_path / _OP / BUILD_LOCK).exists()


def test_an_old_lock_without_any_loader_record_is_cleared(tmp_path: Path) -> None:
    """A lock from before the guard existed (no loader flock file at all) goes the same way."""
    lock = tmp_path / _OP / BUILD_LOCK
    lock.parent.mkdir()
    lock.touch()
    old = time.time() - 10 * STALE_AFTER_S
    os.utime(lock, (old, old))
    load = _GuardedLoad(tmp_path)
    load.start()
    assert load.finish()


def test_a_live_loader_is_waited_for_and_named(tmp_path: Path, records: _Records) -> None:
    """A loader that is alive keeps its lock: the guard waits, logs whom it waits for and how
    to end the wait, and goes on once the loader releases."""
    child = _start(_LOADER, str(tmp_path / _OP), LOADER_FLOCK, BUILD_LOCK, "hold")
    try:
        load = _GuardedLoad(tmp_path)
        load.start()
        waiting = records.wait_for(f"waiting for process {child.pid} ")
        assert str(tmp_path / _OP / LOADER_FLOCK) in waiting
        assert load.is_alive() and load.acquired is None
        assert _send_line(child) == "intact", "the live loader's lock was removed"
        assert child.wait(timeout=_HANG_S) == 0
        assert load.finish()
    finally:
        child.kill()
        child.wait()


def test_a_process_building_in_the_folder_keeps_the_lock(tmp_path: Path, records: _Records) -> None:
    """Another program's build (no rp_engine flock, lock fd not open, but a process running in
    the build folder: torch runs ninja there) keeps even an old lock: the guard waits, naming
    the lock, the holder and the command that clears it by hand. Once that process is gone
    (killed with its loader, leaving the lock) the lock is stale and cleared."""
    lock = tmp_path / _OP / BUILD_LOCK
    lock.parent.mkdir()
    lock.touch()
    old = time.time() - 10 * STALE_AFTER_S
    os.utime(lock, (old, old))
    builder = _start(_BUILDER, cwd=lock.parent)
    try:
        load = _GuardedLoad(tmp_path)
        load.start()
        waiting = records.wait_for(f"held by process {builder.pid}")
        assert f"rm {lock}" in waiting
        assert lock.exists() and load.is_alive()
        _send_line(builder)
        assert builder.wait(timeout=_HANG_S) == 0
        assert load.finish()
        assert any("removed a stale build lock" in m for m in records.messages)
    finally:
        builder.kill()
        builder.wait()


def _built_cpu_adam() -> Path | None:
    folder = Path(cpu_adam_cache_dir()) / "cpu_adam"
    return folder if (folder / "cpu_adam.so").exists() else None


_INITIALIZE = textwrap.dedent(
    """
    import torch
    from torch import nn
    import rp_engine

    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    model.loss_fn = nn.functional.cross_entropy
    engine, *_ = rp_engine.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "roundpipe": {"devices": "cpu:1"},
    })
    print("optimizer:", type(engine.optimizer.optimizer).__name__, flush=True)
    engine.destroy()
    """
)


@pytest.mark.skipif(_built_cpu_adam() is None, reason="DeepSpeed's CPU Adam is not built here")
def test_initialize_goes_past_a_cpu_adam_lock_left_by_a_killed_loader(tmp_path: Path) -> None:
    """End to end: ``rp_engine.initialize`` with AdamW (DeepSpeed's CPU Adam) over an extensions
    dir whose ``cpu_adam/lock`` a killed loader left. A copy of the built op (objects, ninja
    state and mtimes: ninja finds nothing to do), so the shared cache is never touched and
    nothing is rebuilt. Before the guard this child slept in torch's ``baton.wait()`` forever."""
    built = _built_cpu_adam()
    assert built is not None
    ext = tmp_path / "ext"
    shutil.copytree(
        built, ext / "cpu_adam", ignore=shutil.ignore_patterns(BUILD_LOCK, LOADER_FLOCK)
    )
    _killed_loader(ext / "cpu_adam")
    paths = [str(_ROOT), str(_ROOT / "tests" / "support"), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(ext),
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _INITIALIZE], env=env, cwd=tmp_path,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"rp_engine.initialize hung on the leftover lock ({exc.timeout:.0f} s)")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "optimizer: DeepSpeedCPUAdam" in proc.stdout, proc.stdout
    assert "removed a stale build lock" in proc.stderr
    assert str(ext / "cpu_adam" / BUILD_LOCK) in proc.stderr
    assert not (ext / "cpu_adam" / BUILD_LOCK).exists()
