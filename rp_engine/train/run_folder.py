"""The run folder of ``rp-train``: ``./rp-runs/<time>-<model>/`` unless ``--out`` names one.

Holds ``ds_config.json`` (resolved), ``checkpoints/`` (DeepSpeed layout), ``adapter/`` (peft),
``wandb/``, ``loss.png`` (train and eval), ``timeline.png`` + ``timeline.json`` (Gantt and Chrome
trace of the last measured iteration) and ``summary.json``. matplotlib is imported only when a
picture is drawn, on a bare Figure (no pyplot global state).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["make_run_dir", "write_json", "write_loss_png", "write_timeline"]


def make_run_dir(out: str | None, model_name: str, *, root: str = "rp-runs") -> Path:
    """``out`` as given, else ``<root>/<YYYYmmdd-HHMMSS>-<model>`` (a suffix keeps it new)."""
    if out:
        path = Path(out)
    else:
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name) or "model"
        base = Path(root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{safe}"
        path, n = base, 1
        while path.exists():
            n += 1
            path = base.with_name(f"{base.name}-{n}")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, obj: Any) -> Path:
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    return path


def write_loss_png(
    path: Path,
    train: Sequence[tuple[int, float]],
    evals: Sequence[tuple[int, float]],
    *,
    title: str = "loss",
) -> Path:
    """Train loss per step (line) and eval loss (markers) against the optimizer step."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    if train:
        ax.plot([s for s, _ in train], [v for _, v in train], label="train", lw=1.2)
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", label="eval", lw=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def write_timeline(run_dir: Path, records: Sequence[Any], *, title: str) -> dict[str, Any] | None:
    """timeline.png + timeline.json of measured records (engine.last_timeline()); returns the
    measured bubble ratio and span, or None when nothing was recorded."""
    if not records:
        return None
    from rp_engine.plan import render

    result = render.measured_result(records)
    render.write_chrome_trace(result, run_dir / "timeline.json")
    render.write_png(
        result,
        run_dir / "timeline.png",
        lanes=render.STREAM_LANES,  # one row per device and stream
        title=f"{title}: measured iteration, bubble {100 * result.bubble_ratio:.1f} %, "
        f"{result.makespan_ms:.0f} ms",
    )
    return {"bubble_ratio": result.bubble_ratio, "iteration_ms": result.makespan_ms}
