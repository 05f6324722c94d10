"""The NVMe parameter tier changes where the compute weights live, never a result.

With ``offload_param.device: "nvme"`` every layer's compute weights sit in a swap file
(storage/param_tier.py); each upload reads its slot's records (ahead of it, as the plan's READ
actions queue them) and copies from the read buffers; the optimizer's publish writes them back.
The bytes uploaded are the bytes the host-resident engine uploads, so losses and final weights
equal its bit for bit: with and without the optimizer tier, sync and async, fp32 and bf16, 1-3
devices, LoRA, both I/O engines. Checkpoints move between the tiers both ways.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from engine_helpers import config, engine_for
from models import lora_qwen3, tiny_qwen3
from nvme_helpers import (
    STEPS,
    aio_engine,
    assert_same,
    nvme_config,
    resume_from,
    run,
    save_after,
    save_and_go_on,
    train,
)

from rp_engine.plan.actions import Op
from rp_engine.storage import NvmeSpaceError

CASES = {
    # name: (devices, async, bf16, clip, optimizer tier too, engine)
    "sync-fp32-1dev": (1, False, False, 1.0, True, "threads"),
    "async-bf16-2dev": (2, True, True, 1.0, True, "threads"),
    "async-fp32-3dev": (3, True, False, 1.0, True, "threads"),
    "async-bf16-2dev-noclip": (2, True, True, 0.0, True, "threads"),
    "async-bf16-2dev-params-only": (2, True, True, 1.0, False, "threads"),
    "sync-bf16-2dev-aio": (2, False, True, 1.0, True, "aio"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_param_tier_equals_host_resident_bit_for_bit(tmp_path, case: str) -> None:
    devices, asyn, bf16, clip, opt_tier, io = CASES[case]
    if io == "aio":
        io = aio_engine()
    cfg = config(devices=devices, async_optimizer=asyn, clip=clip, lr=1e-2)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    model = tiny_qwen3(0)
    ref_losses, ref = run(copy.deepcopy(model), cfg)
    nvme = nvme_config(cfg, str(tmp_path), engine=io, params=True, optimizer=opt_tier)
    losses, got = run(model, nvme)
    assert losses == ref_losses
    assert_same(got["weights"], ref["weights"])
    io_stats, disk = got["param_io"]["stats"], got["param_io"]["disk"]
    # written whole at start, then every step publishes each layer's new weights into one of
    # the buffers (two with the asynchronous optimizer: w_t and w_t-1 coexist on disk); the
    # uploads read them back, except what the pool still holds
    copies = 2 if asyn else 1
    assert io_stats.write_bytes >= disk + STEPS * disk // copies
    assert io_stats.read_bytes >= disk // copies
    assert not os.path.exists(got["param_io"]["path"]), "destroy removes the swap file"
    assert bool(got["io"]) == opt_tier
    assert got["stats"]["nvme_write_bytes"] > 0  # the last step's publishes


def test_lora_with_both_tiers_equals_host_resident(tmp_path) -> None:
    """Frozen base weights page too (read-only records, rewritten with the adapters)."""
    cfg = config(devices=2, async_optimizer=True, clip=1.0, lr=1e-2, bf16={"enabled": True})
    model = lora_qwen3(0)
    ref_losses, ref = run(copy.deepcopy(model), cfg)
    losses, got = run(model, nvme_config(cfg, str(tmp_path), params=True))
    assert losses == ref_losses
    assert_same(got["weights"], ref["weights"])


def test_paged_weights_hold_no_memory_and_plans_read_before_uploads(tmp_path) -> None:
    cfg = config(devices=2, async_optimizer=True, clip=1.0)
    engine = engine_for(tiny_qwen3(0), nvme_config(cfg, str(tmp_path), params=True))
    try:
        train(engine, 2)
        engine.synchronize()
        tier = engine.param_tier
        paged = [layer for layer in range(len(engine.store.layers)) if tier.paged(layer)]
        assert len(paged) >= len(engine.store.layers) - 1  # all but a layer of shared weights
        for layer in paged:
            for p in tier.plan.paged[layer]:
                assert p.untyped_storage().nbytes() == 0, "a paged weight owns no RAM"
        with engine.store.materialized(writable=False):
            assert all(p.untyped_storage().nbytes() > 0 for p in tier.plan.paged[paged[0]])
        plan = engine.planner.last_plan  # the last step's lowered plan
        uploads = [a for a in plan.actions if a.op is Op.UPLOAD]
        reads = [a for a in plan.actions if a.op is Op.READ]
        assert uploads and len(reads) == len(uploads)
        order = {a: i for i, a in enumerate(plan.actions)}
        for r in reads:
            key = (r.stage, r.microbatch, r.device, r.iteration)
            upload = next(
                u for u in uploads if (u.stage, u.microbatch, u.device, u.iteration) == key
            )
            assert order[r] < order[upload]
    finally:
        engine.destroy()


def test_max_in_cpu_keeps_the_first_layers_in_ram(tmp_path) -> None:
    cfg = config(devices=1)
    model = tiny_qwen3(0)
    ref_losses, _ = run(copy.deepcopy(model), cfg, steps=2)
    engine = engine_for(model, nvme_config(cfg, str(tmp_path), params=True, max_in_cpu=10**9))
    try:
        assert engine.param_tier is None, "everything fits in max_in_cpu: no tier"
    finally:
        engine.destroy()
    model = tiny_qwen3(0)
    layer_elems = sum(p.numel() for p in model.model.layers[0].parameters())
    nvme = nvme_config(cfg, str(tmp_path), params=True, max_in_cpu=2 * layer_elems)
    engine = engine_for(model, nvme)
    try:
        tier = engine.param_tier
        kept = [layer for layer in range(len(engine.store.layers)) if not tier.paged(layer)]
        assert 1 <= len(kept) < len(engine.store.layers) - 1
        assert tier.plan.cached_elements <= 2 * layer_elems
        assert train(engine, 2) == ref_losses
    finally:
        engine.destroy()


@pytest.mark.parametrize("save_tier,load_tier", [(True, False), (False, True)])
def test_checkpoints_move_between_tiers_and_resume_exactly(tmp_path, save_tier, load_tier):
    """A mid-run resume equals the uninterrupted run, whichever side has the weights on NVMe."""
    cfg = config(devices=2, async_optimizer=True, clip=1.0, lr=1e-2, bf16={"enabled": True})
    (tmp_path / "nvme").mkdir()
    nvme = nvme_config(cfg, str(tmp_path / "nvme"), params=True)
    model = tiny_qwen3(0)
    straight, expected = save_and_go_on(copy.deepcopy(model), cfg, str(tmp_path / "ref"))
    ckpt = str(tmp_path / "ckpt")
    first = save_after(copy.deepcopy(model), nvme if save_tier else cfg, ckpt, 2)
    rest, weights = resume_from(tiny_qwen3(1), nvme if load_tier else cfg, ckpt, 3)
    assert first + rest == straight
    assert_same(weights, expected)


def test_save_16bit_model_reads_the_weights_from_the_tier(tmp_path) -> None:
    cfg = config(devices=1, bf16={"enabled": True})
    model = tiny_qwen3(0)
    _, ref = run(copy.deepcopy(model), cfg, steps=2)
    engine = engine_for(model, nvme_config(cfg, str(tmp_path), params=True))
    try:
        train(engine, 2)
        engine.save_16bit_model(str(tmp_path / "out"))
    finally:
        engine.destroy()
    saved = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    for name, value in ref["weights"].items():
        assert torch.equal(saved[name], value), name


def test_a_bad_offload_param_path_is_named(tmp_path) -> None:
    cfg = nvme_config(config(devices=1), str(tmp_path / "missing"), params=True, optimizer=False)
    with pytest.raises(NvmeSpaceError, match="offload_param.nvme_path"):
        engine_for(tiny_qwen3(0), cfg)


def test_the_timeline_has_an_nvme_row(tmp_path) -> None:
    """The parameter tier's reads are in the run's timeline as READ actions on the "nvme"
    stream, drawn on the host's NVMe row as the simulator draws the plan's READs."""
    from rp_engine.plan.actions import HOST, parse_action
    from rp_engine.plan.render import measured_result

    cfg = config(devices=2, async_optimizer=False, clip=1.0)
    engine = engine_for(tiny_qwen3(0), nvme_config(cfg, str(tmp_path), params=True))
    try:
        train(engine, 2)
        timeline = engine.last_timeline()
    finally:
        engine.destroy()
    reads = [r for r in timeline if r.stream == "nvme"]
    assert reads, "every step reads weights back (2 buffers, 6 layers)"
    assert all(parse_action(r.action).op is Op.READ and r.end >= r.start for r in reads)
    drawn = measured_result(timeline)
    nvme = [i for i in drawn.intervals if i.lane == "nvme"]
    assert len(nvme) == len(reads) and all(i.device == HOST for i in nvme)
