"""Weight prediction (``roundpipe.staleness_compensation``: "predict", "lookahead" and
"lookahead_dc", which also delay-compensates the gradients) with the
engine's other features: the NVMe optimizer tier (the moments are staged in from the swap file
when the publish predicts), LoRA (only the adapters are stepped and predicted), fp16 loss scaling
(overflowing steps are skipped and publish the masters) and gradient clipping.

With the tier the result must be the host-resident one bit for bit, as for every other mode
(test_nvme_tier.py). Elsewhere there is no other implementation to equal, so the checks are:
prediction is active (the losses leave "none"'s once a predicted version is read), training
stays finite, and afterwards the module holds the true masters, not a prediction.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from engine_helpers import config, engine_for
from models import lora_qwen3, tiny_qwen3
from nvme_helpers import nvme_config, run, train

STEPS, GAS = 6, 2
CUTS = {"fwd_cuts": [2, 2], "bwd_cuts": [0, 2, 2]}


def _cfg(mode: str, **extra: Any) -> dict[str, Any]:
    return config(
        devices=2, gas=GAS, lr=1e-2, async_optimizer=True,
        roundpipe={"staleness_compensation": mode}, **CUTS, **extra,
    )  # fmt: skip


@pytest.mark.parametrize("method", ["predict", "lookahead", "lookahead_dc"])
def test_predict_with_the_nvme_tier_equals_host_resident(tmp_path, method: str) -> None:
    """The tier stages each layer's masters and moments in for its step and its publish, so
    the prediction reads the same moments as with everything in RAM: same losses, same
    weights, bit for bit."""
    model = tiny_qwen3(0, layers=4)
    host_losses, host = run(copy.deepcopy(model), _cfg(method), steps=STEPS)
    tier_losses, tier = run(
        copy.deepcopy(model), nvme_config(_cfg(method), str(tmp_path)), steps=STEPS
    )
    none_losses, _ = run(copy.deepcopy(model), _cfg("none"), steps=STEPS)
    assert tier["io"]["stats"].read_bytes > 0  # the moments did come from the swap file
    assert tier_losses == host_losses
    for name, w in host["weights"].items():
        assert torch.equal(tier["weights"][name], w), name
    assert host_losses != none_losses  # and prediction was on


def _train(model: torch.nn.Module, cfg: dict[str, Any], steps: int) -> tuple[list[float], Any]:
    engine = engine_for(model, cfg)
    losses = train(engine, steps)
    return losses, engine


@pytest.mark.parametrize("method", ["predict", "lookahead", "lookahead_dc"])
@pytest.mark.parametrize("case", ["lora", "fp16-overflow", "clipping"])
def test_predict_composes_and_leaves_the_masters_true(case: str, method: str) -> None:
    """LoRA, fp16 loss scaling whose first steps overflow (initial scale 2^20: skipped steps,
    which publish the masters, then a lower scale), and clipping at a norm the gradients
    exceed: the predict run's losses are finite and leave the "none" run's (prediction
    active), and after a drain every trained parameter holds its fp32 master."""
    extra: dict[str, Any] = {}
    if case == "fp16-overflow":
        extra["fp16"] = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 2}
    if case == "clipping":
        extra["clip"] = 0.05

    def model() -> torch.nn.Module:
        return lora_qwen3(0, layers=4) if case == "lora" else tiny_qwen3(0, layers=4)

    steps = 2 * STEPS if case == "fp16-overflow" else STEPS  # room after the skipped steps
    none_losses, none_engine = _train(model(), _cfg("none", **extra), steps)
    none_engine.destroy()
    losses, engine = _train(model(), _cfg(method, **extra), steps)
    try:
        assert engine.stepper.predicts
        assert all(math.isfinite(x) for x in losses), losses
        assert losses != none_losses
        if case == "fp16-overflow":  # the boundary this case is about did happen
            assert 0 < engine.skipped_steps < steps - 3, engine.skipped_steps
        module = engine.module  # drains; publishes the masters over any prediction
        trained = list(engine.store.owned_params())
        assert trained
        for hp in trained:
            assert torch.equal(hp.param.detach(), hp.master.to(hp.param.dtype)), hp.name
        if case == "lora":  # only the adapters are stepped (and so predicted)
            assert all("lora_" in hp.name for hp in trained if hp.param.requires_grad)
        assert module is engine.module
    finally:
        engine.destroy()


def test_delay_compensation_with_the_parameter_tier_equals_host_resident(tmp_path) -> None:
    """With the compute weights paged to NVMe, the weights an iteration read are in the tier's
    buffer that the step publishes into: it is read in before the compensation reads it (not
    taken as overwritten), so the result is the host-resident one bit for bit."""
    model = tiny_qwen3(0, layers=4)
    cfg = _cfg("lookahead_dc")
    host_losses, host = run(copy.deepcopy(model), cfg, steps=STEPS)
    tier_losses, tier = run(
        copy.deepcopy(model), nvme_config(cfg, str(tmp_path), params=True), steps=STEPS
    )
    assert tier["io"]["stats"].read_bytes > 0
    assert tier_losses == host_losses
    for name, w in host["weights"].items():
        assert torch.equal(tier["weights"][name], w), name
