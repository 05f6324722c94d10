"""DeepSpeed's ``autotuning`` block (rp_engine/autotune.py, issue 27): the advisor fills "auto"
batch sizes at initialize, keeps the ones the config sets, and the first steps' profile is
checked against its cost model, re-planning when they disagree."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
from models import random_batch, tiny_qwen3
from torch import nn

import rp_engine
from rp_engine.autotune import AutotuneSettings, ProfileCheck
from rp_engine.config import ConfigError

SEQ = 16


def _config(**over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "autotuning": {"enabled": True, "tuner_type": "model_based", "fast": True},
        "roundpipe": {"devices": "cpu:2", "seq_len": SEQ},
    }
    cfg.update(over)
    return cfg


def _train(engine: Any, steps: int) -> None:
    mbs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    for step in range(steps):
        data = [random_batch(128, batch=mbs, seq=SEQ, seed=100 * step + j) for j in range(gas)]
        engine.train_batch(iter(data))


def test_the_advisor_fills_auto_batch_sizes_and_the_profile_is_checked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The "auto" triplet comes back consistent (micro-batch x accumulation = batch); the
    ignored DeepSpeed keys are named; after the profile the check logs both figures: CPU
    virtual devices run a tiny model far slower than the advisor's FLOPs model says (Python
    overhead per layer), so it re-plans on the measured costs."""
    caplog.set_level(logging.INFO, logger="rp_engine.autotune")
    engine, *_ = rp_engine.initialize(model=tiny_qwen3(0, layers=4), config=_config())
    try:
        mbs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
        assert mbs >= 1 and gas >= 1
        assert engine.train_batch_size() == mbs * gas
        assert "ignored: fast, tuner_type" in caplog.text
        assert "micro-batch x accum" in caplog.text  # the advisor's table
        assert engine._autotune is not None
        _train(engine, 3)  # two profile steps, then one more
        assert engine._autotune.done
        assert "the profile disagrees with the advice" in caplog.text
        assert "the plan in use" in caplog.text
    finally:
        engine.destroy()


def test_the_batch_sizes_the_config_sets_are_kept() -> None:
    engine, *_ = rp_engine.initialize(
        model=tiny_qwen3(0, layers=4), config=_config(gradient_accumulation_steps=3)
    )
    try:
        assert engine.gradient_accumulation_steps() == 3
        assert engine.train_batch_size() == 3 * engine.train_micro_batch_size_per_gpu()
    finally:
        engine.destroy()


def test_a_profile_that_agrees_keeps_the_plan(caplog: pytest.LogCaptureFixture) -> None:
    """The check compares compute per micro-batch: with the advisor's model set to what the
    profile measures, it agrees and nothing is re-planned."""
    caplog.set_level(logging.INFO, logger="rp_engine.autotune")
    engine, *_ = rp_engine.initialize(
        model=tiny_qwen3(0, layers=4),
        config=_config(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2,
                       train_batch_size=2, roundpipe={"devices": "cpu:2", "seq_len": SEQ,
                                                      "profile_iterations": 1}),
    )  # fmt: skip
    try:
        check = engine._autotune
        planner = engine.planner
        original = planner.measured_costs
        seen: list[Any] = []

        def measured() -> Any:  # the advisor's model made to match the profile
            costs = original()
            if costs is not None and not seen:
                seen.append(costs)
                check.predicted = dataclasses.replace(costs)
            return costs

        planner.measured_costs = measured
        cuts = (planner.round_size, planner.fwd_cuts, planner.bwd_cuts)
        _train(engine, 2)
        assert check.done and seen
        assert "the profile agrees with the advice" in caplog.text
        assert "disagrees" not in caplog.text
        assert cuts[0] == planner.round_size
    finally:
        engine.destroy()


@pytest.mark.parametrize(
    "change,match",
    [
        ({"roundpipe": {"devices": "cpu:2"}}, "set roundpipe.seq_len"),
        ({"autotuning": {"enabled": True, "metric": "latency"}}, "autotuning.metric"),
        ({"autotuning": {"enabled": "yes"}}, "autotuning.enabled"),
    ],
)
def test_config_errors_name_the_key(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        rp_engine.initialize(model=tiny_qwen3(0, layers=2), config=_config(**change))


def test_a_model_without_a_config_cannot_have_auto_sizes() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with pytest.raises(ConfigError, match="Hugging Face config"):
        rp_engine.initialize(model=model, config=_config())


def test_disabled_autotuning_fills_nothing() -> None:
    """Off (or absent), "auto" batch sizes stay an error that asks for values, as before."""
    assert AutotuneSettings.from_raw({"autotuning": {"enabled": False}}) is None
    assert AutotuneSettings.from_raw({}) is None
    with pytest.raises(ConfigError, match='"auto"'):
        rp_engine.initialize(
            model=tiny_qwen3(0, layers=2), config=_config(autotuning={"enabled": False})
        )
    assert ProfileCheck.for_engine({"autotuning": {"enabled": False}}, None, 1) is None
