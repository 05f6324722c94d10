"""Host memory of one training run of a bf16 Qwen2, with both NVMe tiers or host-resident.

    python -m benchmarks.bounded_ram '{"layers": 48, "hidden": 512, "dir": D, "tiers": true, ...}'

Builds the model in bf16 (the user's own model is the first thing in RAM), initialises the
engine (both tiers on NVMe under ``dir`` when ``tiers``; else host-resident), trains ``steps``
steps on 2 CPU virtual devices and prints ``JSON:{...}``: ``losses``; ``state`` (bytes of the
training state: bf16 weights, fp32 masters, Adam moments and fp32 gradients, 18 B per
parameter); ``params``; ``peak_rss`` (VmHWM, ``common.peak_rss``: the whole run); ``init_peak`` and
``train_peak`` (RSS sampled every 2 ms during ``initialize`` and during training);
``model_rss`` (RSS once the model is built, before ``initialize``); ``import_rss``.
``predicted_peak``: the host RAM the initialize preflight predicted (tiers only, else null).
``count_only``: only ``{"params": n}`` (the model built on the meta device).
Run in a fresh process per variant (tests/engine/test_bounded_ram.py, benchmarks/nvme_bench.py:
``run``). Keys: ``layers``, ``hidden``, ``vocab`` (1024), ``seq`` (32), ``gas`` (2), ``steps``
(3), ``device_memory_gb``, ``grad_buffers`` (null: the engine's default), ``io`` ("threads").
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import torch

import rp_engine
from benchmarks.common import peak_rss


def _rss() -> int:
    return psutil.Process().memory_info().rss


@contextmanager
def _peak() -> Iterator[list[int]]:
    """Yields a list holding, after the block, the highest RSS sampled during it."""
    peak, done = [_rss()], threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            peak[0] = max(peak[0], _rss())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out: list[int] = []
    try:
        yield out
    finally:
        done.set()
        thread.join()
        out.append(max(peak[0], _rss()))


def build(spec: dict) -> torch.nn.Module:
    import transformers

    hidden = spec["hidden"]
    config = transformers.Qwen2Config(
        vocab_size=spec.get("vocab", 1024), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=spec["layers"], num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128), max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    return model


def config(spec: dict) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": spec.get("gas", 2),
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "roundpipe": {
            "devices": "cpu:2",
            "async_optimizer": True,
            "step_journal": "off",
            "nvme_io_engine": spec.get("io", "threads"),
        },
    }
    if spec.get("device_memory_gb"):
        cfg["roundpipe"]["device_memory_gb"] = spec["device_memory_gb"]
    if spec.get("grad_buffers") is not None:
        cfg["roundpipe"]["grad_buffers"] = spec["grad_buffers"]
    if spec.get("host_memory_gb"):  # a budget: the NVMe pools fit it (host_preflight.py)
        cfg["roundpipe"]["host_memory_gb"] = spec["host_memory_gb"]
    if spec["tiers"]:
        folder = spec["dir"]
        cfg["zero_optimization"] = {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": folder, "buffer_count": 4},
            "offload_param": {"device": "nvme", "nvme_path": folder, "max_in_cpu": 0},
        }
    return cfg


def count(spec: dict) -> int:
    """Parameters of the spec's model, built on the meta device (no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build(spec).parameters())


def main(spec: dict) -> None:
    if spec.get("count_only"):
        print("JSON:" + json.dumps({"params": count(spec)}), flush=True)
        return
    import_rss = _rss()
    model = build(spec)
    params = sum(p.numel() for p in model.parameters())
    model_rss = _rss()
    with _peak() as init:
        engine, _, _, _ = rp_engine.initialize(model=model, config=config(spec))
    predicted = engine.host_ram.peak if engine.host_ram is not None else None
    fit = engine.tier_fit
    least = fit.least.peak if fit is not None else None
    counts = dataclasses.asdict(fit.counts) if fit is not None else None
    gen = torch.Generator().manual_seed(1)
    losses = []
    with _peak() as train:
        for _ in range(spec.get("steps", 3)):
            batches = [
                {"input_ids": (ids := torch.randint(0, spec.get("vocab", 1024), (2, spec.get("seq", 32)), generator=gen)),
                 "labels": ids.clone()}
                for _ in range(engine.gradient_accumulation_steps())
            ]  # fmt: skip
            losses.append(float(engine.train_batch(iter(batches))))
        engine.synchronize()
    engine.destroy()
    out = {
        "losses": losses,
        "params": params,
        "state": 18 * params,
        "import_rss": import_rss,
        "model_rss": model_rss,
        "init_peak": init[0],
        "train_peak": train[0],
        "peak_rss": peak_rss(),
        "predicted_peak": predicted,  # the initialize preflight's (with the tiers)
        "least_peak": least,  # the same with every pool at its fewest buffers
        "pool_counts": counts,  # the pools' buffers: the config's, or fewer to fit the budget
    }
    print("JSON:" + json.dumps(out), flush=True)


ROOT = Path(__file__).resolve().parent.parent


def command(spec: dict) -> list[str]:
    """The command line of one run of ``spec`` (run it with ``cwd=ROOT``)."""
    return [sys.executable, "-m", "benchmarks.bounded_ram", json.dumps(spec)]


def parse(stdout: str) -> dict[str, Any]:
    """The result a run printed (its last ``JSON:`` line)."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("JSON:")]
    if not lines:
        raise RuntimeError("the run printed no result")
    return dict(json.loads(lines[-1][5:]))


def run(spec: dict, *, timeout: float = 1800) -> dict[str, Any]:
    """One run of ``spec`` in a fresh process; raises with its stderr when it fails."""
    proc = subprocess.run(
        command(spec), capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
        )},
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"bounded_ram {spec} failed: {proc.stderr[-4000:]}")
    return parse(proc.stdout)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
