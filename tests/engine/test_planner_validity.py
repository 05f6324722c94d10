"""The automatic planner only yields plans the executor accepts (issue 17).

Properties over model depth, devices, sync/async, GAS, memory budgets and random costs: the
planner (and its re-plan from random measurements) returns cuts that ``StageMap.from_cuts`` and
``schedules.validate`` accept, or raises one ValueError about the budget that names no key the
user did not set. Errors about cuts name ``roundpipe.*_cuts`` only when the user wrote them.
A few grid points train two steps on CPU devices, among them the issue's cpu:1 cases.
"""

from __future__ import annotations

import logging
import math

import pytest
from engine_helpers import config, engine_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import random_batch, tiny_qwen2

from rp_engine.plan import schedules
from rp_engine.plan.partition import CutsError, LayerCosts, Partition, partition
from rp_engine.runtime import planning
from rp_engine.runtime.planning import ModelShape, Planner
from rp_engine.runtime.stages import StageMap

_SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
    database=None,
)
_CUT_KEYS = ("fwd_cuts", "bwd_cuts")


@st.composite
def _planner_cases(draw: st.DrawFn) -> dict:
    layers = draw(st.integers(1, 12))
    has_prefix = draw(st.booleans())
    blocks = tuple(draw(st.lists(st.integers(1, 10**6), min_size=layers, max_size=layers)))
    head = draw(st.integers(0, 10**6))
    prefix = draw(st.integers(0, 10**6)) if has_prefix else 0
    # tight (a layer may not fit) .. roomy .. unlimited; a backward stage holds 2x its weights
    factor = draw(st.one_of(st.none(), st.floats(0.5, 6.0)))
    largest = 2 * max(max(blocks) + prefix, head)
    return {
        "shape": ModelShape(layers, has_prefix, blocks, head, prefix),
        "num_devices": draw(st.integers(1, 4)),
        "num_microbatches": draw(st.integers(1, 8)),
        "async_optimizer": draw(st.booleans()),
        "memory_budget_bytes": None if factor is None else int(factor * largest),
        "link_gbps": draw(st.one_of(st.none(), st.floats(0.01, 100.0))),
        # measured times (ms) of two profiled iterations, zeros included
        "times": draw(st.lists(st.floats(0.0, 50.0), min_size=64, max_size=64)),
    }


def _check_budget_error(error: ValueError, budget: int | None) -> None:
    """One clear error about the budget, naming no cut key (the user set none)."""
    message = str(error)
    assert budget is not None, message
    assert "budget" in message and "device_memory_gb" in message, message
    assert not any(key in message for key in _CUT_KEYS), message


def _check_accepted(planner: Planner, budget: int | None) -> None:
    """The executor's stage map and the schedule validator accept the planner's cuts."""
    shape = planner.shape
    stages = StageMap.from_cuts(
        num_blocks=shape.num_blocks,
        has_prefix=shape.has_prefix,
        fwd_cuts=planner.fwd_cuts,
        bwd_cuts=planner.bwd_cuts,
    )
    assert stages == planner.stages
    plan = planner.compute_plan()
    schedules.validate(plan, costs=planner._estimate(), memory_budget_bytes=budget)
    schedules.validate(schedules.lower(plan))


def _observe_random(planner: Planner, times: list[float]) -> None:
    """Feed ``profile_iterations`` iterations of per-layer and per-stage times."""
    p = 1 if planner.shape.has_prefix else 0
    layers = p + planner.shape.num_blocks + 1
    it = iter(times * 4)
    while planner.profile_left > 0:
        fwd = {i: [next(it)] for i in range(layers)}
        bwd = {j: [next(it)] for j in range(len(planner.stages.bwd))}
        planner.observe(fwd, bwd)


@_SETTINGS
@given(_planner_cases())
def test_planner_yields_accepted_plans_or_one_budget_error(case: dict) -> None:
    times, budget = case.pop("times"), case["memory_budget_bytes"]
    try:
        planner = Planner(case.pop("shape"), **case)
    except ValueError as e:
        _check_budget_error(e, budget)
        return
    _check_accepted(planner, budget)
    _observe_random(planner, times)  # the re-plan from measurements: same contract
    _check_accepted(planner, budget)


@st.composite
def _partition_cases(draw: st.DrawFn) -> dict:
    layers = draw(st.integers(1, 12))

    def per_layer(lo: float, hi: float) -> list[float]:
        return draw(st.lists(st.floats(lo, hi), min_size=layers, max_size=layers))

    mib = 1 << 20
    costs = LayerCosts(
        fwd_ms=per_layer(0.0, 10.0),
        bwd_ms=per_layer(0.0, 20.0),
        param_bytes=[int(v * mib) for v in per_layer(0.0, 100.0)],
        act_bytes=[int(v * mib) for v in per_layer(0.0, 50.0)],
        head_fwd_ms=draw(st.floats(0.0, 10.0)),
        head_bwd_ms=draw(st.floats(0.0, 20.0)),
        head_param_bytes=draw(st.integers(0, 100)) * mib,
        head_act_bytes=draw(st.integers(0, 200)) * mib,  # the head chunk's logits
        boundary_bytes=draw(st.integers(0, 4)) * mib,
        comm_ms=draw(st.floats(0.0, 2.0)),
        prefix_param_bytes=draw(st.integers(0, 100)) * mib,  # counts in the budget
    )
    budget_mib = draw(st.one_of(st.none(), st.integers(100, 2000)))
    return {
        "costs": costs,
        "num_devices": draw(st.integers(1, 4)),
        "num_microbatches": draw(st.integers(1, 8)),
        "async_optimizer": draw(st.booleans()),
        "memory_budget_bytes": None if budget_mib is None else budget_mib * mib,
        "min_bwd_stages": draw(st.integers(1, min(4, layers + 1))),
        "link_gbps": draw(st.one_of(st.none(), st.floats(0.01, 100.0))),
    }


