"""Shared test setup: DeepSpeed's CPU Adam build cache outside the checkout, quiet logs."""

from __future__ import annotations

import os

os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    os.path.join(os.path.expanduser("~"), ".cache", "rp_engine", "torch_extensions"),
)
os.environ.setdefault("WANDB_MODE", "disabled")
