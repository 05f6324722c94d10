"""rp_engine vs real DeepSpeed ZeRO-Infinity (ZeRO-3, params + optimizer offloaded to CPU).

Same tiny Qwen3, same config, same data, the DeepSpeed imperative loop on both: per-step losses
agree (fp32, relative 1e-4), and the counter sequences, get_lr() and backward()'s return value
are identical. With the asynchronous optimizer the counters, learning rates and backward's
contract stay DeepSpeed's (only the losses move, by staleness). DeepSpeed runs in a subprocess
(it needs a process group).
"""

from __future__ import annotations

import pytest
import torch
from ds_reference import record
from engine_helpers import assert_close_named
from models import random_batch, tiny_qwen3
from subprocess_helpers import run_json

import rp_engine
from benchmarks.common import loader_dataset

SPEC = {
    "layers": 4,
    "vocab": 128,
    "mbs": 2,
    "seq": 16,
    "micro_batches": 24,  # GAS 2 -> 12 optimizer steps
    "config": {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0,
                "warmup_max_lr": 3e-3,
                "warmup_num_steps": 4,
                "warmup_type": "linear",
            },
        },  # fmt: skip
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
        },
    },
}


@pytest.fixture(scope="module")
def deepspeed_rows() -> list[dict]:
    return run_json("ds_reference.py", SPEC)  # type: ignore[no-any-return]


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_losses_counters_lr_match_deepspeed(
    deepspeed_rows: list[dict], async_optimizer: bool
) -> None:
    model = tiny_qwen3(0, layers=SPEC["layers"])
    batches = [
        random_batch(SPEC["vocab"], batch=SPEC["mbs"], seq=SPEC["seq"], seed=100 + i)
        for i in range(SPEC["micro_batches"])
    ]
    cfg = {**SPEC["config"], "roundpipe": {"devices": "cpu:2", "async_optimizer": async_optimizer}}
    engine, _, _, _ = rp_engine.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    try:
        ours = record(engine, batches, backward_ret=lambda e, loss: e.backward(loss))
    finally:
        engine.destroy()
    assert len(ours) == len(deepspeed_rows) >= 20
    for k, (a, b) in enumerate(zip(ours, deepspeed_rows, strict=True)):
        for key in ("micro_steps", "global_steps", "global_samples", "applied", "boundary_next"):
            assert a[key] == b[key], (k, key, a[key], b[key])
        assert_close_named(a["lr"], b["lr"], f"lr at {k}", rtol=1e-12, atol=0)
        assert a["backward"] == pytest.approx(a["loss"] / 2, rel=1e-6)
        if async_optimizer and k >= 2:
            continue  # staleness 1: losses differ from DeepSpeed's after the first step
        assert_close_named(a["loss"], b["loss"], f"loss at {k}", rtol=1e-4, atol=0)
        torch.testing.assert_close(a["backward"], b["backward"], rtol=1e-4, atol=0)


def _own_loop(engine: object, batches: list[dict], shape: str) -> list[float]:
    """DeepSpeed's loop with its losses read as ``shape`` says; every loss, in order."""
    held = []
    for mb, batch in enumerate(batches):
        loss = engine(**batch).loss  # type: ignore[operator]
        if shape == "before_backward":
            float(loss.detach())
        engine.backward(loss)  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]
        if shape == "every_10th" and mb % 10 == 9:
            float(loss.detach())
        held.append(loss)
    return [float(x.detach()) for x in held]


@pytest.mark.parametrize("shape", ["before_backward", "every_10th", "engine_loader"])
def test_every_loop_shape_keeps_deepspeeds_losses(deepspeed_rows: list[dict], shape: str) -> None:
    """The loss read before each backward, every 10th micro-step, or (``record``'s shape, the
    test above) after each step; or the micro-batches taken from the loader ``initialize``
    returns: the losses are DeepSpeed's (sync), whichever runs the engine chose."""
    model = tiny_qwen3(0, layers=SPEC["layers"])
    batches = [
        random_batch(SPEC["vocab"], batch=SPEC["mbs"], seq=SPEC["seq"], seed=100 + i)
        for i in range(SPEC["micro_batches"])
    ]
    cfg = {**SPEC["config"], "roundpipe": {"devices": "cpu:2", "async_optimizer": False}}
    data = loader_dataset(batches) if shape == "engine_loader" else None
    engine, _, loader, _ = rp_engine.initialize(
        model=model, model_parameters=model.parameters(), config=cfg, training_data=data
    )
    try:
        if shape == "engine_loader":  # its loss read after each step, as a logging loop does
            ours = [row["loss"] for row in record(engine, loader, backward_ret=_backward)]
        else:
            ours = _own_loop(engine, batches, shape)
    finally:
        engine.destroy()
    want = [row["loss"] for row in deepspeed_rows]
    assert_close_named(ours, want, f"losses ({shape})", rtol=1e-4, atol=0)


def _backward(engine: object, loss: torch.Tensor) -> torch.Tensor:
    return engine.backward(loss)  # type: ignore[attr-defined,no-any-return]
