"""Render a simulated timeline: text grid, Chrome trace JSON, PNG Gantt chart.

Owns the three views of a ``SimResult``. The text grid is a device x time picture (one character
per time bucket) for terminals, tests and logs; the Chrome trace opens in chrome://tracing or
https://ui.perfetto.dev (one process per device, one thread per lane); the PNG is a Gantt chart
in the style of the RoundPipe paper's schedule figure. matplotlib is imported only inside
``write_png``.

    d0 |FFFFFFFF..rrrBBBBBBB|      F forward   r recompute   B backward
    d1 |..FFFFFFFFhhhHHHHHH.|      h head fwd  H head bwd    . idle

Host lanes are rows of their own: "host" (the CPU optimizer, lane "cpu") and "nvme" (a plan's
READs of weights from NVMe, lane "nvme"), shown when ``lanes`` names them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from .actions import HOST, Op, parse_action
from .simulate import Interval, SimResult

if TYPE_CHECKING:  # matplotlib itself is imported only when a PNG is written
    from matplotlib.axes import Axes

__all__ = [
    "PHASE_CHARS",
    "text_grid",
    "chrome_trace",
    "write_chrome_trace",
    "write_png",
    "measured_result",
]

PHASE_CHARS = {
    "fwd": "F",
    "recompute": "r",
    "bwd": "B",
    "head_fwd": "h",
    "head_bwd": "H",
    "upload": "U",
    "download": "D",
    "send": "S",
    "send_d2h": "s",
    "send_h2d": "S",
    "opt": "O",
    "accumulate": "A",
    "read": "R",
}
_COLORS = {
    "fwd": "#4C72B0",
    "recompute": "#A1C9F4",
    "bwd": "#DD8452",
    "head_fwd": "#55A868",
    "head_bwd": "#2E7D32",
    "upload": "#8172B3",
    "download": "#937860",
    "send": "#DA8BC3",
    "send_d2h": "#DA8BC3",
    "send_h2d": "#C44E52",
    "opt": "#8C8C8C",
    "accumulate": "#64B5CD",
    "read": "#CCB974",
}
_LANES = ("compute", "h2d_param", "h2d_act", "d2h", "d2h_act", "host", "cpu", "nvme")
STREAM_LANES = _LANES  # every lane a measured timeline may have, in display order


def text_grid(result: SimResult, *, width: int = 100, lanes: Sequence[str] = ("compute",)) -> str:
    """Device x time grid; each column is makespan / width ms; a cell shows the phase running
    at its midpoint (``PHASE_CHARS``), '.' when idle."""
    span = result.makespan_ms or 1.0
    step = span / width
    rows_ = _rows(result, lanes)
    names = [_text_row_name(d, ln) for d, ln in rows_]
    pad = max([len(n) for n in names] + [4])
    rows = [f"{'':>{pad}}  0 ms{'':{max(width - 12, 1)}}{span:8.1f} ms"]
    for (device, lane), name in zip(rows_, names, strict=True):
        cells = ["."] * width
        for iv in _lane(result, device, lane):
            lo = int(iv.start_ms / step + 0.5)
            hi = max(int(iv.end_ms / step + 0.5), lo + 1) if iv.end_ms > iv.start_ms else lo
            for c in range(lo, min(hi, width)):
                cells[c] = PHASE_CHARS.get(iv.phase, "#")
        rows.append(f"{name:>{pad}} |{''.join(cells)}|")
    legend = "  ".join(f"{c}={p}" for p, c in PHASE_CHARS.items() if p in _phases(result))
    rows.append(f"{'':>{pad}}  {legend}   bubble {100 * result.bubble_ratio:.1f} %")
    return "\n".join(rows)


def chrome_trace(result: SimResult) -> dict[str, object]:
    """Trace Event Format: complete events ("ph": "X", microseconds), process = device."""
    events: list[dict[str, object]] = []
    for device, lane in _rows(result, _LANES):
        pid = 1_000 if device == HOST else device
        tid = _LANES.index(lane)
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": pid,
                "args": {"name": "host" if device == HOST else f"device {device}"},
            }
        )
        events.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}}
        )
        for iv in _lane(result, device, lane):
            events.append(
                {
                    "ph": "X",
                    "name": iv.label,
                    "cat": iv.phase,
                    "pid": pid,
                    "tid": tid,
                    "ts": round(iv.start_ms * 1e3, 3),
                    "dur": round((iv.end_ms - iv.start_ms) * 1e3, 3),
                    "args": {
                        "action": str(iv.action),
                        "phase": iv.phase,
                        "iteration": iv.action.iteration,
                    },
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": result.schedule,
            "bubble_ratio": result.bubble_ratio,
            "makespan_ms": result.makespan_ms,
        },
    }


def write_chrome_trace(result: SimResult, path: str | os.PathLike[str]) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(result), f)


def write_png(
    result: SimResult,
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    lanes: Sequence[str] = ("compute",),
) -> None:
    """Gantt chart: one row per device (and lane), boxes coloured by phase and labelled with
    stage.micro-batch when wide enough, like the paper's schedule figure."""
    # a bare Figure (no pyplot): no global backend switch, nothing left open
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = _rows(result, lanes)
    fig = Figure(figsize=(_PNG_WIDTH_IN, 0.45 * len(rows) + 1.6))
    ax = fig.subplots()
    for r, (device, lane) in enumerate(rows):
        _draw_row(ax, r, _lane(result, device, lane), result.makespan_ms or 1.0)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([_png_row_name(d, ln) for d, ln in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, result.makespan_ms or 1.0)
    ax.set_xlabel("time (ms)")
    ax.set_title(
        title
        or f"{result.schedule}: bubble {100 * result.bubble_ratio:.1f} %, "
        f"iteration {result.iteration_ms:.1f} ms"
    )
    present = _phases(result)
    handles = [Patch(color=c, label=p) for p, c in _COLORS.items() if p in present]
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18),
        ncol=8,
        fontsize=7,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=150)


