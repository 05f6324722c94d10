"""CUDA devices: the protocol tests of test_device_cpu.py on real streams (skipped without CUDA).

GPU-side ordering is checked with data: a stream writes a buffer after a long device-side sleep,
another stream reads it after waiting on an event; a missed wait would read stale data.
"""

from __future__ import annotations

import functools
import mmap
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from rp_engine.device import (
    Device,
    DeviceError,
    DevicePool,
    Event,
    StreamRole,
    is_pinned,
    make_devices,
    pin,
)
from rp_engine.device.cuda import CUDADevice, CUDAEvent

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TIMEOUT = 30.0  # only a guard against a hung test
SLEEP_CYCLES = 50_000_000  # ~25 ms of GPU time: long enough that a missed wait reads stale data

COMPUTE, H2D_ACT, H2D_PARAM, D2H = (
    StreamRole.COMPUTE,
    StreamRole.H2D_ACT,
    StreamRole.H2D_PARAM,
    StreamRole.D2H,
)


@pytest.fixture
def pool() -> Iterator[DevicePool]:
    p = make_devices("cuda:0")
    yield p
    p.close()


def device(pool: DevicePool) -> CUDADevice:
    dev = pool[0]
    assert isinstance(dev, CUDADevice)
    return dev


def sync(event: Event) -> None:
    assert isinstance(event, CUDAEvent)
    event.synchronize(timeout=TIMEOUT)


def test_streams_and_priorities(pool: DevicePool) -> None:
    dev = device(pool)
    assert pool.kind == "cuda" and isinstance(dev, Device)
    assert dev.torch_device == torch.device("cuda", 0)
    prio = {role: dev.raw_stream(role).priority for role in StreamRole}
    assert len({dev.raw_stream(role) for role in StreamRole}) == len(StreamRole)  # one each
    assert prio[COMPUTE] == prio[H2D_ACT] <= prio[D2H] <= prio[H2D_PARAM]
    least, greatest = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
    if least != greatest:
        assert prio[COMPUTE] < prio[H2D_PARAM]


def test_a_host_wait_for_the_gpu_sleeps_instead_of_spinning(pool: DevicePool) -> None:
    """A thread synchronizing on an event the GPU has not passed yet sleeps (blocking events,
    device/cuda.py): its CPU time over the wait is a small part of the wait, where a default
    event's wait spins a core (CPU time about the wait's length). Two clocks of one wait are
    compared; no duration is asserted."""
    dev = device(pool)
    compute = dev.stream(COMPUTE)
    compute.submit(lambda: torch.cuda._sleep(8 * SLEEP_CYCLES))  # ~0.2 s of GPU time
    event = compute.record()
    assert isinstance(event, CUDAEvent)
    assert event._done.wait(TIMEOUT)  # recorded by the host thread: the GPU part is left
    assert not event.query(), "the GPU finished before the wait began: sleep longer"
    cpu, wall = time.thread_time(), time.perf_counter()
    sync(event)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    assert cpu < 0.25 * wall, f"the waiting thread used {cpu:.3f} s of CPU in {wall:.3f} s"


def test_fifo_and_closures_run_on_their_stream(pool: DevicePool) -> None:
    dev = device(pool)
    seen: list[int] = []
    current: list[torch.cuda.Stream] = []
    s = dev.stream(COMPUTE)
    s.submit(lambda: current.append(torch.cuda.current_stream()))
    for i in range(100):
        s.submit(functools.partial(seen.append, i))
    sync(s.record())
    assert seen == list(range(100))
    assert current == [dev.raw_stream(COMPUTE)]


def test_wait_issued_before_record_orders_gpu_work(pool: DevicePool) -> None:
    dev = device(pool)
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    gate = threading.Event()
    b_at_wait = threading.Event()
    out: dict[str, torch.Tensor] = {}
    a, b = dev.stream(H2D_ACT), dev.stream(COMPUTE)

    def write() -> None:
        gate.wait(TIMEOUT)  # the record below is issued only after B's host thread waits
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(1.0)

    a.submit(write)
    ev = a.record()
    b.submit(b_at_wait.set)
    b.wait(ev)
    b.submit(lambda: out.__setitem__("y", x.clone()))
    assert b_at_wait.wait(TIMEOUT)
    gate.set()
    sync(b.record())
    assert bool((out["y"] == 1.0).all())


