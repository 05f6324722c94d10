"""Peak host memory of one training run, host-resident or with the NVMe tiers.

    python nvme_memory_child.py '{"tier": true, "params": true, "dir": D, "layers": 64, ...}'

``tier``: the optimizer tier (``offload_optimizer.device: "nvme"``); ``params`` (with ``tier``):
the parameter tier too (``offload_param.device: "nvme"``, nothing kept by ``max_in_cpu``).

prints ``JSON:{"peak_rss": bytes, "init_rss": bytes, "trainable": n, "losses": [...],
"weight_copies": n}`` (``init_rss``: right after ``initialize``). Run in a fresh process
per variant so each peak (``ru_maxrss``) is that run's own (tests/engine/test_nvme_memory.py).
"""

from __future__ import annotations

import json
import resource
import sys

import psutil
import torch
from torch import nn

import rp_engine


def main(spec: dict) -> None:
    torch.manual_seed(0)
    width, layers = spec["width"], spec["layers"]
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    model.loss_fn = nn.functional.mse_loss  # type: ignore[assignment]
    rp = {"devices": "cpu:1", "async_optimizer": True, "step_journal": "off", "seed": 0}
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "roundpipe": rp,
    }
    if spec["tier"]:
        cfg["zero_optimization"] = {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": spec["dir"], "buffer_count": 4},
        }
        rp["nvme_io_engine"] = "threads"
    if spec.get("params"):
        cfg["zero_optimization"]["offload_param"] = {
            "device": "nvme", "nvme_path": spec["dir"], "buffer_count": 4, "max_in_cpu": 0,
        }  # fmt: skip
    engine, _, _, _ = rp_engine.initialize(model=model, config=cfg)
    init_rss = psutil.Process().memory_info().rss  # the host state, before any device copy
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, width, generator=gen), torch.randn(2, width, generator=gen))
               for _ in range(spec.get("steps", 3))]  # fmt: skip
    losses = [float(engine.train_batch(iter([b]))) for b in batches]
    engine.synchronize()
    engine.destroy()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    trainable = sum(p.numel() for p in model.parameters())
    copies = engine.store.weight_copies  # compute-weight buffers (double-buffered: 2)
    out = {
        "peak_rss": peak, "init_rss": init_rss, "trainable": trainable, "losses": losses,
        "weight_copies": copies,
    }  # fmt: skip
    print("JSON:" + json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
