"""Other processes' demand for this machine's cores while a measured window runs.

On a shared machine the run's CPU virtual devices compete for the cores with whatever else runs.
``ExternalLoad`` samples, on a background thread, the system's runnable threads (``/proc/loadavg``
field 4, ``running/total``) and this process's own (``/proc/self/task/*/stat`` in state R), and
reports the mean of the difference: the other processes' runnable threads. That is demand, not
consumption: a thread of theirs counts whether or not it got a core, so the figure does not grow
when this process idles (the CPU time they used would: they take what it leaves). The simulator
takes it as ``Machine.host_load`` (each such thread one more equal sharer of the host cores).
Linux only; elsewhere ``mean`` is 0 and ``samples`` 0.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import TracebackType

__all__ = ["ExternalLoad", "runnable_counts"]

_LOADAVG = Path("/proc/loadavg")
_TASKS = Path("/proc/self/task")


def runnable_counts() -> tuple[int, int] | None:
    """(runnable threads system-wide, runnable threads of this process), or None without /proc."""
    try:
        running = int(_LOADAVG.read_text().split()[3].split("/")[0])
        mine = 0
        for task in os.listdir(_TASKS):
            try:
                stat = (_TASKS / task / "stat").read_text()
            except OSError:  # the thread ended meanwhile
                continue
            mine += stat[stat.rindex(")") + 2] == "R"  # the state follows the "(name)"
    except (OSError, IndexError, ValueError):
        return None
    return running, mine


class ExternalLoad:
    """``with ExternalLoad() as load: ...`` then ``load.mean``: the other processes' runnable
    threads, averaged over samples every ``interval_s`` (and one at each end). The sampler itself
    is a thread of this process, so it never counts as external."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self._values: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="external-load", daemon=True)

    def _sample(self) -> None:
        got = runnable_counts()
        if got is not None:
            self._values.append(max(got[0] - got[1], 0))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> ExternalLoad:
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
    def samples(self) -> int:
        return len(self._values)

    @property
    def mean(self) -> float:
        return sum(self._values) / len(self._values) if self._values else 0.0
