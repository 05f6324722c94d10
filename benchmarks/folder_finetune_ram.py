"""Host memory of a full fine-tune from a model folder with both NVMe tiers (issue 49 (b)).

    python -m benchmarks.folder_finetune_ram '{"hidden": 3072, "layers": 12, "dir": D,
        "budget_gb": 2.15, "device_memory_gb": 0.7, "steps": 2}'

Saves benchmarks/bounded_ram.py's bf16 Qwen2 (``hidden``, ``layers``, vocab 1,024) to
``dir``/model with ``save_pretrained`` (300 MB shards; kept when it exists; ``{"make": 1}``
only does that), then, in a fresh process (``{"child": 1}``: only that, for a caller that puts it
under a memory limit, tests/engine/test_folder_finetune_limited.py),
``rp_engine.initialize(model=<folder>)`` with both NVMe tiers under ``dir``/nvme, one CPU
virtual device of ``device_memory_gb`` and, when given, ``roundpipe.host_memory_gb`` =
``budget_gb`` (the preflight fits the pools, slices and stages to the limit that binds), trains
``steps`` steps of 2 x 32 tokens and prints ``JSON:{...}``: ``state`` (18 B per parameter: what
a host-resident run holds), ``predicted`` (the preflight's peak), ``parts`` (its lines),
``anon_peak`` (the process's anonymous memory, ``RssAnon`` sampled every 5 ms: what a memory
limit cannot reclaim; the RSS also holds the folder's file pages, evictable), ``peak_rss``,
``counts`` (the pools chosen), ``losses`` and ``step_s``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def child(spec: dict) -> None:
    import rp_engine
    from benchmarks.common import peak_rss

    peak = [0]

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], _anon())
            time.sleep(0.005)

    threading.Thread(target=sample, daemon=True).start()
    nvme = os.path.join(spec["dir"], "nvme")
    os.makedirs(nvme, exist_ok=True)
    cfg = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "roundpipe": {
            "devices": "cpu:1", "async_optimizer": True, "step_journal": "off",
            "nvme_io_engine": "threads", "device_memory_gb": spec.get("device_memory_gb", 0.7),
        },
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
            "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0},
        },
    }  # fmt: skip
    if spec.get("budget_gb"):
        cfg["roundpipe"]["host_memory_gb"] = spec["budget_gb"]
    engine, *_ = rp_engine.initialize(model=os.path.join(spec["dir"], "model"), config=cfg)
    ram, fit = engine.host_ram, engine.tier_fit
    gen = torch.Generator().manual_seed(1)
    losses, times = [], []
    for _ in range(spec.get("steps", 3)):
        start = time.perf_counter()
        batches = [
            {"input_ids": (ids := torch.randint(0, 1024, (1, 32), generator=gen)), "labels": ids}
            for _ in range(2)
        ]
        losses.append(float(engine.train_batch(iter(batches))))
        times.append(time.perf_counter() - start)
    engine.synchronize()
    engine.destroy()
    out = {
        "losses": losses, "step_s": times, "anon_peak": peak[0], "peak_rss": peak_rss(),
        "predicted": ram.peak if ram else None, "parts": ram.lines() if ram else [],
        "counts": dataclasses.asdict(fit.counts) if fit else None
    }  # fmt: skip
    print("JSON:" + json.dumps(out), flush=True)


def make(spec: dict) -> int:
    """Save the spec's model to ``dir``/model (unless there); returns its parameter count."""
    from benchmarks import bounded_ram

    spec = {"vocab": 1024, **spec}
    folder = os.path.join(spec["dir"], "model")
    if not os.path.isdir(folder):
        model = bounded_ram.build(spec)
        model.save_pretrained(folder, max_shard_size="300MB")
        del model
    return bounded_ram.count(spec)


def command(spec: dict) -> list[str]:
    """The command line of the run of ``spec`` (``cwd=ROOT``, ``env=environment()``)."""
    return [
        sys.executable,
        "-m",
        "benchmarks.folder_finetune_ram",
        json.dumps({**spec, "child": 1}),
    ]


def environment() -> dict[str, str]:
    paths = (str(ROOT), os.environ.get("PYTHONPATH", ""))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def parse(stdout: str) -> dict:
    """The result a run printed (its last ``JSON:`` line)."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("JSON:")]
    if not lines:
        raise RuntimeError("the run printed no result")
    return dict(json.loads(lines[-1][5:]))


def main(spec: dict) -> None:
    if spec.get("child"):
        child(spec)
        return
    params = make(spec)
    if spec.get("make"):
        print("JSON:" + json.dumps({"params": params, "state": 18 * params}), flush=True)
        return
    proc = subprocess.run(
        command(spec), capture_output=True, text=True, cwd=ROOT, timeout=1800, env=environment()
    )
    if proc.returncode != 0:
        raise SystemExit(f"the run failed: {proc.stderr[-4000:]}")
    out = parse(proc.stdout)
    out.update(params=params, state=18 * params)
    print("JSON:" + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
