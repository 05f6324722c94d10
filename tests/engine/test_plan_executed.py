"""One plan, executed: the executor runs the lowered plan, a slot serves a round of micro-batches
with one weight upload, and gradients accumulate on the device.

The bytes the devices measure are the bytes the plan says; rounds of M_R micro-batches keep
parity with plain PyTorch (fp32) and with per-micro-batch rounds (fp16 loss scaling).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import (
    assert_same_weights,
    config,
    engine_for,
    measured_peak_with_runs_in_flight,
    reference_losses,
    run_losses,
)
from models import mlp_batch, random_batch, tiny_mlp, tiny_qwen3

from rp_engine.plan.actions import Op
from rp_engine.plan.costs import LayerCosts
from rp_engine.plan.simulate import Machine, simulate
from rp_engine.plan.traffic import activation_traffic
from rp_engine.runtime.planning import ModelShape, Planner

GAS = 8


def _lm_batches(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return [random_batch(128, batch=2, seq=12, seed=seed + i) for i in range(n)]


def _model_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _tensor_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))


def _activation_costs(costs: LayerCosts, model: torch.nn.Module) -> LayerCosts:
    """The costs with one micro-batch's sizes: the batch, a boundary state (the prefix's output:
    hidden, rotary tables, labels...) and an upstream gradient (the hidden state)."""
    from rp_engine.model.layers import to_layers

    batch = _lm_batches(1)[0]
    with torch.no_grad():
        state = to_layers(model).prefix(dict(batch))
    return dataclasses.replace(
        costs,
        batch_bytes=_tensor_bytes(batch),
        boundary_bytes=_tensor_bytes(state),
        boundary_grad_bytes=_tensor_bytes({"hidden": state["hidden"]}),
    )


@pytest.mark.parametrize("round_size", [8, 4, 1])
def test_measured_traffic_is_the_plans(round_size: int) -> None:
    model = tiny_qwen3(0, layers=4)
    cfg = config(
        devices=2,
        gas=GAS,
        fwd_cuts=[2, 2],
        bwd_cuts=[1, 1, 2],
        roundpipe={"round_size": round_size},
    )
    engine = engine_for(model, cfg)
    try:
        engine.train_batch(iter(_lm_batches(GAS)))  # cold
        engine.train_batch(iter(_lm_batches(GAS, seed=50)))  # warm: the one measured
        stats = engine.last_step_stats()
        plan = engine.planner.last_plan
        costs = engine.planner.byte_costs()
    finally:
        engine.destroy()
    assert plan is not None
    simulated = simulate(plan, costs, machine=Machine("cpu", num_devices=2)).bytes_moved
    # every weight byte the devices received is one the plan uploads, and nothing else
    assert stats["weight_h2d_bytes"] == simulated["weights_h2d"]
    assert stats["uploads"] == sum(1 for a in plan.actions if a.op is Op.UPLOAD)
    assert stats["downloads"] == sum(1 for a in plan.actions if a.op is Op.DOWNLOAD)
    # and every activation byte is one the plan's traffic rules count (plan/traffic.py)
    traffic = activation_traffic(plan, _activation_costs(costs, model))
    assert stats["h2d_bytes"] == simulated["weights_h2d"] + traffic["act_h2d"]
    assert stats["d2h_bytes"] - stats["grad_d2h_bytes"] == traffic["act_d2h"]
    # one upload per slot and round: at most (2 + 0.5) x the model's weights per round
    rounds = GAS // round_size
    assert stats["weight_h2d_bytes"] <= 2.5 * _model_bytes(model) * rounds
    # and per-micro-batch uploads (the landed executor) would have moved GAS / M_R times more
    slots = len(plan.fwd_cuts) + len(plan.bwd_cuts)
    assert stats["uploads"] == slots * rounds


def test_device_bytes_are_counted_by_the_devices() -> None:
    """The stats come from the devices' own copy counters: a second run moves as much again."""
    engine = engine_for(tiny_qwen3(0, layers=2), config(devices=2, gas=4))
    try:
        engine.train_batch(iter(_lm_batches(4)))
        first = engine.last_step_stats()
        before = sum(d.memory_stats()["h2d_bytes"] for d in engine.pool)
        engine.train_batch(iter(_lm_batches(4, seed=9)))
        second = engine.last_step_stats()  # drains the step first: no copy still in flight
        after = sum(d.memory_stats()["h2d_bytes"] for d in engine.pool)
    finally:
        engine.destroy()
    assert second["h2d_bytes"] == after - before > 0
    assert second["weight_h2d_bytes"] == first["weight_h2d_bytes"]
    assert 0 < second["grad_d2h_bytes"] <= second["d2h_bytes"]
    assert set(second["busy_s"]) == {0, 1} and all(v > 0 for v in second["busy_s"].values())
    assert all(0 < f <= 1.0 for f in second["busy_fraction"].values())


