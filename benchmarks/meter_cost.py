"""What metering a CPU virtual device's compute costs (issue 49, item 4).

    python -m benchmarks.meter_cost [--steps 8]

A CPU device with a capacity (``roundpipe.device_memory_gb``) counts every storage its compute
creates against it (``CPUDevice.meter_compute``: a ``TorchDispatchMode``, a Python call per op).
For each model size (tiny Qwen3s, 2 CPU devices, a budget of 1 GiB) one engine trains
alternate steps metered and not, side by side in one run (the same plan, data and machine
load), after two warm-up steps; prints one JSON line per size: the median wall time of a step
each way, their ratio, and each way's largest device peak (unmetered it counts only the
runtime's weights, gradients and states, not the activations).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

import rp_engine
from rp_engine.device.cpu import CPUDevice

SIZES = (  # (hidden, layers, tokens per sequence): per-op overhead matters less as ops grow
    (64, 4, 16),
    (256, 4, 128),
    (512, 4, 256),
    (1024, 4, 512),
)
VOCAB = 512


def _model(hidden: int, layers: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden // 4, tie_word_embeddings=True, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()


def _batches(seq: int) -> Iterator[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    while True:
        ids = torch.randint(1, VOCAB, (2, seq), generator=gen)
        yield {"input_ids": ids, "labels": ids}


def measure(hidden: int, layers: int, seq: int, steps: int) -> dict[str, Any]:
    """Median step time metered and not (alternate steps of one engine) and their peaks."""
    cfg = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "roundpipe": {"devices": "cpu:2", "device_memory_gb": 1.0, "async_optimizer": False},
    }  # fmt: skip
    engine, *_ = rp_engine.initialize(model=_model(hidden, layers), config=cfg)
    times: dict[bool, list[float]] = {True: [], False: []}
    peaks: dict[bool, int] = {True: 0, False: 0}
    data = _batches(seq)
    try:
        for _ in range(2):  # warm-up: first uploads, the profile and its re-plan
            engine.train_batch(data)
        engine.synchronize()
        for step in range(2 * steps):
            metered = step % 2 == 0
            for device in engine.pool:
                assert isinstance(device, CPUDevice)
                device.meter_compute(metered)
                device.reset_peak()
            start = time.perf_counter()
            engine.train_batch(data)
            engine.synchronize()
            times[metered].append(time.perf_counter() - start)
            peak = max(d.memory_stats()["peak"] for d in engine.pool)
            peaks[metered] = max(peaks[metered], peak)
    finally:
        engine.destroy()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    return {
        "hidden": hidden, "layers": layers, "seq": seq, "metered_s": round(on, 4),
        "unmetered_s": round(off, 4), "ratio": round(on / off, 3),
        "peak_metered": peaks[True], "peak_unmetered": peaks[False],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps each way per size")
    args = parser.parse_args()
    for hidden, layers, seq in SIZES:
        print(json.dumps(measure(hidden, layers, seq, args.steps)), flush=True)


if __name__ == "__main__":
    main()
