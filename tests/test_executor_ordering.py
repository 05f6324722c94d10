"""Ordering on the host side of the executor: gradient accumulation runs on its own worker,
ordered by events, so a slow accumulation never holds up the next micro-batch's backward."""

from __future__ import annotations

import threading
import time
from typing import Any

from engine_helpers import config, engine_for
from models import random_batch, tiny_qwen3


def test_next_backward_starts_before_the_previous_accumulation_ends() -> None:
    # one device, rounds of one micro-batch: F0.0 H0.0 B1.0 B2.0 F0.1 H0.1 B1.1 B2.1
    engine = engine_for(
        tiny_qwen3(0, layers=2),
        config(devices=1, gas=2, fwd_cuts=[2], bwd_cuts=[0, 1, 1], roundpipe={"round_size": 1}),
    )
    events: list[tuple[str, Any]] = []
    lock = threading.Lock()
    first = threading.Event()
    accumulate, call = engine.store.accumulate, engine._executor._call

    def slow_accumulate(param: Any, grad: Any) -> None:
        if not first.is_set():  # micro-batch 0's first gradient lands slowly
            first.set()
            time.sleep(1.0)
            with lock:
                events.append(("first accumulation done", None))
        accumulate(param, grad)

    def traced_call(ctx: Any, device: Any, layer: int, state: Any, mb: int, w: Any) -> Any:
        with lock:
            events.append(("call", (layer, mb)))
        return call(ctx, device, layer, state, mb, w)

    engine.store.accumulate = slow_accumulate  # type: ignore[method-assign]
    engine._executor._call = traced_call  # type: ignore[method-assign]
    try:
        batches = [random_batch(128, batch=2, seq=8, seed=i) for i in range(2)]
        engine.train_batch(iter(batches))
    finally:
        engine.destroy()
    done = events.index(("first accumulation done", None))
    # backward stage 1 is block 1 (layer index 2): called by F0.1, then recomputed by B1.1
    calls = [i for i, e in enumerate(events) if e == ("call", (2, 1))]
    assert len(calls) == 2
    assert calls[1] < done, "B1.1 waited for micro-batch 0's gradient accumulation"