# (devices, fwd_cuts, bwd_cuts): a head stage with no block and with several blocks
SHAPES = [
    (1, [4], [0, 4]),
    (2, [2, 2], [2, 1, 1]),
    (3, [3, 1], [1, 1, 2]),
]


@pytest.mark.parametrize("round_size", [1, 2, 4])
@pytest.mark.parametrize(("devices", "fwd", "bwd"), SHAPES)
def test_rounds_keep_parity_with_pytorch(devices: int, fwd, bwd, round_size: int) -> None:
    steps, gas = 3, 4
    model, ref = tiny_qwen3(0, layers=4), tiny_qwen3(0, layers=4)
    batches = _lm_batches(steps * gas, seed=100)
    expected = reference_losses(ref, batches, steps=steps, gas=gas)
    cfg = config(
        devices=devices, gas=gas, fwd_cuts=fwd, bwd_cuts=bwd, roundpipe={"round_size": round_size}
    )
    got = run_losses(model, cfg, batches, steps=steps)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert_same_weights(model, ref)


def _fp16_losses(
    devices: int, round_size: int, *, resident: bool = False
) -> tuple[list[float], list[torch.Tensor]]:
    model = tiny_mlp(0, layers=4)
    model.loss_fn = F.cross_entropy
    cfg = config(
        devices=devices,
        gas=4,
        fwd_cuts=[2, 1],
        bwd_cuts=[1, 1, 1],
        fp16={"enabled": True, "initial_scale_power": 12},
        roundpipe={"round_size": round_size, **({"device_memory_gb": 1.0} if resident else {})},
    )
    engine = engine_for(model, cfg)
    try:
        assert bool(engine.planner.resident) == resident
        batches = iter([mlp_batch(seed=i) for i in range(12)])
        losses = [float(engine.train_batch(batches)) for _ in range(3)]
        engine.synchronize()
        weights = [p.detach().float().clone() for p in model.parameters()]
        assert engine.optimizer.cur_scale > 1.0  # loss scaling really was on
    finally:
        engine.destroy()
    return losses, weights


