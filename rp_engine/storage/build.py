"""Build the NVMe tier a ds_config asks for (``offload_optimizer.device: "nvme"``).

The engine calls ``build_optimizer_tier`` after the host store (paged masters) and the optimizer
exist; every refusal is a ``ValueError`` or ``NvmeSpaceError`` naming the key and the fix, raised
before anything is written to the NVMe folder.
"""

from __future__ import annotations

from typing import Any

from rp_engine.storage.io_engine import make_io_engine
from rp_engine.storage.optimizer_tier import OptimizerTier, tier_bytes
from rp_engine.storage.swap_file import check_nvme_path

__all__ = ["build_optimizer_tier", "wants_optimizer_tier"]

_KEY = "zero_optimization.offload_optimizer.nvme_path"


def wants_optimizer_tier(cfg: Any) -> bool:
    """Whether ``cfg`` (a DSConfig) puts the optimizer state on NVMe."""
    return bool(cfg.zero.offload_optimizer_device == "nvme")


def build_optimizer_tier(
    cfg: Any, store: Any, optimizer: Any, *, rank: int, data_parallel: bool
) -> OptimizerTier:
    """The optimizer tier over ``store``'s paged masters and ``optimizer``'s moments (see
    storage/optimizer_tier.py), its swap file reserved under the config's ``nvme_path``."""
    if not optimizer.per_layer:
        raise ValueError(
            'zero_optimization.offload_optimizer.device "nvme" streams Adam state layer by '
            f"layer: it needs Adam/AdamW on DeepSpeed's CPU Adam, not {type(optimizer.optimizer).__name__}"
            ' (set "optimizer": {"type": "AdamW", ...} or use device "cpu")'
        )
    if data_parallel:
        raise ValueError(
            'zero_optimization.offload_optimizer.device "nvme" is not supported with data '
            'parallel yet: run one process, or use device "cpu"'
        )
    if cfg.roundpipe.step_journal == "on":
        raise ValueError(
            'roundpipe.step_journal "on" keeps a RAM copy of the state the NVMe tier moves out '
            'of RAM: use "if_memory_allows" or "off" with offload_optimizer.device "nvme"'
        )
    opt = cfg.zero.offload_optimizer
    disk, _ = tier_bytes(store, opt.buffer_count)
    folder = check_nvme_path(opt.nvme_path, disk, key=_KEY)
    engine = make_io_engine(cfg.roundpipe.nvme_io_engine, cfg.aio)
    try:
        return OptimizerTier(
            store, optimizer, folder=folder, rank=rank, engine=engine,
            buffer_count=opt.buffer_count,
        )  # fmt: skip
    except BaseException:
        engine.close()
        raise
