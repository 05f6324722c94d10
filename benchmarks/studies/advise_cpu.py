"""The advisor on CPU virtual devices: its configuration against rp-train's default, run side by
side for the same model and tokens per step.

    python -m benchmarks.studies.advise_cpu [--steps 6] [--repeats 2] [--json out.json]

- Model: the head-to-head's quick model (``cpu-small``: Qwen3 shape, hidden 256, 6 layers, 4 heads,
  vocabulary 1,024, fp32, random weights), sequences of 128 tokens, AdamW lr 1e-4, clipping 1.0,
  2 CPU virtual devices with the emulated link of 0.1 GB/s per direction (``--quick``'s).
- Token budget: rp-train's default configuration (micro-batch 4 x accumulation 4 = 16 sequences,
  2,048 tokens per step); the default lets the planner choose round size and cuts.
- The advisor works on costs measured here, not on its GPU FLOPs model: each layer's forward and
  backward and the LM head for micro-batches of 1-16 sequences (``calibration.layer_costs``,
  with the intra-op threads one device gets), DeepSpeed's CPU Adam rate, and the link of the
  run and the per-action host overhead solved as the head-to-head does (the default's plan run
  with a near-zero-compute model; ``calibration.cpu_machine``, ``solve_overhead``). It
  searches micro-batch x accumulation at the fixed token budget, the round size and the cuts.
- Both configurations train on the engine, alternating (A B A B ...): warm-up steps (the
  default's profile and re-plan included), then ``--steps`` steps timed between two
  synchronisations. Tokens/s is the median over the repeats; next to each, the advisor's
  predicted tokens/s for that configuration (``score_point`` for the default's batch sizes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.calibration import (
    cpu_adam_rate,
    cpu_machine,
    default_threads,
    layer_costs,
    solve_overhead,
)
from benchmarks.calibration_runs import overhead_run
from benchmarks.common import PRESETS, build_model
from rp_engine.plan.advise import advise, format_table, score_point
from rp_engine.plan.shapes import Shape

SEQ, TOKENS, LINK_GBPS, DEVICES = 128, 2048, 0.1, 2
DEFAULT = {"micro_batch": 4, "grad_accum": 4}  # rp-train's --micro-batch / --grad-accum


def _config(mbs: int, gas: int, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95]}},
        "roundpipe": {
            "devices": f"cpu:{DEVICES}", "pcie_gbps": LINK_GBPS, "on_nonfinite": "ignore",
            **extra,
        },
    }  # fmt: skip


def _batches(preset: dict[str, Any], mbs: int, n: int, seed: int) -> list[dict[str, Any]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, preset["vocab_size"], (mbs, SEQ), generator=gen)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def run(preset: dict[str, Any], cfg: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    """Train ``warmup`` + ``steps`` steps; tokens/s over the last ``steps`` (synchronised at
    both ends of the window, not per step)."""
    import rp_engine

    mbs, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    engine, *_ = rp_engine.initialize(model=build_model(preset), config=cfg)
    try:
        data = iter(_batches(preset, mbs, gas * (warmup + steps), seed=1))
        for _ in range(warmup):
            engine.train_batch(data)
        engine.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            loss = engine.train_batch(data)
        engine.synchronize()
        seconds = time.perf_counter() - start
        plan = engine.planner
        return {
            "tokens_per_s": steps * mbs * gas * SEQ / seconds,
            "loss": float(loss),
            "round_size": plan.round_size,
            "fwd_cuts": list(plan.fwd_cuts),
            "bwd_cuts": list(plan.bwd_cuts),
        }
    finally:
        engine.destroy()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first (profile incl.)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)

    preset = PRESETS["cpu-small"]
    model = build_model(preset)
    shape = Shape.from_hf_config(model.config.to_dict())
    threads = default_threads(DEVICES)
    t0 = time.perf_counter()
    measured = {b: layer_costs(model, b, SEQ, threads=threads) for b in (1, 2, 4, 8, 16)}
    n_params = sum(q.numel() for q in model.parameters())
    rate = cpu_adam_rate(n_params)
    # the per-action host overhead (Python issue, copies handed to threads), solved as the
    # head-to-head does: the default's plan run again with a near-zero-compute model
    first = run(preset, _config(DEFAULT["micro_batch"], DEFAULT["grad_accum"], {}),
                args.steps, args.warmup)  # fmt: skip
    plan = {
        "schedule": "roundpipe", "fwd_cuts": first["fwd_cuts"], "bwd_cuts": first["bwd_cuts"],
        "num_microbatches": DEFAULT["grad_accum"], "round_size": first["round_size"],
        "async_optimizer": True, "global_norm": True,
    }  # fmt: skip
    batch = {**preset, "mbs": DEFAULT["micro_batch"], "seq": SEQ, "gas": DEFAULT["grad_accum"]}
    tiny_costs, tiny_rate, tiny_ms, _ = overhead_run(batch, plan, DEVICES)
    overhead = solve_overhead(tiny_costs, cpu_machine(DEVICES, None, tiny_rate), tiny_ms, **plan)[
        "overhead_ms"
    ]
    machine = cpu_machine(DEVICES, LINK_GBPS, rate, overhead)
    measure_s = time.perf_counter() - t0

    def costs(b: int) -> Any:
        if b not in measured:
            measured[b] = layer_costs(model, b, SEQ, threads=threads)
        return measured[b]

    t0 = time.perf_counter()
    table = advise(shape, machine, seq_len=SEQ, tokens_per_step=TOKENS, costs=costs, top=3)
    advise_s = time.perf_counter() - t0
    best = table[0]
    print(format_table(table))
    default_pred = score_point(
        shape, machine, seq_len=SEQ, round_size=DEFAULT["grad_accum"], costs=costs, **DEFAULT
    )
    configs = {
        "rp-train default": (DEFAULT["micro_batch"], DEFAULT["grad_accum"], {}),
        "advisor": (
            best.micro_batch,
            best.grad_accum,
            {"round_size": best.round_size, "fwd_cuts": list(best.fwd_cuts),
             "bwd_cuts": list(best.bwd_cuts)},
        ),
    }  # fmt: skip
    predicted = {
        "rp-train default": getattr(default_pred, "tokens_per_s", None),
        "advisor": best.tokens_per_s,
    }
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in configs}
    runs["rp-train default"].append(first)
    for repeat in range(args.repeats):
        for name, (mbs, gas, extra) in configs.items():
            if repeat == 0 and name == "rp-train default":
                continue  # its first run measured the plan for the overhead
            runs[name].append(run(preset, _config(mbs, gas, extra), args.steps, args.warmup))
            print(name, runs[name][-1])
    rows = []
    base = statistics.median(r["tokens_per_s"] for r in runs["rp-train default"])
    for name, (mbs, gas, _) in configs.items():
        tps = statistics.median(r["tokens_per_s"] for r in runs[name])
        last = runs[name][-1]
        rows.append({
            "config": name, "micro_batch": mbs, "grad_accum": gas,
            "round_size": last["round_size"], "cuts": [last["fwd_cuts"], last["bwd_cuts"]],
            "tokens_per_s": tps, "repeats": [r["tokens_per_s"] for r in runs[name]],
            "vs_default": tps / base, "predicted_tokens_per_s": predicted[name],
        })  # fmt: skip
    print("\n| configuration | micro-batch x accum (round) | cuts | tokens/s | vs default | "
          "predicted tokens/s |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|")
    for r in rows:
        pred = r["predicted_tokens_per_s"]
        print(
            f"| {r['config']} | {r['micro_batch']} x {r['grad_accum']} ({r['round_size']}) | "
            f"{r['cuts'][0]} / {r['cuts'][1]} | {r['tokens_per_s']:,.0f} | "
            f"{r['vs_default']:.2f}x | {'-' if pred is None else f'{pred:,.0f}'} |"
        )
    print(f"\nper-action overhead {overhead:.3f} ms; cost measurement {measure_s:.1f} s "
          f"(one default run included), advisor {advise_s:.1f} s")  # fmt: skip
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "rows": rows,
                    "measure_s": measure_s,
                    "advise_s": advise_s,
                    "action_overhead_ms": overhead,
                },
                indent=1,
            )  # fmt: skip
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
