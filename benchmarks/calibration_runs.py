"""The engine re-run on a measured run's plan, for the calibration of the plan simulator.

``plan_run`` runs ``rp_engine`` on the plan a measured run used (schedule, cuts, round size,
optimizer mode) with no emulated link; ``in_engine_costs`` turns the compute it timed there into
the simulator's layer costs; ``overhead_run`` does both with a near-zero-compute model, so that
the per-action host overhead can be solved for (``calibration.solve_overhead``). Used by
``head_to_head``'s calibration and by studies/advise_cpu.py.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.common import batches, build_model, ds_config
from benchmarks.host_load import CoreShare

OVERHEAD_SHAPE = {  # the near-zero-compute model of the overhead run: the layers, no FLOPs
    "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 8, "vocab_size": 64,
}  # fmt: skip


def plan_run(
    preset: dict[str, Any], shape: dict[str, Any], num_devices: int, warmup: int, steps: int
) -> tuple[Any, float, CoreShare, list[tuple[str, float]]]:
    """The engine on the measured run's plan (``shape``: schedule, cuts, round size, optimizer
    mode; same devices, micro-batches, tokens, layer count) with ``preset``'s model and no
    emulated link. Returns the model, the ms per step (timed between two synchronisations, as
    the real run), the cores other sessions left it meanwhile, and the CPU time of each compute
    action's body in the timed steps (``executor_timing.compute_cpu_spans``)."""
    import rp_engine
    from benchmarks import calibration as cal
    from benchmarks.executor_timing import compute_cpu_spans

    cfg = ds_config(preset, devices=f"cpu:{num_devices}", pcie_gbps=None)
    cfg["roundpipe"].update(
        async_optimizer=shape["async_optimizer"],
        schedule=shape["schedule"],
        round_size=shape["round_size"],
    )
    if shape["schedule"] != "mobius":  # Mobius binds its blocks itself (the same cuts)
        cfg["roundpipe"].update(fwd_cuts=list(shape["fwd_cuts"]), bwd_cuts=list(shape["bwd_cuts"]))
    model = build_model(preset)
    engine, _, _, _ = rp_engine.initialize(model=model, config=cfg)
    wall = cal.default_threads(num_devices) > 1  # the compute thread alone holds its CPU time
    try:
        it = iter(batches(preset, (warmup + steps) * preset["gas"]))
        for _ in range(warmup):
            engine.train_batch(it)
        engine.synchronize()
        with CoreShare() as load, compute_cpu_spans(wall) as spans:
            start = time.perf_counter()
            for _ in range(steps):
                engine.train_batch(it)
            engine.synchronize()
            ms = (time.perf_counter() - start) / steps * 1e3
        ran = (tuple(engine.planner.fwd_cuts), tuple(engine.planner.bwd_cuts))
    finally:
        engine.destroy()
    if ran != (tuple(shape["fwd_cuts"]), tuple(shape["bwd_cuts"])):
        raise RuntimeError(f"a calibration run planned {ran}, not the measured run's cuts")
    return model, ms, load, spans


def in_engine_costs(
    model: Any, preset: dict[str, Any], shape: dict[str, Any], num_devices: int, spans: list
) -> tuple[Any, Any, Any, dict[str, float]]:
    """``model``'s plain layer costs, its executor-path costs (isolated, by part) and the same
    rescaled, per kind of slot, to the CPU time its compute actions took inside the engine
    (``spans``: ``calibration.in_run_costs``), with the factors."""
    from benchmarks import calibration as cal
    from benchmarks.executor_timing import executor_costs

    threads = cal.default_threads(num_devices)
    plain = cal.layer_costs(model, preset["mbs"], preset["seq"], threads=threads)
    timing = executor_costs(model, plain, preset["mbs"], preset["seq"], threads=threads)
    costs, factors = cal.in_run_costs(timing.costs, shape["fwd_cuts"], shape["bwd_cuts"], spans)
    return plain, timing, costs, factors


def overhead_run(
    preset: dict[str, Any], shape: dict[str, Any], num_devices: int, warmup: int = 2, steps: int = 6
) -> tuple[Any, float, float, CoreShare]:
    """``plan_run`` with a near-zero-compute model (``OVERHEAD_SHAPE``): returns its compute
    costs as they ran in the engine (``in_engine_costs``, so the fixed per-action parts of a
    compute body count once: in compute, not in the overhead), its CPU Adam rate, the measured
    ms per step and the cores other sessions left it."""
    from benchmarks import calibration as cal

    tiny = {**preset, **OVERHEAD_SHAPE}
    model, ms, load, spans = plan_run(tiny, shape, num_devices, warmup, steps)
    _, _, costs, _ = in_engine_costs(model, tiny, shape, num_devices, spans)
    rate = cal.cpu_adam_rate(sum(p.numel() for p in model.parameters()))
    return costs, rate, ms, load
