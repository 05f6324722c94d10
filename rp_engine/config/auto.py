"""Hugging Face ``"auto"`` placeholders: filling them from explicit values (``auto_values``,
``hf_auto_values`` computes them as Hugging Face's Trainer does) and finding the ones left."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from rp_engine.config.errors import ConfigError, _join, _show

# every config module logs as "rp_engine.config" (one logger for the config reader)
logger = logging.getLogger("rp_engine.config")

__all__ = ["hf_auto_values"]

# Sections whose values rp_engine reads; an "auto" left in any of them is an error.
_CONSUMED_TOP_LEVEL_KEYS = frozenset(
    (
        "train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps optimizer "
        "scheduler zero_allow_untested_optimizer zero_force_ds_cpu_optimizer steps_per_print fp16 "
        "bf16 bfloat16 gradient_clipping communication_data_type wall_clock_breakdown "
        "zero_optimization activation_checkpointing comms_logger tensorboard wandb csv_monitor "
        "comet flops_profiler checkpoint aio dataloader_drop_last roundpipe"
    ).split()
)
# DeepSpeed's own defaults that are the literal string "auto": not Hugging Face placeholders.
# keys whose value "auto" is a real choice, not a placeholder for the HF Trainer to fill
_LEGIT_AUTO_PATHS = frozenset(
    {
        "pipeline.stages",
        "data_types.keep_in_fp32_modules",
        "roundpipe.nvme_io_engine",
        "roundpipe.staleness_compensation",
    }
)

_AUTO = "auto"


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value


def _apply_auto_values(raw: dict[str, Any], auto_values: Mapping[str, Any]) -> None:
    """Replace "auto" at each dotted key path with the given value (None removes the key, so the
    value is inferred or defaulted). Paths that are absent or not "auto" are left alone."""
    for dotted, value in auto_values.items():
        if not isinstance(dotted, str) or not dotted:
            raise ConfigError(
                f"auto_values keys must be dotted key paths like 'optimizer.params.lr', "
                f"got {dotted!r}"
            )
        parts = dotted.split(".")
        if parts[0] == "bf16" and "bf16" not in raw and "bfloat16" in raw:
            parts[0] = "bfloat16"  # DeepSpeed's old section name
        node: Any = raw
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or parts[-1] not in node:
            continue
        current = node[parts[-1]]
        if _is_auto(current):
            if value is None:
                del node[parts[-1]]
            else:
                node[parts[-1]] = _jsonable(value)
        elif current != _jsonable(value):
            logger.info(
                "auto_values[%r] = %s not used: the config sets %s = %s",
                dotted,
                _show(value),
                dotted,
                _show(current),
            )


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == _AUTO


def _find_autos(node: Any, path: str) -> list[str]:
    if path in _LEGIT_AUTO_PATHS:
        return []
    if _is_auto(node):
        return [path]
    found: list[str] = []
    if isinstance(node, dict):
        for k, v in node.items():
            if not path and k not in _CONSUMED_TOP_LEVEL_KEYS:
                continue  # ignored sections: their values never reach rp_engine
            found += _find_autos(v, _join(path, str(k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += _find_autos(v, f"{path}[{i}]")
    return found


def hf_auto_values(
    *,
    hidden_size: int | None,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    fp16: bool = False,
    bf16: bool = False,
    gradient_clipping: float = 1.0,
    world_size: int = 1,
) -> dict[str, Any]:
    """The values Hugging Face's DeepSpeed integration puts in place of "auto"
    (transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig), keyed by dotted path."""
    values: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "train_batch_size": micro_batch_size * gradient_accumulation_steps * world_size,
        "gradient_clipping": gradient_clipping,
        "optimizer.params.lr": lr,
        "optimizer.params.betas": [betas[0], betas[1]],
        "optimizer.params.eps": eps,
        "optimizer.params.weight_decay": weight_decay,
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": lr,
        # HF keeps it positive: DeepSpeed >= 0.19.6 rejects warmup_num_steps <= 0.
        "scheduler.params.warmup_num_steps": max(1, warmup_steps),
        "fp16.enabled": fp16,
        "bf16.enabled": bf16,
    }
    if total_steps is not None:
        values["scheduler.params.total_num_steps"] = total_steps
    if hidden_size is not None:
        values["zero_optimization.reduce_bucket_size"] = hidden_size * hidden_size
        values["zero_optimization.stage3_prefetch_bucket_size"] = int(
            0.9 * hidden_size * hidden_size
        )
        values["zero_optimization.stage3_param_persistence_threshold"] = 10 * hidden_size
    return values
