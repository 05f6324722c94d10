"""rp_engine: RoundPipe training engine, a drop-in replacement for ``deepspeed.initialize``.

::

    engine, optimizer, _, lr_scheduler = rp_engine.initialize(
        model=model, config="ds_config.json", model_parameters=model.parameters())

Public names: ``initialize``, ``RoundPipeEngine``, ``add_config_arguments``,
``init_distributed``, ``__version__``. Importing the package does no work and touches no device.
"""

from __future__ import annotations

import argparse
import os
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
    checkpoint: str | os.PathLike[str] | None = None,
) -> tuple[RoundPipeEngine, Any, Any, Any]:
    """Same arguments and 4-tuple as ``deepspeed.initialize``.

    Returns ``(engine, optimizer, engine.training_dataloader, engine.lr_scheduler)``. The
    optimizer is what DeepSpeed 0.19.8 returns for the same arguments and config
    (``rp_engine.optim.build.returned_optimizer``): the client's own optimizer object (or the one
    its callable built) where DeepSpeed returns it unwrapped (ZeRO stage 0, fp32), else
    rp_engine's wrapper, whose ``.optimizer`` is the client's object as in DeepSpeed's wrappers;
    ``engine.optimizer`` is the same object (the engine drives ``engine.host_optimizer``).
    Either way the client's object steps the fp32 host masters, driven by ``engine.step()``.
    Misuse that DeepSpeed asserts against raises an error that is also an AssertionError.
    Works in a plain single process: no launcher environment, no mpi4py. ``auto_values`` fills
    Hugging Face ``"auto"`` placeholders (see ``rp_engine.config.hf_auto_values``). Raises
    ``PreflightError`` when the model's host state would not fit in memory (host_preflight.py).
    A model built under ``deepspeed.zero.Init`` (or Transformers' ``HfDeepSpeedConfig``) is taken
    over from its ZeRO-3 partitions layer by layer first (model/zero3.py); a parameter that holds
    no data for its shape raises ``EmptyParameterError`` naming it.

    ``model`` may also be the path of a Hugging Face ``save_pretrained`` folder (a str or
    ``os.PathLike``) or a hub id (``"org/name"``, ``"org/name@revision"``: its snapshot folder
    from the Hugging Face cache, downloaded unless offline: model/hub.py), and a model whose
    parameters are on the meta device may come with ``checkpoint=<folder>``: the weights are
    then read layer by layer from the folder's safetensors files, in the run's dtype, frozen
    ones (``requires_grad=False``) served from the file mapping without a copy
    (model/folder.py). Trainable weights backed by a file are copied into memory first.
    """
    from rp_engine.autotune import advise_batch
    from rp_engine.config import load_config, load_raw_config, resolve_config_arg
    from rp_engine.config.errors import _InitArgError
    from rp_engine.engine import RoundPipeEngine
    from rp_engine.host_preflight import check_initialize

    if model is None:  # deepspeed.initialize asserts it: the error is also an AssertionError
        raise _InitArgError(
            "initialize(model=...) is required: pass the torch.nn.Module to train as model="
        )
    if mpu is not None or mesh_param is not None:
        raise ValueError("model parallelism (mpu / mesh_param) is not supported by rp_engine")
    model, checkpoint = _model_and_checkpoint(model, checkpoint)
    world = _data_parallel_world(distributed_port, dist_init_required)
    if checkpoint is None:
        _take_over_weights(model)
    source = resolve_config_arg(args, config, config_params)
    # DeepSpeed's autotuning block: the advisor fills "auto" batch sizes (autotune.py); the
    # caller's own auto_values win
    tuned = advise_batch(load_raw_config(source), model, world)
    if tuned:
        auto_values = {**tuned, **(auto_values or {})}
    cfg = load_config(source, world_size=world, auto_values=auto_values)
    if checkpoint is not None:  # the run's dtype is known now: files are cast to it per layer
        _load_folder(model, checkpoint, cfg)
    _own_trainable(model, cfg)
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


