"""Running a child command under a memory limit, and how much memory it used.

    run = run_limited([sys.executable, "child.py"], 2 * 2**30)
    assert not run.killed_by_limit and run.returncode == 0, run.stderr[-6000:]
    print(run.peak_bytes, run.mechanism)

Two ways, picked by ``cgroup_mechanism()`` (or forced with ``mechanism=``):

* ``"cgroup-v1"`` / ``"cgroup-v2"``: where this process may write to its own memory cgroup
  (root, a writable cgroupfs), a fresh child cgroup is made under the current process's memory
  cgroup (read from ``/proc/self/cgroup``, so the limit nests inside whatever limits this process
  already has), the limit set there (v1: ``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes``
  where swap accounting exists, ``memory.swappiness`` 0; v2: ``memory.max``, ``memory.swap.max``
  0) and the child started in it: a ``/bin/sh`` wrapper writes its own pid to ``cgroup.procs``
  and then execs the command, so nothing of the command runs before it is inside the group (the
  wrapper's pid is the command's pid: its return code is the command's). The kernel enforces the
  limit: past it the OOM killer SIGKILLs a process in the group (seen here as returncode -9 when
  it is the command itself). The peak is the kernel's high-water mark (v1:
  ``memory.max_usage_in_bytes``; v2: ``memory.peak``, or ``memory.current`` sampled every
  ``interval`` on kernels before 5.19); an OOM kill is read from the kernel's counter (v1:
  ``memory.oom_control``'s ``oom_kill``; v2: ``memory.events``' ``oom_kill``). The group is
  removed afterwards, also after a timeout, an error or Ctrl-C (its leftover processes killed
  first).

  The memory cgroup counts the page cache of the files the group reads or writes, not only
  anonymous memory: a child that streams a large file shows a peak up to the limit, yet is not
  killed for it (the kernel reclaims cache before it OOM-kills). File pages already cached by
  other processes stay charged to those. v2 cannot put a child group under a cgroup that holds
  processes and has no memory controller for its children; there the group is made beside the
  current one (a sibling under the same parent) instead.

* ``"rss-sampling"`` (not root, no memory cgroup): the child runs plainly, in its own session;
  the summed RSS of its process tree (psutil) is sampled every ``interval`` (~20 ms) and the
  whole tree SIGKILLed once it exceeds the limit. A soft limit: growth between two samples goes
  unseen (a child may briefly exceed the limit, or finish before it is caught), pages shared by
  processes of the tree count once per process, and page cache does not count at all.

The child's stdout and stderr are captured as text. A run past ``timeout`` is killed (its cgroup
removed) and ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil

Mechanism = Literal["cgroup-v1", "cgroup-v2", "rss-sampling"]
MECHANISMS: tuple[str, ...] = ("cgroup-v1", "cgroup-v2", "rss-sampling")

# joins the cgroup (its own pid, which exec keeps) and only then runs the command
_JOIN_AND_EXEC = 'echo $$ > "$1" || exit 125; shift; exec "$@"'
_JOIN_FAILED = 125
_names = itertools.count()


@dataclass(frozen=True)
class LimitedRun:
    """One child's run: ``returncode`` (negative: killed by that signal, -9 for an OOM kill or the
    sampler's kill), its captured ``stdout`` and ``stderr``, ``peak_bytes`` (the group's memory
    high-water mark, page cache included, or the highest sampled RSS of the process tree),
    ``killed_by_limit`` (the kernel OOM-killed a process of the group, or the sampler killed the
    tree) and the ``mechanism`` that limited it."""

    returncode: int
    stdout: str
    stderr: str
    peak_bytes: int
    killed_by_limit: bool
    mechanism: Mechanism


# --- where the memory cgroups are ---------------------------------------------------------------


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount root, mount point, fs type, super options) of each cgroup filesystem."""
    found = []
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        fields, _, tail = line.partition(" - ")
        parts, extra = fields.split(), tail.split()
        if len(parts) < 5 or len(extra) < 3 or extra[0] not in ("cgroup", "cgroup2"):
            continue
        point = parts[4].replace("\\040", " ")
        found.append((parts[3], point, extra[0], set(extra[2].split(","))))
    return found


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller (``"memory"``), and ``""`` for v2."""
    paths: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for name in controllers.split(",") if controllers else [""]:
                    paths[name] = path
    except (OSError, ValueError):
        pass
    return paths


def _join(root: str, point: str, path: str) -> Path:
    """The folder of cgroup ``path`` in a hierarchy mounted at ``point`` from ``root``."""
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    return Path(point) / path.lstrip("/")


def _writable(folder: Path) -> bool:
    """A group can be made (and removed) in ``folder``: tried, not guessed."""
    if not os.access(folder, os.W_OK):
        return False
    probe = folder / f"rp_memlimit_probe_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
    except OSError:
        return False
    with contextlib.suppress(OSError):
        probe.rmdir()
    return True


@functools.cache
def _locate() -> tuple[Mechanism, Path] | None:
    """The mechanism and the folder the limited groups are made in, or None (no usable memory
    cgroup). Probed once per process."""
    own = _own_cgroups()
    for root, point, fstype, options in _mounts():
        if fstype == "cgroup2" and "" in own:
            here = _join(root, point, own[""])
            try:
                if "memory" not in (here / "cgroup.controllers").read_text().split():
                    continue
            except OSError:
                continue
            for parent in (here, here.parent):
                if _v2_delegates_memory(parent) and _writable(parent):
                    return "cgroup-v2", parent
        elif fstype == "cgroup" and "memory" in options and "memory" in own:
            here = _join(root, point, own["memory"])
            if (here / "memory.limit_in_bytes").exists() and _writable(here):
                return "cgroup-v1", here
    return None


def _v2_delegates_memory(folder: Path) -> bool:
    """``folder``'s children get the memory controller (enabled here if it can be: not where
    ``folder`` holds processes itself, v2's no-internal-processes rule)."""
    control = folder / "cgroup.subtree_control"
    try:
        if "memory" in control.read_text().split():
            return True
        control.write_text("+memory")
        return "memory" in control.read_text().split()
    except OSError:
        return False


