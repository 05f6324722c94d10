"""Build the NVMe tiers a ds_config asks for (``offload_optimizer`` / ``offload_param`` with
``device: "nvme"``).

The engine calls ``build_optimizer_tier`` after the host store (paged masters) and the optimizer
exist, and ``build_param_tier`` once the store's weight buffers are decided; every refusal is a ``ValueError`` or ``NvmeSpaceError`` naming the key and the fix, raised
before anything is written to the NVMe folder.
"""

from __future__ import annotations

import logging
from typing import Any

from rp_engine.host.defaults import default_grad_buffers
from rp_engine.plan.host_ram import PoolCounts
from rp_engine.plan.host_ram import slice_bytes as slice_bytes_of
from rp_engine.storage.grad_tier import GradTier, grad_records
from rp_engine.storage.io_engine import IOStats, make_io_engine
from rp_engine.storage.optimizer_tier import OptimizerTier, tier_bytes
from rp_engine.storage.param_tier import ParamTier, param_tier_plan
from rp_engine.storage.swap_file import NvmeSpaceError, check_nvme_path

__all__ = [
    "Tiers",
    "build_grad_tier",
    "build_optimizer_tier",
    "grad_buffer_count",
    "build_param_tier",
    "wants_optimizer_tier",
    "wants_param_tier",
]

log = logging.getLogger("rp_engine.storage")

_KEY = "zero_optimization.offload_optimizer.nvme_path"


def wants_optimizer_tier(cfg: Any) -> bool:
    """Whether ``cfg`` (a DSConfig) puts the optimizer state on NVMe."""
    return bool(cfg.zero.offload_optimizer_device == "nvme")


def build_optimizer_tier(
    cfg: Any, store: Any, optimizer: Any, *, rank: int, data_parallel: bool,
    buffer_count: int | None = None, slice_bytes: int | None = None,
) -> OptimizerTier:  # fmt: skip
    """The optimizer tier over ``store``'s paged masters and ``optimizer``'s moments (see
    storage/optimizer_tier.py), its swap file reserved under the config's ``nvme_path``;
    ``buffer_count``: its pool's (None: ``offload_optimizer.buffer_count``); ``slice_bytes``:
    its records' largest size (0: whole layers; None: ``roundpipe.optimizer_slice_mb``)."""
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
    if slice_bytes is None:
        slice_bytes = slice_bytes_of(cfg.roundpipe.optimizer_slice_mb)
    if slice_bytes and cfg.roundpipe.staleness_compensation == "lookahead_dc":
        raise ValueError(
            'roundpipe.staleness_compensation "lookahead_dc" compensates each tensor from its '
            "whole norms, which an optimizer tier stepping layers in slices never holds: unset "
            'roundpipe.optimizer_slice_mb, or choose "lookahead" (or raise the memory limit '
            "if the preflight sliced the layers to fit it)"
        )
    opt = cfg.zero.offload_optimizer
    count = opt.buffer_count if buffer_count is None else buffer_count
    disk, _ = tier_bytes(store, count, slice_bytes=slice_bytes)
    folder = check_nvme_path(opt.nvme_path, disk, key=_KEY)
    engine = make_io_engine(cfg.roundpipe.nvme_io_engine, cfg.aio)
    try:
        return OptimizerTier(
            store, optimizer, folder=folder, rank=rank, engine=engine, buffer_count=count,
            slice_bytes=slice_bytes,
        )  # fmt: skip
    except NvmeSpaceError as exc:
        engine.close()
        raise _naming(exc, _KEY, opt.nvme_path) from exc
    except BaseException:
        engine.close()
        raise


def _naming(exc: NvmeSpaceError, key: str, path: str | None) -> NvmeSpaceError:
    """The swap file's refusal (swap_file.SwapFile: its open, lock or reservation) with the
    ds_config key that chose the folder, as the checks before it name it."""
    return NvmeSpaceError(exc.errno, f"{key} = {path!r}: {exc.strerror}")


def grad_buffer_count(cfg: Any, *, trains: bool, num_devices: int) -> int:
    """Buffers of the gradient tier (storage/grad_tier.py) ``cfg`` asks for; 0: no tier (the
    whole-model gradient arena in RAM). ``roundpipe.grad_buffers`` null: 2 x devices + 4 with
    the NVMe optimizer tier, else 0. Raises, naming the key, for a pool too small to make
    progress (each device's host thread and the optimizer may each hold one buffer)."""
    chosen = cfg.roundpipe.grad_buffers
    if chosen is None:
        return default_grad_buffers(num_devices) if wants_optimizer_tier(cfg) and trains else 0
    if chosen and not wants_optimizer_tier(cfg):
        raise ValueError(
            f"roundpipe.grad_buffers = {chosen}: the gradient pool spills to the NVMe folder of "
            'zero_optimization.offload_optimizer (device "nvme"); set that, or grad_buffers 0'
        )
    fewest = PoolCounts.fewest(num_devices, grad_tier=True).grad
    if chosen and chosen < fewest:
        raise ValueError(
            f"roundpipe.grad_buffers = {chosen} is too few for {num_devices} device(s): at least "
            f"{fewest} (one per device's host thread, the optimizer's, one to spare); "
            "null chooses"
        )
    return int(chosen)


