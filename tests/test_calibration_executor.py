"""Compute cost through the executor's own path and the cores devices get at once
(benchmarks/executor_timing.py), and the machine model the calibration builds from them."""

from __future__ import annotations

import pytest

from benchmarks import calibration
from benchmarks.executor_timing import PARTS, executor_costs, parallel_cores
from benchmarks.head_to_head import PRESETS, build_model

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


def test_parallel_cores_stay_between_one_device_and_all(model) -> None:  # type: ignore[no-untyped-def]
    got = parallel_cores(model, TINY["mbs"], TINY["seq"], workers=2, threads=1, rounds=2)
    assert 1.0 <= got["cores"] <= 2.0 and len(got["ratios"]) == 2
    with pytest.raises(ValueError, match="workers"):
        parallel_cores(model, TINY["mbs"], TINY["seq"], workers=0, threads=1)


def test_cpu_machine_takes_the_measured_cores_and_keeps_each_device_its_share() -> None:
    m = calibration.cpu_machine(2, 0.1, 1e9, 0.5, cores=1.4)
    assert (m.host_cores, m.device_cores, m.action_overhead_ms) == (1.4, 1.0, 0.5)
    assert calibration.cpu_machine(2, None, 1e9).host_cores == float(
        calibration.os.cpu_count() or 1
    )
