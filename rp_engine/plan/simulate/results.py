"""What a simulation measured: ``SimResult`` and its per-lane ``Interval``s."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..actions import Action

__all__ = ["Interval", "SimResult"]


@dataclass(frozen=True)
class Interval:
    """One phase of one action on one lane of a device (``HOST`` for the optimizer)."""

    device: int
    lane: str  # compute, h2d_param, h2d_act, d2h, cpu, nvme (host: NVMe reads)
    phase: str  # fwd, recompute, bwd, head_fwd, head_bwd, upload, download, send, opt, read
    start_ms: float
    end_ms: float
    action: Action
    busy: bool  # counted as compute busy time

    @property
    def label(self) -> str:
        a = self.action
        return f"{a.op.value}{a.stage}.{a.microbatch}"


@dataclass(frozen=True)
class SimResult:
    """What a simulation measured. ``iteration_ms`` is the steady-state iteration (several
    iterations, over a window of whole optimizer lags: run.py's ``_steady_iteration_ms``) or
    the makespan per iteration (one; two with an async optimizer); ``bubble_ratio`` = 1 -
    busy / (N * iteration_ms) with busy the compute of one iteration.
    ``bubble_ratio_fill_drain`` (one iteration only) also counts each device's time before its
    first and after its last action as useful, the published estimate for an asynchronous
    optimizer."""

    schedule: str
    num_devices: int
    num_iterations: int
    num_fwd_stages: int
    num_bwd_stages: int
    makespan_ms: float
    iteration_ms: float
    busy_ms: float
    bubble_ratio: float
    bubble_ratio_fill_drain: float | None
    intervals: tuple[Interval, ...]
    peak_memory_bytes: tuple[int, ...]
    bytes_moved: Mapping[str, int]

    def timeline(self, device: int) -> list[Interval]:
        """Intervals of one device (all lanes), by start time."""
        return sorted(
            (i for i in self.intervals if i.device == device), key=lambda i: (i.start_ms, i.lane)
        )

    def to_json(self) -> dict[str, object]:
        return {
            "schedule": self.schedule,
            "num_devices": self.num_devices,
            "num_iterations": self.num_iterations,
            "num_fwd_stages": self.num_fwd_stages,
            "num_bwd_stages": self.num_bwd_stages,
            "makespan_ms": round(self.makespan_ms, 4),
            "iteration_ms": round(self.iteration_ms, 4),
            "busy_ms": round(self.busy_ms, 4),
            "bubble_ratio": round(self.bubble_ratio, 6),
            "bubble_ratio_fill_drain": None
            if self.bubble_ratio_fill_drain is None
            else round(self.bubble_ratio_fill_drain, 6),
            "peak_memory_bytes": list(self.peak_memory_bytes),
            "bytes_moved": dict(self.bytes_moved),
        }