@pytest.mark.parametrize("devices", [1, 2])
def test_fp16_rounds_match_per_microbatch_accumulation(devices: int) -> None:
    """fp16 with loss scaling: gradients summed on the device over a round (in fp32 from the
    second micro-batch on) equal the per-micro-batch fp32 host accumulation."""
    base_losses, base_weights = _fp16_losses(devices, 1)
    for round_size in (2, 4):
        losses, weights = _fp16_losses(devices, round_size)
        torch.testing.assert_close(losses, base_losses, rtol=1e-6, atol=0)
        for a, b in zip(weights, base_weights, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_fp16_resident_rounds_match_per_microbatch_accumulation() -> None:
    """fp16 with loss scaling, cpu:1, rounds of one micro-batch kept resident: the gradients
    of the step's rounds add up on the device (fp32 from the second on) and come down once,
    equal to downloading each round's."""
    base_losses, base_weights = _fp16_losses(1, 1)
    losses, weights = _fp16_losses(1, 1, resident=True)
    torch.testing.assert_close(losses, base_losses, rtol=1e-6, atol=0)
    for a, b in zip(weights, base_weights, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_round_size_must_divide_the_accumulation_steps() -> None:
    with pytest.raises(ValueError, match=r"roundpipe\.round_size 3 .*divisor.*8"):
        engine_for(tiny_qwen3(0, layers=2), config(devices=2, gas=8, roundpipe={"round_size": 3}))


def test_round_size_fits_the_device_budget() -> None:
    """With a budget and no round size the planner starts with rounds of one micro-batch; once
    a boundary state is measured, M_R is the largest divisor of GAS whose 2 x M_R states fit
    beside the weights and gradients its leanest plan validates (no residency, no prefetch).
    A given size that cannot fit is an error naming roundpipe.round_size."""
    shape = ModelShape(4, True, (100_000,) * 4, 50_000, 40_000)
    kw = {"num_devices": 2, "num_microbatches": 8, "fwd_cuts": (2, 2), "bwd_cuts": (0, 2, 2)}
    state = 200_000  # activations dominate: the round size is what the budget limits

    def weights(size: int) -> int:  # what the leanest plan of rounds of ``size`` validates
        planner = Planner(shape, **kw, memory_budget_bytes=2**30)
        return planner.validated_peak(round_size=size, prefetch_depth=0, resident=())

    # room for rounds of 2 (and 1), not of 4 or 8 (the validated weights change with M_R too)
    budget = max(weights(1) + 2 * state, weights(2) + 4 * state) + state // 2
    assert weights(4) + 8 * state > budget and weights(8) + 16 * state > budget
    planner = Planner(shape, **kw, memory_budget_bytes=budget)
    assert planner.round_size == 1  # safe until a state has been measured
    planner.fit_round_size(state)
    assert planner.round_size == 2
    ample = Planner(shape, **kw, memory_budget_bytes=2**30)
    ample.fit_round_size(state)
    assert ample.round_size == 8  # one upload per slot and step
    given = Planner(shape, **kw, round_size=8, memory_budget_bytes=budget)
    with pytest.raises(ValueError, match=r"roundpipe\.round_size 8 does not fit .* use 2"):
        given.fit_round_size(state)


def test_engine_fits_its_round_after_the_first_step() -> None:
    cfg = config(devices=2, gas=4, roundpipe={"device_memory_gb": 1.0})
    engine = engine_for(tiny_qwen3(0, layers=2), cfg)
    try:
        assert engine.planner.round_size == 1
        engine.train_batch(iter(_lm_batches(4)))
        assert engine.planner.round_size == 4  # a 1 GiB budget holds every round
    finally:
        engine.destroy()


def _resident_engine(devices: int, gas: int, **rp: object):
    """A tiny Qwen3 whose plan keeps weights resident (a 1 GiB budget holds them all), in rounds
    of one micro-batch: without residency each slot would upload once per round."""
    cfg = config(
        devices=devices,
        gas=gas,
        fwd_cuts=[2, 2],
        bwd_cuts=[1, 1, 2],
        roundpipe={"round_size": 1, "device_memory_gb": 1.0, **rp},
    )
    return engine_for(tiny_qwen3(0, layers=4), cfg)


def test_resident_weights_upload_once_per_step_on_one_device() -> None:
    """cpu:1, rounds of one micro-batch: with residency each slot's weights go up once per step
    (not once per round), its gradients come down once, and the devices' bytes are the plan's."""
    engine = _resident_engine(1, GAS)
    try:
        engine.train_batch(iter(_lm_batches(GAS)))  # cold
        engine.train_batch(iter(_lm_batches(GAS, seed=50)))  # warm: the one measured
        stats = engine.last_step_stats()
        plan = engine.planner.last_plan
        costs = engine.planner.byte_costs()
        assert engine.planner.resident
    finally:
        engine.destroy()
    assert plan is not None
    slots = plan.num_slots
    assert stats["uploads"] == sum(1 for a in plan.actions if a.op is Op.UPLOAD) == slots
    assert stats["downloads"] == sum(1 for a in plan.actions if a.op is Op.DOWNLOAD)
    assert stats["downloads"] == len(plan.bwd_cuts)
    simulated = simulate(plan, costs, machine=Machine("cpu", num_devices=1)).bytes_moved
    st = costs.stages(plan.fwd_cuts, plan.bwd_cuts)
    assert stats["weight_h2d_bytes"] == simulated["weights_h2d"] == sum(st.param_bytes)
    traffic = activation_traffic(plan, _activation_costs(costs, tiny_qwen3(0, layers=4)))
    assert stats["h2d_bytes"] == simulated["weights_h2d"] + traffic["act_h2d"]


def test_resident_slots_on_two_devices_reuse_their_upload() -> None:
    """cpu:2 with 5 slots: a slot lands on the same device every other round, and keeps its
    weights there; uploads are the plan's, half the rounds' count."""
    engine = _resident_engine(2, 4)
    try:
        engine.train_batch(iter(_lm_batches(4)))
        engine.train_batch(iter(_lm_batches(4, seed=50)))
        stats = engine.last_step_stats()
        plan = engine.planner.last_plan
        costs = engine.planner.byte_costs()
    finally:
        engine.destroy()
    assert plan is not None
    simulated = simulate(plan, costs, machine=Machine("cpu", num_devices=2)).bytes_moved
    assert stats["weight_h2d_bytes"] == simulated["weights_h2d"]
    assert stats["uploads"] == sum(1 for a in plan.actions if a.op is Op.UPLOAD)
    assert stats["uploads"] == plan.num_slots * 4 // 2  # one per slot and device, not per round


@pytest.mark.parametrize("overlap", [False, True], ids=["drained", "overlapped"])
def test_measured_device_peak_is_within_the_validated_one(overlap: bool) -> None:
    """Prefetch depth 2, rounds of one micro-batch: what a device really holds stays within what
    the planner validated (weights and gradients, every timing) plus the 2 x M_R boundary states
    it reserves for activations. The walk used to count an upload at its place in the device's
    order, though it starts as soon as its gate is freed: measured 954 KB, validated 676 KB.
    Overlapped, with two runs in flight (the earlier one's last backward slots held): the next
    run's first uploads used to start at once, beside the earlier run's last weights and
    gradients (measured 1.25 MB against 954 KB + 18 KB); they now wait for its FREEs by the prefetch
    rule, which the validated peak walks over the two runs."""
    engine = engine_for(
        tiny_qwen3(0, layers=16),
        config(devices=2, gas=2, fwd_cuts=[2] * 8, bwd_cuts=[0] + [1] * 16,
               roundpipe={"device_memory_gb": 1.0, "round_size": 1, "on_nonfinite": "ignore",
                          "overlap_iterations": overlap}),
    )  # fmt: skip
    try:
        engine.planner.set_residency(False)
        assert engine.planner.prefetch_depth == 2 and engine._overlap == overlap
        measured = measured_peak_with_runs_in_flight(engine, lambda i: _lm_batches(2, 10 * i))
        planner = engine.planner
        claimed = planner.validated_peak() + 2 * planner.round_size * planner.boundary_bytes
    finally:
        engine.destroy()
    assert planner.round_size == 1 and planner.boundary_bytes > 0
    assert measured <= claimed, (measured, claimed)


def test_a_tight_budget_keeps_some_slots_resident() -> None:
    """A budget that holds some slots' weights across the step but not all: the planner keeps
    the smallest resident (the most that fit), validated, and no slot that never comes back."""
    shape = ModelShape(4, True, (100_000,) * 4, 50_000, 40_000)
    kw = {"num_devices": 1, "num_microbatches": 4, "fwd_cuts": (2, 2), "bwd_cuts": (1, 1, 2)}
    ample = Planner(shape, **kw, round_size=1, memory_budget_bytes=2**30)
    assert sorted(ample.resident) == list(range(5)) and ample.prefetch_depth == 2
    none = ample.validated_peak(prefetch_depth=1, resident=())
    every = ample.validated_peak(prefetch_depth=1)
    budget = (none + every) // 2
    tight = Planner(shape, **kw, round_size=1, memory_budget_bytes=budget)
    assert 0 < len(tight.resident) < 5 and tight.prefetch_depth == 1
    assert tight.validated_peak() <= budget
    sizes = ample._estimate().stages((2, 2), (1, 1, 2)).param_bytes
    assert max(sizes[s] for s in tight.resident) <= min(
        sizes[s] for s in range(5) if s not in tight.resident
    )
    whole = Planner(shape, **kw, round_size=4, memory_budget_bytes=2**30)  # nothing comes back
    assert whole.resident == ()