def build_grad_tier(
    cfg: Any, store: Any, *, buffer_count: int, rank: int, alloc: Any = None
) -> GradTier:
    """The gradient tier over ``store``'s pooled gradient records (storage/grad_tier.py), its
    file beside the optimizer tier's under ``offload_optimizer.nvme_path``."""
    group_bytes = store.group_bytes()
    disk = sum(r.nbytes for r in grad_records(group_bytes).values())
    folder = check_nvme_path(cfg.zero.offload_optimizer.nvme_path, disk, key=_KEY)
    engine = make_io_engine(cfg.roundpipe.nvme_io_engine, cfg.aio)
    try:
        return GradTier(
            group_bytes, folder=folder, rank=rank, engine=engine, buffer_count=buffer_count,
            alloc=alloc,
        )  # fmt: skip
    except NvmeSpaceError as exc:
        engine.close()
        raise _naming(exc, _KEY, cfg.zero.offload_optimizer.nvme_path) from exc
    except BaseException:
        engine.close()
        raise


_PARAM_KEY = "zero_optimization.offload_param.nvme_path"


def wants_param_tier(cfg: Any) -> bool:
    """Whether ``cfg`` (a DSConfig) puts the compute weights on NVMe."""
    return bool(cfg.zero.offload_param_device == "nvme")


def build_param_tier(
    cfg: Any, store: Any, *, rank: int, data_parallel: bool, buffer_count: int | None = None
) -> ParamTier | None:
    """The parameter tier over ``store``'s compute weights (storage/param_tier.py), its swap
    file under ``offload_param.nvme_path``; None when ``max_in_cpu`` keeps every layer in RAM.
    Call it once the store's weight buffers are decided (double-buffered or not).
    ``buffer_count``: its pool's (None: ``offload_param.buffer_count``)."""
    if data_parallel:
        raise ValueError(
            'zero_optimization.offload_param.device "nvme" is not supported with data parallel '
            'yet: run one process, or use device "cpu"'
        )
    conf = cfg.zero.offload_param
    plan = param_tier_plan(store, conf.max_in_cpu)
    if plan.file_elements:
        log.info(
            "NVMe parameter tier: %d frozen weight elements are read from their model files' "
            "mappings, not paged (model/folder.py)", plan.file_elements,
        )  # fmt: skip
    if not plan.paged:
        log.info(
            "NVMe parameter tier: offload_param.max_in_cpu (%d elements) keeps every layer's "
            "weights in RAM (or in their files)", conf.max_in_cpu,
        )  # fmt: skip
        return None
    folder = check_nvme_path(conf.nvme_path, plan.disk_bytes(store.weight_copies), key=_PARAM_KEY)
    engine = make_io_engine(cfg.roundpipe.nvme_io_engine, cfg.aio)
    try:
        tier = ParamTier(
            store,
            plan,
            folder=folder,
            rank=rank,
            engine=engine,
            buffer_count=conf.buffer_count if buffer_count is None else buffer_count,
        )
    except NvmeSpaceError as exc:
        engine.close()
        raise _naming(exc, _PARAM_KEY, conf.nvme_path) from exc
    except BaseException:
        engine.close()
        raise
    store.page_weights(tier)
    return tier


class Tiers:
    """The NVMe tiers an engine runs (optimizer, gradient, parameter; any may be absent), as
    one; given in the order they were built."""

    def __init__(self, *tiers: Any) -> None:
        self.tiers = [t for t in tiers if t is not None]

    def __bool__(self) -> bool:
        return bool(self.tiers)

    @property
    def stats(self) -> IOStats:
        """Both tiers' I/O, summed."""
        total = IOStats()
        for tier in self.tiers:
            total = total.plus(tier.stats)
        return total

    @property
    def disk_bytes(self) -> int:
        return sum(t.disk_bytes for t in self.tiers)

    @property
    def initial_bytes(self) -> int:
        """Bytes written at initialize: the files of the tiers that start with a state (not
        the gradient tier's, written only when it evicts)."""
        return sum(t.disk_bytes for t in self.tiers if t.writes_initially)

    def flush(self) -> None:
        for tier in self.tiers:
            tier.flush()

    def close(self) -> None:
        """Close every tier (each waits for its writes and removes its swap file), the last
        built first: a folder the first one made is empty, and removed, when it closes."""
        for tier in reversed(self.tiers):
            tier.close()
