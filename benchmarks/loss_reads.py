"""What reading the loss costs in DeepSpeed's loop: rp_engine's loop with the loss read at three
places, from the caller's own iterator and from the loader ``initialize`` returns, against
``train_batch`` and DeepSpeed ZeRO-Infinity, side by side in one run.

    python -m benchmarks.loss_reads --quick      # CPU virtual devices, ~15 min on 2 cores

The head-to-head's ``--quick`` model, emulated link (0.1 GB/s), ds_config and data, GAS 4; each
system in its own process, the systems alternating (``--repeats``), one window of steps timed
between two synchronisations (``benchmarks.head_to_head.run_system``). The reads:

- ``after_step``: ``loss.item()`` after every ``engine.step()`` (a script logging each loss);
- ``before_backward``: ``loss.item()`` before every ``engine.backward(loss)``;
- ``every_10th``: ``loss.item()`` every 10th micro-step;
- ``none``: no read before the window's end (the loop's fast path).

``loop_<read>`` takes the micro-batches from its own iterator, ``loader_<read>`` from the loader
``initialize(training_data=)`` returns (the same batches, in the same order). Every rp_engine
system is asynchronous; their per-step losses must agree with one another (the same arithmetic,
grouped differently: ``LOSS_RTOL``). Reported: tokens/s (median over repeats), the ratio to
``train_batch`` and to DeepSpeed, and the targets: every loader pattern >= 0.85x ``train_batch``,
every own-iterator pattern >= 2x DeepSpeed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import PRESETS, chosen_systems, machine_info
from benchmarks.head_to_head import (
    READS,
    SETUP,
    aggregate,
    roundpipe_setup,
    run_child,
    run_system,
)

LOOP_READS = ("none", *READS)
SETUPS: dict[str, Any] = {
    "deepspeed": SETUP["deepspeed"],
    "train_batch": SETUP["roundpipe"],
    **{
        f"{source}_{read}": roundpipe_setup(
            True, "roundpipe", loop=True, read=None if read == "none" else read,
            engine_loader=source == "loader",
        )
        for source in ("loop", "loader")
        for read in LOOP_READS
    },
}  # fmt: skip
SYSTEMS = tuple(SETUPS)
LOSS_RTOL = 1e-5  # rp_engine's loops among themselves: fp32, the same steps
TARGET_LOADER = 0.85  # x train_batch, every read pattern with the engine's loader
TARGET_OWN = 2.0  # x DeepSpeed, every read pattern with the caller's iterator


def summarize(systems: dict[str, Any]) -> dict[str, Any]:
    """Ratios to train_batch and DeepSpeed, the targets, and the loops' loss agreement."""
    tps = {k: v["tokens_per_s"] for k, v in systems.items() if "tokens_per_s" in v}
    base, ds = tps.get("train_batch"), tps.get("deepspeed")
    ratios = {
        k: {"vs_train_batch": v / base if base else None, "vs_deepspeed": v / ds if ds else None}
        for k, v in tps.items()
    }
    targets = {}
    for read in READS:
        loader, own = ratios.get(f"loader_{read}", {}), ratios.get(f"loop_{read}", {})
        if loader.get("vs_train_batch") is not None:
            targets[f"loader_{read}"] = loader["vs_train_batch"] >= TARGET_LOADER
        if own.get("vs_deepspeed") is not None:
            targets[f"loop_{read}"] = own["vs_deepspeed"] >= TARGET_OWN
    ref = systems.get("train_batch", {}).get("step_losses")
    agreement: dict[str, float] = {}
    for name, s in systems.items():
        if name.startswith(("loop_", "loader_")) and ref and s.get("step_losses"):
            rel = [
                abs(a - b) / max(abs(b), 1e-12) for a, b in zip(s["step_losses"], ref, strict=True)
            ]
            agreement[name] = max(rel)
    ok = all(v <= LOSS_RTOL for v in agreement.values())
    return {"ratios": ratios, "targets": targets, "loss_agreement": agreement, "losses_ok": ok}


def format_table(systems: dict[str, Any], summary: dict[str, Any]) -> str:
    lines = [
        "| system | loader | loss read | tokens/s | vs train_batch | vs DeepSpeed | "
        "losses vs train_batch (max rel) | target |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for name in SYSTEMS:
        s = systems.get(name)
        if s is None:
            continue
        if "tokens_per_s" not in s:
            lines.append(f"| {name} | failed: {s.get('error') or s.get('skipped')} |")
            continue
        source, _, read = name.partition("_")
        loader = {"loop": "own iterator", "loader": "initialize's"}.get(source, "")
        read = read if loader else ""
        r = summary["ratios"][name]
        tb, ds = r["vs_train_batch"], r["vs_deepspeed"]
        rel = summary["loss_agreement"].get(name)
        hit = summary["targets"].get(name)
        goal = (
            "" if hit is None
            else f"{'>= 0.85x train_batch' if source == 'loader' else '>= 2x DeepSpeed'}: "
            f"{'met' if hit else 'MISSED'}"
        )  # fmt: skip
        lines.append(
            f"| {name} | {loader} | {read} | {s['tokens_per_s']:,.0f} | "
            f"{'' if tb is None else f'{tb:.2f}'} | {'' if ds is None else f'{ds:.2f}x'} | "
            f"{'' if rel is None else f'{rel:.1e}'} | {goal} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the CPU configuration (cpu-small)")
    p.add_argument("--model", choices=sorted(PRESETS))
    p.add_argument("--devices", help="rp_engine devices (default: cuda, else cpu:2)")
    p.add_argument("--pcie-gbps", type=float, help="emulated link, CPU only (--quick: 0.1)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--gas", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--timeout", type=float, help="seconds per system's process")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--child-log", help="append every system process's stderr here")
    p.add_argument("--system", help=argparse.SUPPRESS)  # the child process's one system
    p.add_argument("--no-calibrate", action="store_true", help=argparse.SUPPRESS)  # (children)
    args = p.parse_args(argv)
    args.model = args.model or ("cpu-small" if args.quick else "qwen3-1.7b")
    if args.quick and args.pcie_gbps is None:
        args.pcie_gbps = 0.1  # the head-to-head's --quick link
    args.calibrate, args.cuts = False, None
    preset = {**PRESETS[args.model], "gas": args.gas}
    if args.system:
        row = run_system(args.system, preset, args, setups=SETUPS)
        row.pop("timeline", None)
        print("JSON:" + json.dumps(row), flush=True)
        return 0
    names = chosen_systems(p, args.systems, SYSTEMS)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in names}
    for rep in range(args.repeats):  # alternate: drift hits every system alike
        for system in names:
            row = run_child(system, args, module="benchmarks.loss_reads")
            runs[system].append(row)
            brief = {k: row[k] for k in ("tokens_per_s", "error") if k in row}
            print(f"[{rep + 1}/{args.repeats}] {system}: {json.dumps(brief)}", file=sys.stderr)
    systems = aggregate(runs)
    summary = summarize(systems)
    print(format_table(systems, summary))
    print(json.dumps({"targets": summary["targets"], "losses_ok": summary["losses_ok"]}))
    if args.json:
        out = {"model": args.model, "gas": args.gas, "pcie_gbps": args.pcie_gbps,
               "machine": machine_info(), "systems": systems, **summary}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=1))
    failed = any("tokens_per_s" not in s for s in systems.values())
    return 1 if failed or not summary["losses_ok"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
