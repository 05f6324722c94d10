"""Ordering on the host side of the executor: gradient accumulation runs on its own worker,
ordered by events, so a slow accumulation never holds up the next micro-batch's backward."""

from __future__ import annotations

import threading
from typing import Any

from engine_helpers import config, engine_for
from models import random_batch, tiny_qwen3


def test_next_backward_starts_before_the_previous_accumulation_ends() -> None:
    """Micro-batch 0's first gradient accumulation (a direct landing: the step's first
    contribution) is held until micro-batch 1's backward (B1.1) has started: with accumulation
    on the copy thread (the landed executor) B1.1's saved input queued behind it and this waited
    out its timeout; no wall-clock figure is asserted."""
    # one device, rounds of one micro-batch: F0.0 H0.0 B1.0 B2.0 F0.1 H0.1 B1.1 B2.1
    engine = engine_for(
        tiny_qwen3(0, layers=2),
        config(devices=1, gas=2, fwd_cuts=[2], bwd_cuts=[0, 1, 1], roundpipe={"round_size": 1}),
    )
    b11_started = threading.Event()
    first = threading.Event()
    seen: dict[str, Any] = {"calls": 0, "overlapped": None}
    call = engine._executor._call

    def held(host_work: Any) -> Any:  # the HOST worker's first landing or add waits for B1.1
        def run(*args: Any, **kwargs: Any) -> Any:
            if not first.is_set():
                first.set()
                seen["overlapped"] = b11_started.wait(timeout=60)
            return host_work(*args, **kwargs)

        return run

    def traced_call(ctx: Any, device: Any, layer: int, state: Any, mb: int, w: Any) -> Any:
        # backward stage 1 is block 1 (layer index 2): called by F0.1, then recomputed by B1.1
        if (layer, mb) == (2, 1):
            seen["calls"] += 1
            if seen["calls"] == 2:
                b11_started.set()
        return call(ctx, device, layer, state, mb, w)

    engine.store.land = held(engine.store.land)  # type: ignore[method-assign]
    engine.store.accumulate = held(engine.store.accumulate)  # type: ignore[method-assign]
    engine._executor._call = traced_call  # type: ignore[method-assign]
    try:
        batches = [random_batch(128, batch=2, seq=8, seed=i) for i in range(2)]
        engine.train_batch(iter(batches))
    finally:
        engine.destroy()
    assert seen["calls"] == 2
    assert seen["overlapped"] is True, "B1.1 waited for micro-batch 0's gradient accumulation"


def test_timeline_has_a_row_per_stream_and_renders() -> None:
    """The measured timeline holds compute, weight uploads, gradient downloads, activation
    transfers and host accumulation; each stream's spans are ordered; the Gantt draws them."""
    from rp_engine.plan import render

    engine = engine_for(
        tiny_qwen3(0, layers=2),
        config(devices=2, gas=2, fwd_cuts=[1, 1], bwd_cuts=[0, 1, 1]),
    )
    try:
        engine.train_batch(iter([random_batch(128, batch=2, seq=8, seed=i) for i in range(2)]))
        records = engine.last_timeline()
        stats = engine.last_step_stats()
    finally:
        engine.destroy()
    streams = {r.stream for r in records}
    assert {"compute", "h2d_param", "h2d_act", "d2h", "d2h_act", "host"} <= streams
    uploads = [r for r in records if r.stream == "h2d_param"]
    assert len(uploads) == stats["uploads"] and all(r.action.startswith("U") for r in uploads)
    assert sum(r.stream == "d2h" for r in records) == stats["downloads"]
    for d in (0, 1):
        for stream in streams:
            spans = sorted((r.start, r.end) for r in records if (r.device, r.stream) == (d, stream))
            assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:], strict=False))
    result = render.measured_result(records)
    busy = sum(r.end - r.start for r in records if r.stream == "compute") * 1e3
    assert abs(result.busy_ms - busy) < 1e-6  # only compute counts as busy
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        png = Path(tmp) / "t.png"
        render.write_png(result, png, lanes=render.STREAM_LANES)
        assert png.stat().st_size > 0