@_SETTINGS
@given(_partition_cases())
def test_partition_respects_min_bwd_stages_and_budget(case: dict) -> None:
    budget = case["memory_budget_bytes"]
    try:
        got = partition(case["costs"], **{k: v for k, v in case.items() if k != "costs"})
    except ValueError as e:
        assert budget is not None and "budget" in str(e), str(e)
        assert not isinstance(e, CutsError)  # no cuts were given: none can be blamed
        return
    assert len(got.bwd_cuts) >= case["min_bwd_stages"]
    assert min(got.fwd_cuts) >= 1 and min(got.bwd_cuts[1:], default=1) >= 1
    assert math.isfinite(got.est_iteration_ms)
    plan = schedules.roundpipe(
        fwd_cuts=got.fwd_cuts,
        bwd_cuts=got.bwd_cuts,
        num_devices=case["num_devices"],
        num_microbatches=case["num_microbatches"],
    )
    schedules.validate(plan, costs=case["costs"], memory_budget_bytes=budget)


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_one_layer_and_short_models_with_a_prefix_get_a_stage_after_the_head(layers) -> None:
    shape = ModelShape(layers, True, (1000,) * layers, 4000, 2000)
    for devices in (1, 2):
        for async_optimizer in (False, True):
            planner = Planner(
                shape, num_devices=devices, num_microbatches=2, async_optimizer=async_optimizer
            )
            assert len(planner.bwd_cuts) >= 2 and planner.bwd_cuts[-1] >= 1
    if layers == 1:  # the only accepted cuts: an empty head stage, then the layer and prefix
        assert (planner.fwd_cuts, planner.bwd_cuts) == ((1,), (0, 1))
        assert planner.stages.bwd == ((2,), (0, 1))


def test_planning_is_deterministic_given_costs() -> None:
    shape = ModelShape(9, True, tuple(1000 + 37 * i for i in range(9)), 5000, 3000)
    times = [float((7 * i) % 11) + 0.5 for i in range(64)]
    runs = []
    for _ in range(2):
        planner = Planner(shape, num_devices=3, num_microbatches=5)
        first = (planner.fwd_cuts, planner.bwd_cuts)
        _observe_random(planner, times)
        runs.append((first, (planner.fwd_cuts, planner.bwd_cuts)))
    assert runs[0] == runs[1]


def test_replan_keeps_the_current_plan_when_the_search_finds_nothing_better(
    monkeypatch,
) -> None:
    shape = ModelShape(6, True, (1000,) * 6, 3000, 2000)
    planner = Planner(shape, num_devices=2, num_microbatches=4)
    kept = (planner.fwd_cuts, planner.bwd_cuts)
    real = planning.partition

    def worse_search(costs: LayerCosts, **kw) -> Partition:
        if kw.get("fwd_cuts") is not None:  # the estimate of the current cuts: the real one
            return real(costs, **kw)
        current = real(costs, **{**kw, "fwd_cuts": kept[0], "bwd_cuts": kept[1]})
        return Partition((6,), (0, 6 - 1, 1), current.est_iteration_ms * 1.5)

    monkeypatch.setattr(planning, "partition", worse_search)
    _observe_random(planner, [1.0] * 64)
    assert (planner.fwd_cuts, planner.bwd_cuts) == kept and not planner.replanned


def test_the_plan_in_use_is_logged_once_in_text_form(caplog) -> None:
    shape = ModelShape(4, True, (1000,) * 4, 3000, 2000)
    with caplog.at_level(logging.INFO, logger="rp_engine.planning"):
        planner = Planner(shape, num_devices=2, num_microbatches=2)
    (record,) = [r for r in caplog.records if "fwd_cuts" in r.getMessage()]
    text = record.getMessage()
    assert f"fwd_cuts={list(planner.fwd_cuts)}" in text
    assert f"bwd_cuts={list(planner.bwd_cuts)}" in text
    assert "\nd0: " in text and "\nd1: " in text  # the device grid


