"""rp_engine.integrations.hf and the engine fixes the Hugging Face path needs (in-process, fast).

The end-to-end runs against real DeepSpeed are in test_hf_trainer.py and test_hf_accelerate.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import config, engine_for
from models import random_batch, tiny_qwen3

import rp_engine
from rp_engine.config import load_config


def test_steps_per_print_infinity_means_never() -> None:
    # Accelerate's DeepSpeedPlugin writes float("inf") to silence DeepSpeed's progress log.
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "steps_per_print": float("inf")})
    assert cfg.steps_per_print is None


def test_forward_loss_takes_in_place_scaling() -> None:
    """Trainer does `loss *= k` on the forward's loss; its gradient follows the scaled loss."""
    batch = random_batch(128, batch=2, seq=8, seed=1)
    masters = []
    for in_place in (True, False):
        engine = engine_for(tiny_qwen3(0, layers=2), config(gas=1, lr=1e-2))
        try:
            loss = engine(**batch).loss
            assert not loss.is_leaf and loss.device == engine.device
            if in_place:
                loss *= 0.25
            else:
                loss = loss * 0.25
            engine.backward(loss)
            engine.step()
            engine.synchronize()
            masters.append([p.detach().clone() for p in engine.module.parameters()])
        finally:
            engine.destroy()
    reference = tiny_qwen3(0, layers=2)
    moved = [not torch.equal(a, b) for a, b in zip(masters[0], reference.parameters(), strict=True)]
    assert any(moved)
    for a, b in zip(*masters, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_num_items_in_batch_gives_the_tokens_share() -> None:
    """Trainer passes the optimizer step's token count; the loss is then sum / count."""
    batch = random_batch(128, batch=2, seq=8, seed=2)
    batch["labels"][0, :3] = -100
    engine = engine_for(tiny_qwen3(0, layers=2), config(gas=2))
    try:
        mean = engine(**batch).loss
        engine.backward(mean)
        engine.step()  # not a boundary: weights unchanged
        share = engine(**batch, num_items_in_batch=torch.tensor(40)).loss
        engine.backward(share)
        engine.step()
    finally:
        engine.destroy()
    tokens = int((batch["labels"][..., 1:] != -100).sum())
    assert share.item() == pytest.approx(mean.item() * tokens / 40, rel=1e-6)


def test_torch_adamw_client_without_deepspeed_optimizer() -> None:
    """Accelerate with zero_force_ds_cpu_optimizer false hands over torch's AdamW, whose
    ``defaults`` hold ``decoupled_weight_decay`` that its constructor refuses."""
    model = tiny_qwen3(0, layers=2)
    client = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
    cfg = config()
    del cfg["optimizer"]
    engine, optimizer, _, _ = rp_engine.initialize(model=model, optimizer=client, config=cfg)
    try:
        assert optimizer is client  # stage 0, fp32: DeepSpeed returns the client's object
        assert optimizer.param_groups[0]["lr"] == 2e-3
        assert optimizer.param_groups[0]["weight_decay"] == 0.05
    finally:
        engine.destroy()


@pytest.mark.parametrize("gather", [True, False])
def test_zero3_16bit_state_dict(gather: bool) -> None:
    model = tiny_qwen3(0, layers=2)
    expected = copy.deepcopy(model.state_dict())
    cfg = config(
        zero_optimization={"stage": 3, "stage3_gather_16bit_weights_on_model_save": gather}
    )
    engine = engine_for(model, cfg)
    try:
        assert engine.zero_gather_16bit_weights_on_model_save() is gather
        state = engine._zero3_consolidated_16bit_state_dict()
        assert state.keys() == expected.keys()
        for name, tensor in expected.items():
            torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)
        model.model.norm.weight.requires_grad_(False)
        frozen = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
        assert "model.norm.weight" not in frozen and len(frozen) == len(state) - 1
    finally:
        engine.destroy()


def test_enable_disable_are_idempotent_and_restore() -> None:
    import deepspeed
    from transformers import Trainer
    from transformers.integrations import deepspeed as hf_ds
    from transformers.integrations import is_deepspeed_zero3_enabled

    from rp_engine.integrations import hf

    original, original_set = deepspeed.initialize, hf_ds.set_hf_deepspeed_config
    trainer_methods = (Trainer._wrap_model, Trainer.prediction_step)
    had_group = torch.distributed.is_initialized()
    try:
        hf.enable()
        hf.enable(devices="cpu:2")
        assert hf.is_enabled() and deepspeed.initialize is hf.initialize
        assert torch.distributed.is_initialized()
        assert torch.distributed.get_world_size() == 1
        keep = hf_ds.HfDeepSpeedConfig({"zero_optimization": {"stage": 3}})
        assert keep.is_zero3() and not is_deepspeed_zero3_enabled()
        assert (Trainer._wrap_model, Trainer.prediction_step) != trainer_methods
    finally:
        hf.disable()
        hf.disable()
    assert deepspeed.initialize is original
    assert hf_ds.set_hf_deepspeed_config is original_set
    assert (Trainer._wrap_model, Trainer.prediction_step) == trainer_methods
    assert torch.distributed.is_initialized() is had_group


def test_adapter_is_a_deepspeed_engine_serving_rp_engine() -> None:
    from accelerate.utils import extract_model_from_parallel
    from deepspeed import DeepSpeedEngine

    from rp_engine.integrations.hf import DeepSpeedEngineAdapter

    model = tiny_qwen3(0, layers=2)
    engine = engine_for(model, config(gas=1, async_optimizer=True))
    adapter = DeepSpeedEngineAdapter(engine)
    try:
        assert isinstance(adapter, DeepSpeedEngine)
        loss = adapter(**random_batch(128, batch=2, seq=8, seed=3)).loss
        adapter.backward(loss)
        adapter.step()
        assert adapter.global_steps == 1 and engine.global_steps == 1
        adapter.some_flag = 3
        assert engine.some_flag == 3
        # Accelerate's unwrap_model: the HF model, with the async step already applied.
        unwrapped = extract_model_from_parallel(adapter)
        assert unwrapped is model
        for p in model.parameters():  # the async step was drained and published
            torch.testing.assert_close(p.detach(), engine.store.master_of(p), rtol=0, atol=0)
        # evaluation without labels wants logits: the host module answers (newest weights)
        adapter.eval()
        ids = random_batch(128, batch=2, seq=8, seed=3)["input_ids"]
        logits = adapter(input_ids=ids).logits
        assert logits.shape == (2, 8, 128)
        adapter.train()
    finally:
        engine.destroy()
