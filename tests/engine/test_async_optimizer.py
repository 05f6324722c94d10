"""The asynchronous CPU optimizer: staleness 1, per-layer stepping, overflow, errors, draining.

Iteration t reads the weights of step max(t-2, 0) in async mode (t-1 in sync mode); the step of
iteration t runs on the host while iteration t+1 computes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import assert_same_weights, config, engine_for, reference_losses, run_losses
from models import mlp_batch, random_batch, tiny_mlp, tiny_qwen3

STEPS, GAS = 6, 2
CUTS = {"fwd_cuts": [2, 2], "bwd_cuts": [0, 2, 2]}


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    return [random_batch(128, batch=2, seq=12, seed=200 + i) for i in range(n)]


# Iterations overlap by default (engine_pipeline.py): train_batch t+1 is issued while iteration
# t's backward tail and optimizer run; "overlap_iterations": false is the drained control.
OVERLAP = {"on_nonfinite": "ignore"}
DRAINED = {"overlap_iterations": False}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "drained"])
def test_async_matches_staleness_one_reference(overlap: bool) -> None:
    model, ref = tiny_qwen3(0, layers=4), tiny_qwen3(0, layers=4)
    batches = _batches(STEPS * GAS)
    expected = reference_losses(ref, batches, steps=STEPS, gas=GAS, lr=1e-2, staleness=1)
    rp = OVERLAP if overlap else DRAINED
    cfg = config(devices=2, gas=GAS, lr=1e-2, async_optimizer=True, roundpipe=rp, **CUTS)
    got = run_losses(model, cfg, batches, steps=STEPS, overlap=overlap)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert_same_weights(model, ref)
    # and it really is stale: the synchronous losses (which the sync engine meets, see
    # test_runtime_parity.py) differ from step 2 on
    sync = reference_losses(tiny_qwen3(0, layers=4), batches, steps=STEPS, gas=GAS, lr=1e-2)
    assert sync[0] == pytest.approx(got[0]) and sync[2] != pytest.approx(got[2])


def test_layers_step_as_their_gradients_land() -> None:
    """Without clipping (and with on_nonfinite "ignore", which does not wait for the global norm
    to be known finite), a layer's step is issued before the earlier layers' gradients exist."""
    engine = engine_for(
        tiny_qwen3(0, layers=4),
        config(devices=2, async_optimizer=True, roundpipe={"on_nonfinite": "ignore"}, **CUTS),
    )
    log: list[tuple[str, int]] = []
    stepper = engine.stepper
    ready, enqueue = stepper.layer_ready, stepper._enqueue
    stepper.layer_ready = lambda layer, *step: (log.append(("ready", layer)), ready(layer, *step))[
        1
    ]
    stepper._enqueue = lambda layer, st, **kw: (
        log.append(("step", layer)),
        enqueue(layer, st, **kw),
    )[1]
    try:
        engine.train_batch(iter(_batches(GAS)))
        engine.synchronize()
    finally:
        engine.destroy()
    head = engine.planner.stages.head_index
    assert log.index(("step", head)) < log.index(("ready", 0)), log


def test_clipping_waits_for_the_global_norm() -> None:
    """With clipping every step is issued after the last gradient (the norm needs them all)."""
    engine = engine_for(
        tiny_qwen3(0, layers=4), config(devices=2, async_optimizer=True, clip=1.0, **CUTS)
    )
    log: list[str] = []
    stepper = engine.stepper
    ready, enqueue = stepper.layer_ready, stepper._enqueue
    stepper.layer_ready = lambda layer, *step: (log.append("ready"), ready(layer, *step))[1]
    stepper._enqueue = lambda layer, st, **kw: (log.append("step"), enqueue(layer, st, **kw))[1]
    try:
        engine.train_batch(iter(_batches(GAS)))
        engine.synchronize()  # the step closes (with overlapping iterations, at the drain)
        norm = engine.get_global_grad_norm()
    finally:
        engine.destroy()
    last_ready = len(log) - 1 - log[::-1].index("ready")
    assert log.index("step") > last_ready
    assert norm is not None and norm > 0


def _fp16_mlp_engine(async_optimizer: bool):
    model = tiny_mlp(0, layers=4)
    model.loss_fn = F.cross_entropy
    cfg = config(
        devices=2, gas=1, mbs=4, async_optimizer=async_optimizer,
        fwd_cuts=[2, 1], bwd_cuts=[0, 1, 2],
        fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
        scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 2e-3,
                                                  "warmup_num_steps": 10, "warmup_type": "linear"}},
    )  # fmt: skip
    return model, engine_for(model, cfg)


@pytest.mark.parametrize("async_optimizer", [True, False])
def test_fp16_overflow_skips_the_step_for_all_layers(async_optimizer: bool) -> None:
    model, engine = _fp16_mlp_engine(async_optimizer)
    try:
        good = mlp_batch(batch=4, seed=1)
        engine.train_batch(iter([good]))
        engine.synchronize()
        before = [p.detach().clone() for p in model.parameters()]
        masters = [hp.master.clone() for hp in engine.store.owned_params()]
        lr, scale = engine.get_lr(), engine.optimizer.cur_scale
        huge = (good[0] * 1e6, good[1])  # fp16 activations overflow -> inf gradients
        engine.train_batch(iter([huge]))
        engine.synchronize()
        assert not engine.was_step_applied() and engine.skipped_steps == 1
        assert engine.global_steps == 2 and engine.get_lr() == lr  # scheduler skipped too
        assert engine.optimizer.cur_scale == scale / 2
        for p, b in zip(model.parameters(), before, strict=True):
            torch.testing.assert_close(p, b, rtol=0, atol=0)
        for hp, m in zip(engine.store.owned_params(), masters, strict=True):
            torch.testing.assert_close(hp.master, m, rtol=0, atol=0)
            assert hp.master.grad is None or not hp.master.grad.any()
        engine.train_batch(iter([good]))  # training goes on after a skipped step
        engine.synchronize()
        assert engine.was_step_applied()
        assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    finally:
        engine.destroy()


@pytest.mark.parametrize("journal", ["on", "off"])
def test_optimizer_error_surfaces_at_next_call_naming_the_layer(journal: str) -> None:
    """(That a failed step is undone with a journal is checked in test_faults.py.)"""
    cfg = config(devices=2, async_optimizer=True, roundpipe={"step_journal": journal}, **CUTS)
    engine = engine_for(tiny_qwen3(0, layers=4), cfg)
    real = engine.optimizer.step_params
    target = engine.store.layers[2].owned[0].master

    def failing(params, **kw):
        if any(p is target for p in params):
            raise ValueError("injected")
        return real(params, **kw)

    engine.optimizer.step_params = failing
    try:
        batches = iter(_batches(6 * GAS))
        with pytest.raises(RuntimeError, match="layer 2"):
            for _ in range(4):  # the error appears at the first engine call after it happened
                engine.train_batch(batches)
            engine.synchronize()
        with pytest.raises(RuntimeError, match="layer 2"):
            # Journal off: the error stays (no hang, no training on weights half a step apart).
            # On: the step was undone and training goes on, so the fault strikes again.
            engine.train_batch(batches)
            assert journal == "on", "the error must stay without a journal"
            engine.synchronize()
    finally:
        engine.destroy()


@pytest.mark.parametrize("overlap", [False, True], ids=["drained", "overlap"])
def test_sync_optimizer_error_never_hangs_the_next_call(overlap: bool) -> None:
    rp = {"overlap_iterations": overlap}
    engine = engine_for(tiny_qwen3(0, layers=4), config(devices=2, roundpipe=rp, **CUTS))

    def failing(params, **kw):
        raise ValueError("injected")

    engine.optimizer.step_params = failing
    try:
        batches = iter(_batches(4 * GAS))
        if overlap:  # step 1 closes (and its optimizer runs) in the next call
            engine.train_batch(batches)
        with pytest.raises(RuntimeError, match="optimizer step failed on layer"):
            engine.train_batch(batches)
        for _ in range(2):
            with pytest.raises(RuntimeError, match="optimizer step failed"):
                engine.train_batch(batches)
    finally:
        engine.destroy()


def test_synchronize_publishes_latest_weights() -> None:
    """(That save_checkpoint waits for the steps in flight is checked in test_resume.py.)"""
    engine = engine_for(tiny_qwen3(0, layers=4), config(devices=2, async_optimizer=True, **CUTS))
    try:
        it = iter(_batches(3 * GAS))
        for _ in range(3):
            engine.train_batch(it)
        engine.synchronize()
        for hp in engine.store.owned_params():
            torch.testing.assert_close(hp.param.detach(), hp.master, rtol=0, atol=0)
        assert all(engine.store.version(i) == 3 for i in range(len(engine.store.layers)))
    finally:
        engine.destroy()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "drained"])
def test_tied_embedding_waits_for_its_owner_step(overlap: bool) -> None:
    """Tied input/output embeddings: the head stage's gradient lands in the embedding's buffer,
    owned by the prefix layer, whose async step may still be pending; the download must wait
    for that step (a slow optimizer makes the race certain), so results match the reference."""
    import time

    model, ref = tiny_qwen3(0, layers=4, tie=True), tiny_qwen3(0, layers=4, tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    batches = _batches(4 * GAS)
    expected = reference_losses(ref, batches, steps=4, gas=GAS, lr=1e-2, staleness=1)
    rp = OVERLAP if overlap else DRAINED
    cfg = config(devices=2, gas=GAS, lr=1e-2, async_optimizer=True, roundpipe=rp, **CUTS)
    engine = engine_for(model, cfg)
    assert engine.store.owner_layer(model.lm_head.weight) == 0
    assert engine._overlap is overlap and engine.store.weight_copies == (2 if overlap else 1)
    real = engine.optimizer.step_params

    def slow(params, **kw):
        time.sleep(0.05)  # a slow host optimizer: steps lag well behind the next iteration
        return real(params, **kw)

    engine.optimizer.step_params = slow
    try:
        it = iter(batches)
        got = [float(engine.train_batch(it)) for _ in range(4)]
    finally:
        engine.destroy()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