def cgroup_mechanism() -> str | None:
    """``"cgroup-v1"`` or ``"cgroup-v2"`` where this process can make memory cgroups under its
    own (root, a writable cgroupfs), else None (``run_limited`` falls back to RSS sampling)."""
    found = _locate()
    return found[0] if found else None


# --- running -----------------------------------------------------------------------------------


def run_limited(
    argv: Sequence[str],
    limit_bytes: int,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
    cwd: str | os.PathLike[str] | None = None,
    mechanism: str | None = None,
    interval: float = 0.02,
) -> LimitedRun:
    """Run ``argv`` with at most ``limit_bytes`` of memory; see the module docstring.

    ``mechanism``: None picks a cgroup where one is usable, else ``"rss-sampling"``; naming
    ``"cgroup-v1"`` or ``"cgroup-v2"`` raises ``RuntimeError`` where that one is not usable.
    ``env``: the child's whole environment (None: this process's). Raises
    ``subprocess.TimeoutExpired`` past ``timeout`` seconds, after killing the child."""
    if limit_bytes <= 0:
        raise ValueError(f"limit_bytes must be positive, not {limit_bytes}")
    if mechanism is not None and mechanism not in MECHANISMS:
        raise ValueError(f"mechanism must be one of {MECHANISMS} or None, not {mechanism!r}")
    found = _locate()
    if mechanism is None:
        mechanism = found[0] if found else "rss-sampling"
    if mechanism == "rss-sampling":
        return _run_sampled(list(argv), limit_bytes, env, timeout, cwd, interval)
    if found is None or found[0] != mechanism:
        raise RuntimeError(f"{mechanism} is not usable here (available: {cgroup_mechanism()})")
    return _run_in_cgroup(found[0], found[1], list(argv), limit_bytes, env, timeout, cwd, interval)


def _popen(
    argv: list[str], env: Mapping[str, str] | None, cwd: str | os.PathLike[str] | None
) -> subprocess.Popen[str]:
    # its own session: the sampler kills the whole tree by its process group, and a Ctrl-C at the
    # terminal reaches this process only (which then kills the child in its cleanup)
    return subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=None if env is None else dict(env), cwd=cwd, start_new_session=True,
    )  # fmt: skip


