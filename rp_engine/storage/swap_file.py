"""The tier's files: one preallocated swap file per tier and rank under ``nvme_path``.

``check_nvme_path`` runs at ``initialize``: a missing or unwritable folder, or a disk without
room for the tier, is an error naming the path, the bytes needed and the bytes free, raised
before anything is written. ``SwapFile`` then reserves the whole file at once
(``posix_fallocate``), so a disk that fills up later (other writers) fails at the reservation,
never halfway through a step; nothing outside the tier's own folder is touched. The swap file
is scratch state of one run (checkpoints are what resumes: checkpoint/), removed at close.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil

from rp_engine.host.units import format_gib_exact

__all__ = ["NvmeSpaceError", "SwapFile", "check_nvme_path"]


class NvmeSpaceError(OSError):
    """The NVMe path cannot hold the tier: missing, unwritable or too small (the message says
    which, with the path, bytes needed and bytes free)."""


def check_nvme_path(path: str | None, need: int, *, key: str) -> str:
    """The absolute ``path`` when it is an existing, writable folder with ``need`` bytes free;
    else ``NvmeSpaceError`` naming ``key`` (the ds_config key that set it)."""
    if not path:
        raise NvmeSpaceError(
            errno.EINVAL,
            f'{key} is not set: "device": "nvme" needs a folder on a local NVMe drive, e.g. '
            f'"nvme_path": "/local_nvme"',
        )
    folder = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(folder):
        raise NvmeSpaceError(
            errno.ENOENT,
            f"{key} = {path!r}: {folder} does not exist (or is not a folder); create it on a "
            f"local NVMe drive with at least {format_gib_exact(need)} free",
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise NvmeSpaceError(
            errno.EACCES, f"{key} = {path!r}: {folder} is not writable by this user"
        )
    free = shutil.disk_usage(folder).free
    if free < need:
        raise NvmeSpaceError(
            errno.ENOSPC,
            f"{key} = {path!r}: the NVMe tier needs {format_gib_exact(need)} in {folder}, but only "
            f"{format_gib_exact(free)} are free; free space there or point {key} at a larger drive",
        )
    return folder


class SwapFile:
    """A file of ``nbytes`` reserved under ``folder/name``: created (with its parent folders)
    and fully allocated, or an ``NvmeSpaceError`` and nothing left behind. ``close`` removes it
    (and the folders it created, when empty)."""

    def __init__(self, folder: str, name: str, nbytes: int) -> None:
        self.path = os.path.join(folder, name)
        self.nbytes = nbytes
        self._made: list[str] = []
        self._fd = -1
        parent = os.path.dirname(self.path)
        missing = []
        while not os.path.isdir(parent):
            missing.append(parent)
            parent = os.path.dirname(parent)
        for d in reversed(missing):
            os.mkdir(d)
            self._made.append(d)
        # the file stays open and locked for the run: a second live run on the same folder is
        # refused, while a file left by a killed run (no lock holder) is reused, not piled up
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:  # the folder passed the access check, yet the kernel refuses
            # (a read-only mount, root on a root-squashed NFS export): an error naming the
            # file, and nothing left behind
            self._remove_dirs()
            raise NvmeSpaceError(
                exc.errno or errno.EACCES,
                f"could not create {self.path} ({exc.strerror}): {folder} must be a writable "
                "folder on a local NVMe drive",
            ) from exc
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = -1
            self._remove_dirs()
            raise NvmeSpaceError(
                errno.EBUSY,
                f"{self.path} is in use by another running process: give this run its own "
                "nvme_path",
            ) from None
        try:
            os.ftruncate(self._fd, 0)  # a stale file's old contents are never read
            os.posix_fallocate(self._fd, 0, max(nbytes, 1))
        except OSError as exc:
            self.close()
            free = shutil.disk_usage(folder).free
            raise NvmeSpaceError(
                exc.errno or errno.ENOSPC,
                f"could not reserve {format_gib_exact(nbytes)} for {self.path} ({exc.strerror}); "
                f"{format_gib_exact(free)} free there",
            ) from exc

    def close(self) -> None:
        """Remove the file and the folders this object created (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)  # drops the lock
            self._fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._remove_dirs()

    def _remove_dirs(self) -> None:
        for d in reversed(self._made):
            try:
                os.rmdir(d)
            except OSError:
                pass  # not empty: something else lives there
        self._made = []
