"""Where ``rp-train`` reports: W&B (on by default), a tqdm bar, DeepSpeed-style print lines.

W&B runs offline when no API key is configured (no ``WANDB_API_KEY``, no api.wandb.ai entry in
~/.netrc), so a machine without network just works and the run can be uploaded later with
``wandb sync <run folder>/wandb/offline-run-*``. ``WANDB_MODE`` in the environment is left to
wandb itself; ``--no-wandb`` turns it off. The mode and the run directory are passed to
``wandb.init`` as settings, never written to ``os.environ`` (other code in the process keeps its
own W&B behaviour). The config's ``wandb`` section names project, team and group when present.
"""

from __future__ import annotations

import logging
import netrc
import os
from pathlib import Path
from typing import Any

__all__ = ["start_wandb", "wandb_mode", "host_rss_gb"]

log = logging.getLogger("rp_engine.cli")


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        auth = netrc.netrc().authenticators("api.wandb.ai")
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(auth and auth[2])


def wandb_mode() -> str | None:
    """The mode to pass to wandb.init: None (wandb decides: WANDB_MODE or a configured key),
    or "offline" when nothing is configured."""
    if "WANDB_MODE" in os.environ or _has_api_key():
        return None
    return "offline"


def start_wandb(
    *, run_dir: Path, name: str, config: dict[str, Any], project: str | None,
    team: str | None, group: str | None,
) -> Any:  # fmt: skip
    """A W&B run writing under ``run_dir/wandb``; returns the run object."""
    import wandb

    mode = wandb_mode()
    if mode == "offline":
        log.info("W&B: no API key configured, logging offline (sync later with `wandb sync`)")
    settings = wandb.Settings(mode=mode) if mode else wandb.Settings()  # type: ignore[arg-type]
    (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
    return wandb.init(
        project=project or "rp-train",
        entity=team,
        group=group,
        name=name,
        dir=str(run_dir),
        config=config,
        settings=settings,
        reinit="finish_previous",
    )


def host_rss_gb() -> float:
    import psutil

    return float(psutil.Process().memory_info().rss) / 2**30