def _wait(
    proc: subprocess.Popen[str],
    timeout: float,
    interval: float,
    sample: Callable[[], bool],
    kill: Callable[[], None],
) -> tuple[str, str]:
    """The child's output once it exits (and closes its output), calling ``sample`` every
    ``interval`` meanwhile (True: ``kill`` the child). ``communicate`` keeps what it read across
    its timeouts, so the pipes never fill while waiting."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            out, err = proc.communicate(timeout=interval)
            sample()
            return out, err
        except subprocess.TimeoutExpired:
            if sample():
                kill()
            elif time.monotonic() > deadline:
                kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.communicate(timeout=5)  # a process outside the kill may hold a pipe
                raise subprocess.TimeoutExpired(proc.args, timeout) from None


def _kill_session(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the child and whatever of its session is left (its process group)."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        proc.kill()


def _tree_rss(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def _run_sampled(
    argv: list[str],
    limit: int,
    env: Mapping[str, str] | None,
    timeout: float,
    cwd: str | os.PathLike[str] | None,
    interval: float,
) -> LimitedRun:
    peak, killed = 0, False
    proc = _popen(argv, env, cwd)

    def sample() -> bool:
        nonlocal peak, killed
        if proc.poll() is not None:
            return False
        rss = _tree_rss(proc.pid)
        peak = max(peak, rss)
        if rss > limit and not killed:
            killed = True
            return True
        return False

    try:
        out, err = _wait(proc, timeout, interval, sample, lambda: _kill_session(proc))
    finally:
        if proc.poll() is None:
            _kill_session(proc)
            proc.wait()
    assert proc.returncode is not None
    return LimitedRun(proc.returncode, out, err, peak, killed, "rss-sampling")


def _read_int(path: Path, key: str | None = None) -> int | None:
    """An integer file, or the value of ``key`` in a flat-keyed one; None where absent."""
    try:
        text = path.read_text()
    except OSError:
        return None
    if key is None:
        value = text.strip()
        return None if value == "max" else int(value)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return None


def _write(path: Path, value: int | str, *, required: bool = True) -> None:
    try:
        path.write_text(str(value))
    except OSError:
        if required:
            raise


def _setup_group(kind: str, group: Path, limit: int) -> None:
    if kind == "cgroup-v1":
        _write(group / "memory.limit_in_bytes", limit)
        if (group / "memory.memsw.limit_in_bytes").exists():  # swap accounting on
            _write(group / "memory.memsw.limit_in_bytes", limit)
        _write(group / "memory.swappiness", 0, required=False)
    else:
        _write(group / "memory.max", limit)
        if (group / "memory.swap.max").exists():
            _write(group / "memory.swap.max", 0)


def _procs(group: Path) -> list[int]:
    try:
        return [int(p) for p in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _kill_group(group: Path) -> None:
    """SIGKILL every process in ``group`` (all started by this module's child)."""
    for pid in _procs(group):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _remove_group(group: Path) -> None:
    """Kill what is left in ``group`` and remove it (a group goes once its last process is
    gone, reaped by its parent or by init: retried for a few seconds)."""
    deadline = time.monotonic() + 10
    while True:
        _kill_group(group)
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _run_in_cgroup(
    kind: Mechanism,
    parent: Path,
    argv: list[str],
    limit: int,
    env: Mapping[str, str] | None,
    timeout: float,
    cwd: str | os.PathLike[str] | None,
    interval: float,
) -> LimitedRun:
    group = parent / f"rp_memlimit_{os.getpid()}_{next(_names)}_{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        _setup_group(kind, group, limit)
        v2_sampled = kind == "cgroup-v2" and not (group / "memory.peak").exists()
        sampled_peak = 0

        def sample() -> bool:
            nonlocal sampled_peak
            if v2_sampled:
                sampled_peak = max(sampled_peak, _read_int(group / "memory.current") or 0)
            return False

        wrapped = ["/bin/sh", "-c", _JOIN_AND_EXEC, "sh", str(group / "cgroup.procs"), *argv]
        proc = _popen(wrapped, env, cwd)

        def kill() -> None:
            _kill_session(proc)
            _kill_group(group)

        try:
            out, err = _wait(proc, timeout, interval, sample, kill)
        finally:
            if proc.poll() is None:
                kill()
                proc.wait()
        if proc.returncode == _JOIN_FAILED and not _procs(group) and "cgroup.procs" in err:
            raise RuntimeError(f"the child could not join {group}: {err.strip()}")
        _kill_group(group)  # leftovers (the figures below include what they used)
        if kind == "cgroup-v1":
            peak = _read_int(group / "memory.max_usage_in_bytes") or 0
            ooms = _read_int(group / "memory.oom_control", "oom_kill")
            if ooms is None:  # kernels before 4.13: the limit was hit, and a SIGKILL
                failed = _read_int(group / "memory.failcnt") or 0
                failed += _read_int(group / "memory.memsw.failcnt") or 0
                ooms = int(failed > 0 and proc.returncode == -signal.SIGKILL)
        else:
            peak = _read_int(group / "memory.peak") or sampled_peak
            ooms = _read_int(group / "memory.events", "oom_kill") or 0
        assert proc.returncode is not None
        return LimitedRun(proc.returncode, out, err, peak, ooms > 0, kind)
    finally:
        _remove_group(group)