def _model_and_checkpoint(model: Any, checkpoint: Any) -> tuple[Any, Any]:
    """``(module, folder to load it from or None)``: a folder path as ``model`` becomes its
    model built with parameters on the meta device (model/folder.py); ``checkpoint`` must come
    with a model whose parameters are (some of them) on the meta device. A hub id in either
    place is its snapshot folder of the Hugging Face cache (model/hub.py)."""
    import torch

    from rp_engine.model.folder import FolderError, build_empty, is_model_folder
    from rp_engine.model.hub import local_folder

    if isinstance(model, str | os.PathLike):
        from transformers import AutoConfig

        if checkpoint is not None:
            raise FolderError(
                f"initialize(model={os.fspath(model)!r}, checkpoint=...): give the folder once, "
                "as model= (or a meta-device module as model= and the folder as checkpoint=)"
            )
        # a hub id ("org/name[@revision]") becomes its snapshot folder in the HF cache
        path = os.fspath(local_folder(model))
        if os.path.isfile(os.path.join(path, "adapter_config.json")) and not is_model_folder(path):
            from rp_engine.model.folder import from_folder

            # a peft adapter: its base folder loaded in the config's dtype (a frozen base in
            # another dtype than the run's is cast whole by the engine), the adapter trainable
            return from_folder(path), None
        if not is_model_folder(path):
            raise FolderError(
                f"initialize(model={os.fspath(model)!r}): not a save_pretrained folder "
                "(config.json and model.safetensors or model.safetensors.index.json) nor a "
                "Hugging Face hub id (org/name or org/name@revision); give the folder's path"
            )
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        return build_empty(config), path
    if checkpoint is not None:
        if not isinstance(model, torch.nn.Module) or not any(p.is_meta for p in model.parameters()):
            raise FolderError(
                "initialize(checkpoint=...) fills a model whose parameters are on the meta "
                "device (built under torch.device('meta')); this model already holds its "
                "weights: load them yourself, or build it on meta"
            )
        return model, os.fspath(local_folder(checkpoint))
    return model, None


def _load_folder(model: Any, folder: str | os.PathLike[str], cfg: Any) -> None:
    """Read ``model``'s weights from ``folder`` in the run's compute dtype, then check every
    parameter holds them (model/folder.py)."""
    from rp_engine.model.batches import compute_dtype
    from rp_engine.model.folder import load_weights

    load_weights(model, folder, dtype=compute_dtype(cfg))
    _take_over_weights(model)


def _take_over_weights(model: Any) -> None:
    """Whole weights in every parameter before anything sizes or cuts the model: a model built
    under ``deepspeed.zero.Init`` (or Transformers' ``HfDeepSpeedConfig``) is gathered from its
    ZeRO-3 partitions layer by layer (model/zero3.py); a parameter that still holds no data for
    its shape is refused by name. A LayerSpec list builds its modules later (model/layers.py)."""
    import torch

    from rp_engine.model.folder import frozen_file_views
    from rp_engine.model.zero3 import check_parameter_storage, has_partitions, take_over

    if isinstance(model, torch.nn.Module):
        if has_partitions(model):
            # loaded from a folder: its frozen weights are served from the files where equal
            take_over(model, files=frozen_file_views(model))
        check_parameter_storage(model)


def _own_trainable(model: Any, cfg: Any) -> None:
    """Trainable weights still in a file mapping (a folder's model) are written by the
    optimizer's publish: into ordinary memory now, frozen ones stay served from the files
    (model/folder.py). Not with the NVMe parameter tier: it copies every weight it pages from
    the mapping into its swap file, layer by layer, and the mapping is dropped, so a full
    fine-tune from a folder never holds the model in anonymous memory (the few it keeps in
    RAM, ``max_in_cpu`` layers and shared weights, turn anonymous as they are written)."""
    import torch

    from rp_engine.model.folder import own_trainable

    if isinstance(model, torch.nn.Module) and cfg.zero.offload_param_device != "nvme":
        own_trainable(model)


def _data_parallel_world(port: int, dist_init_required: bool | None) -> int:
    """The data-parallel world size; with a launcher's ``WORLD_SIZE > 1`` the process group is
    made first (``init_distributed``). One process per node: it drives every local device."""
    import os

    from rp_engine import distributed

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 or dist_init_required:
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if world > 1 and missing:
            raise ValueError(
                f"WORLD_SIZE={world} but {', '.join(missing)} not set: launch every node's process "
                "with `torchrun` or the `deepspeed` launcher (see README, Across nodes)"
            )
        distributed.init_distributed(
            distributed_port=port, dist_init_required=dist_init_required, verbose=False
        )
    return distributed.dp_world()


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's argument group (--deepspeed, --deepspeed_config, deprecated --deepscale*)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="Enable DeepSpeed")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json config")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def init_distributed(*args: Any, **kwargs: Any) -> None:
    """``deepspeed.init_distributed`` (same arguments): see rp_engine.distributed."""
    from rp_engine.distributed import init_distributed as init

    init(*args, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "RoundPipeEngine":
        from rp_engine.engine import RoundPipeEngine

        return RoundPipeEngine
    raise AttributeError(name)
