"""Parity: rp_engine on 1..4 CPU virtual devices == plain PyTorch on one device (fp32).

Per-step losses and final weights, for a tiny Qwen3, a tiny Llama, an nn.Sequential MLP and a
LoRA-wrapped Qwen3, with dropout off and on (the engine seeds each layer's RNG from (step,
micro-batch, layer) and restores it for the recomputation; the reference uses the same seeds).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import (
    assert_same_weights,
    config,
    engine_for,
    reference_losses,
    run_losses,
    seeded_layers,
)
from models import lora_qwen3, mlp_batch, random_batch, tiny_llama, tiny_mlp, tiny_qwen3

STEPS, GAS = 5, 2

# (fwd_cuts, bwd_cuts) per device count for 4 decoder blocks: different shapes on purpose,
# including a head stage that holds a block (bwd_cuts[0] > 0) and more stages than devices.
CUTS = {
    1: ([4], [0, 4]),
    2: ([2, 2], [0, 2, 2]),
    3: ([3, 1], [1, 1, 2]),
    4: ([1, 2, 1], [0, 1, 1, 1, 1]),
}


def _lm_batches(vocab: int, n: int) -> list[dict[str, torch.Tensor]]:
    return [random_batch(vocab, batch=2, seq=12, seed=100 + i) for i in range(n)]


def _run_engine(model, batches, *, devices: int, dropout: bool, **kw) -> list[float]:
    fwd, bwd = CUTS[devices]
    cfg = config(devices=devices, gas=GAS, fwd_cuts=fwd, bwd_cuts=bwd, **kw)
    return run_losses(model, cfg, batches, steps=STEPS)


LM_FACTORIES = {"qwen3": tiny_qwen3, "llama": tiny_llama, "lora-qwen3": lora_qwen3}


# The device x dropout grid for one family; one case for each other family (every family's
# layers are checked stage by stage in test_model_layers.py).
LM_CASES = [("qwen3", d, p) for d in (1, 2, 3, 4) for p in (0.0, 0.1)] + [
    ("llama", 2, 0.1),
    ("lora-qwen3", 3, 0.0),
]


@pytest.mark.parametrize(("family", "devices", "dropout"), LM_CASES)
def test_causal_lm_matches_pytorch(family: str, devices: int, dropout: float) -> None:
    make = LM_FACTORIES[family]
    model, ref = make(0, layers=4, dropout=dropout), make(0, layers=4, dropout=dropout)
    batches = _lm_batches(128, STEPS * GAS)
    set_position = seeded_layers(ref) if dropout else None
    expected = reference_losses(ref, batches, steps=STEPS, gas=GAS, set_position=set_position)
    got = _run_engine(model, batches, devices=devices, dropout=dropout > 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert_same_weights(model, ref)


@pytest.mark.parametrize("devices", [1, 2, 3, 4])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_sequential_mlp_matches_pytorch(devices: int, dropout: float) -> None:
    model, ref = tiny_mlp(0, layers=5, dropout=dropout), tiny_mlp(0, layers=5, dropout=dropout)
    model.loss_fn = F.cross_entropy
    ref.loss_fn = F.cross_entropy
    batches = [mlp_batch(seed=i) for i in range(STEPS * GAS)]
    set_position = seeded_layers(ref) if dropout else None
    expected = reference_losses(
        ref, batches, steps=STEPS, gas=GAS, set_position=set_position,
        loss_of=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
    )  # fmt: skip
    got = _run_engine(model, batches, devices=devices, dropout=dropout > 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert_same_weights(model, ref)


def test_lora_frozen_base_gets_no_state() -> None:
    model = lora_qwen3(0, layers=4)
    engine = engine_for(model, config(devices=2, fwd_cuts=[2, 2], bwd_cuts=[0, 2, 2]))
    try:
        frozen = [p for p in model.parameters() if not p.requires_grad]
        before = [p.detach().clone() for p in frozen]
        engine.train_batch(iter(_lm_batches(128, GAS)))
        engine.synchronize()
        masters = {id(hp.param) for hp in engine.store.owned_params()}
        assert frozen and not any(id(p) in masters for p in frozen)
        state_params = sum(len(g["params"]) for g in engine.optimizer.param_groups)
        assert state_params == sum(1 for p in model.parameters() if p.requires_grad)
        for p, b in zip(frozen, before, strict=True):
            torch.testing.assert_close(p, b, rtol=0, atol=0)
    finally:
        engine.destroy()


@pytest.mark.parametrize("devices", [1, 3])
def test_imperative_loop_matches_train_batch(devices: int) -> None:
    """engine(batch); engine.backward(loss); engine.step() gives train_batch's losses/weights."""
    a, b = tiny_qwen3(0, layers=4), tiny_qwen3(0, layers=4)
    batches = _lm_batches(128, STEPS * GAS)
    fwd, bwd = CUTS[devices]
    cfg = config(devices=devices, gas=GAS, fwd_cuts=fwd, bwd_cuts=bwd)
    fast, slow = engine_for(a, cfg), engine_for(b, cfg)
    try:
        it = iter(batches)
        fast_losses = [float(fast.train_batch(it)) for _ in range(STEPS)]
        slow_losses = []
        for step in range(STEPS):
            total = 0.0
            for k in range(GAS):
                out = slow(**batches[step * GAS + k])
                scaled = slow.backward(out.loss)
                torch.testing.assert_close(scaled, out.loss.detach() / GAS)
                slow.step()
                total += float(out.loss.detach())
            slow_losses.append(total / GAS)
        fast.synchronize()
        slow.synchronize()
        torch.testing.assert_close(slow_losses, fast_losses, rtol=1e-5, atol=1e-6)
        assert_same_weights(a, b)
    finally:
        fast.destroy()
        slow.destroy()


