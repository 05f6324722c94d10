"""Calibration: the plan simulator's predicted iteration time against a measured rp_engine run.

``layer_costs`` times the model's own layers directly (forward; forward + backward; the LM head
with its loss) on one micro-batch, with the intra-op threads one CPU virtual device gets, and
returns ``LayerCosts`` with the real parameter, boundary-state and batch bytes. ``cpu_adam_rate``
(``rp_engine.autotune``'s) measures DeepSpeed's CPU Adam (the kernel the engine steps with). ``predict_ms`` builds the
engine's plan (same schedule, cuts, devices, micro-batches, round size) for a few iterations back
to back and simulates it on a machine model of the emulated link; its steady-state iteration is
the prediction. ``gpu_point`` is the second calibration point, from the per-layer figures
measured on an H200 (shared/reference/gpu_measurements.md).

Host overhead per action (``Machine.action_overhead_ms``), measured, not fitted to the runs it
predicts. Layer timing and the link model leave out what the runtime pays per action on the host:
Python issue and bookkeeping, each copy handed to a stream thread, each optimizer step's call.
``solve_overhead`` takes a *separate* measured run of the engine on the same plan (same schedule,
cuts, devices, micro-batches, round size, optimizer mode) with a near-zero-compute model (the
same layer count, hidden size 16) and no emulated link, where almost all of the step is this
overhead, times that model's layers the same way, and solves for the one per-action overhead at
which the simulator reproduces that run's step time (bisection; the simulated iteration grows
with the overhead). The same value is then charged to every compute action, copy and optimizer
step of the real run's prediction. ``benchmarks/head_to_head.py`` measures it in each child,
right after the measured run, on the same machine state. It is a CPU virtual-device figure; the
GPU presets keep 0 (no CUDA measurement of it yet).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.shapes import SHAPES, zero_infinity_tps
from rp_engine.autotune import cpu_adam_rate  # re-exported: the benchmarks' one Adam timer
from rp_engine.plan import schedules
from rp_engine.plan.partition import LayerCosts
from rp_engine.plan.simulate import Machine, simulate

__all__ = [
    "layer_costs",
    "in_run_costs",
    "cpu_adam_rate",
    "predict_ms",
    "cpu_machine",
    "solve_overhead",
]

NO_LINK_GBPS = 1e6  # "no emulated link": copies are memcpy-fast next to compute


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm-up (allocator, kernels)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def layer_costs(model: Any, mbs: int, seq: int, *, threads: int, reps: int = 5) -> LayerCosts:
    """Per-layer ms per micro-batch of an HF decoder-only model (``model.model.layers``)."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        return _layer_costs(model, mbs, seq, reps)
    finally:
        torch.set_num_threads(saved)


def _layer_costs(model: Any, mbs: int, seq: int, reps: int) -> LayerCosts:
    import torch
    import torch.nn.functional as F

    inner = model.model
    ids = torch.randint(0, model.config.vocab_size, (mbs, seq))
    pos = torch.arange(seq).unsqueeze(0)
    with torch.no_grad():
        hidden = inner.embed_tokens(ids)
        rope = inner.rotary_emb(hidden, pos)
    fwd, bwd, pbytes = [], [], []
    for layer in inner.layers:

        def run_fwd(layer: Any = layer) -> None:
            with torch.no_grad():
                layer(hidden, position_embeddings=rope, position_ids=pos)

        def run_both(layer: Any = layer) -> None:
            x = hidden.detach().requires_grad_(True)
            layer(x, position_embeddings=rope, position_ids=pos).sum().backward()

        f = _median_ms(run_fwd, reps)
        fwd.append(f)
        bwd.append(max(_median_ms(run_both, reps) - f, 0.0))
        pbytes.append(sum(p.numel() * p.element_size() for p in layer.parameters()))
    labels = ids.clone()

    def head(backward: bool) -> None:
        x = hidden.detach().requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            logits = model.lm_head(inner.norm(x)).float()
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
            if backward:
                loss.backward()

    head_f = _median_ms(lambda: head(False), reps)
    head_b = max(_median_ms(lambda: head(True), reps) - head_f, 0.0)
    model.zero_grad(set_to_none=True)
    head_bytes = sum(p.numel() * p.element_size() for p in model.lm_head.parameters())
    head_bytes += sum(p.numel() * p.element_size() for p in inner.norm.parameters())
    prefix = sum(p.numel() * p.element_size() for p in inner.embed_tokens.parameters())
    # what crosses the link per micro-batch, as the runtime's state dicts hold it: the batch
    # (input ids and labels); a boundary state (hidden, position ids, rotary cos/sin, labels)
    hidden_bytes = hidden.numel() * hidden.element_size()
    batch_bytes = 2 * ids.numel() * ids.element_size()
    state_bytes = hidden_bytes + pos.numel() * pos.element_size() + ids.numel() * ids.element_size()
    state_bytes += sum(t.numel() * t.element_size() for t in rope)
    return LayerCosts(
        fwd_ms=tuple(fwd),
        bwd_ms=tuple(bwd),
        param_bytes=tuple(pbytes),
        head_fwd_ms=head_f,
        head_bwd_ms=head_b,
        head_param_bytes=head_bytes,
        boundary_bytes=state_bytes,
        boundary_grad_bytes=hidden_bytes,
        batch_bytes=batch_bytes,
        prefix_param_bytes=prefix,
    )