def test_registered_memory_counts_as_pinned_and_pin_copies_it_no_more() -> None:
    """``is_pinned`` sees ``pinned_empty``'s registered range, its last byte too, and nothing
    outside it; ``pin`` hands already pinned memory back as it is (no second locked copy)."""
    from rp_engine.device.cuda import pinned_empty

    buf = pinned_empty(5000, torch.float32)
    assert is_pinned(buf) and is_pinned(buf[4999:])
    assert pin(buf) is buf and not is_pinned(torch.empty(5000))


def test_pinned_upload_compute_download_round_trip(pool: DevicePool) -> None:
    dev = device(pool)
    host = pin(torch.randn(1 << 20))
    assert is_pinned(host)
    out: dict[str, torch.Tensor] = {}
    up, compute, down = dev.stream(H2D_PARAM), dev.stream(COMPUTE), dev.stream(D2H)

    def upload() -> None:
        out["d"] = dev.to_device(host)

    def twice() -> None:
        out["d"].record_stream(dev.raw_stream(COMPUTE))
        out["y"] = out["d"] * 2

    up.submit(upload, label="U0.0")
    compute.wait(up.record())
    compute.submit(twice, label="F0.0")
    down.wait(compute.record())
    down.submit(lambda: out.__setitem__("h", dev.to_host(out["y"])), label="D0.0")
    sync(down.record())
    assert is_pinned(out["h"]) and out["h"].device.type == "cpu"
    torch.testing.assert_close(out["h"], host * 2)
    stats = dev.memory_stats()
    assert stats["allocated"] == host.numel() * 4 and stats["cuda_allocated"] > 0
    assert stats["h2d_bytes"] == host.numel() * 4 and stats["d2h_bytes"] == host.numel() * 4
    dev.free(out["d"])
    assert dev.memory_stats()["allocated"] == 0


def test_host_buffers_are_exact_size_pinned_and_counted(pool: DevicePool) -> None:
    """``host_buffer``: the staging memory of later gradient contributions, pinned (so the
    download into it is asynchronous) with exactly the bytes asked for, counted as host
    allocation and never as device memory."""
    dev = device(pool)
    buf = dev.host_buffer(1000, torch.bfloat16)
    assert is_pinned(buf) and buf.numel() == 1000 and buf.dtype == torch.bfloat16
    page = mmap.PAGESIZE  # whole pages plus one for the alignment, not a power of two
    assert buf.untyped_storage().nbytes() <= -(-2000 // page) * page + page
    stats = dev.memory_stats()
    assert stats["host_alloc_bytes"] == 2000 and stats["allocated"] == 0
    y = torch.ones(1000, device=dev.torch_device, dtype=torch.bfloat16)
    out: dict[str, torch.Tensor] = {}
    down = dev.stream(D2H)
    down.submit(lambda: out.__setitem__("h", dev.to_host(y, out=buf)), label="D0.0")
    sync(down.record())
    assert out["h"] is buf and bool((buf == 1).all())


def test_errors_surface_and_reset_recovers(pool: DevicePool) -> None:
    dev = device(pool)
    s, d2h = dev.stream(COMPUTE), dev.stream(D2H)
    ran: list[str] = []
    s.submit(lambda: torch.ones(3, device="cuda") @ torch.ones(4, device="cuda"), label="B2.1")
    s.submit(lambda: ran.append("skipped"))
    d2h.wait(s.record())
    d2h.submit(lambda: ran.append("skipped too"))
    with pytest.raises(DeviceError) as info:
        sync(d2h.record())
    assert info.value.device == 0 and info.value.where == "B2.1"
    assert "device 0 (B2.1)" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert ran == []
    dev.reset()
    s.submit(lambda: ran.append("fresh"))
    sync(s.record())
    dev.synchronize()
    assert ran == ["fresh"]


def test_capacity_budget() -> None:
    # the ledger's check or, first, the allocator's cap (a 4 KiB cap holds no 2 MiB segment)
    with make_devices("cuda:0", capacity_bytes=4096) as p:
        dev = p[0]
        s = dev.stream(H2D_PARAM)
        s.submit(lambda: dev.to_device(pin(torch.zeros(2048))), label="U3.0")
        with pytest.raises(DeviceError, match="U3.0.*out of memory"):
            sync(s.record())


def test_the_budget_caps_the_caching_allocator() -> None:
    """``capacity_bytes`` (``roundpipe.device_memory_gb``) is a limit on every allocation, not
    only on the tensors the ledger tracks: the process's allocator fraction is the budget over
    the GPU's memory, an untracked allocation past it raises out of memory (as a GPU of that
    size would), one under it succeeds, and closing the pool restores the fraction."""
    total = torch.cuda.get_device_properties(0).total_memory
    # torch < 2.9 cannot read the fraction back (1.0 is the default): the behaviour is checked
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _i: 1.0)
    before = fraction(0)
    mib = 2**20
    torch.cuda.empty_cache()  # the cap counts reserved segments: none cached, only live ones
    held = torch.cuda.memory_reserved(0)  # earlier tests' live blocks (cuBLAS workspaces)
    budget = held + 256 * mib
    with make_devices("cuda:0", capacity_bytes=budget) as p:
        dev = p[0]
        assert isinstance(dev, CUDADevice)
        if hasattr(torch.cuda, "get_per_process_memory_fraction"):
            assert fraction(0) == pytest.approx(budget / total)
        stats = dev.memory_stats()
        assert stats["cuda_cap"] == budget and stats["cuda_reserved_peak"] >= 0
        fits = torch.empty(64 * mib, dtype=torch.uint8, device="cuda")  # untracked
        with pytest.raises(torch.OutOfMemoryError):  # held + 64 + 256 MiB > held + 256 MiB
            torch.empty(256 * mib, dtype=torch.uint8, device="cuda")
        del fits
        assert dev.memory_stats()["allocated"] == 0  # the ledger never saw either
    assert fraction(0) == pytest.approx(before)
    # restored: what the cap refused now fits
    torch.cuda.empty_cache()
    assert torch.empty(budget, dtype=torch.uint8, device="cuda").numel() == budget
    torch.cuda.empty_cache()