@pytest.mark.parametrize("devices", [2, 4])
def test_mobius_schedule_runs_on_the_same_executor(devices: int) -> None:
    """The Mobius-style plan (blocks bound to devices, GPipe order, full recompute) trains with
    the same results as plain PyTorch: the benchmarks compare schedules on one engine."""
    model, ref = tiny_qwen3(0, layers=4), tiny_qwen3(0, layers=4)
    batches = _lm_batches(128, STEPS * GAS)
    expected = reference_losses(ref, batches, steps=STEPS, gas=GAS)
    engine = engine_for(model, config(devices=devices, gas=GAS, roundpipe={"schedule": "mobius"}))
    try:
        assert engine.planner.bwd_cuts == engine.planner.fwd_cuts[::-1]
        it = iter(batches)
        got = [float(engine.train_batch(it)) for _ in range(STEPS)]
        timeline = engine.last_timeline()
        engine.synchronize()
    finally:
        engine.destroy()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert_same_weights(model, ref)
    # bound: each forward stage always runs on the same device as its backward twin
    k = len(engine.planner.fwd_cuts)
    for s in range(k):
        fwd = {r.device for r in timeline if r.action.startswith(f"F{s}.")}
        twin = "H0." if s == k - 1 else f"B{k - 1 - s}."
        assert fwd == {r.device for r in timeline if r.action.startswith(twin)}


def test_partitioner_and_replan_keep_parity() -> None:
    """No cuts given: the partitioner chooses, the first iterations are profiled, the engine
    re-plans once; results stay those of plain PyTorch across the switch."""
    model, ref = tiny_qwen3(0, layers=6), tiny_qwen3(0, layers=6)
    batches = _lm_batches(128, STEPS * GAS)
    expected = reference_losses(ref, batches, steps=STEPS, gas=GAS)
    engine = engine_for(model, config(devices=3, gas=GAS, roundpipe={"profile_iterations": 2}))
    try:
        it = iter(batches)
        got = [float(engine.train_batch(it)) for _ in range(STEPS)]
        assert engine.planner.profile_left == 0  # profiled, then planned from measurements
        assert sum(engine.planner.fwd_cuts) == sum(engine.planner.bwd_cuts) == 6
        engine.synchronize()
    finally:
        engine.destroy()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert_same_weights(model, ref)


@pytest.mark.parametrize(("devices", "dropout"), [(1, 0.1), (2, 0.0)])
def test_resident_weights_keep_parity(devices: int, dropout: float) -> None:
    """Weights kept on a device across rounds (residency; rounds of one micro-batch, GAS 4):
    the later rounds run on the first round's upload and their gradients add up on the device
    with the earlier rounds', downloaded once; losses and weights still equal PyTorch's."""
    gas = 4
    model = tiny_qwen3(0, layers=4, dropout=dropout)
    ref = tiny_qwen3(0, layers=4, dropout=dropout)
    batches = _lm_batches(128, 3 * gas)
    set_position = seeded_layers(ref) if dropout else None
    expected = reference_losses(ref, batches, steps=3, gas=gas, set_position=set_position)
    fwd, bwd = CUTS[devices]
    rp = {"round_size": 1, "device_memory_gb": 1.0}
    engine = engine_for(model, config(devices=devices, gas=gas, fwd_cuts=fwd, bwd_cuts=bwd,
                                      roundpipe=rp))  # fmt: skip
    try:
        it = iter(batches)
        got = [float(engine.train_batch(it)) for _ in range(3)]
        engine.synchronize()
        assert engine.planner.resident
        slots = len(fwd) + len(bwd)
        assert engine.last_step_stats()["uploads"] < slots * gas  # fewer than one per round
    finally:
        engine.destroy()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert_same_weights(model, ref)
