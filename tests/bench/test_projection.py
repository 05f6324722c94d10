"""The projection's model shapes, cost rate, ZeRO-Infinity formula, memory model and clipping."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks import calibration, projection, shapes
from rp_engine.plan.partition import LayerCosts
from rp_engine.plan.simulate import load_machine


@pytest.mark.parametrize(
    ("key", "billions"),
    [("qwen3-1.7b", 2.03), ("llama3.1-8b", 8.03), ("qwen3-32b", 32.8), ("qwen3-235b-lora", 235.1)],
)
def test_shapes_have_the_published_parameter_counts(key: str, billions: float) -> None:
    s = shapes.SHAPES[key]
    # all parameters, embeddings and an untied head included (Qwen3-1.7B: 2.03 B with the
    # embedding counted once per use as HF reports for untied; 1.72 B tied)
    total = s.layers * s.layer_params + s.head_params * 2
    assert total / 1e9 == pytest.approx(billions, rel=0.02)


def test_the_reference_layer_reproduces_the_published_forward_time() -> None:
    machine = load_machine("rtx4090_pcie4_8x")
    costs = shapes.layer_costs(shapes.SHAPES["qwen3-1.7b"], machine)
    assert costs.fwd_ms[0] == pytest.approx(shapes.REF_FWD_MS)
    assert costs.bwd_ms[0] == pytest.approx(shapes.REF_BWD_MS)
    assert costs.head_fwd_ms == pytest.approx(shapes.REF_HEAD_FWD_MS)


def test_zero_infinity_is_link_bound_when_pcie_is_slow() -> None:
    shape = shapes.SHAPES["llama3.1-8b"]
    fast = load_machine("rtx4090_pcie4_8x")
    slow = dataclasses.replace(fast, h2d_gbps=2.0, d2h_gbps=2.0)
    a = shapes.zero_infinity_tps(shape, fast, 16)
    b = shapes.zero_infinity_tps(shape, slow, 16)
    assert b["link_bound_fraction"] and b["tokens_per_s"] < a["tokens_per_s"]


def test_longest_sequence_grows_with_memory_and_roundpipe_reaches_furthest() -> None:
    shape = shapes.SHAPES["qwen3-1.7b"]
    small = load_machine("rtx4090_pcie4_8x")
    big = dataclasses.replace(small, memory_bytes=small.memory_bytes * 2)
    for system in ("roundpipe", "mobius", "zero_infinity"):
        a, b = projection.max_seq(system, shape, small), projection.max_seq(system, shape, big)
        assert a is not None and b is not None and b > a
    seq = {s: projection.max_seq(s, shape, small) for s in ("roundpipe", "zero_infinity")}
    assert seq["roundpipe"] > seq["zero_infinity"]


def test_calibration_predicts_a_longer_iteration_over_a_slower_link() -> None:
    costs = LayerCosts(fwd_ms=(1.0,) * 4, bwd_ms=(2.0,) * 4, param_bytes=(4_000_000,) * 4)
    kw = dict(schedule="roundpipe", fwd_cuts=(2, 2), bwd_cuts=(0, 2, 2), num_microbatches=4,
              round_size=4, async_optimizer=False)  # fmt: skip
    fast = calibration.predict_ms(costs, calibration.cpu_machine(2, 100.0, 1e9), **kw)
    slow = calibration.predict_ms(costs, calibration.cpu_machine(2, 0.1, 1e9), **kw)
    assert slow["iteration_ms"] > fast["iteration_ms"] > 0


def test_gpu_calibration_point_rows_compare_prediction_and_measurement() -> None:
    rows = calibration.gpu_point()
    assert {r["run"].split(" ")[0] for r in rows} >= {"torch", "deepspeed"}
    for r in rows:
        assert r["predicted_ms"] > 0 and r["measured_ms"] > 0
        assert r["error"] == pytest.approx(
            (r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"]
        )


def test_in_run_costs_recover_the_run_level_of_each_kind_of_slot() -> None:
    # a run whose forward is 2x, backward 3x and head 0.5x the isolated timing: the rescaled
    # costs must reproduce every slot's measured span, and the factors must be found
    costs = LayerCosts(
        fwd_ms=(1.0, 2.0, 1.0, 2.0, 1.0, 2.0),
        bwd_ms=(2.0, 3.0, 2.0, 3.0, 2.0, 3.0),
        head_fwd_ms=4.0,
        head_bwd_ms=8.0,
    )
    fwd_cuts, bwd_cuts = (2, 2, 2), (1, 2, 3)
    k_f, k_b, k_h = 2.0, 3.0, 0.5
    truth = dataclasses.replace(
        costs,
        fwd_ms=tuple(k_f * v for v in costs.fwd_ms),
        recompute_ms=tuple(k_f * v for v in costs.recompute_ms),
        bwd_ms=tuple(k_b * v for v in costs.bwd_ms),
        head_fwd_ms=k_h * costs.head_fwd_ms,
        head_bwd_ms=k_h * costs.head_bwd_ms,
    )
    st = truth.stages(fwd_cuts, bwd_cuts)
    # the runtime's text: forward stages F0-F2, then the backward stages H0, B1, B2 (slots 3-5)
    names = ["F0", "F1", "F2", "H0", "B1", "B2"]
    spans = [
        (f"{name}.{m}@0", st.busy_ms(slot) / 1e3)
        for slot, name in enumerate(names)
        for m in range(2)
    ]
    scaled, factors = calibration.in_run_costs(costs, fwd_cuts, bwd_cuts, spans)
    assert factors == pytest.approx({"k_f": k_f, "k_b": k_b, "k_h": k_h})
    again = scaled.stages(fwd_cuts, bwd_cuts)
    assert [again.busy_ms(s) for s in range(6)] == pytest.approx([st.busy_ms(s) for s in range(6)])


def test_solve_overhead_recovers_a_known_overhead() -> None:
    """The overhead measurement's inverse: an iteration simulated with 0.7 ms per action gives
    back 0.7 ms; one the simulator reaches without any overhead gives 0."""
    costs = LayerCosts.uniform(
        4, fwd_ms=0.2, bwd_ms=0.4, param_bytes=4_000, boundary_bytes=1_000, batch_bytes=100
    )
    machine = calibration.cpu_machine(2, None, 1e9)
    shape = dict(
        schedule="roundpipe", fwd_cuts=(2, 2), bwd_cuts=(0, 2, 2), num_microbatches=4,
        round_size=4, async_optimizer=False,
    )  # fmt: skip
    known = dataclasses.replace(machine, action_overhead_ms=0.7)
    measured = calibration.predict_ms(costs, known, **shape)["iteration_ms"]
    solved = calibration.solve_overhead(costs, machine, measured, **shape)
    assert solved["overhead_ms"] == pytest.approx(0.7, abs=0.01)
    assert solved["simulated_no_overhead_ms"] < measured
    fast = calibration.solve_overhead(costs, machine, solved["simulated_no_overhead_ms"], **shape)
    assert fast["overhead_ms"] == 0.0


def test_projection_simulates_the_clipped_runs_with_the_step_barrier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The modelled runs clip (``projection.CLIPPING``): every simulated system must carry the
    global-norm step barrier, and it must cost the sync rows time (no step before the last
    gradient of the iteration)."""
    assert projection.CLIPPING > 0 and projection.GLOBAL_NORM
    seen: list[bool] = []
    real = projection.simulate

    def recording(*args: object, **kwargs: object) -> object:
        seen.append(bool(kwargs.get("global_norm")))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(projection, "simulate", recording)
    shape, machine = shapes.SHAPES["qwen3-1.7b"], load_machine("rtx4090_pcie4_8x")
    rows = projection.project_model(shape, machine, 16)
    assert seen == [True, True, True]  # async, sync, Mobius
    free = projection.roundpipe_tps(shape, machine, 16, async_opt=False, global_norm=False)
    assert rows["roundpipe_sync"]["tokens_per_s"] < free["tokens_per_s"]
    free = projection.mobius_tps(shape, machine, 16, global_norm=False)
    assert rows["mobius"]["tokens_per_s"] < free["tokens_per_s"]


def test_gpu_calibration_point_simulates_the_clipped_runs_with_the_step_barrier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[bool] = []
    real = calibration.predict_ms

    def recording(*args: object, **kwargs: object) -> object:
        seen.append(bool(kwargs.get("global_norm")))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(calibration, "predict_ms", recording)
    calibration.gpu_point()
    assert seen and all(seen)
