"""CPU virtual devices hold no more than ``roundpipe.device_memory_gb`` (issue 49, item 4).

A CPU device's memory is host memory: the planner fits its stages to the budget and the
host-RAM model (plan/host_ram.py) counts each device as ``device_memory_gb`` of host RAM. Both
are honest only if the device's compute (activations kept for the backward, temporaries, the
LM head's logits) counts against the budget too, not only the weights and gradients the
runtime tracks: a device with a capacity meters its compute by default
(``CPUDevice.meter_compute``), so its peak is what it really held, and a run that does not fit
is stopped with an out-of-memory error naming the budget instead of using more host RAM.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_helpers import config, engine_for
from models import random_batch, tiny_qwen3

import rp_engine
from rp_engine.device import make_devices

GIB = 2**30
VOCAB = 128
BUDGET_GB = 0.015  # 15.4 MiB: the planner splits the backward into one layer per stage
FACTOR = 2.0  # the memory rule overestimates a device's peak by at most this (test_memory_rule)


def _engine() -> Any:
    """A 4-layer Qwen3 64 wide on 2 CPU devices of ``BUDGET_GB`` each, micro-batches of 2."""
    model = tiny_qwen3(0, layers=4, hidden=64, vocab=VOCAB)
    return engine_for(
        model, config(devices=2, gas=2, mbs=2, roundpipe={"device_memory_gb": BUDGET_GB})
    )


def _batches(seqs: list[int]) -> Iterator[dict[str, torch.Tensor]]:
    return iter([random_batch(VOCAB, batch=2, seq=s, seed=i) for i, s in enumerate(seqs)])


def test_each_device_holds_at_most_its_budget() -> None:
    """Three steps of 2 x 256 tokens (activations ~10x the weights): each device's peak, every
    storage it held counted, is within ``device_memory_gb`` and is the memory rule's (at least
    the planner's validated peak over ``FACTOR``). Only the runtime's tensors were counted
    before: ~2 MB measured for a plan the rule puts at 14 MB."""
    engine = _engine()
    try:
        assert all(d.compute_metered for d in engine.pool)
        data = _batches([256] * 6)
        for _ in range(3):
            engine.train_batch(data)
        engine.synchronize()
        budget = int(BUDGET_GB * GIB)
        validated = engine.planner.validated_peak()
        peaks = [d.memory_stats()["peak"] for d in engine.pool]
    finally:
        engine.destroy()
    assert validated <= budget
    assert all(peak <= budget for peak in peaks), (peaks, budget)
    assert validated <= FACTOR * max(peaks), (validated, peaks)


def test_a_run_that_does_not_fit_is_stopped_naming_the_budget() -> None:
    """The plan is fitted to the first batch (2 x 16 tokens); a later batch of 2 x 512 needs
    more than the budget in activations (the runtime's own tensors for it, ~6 MB, fit). Its
    step fails with an out-of-memory error naming roundpipe.device_memory_gb and the fix
    (before, it trained on in more host RAM), and no device ever held more than the budget."""
    engine = _engine()
    try:
        data = _batches([16, 16, 512, 512])
        engine.train_batch(data)
        with pytest.raises(Exception) as info:  # noqa: PT011 - the message is what is checked
            engine.train_batch(data)
            engine.synchronize()
        peaks = [d.memory_stats()["peak"] for d in engine.pool]
    finally:
        engine.destroy()
    text = str(info.value)
    assert "out of memory" in text and "roundpipe.device_memory_gb" in text, text
    assert "smaller stages" in text and "micro-batches" in text, text
    assert all(peak <= int(BUDGET_GB * GIB) for peak in peaks), peaks


def test_metering_follows_the_budget_and_can_be_turned_off() -> None:
    """Devices without a capacity are not metered (nothing to bound: it would only cost time);
    ``roundpipe.meter_cpu_compute`` false turns it off with a budget, true on without one."""
    with make_devices("cpu:2") as pool:
        assert not any(d.compute_metered for d in pool)
    with make_devices("cpu:1", capacity_bytes=GIB) as pool:
        assert all(d.compute_metered for d in pool)
    for key, budget, metered in ((False, BUDGET_GB, False), (True, None, True)):
        engine, *_ = rp_engine.initialize(
            model=tiny_qwen3(0, layers=2, hidden=32, vocab=VOCAB),
            config=config(roundpipe={"device_memory_gb": budget, "meter_cpu_compute": key}),
        )
        try:
            assert [d.compute_metered for d in engine.pool] == [metered] * 2
        finally:
            engine.destroy()
