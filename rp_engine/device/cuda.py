"""CUDA devices: real torch.cuda streams with priorities, each driven by a host worker thread.

Every role has a ``torch.cuda.Stream`` and a host thread (a ``ThreadStream`` from cpu.py) that
runs submitted closures inside ``torch.cuda.device(i)`` and ``torch.cuda.stream(s)``: closures
launch kernels and copies asynchronously and return. Events are two-level: a ``CUDAEvent`` is
"recorded" (host flag) when the stream's host thread reaches it and records the CUDA event, and
"done" when the GPU passes that point. A wait task first blocks its host thread until the event
is recorded, then calls ``wait_event`` on the GPU stream: waiting on a CUDA event that was not
recorded yet would silently be a no-op, the classic multi-stream race.

Priorities (a lower number runs first): COMPUTE and H2D_ACT highest, D2H in between, H2D_PARAM
lowest, so activations never queue behind weight prefetch in the kernel scheduler. Copy
engines largely ignore stream priorities; ordering big weight copies into the gaps between
activation copies is the transfer engine's job.

Host waits sleep: every ``torch.cuda.Event`` here is created ``blocking=True``
(``cudaEventBlockingSync``: the thread sleeps until the GPU passes the event). A default event,
like ``cudaStreamSynchronize``, waits by the device's scheduling policy, which with fewer GPU
contexts than cores (``cudaDeviceScheduleAuto``) is to spin a core at 100 % for the whole wait;
the threads that wait (the main thread in ``losses``/``finish``, the HOST workers before adding
up a download, ``HostStore.publish`` behind an upload) would take cores from the CPU Adam team
and the accumulation workers. A blocking wait costs some microseconds of wake-up latency, small
beside the millisecond copies and kernels waited for.

What the runtime must do itself (CUDA's caching allocator tracks tensors per stream):
- a tensor made on one stream (``to_device`` on H2D_PARAM) and used on another (COMPUTE) must be
  passed to ``tensor.record_stream(device.raw_stream(StreamRole.COMPUTE))``, or freed only after
  an event recorded on the consumer stream, else its memory can be reused too early;
- a pinned host tensor being uploaded must not be rewritten (optimizer step) before an event
  recorded after the upload is done; a ``to_host`` result must not be read before its event.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import threading
import weakref
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from .base import ComputeTimer, DeviceError, StreamRole
from .cpu import CPUEvent, ThreadedDevice, ThreadStream

__all__ = [
    "CUDADevice",
    "CUDAEvent",
    "CUDAStream",
    "CUDATimer",
    "cap_allocator",
    "is_pinned",
    "pin",
    "pinned_empty",
    "stream_priorities",
]

log = logging.getLogger("rp_engine.device")

_PAGE = mmap.PAGESIZE
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context
# The live ``pinned_empty`` registrations: sorted start addresses and each one's span in bytes.
_registered_starts: list[int] = []
_registered_spans: dict[int, int] = {}
_registered_lock = threading.Lock()


def is_pinned(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is page-locked: a block of torch's pinned allocator
    (``Tensor.is_pinned``) or memory ``pinned_empty`` registered. torch's own check does not
    see the latter (torch 2.11 on an H200: ``is_pinned`` is False for a registered range, though
    the driver holds it locked and copies from it asynchronously), so ask this instead."""
    if t.device.type != "cpu":
        return False
    if t.is_pinned():
        return True
    addr = t.data_ptr()
    with _registered_lock:
        i = bisect.bisect_right(_registered_starts, addr) - 1
        return i >= 0 and addr < _registered_starts[i] + _registered_spans[_registered_starts[i]]


def pin(t: torch.Tensor) -> torch.Tensor:
    """Return a copy of ``t`` in pinned (page-locked) memory when CUDA is available, else ``t``.

    Pinned memory is what makes ``to_device``/``to_host`` truly asynchronous; pinning raises
    without an accelerator, hence the guard. The copy is ``pinned_empty``: exactly the tensor's
    bytes (``Tensor.pin_memory`` would round each block up to a power of two).
    """
    if not torch.cuda.is_available() or t.device.type != "cpu" or is_pinned(t):
        return t
    out = pinned_empty(t.numel(), t.dtype).view(t.shape)
    out.copy_(t)
    return out


