"""Compute cost through the executor's own path (benchmarks/executor_timing.py), the other
processes' load (benchmarks/host_load.py), and the machine model the calibration builds."""

from __future__ import annotations

import pytest

from benchmarks import calibration
from benchmarks.executor_timing import PARTS, executor_costs
from benchmarks.head_to_head import PRESETS, build_model
from benchmarks.host_load import ExternalLoad, runnable_counts

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


def test_external_load_counts_other_processes_not_this_one() -> None:
    """This process's own busy thread is never external load; a figure is always there."""
    import time

    with ExternalLoad(interval_s=0.01) as load:
        end = time.perf_counter() + 0.1
        while time.perf_counter() < end:  # this process runnable throughout
            pass
    assert load.samples >= 2 and load.mean >= 0
    got = runnable_counts()
    if got is not None:  # Linux: the system's runnable threads include this one
        assert got[0] >= got[1] >= 1


def test_cpu_machine_takes_the_measured_load() -> None:
    m = calibration.cpu_machine(2, 0.1, 1e9, 0.5, host_load=1.5)
    assert (m.host_load, m.action_overhead_ms, m.serial_overhead) == (1.5, 0.5, True)
    assert calibration.cpu_machine(2, None, 1e9).host_load == 0.0
