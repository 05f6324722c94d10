"""Device memory metering for the host-thread devices (CPU virtual devices, and the CUDA
backend's bookkeeping): ``MemoryLedger`` counts the bytes a device holds per storage against an
emulated capacity (overuse: ``DeviceError``), and ``_AllocationMeter`` counts every storage the
ops of a metered thread create (``CPUDevice.meter_compute``). Apart from cpu.py, which runs the
streams and events, because a reader of either does not need the other; cpu.py re-exports
``MemoryLedger``.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .base import DeviceError

__all__ = ["MemoryLedger"]

_MIB = 1024 * 1024


@dataclass
class _Tracked:
    storage: weakref.ref[torch.UntypedStorage]
    nbytes: int
    refs: int  # track() calls not yet freed; 0: only created under a meter (track_created)


class MemoryLedger:
    """Bytes a device holds, counted per storage (views of one storage count once).

    ``track`` of the same storage twice takes two ``free`` calls (a reference count) but its
    bytes count once. ``free`` of an untracked tensor is a no-op. Storages are held by weak
    reference: one that died without ``free`` (its memory is gone) stops counting, and its
    address, reused by a new tensor, is not mistaken for the old one.

    ``track_created`` counts a storage an op created under a meter (``meter_compute``) until
    the storage dies (a weak-reference callback: at once, so the peak is exact); a later
    ``track`` of it counts the same bytes, once, until its ``free``.
    """

    def __init__(self, device_index: int, capacity_bytes: int | None) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive or None, got {capacity_bytes}")
        self.device_index = device_index
        self.capacity = capacity_bytes or 0
        # reentrant: a created storage's death callback may run inside a locked section
        self._lock = threading.RLock()
        self._storages: dict[int, _Tracked] = {}  # storage data_ptr -> entry
        self._allocated = 0
        self._peak = 0
        self._h2d_bytes = 0
        self._d2h_bytes = 0
        self._host_alloc_bytes = 0

    def _drop(self, ptr: int) -> None:
        self._allocated -= self._storages.pop(ptr).nbytes

    def _prune(self) -> None:
        for ptr in [p for p, e in self._storages.items() if e.storage() is None]:
            self._drop(ptr)

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return
        with self._lock:
            entry = self._storages.get(ptr)
            if entry is not None:
                if entry.storage() is storage:
                    entry.refs += 1
                    return
                self._drop(ptr)  # a dead storage whose address was reused
            self._admit(nbytes, "need")
            self._storages[ptr] = _Tracked(weakref.ref(storage), nbytes, 1)
            self._allocated += nbytes
            self._peak = max(self._peak, self._allocated)

    def _admit(self, nbytes: int, what: str) -> None:
        """Room for ``nbytes`` more within the capacity (dead storages pruned first), else
        ``DeviceError`` ("device i out of memory: {what} X MiB ..."). Called under the lock."""
        if self.capacity and self._allocated + nbytes > self.capacity:
            self._prune()
        if self.capacity and self._allocated + nbytes > self.capacity:
            raise DeviceError(
                f"device {self.device_index} out of memory: {what} {nbytes / _MIB:.1f} MiB, "
                f"capacity {self.capacity / _MIB:.1f} MiB (roundpipe.device_memory_gb) with "
                f"{self._allocated / _MIB:.1f} MiB already allocated: the plan's stages and "
                "micro-batches do not fit the device (the planner fits them to the first "
                "batch's size; a later batch of more tokens is not planned for). Use smaller "
                "stages (roundpipe.fwd_cuts/bwd_cuts, or none to let the planner choose) or "
                "micro-batches, or raise roundpipe.device_memory_gb",
                device=self.device_index,
            )

    def track_created(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage, just created by an op on a metered stream, until it dies
        (a no-op for one already counted). Over the capacity: ``DeviceError``, as ``track``."""
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse and other storage-less layouts
            return
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return
        with self._lock:
            entry = self._storages.get(ptr)
            if entry is not None and entry.storage() is storage:
                return
            if entry is not None:
                self._drop(ptr)  # a dead storage whose address was reused
            self._admit(nbytes, "an op needs")
            ref = weakref.ref(storage, functools.partial(self._died, ptr))
            self._storages[ptr] = _Tracked(ref, nbytes, 0)
            self._allocated += nbytes
            self._peak = max(self._peak, self._allocated)

    def _died(self, ptr: int, ref: weakref.ref[torch.UntypedStorage]) -> None:
        with self._lock:
            entry = self._storages.get(ptr)
            if entry is not None and entry.storage is ref:
                self._drop(ptr)

    def free(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        with self._lock:
            entry = self._storages.get(ptr)
            if entry is None or entry.storage() is not storage:
                return
            entry.refs -= 1
            if entry.refs == 0:
                self._drop(ptr)

    def count_copy(self, nbytes: int, *, h2d: bool) -> None:
        with self._lock:
            if h2d:
                self._h2d_bytes += nbytes
            else:
                self._d2h_bytes += nbytes

    def count_host_alloc(self, nbytes: int) -> None:
        """A host buffer was allocated for this device's copies (``Device.host_buffer``)."""
        with self._lock:
            self._host_alloc_bytes += nbytes

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._prune()
            return {
                "allocated": self._allocated,
                "peak": self._peak,
                "capacity": self.capacity,
                "h2d_bytes": self._h2d_bytes,
                "d2h_bytes": self._d2h_bytes,
                "host_alloc_bytes": self._host_alloc_bytes,
            }

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self._allocated

    def clear(self) -> None:
        """Forget every tracked tensor (after an aborted step the runtime drops them all)."""
        with self._lock:
            self._storages.clear()
            self._allocated = 0


# Per op: whether its results alias an input (views, in-place and ``out=`` ops: their schema
# says so), read once per op rather than per call (the meter runs for every op of a device).
_ALIASES: dict[torch._ops.OpOverload, bool] = {}


def _aliases(func: torch._ops.OpOverload) -> bool:
    aliases = _ALIASES.get(func)
    if aliases is None:
        aliases = _ALIASES[func] = any(r.alias_info is not None for r in func._schema.returns)
    return aliases


class _AllocationMeter(TorchDispatchMode):
    """While entered on a thread: every storage an op there creates counts in ``ledger``
    (``MemoryLedger.track_created``). Ops whose results alias an input (views, in-place and
    ``out=`` ops) create nothing. Autograd's backward on CPU tensors runs on the calling
    thread, so a backward started inside is counted too.

    Its cost is a Python call per op (the dispatch mode's, most of it: the bookkeeping here
    is kept to a cached schema look-up and one ledger call per new storage)."""

    def __init__(self, ledger: MemoryLedger) -> None:
        super().__init__()
        self._track = ledger.track_created

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        out = func(*args, **(kwargs or {}))
        if _aliases(func):
            return out
        if isinstance(out, torch.Tensor):  # most ops: one tensor, no pytree walk
            if out.is_cpu:
                self._track(out)
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_cpu:
                self._track(t)
        return out
