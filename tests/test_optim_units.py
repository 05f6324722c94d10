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


def test_heartbeat_logs_while_a_long_step_runs(caplog) -> None:
    import threading

    release = threading.Event()
    with caplog.at_level(logging.WARNING, logger="rp_engine.optim"):
        with _heartbeat("still building", every_s=0.01):
            # wait until at least one beat was logged (no sleeps: poll the captured records)
            while not any("still building" in r.message for r in caplog.records):
                release.wait(0.005)
    assert any("still building" in r.message for r in caplog.records)