def in_run_costs(
    costs: LayerCosts,
    fwd_cuts: Sequence[int],
    bwd_cuts: Sequence[int],
    spans: Sequence[tuple[str, float]],
) -> tuple[LayerCosts, dict[str, float]]:
    """``costs`` rescaled to the compute spans the engine itself measured during the run.

    ``spans`` are (action text, seconds) of the run's compute stream (FWD, HEAD and BWD
    actions as the plan writes them, "H0.1@0" and "B2.3@1" by backward stage; any iterations). Isolated layer timing (``layer_costs``) runs at another moment,
    without the run's host threads competing for the same cores, so on a shared machine it
    misjudges the level of compute; the run's own spans do not. Three factors keep the isolated
    per-layer shape and take the level from the run: ``k_f`` scales forward (and recompute)
    time so the forward slots' mean spans match; ``k_b`` scales backward time so the backward
    slots' spans match given the scaled recompute; ``k_h`` scales the LM head so the HEAD slot
    matches given its scaled blocks. What remains between prediction and measurement is the
    schedule, the link and the host overheads: the part of the model a projection relies on.
    Returns the rescaled costs and the factors.
    """
    from rp_engine.plan.actions import Op, parse_action

    stages = costs.stages(fwd_cuts, bwd_cuts)
    num_fwd = len(fwd_cuts)
    per_slot: dict[int, list[float]] = {}
    for text, seconds in spans:
        a = parse_action(text)
        if a.op not in (Op.FWD, Op.HEAD, Op.BWD):
            continue
        # the runtime writes the plan's actions: HEAD / BWD carry the backward stage, not a slot
        slot = a.stage if a.op is Op.FWD else num_fwd + a.stage
        if slot < len(stages.pre_ms):  # a slot this cut lacks ran under an earlier plan
            per_slot.setdefault(slot, []).append(seconds * 1e3)
    measured = {slot: statistics.fmean(v) for slot, v in per_slot.items()}
    fwd_slots = [s for s in measured if s < num_fwd and stages.busy_ms(s) > 0]
    bwd_slots = [s for s in measured if s > num_fwd]

    def ratio(num: float, den: float) -> float:
        return max(num, 0.0) / den if den > 0 else 1.0

    k_f = ratio(sum(measured[s] for s in fwd_slots), sum(stages.busy_ms(s) for s in fwd_slots))
    pre = sum(stages.pre_ms[s] for s in bwd_slots)
    post = sum(stages.post_ms[s] for s in bwd_slots)
    k_b = ratio(sum(measured[s] for s in bwd_slots) - k_f * pre, post) if bwd_slots else k_f
    head_layers = range(costs.num_layers - bwd_cuts[0], costs.num_layers)
    blocks = sum(k_f * costs.fwd_ms[i] + k_b * costs.bwd_ms[i] for i in head_layers)
    head = costs.head_fwd_ms + costs.head_bwd_ms
    k_h = ratio(measured[num_fwd] - blocks, head) if num_fwd in measured else k_f
    scaled = dataclasses.replace(
        costs,
        fwd_ms=tuple(k_f * v for v in costs.fwd_ms),
        recompute_ms=tuple(k_f * v for v in costs.recompute_ms),
        bwd_ms=tuple(k_b * v for v in costs.bwd_ms),
        head_fwd_ms=k_h * costs.head_fwd_ms,
        head_bwd_ms=k_h * costs.head_bwd_ms,
    )
    return scaled, {"k_f": k_f, "k_b": k_b, "k_h": k_h}


