"""CPU virtual devices: every stream is a host worker thread running closures from a FIFO.

This module owns the thread machinery shared by both backends (``ThreadStream``, ``CPUEvent``,
``ThreadedDevice``: the CUDA backend's host side is exactly a CPU stream; their memory ledger,
``MemoryLedger``, is in memory.py) and the CPU backend proper (``CPUDevice``, ``CPUPool``). Virtual devices behave like GPUs where the
runtime can tell: work is ordered FIFO per stream and only events order streams, copies can be
slowed to an emulated PCIe bandwidth (``time.sleep`` drops the GIL, so a copy overlaps compute
as on a GPU copy engine), and an emulated memory capacity turns overuse into ``DeviceError``.
The capacity counts the tensors the runtime tracks (weights, gradients, boundary states) and,
metered (``CPUDevice.meter_compute``: on by default on a device with a capacity), every storage
the compute stream's closures create (activations autograd keeps, temporaries, the LM head's
logits), as a GPU's allocator would: a device with a capacity then holds no more host RAM than
it, which is what the planner and the host-RAM model (plan/host_ram.py) count on.

Two streams and an event: the D2H worker blocks in its wait task until compute reaches e::

    compute  |--F0.0--|--F1.0--|rec(e)
    d2h      |wait(e).................|--D0.0--|
"""

from __future__ import annotations

import functools
import queue
import signal
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import NoReturn

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .base import ComputeTimer, DeviceError, Event, StreamRole
from .memory import MemoryLedger, _AllocationMeter

__all__ = [
    "CPUDevice",
    "CPUEvent",
    "CPUPool",
    "MemoryLedger",
    "ThreadStream",
    "ThreadedDevice",
    "sigint_deferred",
]

# How often a worker blocked in a wait task checks whether reset()/close() abandoned it. A set
# event wakes the worker at once; this only bounds how long reset() takes to cancel a wait.
_CANCEL_POLL_S = 0.02
# close() gives a closure that is still running this long before leaving its (daemon) thread.
_JOIN_TIMEOUT_S = 10.0


def _raise_device_error(err: DeviceError) -> NoReturn:
    """Raise a fresh copy of ``err`` (same message, device, where and cause).

    One stored error may be raised in many threads (every event recorded after a failure holds
    it); raising the stored instance itself would keep growing its shared traceback.
    """
    fresh = DeviceError(str(err), device=err.device, where=err.where)
    raise fresh from (err.__cause__ or err)


def _link_sleep(seconds: float) -> None:
    """The emulated PCIe transfer time. A function of its own so tests can replace it."""
    time.sleep(seconds)


@contextmanager
def sigint_deferred() -> Iterator[list[FrameType | None] | None]:
    """Hold a Ctrl-C (SIGINT) back while the block runs; deliver it when the block ends.

    For main-thread code that queues work for the worker threads (``Executor.start``) or
    waits for them (``CPUEvent.synchronize``). Yields the list of the signals caught so far
    (a wait polls it and ends early), or None when nothing is deferred.

    Why: Python raises ``KeyboardInterrupt`` at any bytecode boundary, and one of them lies
    inside ``threading.Condition.__enter__``, after its lock is taken and before the ``with``
    that took it can release it (CPython bpo-29988). A stream's
    ``queue.Queue.put`` takes its queue's mutex that way: an interrupt there left the mutex
    held forever, the worker blocked in ``task_done`` and the reset after the interrupt in
    ``queue.join``, so Ctrl-C hung the process instead of ending it::

        main     put: mutex taken | KeyboardInterrupt | abort: reset -> join: mutex ... forever
        worker   task done -> task_done: mutex ........................................ forever

    ``threading.Event.wait`` has such a point too, after its condition's lock is released and
    before the ``try`` that owns it: the ``with`` then released the lock a second time, while
    a worker setting the event held it, and that worker died of "release unlocked lock" (its
    stream's later events were never set: the wait after the interrupt hung).

    The signal caught meanwhile goes to the handler that was installed before, once the block
    is over (``KeyboardInterrupt`` from Python's default handler). Nothing is deferred outside
    the main thread (signals are handled there only) or when SIGINT has no Python handler.
    """
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # ignored, the OS default, or a handler installed outside Python
        yield None
        return
    caught: list[FrameType | None] = []
    signal.signal(signal.SIGINT, lambda _signum, frame: caught.append(frame))
    try:
        yield caught
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            previous(signal.SIGINT, caught[0])


