"""Resume: save at step k, load into a fresh engine, continue; losses equal an uninterrupted run.

Sync mode continues bit-exactly. In async mode ``save_checkpoint`` drains the optimizer (the
saved weights are the newest), so the run that saved and the run that resumed both continue
from the drained state and must agree exactly too.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import config, engine_for
from models import random_batch, tiny_qwen3

K, MORE, GAS = 3, 3, 2
CUTS = {"fwd_cuts": [2, 2], "bwd_cuts": [0, 2, 2]}


def _cfg(async_optimizer: bool) -> dict:
    return config(
        devices=2, gas=GAS, lr=5e-3, async_optimizer=async_optimizer, clip=1.0,
        scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 5e-3,
                                                   "warmup_num_steps": 4, "warmup_type": "linear"}},
        **CUTS,
    )  # fmt: skip


def _train(engine, batches, steps: int) -> list[float]:
    it = iter(batches)
    return [float(engine.train_batch(it)) for _ in range(steps)]


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_resume_matches_uninterrupted_run(tmp_path, async_optimizer: bool) -> None:
    batches = [random_batch(128, batch=2, seq=12, seed=300 + i) for i in range((K + MORE) * GAS)]
    head, tail = batches[: K * GAS], batches[K * GAS :]
    a = engine_for(tiny_qwen3(0, layers=4), _cfg(async_optimizer))
    try:
        _train(a, head, K)
        a.save_checkpoint(str(tmp_path), client_state={"epoch": 7})
        expected = _train(a, tail, MORE)
        lr_a = a.get_lr()
    finally:
        a.destroy()
    if not async_optimizer:  # in sync mode saving changes nothing: same as never saving
        c = engine_for(tiny_qwen3(0, layers=4), _cfg(False))
        try:
            assert _train(c, batches, K + MORE)[K:] == expected
        finally:
            c.destroy()
    # fresh engine with a different init: everything must come from the checkpoint
    b = engine_for(tiny_qwen3(1, layers=4), _cfg(async_optimizer))
    try:
        path, client = b.load_checkpoint(str(tmp_path))
        assert path is not None and client == {"epoch": 7}
        assert b.global_steps == K and b.global_samples == K * GAS * 2
        got = _train(b, tail, MORE)
        assert b.get_lr() == lr_a and b.global_steps == K + MORE
    finally:
        b.destroy()
    assert got == expected  # bit-exact


def test_load_without_checkpoint_returns_none(tmp_path, caplog) -> None:
    engine = engine_for(tiny_qwen3(0, layers=2), config(devices=1, fwd_cuts=[2], bwd_cuts=[0, 2]))
    try:
        assert engine.load_checkpoint(str(tmp_path)) == (None, None)
    finally:
        engine.destroy()


def test_zero_to_fp32_reads_engine_checkpoint(tmp_path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    model = tiny_qwen3(0, layers=4)
    engine = engine_for(model, config(devices=2, async_optimizer=True, **CUTS))
    try:
        engine.train_batch(iter([random_batch(128, batch=2, seq=12, seed=i) for i in range(GAS)]))
        engine.save_checkpoint(str(tmp_path))
        masters = {n: engine.store.master_of(p) for n, p in model.named_parameters()}
    finally:
        engine.destroy()
    state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert set(state) == set(masters)
    for name, value in state.items():
        torch.testing.assert_close(value, masters[name], rtol=0, atol=0, msg=name)
