"""The Device protocol: the only interface the runtime uses to reach an accelerator.

A device owns named streams (by role), events, and memory accounting. Two backends implement it:
``cpu.py`` (virtual devices: each stream is a worker thread with a FIFO) and ``cuda.py`` (real
CUDA streams; each stream also has a host worker thread that issues work and runs host-side
callbacks). The runtime submits closures to streams; ordering within a stream is FIFO, ordering
across streams is expressed only with events.

Error contract: a closure that raises marks its stream failed; the exception is stored on every
event recorded after it (``Event.synchronize`` re-raises it in the waiting thread) and later
closures on that stream are skipped until ``Device.reset()``. Nothing ever calls ``os._exit``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch

__all__ = ["StreamRole", "Event", "Stream", "Device", "DeviceError", "ComputeTimer"]


class StreamRole(enum.Enum):
    """Streams by role. Compute and activation uploads are high priority on CUDA; weight
    prefetch is low priority so activations never queue behind a large weight upload."""

    COMPUTE = "compute"
    H2D_ACT = "h2d_act"  # activations / gradients flowing into the device
    H2D_PARAM = "h2d_param"  # weight uploads (prefetch)
    D2H = "d2h"  # gradient downloads
    D2H_ACT = "d2h_act"  # activations leaving the device (saved stage inputs, sends)
    HOST = "host"  # host work ordered by events (gradient accumulation), off the copy threads


class DeviceError(RuntimeError):
    """An exception raised by work on a device, re-raised in the caller's thread.

    ``device`` is the device index; ``where`` says what was running (e.g. "F2.3" action text).
    The original exception is chained as ``__cause__``.
    """

    def __init__(self, message: str, *, device: int, where: str = "") -> None:
        super().__init__(message)
        self.device = device
        self.where = where


@runtime_checkable
class Event(Protocol):
    """Marks a point in a stream. Host threads may wait on it; other streams may wait on it."""

    def synchronize(self) -> None:
        """Block the calling host thread until the event's work is done; re-raise its error."""
        ...

    def query(self) -> bool:
        """True when the work before the event has completed (successfully or not)."""
        ...


@runtime_checkable
class Stream(Protocol):
    """An in-order queue of work on one device."""

    role: StreamRole

    def submit(self, fn: Callable[[], object], *, label: str = "") -> None:
        """Run ``fn`` after everything submitted before it on this stream.

        On CPU it runs on the stream's worker thread. On CUDA it runs on the stream's host
        thread inside ``torch.cuda.stream(...)`` (kernels it launches are asynchronous).
        ``label`` (an action text such as "F2.3") names the work in errors.
        """
        ...

    def record(self) -> Event:
        """Return an event completed when all work submitted so far on this stream is done."""
        ...

    def wait(self, event: Event) -> None:
        """Make work submitted after this call wait for ``event`` (never blocks the caller).

        ``event`` may come from any stream of any device of the same backend, and its record
        may still be queued. An event carrying an error fails this stream with that error."""
        ...


class ComputeTimer(Protocol):
    """A span of work on one stream: ``stop()`` ends it, ``seconds()`` reads it once done,
    ``offsets(base)`` gives (start, end) in seconds after another timer of the same device."""

    def stop(self) -> None: ...

    def seconds(self) -> float: ...

    def offsets(self, base: ComputeTimer) -> tuple[float, float]: ...


