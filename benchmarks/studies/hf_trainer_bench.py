"""Trainer + DeepSpeed ZeRO-Infinity vs Trainer + rp_engine (``hf.enable()``), same config.

Each system trains the same Qwen3 with ``transformers.Trainer`` and the shared all-"auto"
ZeRO-Infinity config, in its own subprocess (``tests/support/hf_trainer_run.py``); the figure is
Trainer's own ``train_runtime`` (the training loop, not process start or model build), printed
as a side-by-side ratio. rp_engine runs plain ``Trainer`` and ``RoundPipeTrainer`` (the
``train_batch`` fast path), sync optimizer (DeepSpeed's numbers) and async.

``--trl``: TRL's ``SFTTrainer`` instead (``tests/support/hf_trl_run.py``: prompt/completion rows, the
fused LM head), plain SFTTrainer on both sides; also Trainer's ``eval_runtime`` (rp_engine:
evaluation through the engine).

    .venv/bin/python benchmarks/studies/hf_trainer_bench.py [--devices cpu:2] [--steps 8] [--trl]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file: benchmarks/studies/)
TESTS = ROOT / "tests" / "support"  # the Trainer/TRL children and their helpers
SHARED = Path(os.environ.get("RP_SHARED_DIR", ROOT.parent / "shared"))
FIXTURE = SHARED / "fixtures" / "ds_configs" / "hf_zero3_offload_auto.json"


def run(spec: dict, script: str = "hf_trainer_run.py") -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, str(TESTS / script), json.dumps(spec)],
        capture_output=True, text=True, env=env, cwd=TESTS, timeout=3600,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON:")]
    if proc.returncode or not lines:
        raise RuntimeError(proc.stderr[-4000:])
    return json.loads(lines[-1][5:])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", default="cpu:2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--trl", action="store_true", help="TRL SFTTrainer instead of Trainer")
    a = ap.parse_args()
    config = json.loads(FIXTURE.read_text())
    if a.trl:
        trl_bench(a, config)
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = {
            "config": config, "steps": a.steps, "layers": a.layers, "hidden": a.hidden,
            "seq": a.seq, "mbs": 2, "gas": 4, "save_steps": None,
        }  # fmt: skip
        rows = [("DeepSpeed ZeRO-Infinity", {"backend": "deepspeed", "port": 29591})]
        for fast in (False, True):
            for async_opt in (False, True):
                name = f"rp_engine {'RoundPipeTrainer' if fast else 'Trainer'}, " + (
                    "async" if async_opt else "sync"
                )
                rp = {"devices": a.devices, "async_optimizer": async_opt}
                rows.append((name, {"backend": "rp_engine", "roundpipe": rp, "fast_path": fast}))
        times = {}
        for i, (name, extra) in enumerate(rows):
            out = run({**base, **extra, "output_dir": f"{tmp}/o{i}"})
            times[name] = out["train_runtime"]
    ds = times["DeepSpeed ZeRO-Infinity"]
    print(f"Qwen3 {a.layers} layers hidden {a.hidden}, seq {a.seq}, mbs 2, GAS 4, {a.steps} steps")
    print("| system | train_runtime s | DeepSpeed / system |")
    print("|---|---:|---:|")
    for name, t in times.items():
        print(f"| {name} | {t:.2f} | {ds / t:.2f}x |")


def trl_bench(a: argparse.Namespace, config: dict) -> None:
    base = {
        "config": config, "steps": a.steps, "layers": a.layers, "hidden": a.hidden, "mbs": 2,
        "gas": 4, "train_rows": a.steps * 8, "eval_rows": 16,
    }  # fmt: skip
    rows = [("DeepSpeed ZeRO-Infinity", {"backend": "deepspeed"})]
    for async_opt in (False, True):
        rp = {"devices": a.devices, "async_optimizer": async_opt}
        name = f"rp_engine SFTTrainer, {'async' if async_opt else 'sync'}"
        rows.append((name, {"backend": "rp_engine", "roundpipe": rp}))
    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, extra) in enumerate(rows):
            out = run({**base, **extra, "output_dir": f"{tmp}/o{i}"}, "hf_trl_run.py")
            times[name] = (out["train_runtime"], out["eval_runtime"])
    ds_train, ds_eval = times["DeepSpeed ZeRO-Infinity"]
    print(f"SFTTrainer, Qwen3 {a.layers} layers hidden {a.hidden}, mbs 2, GAS 4, {a.steps} steps")
    print("| system | train_runtime s | ratio | eval_runtime s | ratio |")
    print("|---|---:|---:|---:|---:|")
    for name, (t, e) in times.items():
        print(f"| {name} | {t:.2f} | {ds_train / t:.2f}x | {e:.2f} | {ds_eval / e:.2f}x |")


if __name__ == "__main__":
    main()
