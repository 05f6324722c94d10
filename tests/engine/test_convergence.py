"""Convergence smoke test: async (staleness 1) and sync CPU Adam both learn the main job's data.

A learnable task (byte-level LM on the standard library's documentation, the rp-train default
data), a small model, 60 steps: both runs learn, and the async run's tail stays close to the
sync run's. The long claim (300 steps, a learning-rate sweep, within 2 % at fine-tuning rates)
is a benchmark: ``benchmarks/studies/engine_bench.py convergence`` (figures in RESULTS.md).
"""

from __future__ import annotations

import statistics

from engine_helpers import engine_for

from rp_engine.train.cli import batches, build_tiny_model, stdlib_corpus

STEPS, TAIL, LR = 60, 10, 5e-4


def _losses(async_optimizer: bool) -> list[float]:
    model = build_tiny_model(seed=0, layers=2, hidden=64)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "roundpipe": {"devices": "cpu:1", "async_optimizer": async_optimizer,
                      "fwd_cuts": [2], "bwd_cuts": [0, 2]},
    }  # fmt: skip
    engine = engine_for(model, cfg)
    try:
        data = batches(stdlib_corpus(), seq_len=32, micro_batch=4, seed=0)
        return [float(engine.train_batch(data)) for _ in range(STEPS)]
    finally:
        engine.destroy()


def test_async_and_sync_both_learn() -> None:
    sync, stale = _losses(False), _losses(True)
    for losses in (sync, stale):
        assert statistics.mean(losses[-TAIL:]) < statistics.mean(losses[:TAIL]) - 0.5
    tail_sync, tail_async = statistics.mean(sync[-TAIL:]), statistics.mean(stale[-TAIL:])
    assert abs(tail_async - tail_sync) / tail_sync < 0.10, (tail_sync, tail_async)
