"""Issue 49: the optimizer tier steps a layer's state in slices smaller than the layer.

With ``roundpipe.optimizer_slice_mb`` (or a memory limit that needs it, host_preflight.py) the
NVMe optimizer tier's buffers carry pieces of a layer's fp32 masters and Adam moments, cut inside
tensors at multiples of CPU Adam's SIMD span, and the stepper steps them one after the other
(storage/optimizer_tier.py, ``HostOptimizer.step_segments``). Adam is elementwise: the losses
and weights equal the host-resident engine's bit for bit, and the pool's buffers are the
slice's size, not the layer's.
"""

from __future__ import annotations

import copy

import nvme_helpers as nvme
import pytest
from engine_helpers import config, engine_for
from models import tiny_qwen3

# tiny_qwen3's layers hold ~50K trainable parameters each (600 KiB of fp32 state): 60 KiB
# slices (5 x 1024 elements) cut every layer into ~10, the larger tensors among them in pieces
SLICE_MB = 60 / 1024


def _sliced(cfg: dict, folder: str, **kw) -> dict:
    out = nvme.nvme_config(cfg, folder, **kw)
    out["roundpipe"]["optimizer_slice_mb"] = SLICE_MB
    return out


@pytest.mark.parametrize(
    "asyn,bf16,compensation",
    [(True, True, "lookahead"), (False, False, "none"), (True, True, "predict")],
)
def test_sliced_tier_equals_host_resident_bit_for_bit(tmp_path, asyn, bf16, compensation) -> None:
    cfg = config(devices=2, async_optimizer=asyn, clip=1.0, lr=1e-2)
    cfg["roundpipe"]["staleness_compensation"] = compensation
    if bf16:
        cfg["bf16"] = {"enabled": True}
    model = tiny_qwen3(0)
    ref_losses, ref = nvme.run(copy.deepcopy(model), cfg)
    losses, got = nvme.run(model, _sliced(cfg, str(tmp_path)))
    assert losses == ref_losses
    nvme.assert_same(got["weights"], ref["weights"])


def test_the_pool_holds_slices_not_layers(tmp_path) -> None:
    """The buffers are a slice's size: every layer's state streams through pieces of it, and
    each step writes every layer's state once."""

    cfg = config(devices=2, async_optimizer=True, clip=1.0, lr=1e-2)
    engine = engine_for(tiny_qwen3(0), _sliced(cfg, str(tmp_path)))
    try:
        tier = engine.nvme_tier
        assert tier is not None
        layer_state = max(
            12 * sum(hp.master.numel() for hp in layer.owned) for layer in engine.store.layers
        )
        assert tier.buffer_bytes <= 2 * round(SLICE_MB * 2**20) < layer_state
        assert max(tier.slice_count(i) for i in range(len(engine.store.layers))) > 3
        # the gradients' records: the same pieces, whole tensors (a larger one alone)
        grads = engine.grad_tier
        assert grads is not None
        largest = max(4 * hp.master.numel() for hp in engine.store.owned_params())
        records = engine.store.group_bytes()
        assert len(records) > 2 * len(engine.store.layers)
        assert max(records) <= max(round(SLICE_MB * 2**20) // 3, largest)
        assert grads.pool.sizes.ordinary < layer_state // 3  # a layer's fp32 gradient
        before = tier.stats.write_bytes
        nvme.train(engine, 2)
        engine.synchronize()
        assert tier.stats.write_bytes - before == 2 * tier.disk_bytes
    finally:
        engine.destroy()


def test_a_sliced_run_resumes_exactly(tmp_path) -> None:
    """Checkpoints read the sliced state through the file mapping, layer by layer, and load
    it back the same way: a sliced run saved and resumed equals the host-resident run that
    saved and went on, and a host-resident checkpoint resumes in a sliced run."""
    cfg = config(devices=2, async_optimizer=True, clip=1.0, lr=1e-2, bf16={"enabled": True})
    (tmp_path / "swap").mkdir()
    sliced = _sliced(cfg, str(tmp_path / "swap"))
    model = tiny_qwen3(0)
    straight, expected = nvme.save_and_go_on(copy.deepcopy(model), cfg, str(tmp_path / "ref"))
    first = nvme.save_after(copy.deepcopy(model), sliced, str(tmp_path / "ckpt"), 2)
    rest, weights = nvme.resume_from(tiny_qwen3(1), sliced, str(tmp_path / "ckpt"), 3)
    assert first + rest == straight
    nvme.assert_same(weights, expected)
    rest, weights = nvme.resume_from(tiny_qwen3(1), sliced, str(tmp_path / "ref"), 3)
    assert rest == straight[2:]
    nvme.assert_same(weights, expected)


def test_delay_compensation_with_slices_is_refused_by_name(tmp_path) -> None:

    cfg = config(devices=2, async_optimizer=True, clip=1.0)
    cfg["roundpipe"]["staleness_compensation"] = "lookahead_dc"
    with pytest.raises(ValueError, match="optimizer_slice_mb"):
        engine_for(tiny_qwen3(0), _sliced(cfg, str(tmp_path)))
