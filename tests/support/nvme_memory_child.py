"""Peak host memory of one training run, host-resident or with the NVMe tiers.

    python nvme_memory_child.py '{"tier": true, "params": true, "dir": D, "layers": 64, ...}'

``tier``: the optimizer tier (``offload_optimizer.device: "nvme"``); ``params`` (with ``tier``):
the parameter tier too (``offload_param.device: "nvme"``, nothing kept by ``max_in_cpu``).

prints ``JSON:{"peak_rss": bytes, "init_rss": bytes, "trainable": n, "losses": [...],
"weight_copies": n}`` (``init_rss``: right after ``initialize``). Run in a fresh process
per variant so each peak (VmHWM: ``benchmarks.common.peak_rss``) is that run's own (tests/engine/test_nvme_memory.py).

``checkpoint`` (a folder): after training, save a checkpoint there, train one more step
(``saved_next``: its loss), destroy the engine, build a fresh one over a model initialised from
another seed, load the checkpoint into it and train the same step (``loaded_next``: its loss,
which a load that restored everything makes bit for bit the same). Reports how far memory rose
above its level before the save and the load: ``save_rise`` (RSS, sampled every ms during
``save_checkpoint``) and ``load_rise`` (anonymous RSS, sampled during ``load_checkpoint``: the
checkpoint and the swap files are read through memory mappings, page cache the kernel evicts
at will, which RSS counts while they are mapped).
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psutil
import torch
from torch import nn

import rp_engine
from benchmarks.common import peak_rss
from rp_engine.host.memory_limit import status_bytes


def _rss_anon() -> int:
    anon = status_bytes("RssAnon")
    if anon is None:
        raise RuntimeError("no RssAnon in /proc/self/status")
    return anon


def _rss() -> int:
    return psutil.Process().memory_info().rss


@contextmanager
def _rise(measure: Callable[[], int]) -> Iterator[list[int]]:
    """Yields a list that holds, after the block, how far ``measure()`` rose above its value
    at the start (sampled every millisecond on a thread)."""
    start, peak, done = measure(), [measure()], threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            peak[0] = max(peak[0], measure())

    out: list[int] = []
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        done.set()
        thread.join()
        out.append(max(peak[0], measure()) - start)


def _model(width: int, layers: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    model.loss_fn = nn.functional.mse_loss  # type: ignore[assignment]
    return model


def main(spec: dict) -> None:
    width, layers = spec["width"], spec["layers"]
    model = _model(width, layers, seed=0)
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
    nxt = (torch.randn(2, width, generator=gen), torch.randn(2, width, generator=gen))
    losses = [float(engine.train_batch(iter([b]))) for b in batches]
    engine.synchronize()
    copies = engine.store.weight_copies  # compute-weight buffers (double-buffered: 2)
    result = {}
    if spec.get("checkpoint"):
        with _rise(_rss) as save_rise:
            engine.save_checkpoint(spec["checkpoint"], tag="t")
        result["saved_next"] = float(engine.train_batch(iter([nxt])))  # the run that saved
        engine.destroy()
        # a fresh engine over other weights: only what the load reads can make its loss equal
        engine, _, _, _ = rp_engine.initialize(model=_model(width, layers, seed=1), config=cfg)
        with _rise(_rss_anon) as load_rise:
            engine.load_checkpoint(spec["checkpoint"], tag="t")
        result["loaded_next"] = float(engine.train_batch(iter([nxt])))
        result.update(save_rise=save_rise[0], load_rise=load_rise[0])
    engine.destroy()
    peak = peak_rss()  # this process's own (benchmarks/common.py)
    trainable = sum(p.numel() for p in model.parameters())
    out = {
        "peak_rss": peak, "init_rss": init_rss, "trainable": trainable, "losses": losses,
        "weight_copies": copies, **result,
    }  # fmt: skip
    print("JSON:" + json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
