"""``engine(**batch, fused_lm_head=True)``: TRL's fused-LM-head output computed by rp_engine's
chunked head on the devices, against TRL's own fused head on the same model (in-process).

The end-to-end SFTTrainer run against real DeepSpeed is in test_hf_trl.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import assert_close_named, config, engine_for
from models import random_batch, tiny_mlp, tiny_qwen3

VOCAB = 128
FIELDS = ("log_probs", "entropy", "is_top1", "label_mask")


def _trl_reference(model: torch.nn.Module) -> torch.nn.Module:
    pytest.importorskip("trl")  # the hf extra (make install, CI) installs it
    from trl.trainer.utils import add_fused_lm_head

    ref = copy.deepcopy(model)
    add_fused_lm_head(ref, outputs=("log_probs", "entropy", "is_top1"))
    return ref


def _assert_fields_match(ours, theirs) -> None:  # type: ignore[no-untyped-def]
    for name in FIELDS:
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if a.is_floating_point():
            assert_close_named(a.detach(), b.detach(), name, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(a, b), name
    assert theirs.log_sum_sq_probs is None and ours.log_sum_sq_probs is None


@pytest.fixture
def model_and_batch() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    return tiny_qwen3(0, layers=2), random_batch(VOCAB, batch=2, seq=12, seed=5, padded=True)


def test_eval_fields_match_trl_chunked(model_and_batch) -> None:  # type: ignore[no-untyped-def]
    model, batch = model_and_batch
    ref = _trl_reference(model)
    # 5-token chunks: the statistics are assembled from several head chunks
    engine = engine_for(model, config(gas=1, roundpipe={"head_chunk_tokens": 5}))
    try:
        engine.eval()
        with torch.no_grad():
            ours = engine(**batch, fused_lm_head=True)
            theirs = ref.eval()(**batch, fused_lm_head=True)
        _assert_fields_match(ours, theirs)
        assert float(ours.loss) == pytest.approx(float(theirs.loss), rel=1e-5)
        assert not ours.log_probs.requires_grad
    finally:
        engine.destroy()


def test_train_fields_and_gradients_match_trl(model_and_batch) -> None:  # type: ignore[no-untyped-def]
    """SFTTrainer's loss, ``-log_probs.sum() / num_items``, through engine.backward: the
    gradients equal those of TRL's fused head on the host model."""
    model, batch = model_and_batch
    ref = _trl_reference(model)
    cfg = config(gas=2, roundpipe={"head_chunk_tokens": 7})
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 1.0}}  # the step applies -gradient
    engine = engine_for(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        out = engine(**batch, fused_lm_head=True)  # its forward runs now: TRL reads it at once
        theirs = ref(**batch, fused_lm_head=True)
        _assert_fields_match(out, theirs)
        num_items = int(out.label_mask.sum()) + 9  # the whole accumulation window's count
        loss = -out.log_probs.sum() / num_items
        engine.backward(loss)  # not a boundary (GAS 2): its backward is queued for the window
        engine.step()
        (-theirs.log_probs.sum() / num_items / 2).backward()  # engine.backward divides by GAS
        # a second micro-batch that adds nothing (its loss times 0) closes the window
        engine.backward(engine(**batch, fused_lm_head=True).log_probs.sum() * 0.0)
        engine.step()
        engine.synchronize()
        for name, p in ref.named_parameters():
            ours = before[name] - dict(model.named_parameters())[name].detach()
            assert_close_named(ours, p.grad, name, rtol=1e-4, atol=1e-6)
    finally:
        engine.destroy()


def test_per_token_weights_are_refused_not_trained_wrong(model_and_batch) -> None:  # type: ignore[no-untyped-def]
    model, batch = model_and_batch
    engine = engine_for(model, config(gas=1))
    try:
        out = engine(**batch, fused_lm_head=True)
        # TRL loss_type="dft": -log_p * p, a different weight per token
        dft = (-out.log_probs * out.log_probs.exp().detach()).sum() / out.label_mask.sum()
        with pytest.raises(NotImplementedError, match="dft"):
            engine.backward(dft)
    finally:
        engine.destroy()


def test_fused_request_needs_a_causal_lm_head() -> None:
    from models import mlp_batch

    model = tiny_mlp(0)
    model.loss_fn = torch.nn.functional.cross_entropy  # type: ignore[assignment]
    engine = engine_for(model, config(gas=1, mbs=4))
    try:
        with pytest.raises(NotImplementedError, match="fused_lm_head=True needs"):
            engine(mlp_batch(), fused_lm_head=True)
    finally:
        engine.destroy()