def cpu_machine(
    num_devices: int,
    pcie_gbps: float | None,
    adam_rate: float,
    overhead_ms: float = 0.0,
    host_share: tuple[float, ...] = (),
) -> Machine:
    """CPU virtual devices: each direction of each device one emulated link, no shared host
    link (the emulation has none), fp32 weights (4 B/param), ``overhead_ms`` per action, taken
    in turn on one host lane (one Python process: its threads' Python work is serial), and the
    devices' compute, the optimizer and that overhead all on this machine's cores, of which
    other processes leave ``host_share`` (``host_load.CoreShare``; empty: all of them)."""
    gbps = pcie_gbps or NO_LINK_GBPS
    return Machine(
        name=f"{num_devices} CPU virtual devices, emulated link {pcie_gbps or 'none'} GB/s",
        num_devices=num_devices,
        h2d_gbps=gbps,
        d2h_gbps=gbps,
        host_link_gbps=None,
        cpu_adam_params_per_s=adam_rate,
        bytes_per_param=4.0,
        action_overhead_ms=overhead_ms,
        serial_overhead=True,  # the devices' worker threads share one interpreter lock
        host_cores=float(os.cpu_count() or 1),  # devices, optimizer and overhead share them
        host_share=tuple(host_share),
    )


def predict_ms(
    costs: LayerCosts,
    machine: Machine,
    *,
    schedule: str,
    fwd_cuts: Sequence[int],
    bwd_cuts: Sequence[int],
    num_microbatches: int,
    round_size: int,
    async_optimizer: bool,
    iterations: int = 4,
    global_norm: bool = False,
) -> dict[str, Any]:
    """The simulator's steady-state iteration (ms) for the engine's plan on ``machine``;
    ``global_norm``: the run clips by the global norm, so no layer steps before every gradient
    of its iteration is in (``simulate``)."""
    kwargs: dict[str, Any] = {
        "fwd_cuts": tuple(fwd_cuts),
        "num_devices": machine.num_devices,
        "num_microbatches": num_microbatches,
    }
    if schedule == "mobius":
        kwargs["bwd_cuts"] = tuple(bwd_cuts)
    else:
        kwargs.update(bwd_cuts=tuple(bwd_cuts), round_size=round_size)
    plan = schedules.build(schedule, num_iterations=iterations, **kwargs)
    result = simulate(
        plan,
        costs,
        machine=machine,
        optimizer="async" if async_optimizer else "sync",
        global_norm=global_norm,
    )
    return {
        "iteration_ms": result.iteration_ms,
        "bubble_ratio": result.bubble_ratio,
        "compute_ms_per_iteration": result.busy_ms,
        "bytes_moved_per_iteration": {k: v / iterations for k, v in result.bytes_moved.items()},
        "result": result,
    }


def solve_overhead(
    costs: LayerCosts, machine: Machine, measured_ms: float, *, tol_ms: float = 0.01, **plan: Any
) -> dict[str, float]:
    """The per-action overhead (ms) at which ``predict_ms(costs, machine, **plan)`` equals
    ``measured_ms`` (see the module docstring: ``costs`` and ``measured_ms`` come from the
    near-zero-compute run on the same plan). 0 when the simulator already reaches the measured
    time without any. Returns the overhead, the simulated iteration without it and the measured
    time."""

    def at(h: float) -> float:
        return float(
            predict_ms(costs, dataclasses.replace(machine, action_overhead_ms=h), **plan)[
                "iteration_ms"
            ]
        )

    base = at(0.0)
    lo, hi = 0.0, max(measured_ms, 1e-3)
    if base >= measured_ms:
        hi = 0.0
    while at(hi) < measured_ms:  # the simulator's iteration need not grow 1:1 with h
        lo, hi = hi, 2 * hi
    while hi - lo > tol_ms / 10:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at(mid) < measured_ms else (lo, mid)
    return {"overhead_ms": hi, "simulated_no_overhead_ms": base, "measured_ms": measured_ms}


