"""Data-parallel scaling on this machine: 1 process vs 2 processes (gloo, localhost), side by side.

    python benchmarks/studies/dp_scaling.py [--reps 3] [--steps 6] [--hidden 256] [--layers 4] \
        [--seq 64]

Each repetition runs one process on the whole global batch (GAS 4; with 1 and with 2 torch
threads), then ``torchrun --nproc_per_node 2`` with GAS 2 per rank (the same global batch, 1
thread each), alternating, all through
``tests/support/dp_run.py`` (tiny Qwen3, async CPU Adam, one CPU virtual device per process). Reported: median step time after the first two steps, tokens/s per process
and in total. The two ranks share this machine's cores, so this measures the data-parallel
overhead (reduce + broadcast + ordering), not a multi-node speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file: benchmarks/studies/)
TESTS = ROOT / "tests" / "support"  # dp_run.py and its helpers


def run(spec: dict[str, Any], nproc: int, threads: int = 1) -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": f"{TESTS}{os.pathsep}{ROOT}",
        "OMP_NUM_THREADS": str(threads),
    }
    script = [str(TESTS / "dp_run.py"), json.dumps(spec)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:0"]  # fmt: skip
    cmd = [sys.executable, *script] if nproc == 1 else [*launcher, *script]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=TESTS, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON:")]
    if proc.returncode or not lines:
        raise SystemExit(proc.stderr[-4000:])
    return json.loads(lines[-1][5:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    a = p.parse_args()
    spec = {"steps": a.steps, "global_gas": 4, "async": True, "hidden": a.hidden,
            "layers": a.layers, "seq": a.seq}  # fmt: skip
    # (processes, torch threads per process): one process with one thread, one with two (all
    # of this machine's cores), two processes with one thread each
    arms = [(1, 1), (1, 2), (2, 1)]
    times: dict[tuple[int, int], list[float]] = {arm: [] for arm in arms}
    tokens: dict[tuple[int, int], int] = {}
    for rep in range(a.reps):
        for arm in arms:
            out = run(spec, *arm)
            step = statistics.median(out["step_seconds"][2:])
            times[arm].append(step)
            tokens[arm] = out["tokens_per_step_per_process"]
            print(f"rep {rep} {arm}: step {step:.3f} s", file=sys.stderr)
    print(
        "| processes x threads | global tokens/step | step time (median) | tokens/s per process | tokens/s total |"
    )
    print("|---|---|---|---|---|")
    for nproc, threads in arms:
        step = statistics.median(times[nproc, threads])
        per = tokens[nproc, threads] / step
        print(
            f"| {nproc} x {threads} | {tokens[nproc, threads] * nproc} | {step:.3f} s | {per:.0f} | {per * nproc:.0f} |"
        )
    base = statistics.median(times[1, 2])
    print(
        f"\nstep time, 2 processes / 1 process with 2 threads: {statistics.median(times[2, 1]) / base:.2f}"
    )


if __name__ == "__main__":
    main()
