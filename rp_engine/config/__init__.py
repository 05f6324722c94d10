"""DeepSpeed config -> frozen typed dataclasses (the only reader of the raw ds_config dict).

One job per module, read in this order: ``errors.py`` (``ConfigError`` and the messages that
name the key), ``fields.py`` (a dataclass field is the spec of its key; generic section
reading), ``schema.py`` (the dataclasses users read), ``sources.py`` (dict, file or base64;
``resolve_config_arg``), ``auto.py`` (Hugging Face "auto" filling), ``parse.py`` (the
sections, and ``load_config``: the one reader of the raw dict).

Owns: reading a config given as a dict, an hjson/JSON file (comments allowed, duplicate keys
rejected) or a urlsafe-base64 JSON string; filling Hugging Face "auto" placeholders from explicit
values; DeepSpeed 0.19.8's defaults, aliases and batch-size inference; validation whose errors
name the key path, the bad value and the fix; and the "roundpipe" section (rp_engine's own knobs).

Strictness follows DeepSpeed: sections DeepSpeed validates with pydantic (zero_optimization,
offload_*, fp16, bf16, monitors, comms_logger) reject unknown keys; activation_checkpointing,
flops_profiler, aio, pipeline and unknown top-level keys are ignored (top-level ones with a
warning). Where DeepSpeed silently turns "auto" into a default, rp_engine asks for a value.
"""

from __future__ import annotations

from rp_engine.config.auto import hf_auto_values
from rp_engine.config.errors import ConfigError
from rp_engine.config.parse import (
    DEEPSPEED_LR_SCHEDULES,
    DEEPSPEED_OPTIMIZERS,
    load_config,
    load_raw_config,
)
from rp_engine.config.schema import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    CSVMonitorConfig,
    DSConfig,
    FP16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    RoundPipeConfig,
    SchedulerConfig,
    TensorBoardConfig,
    WandbConfig,
    ZeroConfig,
)
from rp_engine.config.sources import resolve_config_arg

__all__ = [
    "ConfigError",
    "DSConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "FP16Config",
    "BF16Config",
    "OffloadParamConfig",
    "OffloadOptimizerConfig",
    "ZeroConfig",
    "AioConfig",
    "ActivationCheckpointingConfig",
    "WandbConfig",
    "CSVMonitorConfig",
    "TensorBoardConfig",
    "CheckpointConfig",
    "RoundPipeConfig",
    "DEEPSPEED_OPTIMIZERS",
    "DEEPSPEED_LR_SCHEDULES",
    "load_config",
    "load_raw_config",
    "resolve_config_arg",
    "hf_auto_values",
]
