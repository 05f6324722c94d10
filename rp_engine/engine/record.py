"""What the last closed optimizer step did: its result, its runs' measured traffic, its timeline.

The pipeline (pipeline.py) writes a :class:`StepRecord` as runs finish and steps close; the
engine's accessors (api.py: ``get_global_grad_norm``, ``last_step_stats``, ``last_timeline``,
``step_report``) read it, and the monitor gets one row per closed step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rp_engine.runtime.executor import RunStats
from rp_engine.storage.io_engine import IOStats

if TYPE_CHECKING:
    from rp_engine.monitor import Monitor
    from rp_engine.optim.stepper import StepResult
    from rp_engine.runtime.counters import StepCounters
    from rp_engine.runtime.executor import TimelineRecord
    from rp_engine.storage.build import Tiers

__all__ = ["StepRecord"]


class StepRecord:
    """The newest closed step (``last``: its norm, overflow, step number), the stats of its
    runs (``step_stats``) and of the open step's runs so far, the last run's ``timeline``, and
    the NVMe tiers' traffic between the last two step closes."""

    def __init__(self, *, tiers: Tiers, monitor: Monitor, counters: StepCounters) -> None:
        self.tiers = tiers
        self.monitor = monitor
        self.counters = counters  # global_samples labels the monitor's rows
        self.last: StepResult | None = None
        self.timeline: list[TimelineRecord] = []
        self.open_stats = RunStats()  # runs of the optimizer step in progress
        self.step_stats: RunStats | None = None
        self._nvme_mark = IOStats()  # the NVMe tier's totals at the last step's close
        self._nvme_step = IOStats()  # its traffic between the last two step closes

    def add(self, stats: RunStats) -> None:
        """A run of the open step finished: its traffic counts toward the step."""
        self.open_stats.add(stats)

    def closed(self) -> None:
        """The open step closed: its runs' stats are the step's; one monitor row."""
        self.step_stats, self.open_stats = self.open_stats, RunStats()
        if self.tiers:  # the NVMe tier's traffic since the previous close is this step's
            now = self.tiers.stats
            self._nvme_step, self._nvme_mark = now.minus(self._nvme_mark), now
        self.monitor.write_step_stats(self.stats_dict(), self.counters.global_samples)

    def stats_dict(self) -> dict[str, Any]:
        """``engine.last_step_stats()`` (api.py says what each key measures); {} before a step."""
        st = self.step_stats
        if st is None:
            return {}
        return {
            "h2d_bytes": st.h2d_bytes,
            "d2h_bytes": st.d2h_bytes,
            "weight_h2d_bytes": st.weight_h2d_bytes,
            "grad_d2h_bytes": st.grad_d2h_bytes,
            "activation_bytes": st.activation_bytes,
            "uploads": st.uploads,
            "kept_uploads": st.kept_uploads,
            "downloads": st.downloads,
            "seconds": st.seconds,
            "busy_s": dict(st.busy_s),
            "busy_fraction": {
                d: (b / st.seconds if st.seconds > 0 else 0.0) for d, b in st.busy_s.items()
            },
            **self._nvme_stats(),
        }

    def _nvme_stats(self) -> dict[str, Any]:
        """The NVMe tier's traffic between the last two step closes (with the asynchronous
        optimizer that is mostly the previous step's state streaming through), and the bytes
        written in total (SSD wear): every write finished when asked, not at the last close,
        so after ``synchronize()`` all of them (the last step's write-backs, and with the
        asynchronous optimizer the earlier steps' still in flight at that close, included).
        Empty without the tier."""
        if not self.tiers:
            return {}
        io = self._nvme_step
        return {
            "nvme_read_bytes": io.read_bytes,
            "nvme_write_bytes": io.write_bytes,
            "nvme_busy_s": io.busy_s,
            "nvme_total_write_bytes": self.tiers.stats.write_bytes,
        }