class CPUEvent:
    """An event set by a stream's worker when it reaches it; carries the stream's error."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: DeviceError | None = None

    @property
    def error(self) -> DeviceError | None:
        """The error of the stream at the point the event was reached (None when healthy)."""
        return self._error

    def _set(self, error: DeviceError | None) -> None:
        self._error = error  # written before the flag, read only after it
        self._done.set()

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until the event is reached; re-raise its error as ``DeviceError``.

        ``timeout`` (seconds) raises ``TimeoutError`` instead of blocking forever (tests).
        On the main thread a Ctrl-C ends the wait with ``KeyboardInterrupt`` raised outside
        ``threading.Event.wait`` (``sigint_deferred``), within one poll of ``_CANCEL_POLL_S``;
        a SIGINT handler that returns (rp-train's: it asks the loop to stop) lets it go on.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with sigint_deferred() as interrupted:
                if interrupted is None:
                    reached = self._done.wait(timeout)
                else:
                    while not (reached := self._done.wait(_CANCEL_POLL_S)) and not interrupted:
                        if deadline is not None and time.monotonic() >= deadline:
                            break
            # the block's end ran the handler: a KeyboardInterrupt has left already
            expired = deadline is not None and time.monotonic() >= deadline
            if reached or interrupted is None or expired:
                break
        if not reached:
            raise TimeoutError(f"event not reached within {timeout} s")
        if self._error is not None:
            _raise_device_error(self._error)

    def query(self) -> bool:
        return self._done.is_set()


@dataclass(frozen=True)
class _Task:
    kind: str  # "run" | "record" | "wait"
    fn: Callable[[], object] | None = None
    label: str = ""
    event: CPUEvent | None = None


class ThreadStream:
    """A stream run by one daemon host thread: closures, records and waits in FIFO order.

    Failure: a closure that raises stores a ``DeviceError`` (the original as ``__cause__``) and
    the stream is failed: later closures are skipped, later waits do not block, later events are
    still set and carry the error, so no waiter ever hangs. A wait on an event that carries an
    error fails this stream with that error. ``_abandon`` (reset/close) makes the worker skip
    everything still queued and cancels a wait it is blocked in.

    Subclasses (CUDA) override ``_run``, ``_new_event``, ``_device_record``, ``_device_wait``.
    """

    role: StreamRole

    def __init__(
        self,
        device_index: int,
        role: StreamRole,
        *,
        thread_name: str,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        self.role = role
        self.device_index = device_index
        self._queue: queue.Queue[_Task | None] = queue.Queue()
        self._error: DeviceError | None = None  # written only by the worker thread
        self._abandoned: DeviceError | None = None  # written by reset()/close()
        self._closed = False
        self._on_start = on_start
        # entered around each closure when set (CPUDevice.meter_compute); read by the worker
        self.meter: Callable[[], TorchDispatchMode] | None = None
        self.thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)
        self.thread.start()

    # -- the Stream protocol ----------------------------------------------------------------

    def submit(self, fn: Callable[[], object], *, label: str = "") -> None:
        self._put(_Task("run", fn=fn, label=label))

    def record(self) -> CPUEvent:
        event = self._new_event()
        self._put(_Task("record", event=event))
        return event

    def wait(self, event: Event) -> None:
        if not isinstance(event, CPUEvent):
            raise TypeError(f"cannot wait on {type(event).__name__}: not an event of this backend")
        self._put(_Task("wait", event=event))

    # -- hooks for the CUDA backend ---------------------------------------------------------

    def _run(self, fn: Callable[[], object]) -> None:
        meter = self.meter
        if meter is None:
            fn()
            return
        with meter():
            fn()

    def _new_event(self) -> CPUEvent:
        return CPUEvent()

    def _device_record(self, event: CPUEvent) -> None:
        """Device-side part of a record (nothing on CPU: reaching it is the completion)."""

    def _device_wait(self, event: CPUEvent) -> None:
        """Device-side part of a wait, after the event is set without error (nothing on CPU)."""

    # -- machinery --------------------------------------------------------------------------

    @property
    def failed(self) -> DeviceError | None:
        return self._error

    def _put(self, task: _Task | None) -> None:
        if self._closed:
            raise DeviceError(
                f"device {self.device_index} is closed: cannot queue work on its "
                f"{self.role.value} stream",
                device=self.device_index,
            )
        self._queue.put(task)

    def _wrap(self, exc: BaseException, label: str) -> DeviceError:
        where = label or f"{self.role.value} stream"
        err = DeviceError(
            f"device {self.device_index} ({where}): {type(exc).__name__}: {exc}",
            device=self.device_index,
            where=label,
        )
        err.__cause__ = exc
        return err

    def _loop(self) -> None:
        if self._on_start is not None:
            try:
                self._on_start()
            except BaseException as exc:  # a stream that cannot start is failed, not dead
                self._error = self._wrap(exc, "stream start")
        while True:
            task = self._queue.get()
            try:
                if task is None:
                    return
                self._handle(task)
            finally:
                self._queue.task_done()

    def _handle(self, task: _Task) -> None:
        # Never let an exception escape: a dead worker would hang every later waiter.
        error = self._error or self._abandoned
        if task.kind == "run":
            if error is None and task.fn is not None:
                try:
                    self._run(task.fn)
                except BaseException as exc:
                    self._error = self._wrap(exc, task.label)
        elif task.kind == "record":
            assert task.event is not None
            if error is None:
                try:
                    self._device_record(task.event)
                except BaseException as exc:
                    error = self._error = self._wrap(exc, "record event")
            task.event._set(error)
        elif task.kind == "wait":
            assert task.event is not None
            if error is None and self._block_until_set(task.event):
                if task.event.error is not None:
                    self._error = task.event.error
                else:
                    try:
                        self._device_wait(task.event)
                    except BaseException as exc:
                        self._error = self._wrap(exc, "wait event")

    def _block_until_set(self, event: CPUEvent) -> bool:
        """Block until ``event`` is set; False when reset()/close() abandoned the stream."""
        while not event._done.wait(_CANCEL_POLL_S):
            if self._abandoned is not None:
                return False
        return True

    def _abandon(self, reason: DeviceError) -> None:
        self._abandoned = reason

    def _drain(self) -> None:
        self._queue.join()

    def _clear(self) -> None:
        """After a drain: healthy again. Only called while the worker is idle."""
        self._error = None
        self._abandoned = None

    def _close(self) -> None:
        if self._closed:
            return
        self._queue.put(None)
        self._closed = True


class HostTimer:
    """A ``ComputeTimer`` on the host clock (virtual devices compute synchronously)."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._end = self._start

    def stop(self) -> None:
        self._end = time.perf_counter()

    def seconds(self) -> float:
        return self._end - self._start

    def offsets(self, base: ComputeTimer) -> tuple[float, float]:
        assert isinstance(base, HostTimer)
        return self._start - base._start, self._end - base._start