def pinned_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A flat, uninitialised host tensor of exactly ``numel`` elements in page-locked memory.

    torch's caching host allocator (``pin_memory=True``, ``Tensor.pin_memory``) rounds every
    block up to a power of two: a 622 MB embedding would take 1 GiB of locked memory. Here plain
    memory is registered with ``cudaHostRegister`` instead, rounded to whole pages only. The
    registered pages lie strictly inside their own allocation (so two tensors never register the
    same page) and are unregistered when the last tensor viewing them is freed, before the memory
    is. Without CUDA the tensor is ordinary memory.
    """
    if not torch.cuda.is_available():
        return torch.empty(numel, dtype=dtype)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    span = -(-max(nbytes, 1) // _PAGE) * _PAGE
    raw = np.empty(span + _PAGE, dtype=np.uint8)  # the storage owns it (torch.from_numpy)
    start = -raw.ctypes.data % _PAGE
    addr = raw.ctypes.data + start
    torch.cuda.check_error(
        torch.cuda.cudart().cudaHostRegister(addr, span, _HOST_REGISTER_PORTABLE)
    )
    with _registered_lock:
        bisect.insort(_registered_starts, addr)
        _registered_spans[addr] = span
    # numpy runs weakref callbacks before it frees the buffer: unregister first, then free.
    weakref.finalize(raw, _unregister, addr)
    return torch.from_numpy(raw)[start : start + nbytes].view(dtype)


def _unregister(addr: int) -> None:
    with _registered_lock:
        del _registered_spans[addr]
        del _registered_starts[bisect.bisect_left(_registered_starts, addr)]
    # At interpreter exit CUDA may already be torn down; the process frees everything anyway.
    try:
        torch.cuda.cudart().cudaHostUnregister(addr)
    except Exception:  # noqa: BLE001 - never raise from a finaliser
        pass


def cap_allocator(device_index: int, capacity_bytes: int) -> float:
    """Cap torch's caching allocator on GPU ``device_index`` at ``capacity_bytes`` for this
    process (``torch.cuda.set_per_process_memory_fraction``) and return the fraction set.

    The budget (``roundpipe.device_memory_gb``) is a limit, not a hint: the planner fits its
    plans under it, and an allocation that would take the allocator past it raises
    ``torch.OutOfMemoryError`` (after the allocator has returned its cached free blocks), as a
    GPU of that size would. The cap counts what the allocator reserves (its segments), which
    is at least what ``max_memory_allocated`` reports; the CUDA context and anything allocated
    outside torch (NCCL's buffers) are not in it. A budget above the GPU's memory caps nothing
    (fraction 1) and is logged as a warning: the plan then assumes memory the GPU lacks.
    """
    total = torch.cuda.get_device_properties(device_index).total_memory
    fraction = min(1.0, capacity_bytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device_index)
    gib = 2**30
    if capacity_bytes > total:
        log.warning(
            "cuda:%d: roundpipe.device_memory_gb (%.2f GiB) exceeds the GPU's %.2f GiB; the "
            "allocator is not capped below the GPU",
            device_index, capacity_bytes / gib, total / gib,
        )  # fmt: skip
    else:
        log.info(
            "cuda:%d: caching allocator capped at %.2f GiB (roundpipe.device_memory_gb; "
            "fraction %.4f of %.2f GiB)",
            device_index, capacity_bytes / gib, fraction, total / gib,
        )  # fmt: skip
    return fraction


def stream_priorities(device_index: int) -> dict[StreamRole, int]:
    """CUDA stream priority per role on a device (a lower number is a higher priority).

    torch hands out streams from a few pooled priority levels (fewer than CUDA's range on some
    GPUs), so "normal" is placed between the highest level torch really gives and the lowest.
    """
    get_range: Callable[[], tuple[int, int]] = torch.cuda.Stream.priority_range  # type: ignore[assignment]
    try:
        least, greatest = get_range()
    except TypeError:  # bound as an instance method in some builds
        least, greatest = torch.cuda.Stream(device=device_index).priority_range()
    high, low = min(least, greatest), max(least, greatest)
    high = torch.cuda.Stream(device=device_index, priority=high).priority  # the level granted
    normal = (high + low) // 2
    return {
        StreamRole.COMPUTE: high,
        StreamRole.H2D_ACT: high,
        StreamRole.D2H: normal,
        StreamRole.D2H_ACT: high,
        StreamRole.HOST: normal,  # runs host closures; its CUDA stream stays idle
        StreamRole.H2D_PARAM: low,
    }


class CUDAEvent(CPUEvent):
    """A host "recorded" flag (with the stream's error) plus the ``torch.cuda.Event``."""

    def __init__(self, device_index: int) -> None:
        super().__init__()
        self.device_index = device_index
        # blocking: host threads synchronize on it (module docstring); no timing (cheaper).
        # Created lazily by CUDA at its first record.
        self.cuda_event = torch.cuda.Event(blocking=True)

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait until recorded (``timeout`` bounds only this part), re-raise the stream's
        error, then wait for the GPU to pass the event; a CUDA error becomes DeviceError."""
        super().synchronize(timeout)
        try:
            self.cuda_event.synchronize()
        except RuntimeError as exc:
            raise DeviceError(
                f"device {self.device_index}: CUDA error: {exc}", device=self.device_index
            ) from exc

    def query(self) -> bool:
        if not self._done.is_set():
            return False
        return self._error is not None or self.cuda_event.query()


class CUDATimer:
    """Two timing events on the current stream: GPU busy time, not host issue time.

    Blocking too: ``seconds``/``offsets`` synchronize on the end event. The runtime reads them
    after the run's end events, when it is long reached, but a read before that (a profile
    read early) then sleeps instead of spinning; the flag costs nothing when it is reached."""

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        self._start = torch.cuda.Event(enable_timing=True, blocking=True)
        self._end = torch.cuda.Event(enable_timing=True, blocking=True)
        with torch.cuda.device(device_index):  # this device's current stream
            self._start.record()

    def stop(self) -> None:
        with torch.cuda.device(self.device_index):
            self._end.record()

    def seconds(self) -> float:
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3

    def offsets(self, base: ComputeTimer) -> tuple[float, float]:
        assert isinstance(base, CUDATimer)
        self._end.synchronize()
        ms = base._start.elapsed_time
        return ms(self._start) / 1e3, ms(self._end) / 1e3


class CUDAStream(ThreadStream):
    """A ``torch.cuda.Stream`` plus the host thread that issues its work."""

    def __init__(self, device_index: int, role: StreamRole, *, priority: int) -> None:
        self.raw = torch.cuda.Stream(device=device_index, priority=priority)
        super().__init__(
            device_index,
            role,
            thread_name=f"rp-cuda{device_index}-{role.value}",
            on_start=lambda: torch.cuda.set_device(device_index),
        )

    def _run(self, fn: Callable[[], object]) -> None:
        with torch.cuda.device(self.device_index), torch.cuda.stream(self.raw):
            fn()

    def _new_event(self) -> CUDAEvent:
        return CUDAEvent(self.device_index)

    def _device_record(self, event: CPUEvent) -> None:
        if isinstance(event, CUDAEvent):
            with torch.cuda.device(self.device_index):
                event.cuda_event.record(self.raw)

    def _device_wait(self, event: CPUEvent) -> None:
        # Only reached once the event is recorded, so the GPU-side wait is never a no-op.
        if isinstance(event, CUDAEvent):
            with torch.cuda.device(self.device_index):
                self.raw.wait_event(event.cuda_event)


class CUDADevice(ThreadedDevice):
    """One GPU: four prioritised streams with host threads, budget accounting, its own RNG.

    ``capacity_bytes`` (None = unlimited) is a budget over tracked tensors, checked like the CPU
    emulation, and a hard cap on the process's caching allocator on this GPU (``cap_allocator``:
    every allocation counts, activations and temporaries included); ``close`` restores the
    fraction found before. The real allocator figures are in ``memory_stats`` as
    "cuda_allocated"/"cuda_peak"/"cuda_reserved_peak" and the cap as "cuda_cap".
    """

    def __init__(self, index: int, *, capacity_bytes: int | None = None) -> None:
        super().__init__(
            index, torch_device=torch.device("cuda", index), capacity_bytes=capacity_bytes
        )
        torch.cuda.init()  # fills torch.cuda.default_generators
        self._fraction_before: float | None = None
        self.cap_bytes = 0  # 0: the allocator is not capped by this device
        if capacity_bytes is not None:
            # torch < 2.9 cannot read the fraction back: 1.0 is the allocator's default
            read = getattr(torch.cuda, "get_per_process_memory_fraction", None)
            self._fraction_before = read(index) if read is not None else 1.0
            cap_allocator(index, capacity_bytes)
            self.cap_bytes = capacity_bytes
        priorities = stream_priorities(index)
        with torch.cuda.device(index):
            self._streams = {
                role: CUDAStream(index, role, priority=priorities[role]) for role in StreamRole
            }

    def raw_stream(self, role: StreamRole) -> torch.cuda.Stream:
        """The ``torch.cuda.Stream`` of a role (for ``record_stream`` and profiling)."""
        stream = self._streams[role]
        assert isinstance(stream, CUDAStream)
        return stream.raw

    def to_device(self, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Asynchronous upload on the current (H2D) stream; truly async from pinned memory.
        With ``out``: into that device tensor (already counted as device memory)."""
        if out is None:
            dev = host.detach().to(self.torch_device, non_blocking=True)
            self._ledger.track(dev)
        else:
            with torch.no_grad():
                dev = out.copy_(host.detach(), non_blocking=True)
        self._ledger.count_copy(dev.numel() * dev.element_size(), h2d=True)
        return dev

    def to_host(self, dev: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Asynchronous download into ``out`` (pinned; allocated pinned when None)."""
        if out is None:
            out = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
        with torch.no_grad():
            out.copy_(dev.detach(), non_blocking=True)
        self._ledger.count_copy(dev.numel() * dev.element_size(), h2d=False)
        return out

    def _host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked, exactly ``numel`` elements (``pinned_empty``), so ``to_host`` into it
        is asynchronous without torch's power-of-two caching host allocator."""
        return pinned_empty(numel, dtype)

    def free(self, dev: torch.Tensor, used_by: Collection[StreamRole] | None = None) -> None:
        """Stop counting ``dev``; first mark it used by the streams in ``used_by`` (every stream
        when None), so the caching allocator does not hand its memory out while a queued kernel
        or copy there may still read it (the runtime frees tensors right after queueing their
        use). Recording only the streams that used it keeps the others' queues from holding the
        memory back."""
        if dev.is_cuda:
            roles = self._streams.keys() if used_by is None else used_by
            for role in roles:
                stream = self._streams[role]
                assert isinstance(stream, CUDAStream)
                dev.record_stream(stream.raw)
        super().free(dev)

    def fence(self) -> CUDAEvent:
        """An event recorded now on the calling closure's stream: done when the GPU has run
        what the closure launched so far (the host flag is set at once: it is recorded)."""
        event = CUDAEvent(self.index)
        event.cuda_event.record(torch.cuda.current_stream(self.torch_device))
        event._set(None)
        return event

    def host_sync(self) -> None:
        """Block the calling stream thread until its stream's queued work is done: on a
        blocking event (``cudaStreamSynchronize`` would spin, as a default event's wait does)."""
        done = torch.cuda.Event(blocking=True)
        done.record(torch.cuda.current_stream(self.torch_device))
        done.synchronize()

    def memory_stats(self) -> dict[str, int]:
        stats = super().memory_stats()
        stats["cuda_allocated"] = torch.cuda.memory_allocated(self.index)
        stats["cuda_peak"] = torch.cuda.max_memory_allocated(self.index)
        # what the cap limits: the allocator's segments, not only the live tensors in them
        stats["cuda_reserved_peak"] = torch.cuda.max_memory_reserved(self.index)
        stats["cuda_cap"] = self.cap_bytes
        return stats

    def close(self) -> None:
        """Stop the worker threads (``ThreadedDevice.close``) and give the allocator back the
        memory fraction it had before this device capped it. Idempotent."""
        super().close()
        before, self._fraction_before = self._fraction_before, None
        if before is not None:
            try:
                torch.cuda.set_per_process_memory_fraction(before, self.index)
            except RuntimeError:  # CUDA torn down at exit: nothing left to cap
                pass

    def reset_peak(self) -> None:
        super().reset_peak()
        torch.cuda.reset_peak_memory_stats(self.index)

    def timer(self) -> ComputeTimer:
        """GPU execution time of the work the calling closure launches on its stream."""
        return CUDATimer(self.index)

    def _synchronize_device(self) -> None:
        try:
            torch.cuda.synchronize(self.index)
        except RuntimeError as exc:
            raise DeviceError(f"device {self.index}: CUDA error: {exc}", device=self.index) from exc

    @contextmanager
    def rng_scope(self, seed: int) -> Iterator[None]:
        """Seed this GPU's default generator for the enclosed work, then restore it.

        Per device, no lock: only this device's compute thread launches its random kernels.
        The CPU generator is left alone (ops on CUDA tensors do not draw from it).
        """
        gen = torch.cuda.default_generators[self.index]
        state = gen.get_state()
        gen.manual_seed(seed)
        try:
            yield
        finally:
            gen.set_state(state)
