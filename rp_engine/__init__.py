"""rp_engine: RoundPipe training engine, a drop-in replacement for ``deepspeed.initialize``.

::

    engine, optimizer, _, lr_scheduler = rp_engine.initialize(
        model=model, config="ds_config.json", model_parameters=model.parameters())

Public names: ``initialize``, ``RoundPipeEngine``, ``add_config_arguments``,
``init_distributed``, ``__version__``. Importing the package does no work and touches no device.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "initialize",
    "RoundPipeEngine",
    "add_config_arguments",
    "init_distributed",
    "__version__",
]

if TYPE_CHECKING:
    from rp_engine.engine import RoundPipeEngine


def initialize(
    args: Any = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
    *,
    auto_values: dict[str, Any] | None = None,
) -> tuple[RoundPipeEngine, Any, Any, Any]:
    """Same arguments and 4-tuple as ``deepspeed.initialize``.

    Returns ``(engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler)``.
    Works in a plain single process: no launcher environment, no mpi4py. ``auto_values`` fills
    Hugging Face ``"auto"`` placeholders (see ``rp_engine.config.hf_auto_values``). Raises
    ``PreflightError`` when the model's host state would not fit in memory (host_preflight.py).
    """
    from rp_engine.config import load_config, resolve_config_arg
    from rp_engine.engine import RoundPipeEngine
    from rp_engine.host_preflight import check_initialize

    if model is None:
        raise ValueError("initialize(model=...) is required")
    _check_single_process()
    if mpu is not None or mesh_param is not None:
        raise ValueError("model parallelism (mpu / mesh_param) is not supported by rp_engine")
    cfg = load_config(resolve_config_arg(args, config, config_params), auto_values=auto_values)
    check_initialize(model, cfg)  # before anything is allocated: refuse rather than be OOM-killed
    engine = RoundPipeEngine(
        model=model,
        config=cfg,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
    )
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _check_single_process() -> None:
    """One rp_engine process drives every local GPU; a launcher that starts one process per GPU
    (deepspeed --num_gpus N, torchrun --nproc_per_node N) would make each grab them all."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        raise ValueError(
            f"WORLD_SIZE={world}: rp_engine drives all local GPUs from ONE process (the RoundPipe "
            "worker pool), so launch a single process: `deepspeed --num_gpus 1 train.py ...` or "
            "`torchrun --nproc_per_node 1 train.py ...` (set roundpipe.devices to choose GPUs). "
            "Multi-node data parallel is not supported yet."
        )


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's argument group (--deepspeed, --deepspeed_config, deprecated --deepscale*)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="Enable DeepSpeed")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json config")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def init_distributed(*args: Any, **kwargs: Any) -> None:
    """Single-process training needs no process group: a no-op kept for API compatibility.
    (Multi-node data parallel arrives with its own issue.)"""


def __getattr__(name: str) -> Any:
    if name == "RoundPipeEngine":
        from rp_engine.engine import RoundPipeEngine

        return RoundPipeEngine
    raise AttributeError(name)
