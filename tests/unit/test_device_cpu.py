"""CPU virtual devices: ordering, events, errors, reset, memory, emulated PCIe, RNG, shutdown.

Ordering is checked through side effects and gates the test controls, never through timings.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from rp_engine.device import (
    Device,
    DeviceError,
    DevicePool,
    Event,
    Stream,
    StreamRole,
    make_devices,
    parse_device_spec,
)
from rp_engine.device import cpu as cpu_mod
from rp_engine.device.cpu import CPUDevice, CPUEvent, CPUPool

TIMEOUT = 10.0  # only a guard against a hung test; never reached when the code is right

COMPUTE, H2D_ACT, H2D_PARAM, D2H = (
    StreamRole.COMPUTE,
    StreamRole.H2D_ACT,
    StreamRole.H2D_PARAM,
    StreamRole.D2H,
)


@pytest.fixture
def pool() -> Iterator[CPUPool]:
    p = CPUPool(2)
    yield p
    p.close()


def sync(event: Event) -> None:
    assert isinstance(event, CPUEvent)
    event.synchronize(timeout=TIMEOUT)


def test_protocol_conformance(pool: CPUPool) -> None:
    dev = pool[0]
    assert isinstance(dev, Device)
    assert isinstance(dev.stream(COMPUTE), Stream)
    ev = dev.stream(COMPUTE).record()
    assert isinstance(ev, Event)
    sync(ev)
    assert ev.query()
    assert dev.torch_device == torch.device("cpu")
    assert [s.role for s in map(dev.stream, StreamRole)] == list(StreamRole)


def test_fifo_order_within_a_stream(pool: CPUPool) -> None:
    seen: list[int] = []
    s = pool[0].stream(COMPUTE)
    for i in range(200):
        s.submit(functools.partial(seen.append, i))
    sync(s.record())
    assert seen == list(range(200))


def test_cross_stream_event_orders_work(pool: CPUPool) -> None:
    gate = threading.Event()
    order: list[str] = []
    a, b = pool[0].stream(COMPUTE), pool[1].stream(H2D_ACT)

    def slow_a() -> None:
        gate.wait(TIMEOUT)
        order.append("A")

    a.submit(slow_a)
    ev_a = a.record()
    b.wait(ev_a)
    b.submit(lambda: order.append("B"))
    ev_b = b.record()
    # A is held by the gate, so B cannot have run; both are merely queued.
    b_other = pool[1].stream(D2H)
    b_other.submit(lambda: order.append("independent"))
    sync(b_other.record())
    assert order == ["independent"]
    assert not ev_a.query() and not ev_b.query()
    gate.set()
    sync(ev_b)
    assert order == ["independent", "A", "B"]
    assert ev_a.query()


def test_wait_reached_before_the_record_is_reached(pool: CPUPool) -> None:
    # B's worker reaches its wait while A's record is still queued behind a blocked closure.
    gate = threading.Event()
    b_at_wait = threading.Event()
    order: list[str] = []
    a, b = pool[0].stream(H2D_PARAM), pool[0].stream(COMPUTE)

    def slow_a() -> None:
        gate.wait(TIMEOUT)
        order.append("A")

    a.submit(slow_a)
    ev = a.record()
    b.submit(b_at_wait.set)
    b.wait(ev)
    b.submit(lambda: order.append("B"))
    assert b_at_wait.wait(TIMEOUT)
    assert order == [] and not ev.query()
    gate.set()
    sync(b.record())
    assert order == ["A", "B"]


def test_error_surfaces_in_caller_and_skips_later_work(pool: CPUPool) -> None:
    dev = pool[1]
    s = dev.stream(COMPUTE)
    ran: list[str] = []

    def boom() -> None:
        raise ValueError("boom")

    s.submit(lambda: ran.append("before"))
    s.submit(boom, label="F2.3")
    s.submit(lambda: ran.append("after"), label="F3.3")
    ev = s.record()
    with pytest.raises(DeviceError) as info:
        sync(ev)
    err = info.value
    assert err.device == 1 and err.where == "F2.3"
    assert "device 1" in str(err) and "F2.3" in str(err) and "boom" in str(err)
    assert isinstance(err.__cause__, ValueError)
    assert ran == ["before"]
    # Every later event carries the error too; nobody hangs.
    with pytest.raises(DeviceError, match="F2.3"):
        sync(s.record())
    with pytest.raises(DeviceError, match="F2.3"):
        dev.synchronize()


def test_error_propagates_through_a_wait(pool: CPUPool) -> None:
    a, b = pool[0].stream(COMPUTE), pool[1].stream(D2H)
    ran: list[str] = []
    a.submit(lambda: 1 / 0, label="B1.0")
    b.wait(a.record())
    b.submit(lambda: ran.append("download"))
    with pytest.raises(DeviceError) as info:
        sync(b.record())
    assert info.value.device == 0 and info.value.where == "B1.0"
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert ran == []


def test_reset_clears_the_failure(pool: CPUPool) -> None:
    dev = pool[0]
    s = dev.stream(COMPUTE)
    s.submit(lambda: 1 / 0, label="F0.0")
    with pytest.raises(DeviceError):
        sync(s.record())
    dev.reset()
    ran: list[int] = []
    s.submit(lambda: ran.append(1))
    sync(s.record())
    dev.synchronize()
    assert ran == [1]


def test_reset_cancels_a_wait_that_would_never_end(pool: CPUPool) -> None:
    gate = threading.Event()
    a = pool[0].stream(COMPUTE)
    b = pool[1].stream(COMPUTE)
    ran: list[str] = []
    a.submit(lambda: gate.wait(TIMEOUT))
    b.wait(a.record())
    b.submit(lambda: ran.append("skipped"))
    pending = b.record()
    pool[1].reset()  # returns although device 0 is still blocked
    with pytest.raises(DeviceError, match="discarded by reset"):
        sync(pending)
    b.submit(lambda: ran.append("fresh"))
    sync(b.record())
    assert ran == ["fresh"]
    gate.set()
    pool[0].synchronize()


def test_host_buffers_are_exact_size_and_counted_as_host_allocation(pool: CPUPool) -> None:
    dev = pool[0]
    buf = dev.host_buffer(1000, torch.bfloat16)
    assert buf.numel() == 1000 and buf.dtype == torch.bfloat16 and buf.device.type == "cpu"
    stats = dev.memory_stats()
    assert stats["host_alloc_bytes"] == 2000 and stats["allocated"] == 0
    dev.host_buffer(3, torch.float32)
    assert dev.memory_stats()["host_alloc_bytes"] == 2012


def test_memory_accounting(pool: CPUPool) -> None:
    dev = pool[0]
    a = torch.zeros(256)  # 1 KiB
    b = torch.zeros(512)  # 2 KiB
    dev.track(a)
    dev.track(a[10:20])  # a view: same storage, counted once
    dev.track(b)
    assert dev.memory_stats()["allocated"] == 3072
    dev.free(b)
    dev.free(a)
    assert dev.memory_stats()["allocated"] == 1024  # the view still holds it
    dev.free(a[10:20])
    dev.free(torch.zeros(4))  # untracked: no-op
    stats = dev.memory_stats()
    assert stats["allocated"] == 0 and stats["peak"] == 3072 and stats["capacity"] == 0
    dev.reset_peak()
    assert dev.memory_stats()["peak"] == 0


def test_a_dead_tensor_stops_counting(pool: CPUPool) -> None:
    # Dropped without free: its memory is gone, and a new tensor at the same address is new.
    dev = pool[0]
    dev.track(torch.zeros(256))
    assert dev.memory_stats()["allocated"] == 0
    a = torch.zeros(256)
    dev.track(a)
    dev.free(torch.zeros(256))  # another storage of the same size: not `a`
    assert dev.memory_stats()["allocated"] == 1024
    dev.free(a)
    assert dev.memory_stats()["allocated"] == 0


def test_capacity_exceeded_raises() -> None:
    with CPUPool(1, capacity_bytes=4096) as p:
        dev = p[0]
        held = torch.zeros(512)  # 2 KiB
        dev.track(held)
        with pytest.raises(DeviceError) as info:
            dev.track(torch.zeros(1024))  # 4 KiB more
        assert info.value.device == 0
        assert "device 0 out of memory" in str(info.value) and "capacity 0.0 MiB" in str(info.value)
        # Inside a closure it surfaces at the event, naming the action.
        s = dev.stream(H2D_PARAM)
        s.submit(lambda: dev.to_device(torch.zeros(1024)), label="U1.0")
        with pytest.raises(DeviceError, match="U1.0.*out of memory"):
            sync(s.record())
        assert dev.memory_stats()["allocated"] == 2048
        dev.free(held)


def test_to_device_and_to_host_copy(pool: CPUPool) -> None:
    dev = pool[0]
    host = torch.arange(8.0, requires_grad=True)
    out: dict[str, torch.Tensor] = {}
    s = dev.stream(H2D_PARAM)
    s.submit(lambda: out.__setitem__("d", dev.to_device(host)))
    sync(s.record())
    d = out["d"]
    assert d.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()
    assert not d.requires_grad
    with torch.no_grad():
        host.add_(100.0)  # the optimizer rewrites the host copy; the device copy keeps its data
    torch.testing.assert_close(d, torch.arange(8.0))
    stats = dev.memory_stats()
    assert stats["allocated"] == 32 and stats["h2d_bytes"] == 32
    back = torch.empty(8)
    assert dev.to_host(d * 2, back) is back
    torch.testing.assert_close(back, torch.arange(8.0) * 2)
    fresh = dev.to_host(d)
    assert fresh.untyped_storage().data_ptr() != d.untyped_storage().data_ptr()
    dev.free(d)
    assert dev.memory_stats()["allocated"] == 0 and dev.memory_stats()["d2h_bytes"] == 64


def test_upload_into_an_empty_device_tensor_and_a_fence(pool: CPUPool) -> None:
    """``empty`` counts a tensor once; ``to_device(..., out=)`` fills views of it and counts
    only the bytes copied; ``fence`` inside a closure is already complete on CPU."""
    dev = pool[0]
    host = torch.arange(10.0)
    out: dict[str, object] = {}

    def upload() -> None:
        d = out["d"] = dev.empty((10,), torch.float32)
        assert dev.to_device(host[:6], out=d[:6]) is not None
        dev.to_device(host[6:], out=d[6:])
        out["fence"] = dev.fence()

    s = dev.stream(H2D_PARAM)
    s.submit(upload)
    sync(s.record())
    fence = out["fence"]
    assert isinstance(fence, Event) and fence.query()
    fence.synchronize()
    torch.testing.assert_close(out["d"], host)
    stats = dev.memory_stats()
    assert stats["allocated"] == 40 and stats["h2d_bytes"] == 40
    dev.free(out["d"])  # type: ignore[arg-type]
    assert dev.memory_stats()["allocated"] == 0


def test_emulated_pcie_copy_overlaps_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    # The emulated link and a compute closure must be in flight together: both meet at a
    # barrier, which only happens if neither waits for the other to finish.
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    slept: list[float] = []

    def link_sleep(seconds: float) -> None:
        slept.append(seconds)
        barrier.wait()

    monkeypatch.setattr(cpu_mod, "_link_sleep", link_sleep)
    with CPUPool(1, pcie_gbps=2.0) as p:
        dev = p[0]
        upload = dev.stream(H2D_PARAM)
        compute = dev.stream(COMPUTE)
        weight = torch.ones(1000)  # 4000 bytes
        upload.submit(lambda: dev.to_device(weight), label="U0.0")
        compute.submit(lambda: barrier.wait(), label="F0.0")
        sync(upload.record())
        sync(compute.record())
    assert slept == [pytest.approx(4000 / 2e9)]


def test_emulated_links_are_per_direction(monkeypatch: pytest.MonkeyPatch) -> None:
    # An upload and a download overlap (two links), as a GPU's two copy directions do.
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    monkeypatch.setattr(cpu_mod, "_link_sleep", lambda seconds: barrier.wait())
    with CPUPool(1, pcie_gbps=1.0) as p:
        dev = p[0]
        dev.stream(H2D_ACT).submit(lambda: dev.to_device(torch.ones(4)))
        dev.stream(D2H).submit(lambda: dev.to_host(torch.ones(4)))
        dev.synchronize()


def test_rng_scope_depends_only_on_the_seed() -> None:
    x = torch.ones(64, 64)

    def expected(seed: int) -> list[torch.Tensor]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return [F.dropout(x, 0.5) for _ in range(5)]

    ref = {seed: expected(seed) for seed in (11, 22)}
    before = torch.get_rng_state()
    results: dict[tuple[int, int], list[torch.Tensor]] = {}
    with CPUPool(2) as p:
        for rep in range(10):
            for dev, seed in zip(p.devices, (11, 22), strict=True):

                def run(dev: CPUDevice = dev, seed: int = seed, rep: int = rep) -> None:
                    with dev.rng_scope(seed):
                        results[(rep, seed)] = [F.dropout(x, 0.5) for _ in range(5)]

                dev.stream(COMPUTE).submit(run)
        for dev in p.devices:
            dev.synchronize()
    assert len(results) == 20
    for (_, seed), masks in results.items():
        for got, want in zip(masks, ref[seed], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), before)


def test_compute_threads_split_the_cores() -> None:
    main_threads = torch.get_num_threads()
    seen: list[int] = []
    with CPUPool(3) as p:
        for dev in p.devices:
            dev.stream(COMPUTE).submit(lambda: seen.append(torch.get_num_threads()))
            dev.synchronize()
        assert torch.get_num_threads() == main_threads  # the calling thread is left alone
    assert seen == [max(1, main_threads // 3)] * 3
    assert torch.get_num_threads() == main_threads


def test_close_is_idempotent_and_threads_exit() -> None:
    p = CPUPool(2)
    threads = [t for d in p.devices for t in d.threads]
    per_device = len(StreamRole)  # one worker thread per stream role
    assert len(threads) == 2 * per_device and all(t.is_alive() and t.daemon for t in threads)
    never = CPUEvent()  # no stream will ever reach it
    p[1].stream(D2H).wait(never)
    pending = p[1].stream(D2H).record()
    p.close()  # cancels the wait
    p.close()
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(DeviceError, match="device 1 closed"):
        sync(pending)
    with pytest.raises(DeviceError, match="device 0 is closed"):
        p[0].stream(COMPUTE).submit(lambda: None)


# -- make_devices --------------------------------------------------------------------------


def test_make_cpu_devices() -> None:
    with make_devices("cpu:3", pcie_gbps=10.0, capacity_bytes=1 << 20) as pool:
        assert isinstance(pool, DevicePool) and pool.kind == "cpu" and len(pool) == 3
        assert [d.index for d in pool] == [0, 1, 2]
        assert pool[2].memory_stats()["capacity"] == 1 << 20
        threads = [t for d in pool.devices if isinstance(d, CPUDevice) for t in d.threads]
    assert not any(t.is_alive() for t in threads)
    pool.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="default is cpu only without a GPU")
def test_default_is_two_cpu_devices_without_a_gpu() -> None:
    with make_devices(None) as pool:
        assert pool.kind == "cpu" and len(pool) == 2


def test_parse_device_spec() -> None:
    assert parse_device_spec("cpu:4", num_gpus=0) == ("cpu", [0, 1, 2, 3])
    assert parse_device_spec(" CPU ", num_gpus=0) == ("cpu", [0, 1])
    assert parse_device_spec("cuda", num_gpus=3) == ("cuda", [0, 1, 2])
    assert parse_device_spec("cuda:2, 0", num_gpus=3) == ("cuda", [2, 0])


@pytest.mark.parametrize(
    "spec", ["gpu", "cpu:0", "cpu:x", "cpu:-1", "cuda:", "cuda:a", "cuda:0,0", "cuda:5", ""]
)
def test_bad_spec_names_the_setting(spec: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_device_spec(spec, num_gpus=2)
    msg = str(info.value)
    assert "roundpipe.devices" in msg and repr(spec) in msg and "cpu:N" in msg


def test_cuda_without_gpu_suggests_cpu() -> None:
    with pytest.raises(ValueError, match="no GPU is visible.*cpu:N"):
        parse_device_spec("cuda:0", num_gpus=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no GPU is visible"):
            make_devices("cuda")