# --- which key an error names ------------------------------------------------------------------
def test_cut_errors_name_the_roundpipe_keys_only_when_the_user_set_them() -> None:
    shape = ModelShape(3, True, (1000,) * 3, 3000, 2000)
    with pytest.raises(ValueError, match=r"^roundpipe\.bwd_cuts \[3\]: the embedding prefix"):
        Planner(shape, num_devices=1, num_microbatches=2, fwd_cuts=(3,), bwd_cuts=(3,))
    # layers 0..1 with the prefix as a backward stage: 3 x (1000 + 1000 + 2000) bytes (weights,
    # gradient accumulators, the micro-batch's gradients before they are folded in) > 10500
    match = r"^roundpipe\.bwd_cuts \[0, 1, 2\]: backward stage 2 \(layers 0\.\.1\) exceeds"
    with pytest.raises(ValueError, match=match):
        Planner(
            shape,
            num_devices=1,
            num_microbatches=2,
            fwd_cuts=(1, 1, 1),
            bwd_cuts=(0, 1, 2),
            memory_budget_bytes=10500,
        )
    Planner(shape, num_devices=1, num_microbatches=2, memory_budget_bytes=10500)  # plans itself
    # the same budget without cuts: the planner's error is about the layer and the budget
    with pytest.raises(ValueError, match=r"layer 0 needs .* budget .* device") as info:
        Planner(shape, num_devices=2, num_microbatches=2, memory_budget_bytes=7500)
    assert not any(key in str(info.value) for key in _CUT_KEYS)


def test_mobius_on_one_device_with_a_prefix_binds_two_blocks() -> None:
    shape = ModelShape(4, True, (1000,) * 4, 3000, 2000)
    planner = Planner(shape, num_devices=1, num_microbatches=2, schedule="mobius")
    assert planner.fwd_cuts == (2, 2) and planner.bwd_cuts == (2, 2)
    with pytest.raises(ValueError, match=r"roundpipe\.schedule 'mobius' needs at least 2"):
        Planner(
            ModelShape(1, True, (1000,), 3000, 2000),
            num_devices=1,
            num_microbatches=2,
            schedule="mobius",
        )


# --- a few grid points train two steps on CPU devices ------------------------------------------
@pytest.mark.parametrize(
    "layers,devices,gas,async_optimizer,extra",
    [
        (1, 1, 2, True, {}),  # the failures on cpu:1
        (3, 1, 2, True, {}),
        (4, 1, 2, False, {}),
        (2, 3, 5, True, {"head_chunk_tokens": 8}),
        (5, 2, 1, False, {"schedule": "mobius"}),
        (3, 1, 2, False, {"schedule": "mobius"}),  # two blocks bound to the one device
    ],
)
def test_grid_points_train_two_steps_without_cuts(layers, devices, gas, async_optimizer, extra):
    model = tiny_qwen2(layers=layers)
    cfg = config(devices=devices, gas=gas, async_optimizer=async_optimizer, roundpipe=extra)
    engine = engine_for(model, cfg)
    try:
        batches = iter([random_batch(128, batch=2, seq=8, seed=i) for i in range(2 * gas)])
        losses = [float(engine.train_batch(batches)) for _ in range(2)]
        assert all(math.isfinite(v) for v in losses)
        assert len(engine.planner.bwd_cuts) >= 2  # Qwen2 has an embedding prefix
    finally:
        engine.destroy()


def test_the_engine_plans_with_its_link_bandwidth() -> None:
    """``roundpipe.pcie_gbps`` (the emulated link) reaches the planner's transfer objective."""
    engine = engine_for(tiny_qwen2(0), config(roundpipe={"pcie_gbps": 0.5}))
    try:
        assert engine.planner.link_gbps == 0.5
    finally:
        engine.destroy()


def test_the_measured_head_cost_excludes_the_head_stage_blocks() -> None:
    """The HEAD slot runs its stage's blocks (forward + backward) and the LM head: only the rest
    of its measured time is the head's. Charged whole (as before), a head stage of 5 blocks at
    7 ms per forward made a 110 ms "head", and the re-plan cut the model around it (found by the
    head-to-head's calibration: the chosen cuts left one device 4x busier than the other)."""
    shape = ModelShape(6, True, (1000,) * 6, 3000, 2000)
    planner = Planner(shape, num_devices=2, num_microbatches=4, profile_iterations=1)
    planner.set_cuts((6,), (5, 1))  # a planned (not user-given) head stage of 5 blocks
    assert planner.profile_left == 1
    f, head_fwd = 7.0, 2.0  # per block forward, LM head forward (backward twice each)
    fwd = {layer: [f] for layer in range(1, 7)}
    fwd[planner.stages.head_index] = [head_fwd]
    bwd = {0: [5 * 3 * f + 3 * head_fwd], 1: [3 * f]}  # head slot: 5 blocks + head, fwd + bwd
    captured: list[LayerCosts] = []
    real = planner._measured

    def spy() -> LayerCosts | None:
        costs = real()
        assert costs is not None
        captured.append(costs)
        return costs

    planner._measured = spy  # type: ignore[method-assign]
    planner.observe(fwd, bwd)
    (costs,) = captured
    assert costs.head_fwd_ms == pytest.approx(head_fwd)
    assert costs.head_bwd_ms == pytest.approx(2 * head_fwd)
