"""Cores split between the host optimizer and the pipeline threads (``roundpipe.optimizer_cores``).

On a GPU machine the host does two jobs at once: the optimizer thread runs DeepSpeed's CPU Adam
on an OpenMP team, and the pipeline threads issue every kernel, copy and event wait. An Adam
team spread over all cores takes the cores the issuing threads need, and kernels go out late
(the H200 run: 12 OpenMP threads beat 16 by 1.08x on 16 cores). DeepSpeed's ZenFlow splits the
cores the same way (``pt_reserved_cores_perc``). Here, by affinity: the optimizer thread is
pinned to its cores and sizes its own OpenMP team to them (``omp_set_num_threads`` on that
thread only, so torch's pool elsewhere is untouched), and the process's other threads to the
rest.

``CoreSplit`` is the plan (data); ``split_cores`` derives it; ``pin_optimizer_thread`` and
``pin_pipeline`` apply it. On CPU virtual devices the "devices" compute on the host cores
themselves, so the default is no split.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import threading

__all__ = [
    "CoreSplit",
    "available_cores",
    "pin_optimizer_thread",
    "pin_pipeline",
    "pin_process",
    "pin_thread",
    "split_cores",
]

log = logging.getLogger("rp_engine.optim")  # its name before the move: log settings keep working


@dataclasses.dataclass(frozen=True)
class CoreSplit:
    """The optimizer's cores and the pipeline's (disjoint, both non-empty), or no split
    (``optimizer`` empty: every thread may run anywhere)."""

    optimizer: tuple[int, ...] = ()
    pipeline: tuple[int, ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.optimizer)

    def describe(self) -> str:
        if not self.active:
            return "optimizer and pipeline threads share all cores"
        return (
            f"optimizer: {len(self.optimizer)} cores ({_ranges(self.optimizer)}), pipeline "
            f"threads: {len(self.pipeline)} cores ({_ranges(self.pipeline)})"
        )


def split_cores(
    wanted: int | None,
    *,
    cores: tuple[int, ...],
    device_kind: str,
    num_devices: int,
    processes: int = 1,
) -> CoreSplit:
    """The split for ``roundpipe.optimizer_cores`` = ``wanted`` over the cores this process may
    run on (``cores``, ascending), training on ``num_devices`` devices of ``device_kind``.

    ``wanted`` None derives it: no split on CPU virtual devices (they compute on these cores),
    with fewer than 2 cores, or with ``processes`` > 1 (data parallel ranks on one host would
    each take the same cores); on GPUs the pipeline keeps 2 cores plus 2 per device (an issuing
    thread and a copy thread each), at most half of them, and the optimizer gets the rest (16
    cores, one GPU: 12 for Adam, the H200 measurement's best). 0: no split. N: N cores for the
    optimizer, the highest-numbered ones (core 0 takes most interrupts), at least one left.
    Raises ValueError naming the key when N does not fit."""
    n = len(cores)
    if wanted is None:
        if device_kind != "cuda" or n < 2 or processes > 1:
            return CoreSplit()
        pipeline = min(max(1, n // 2), 2 + 2 * num_devices)
        wanted = n - pipeline
    if wanted == 0:
        return CoreSplit()
    if not 0 < wanted < n:
        raise ValueError(
            f"roundpipe.optimizer_cores={wanted}: this process may run on {n} cores, so the "
            f"optimizer can have 1 to {n - 1} of them (the rest run the pipeline threads); use "
            "0 for no split or null for the default"
        )
    return CoreSplit(optimizer=cores[n - wanted :], pipeline=cores[: n - wanted])


def available_cores() -> tuple[int, ...]:
    """The cores this process may run on (its affinity mask), ascending."""
    return tuple(sorted(os.sched_getaffinity(0)))


def pin_pipeline(split: CoreSplit) -> None:
    """Pin every thread of the process now (the caller's, the device, copy and I/O threads
    already started) to the pipeline's cores; threads started afterwards inherit their
    creator's mask. Call it before the optimizer thread pins itself. No-op without a split."""
    if split.active:
        pin_process(split.pipeline)


def pin_process(cores: tuple[int, ...]) -> None:
    """Set the affinity of every current thread of the process to ``cores`` (what ``destroy``
    uses to give a split's cores back)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):  # a thread that has just ended
            continue


def pin_thread(cores: tuple[int, ...]) -> None:
    """Pin the calling thread alone to ``cores`` (threads it starts later inherit the mask)."""
    os.sched_setaffinity(threading.get_native_id(), cores)


def pin_optimizer_thread(split: CoreSplit) -> None:
    """Pin the calling thread (the optimizer's, before its first Adam call creates its OpenMP
    team, whose threads inherit the mask) to the optimizer's cores and size that team to
    them. No-op without a split."""
    if not split.active:
        return
    try:
        pin_thread(split.optimizer)
    except OSError as e:  # the worker must run anyway: a failed pin only costs speed
        log.warning("could not pin the optimizer thread to cores %s: %s", split.optimizer, e)
        return
    omp = _openmp()
    if omp is not None:
        omp.omp_set_num_threads(len(split.optimizer))  # this thread's team only


def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (the one DeepSpeed's CPU Adam op resolves to), found
    among the process's mappings; None if there is none."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_set_num_threads.argtypes = [ctypes.c_int]
            return lib
        except (OSError, AttributeError):
            continue
    return None


def _ranges(cores: tuple[int, ...]) -> str:
    """ "0-3,8" for (0, 1, 2, 3, 8)."""
    parts: list[str] = []
    start = prev = cores[0]
    for c in (*cores[1:], None):
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(parts)