_PNG_WIDTH_IN = 14.0


def _draw_row(ax: Axes, row: int, intervals: Sequence[Interval], span: float) -> None:
    """One device lane: a box per interval, labelled when it is at least 22 points wide."""
    for iv in intervals:
        width = iv.end_ms - iv.start_ms
        ax.broken_barh(
            [(iv.start_ms, width)],
            (row - 0.4, 0.8),
            facecolors=_COLORS.get(iv.phase, "#999999"),
            edgecolors="white",
            linewidth=0.3,
        )
        if width / span * _PNG_WIDTH_IN * 72 > 22:
            label = f"{iv.action.stage}.{iv.action.microbatch}"
            ax.text(
                iv.start_ms + width / 2,
                row,
                label,
                ha="center",
                va="center",
                fontsize=5,
                color="white",
            )


def _png_row_name(device: int, lane: str) -> str:
    if device == HOST:
        return "NVMe" if lane == "nvme" else "host"
    return f"GPU {device}" + ("" if lane == "compute" else f" {lane}")


def _text_row_name(device: int, lane: str) -> str:
    if device == HOST:
        return "nvme" if lane == "nvme" else "host"
    return f"d{device}" + ("" if lane == "compute" else f":{lane}")


def _rows(result: SimResult, lanes: Sequence[str]) -> list[tuple[int, str]]:
    present = {(iv.device, iv.lane) for iv in result.intervals}
    devices = sorted({d for d, _ in present}, key=lambda d: (d == HOST, d))
    return [(d, ln) for d in devices for ln in lanes if (d, ln) in present]


def _lane(result: SimResult, device: int, lane: str) -> list[Interval]:
    return [iv for iv in result.intervals if iv.device == device and iv.lane == lane]


def _phases(result: SimResult) -> set[str]:
    return {iv.phase for iv in result.intervals}


_MEASURED_PHASE = {
    Op.FWD: "fwd",
    Op.HEAD: "head_bwd",
    Op.BWD: "bwd",
    Op.UPLOAD: "upload",
    Op.DOWNLOAD: "download",
    Op.SEND: "send",
    Op.READ: "read",
}


class TimelineRecordLike(Protocol):
    """What the runtime records per action and stream (``RoundPipeEngine.last_timeline()``)."""

    device: int
    action: str
    start: float  # seconds
    end: float
    stream: str  # "compute", "h2d_param", "h2d_act", "d2h", "d2h_act", "host" or "nvme"


def measured_result(
    records: Sequence[TimelineRecordLike], *, schedule: str = "measured"
) -> SimResult:
    """A ``SimResult`` from what the runtime really ran, so the same three views render it.

    ``records`` are objects with ``device``, ``action`` (text such as "F2.3@1"), ``start``,
    ``end`` in seconds and ``stream`` (``RoundPipeEngine.last_timeline()``): one lane per
    stream; only compute counts as busy, so the bubble is 1 - busy / (devices x span). A READ
    is drawn on the host's "nvme" row, whatever device and stream it was recorded with.
    """
    intervals = []
    for r in records:
        action = parse_action(r.action)
        lane = getattr(r, "stream", "compute")
        device = r.device
        if action.op is Op.READ:  # host work on the NVMe lane, as the simulator draws it
            device, lane = HOST, "nvme"
        phase = "accumulate" if lane == "host" else _MEASURED_PHASE[action.op]
        busy = lane == "compute"
        intervals.append(Interval(device, lane, phase, r.start * 1e3, r.end * 1e3, action, busy))
    t0 = min((i.start_ms for i in intervals), default=0.0)
    intervals = [
        Interval(i.device, i.lane, i.phase, i.start_ms - t0, i.end_ms - t0, i.action, i.busy)
        for i in intervals
    ]
    devices = max((i.device for i in intervals), default=0) + 1
    span = max((i.end_ms for i in intervals), default=0.0)
    busy = sum(i.end_ms - i.start_ms for i in intervals if i.busy)
    return SimResult(
        schedule=schedule,
        num_devices=devices,
        num_iterations=1,
        num_fwd_stages=1
        + max((i.action.stage for i in intervals if i.action.op is Op.FWD), default=0),
        num_bwd_stages=1
        + max((i.action.stage for i in intervals if i.action.op is Op.BWD), default=0),
        makespan_ms=span,
        iteration_ms=span,
        busy_ms=busy,
        bubble_ratio=1 - busy / (devices * span) if span > 0 else 0.0,
        bubble_ratio_fill_drain=None,
        intervals=tuple(intervals),
        peak_memory_bytes=tuple(0 for _ in range(devices)),
        bytes_moved={},
    )