def default_threads(num_devices: int) -> int:
    """Intra-op threads one CPU virtual device runs with (the pool's split)."""
    return max(1, (os.cpu_count() or 1) // num_devices)


# ---- the second calibration point: Qwen3-1.7B on one H200 (gpu_measurements.md) ---------------
H200: dict[str, Any] = {  # shared/reference/gpu_measurements.md, 2026-11-30 (CUDA events, medians)
    "layer_fwd_ms": 1.68, "layer_bwd_ms": 3.05, "head_fwd_bwd_ms": 19.1, "pcie_gbps": 55.0,
    "layers": 28, "layer_bytes": 96e6, "hidden": 2048, "vocab": 151936, "mbs": 4, "seq": 1024,
    "gas": 4, "clipping": 1.0,  # gradient_clipping of every measured run
    # measured tokens/s of whole runs, same page
    "measured": {"torch": 22755, "deepspeed": 4984, "roundpipe_landed_sync": 2826,
                 "roundpipe_landed_async": 2381},
}  # fmt: skip


def gpu_point() -> list[dict[str, Any]]:
    """Predicted vs measured on the H200 (one device, GAS 4, 24 GB budget). The runs clipped
    at 1.0, so rp_engine's plans are simulated with clipping's step barrier (``global_norm``);
    DeepSpeed's closed form already steps after every gradient."""
    g = H200
    n_layers, tokens = g["layers"], g["gas"] * g["mbs"] * g["seq"]
    costs = LayerCosts(
        fwd_ms=(g["layer_fwd_ms"],) * n_layers,
        bwd_ms=(g["layer_bwd_ms"],) * n_layers,
        param_bytes=(int(g["layer_bytes"]),) * n_layers,
        head_fwd_ms=g["head_fwd_bwd_ms"] / 3,
        head_bwd_ms=2 * g["head_fwd_bwd_ms"] / 3,
        head_param_bytes=g["vocab"] * g["hidden"] * 2,
        boundary_bytes=g["mbs"] * g["seq"] * g["hidden"] * 2,
    )
    machine = Machine(
        name="1x H200, PCIe 5.0 55 GB/s", num_devices=1, h2d_gbps=g["pcie_gbps"],
        d2h_gbps=g["pcie_gbps"], memory_bytes=24 * 2**30,
    )  # fmt: skip
    rows = []
    from rp_engine.plan.partition import partition

    for label, async_opt, round_size in (
        ("roundpipe_landed_async", True, 1),  # the measured runs predate rounds: M_R = 1
        ("roundpipe_landed_sync", False, 1),
    ):
        part = partition(costs, num_devices=1, num_microbatches=g["gas"],
                         memory_budget_bytes=machine.memory_bytes, async_optimizer=async_opt)  # fmt: skip
        for rs in (round_size, g["gas"]):
            pred = predict_ms(
                costs, machine, schedule="roundpipe", fwd_cuts=part.fwd_cuts,
                bwd_cuts=part.bwd_cuts, num_microbatches=g["gas"], round_size=rs,
                async_optimizer=async_opt, global_norm=g["clipping"] > 0,
            )  # fmt: skip
            rows.append(_row(f"{label} (simulated M_R={rs})", pred["iteration_ms"], tokens,
                             g["measured"][label]))  # fmt: skip
    # plain PyTorch, no recomputation: forward + backward of every layer and the head
    torch_ms = g["gas"] * (
        n_layers * (g["layer_fwd_ms"] + g["layer_bwd_ms"]) + g["head_fwd_bwd_ms"]
    )
    rows.append(_row("torch (compute sum, no recompute)", torch_ms, tokens, g["measured"]["torch"]))
    # ZeRO-Infinity: the projection's closed form, on this machine and per-layer costs
    shape = SHAPES["qwen3-1.7b"]
    zero = _zero_h200(shape, costs, machine)
    rows.append(_row("deepspeed (projection's ZeRO-Infinity model)", zero, tokens,
                     g["measured"]["deepspeed"]))  # fmt: skip
    _ = zero_infinity_tps  # the same formula, checked by test_projection
    return rows


def _zero_h200(shape: Any, costs: LayerCosts, machine: Machine) -> float:
    rate = machine.h2d_gbps * 1e6
    f, b, p = costs.fwd_ms[0], costs.bwd_ms[0], costs.param_bytes[0]
    per_mb = shape.layers * (max(f, p / rate) + max(f + b, p / rate))
    head = costs.head_fwd_ms + costs.head_bwd_ms
    adam = shape.trainable_params / machine.cpu_adam_params_per_s * 1e3
    return H200["gas"] * (per_mb + head) + adam


def _row(label: str, pred_ms: float, tokens: int, measured_tps: float) -> dict[str, Any]:
    meas_ms = tokens / measured_tps * 1e3
    return {"run": label, "predicted_ms": pred_ms, "measured_ms": meas_ms,
            "error": (pred_ms - meas_ms) / meas_ms}  # fmt: skip


def main() -> int:
    print("| run (Qwen3-1.7B, 1x H200, GAS 4) | predicted ms/step | measured ms/step | error |")
    print("|---|---:|---:|---:|")
    for r in gpu_point():
        print(f"| {r['run']} | {r['predicted_ms']:,.0f} | {r['measured_ms']:,.0f} | "
              f"{100 * r['error']:+.0f} % |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
