"""Projection: RoundPipe, Mobius and ZeRO-Infinity on 8x RTX 4090 and 8x A800, by the plan simulator.

    python -m benchmarks.projection [--json out.json] [--microbatches 16]

For Qwen3-1.7B, Llama-3.1-8B, Qwen3-32B and Qwen3-235B-A22B (LoRA) shapes (public configs), with
micro-batches of 4 sequences x 2,048 tokens (the published per-layer measurement) and 16
micro-batches per iteration:

- Per-layer costs. One rate, from the published Qwen3-1.7B layer on an RTX 4090 (forward
  7.43 ms, backward 15.83 ms, LM head 22.07 / 43.71 ms; shared/reference/
  schedules_and_baselines.md): forward FLOPs (2 x tokens x active params + 4 b s^2 h attention)
  divided by 7.43 ms gives the 4090's effective rate; every other layer's forward is its FLOPs at
  that rate, backward keeps the measured 15.83 / 7.43 ratio (LoRA: half of it, no weight
  gradients), the head scales with vocabulary x hidden. The A800 preset scales compute by its
  ``compute_scale``.
- RoundPipe async / sync: the partitioner (24 GB / 80 GB budget) then the simulator on the machine
  preset (links, shared host link, CPU Adam), 4 back-to-back iterations (async) or 2 (sync),
  rounds of M_R = N micro-batches (the paper's convention; the engine's default M_R = GAS
  is in RESULTS.md, where it exposed an async-vs-sync anomaly of the simulator).
- Mobius: ``schedules.mobius`` with K = v x N blocks, the smallest v whose memory (below, at
  this micro-batch) fits a GPU, cross mapping from the preset, the same simulator; OOM when even
  one-layer blocks do not fit.
- ZeRO-Infinity: a closed-form model, since it is data parallel, not a plan: each of the N ranks
  runs every layer on its 16/N micro-batches; per layer and micro-batch it fetches the whole
  layer (bf16) over its PCIe link before the forward and again before the backward (the
  all-gather goes through host memory: no P2P) and offloads its gradient after the backward;
  each transfer overlaps the neighbouring layer's compute perfectly (prefetch), so a layer costs
  max(compute, transfer), with the N links sharing the host link; then CPU Adam over all
  trainable parameters, synchronously. This is an optimistic bound for ZeRO-Infinity.
- Longest sequence (micro-batch of one sequence) from a memory model per GPU (24 GB on the 4090,
  80 GB on the A800), bf16: activation checkpoints of s x h x 2 bytes per layer boundary, the
  working set of one layer s x (18 h + 4 I_active) bytes (flash attention, no s^2 term), the LM
  head: RoundPipe computes it in 1,024-token chunks (fp32 logits and gradient of one chunk),
  DeepSpeed and Mobius run the HF head unchunked (bf16 logits + fp32 upcast + fp32 gradient:
  10 bytes x vocabulary per token); weights: RoundPipe one 1-layer backward stage double
  buffered plus its gradient, Mobius its block double buffered plus gradients, ZeRO two gathered
  layers plus 1 GB of reduce bucket; ZeRO keeps all L checkpoints of its micro-batch, Mobius the
  checkpoints of its block for its N in-flight micro-batches, RoundPipe those of one stage (the
  rest live on the host). 1.5 GB per GPU for the CUDA context and allocator slack.
- Gradient clipping (``CLIPPING`` = 1.0: DeepSpeed's default ``gradient_clipping`` since 0.19.3
  and the configuration measured on the H200, gpu_measurements.md). Clipping needs the global
  norm, so rp_engine's optimizer (optim/stepper.py) steps no layer before every gradient of the
  step is in, and the next iteration's uploads wait for those steps: the RoundPipe and Mobius
  rows are simulated with ``simulate(global_norm=True)``. rp_engine's default
  ``on_nonfinite: "raise"`` guards the same norm, so it holds this barrier even without
  clipping. ZeRO-Infinity's closed form already runs its CPU Adam after every gradient.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from benchmarks.calibration import gpu_point
from benchmarks.shapes import (
    MBS,
    SEQ,
    SHAPES,
    Shape,
    layer_costs,
    zero_infinity_tps,
)
from rp_engine.plan import schedules
from rp_engine.plan.partition import partition
from rp_engine.plan.shapes import max_seq, mem_bytes
from rp_engine.plan.simulate import Machine, load_machine, simulate

PRESETS = ("rtx4090_pcie4_8x", "a800_nvlink_8x")
CLIPPING = 1.0  # gradient_clipping of the modelled runs (module docstring)
GLOBAL_NORM = CLIPPING > 0  # the optimizer steps wait for every gradient of their step

# published tokens/s on 8x RTX 4090 (schedules_and_baselines.md); None = OOM
PUBLISHED_4090: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": {"roundpipe": 65417, "mobius": 39370, "zero_infinity": 7035,
                   "max_seq": {"roundpipe": "73K", "baselines": "9K"}},
    "llama3.1-8b": {"roundpipe": 24275, "mobius": 11288, "zero_infinity": 1843,
                    "max_seq": {"roundpipe": "49K", "baselines": "9K"}},
    "qwen3-32b": {"roundpipe": 5516, "mobius": 2552, "zero_infinity": 218,
                  "max_seq": {"roundpipe": "28K", "baselines": "6K"}},
    "qwen3-235b-lora": {"roundpipe": 1820, "mobius": None, "zero_infinity": None,
                        "max_seq": {"roundpipe": "31K", "baselines": "OOM"}},
}  # fmt: skip


def _adam_machine(shape: Shape, machine: Machine) -> Machine:
    """The machine the simulator runs: compute_scale 1, since ``layer_costs`` already gives
    this machine's times (the simulator would scale them again: until 2026-12-03 the A800 rows
    ran at 0.53^2 of the 4090's compute times); with LoRA only the adapters step, so the CPU
    Adam rate is scaled by (all parameters / trainable)."""
    machine = dataclasses.replace(machine, compute_scale=1.0)
    if not shape.lora:
        return machine
    total = shape.layers * shape.layer_params + 2 * shape.head_params
    return dataclasses.replace(
        machine,
        cpu_adam_params_per_s=machine.cpu_adam_params_per_s * total / shape.trainable_params,
    )


def roundpipe_tps(
    shape: Shape, machine: Machine, m: int, *, async_opt: bool, global_norm: bool = GLOBAL_NORM
) -> dict[str, Any]:
    costs = layer_costs(shape, machine)
    n = machine.num_devices
    part = partition(
        costs, num_devices=n, num_microbatches=m, memory_budget_bytes=machine.memory_bytes,
        async_optimizer=async_opt, round_size=n,  # cuts timed at the rounds the plan runs
    )  # fmt: skip
    iters = 4 if async_opt else 2
    plan = schedules.build(
        "roundpipe", num_iterations=iters, fwd_cuts=part.fwd_cuts, bwd_cuts=part.bwd_cuts,
        num_devices=n, num_microbatches=m, round_size=n,
    )  # fmt: skip
    res = simulate(
        plan, costs, machine=_adam_machine(shape, machine),
        optimizer="async" if async_opt else "sync", global_norm=global_norm,
    )  # fmt: skip
    return {
        "tokens_per_s": m * MBS * SEQ / (res.iteration_ms / 1e3),
        "iteration_ms": res.iteration_ms,
        "bubble": res.bubble_ratio,
        "cuts": [list(part.fwd_cuts), list(part.bwd_cuts)],
    }


def mobius_tps(
    shape: Shape, machine: Machine, m: int, *, global_norm: bool = GLOBAL_NORM
) -> dict[str, Any]:
    costs = layer_costs(shape, machine)
    n = machine.num_devices
    # Mobius uses K = v * N blocks: the fewest whose memory (weights, checkpoints, the
    # unchunked head at this micro-batch) fits one GPU
    tokens = MBS * SEQ
    for v in range(1, shape.layers // n + 2):
        k = min(v * n, shape.layers)
        blocks = [shape.layers // k + (1 if i < shape.layers % k else 0) for i in range(k)]
        need = _mem_bytes("mobius", shape, tokens, n, block=max(blocks))
        if not machine.memory_bytes or need <= machine.memory_bytes:
            break
    else:
        return {"tokens_per_s": None, "why": f"one-layer blocks need {need / 1e9:.0f} GB (OOM)"}
    plan = schedules.build(
        "mobius", num_iterations=2, fwd_cuts=blocks, num_devices=n, num_microbatches=m,
        device_order=machine.device_order,
    )  # fmt: skip
    res = simulate(
        plan, costs, machine=_adam_machine(shape, machine), optimizer="sync",
        global_norm=global_norm,
    )  # fmt: skip
    return {
        "tokens_per_s": m * MBS * SEQ / (res.iteration_ms / 1e3),
        "iteration_ms": res.iteration_ms,
        "bubble": res.bubble_ratio,
        "blocks": len(blocks),
    }


# ---- memory model: longest sequence (rp_engine/plan/shapes.py; the names kept here) -----------
_mem_bytes = mem_bytes


def zero_calibration() -> float:
    """Measured / predicted step time of the ZeRO-Infinity model on the H200 calibration point
    (benchmarks.calibration.gpu_point): the factor the 'calibrated' ZeRO column divides by."""
    row = next(r for r in gpu_point() if r["run"].startswith("deepspeed"))
    return float(row["measured_ms"] / row["predicted_ms"])


def project_model(shape: Shape, machine: Machine, m: int) -> dict[str, Any]:
    """One table row: every system's projection for ``shape`` on ``machine``, ``m``
    micro-batches per iteration, with the modelled runs' clipping (``GLOBAL_NORM``)."""
    return {
        "roundpipe": roundpipe_tps(shape, machine, m, async_opt=True),
        "roundpipe_sync": roundpipe_tps(shape, machine, m, async_opt=False),
        "mobius": mobius_tps(shape, machine, m),
        "zero_infinity": zero_infinity_tps(shape, machine, m),
        "max_seq": {
            s: max_seq(s, shape, machine) for s in ("roundpipe", "mobius", "zero_infinity")
        },
    }


