"""Training data: DeepSpeed's single-process training loader, the engine's window-ahead view of
it, and its repeating wrapper."""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

__all__ = ["build_dataloader", "WindowLoader", "RepeatingLoader", "repeat", "DataFeed"]


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


class WindowLoader:
    """The loader ``initialize(training_data=...)`` returns: DeepSpeed's loader, read one
    accumulation window ahead.

    At the start of each window (``ahead()`` > 0: the engine's window is empty, at a boundary)
    it reads that many micro-batches and announces them (``announce``: the engine's
    ``expect_micro_batches``) before handing out the first. The engine then runs the whole
    window as one schedule at its first forward, so every loss the loop reads, before or after
    its backward, is already known: a loop that logs each loss runs at ``train_batch``'s
    speed. Mid-window (a loop that does not start at a boundary) it reads one batch at a time
    and announces nothing. Everything else (``len``, ``dataset``, ``sampler``,
    ``batch_size``...) is the wrapped loader's. The callbacks are held weakly: the loader may
    outlive the engine (then it is the plain loader)."""

    def __init__(
        self,
        loader: Any,
        *,
        ahead: Callable[[], int],
        announce: Callable[[list[Any]], None],
    ) -> None:
        self.loader = loader
        self._ahead = weakref.WeakMethod(ahead)  # type: ignore[arg-type]
        self._announce = weakref.WeakMethod(announce)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        queued: collections.deque[Any] = collections.deque()
        while True:
            if not queued:
                ahead, announce = self._ahead(), self._announce()
                n = ahead() if ahead is not None else 0
                if n > 0 and announce is not None:
                    queued.extend(_take(it, n))
                    # only dict micro-batches (``engine(**batch)``) can be announced
                    if queued and all(isinstance(b, Mapping) for b in queued):
                        announce(list(queued))
                else:
                    queued.extend(_take(it, 1))
                if not queued:
                    return
            yield queued.popleft()

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


def _take(it: Iterator[Any], n: int) -> list[Any]:
    out = []
    for _ in range(n):
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


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