class ThreadedDevice:
    """Streams (one ``ThreadStream`` per role), memory ledger, synchronize/reset/close.

    Shared by ``CPUDevice`` and ``CUDADevice``; subclasses build ``self._streams``.
    ``torch_device``: where ``empty`` allocates (``cpu``, or ``cuda:<index>``).
    """

    def __init__(
        self, index: int, *, torch_device: torch.device, capacity_bytes: int | None
    ) -> None:
        self.index = index
        self.torch_device = torch_device
        self._ledger = MemoryLedger(index, capacity_bytes)
        self._streams: dict[StreamRole, ThreadStream] = {}
        self._closed = False

    def stream(self, role: StreamRole) -> ThreadStream:
        return self._streams[role]

    def track(self, dev: torch.Tensor) -> None:
        self._ledger.track(dev)

    def free(self, dev: torch.Tensor, used_by: Collection[StreamRole] | None = None) -> None:
        """Stop counting ``dev``; ``used_by`` matters only to backends with real streams."""
        self._ledger.free(dev)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor on this device, counted until ``free``."""
        t = torch.empty(tuple(shape), dtype=dtype, device=self.torch_device)
        self._ledger.track(t)
        return t

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat, uninitialised host tensor of exactly ``numel`` elements (counted in
        "host_alloc_bytes"); ``_host_empty`` says what memory (plain here, pinned on CUDA)."""
        t = self._host_empty(numel, dtype)
        self._ledger.count_host_alloc(t.numel() * t.element_size())
        return t

    def _host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def fence(self) -> CPUEvent:
        """Copies and compute on virtual devices are synchronous: an event already complete."""
        event = CPUEvent()
        event._set(None)
        return event

    def host_sync(self) -> None:
        """Copies and compute on virtual devices are synchronous: nothing to wait for."""

    def memory_stats(self) -> dict[str, int]:
        """{"allocated", "peak", "capacity" (0 = unlimited), "h2d_bytes", "d2h_bytes",
        "host_alloc_bytes"}."""
        return self._ledger.stats()

    def reset_peak(self) -> None:
        self._ledger.reset_peak()

    def timer(self) -> ComputeTimer:
        """Host time of the calling closure: on virtual devices that is the compute itself."""
        return HostTimer()

    def synchronize(self) -> None:
        """Wait until every stream has run what was queued so far; raise the first error."""
        events = [s.record() for s in self._streams.values()]
        errors = []
        for event in events:
            event._done.wait()
            if event.error is not None:
                errors.append(event.error)
        self._synchronize_device()
        if errors:
            _raise_device_error(errors[0])

    def _synchronize_device(self) -> None:
        """Device-side drain after the host workers drained (nothing on CPU)."""

    def reset(self) -> None:
        """Discard queued work and clear the failed state (call it when no thread submits).

        Closures not yet started are skipped, a wait a worker is blocked in is cancelled, and
        events not yet reached complete with a ``DeviceError`` saying the work was discarded
        (a closure already running finishes first). Tracked memory is forgotten. A stream on
        another device that adopted this device's error through a wait needs that device's
        ``reset`` too.
        """
        reason = DeviceError(f"device {self.index}: work discarded by reset()", device=self.index)
        for s in self._streams.values():
            s._abandon(reason)
        for s in self._streams.values():
            s._drain()
        try:
            self._synchronize_device()
        except Exception:  # a broken device stays broken; the streams are clear regardless
            pass
        for s in self._streams.values():
            s._clear()
        self._ledger.clear()

    def close(self) -> None:
        """Discard queued work and stop the worker threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        reason = DeviceError(f"device {self.index} closed", device=self.index)
        for s in self._streams.values():
            s._abandon(reason)
            s._close()
        for s in self._streams.values():
            if s.thread is not threading.current_thread():  # a worker cannot join itself
                s.thread.join(_JOIN_TIMEOUT_S)

    @property
    def threads(self) -> list[threading.Thread]:
        return [s.thread for s in self._streams.values()]


class CPUDevice(ThreadedDevice):
    """A virtual device: four worker threads (one per role) over host memory.

    ``pcie_gbps`` (GB/s, None = instant) slows ``to_device``/``to_host`` to that bandwidth; each
    direction is one emulated link, so the two upload streams share it as on a real bus.
    ``capacity_bytes`` (None = unlimited) caps what the device holds; ``meter`` (None: on
    exactly when there is a capacity) counts its compute's storages too (``meter_compute``).
    """

    def __init__(
        self,
        index: int,
        *,
        pool: CPUPool,
        pcie_gbps: float | None = None,
        capacity_bytes: int | None = None,
        meter: bool | None = None,
    ) -> None:
        if pcie_gbps is not None and pcie_gbps <= 0:
            raise ValueError(f"pcie_gbps must be positive or None, got {pcie_gbps}")
        super().__init__(index, torch_device=torch.device("cpu"), capacity_bytes=capacity_bytes)
        self.pcie_gbps = pcie_gbps
        self._pool = pool
        self._h2d_link = threading.Lock()
        self._d2h_link = threading.Lock()
        threads = pool.threads_per_device

        def on_start() -> None:
            # Per thread: with the OpenMP backend torch's intra-op thread count is a per-thread
            # setting taken when a thread first runs a parallel op, so each worker sets its own.
            torch.set_num_threads(threads)

        self._streams = {
            role: ThreadStream(
                index, role, thread_name=f"rp-cpu{index}-{role.value}", on_start=on_start
            )
            for role in StreamRole
        }
        # A capacity is a limit on what the device holds, activations included (the planner
        # fits its stages to it and the host-RAM model counts it as the device's host memory);
        # without one there is nothing to bound, and metering would only cost time.
        self.meter_compute(capacity_bytes is not None if meter is None else meter)

    def meter_compute(self, on: bool = True) -> None:
        """Count every storage the compute stream's closures create (``on``) or only the
        tensors the runtime tracks (off) against this device's capacity and peak: with it,
        the peak is what a GPU's allocator would have held (activations kept for the
        backward, temporaries, the LM head's logits), and a capacity overrun by any of them
        is an out-of-memory ``DeviceError``. On by default on a device with a capacity.
        Costs a Python call per op (benchmarks/RESULTS.md, "CPU virtual devices bounded").
        Set it while the device is idle."""
        ledger = self._ledger
        self._streams[StreamRole.COMPUTE].meter = (
            functools.partial(_AllocationMeter, ledger) if on else None
        )

    @property
    def compute_metered(self) -> bool:
        """Whether the compute stream's storages count against the capacity (``meter_compute``)."""
        return self._streams[StreamRole.COMPUTE].meter is not None

    def _emulate_link(self, nbytes: int, link: threading.Lock) -> None:
        if self.pcie_gbps is None or nbytes == 0:
            return
        with link:
            _link_sleep(nbytes / (self.pcie_gbps * 1e9))

    def to_device(self, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A detached clone (its own storage: the optimizer may rewrite the host copy later),
        or a copy into ``out`` (already counted as device memory)."""
        with torch.no_grad():
            if out is None:
                dev = host.detach().clone()
                self._ledger.track(dev)
                nbytes = dev.untyped_storage().nbytes()
            else:
                dev = out.copy_(host.detach())
                nbytes = dev.numel() * dev.element_size()
        self._emulate_link(nbytes, self._h2d_link)
        self._ledger.count_copy(nbytes, h2d=True)
        return dev

    def to_host(self, dev: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A detached copy in host memory (into ``out`` when given). Not counted as device
        memory; ``free`` the device tensor separately."""
        with torch.no_grad():
            if out is None:
                out = dev.detach().clone()
            else:
                out.copy_(dev.detach())
        nbytes = dev.numel() * dev.element_size()
        self._emulate_link(nbytes, self._d2h_link)
        self._ledger.count_copy(nbytes, h2d=False)
        return out

    @contextmanager
    def rng_scope(self, seed: int) -> Iterator[None]:
        """Seed the CPU default generator for the enclosed work, then restore it.

        All CPU devices share that one generator, so the pool-wide lock is held for the whole
        scope: scoped compute on different virtual devices runs one at a time. Enter the scope
        only around work that draws random numbers (dropout in training mode).
        """
        with self._pool.rng_lock:
            gen = torch.default_generator
            state = gen.get_state()
            gen.manual_seed(seed)
            try:
                yield
            finally:
                gen.set_state(state)


class CPUPool:
    """``n`` virtual devices, the lock over the CPU's single RNG, and the intra-op split.

    Each worker thread runs torch with ``max(1, T // n)`` intra-op threads, T being
    ``torch.get_num_threads()`` of the thread that builds the pool, so n devices computing at
    once do not oversubscribe the cores (and the count, hence reduction order, depends only on
    T and n). ``close`` restores the process default that the workers changed. ``meter``:
    ``CPUDevice``'s (None: the devices' compute is metered when they have a capacity).
    """

    def __init__(
        self,
        n: int,
        *,
        pcie_gbps: float | None = None,
        capacity_bytes: int | None = None,
        meter: bool | None = None,
    ) -> None:
        if n < 1:
            raise ValueError(f"a CPU pool needs at least one device, got {n}")
        self.rng_lock = threading.RLock()
        # Reading it also pins the calling thread's own setting, which the workers leave alone.
        self._saved_threads = torch.get_num_threads()
        self.threads_per_device = max(1, self._saved_threads // n)
        self._closed = False
        self.devices = [
            CPUDevice(i, pool=self, pcie_gbps=pcie_gbps, capacity_bytes=capacity_bytes, meter=meter)
            for i in range(n)
        ]

    def __len__(self) -> int:
        return len(self.devices)

    def __getitem__(self, i: int) -> CPUDevice:
        return self.devices[i]

    def close(self) -> None:
        """Stop every worker thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for d in self.devices:
            d.close()
        # Workers set the process default for threads started later; put it back.
        torch.set_num_threads(self._saved_threads)

    def __enter__(self) -> CPUPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
