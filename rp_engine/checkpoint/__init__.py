"""Checkpoints in DeepSpeed's ZeRO layout (``engine.save_checkpoint`` / ``load_checkpoint`` /
``save_16bit_model``); see writer.py for the layout."""

from __future__ import annotations

from rp_engine.checkpoint.writer import (
    load,
    model_file_name,
    optim_file_name,
    save,
    save_16bit,
)

__all__ = ["save", "load", "save_16bit", "model_file_name", "optim_file_name"]
