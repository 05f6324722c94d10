"""DeepSpeed's ``autotuning`` block (rp_engine/autotune.py, issue 27): the advisor fills "auto"
batch sizes at initialize, keeps the ones the config sets, and the first steps' profile is
checked against its cost model, re-planning when they disagree.

The re-plan is observed, not read from the log: a spy on ``Planner.replan_rounds`` sees the
costs it is given (the profile's measured ones), and the plan it leaves is held against what
``partition`` gives for those costs. The agree / disagree threshold is tested on both sides of
both edges (a measured / predicted ratio of 1 +- tolerance), by predicted costs scaled to put
the ratio there."""

from __future__ import annotations

import dataclasses
import logging
import types
from typing import Any

import pytest
from models import random_batch, tiny_qwen3
from torch import nn

import rp_engine
from rp_engine.autotune import AutotuneSettings, ProfileCheck
from rp_engine.config import ConfigError
from rp_engine.plan.costs import LayerCosts
from rp_engine.plan.partition import partition
from rp_engine.runtime.stages import StageMap

SEQ = 16
TOLERANCE = 0.25  # roundpipe.autotune_tolerance's default
EDGE = 1e-6  # how far inside or outside the tolerance a ratio is put


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


def _scaled(costs: LayerCosts, factor: float) -> LayerCosts:
    """``costs`` with every time (forward, recompute, backward, head) times ``factor``: any
    total of compute per micro-batch scales by it exactly."""

    def times(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(v * factor for v in values)

    return dataclasses.replace(
        costs, fwd_ms=times(costs.fwd_ms), recompute_ms=times(costs.recompute_ms),
        bwd_ms=times(costs.bwd_ms), head_fwd_ms=costs.head_fwd_ms * factor,
        head_bwd_ms=costs.head_bwd_ms * factor,
    )  # fmt: skip


def _spy_on_replan(planner: Any) -> list[LayerCosts]:
    """The costs of every ``planner.replan_rounds`` call (which still runs)."""
    calls: list[LayerCosts] = []
    real = planner.replan_rounds

    def replan_rounds(costs: LayerCosts) -> tuple[float, float]:
        calls.append(costs)
        return real(costs)

    planner.replan_rounds = replan_rounds
    return calls


def _assert_partition_s_plan(planner: Any, costs: LayerCosts) -> None:
    """The plan left by the re-plan is what ``partition`` gives for ``costs``: the fastest
    estimate over the round sizes dividing the step (no device budget here, so every one is
    a candidate), and at the round size chosen the cuts ``partition`` returns."""
    assert planner.memory_budget_bytes is None  # else the sizes are bounded by the budget's
    m = planner.num_microbatches

    def part(round_size: int) -> Any:
        return partition(
            costs, num_devices=planner.num_devices, num_microbatches=m, memory_budget_bytes=None,
            async_optimizer=planner.async_optimizer, link_gbps=planner.link_gbps,
            min_bwd_stages=StageMap.min_bwd_stages(planner.shape.has_prefix),
            round_size=round_size,
        )  # fmt: skip

    fastest = min(part(d).est_iteration_ms for d in range(1, m + 1) if not m % d)
    chosen = part(planner.round_size)
    assert (tuple(planner.fwd_cuts), tuple(planner.bwd_cuts)) == (
        tuple(chosen.fwd_cuts),
        tuple(chosen.bwd_cuts),
    )
    assert planner.est_iteration_ms == pytest.approx(fastest, rel=1e-9)
    assert chosen.est_iteration_ms == pytest.approx(fastest, rel=1e-9)


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
        replans = _spy_on_replan(engine.planner)
        _train(engine, 3)  # two profile steps, then one more
        assert engine._autotune.done
        measured = engine.planner.measured_costs()
        assert measured is not None and replans == [measured] and replans[0] is measured
        _assert_partition_s_plan(engine.planner, measured)
        assert "the profile disagrees with the advice" in caplog.text
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


@pytest.mark.parametrize("side", ["inside", "outside"])
def test_the_tolerance_edge_decides_the_re_plan(side: str) -> None:
    """The advisor's model set to the profile's measured costs / (1 + tolerance -+ EDGE): just
    inside the tolerance the profile agrees and nothing is re-planned; just outside the
    re-plan runs on the measured costs and leaves the plan ``partition`` gives for them."""
    engine, *_ = rp_engine.initialize(
        model=tiny_qwen3(0, layers=4),
        config=_config(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2,
                       train_batch_size=2, roundpipe={"devices": "cpu:2", "seq_len": SEQ,
                                                      "profile_iterations": 1}),
    )  # fmt: skip
    try:
        check, planner = engine._autotune, engine.planner
        assert check is not None and check.tolerance == TOLERANCE
        ratio = 1 + TOLERANCE + (EDGE if side == "outside" else -EDGE)
        original = planner.measured_costs
        seen: list[LayerCosts] = []

        def measured() -> Any:  # the advisor's model put at ``ratio`` of the profile
            costs = original()
            if costs is not None and not seen:
                seen.append(costs)
                check.predicted = _scaled(costs, 1 / ratio)
            return costs

        planner.measured_costs = measured
        replans = _spy_on_replan(planner)
        _train(engine, 2)
        assert check.done and seen
        if side == "inside":
            assert replans == []
        else:
            assert len(replans) == 1 and replans[0] is seen[0]
            _assert_partition_s_plan(planner, seen[0])
    finally:
        engine.destroy()


@pytest.mark.parametrize(
    ("ratio", "replans"),
    [
        (1 + TOLERANCE - EDGE, False),
        (1 + TOLERANCE + EDGE, True),
        (1 - TOLERANCE + EDGE, False),
        (1 - TOLERANCE - EDGE, True),
    ],
    ids=["slower-inside", "slower-outside", "faster-inside", "faster-outside"],
)
def test_both_edges_of_the_tolerance(ratio: float, replans: bool) -> None:
    """The check alone, on a planner that records: measured compute ``ratio`` x the advisor's
    model, just inside or outside 1 +- tolerance on either side; a re-plan is asked for on the
    measured costs exactly when outside."""
    measured = LayerCosts.uniform(4, fwd_ms=1.0, bwd_ms=2.0, head_fwd_ms=0.5, head_bwd_ms=1.5)
    calls: list[LayerCosts] = []

    def replan_rounds(costs: LayerCosts) -> tuple[float, float]:
        calls.append(costs)
        return 1.0, 1.0

    planner = types.SimpleNamespace(
        profile_left=0, measured_costs=lambda: measured, replan_rounds=replan_rounds,
        round_size=2, fwd_cuts=(4,), bwd_cuts=(2, 2),
    )  # fmt: skip
    check = ProfileCheck(predicted=_scaled(measured, 1 / ratio), tolerance=TOLERANCE)
    assert check.check(planner) is False  # the plan did not change
    assert check.done and calls == ([measured] if replans else [])
    assert check.check(planner) is False and len(calls) == int(replans)  # once only


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
