"""Training monitors: W&B (offline unless a key or mode is configured), DeepSpeed-style CSV
and TensorBoard event files.

``Monitor.write_events([(tag, value, step), ...])`` mirrors ``deepspeed.monitor.MonitorMaster``.
W&B without an API key would raise "No API key configured" after a delay; rp_engine picks
``WANDB_MODE=offline`` itself in that case, so runs on machines without network just work and
can be synced later with ``wandb sync``. TensorBoard events go where DeepSpeed's
``TensorBoardMonitor`` puts them: ``os.path.join(output_path, job_name)``, so an empty
``output_path`` (the default) means ``./<job_name>`` under the working directory.
"""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from rp_engine.config import DSConfig

__all__ = ["Monitor"]

log = logging.getLogger("rp_engine.monitor")


class Monitor:
    """Fan-out of scalar events to the enabled backends."""

    def __init__(
        self, *, wandb_run: Any = None, csv_dir: Path | None = None, tb_writer: Any = None
    ) -> None:
        self._wandb = wandb_run
        self._csv_dir = csv_dir
        self._csv_files: dict[str, Any] = {}
        self._tb = tb_writer  # torch.utils.tensorboard.SummaryWriter

    @property
    def enabled(self) -> bool:
        return self._wandb is not None or self._csv_dir is not None or self._tb is not None

    @classmethod
    def from_config(cls, cfg: DSConfig) -> Monitor:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() != 0:  # as DeepSpeed: rank 0 writes
            return cls(wandb_run=None, csv_dir=None, tb_writer=None)
        wandb_run = None
        if cfg.wandb.enabled:
            wandb_run = _start_wandb(cfg)
        csv_dir = None
        if cfg.csv_monitor.enabled:
            root = cfg.csv_monitor.output_path or "./csv_monitor"
            csv_dir = Path(root) / cfg.csv_monitor.job_name
            csv_dir.mkdir(parents=True, exist_ok=True)
        tb_writer = None
        if cfg.tensorboard.enabled:
            tb_writer = _start_tensorboard(cfg)
        return cls(wandb_run=wandb_run, csv_dir=csv_dir, tb_writer=tb_writer)

    def write_step_stats(self, stats: dict[str, Any], samples: int) -> None:
        """One optimizer step's traffic and mean device busy fraction (engine.last_step_stats)."""
        busy = stats.get("busy_fraction") or {}
        self.write_events(
            [
                ("Train/Samples/h2d_bytes", float(stats["h2d_bytes"]), samples),
                ("Train/Samples/d2h_bytes", float(stats["d2h_bytes"]), samples),
                ("Train/Samples/weight_h2d_bytes", float(stats["weight_h2d_bytes"]), samples),
                (
                    "Train/Samples/device_busy_fraction",
                    sum(busy.values()) / len(busy) if busy else 0.0,
                    samples,
                ),
                *[  # the NVMe tier's bytes (SSD wear), when it is on
                    (f"Train/Samples/{key}", float(stats[key]), samples)
                    for key in ("nvme_write_bytes", "nvme_total_write_bytes")
                    if key in stats
                ],
            ]
        )

    def write_events(self, events: Iterable[tuple[str, float, int]]) -> None:
        events = list(events)
        if self._wandb is not None:
            for tag, value, step in events:
                self._wandb.log({tag: value}, step=step)
        if self._csv_dir is not None:
            for tag, value, step in events:
                self._csv_writer(tag).writerow([step, value])
                self._csv_files[tag][0].flush()
        if self._tb is not None:
            for tag, value, step in events:
                self._tb.add_scalar(tag, value, step)
            self._tb.flush()  # as DeepSpeed's write_events(flush=True): readable mid-run

    def _csv_writer(self, tag: str) -> Any:
        if tag not in self._csv_files:
            path = self._csv_dir / (tag.replace("/", "_") + ".csv")  # type: ignore[operator]
            new = not path.exists()
            f = open(path, "a", newline="")  # noqa: SIM115 - kept open for the run
            writer = csv.writer(f)
            if new:
                writer.writerow(["step", tag])
            self._csv_files[tag] = (f, writer)
        return self._csv_files[tag][1]

    def close(self) -> None:
        for f, _ in self._csv_files.values():
            f.close()
        self._csv_files.clear()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _start_tensorboard(cfg: DSConfig) -> Any:
    """A SummaryWriter at DeepSpeed's log_dir; needs the ``tensorboard`` package (a dependency)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch imports the tensorboard package lazily, here
        raise ImportError(
            "the config's tensorboard section needs the `tensorboard` package: "
            "pip install tensorboard, or set tensorboard.enabled to false"
        ) from e
    log_dir = os.path.join(cfg.tensorboard.output_path, cfg.tensorboard.job_name)
    os.makedirs(log_dir, exist_ok=True)
    return SummaryWriter(log_dir=log_dir)


def _start_wandb(cfg: DSConfig) -> Any:
    import wandb

    # WANDB_MODE or wandb's own settings decide; the environment is left alone
    mode: Literal["offline"] | None = None
    if "WANDB_MODE" not in os.environ and not os.environ.get("WANDB_API_KEY"):
        mode = "offline"
        log.info("W&B: no API key configured, logging offline (sync later with `wandb sync`)")
    return wandb.init(
        mode=mode,
        project=cfg.wandb.project,
        group=cfg.wandb.group,
        entity=cfg.wandb.team,
        config=dict(cfg.raw),
        reinit="finish_previous",
    )