def test_rng_scope_depends_only_on_the_seed(pool: DevicePool) -> None:
    dev = device(pool)
    x = torch.ones(256, 256, device="cuda")
    before = torch.cuda.get_rng_state(0)
    masks: dict[str, torch.Tensor] = {}

    def run(name: str, seed: int) -> None:
        with dev.rng_scope(seed):
            masks[name] = F.dropout(x, 0.5)

    s = dev.stream(COMPUTE)
    s.submit(lambda: run("a", 7))
    sync(s.record())
    assert torch.equal(torch.cuda.get_rng_state(0), before)  # restored after the scope
    s.submit(lambda: F.dropout(x, 0.5))  # unscoped draws in between change nothing
    s.submit(lambda: run("b", 7))
    s.submit(lambda: run("c", 8))
    sync(s.record())
    assert torch.equal(masks["a"], masks["b"])
    assert not torch.equal(masks["a"], masks["c"])


def test_close_is_idempotent_and_threads_exit() -> None:
    p = make_devices("cuda:0")
    dev = p[0]
    assert isinstance(dev, CUDADevice)
    threads = dev.threads
    assert all(t.is_alive() for t in threads)
    p.close()
    p.close()
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(DeviceError, match="closed"):
        dev.stream(COMPUTE).submit(lambda: None)


def test_free_records_only_the_streams_that_used_the_tensor(
    pool: DevicePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = pool.devices[0]
    assert isinstance(dev, CUDADevice)
    recorded: list[torch.cuda.Stream] = []
    original = torch.Tensor.record_stream

    def spy(self: torch.Tensor, stream: torch.cuda.Stream) -> None:
        recorded.append(stream)
        original(self, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", spy)
    t = dev.to_device(torch.ones(16))
    dev.free(t, used_by=(COMPUTE,))
    assert [s.stream_id for s in recorded] == [dev.raw_stream(COMPUTE).stream_id]
    recorded.clear()
    u = dev.to_device(torch.ones(16))
    dev.free(u)  # None: every stream, the conservative default
    assert len(recorded) == len(StreamRole)
