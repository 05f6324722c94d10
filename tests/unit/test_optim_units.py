"""Optimizer units: the loss scaler against DeepSpeed's own, the build heartbeat, LR builders."""

from __future__ import annotations

import logging

import pytest

from rp_engine.optim.loss_scaler import LossScaler
from rp_engine.optim.optimizer import _heartbeat


def test_loss_scaler_follows_deepspeed_dynamic_loss_scaler(monkeypatch) -> None:
    from deepspeed.runtime.fp16 import loss_scaler as ds

    monkeypatch.setattr(ds.dist, "get_rank", lambda *a, **k: 0)
    kw = dict(scale_window=3, min_scale=1.0, delayed_shift=2, consecutive_hysteresis=False)
    theirs = ds.DynamicLossScaler(init_scale=2.0**8, **kw)
    ours = LossScaler(cur_scale=2.0**8, dynamic=True, cur_hysteresis=2, **kw)
    pattern = [False, True, False, True, True, False, False, False, False, True, False] * 3
    for overflow in pattern:
        theirs.update_scale(overflow)
        ours.update(overflow)
        assert (ours.cur_scale, ours.cur_hysteresis) == (theirs.cur_scale, theirs.cur_hysteresis)


def test_loss_scaler_raises_at_minimum_scale() -> None:
    scaler = LossScaler(cur_scale=1.0, dynamic=True, min_scale=1.0, delayed_shift=1)
    with pytest.raises(FloatingPointError, match="min_loss_scale"):
        scaler.update(True)


def test_static_and_disabled_scalers_never_change() -> None:
    static = LossScaler.from_fp16(
        enabled=True, loss_scale=128, initial_scale_power=16, loss_scale_window=1000,
        hysteresis=2, consecutive_hysteresis=False, min_loss_scale=1,
    )  # fmt: skip
    static.update(True)
    assert static.cur_scale == 128 and not static.dynamic
    assert LossScaler.from_fp16(
        enabled=False, loss_scale=0, initial_scale_power=16, loss_scale_window=1000,
        hysteresis=2, consecutive_hysteresis=False, min_loss_scale=1,
    ).cur_scale == 1.0  # fmt: skip


def test_heartbeat_logs_while_a_long_step_runs() -> None:
    """A beat arrives while the block runs (a broken heartbeat fails on the timeout instead of
    hanging), and none after it ends."""
    import threading

    beat = threading.Event()

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "still building" in record.getMessage():
                beat.set()

    logger = logging.getLogger("rp_engine.optim")
    handler, level = Catch(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        with _heartbeat("still building", every_s=0.01):
            assert beat.wait(timeout=30), "no heartbeat within 30 s of a 0.01 s period"
        beat.clear()
        assert not beat.wait(timeout=0.1), "the heartbeat kept beating after the block ended"
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
