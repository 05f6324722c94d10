"""A training run under a memory limit it cannot fit: refused at ``initialize``, or trained.

    python tests/support/limit_refusal_child.py '{"hidden": 1024, "layers": 4, "dir": D,
        "ckpt": C, "rlimit_margin_mb": null}'

Builds benchmarks/bounded_ram.py's bf16 Qwen2 (both NVMe tiers under ``dir``, 2 CPU virtual
devices), then calls ``rp_engine.initialize``. ``rlimit_margin_mb``: first lowers this process's
``RLIMIT_AS`` to its address space now plus that margin (the limit a process without a memory
cgroup can be given). Prints ``JSON:{...}``: ``refused`` (the PreflightError's message, or null),
``rss`` (resident bytes before ``initialize``), and when it was not refused, ``predicted_peak``
and ``held`` (the tiers' preflight's prediction and what the process held of it; null
host-resident) after training one
step and saving a checkpoint to ``ckpt`` (which a refused run must never create).
"""

from __future__ import annotations

import json
import resource
import sys

import psutil
import torch

import rp_engine
from benchmarks import bounded_ram
from rp_engine.host_preflight import PreflightError


def _vm_size() -> int:
    return int(psutil.Process().memory_info().vms)


def main(spec: dict) -> None:
    spec = {"vocab": 2048, "steps": 1, "tiers": True, **spec}  # tiers false: host-resident
    model = bounded_ram.build(spec)
    rss = int(psutil.Process().memory_info().rss)
    if spec.get("rlimit_margin_mb") is not None:
        limit = _vm_size() + int(spec["rlimit_margin_mb"]) * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    try:
        engine, _, _, _ = rp_engine.initialize(model=model, config=bounded_ram.config(spec))
    except PreflightError as e:
        print("JSON:" + json.dumps({"refused": str(e), "rss": rss}), flush=True)
        return
    ids = torch.randint(0, spec["vocab"], (2, 16), generator=torch.Generator().manual_seed(1))
    batches = [{"input_ids": ids, "labels": ids.clone()}] * engine.gradient_accumulation_steps()
    engine.train_batch(iter(batches))
    engine.save_checkpoint(spec["ckpt"])
    ram = engine.host_ram  # predicted with the tiers only
    engine.destroy()
    out = {
        "refused": None, "rss": rss, "predicted_peak": ram.peak if ram else None,
        "held": ram.runtime + ram.model if ram else None,
    }  # fmt: skip
    print("JSON:" + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
