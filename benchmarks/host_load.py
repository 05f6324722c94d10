"""The share of this machine's cores a run gets beside other processes, measured during it.

On a shared machine the run's CPU virtual devices compete for the cores with whatever else runs.
Linux shares the cores fairly between *sessions* first (autogroups, on by default:
``/proc/sys/kernel/sched_autogroup_enabled``), then between the threads of each: a process with
two busy threads beside two other busy sessions gets 2/3 of the 2 cores, not 2 x 2/(2 + 2).
(Measured here: at 5.5 runnable threads of others, the run's compute threads ran 1.8x slower
than their CPU time, where per-thread fairness says 3.3-3.8x.)

``CoreShare`` samples, on a background thread, every thread of every other session in state R
(``/proc/*/task/*/stat``: state and session), i.e. each session's *demand* in threads. A thread
counts whether or not it got a core, so the figure does not grow when this process idles (the
CPU time the others used would: they take what it leaves). ``share(cores, k)`` is then the mean
over samples of the cores this process gets when ``k`` of its threads want them, water-filling
the cores between the sessions' demands; ``Machine.host_share`` takes it (k = 1, 2, ...).
Linux only; elsewhere there are no samples and the share is all the cores.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path
from types import TracebackType

__all__ = ["CoreShare", "other_sessions_demand", "water_fill"]

_PROC = Path("/proc")


def other_sessions_demand() -> list[int] | None:
    """Runnable threads per session other than this process's, or None without /proc."""
    me = os.getsid(0)
    per: Counter[int] = Counter()
    try:
        pids = [p for p in os.listdir(_PROC) if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            tasks = os.listdir(_PROC / pid / "task")
        except OSError:  # the process ended meanwhile
            continue
        for task in tasks:
            try:
                stat = (_PROC / pid / "task" / task / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()  # state ppid pgrp session ...
            if fields[0] == "R" and int(fields[3]) != me:
                per[int(fields[3])] += 1
    return list(per.values())


def water_fill(cores: float, demands: list[float]) -> list[float]:
    """Cores each demand gets: equal shares, a demand below its share gets just that, and what
    it leaves goes to the others (max-min fairness)."""
    got = [0.0] * len(demands)
    left, todo = cores, sorted(range(len(demands)), key=lambda i: demands[i])
    while todo:
        fair = left / len(todo)
        i = todo[0]
        if demands[i] <= fair:
            got[i] = demands[i]
            left -= demands[i]
            todo.pop(0)
        else:
            for j in todo:
                got[j] = fair
            break
    return got


class CoreShare:
    """``with CoreShare() as s: ...`` then ``s.share(cores, k)`` (see the module docstring),
    ``s.mean_threads`` (the others' runnable threads) and ``s.mean_sessions`` (how many other
    sessions had one), averaged over samples every ``interval_s`` and one at each end."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.samples: list[list[int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="core-share", daemon=True)

    def _sample(self) -> None:
        got = other_sessions_demand()
        if got is not None:
            self.samples.append(got)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> CoreShare:
        self._sample()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def mean_threads(self) -> float:
        return sum(map(sum, self.samples)) / len(self.samples) if self.samples else 0.0

    @property
    def mean_sessions(self) -> float:
        return sum(map(len, self.samples)) / len(self.samples) if self.samples else 0.0

    def share(self, cores: float, k: int) -> float:
        """Mean cores this process gets with ``k`` threads wanting them (``cores`` without
        samples), never more than ``min(k, cores)``."""
        if not self.samples:
            return min(float(k), cores)
        got = [water_fill(cores, [float(k), *map(float, s)])[0] for s in self.samples]
        return sum(got) / len(got)

    def shares(self, cores: float, k_max: int) -> tuple[float, ...]:
        """``share(cores, k)`` for k = 1 .. ``k_max`` (``Machine.host_share``)."""
        return tuple(self.share(cores, k) for k in range(1, k_max + 1))
