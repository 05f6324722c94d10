"""The longest sequence rp_engine trains within a device-memory budget (micro-batch 1).

    python -m benchmarks.longest_seq --model qwen3-1.7b --budget-gib 24          # a GPU
    python -m benchmarks.longest_seq --model tiny --devices cpu:2 --budget-gib 0.03 \
        --start 1024 --min 512 --max 4096 --step 1024                           # CPU, seconds

Search: from ``--start`` double while a probe trains (up to ``--max``), or halve while it fails
(down to ``--min``); then bisect between the longest length that trained and the shortest that
failed until they are ``--step`` apart. Every probe is its own process (a failed probe leaves no
allocator or thread state behind for the next): it builds the model (random weights, the
head-to-head presets), initialises rp_engine with ``device_memory_gb`` = the budget, micro-batch
1, one micro-batch per step, the async optimizer, and trains ``--steps`` steps. A probe
succeeds when every step completes with a finite loss and the peak device memory is within the
budget: on CUDA the process is capped with ``torch.cuda.set_per_process_memory_fraction`` so
that the allocator plus what was resident at the start (the CUDA context) stay within the
budget, emulating a card of that size, and an overrun raises out of memory; on CPU virtual
devices rp_engine's pool enforces its capacity. The peak is ``torch.cuda.max_memory_allocated``
(CUDA) or the pool's peak (CPU).

Reported beside the measured length: the advisor's prediction (``rp_engine.plan.shapes.max_seq``
for "roundpipe", the figure ``advise`` reports as ``max_seq_len``: the memory model's longest
single sequence, in 1K steps) and RoundPipe's published figures (README: Qwen3-1.7B 73K, and
49K for Llama3.1-8B, on one 24 GB RTX 4090). Each probe's JSON line is appended to ``--jsonl``
as it ends, the summary line last, so a run cut short keeps its probes. ``--time-budget``
bounds the whole search: no probe starts with less than ``--min-probe-s`` left, and each is
killed at what remains.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.cuda_budget import GIB, cap_cuda_memory

__all__ = [
    "PUBLISHED",
    "advisor_prediction",
    "run_probe",
    "search",
    "main",
]

# RoundPipe README, "Maximum Input Sequence Length", one RTX 4090 (24 GB)
PUBLISHED: dict[str, dict[str, str]] = {
    "qwen3-1.7b": {"tokens": "73K", "source": "RoundPipe README: Qwen3-1.7B, one RTX 4090"},
    "qwen3-8b": {
        "tokens": "49K",
        "source": "RoundPipe README: Llama3.1-8B (no Qwen3-8B figure), one RTX 4090",
    },
}


def probe_preset(model: str, seq: int, budget_gib: float, layers: int | None) -> dict[str, Any]:
    """The head-to-head preset ``model`` at micro-batch 1 x ``seq`` tokens, one micro-batch per
    step, ``device_memory_gb`` = the budget, optionally ``layers`` decoder layers."""
    from benchmarks.common import PRESETS

    preset = dict(PRESETS[model])
    preset.update(mbs=1, seq=seq, gas=1, device_memory_gb=budget_gib)
    # RoPE tables are built for the positions asked; the config's limit only has to allow them
    preset["max_position_embeddings"] = max(seq, 40960)
    if layers:
        preset["num_hidden_layers"] = layers
    return preset


def run_probe(
    seq: int, *, model: str, budget_gib: float, devices: str, steps: int, layers: int | None
) -> dict[str, Any]:
    """One probe, in this process: train ``steps`` steps of micro-batch 1 x ``seq`` with
    rp_engine under the budget. Returns ``{"seq", "ok", "reason", "losses", "peak_gb", ...}``;
    ``ok`` False (with the exception as ``reason``) when anything raised, a loss was not
    finite or the peak exceeded the budget. Never raises for a failed training. The engine is
    left to the process's end (a failed one's threads may be stuck behind the failure; each
    probe is its own process, which ends right after)."""
    import torch

    from benchmarks.common import batches, build_model, ds_config

    cuda = devices.startswith("cuda")
    budget = int(budget_gib * GIB)
    row: dict[str, Any] = {"seq": seq, "ok": False, "reason": None, "losses": [],
                           "peak_gb": None, "budget_gib": budget_gib, "devices": devices}  # fmt: skip
    start = time.perf_counter()
    try:
        if cuda:
            row["cap"] = cap_cuda_memory(budget_gib)
        import rp_engine

        preset = probe_preset(model, seq, budget_gib, layers)
        cfg = ds_config(preset, devices=devices, pcie_gbps=None)
        cfg["roundpipe"]["async_optimizer"] = True
        engine, _, _, _ = rp_engine.initialize(model=build_model(preset), config=cfg)
        row["setup_s"] = time.perf_counter() - start
        it = iter(batches(preset, steps))
        for _ in range(steps):
            row["losses"].append(float(engine.train_batch(it)))  # float(): the step's end
        engine.synchronize()
        if cuda:
            peak = torch.cuda.max_memory_allocated()
            row["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
        else:
            peak = max(d.memory_stats().get("peak", 0) for d in engine.pool.devices)
        row["peak_gb"] = peak / 1e9
        finite = all(math.isfinite(x) for x in row["losses"])
        row["ok"] = finite and peak <= budget
        if not row["ok"]:
            row["reason"] = "non-finite loss" if not finite else "peak over the budget"
    except Exception as exc:  # out of memory, the planner's refusal: a failed probe
        text = str(exc).strip().splitlines()
        row["reason"] = f"{type(exc).__name__}: {text[0][:300] if text else ''}"
    row["seconds"] = time.perf_counter() - start
    return row


def search(
    probe: Callable[[int], dict[str, Any]],
    *,
    start: int,
    minimum: int,
    maximum: int,
    step: int,
    time_left: Callable[[], float] = lambda: math.inf,
    min_probe_s: float = 0.0,
) -> dict[str, Any]:
    """Doubling (or halving) from ``start`` within [``minimum``, ``maximum``], then bisection
    in multiples of ``step`` until the longest length that trained (``longest_ok``) and the
    shortest that failed (``first_fail``) are ``step`` apart. ``probe(seq)`` returns a dict
    with ``ok``. No probe starts once ``time_left()`` is under ``min_probe_s`` (``stopped``
    says so). ``capped``: every length up to ``maximum`` trained (the answer is at least it)."""
    probes: list[dict[str, Any]] = []
    lo: int | None = None
    hi: int | None = None
    stopped: str | None = None

    def run(seq: int) -> bool | None:
        nonlocal stopped
        if time_left() < min_probe_s:
            stopped = f"time budget: {max(0.0, time_left()):.0f} s left before the {seq} probe"
            return None
        got = probe(seq)
        probes.append(got)
        return bool(got.get("ok"))

    seq = start
    ok = run(seq)
    if ok:  # up: double while it trains
        lo = seq
        while ok and seq * 2 <= maximum:
            seq *= 2
            ok = run(seq)
            if ok:
                lo = seq
            elif ok is False:
                hi = seq
    elif ok is False:  # down: halve while it fails
        hi = seq
        while ok is False and seq // 2 >= minimum:
            seq //= 2
            ok = run(seq)
            if ok:
                lo = seq
            elif ok is False:
                hi = seq
    while stopped is None and lo is not None and hi is not None and hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        mid = max(mid, lo + step)
        if mid >= hi:
            break
        ok = run(mid)
        if ok:
            lo = mid
        elif ok is False:
            hi = mid
    return {
        "longest_ok": lo,
        "first_fail": hi,
        "capped": lo is not None and hi is None and stopped is None,
        "stopped": stopped,
        "probes": probes,
    }


def advisor_prediction(preset: dict[str, Any], budget_gib: float) -> int | None:
    """The advisor's longest single sequence for ``preset``'s shape on one device of
    ``budget_gib``: ``shapes.max_seq("roundpipe", ...)``, as ``advise`` reports it
    (``Advice.max_seq_len``; its memory model is bf16's, flash attention, 1K steps)."""
    from rp_engine.plan.shapes import Shape, max_seq
    from rp_engine.plan.simulate import Machine

    shape = Shape.from_hf_config(preset, name="probe")
    machine = Machine("budget", num_devices=1, memory_bytes=int(budget_gib * GIB))
    return max_seq("roundpipe", shape, machine)


def _child_probe(seq: int, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """One probe in its own process; a crash or timeout is a failed probe with the reason."""
    from benchmarks.common import child_json

    cmd = [sys.executable, "-m", "benchmarks.longest_seq", "--probe", str(seq)]
    cmd += ["--model", args.model, "--budget-gib", str(args.budget_gib)]
    cmd += ["--devices", args.devices, "--steps", str(args.steps)]
    if args.layers:
        cmd += ["--layers", str(args.layers)]
    row = child_json(cmd, f"longest_seq {seq}", timeout=timeout, child_log=args.child_log)
    if "error" in row:  # the process failed or was killed: no verdict of its own
        row = {"seq": seq, "ok": False, "reason": " / ".join(row["error"])[-400:]}
    return row


def _tokens(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024:g}K"


def format_table(result: dict[str, Any]) -> str:
    """The summary as a one-row Markdown table."""
    fail = _tokens(result["first_fail"])
    why = next((p.get("reason") for p in result["probes"] if p["seq"] == result["first_fail"]), "")
    if why:
        fail += f" ({why[:120]})"
    longest = _tokens(result["longest_ok"]) + (
        " (capped: the search's maximum)" if result["capped"] else ""
    )
    if result.get("stopped"):
        longest += f" (search stopped: {result['stopped']})"
    published = result["published"]
    layers = f" ({result['layers']} layers)" if result["layers"] else ""
    return (
        "| model | budget | longest that trained | shortest that failed | advisor | published |\n"
        "|---|---:|---:|---|---:|---:|\n"
        f"| {result['model']}{layers} | "
        f"{result['budget_gib']:g} GiB | {longest} | {fail} | "
        f"{_tokens(result['advisor_prediction'])} | "
        f"{published['tokens'] if published else '-'} |\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--model", default="qwen3-1.7b", help="a preset of benchmarks/common.py")
    p.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    p.add_argument("--budget-gib", type=float, default=24.0, help="device memory budget, GiB")
    p.add_argument("--devices", default="cuda", help="rp_engine devices: cuda or cpu:N")
    p.add_argument("--start", type=int, default=65536, help="first length probed")
    p.add_argument("--min", type=int, default=4096, dest="minimum")
    p.add_argument("--max", type=int, default=131072, dest="maximum")
    p.add_argument("--step", type=int, default=8192, help="bisection granularity (tokens)")
    p.add_argument("--steps", type=int, default=2, help="training steps per probe")
    p.add_argument("--time-budget", type=float, default=600.0, help="seconds for the search")
    p.add_argument("--probe-timeout", type=float, default=300.0, help="seconds per probe")
    p.add_argument("--min-probe-s", type=float, default=30.0, help="no probe starts with less")
    p.add_argument("--jsonl", help="append each probe's line and the summary line here")
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--child-log", help="append every probe process's stderr here")
    p.add_argument("--probe", type=int, help=argparse.SUPPRESS)  # the child's one length
    args = p.parse_args(argv)
    if args.probe:
        row = run_probe(args.probe, model=args.model, budget_gib=args.budget_gib,
                        devices=args.devices, steps=args.steps, layers=args.layers)  # fmt: skip
        print("JSON:" + json.dumps(row), flush=True)
        sys.stderr.flush()
        # the verdict is out: end without waiting on a failed engine's threads (exit handlers
        # that join them could hang until the parent's timeout)
        os._exit(0)

    began = time.monotonic()
    deadline = began + args.time_budget

    def time_left() -> float:
        return deadline - time.monotonic()

    def probe(seq: int) -> dict[str, Any]:
        row = _child_probe(seq, args, timeout=min(args.probe_timeout, max(1.0, time_left())))
        print(f"longest_seq: {seq} tokens: {'ok' if row['ok'] else 'failed'} "
              f"peak {row.get('peak_gb')} GB {row.get('reason') or ''}", file=sys.stderr)  # fmt: skip
        if args.jsonl:
            _append(args.jsonl, {"leg": "longest_seq_probe", "model": args.model, **row})
        return row

    found = search(probe, start=args.start, minimum=args.minimum, maximum=args.maximum,
                   step=args.step, time_left=time_left, min_probe_s=args.min_probe_s)  # fmt: skip
    preset = probe_preset(args.model, args.start, args.budget_gib, args.layers)
    result = {
        "leg": "longest_seq",
        "model": args.model,
        "layers": args.layers,
        "budget_gib": args.budget_gib,
        "devices": args.devices,
        "micro_batch": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_probe": args.steps,
        "granularity": args.step,
        "range": [args.minimum, args.maximum],
        **found,
        "advisor_prediction": advisor_prediction(preset, args.budget_gib),
        "published": PUBLISHED.get(args.model),
        "seconds": time.monotonic() - began,
    }
    table = format_table(result)
    print(table)
    if args.jsonl:
        _append(args.jsonl, {k: v for k, v in result.items() if k != "probes"})
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "table": table}, indent=1))
    # 1: lengths were probed and none trained (a search the time budget stopped first is not)
    return 1 if result["probes"] and result["longest_ok"] is None else 0


def _append(path: str, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
