"""Compute cost through the executor's own path (benchmarks/executor_timing.py), the other
processes' load (benchmarks/host_load.py), and the machine model the calibration builds."""

from __future__ import annotations

import pytest

from benchmarks import calibration
from benchmarks.common import PRESETS, build_model
from benchmarks.executor_timing import PARTS, executor_costs
from benchmarks.host_load import CoreShare, other_sessions_demand, water_fill

TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def model():  # type: ignore[no-untyped-def]
    return build_model(TINY).train()


def test_executor_costs_time_every_layer_and_keep_the_bytes(model) -> None:  # type: ignore[no-untyped-def]
    base = calibration.layer_costs(model, TINY["mbs"], TINY["seq"], threads=1, reps=1)
    timing = executor_costs(model, base, TINY["mbs"], TINY["seq"], threads=1, reps=1)
    got = timing.costs
    assert got.num_layers == base.num_layers == TINY["num_hidden_layers"]
    for times in (got.fwd_ms, got.recompute_ms, got.bwd_ms):
        assert len(times) == base.num_layers and all(t > 0 for t in times)
    assert got.head_fwd_ms > 0 and got.head_bwd_ms > 0
    # bytes are the base's: only the times come from the executor path
    assert (got.param_bytes, got.boundary_bytes, got.batch_bytes) == (
        base.param_bytes, base.boundary_bytes, base.batch_bytes,
    )  # fmt: skip
    assert set(timing.parts_ms) == set(PARTS) and all(v >= 0 for v in timing.parts_ms.values())
    # the model's parameters are untouched: no gradient left on them
    assert all(p.grad is None for p in model.parameters())


def test_executor_costs_refuse_base_costs_of_another_model(model) -> None:  # type: ignore[no-untyped-def]
    other = calibration.LayerCosts(fwd_ms=(1.0,), bwd_ms=(1.0,))
    with pytest.raises(ValueError, match="blocks"):
        executor_costs(model, other, TINY["mbs"], TINY["seq"], threads=1, reps=1)


def test_water_fill_gives_each_session_its_fair_share_or_its_demand() -> None:
    assert water_fill(2.0, [2, 2, 1]) == pytest.approx([2 / 3] * 3)  # three busy sessions
    assert water_fill(2.0, [2, 0.5]) == pytest.approx([1.5, 0.5])  # a light one leaves the rest
    assert water_fill(2.0, [1]) == [1]  # one thread: one core, however many there are
    assert water_fill(2.0, []) == []


def test_core_share_counts_other_sessions_not_this_one() -> None:
    """This process's own busy thread is never another session's demand; without samples (or
    with no one else) the run has every core it asks for."""
    import time

    with CoreShare(interval_s=0.01) as got:
        end = time.perf_counter() + 0.1
        while time.perf_counter() < end:  # this process runnable throughout
            pass
    assert len(got.samples) >= 2 and got.mean_threads >= got.mean_sessions >= 0
    idle = CoreShare()
    assert idle.shares(2.0, 3) == (1.0, 2.0, 2.0)
    idle.samples = [[1], [1, 1]]  # one, then two other sessions with a busy thread
    assert idle.share(2.0, 1) == pytest.approx((1.0 + 2 / 3) / 2)
    assert idle.share(2.0, 2) == pytest.approx((1.0 + 2 / 3) / 2)
    demand = other_sessions_demand()
    if demand is not None:  # Linux
        assert all(n >= 1 for n in demand)


def test_cpu_machine_takes_the_measured_share() -> None:
    m = calibration.cpu_machine(2, 0.1, 1e9, 0.5, host_share=(1.0, 1.5))
    assert (m.host_share, m.action_overhead_ms, m.serial_overhead) == ((1.0, 1.5), 0.5, True)
    assert calibration.cpu_machine(2, None, 1e9).host_share == ()


def test_compute_cpu_spans_record_every_compute_action_of_a_step() -> None:
    """Inside the block each compute action the engine runs is recorded once (its text and
    its CPU time); outside it the executor is untouched."""
    import rp_engine
    from benchmarks.common import batches, ds_config
    from benchmarks.executor_timing import compute_cpu_spans
    from rp_engine.plan.actions import Op, parse_action
    from rp_engine.runtime.executor import Executor

    launch = Executor._launch
    cfg = ds_config(TINY, devices="cpu:2", pcie_gbps=None)
    engine, _, _, _ = rp_engine.initialize(model=build_model(TINY), config=cfg)
    try:
        it = iter(batches(TINY, 2 * TINY["gas"]))
        engine.train_batch(it)
        engine.synchronize()
        with compute_cpu_spans() as spans:
            engine.train_batch(it)
            engine.synchronize()
        timeline = [r.action for r in engine.last_timeline() if r.stream == "compute"]
    finally:
        engine.destroy()
    assert Executor._launch is launch
    assert sorted(text for text, _ in spans) == sorted(timeline)
    assert all(parse_action(t).op in (Op.FWD, Op.HEAD, Op.BWD) and s >= 0 for t, s in spans)
