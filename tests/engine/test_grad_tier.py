"""Bounded gradients: with the NVMe optimizer tier, fp32 gradients live in a small pool of
layer-sized buffers and spill to a gradient file (storage/grad_tier.py), never changing a result.

The pool here is as small as the engine allows (devices + 2 buffers) for models of 6-10 layers,
so gradients are evicted to the file and read back in every step: when the step's norm is needed
before any layer steps (clipping, the non-finite guard), across accumulation rounds, and for a
tied embedding whose gradient is open from the head's backward to the embedding's. Losses and
final weights equal the host-resident engine's bit for bit, and the tier's own I/O counters show
the spills happened (else the comparison would prove nothing).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from engine_helpers import config, engine_for
from models import tiny_qwen3
from nvme_helpers import assert_same, nvme_config, run

CASES: dict[str, dict[str, Any]] = {
    # async, bf16, clipping that binds, 2 rounds of 2 micro-batches each
    "async-bf16-clip-rounds": dict(devices=2, asyn=True, bf16=True, clip=0.05, round_size=2),
    # sync fp32, one device, no clipping but the default non-finite guard: the norm first
    "sync-fp32-1dev": dict(devices=1, asyn=False, bf16=False, clip=0.0),
    # layers step as their gradient lands (no guard, no clip): back-pressure, few spills
    "async-bf16-immediate": dict(devices=2, asyn=True, bf16=True, clip=0.0, guard="ignore"),
    # a tied embedding far larger than a layer: the big size class, 3 devices
    "async-bf16-3dev-tied-big": dict(devices=3, asyn=True, bf16=True, clip=1.0, vocab=4096),
}


def _model(case: dict[str, Any]) -> Any:
    vocab = case.get("vocab", 128)
    return tiny_qwen3(0, layers=8, vocab=vocab, tie=vocab > 128)


def _cfg(case: dict[str, Any]) -> dict[str, Any]:
    rp: dict[str, Any] = {"on_nonfinite": case.get("guard", "raise")}
    if "round_size" in case:
        rp["round_size"] = case["round_size"]
    cfg = config(
        devices=case["devices"], gas=4, async_optimizer=case["asyn"], clip=case["clip"],
        lr=1e-2, roundpipe=rp,
    )  # fmt: skip
    if case["bf16"]:
        cfg["bf16"] = {"enabled": True}
    return cfg


@pytest.mark.parametrize("name", list(CASES))
def test_pooled_gradients_equal_host_resident_bit_for_bit(tmp_path, name: str) -> None:
    case = CASES[name]
    model, cfg = _model(case), _cfg(case)
    ref_losses, ref = run(copy.deepcopy(model), cfg)
    tiered = nvme_config(cfg, str(tmp_path), buffers=4)
    tiered["roundpipe"]["grad_buffers"] = case["devices"] + 2  # the smallest pool allowed
    losses, got = run(model, tiered)
    assert losses == ref_losses
    assert_same(got["weights"], ref["weights"])
    grad_io = got["grad_io"]
    assert grad_io, "the gradient tier is on with the optimizer tier"
    if name != "async-bf16-immediate":
        # the norm is needed before any step: every layer's gradient is held at once, more
        # than the pool has, so records were evicted to the file and read back
        assert grad_io["stats"].write_bytes > 0
        assert grad_io["stats"].read_bytes > 0


def test_the_pool_is_on_with_the_tier_and_sized_by_the_devices(tmp_path) -> None:
    """null: 2 x devices + 4 buffers, whatever the depth; 0: the arena; too few: refused."""
    cfg = nvme_config(config(devices=2, async_optimizer=True), str(tmp_path))
    for layers in (4, 12):
        engine = engine_for(tiny_qwen3(0, layers=layers), copy.deepcopy(cfg))
        try:
            assert engine.grad_tier is not None and engine.grad_tier.buffer_count == 8
            assert engine.store.grads.arenas == []  # no whole-model arena
        finally:
            engine.destroy()
    off = copy.deepcopy(cfg)
    off["roundpipe"]["grad_buffers"] = 0
    engine = engine_for(tiny_qwen3(0), off)
    try:
        assert engine.grad_tier is None and engine.store.grads.arenas
    finally:
        engine.destroy()
    few = copy.deepcopy(cfg)
    few["roundpipe"]["grad_buffers"] = 3
    with pytest.raises(ValueError, match=r"roundpipe.grad_buffers = 3 .* at least 4"):
        engine_for(tiny_qwen3(0), few)
    no_tier = config(devices=2, roundpipe={"grad_buffers": 6})
    with pytest.raises(ValueError, match=r"roundpipe.grad_buffers = 6: .*offload_optimizer"):
        engine_for(tiny_qwen3(0), no_tier)
