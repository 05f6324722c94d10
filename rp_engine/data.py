"""Training data: DeepSpeed's single-process training loader and its repeating wrapper."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

__all__ = ["build_dataloader", "RepeatingLoader", "repeat", "DataFeed"]


def build_dataloader(training_data: Any, cfg: Any, collate_fn: Any = None) -> DataLoader[Any]:
    """DeepSpeed's training loader (``deepspeed_io``): micro-batch size, ``dataloader_drop_last``,
    ``collate_fn`` and a ``DistributedSampler`` over the data-parallel ranks (this process's
    rank of the torch.distributed group; rank 0 of 1 without one).

    That sampler shuffles with seed 0 and DeepSpeed never calls ``set_epoch``, so every epoch
    repeats the same permutation; keeping it gives exactly DeepSpeed's sample order. Batches are
    assembled in this process (workers would fork a process that runs threads).
    """
    sampler: DistributedSampler[Any] | None
    if isinstance(training_data, IterableDataset):
        sampler = None
    elif hasattr(training_data, "__getitem__") and hasattr(training_data, "__len__"):
        sampler = DistributedSampler(training_data, num_replicas=_world(), rank=_rank())
    else:
        raise ValueError("Training data must be a torch Dataset (map-style or iterable)")
    return DataLoader(
        training_data,
        batch_size=cfg.train_micro_batch_size_per_gpu,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=cfg.dataloader_drop_last,
    )


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class RepeatingLoader:
    """Cycles a loader forever, restarting it at each epoch end (DeepSpeed's RepeatingLoader)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._it: Iterator[Any] = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
        try:
            return next(self._it)
        except StopIteration:
            raise ValueError(
                "the training data loader yields no batch at all (dataset smaller than "
                "train_micro_batch_size_per_gpu with dataloader_drop_last?)"
            ) from None


def repeat(loader: Any) -> RepeatingLoader:
    """An infinite iterator over ``loader``'s batches, epoch after epoch."""
    return RepeatingLoader(loader)


class DataFeed:
    """Where ``train_batch`` / ``eval_batch`` take micro-batches from: the caller's iterator,
    else the engine's own training loader (``initialize(training_data=...)``), repeated."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._own: Iterator[Any] | None = None

    def take(self, data_iter: Iterator[Any] | None, n: int) -> list[Any]:
        if data_iter is None:
            if self.loader is None:
                raise ValueError("train_batch() needs a data_iter or initialize(training_data=...)")
            if self._own is None:
                self._own = iter(repeat(self.loader))
            data_iter = self._own
        return [next(data_iter) for _ in range(n)]
