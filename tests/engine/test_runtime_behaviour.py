"""Runtime behaviour on CPU virtual devices: the round-robin timeline, device memory that does
not grow with depth, errors that name the device and leave the engine usable."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from engine_helpers import config, engine_for, measured_peak_with_runs_in_flight
from models import random_batch, tiny_qwen3

from rp_engine.device.base import DeviceError, StreamRole
from rp_engine.runtime.planning import ModelShape, Planner


def _batches(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return [random_batch(128, batch=2, seq=12, seed=seed + i) for i in range(n)]


def test_timeline_dispatches_round_robin_over_all_devices() -> None:
    engine = engine_for(
        tiny_qwen3(0, layers=4),
        config(devices=4, gas=4, fwd_cuts=[2, 2], bwd_cuts=[0, 1, 1, 2]),
    )
    try:
        engine.train_batch(iter(_batches(4)))
        timeline = engine.last_timeline()
    finally:
        engine.destroy()
    assert {r.device for r in timeline} == {0, 1, 2, 3}  # every device busy
    assert all(r.end >= r.start for r in timeline)
    # decoder block 0 (layer index 1) runs forward in F0 and backward in B3: different devices
    fwd = {r.device for r in timeline if r.action.startswith("F0.")}
    bwd = {r.device for r in timeline if r.action.startswith("B3.")}
    assert fwd and bwd and fwd.isdisjoint(bwd)
    # each device's actions do not overlap in time (one compute stream per device)
    for d in range(4):
        spans = sorted(
            (r.start, r.end) for r in timeline if r.device == d and r.stream == "compute"
        )
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:], strict=False))


@pytest.mark.parametrize("overlap", [False, True], ids=["drained", "overlapped"])
def test_device_memory_does_not_grow_with_depth(overlap: bool) -> None:
    """The plan's validated peak (weights and gradients of the groups a device holds at once,
    prefetch included) is the same for 16 and 32 blocks of the same stage shapes; a measured
    run stays within that peak plus the 2 x M_R boundary states the planner reserves, and the
    bound is not loose. Overlapped: with two runs in flight at the seam (the earlier one's last
    backward slots held while the next one uploads), validated over both runs (the next run's
    first uploads used to start at once: measured 1.25 MB against 954 KB + 18 KB)."""
    layer, head, prefix = 150_000, 40_000, 30_000
    peaks = {}
    for blocks in (16, 32):
        shape = ModelShape(blocks, True, (layer,) * blocks, head, prefix)
        planner = Planner(
            shape, num_devices=2, num_microbatches=2, fwd_cuts=(2,) * (blocks // 2),
            bwd_cuts=(0,) + (1,) * blocks, memory_budget_bytes=2**30, overlap_iterations=overlap,
        )  # fmt: skip
        peaks[blocks] = planner.validated_peak()
    assert peaks[16] == peaks[32] > 0
    engine = engine_for(
        tiny_qwen3(0, layers=16),
        config(devices=2, gas=2, fwd_cuts=[2] * 8, bwd_cuts=[0] + [1] * 16,
               roundpipe={"device_memory_gb": 1.0, "round_size": 1, "on_nonfinite": "ignore",
                          "overlap_iterations": overlap}),
    )  # fmt: skip
    try:
        assert engine._overlap == overlap
        for device in engine.pool:  # every storage counts: the rule counts activations too
            device.meter_compute()
        measured = measured_peak_with_runs_in_flight(engine, lambda i: _batches(2, 10 * i))
        validated = engine.planner.validated_peak()
        states = 2 * engine.planner.round_size * engine.planner.boundary_bytes
    finally:
        engine.destroy()
    assert 0.75 * validated <= measured <= validated + states, (validated, measured, states)


@pytest.mark.parametrize("overlap", [False, True], ids=["drained", "overlapped"])
def test_device_peak_spans_every_run_since_its_reset(overlap: bool) -> None:
    """A device's memory peak is its user's window (a benchmark resets it at the window's start
    and reads it at the end), not the newest run's: a step of long sequences, then one of short
    ones, still reports the long step's peak. The executor used to reset every device's peak as
    it issued each run, so the window reported only the short step (as a fresh window does)."""
    engine = engine_for(
        tiny_qwen3(0, layers=4),
        config(devices=2, gas=2, roundpipe={"overlap_iterations": overlap}),
    )

    def peak() -> int:
        engine.synchronize()
        return max(d.memory_stats()["peak"] for d in engine.pool)

    def reset() -> None:
        for device in engine.pool:
            device.reset_peak()

    def long_and_short(i: int) -> list[dict[str, torch.Tensor]]:
        # the long step's activations (attention scores alone: 2 x 4 heads x 512^2 x 4 B = 8 MB)
        # dwarf the whole model's weights and gradients (~2 MB), so how many slots' weights a
        # device happens to hold at once (stream run-ahead, timing) cannot order the two peaks
        # the other way; at 96 tokens it once did (960,576 vs 949,312 B in a loaded CI run)
        seq = 512 if i == 0 else 8
        return [random_batch(128, batch=2, seq=seq, seed=10 * i + j) for j in range(2)]

    try:
        engine.train_batch(iter(long_and_short(1)))  # cold: the weights' first uploads
        engine.synchronize()
        reset()
        engine.train_batch(iter(long_and_short(0)))
        long_peak = peak()
        engine.train_batch(iter(long_and_short(1)))
        window = peak()
        reset()
        engine.train_batch(iter(long_and_short(1)))
        short_peak = peak()
    finally:
        engine.destroy()
    assert short_peak < long_peak  # the two steps' peaks differ: the check below can bite
    assert window == long_peak, (window, long_peak, short_peak)


def test_device_tensors_are_freed_naming_only_the_streams_that_used_them() -> None:
    """``Device.free(t, used_by)`` marks ``t`` used by those streams (CUDA: ``record_stream``,
    so its memory waits for their queued work); None marks all six, the weight-upload and
    gradient-download queues included. Over overlapped steps with activations sent between
    devices and saved for the backward, no free marks every stream, and what the compute
    threads free (activations, folded gradients) marks COMPUTE at most: activations are made
    there or by an H2D_ACT upload (their allocation stream), and a D2H_ACT download of one
    marks its own stream (transfer.download_state)."""
    engine = engine_for(
        tiny_qwen3(0, layers=4),
        config(devices=2, gas=2, fwd_cuts=[2, 2], bwd_cuts=[0, 2, 2],
               roundpipe={"on_nonfinite": "ignore"}),
    )  # fmt: skip
    frees: list[tuple[str, tuple[StreamRole, ...] | None]] = []
    lock = threading.Lock()
    for device in engine.pool.devices:
        real = device.free

        def recorded(t: torch.Tensor, used_by: Any = None, real: Any = real) -> None:
            with lock:
                roles = None if used_by is None else tuple(used_by)
                frees.append((threading.current_thread().name, roles))
            real(t, used_by)

        device.free = recorded  # type: ignore[method-assign]
    try:
        assert engine._overlap
        it = iter(_batches(6))
        for _ in range(3):
            engine.train_batch(it)
        engine.synchronize()
    finally:
        engine.destroy()
    by_compute = {roles for thread, roles in frees if thread.endswith("-compute")}
    assert frees and by_compute, "no free recorded"
    assert None not in {roles for _, roles in frees}, "a free marked every stream"
    assert by_compute <= {(), (StreamRole.COMPUTE,)}, by_compute
    assert {roles for thread, roles in frees if thread.endswith("-d2h_act")} == {
        (StreamRole.D2H_ACT,)
    }  # the activation downloads ran (saved inputs, sends) and mark their own stream


@pytest.mark.parametrize("cuts", [{}, {"fwd_cuts": [2, 2], "bwd_cuts": [0, 2, 2]}])
def test_layer_that_cannot_fit_fails_before_training(cuts) -> None:
    """Whether the partitioner chooses or the config gives the cuts."""
    model = tiny_qwen3(0, layers=4, hidden=64, vocab=128)
    with pytest.raises(ValueError, match=r"layer .* budget|budget .* layer"):
        engine_for(model, config(devices=2, roundpipe={"device_memory_gb": 1e-5}, **cuts))


def test_error_in_a_layer_names_the_device_and_next_call_works() -> None:
    """A layer that raises while running on virtual device 2: the caller gets a DeviceError
    naming device 2 and the action; the failed step is dropped; the next call trains."""
    model = tiny_qwen3(0, layers=4)
    engine = engine_for(model, config(devices=3, gas=3, fwd_cuts=[2, 2], bwd_cuts=[0, 2, 2]))
    block = model.model.layers[1]
    real_forward = block.forward
    armed = {"on": False}

    def exploding(*args, **kwargs):
        if armed["on"] and threading.current_thread().name == "rp-cpu2-compute":
            raise ArithmeticError("boom inside layer")
        return real_forward(*args, **kwargs)

    block.forward = exploding  # replicas copy the module, so they call the patched forward
    try:
        engine.train_batch(iter(_batches(3)))
        engine.synchronize()  # step 1 applied and published (async: it may still be running)
        before = [p.detach().clone() for p in model.parameters()]
        armed["on"] = True
        with pytest.raises(DeviceError) as err:
            engine.train_batch(iter(_batches(3, seed=5)))
        assert err.value.device == 2 and "device 2" in str(err.value)
        assert "boom inside layer" in str(err.value) and err.value.where
        assert engine.global_steps == 1  # the failed step was not counted
        engine.synchronize()
        for p, b in zip(model.parameters(), before, strict=True):  # nothing half-applied
            torch.testing.assert_close(p, b, rtol=0, atol=0)
        armed["on"] = False
        loss = engine.train_batch(iter(_batches(3, seed=7)))
        assert torch.isfinite(loss) and engine.global_steps == 2
    finally:
        engine.destroy()


def test_concurrent_gradient_downloads_add_up_exactly() -> None:
    """Download threads of several devices adding into one host buffer at once lose nothing."""
    from rp_engine.model.host_store import HostStore

    layer = torch.nn.Linear(256, 256)
    store = HostStore([layer])
    grad = torch.ones(256, 256)
    start = threading.Barrier(4)

    def worker() -> None:
        start.wait()
        for _ in range(50):
            store.accumulate(layer.weight, grad)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.has_grad(layer.weight)
    assert torch.equal(store.grad_buffer(layer.weight), torch.full((256, 256), 200.0))


def test_each_layer_completes_exactly_once_under_concurrent_reports() -> None:
    """Download threads of several devices report the same layers at once: every layer is
    reported ready exactly once (a lost or doubled report would skip or double a step)."""
    from rp_engine.runtime.run_state import Countdown

    countdown = Countdown()
    layers, reports = list(range(8)), 64
    countdown.set(layers, reports)
    done: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def worker() -> None:
        start.wait()
        for _ in range(reports // 8):
            finished = countdown.arrive(layers)
            with lock:
                done.extend(finished)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(done) == layers
