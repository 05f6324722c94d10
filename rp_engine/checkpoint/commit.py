"""Atomic commits and crash recovery of checkpoint folders.

Files go to ``save_dir/.<tag>.tmp-<pid>``, are fsynced, and the folder is renamed to ``<tag>``
(an existing ``<tag>`` is first renamed aside to ``.<tag>.old-<pid>``); ``latest`` is replaced
last, by an atomic write. A crash leaves the previous checkpoint and ``latest``: the next save or
load renames a folder left aside back (``_recover_interrupted``), and a save removes what dead
processes half wrote. Also DeepSpeed's recovery scripts (zero_to_fp32.py), copied next to the
tags as DeepSpeed does.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import shutil
import stat
from collections.abc import Mapping
from typing import Any

import torch

from rp_engine.checkpoint.streamed import StreamedSave

log = logging.getLogger("rp_engine.checkpoint")

_RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def _commit_folder(
    save_dir: str, tag: str, files: Mapping[str, Any], streamed: StreamedSave | None = None
) -> None:
    """Write ``files`` (name -> object) into ``save_dir/<tag>`` all-or-nothing; ``streamed``
    fills the objects' deferred tensors (streamed.py)."""
    final = os.path.join(save_dir, tag)
    tmp = os.path.join(save_dir, f".{tag}.tmp-{os.getpid()}")
    old = os.path.join(save_dir, f".{tag}.old-{os.getpid()}")
    _recover_interrupted(save_dir, remove_stale=True)
    try:
        os.makedirs(tmp)
        for name, obj in files.items():
            with open(os.path.join(tmp, name), "w+b") as f:
                (streamed or StreamedSave()).save(obj, f)
                f.flush()
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        if os.path.isdir(final):
            # Two renames: between them no folder named <tag> exists; a crash right there leaves
            # the old one as .<tag>.old-<pid>, which the next save or load renames back.
            os.rename(final, old)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(save_dir)
    shutil.rmtree(old, ignore_errors=True)


_ASIDE = re.compile(r"^\.(?P<tag>.+)\.(?P<kind>old|tmp)-(?P<pid>\d+)$")


def _recover_interrupted(folder: str, *, remove_stale: bool) -> None:
    """Undo what a save killed mid-way left behind: a tag folder renamed aside but not replaced
    (``.<tag>.old-<pid>`` without ``<tag>``) is renamed back; with ``remove_stale``, half-written
    folders and replaced old folders of processes no longer running are deleted."""
    for name in _listdir(folder):
        m = _ASIDE.match(name)
        if m is None:
            continue
        path, final = os.path.join(folder, name), os.path.join(folder, m["tag"])
        if m["kind"] == "old" and not os.path.exists(final):
            log.warning("restoring checkpoint %s from an interrupted save (%s)", final, name)
            os.rename(path, final)
        elif remove_stale and (int(m["pid"]) == os.getpid() or not _pid_alive(int(m["pid"]))):
            shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but belongs to someone else, or the platform cannot tell
        return True
    return True


def _write_atomic(path: str, data: bytes) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(path) or ".")


def _atomic_torch_save(obj: Any, path: str) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(path) or ".")


def _fsync_dir(path: str) -> None:
    # Makes the renames durable; not every platform/filesystem lets a directory be opened.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _copy_recovery_scripts(save_dir: str) -> None:
    """Copy DeepSpeed's zero_to_fp32.py (and zero_to_torch.py) next to the tags, as DeepSpeed."""
    spec = importlib.util.find_spec("deepspeed")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        log.warning("deepspeed is not installed: zero_to_fp32.py not copied into %s", save_dir)
        return
    for script in _RECOVERY_SCRIPTS:
        src = os.path.join(locations[0], "utils", script)
        if not os.path.isfile(src):
            continue
        dst = os.path.join(save_dir, script)
        with open(src, "rb") as f:
            _write_atomic(dst, f.read())
        with contextlib.suppress(OSError):
            os.chmod(dst, os.stat(dst).st_mode | stat.S_IEXEC)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
