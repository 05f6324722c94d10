"""Shared test setup: DeepSpeed's CPU Adam build cache outside the checkout, quiet logs, and
one CPU probe per test process."""

from __future__ import annotations

import functools
import os
from typing import Any

os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    os.path.join(os.path.expanduser("~"), ".cache", "rp_engine", "torch_extensions"),
)
os.environ.setdefault("WANDB_MODE", "disabled")


def _probe_the_cpu_once() -> None:
    """DeepSpeedCPUAdam's constructor calls ``cpuinfo.get_cpu_info()``, which runs a Python
    subprocess (~1.2 s, nearly all of an engine's construction on CPU); the suite builds hundreds
    of engines in one process on one CPU, so the answer is kept (it is read by ``from cpuinfo
    import get_cpu_info`` inside the constructor, hence patching the module attribute works)."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed brings it; without it nothing calls it
        return
    probe = functools.cache(cpuinfo.get_cpu_info)

    def get_cpu_info() -> dict[str, Any]:
        return dict(probe())  # a copy: a caller may edit its dict

    cpuinfo.get_cpu_info = get_cpu_info


_probe_the_cpu_once()