def project(m: int) -> dict[str, Any]:
    out: dict[str, Any] = {"zero_calibration": zero_calibration(), "clipping": CLIPPING}
    for preset in PRESETS:
        machine = load_machine(preset)
        rows = {key: project_model(shape, machine, m) for key, shape in SHAPES.items()}
        out[preset] = {"machine": machine.name, "models": rows}
    return out


def _fmt(x: float | None) -> str:
    return "OOM" if x is None else f"{x:,.0f}"


def _div(x: float | None, by: float) -> float | None:
    return None if x is None else x / by


def _k(x: int | None) -> str:
    return "OOM" if x is None else f"{x // 1024}K"


def format_tables(result: dict[str, Any]) -> str:
    lines = []
    slow = result["zero_calibration"]
    for preset, data in result.items():
        if preset not in PRESETS:  # "zero_calibration", "clipping"
            continue
        pub = preset.startswith("rtx4090")
        note = "; published 8x RTX 4090 figures in brackets" if pub else ""
        lines.append(f"**{data['machine']}** (tokens/s{note})\n")
        lines.append("| model | RoundPipe async | RoundPipe sync | Mobius | ZeRO-Infinity | "
                     f"ZeRO / {slow:.2f} (H200-calibrated) | max seq RP / Mobius / ZeRO |")  # fmt: skip
        lines.append("|---|---:|---:|---:|---:|---:|---|")
        for key, row in data["models"].items():
            p = PUBLISHED_4090[key] if pub else {}

            def cell(system: str, row: dict = row, p: dict = p, pub: bool = pub) -> str:
                ours = _fmt(row[system].get("tokens_per_s"))
                if not pub or system not in p:
                    return ours
                return f"{ours} [{_fmt(p[system])}]"

            seq = row["max_seq"]
            seq_text = " / ".join(_k(seq[s]) for s in ("roundpipe", "mobius", "zero_infinity"))
            if pub:
                seq_text += f" [{p['max_seq']['roundpipe']} / {p['max_seq']['baselines']}]"
            lines.append(
                f"| {SHAPES[key].name} | {cell('roundpipe')} | "
                f"{_fmt(row['roundpipe_sync']['tokens_per_s'])} | {cell('mobius')} | "
                f"{cell('zero_infinity')} | {_fmt(_div(row['zero_infinity'].get('tokens_per_s'), slow))}"
                f" | {seq_text} |"
            )
        lines.append("")
    lines.append(
        f"Gradient clipping {result['clipping']}: RoundPipe and Mobius simulated with the "
        "global-norm step barrier (no layer steps before the step's last gradient)."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--json", help="write the projection here")
    args = p.parse_args(argv)
    result = project(args.microbatches)
    print(format_tables(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