@runtime_checkable
class Device(Protocol):
    """One worker of the pool. Stateless between iterations: weights come and go."""

    index: int
    torch_device: torch.device  # where tensors for this device live (cpu for virtual devices)

    def stream(self, role: StreamRole) -> Stream: ...

    def to_device(self, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy a host tensor to this device. Call it inside a closure on an H2D stream; on CUDA
        it is non_blocking from pinned memory; on CPU it clones (and sleeps bytes/bandwidth when
        PCIe emulation is on). The copy is counted in the memory accounting until ``free``.
        The result is detached and has its own storage. On CUDA the host tensor must not be
        rewritten until an event recorded after the copy is done.

        ``out``: copy into this device tensor instead (same shape and dtype, e.g. a view of an
        ``empty`` tensor: a large tensor uploaded piece by piece); nothing new is counted as
        device memory, the copied bytes are."""
        ...

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor on this device, counted in the memory accounting until
        ``free`` (filled with ``to_device(..., out=)``). Call it inside a stream closure: on
        CUDA the memory belongs to that closure's stream, as ``to_device``'s result does."""
        ...

    def to_host(self, dev: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy a device tensor to host memory (into ``out`` when given). Call it inside a D2H
        closure. The caller must wait on an event recorded after it before reading the result."""
        ...

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat, uninitialised host tensor of exactly ``numel`` elements that ``to_host`` can
        copy into (``out=``): page-locked on CUDA (``pinned_empty``: exact size, not torch's
        power-of-two caching allocator), ordinary memory on CPU virtual devices. The caller
        owns and reuses it (e.g. a staging pool); its bytes are added to ``memory_stats()``'s
        "host_alloc_bytes", never to the device memory accounting."""
        ...

    def track(self, dev: torch.Tensor) -> None:
        """Count a tensor produced on the device (an activation) against the memory budget.
        Exceeding an emulated capacity raises ``DeviceError`` naming the device and budget."""
        ...

    def fence(self) -> Event:
        """Inside a stream closure: an event completed once the work this closure has launched
        on its stream so far is done (``host_sync`` without blocking; e.g. a ``to_host`` copy
        another host thread will read). Already complete on CPU virtual devices, whose copies
        are synchronous."""
        ...

    def host_sync(self) -> None:
        """Inside a stream closure: block until the work this closure launched on its stream is
        done (e.g. before host code reads a ``to_host`` result). No-op on CPU virtual devices,
        whose copies are synchronous."""
        ...

    def free(self, dev: torch.Tensor, used_by: Collection[StreamRole] | None = None) -> None:
        """Stop counting ``dev`` against the memory budget (the runtime drops its reference).

        ``used_by``: the streams other than the one that allocated ``dev`` that may still have
        queued work reading it (None: any stream). On CUDA the memory is not reused before that
        work is done; naming only the streams that used it lets it be reused sooner."""
        ...

    def memory_stats(self) -> dict[str, int]:
        """{"allocated": bytes, "peak": bytes, "capacity": bytes or 0 for unlimited,
        "h2d_bytes"/"d2h_bytes": bytes copied each way, "host_alloc_bytes": bytes of every
        ``host_buffer`` so far (neither ever decreases)}. "peak" is
        the most allocated at once since the device was made or since the last ``reset_peak``:
        the runtime never resets it, so it spans every run of its user's window."""
        ...

    def reset_peak(self) -> None:
        """Start a new peak window at what is allocated now (CUDA: the allocator's peak too)."""
        ...

    def timer(self) -> ComputeTimer:
        """Inside a COMPUTE closure: a timer started now on this device's compute stream. Call
        ``stop()`` at the closure's end and ``seconds()`` after the work is done (e.g. after a
        drain): on CUDA it measures GPU execution with timing events, not host issue time."""
        ...

    def rng_scope(self, seed: int) -> AbstractContextManager[None]:
        """Run the enclosed compute with the default RNG seeded to ``seed`` and restore it after.
        Dropout then depends only on (seed), never on which device or thread ran the layer.
        CPU virtual devices share one global generator, so the CPU backend holds a lock shared by
        all devices of its pool for the duration; CUDA seeds only this device's generator."""
        ...

    def reset(self) -> None:
        """Clear a failed state after an error so the next call works; drains pending work.

        Queued work that has not started is discarded (skipped); events not reached yet
        complete with a ``DeviceError``; tracked memory is forgotten. Call it while no other
        thread submits to this device."""
        ...

    def synchronize(self) -> None:
        """Wait for every stream of this device to drain (used at teardown and between calls,
        never inside a step)."""
        ...

    def close(self) -> None:
        """Stop worker threads. Idempotent."""
        ...
