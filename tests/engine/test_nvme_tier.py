"""The NVMe optimizer tier changes where the state lives, never a result.

With ``offload_optimizer.device: "nvme"`` the fp32 masters and Adam moments stream through a few
buffers from a swap file (storage/optimizer_tier.py). The same CPU Adam kernel steps the same
bytes in the same order, so losses and final weights equal the host-resident engine's bit for
bit: sync and async, fp32 and bf16, clipping on and off, 1-3 devices, LoRA, both I/O engines.
Checkpoints move between the tiers both ways, and a mid-run resume equals the uninterrupted run.
"""

from __future__ import annotations

import copy
import os
from typing import Any

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

from rp_engine.storage.io_engine import AioEngine, ThreadEngine

CASES = {
    # name: (devices, async, bf16, clip, engine)
    "sync-fp32-1dev": (1, False, False, 1.0, "threads"),
    "async-bf16-2dev": (2, True, True, 1.0, "threads"),
    "async-fp32-3dev": (3, True, False, 1.0, "threads"),
    "async-bf16-2dev-noclip": (2, True, True, 0.0, "threads"),  # layers step during backward
    "sync-bf16-2dev-aio": (2, False, True, 1.0, "aio"),
    "async-bf16-2dev-aio": (2, True, True, 1.0, "aio"),
}


def _count_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """The file and size of every write the I/O engines hand to the OS (their ``_pwrite``,
    under the counting of ``IOEngine``): the bytes written, counted apart from the tiers'
    counters."""
    sizes: list[tuple[str, int]] = []
    for cls in (ThreadEngine, AioEngine):
        real = cls._pwrite

        def pwrite(self: Any, path: str, buffer: torch.Tensor, offset: int, real=real) -> None:
            real(self, path, buffer, offset)
            # list.append: atomic across the worker threads
            sizes.append((os.path.basename(path), buffer.numel()))

        monkeypatch.setattr(cls, "_pwrite", pwrite)
    return sizes


@pytest.mark.parametrize("case", list(CASES))
def test_tier_equals_host_resident_bit_for_bit(tmp_path, case: str, monkeypatch) -> None:
    devices, asyn, bf16, clip, io = CASES[case]
    if io == "aio":
        io = aio_engine()
    cfg = config(devices=devices, async_optimizer=asyn, clip=clip, lr=1e-2)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    model = tiny_qwen3(0)
    ref_losses, ref = run(copy.deepcopy(model), cfg)
    written = _count_writes(monkeypatch)
    losses, got = run(model, nvme_config(cfg, str(tmp_path), engine=io))
    assert losses == ref_losses
    assert_same(got["weights"], ref["weights"])
    stats, disk = got["io"]["stats"], got["io"]["disk"]
    # every layer's record is written once per step, after the initial write; with 2 buffers
    # for 6 layers most steps read their state back from the file
    assert stats.write_bytes == (STEPS + 1) * disk
    assert stats.read_bytes >= (STEPS - 1) * disk // 2
    assert not os.path.exists(got["io"]["path"]), "destroy removes the swap file"
    for key in ("nvme_read_bytes", "nvme_write_bytes", "nvme_busy_s", "nvme_total_write_bytes"):
        assert key in got["stats"], key
    # read after synchronize() (nvme_helpers.run), when every write-back has finished, in
    # both modes: the counter is every byte written, the last step's write-backs and (async)
    # the earlier steps' still in flight at the last step's close included; the gradient
    # tier's evictions (grads.swp: how many depends on timing) are in it too
    assert got["stats"]["nvme_total_write_bytes"] == sum(n for _, n in written)
    assert sum(n for f, n in written if f == "optimizer.swp") == (STEPS + 1) * disk
    assert {f for f, _ in written} <= {"optimizer.swp", "grads.swp"}
    assert "nvme_read_bytes" not in ref["stats"]


def test_lora_with_the_tier_equals_host_resident(tmp_path) -> None:
    cfg = config(devices=2, async_optimizer=True, clip=1.0, lr=1e-2, bf16={"enabled": True})
    model = lora_qwen3(0)
    ref_losses, ref = run(copy.deepcopy(model), cfg)
    losses, got = run(model, nvme_config(cfg, str(tmp_path)))
    assert losses == ref_losses
    assert_same(got["weights"], ref["weights"])
    # only the adapters have optimizer state: the swap file is a small fraction of the model
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert got["io"]["disk"] < 12 * trainable + 4096 * 2 * 20


def test_many_buffers_hold_the_state_without_reading(tmp_path) -> None:
    """With a buffer per layer, each step finds its layers' state still in the pool: the tier
    only writes (the reads are the same bytes, skipped)."""
    cfg = config(devices=2, async_optimizer=True, clip=1.0)
    model = tiny_qwen3(0)
    ref_losses, ref = run(copy.deepcopy(model), cfg)
    losses, got = run(model, nvme_config(cfg, str(tmp_path), buffers=8))
    assert losses == ref_losses
    assert_same(got["weights"], ref["weights"])
    assert got["io"]["stats"].read_bytes == 0


@pytest.mark.parametrize("save_tier,load_tier", [(True, True), (True, False), (False, True)])
def test_checkpoints_move_between_tiers_and_resume_exactly(tmp_path, save_tier, load_tier):
    """A mid-run resume equals the uninterrupted run, whichever tier saved and which loads."""
    cfg = config(devices=2, async_optimizer=True, clip=1.0, lr=1e-2, bf16={"enabled": True})
    nvme = nvme_config(cfg, str(tmp_path / "nvme"))
    (tmp_path / "nvme").mkdir()
    model = tiny_qwen3(0)
    straight, expected = save_and_go_on(copy.deepcopy(model), cfg, str(tmp_path / "ref"))
    ckpt = str(tmp_path / "ckpt")
    first = save_after(copy.deepcopy(model), nvme if save_tier else cfg, ckpt, 2)
    rest, weights = resume_from(tiny_qwen3(1), nvme if load_tier else cfg, ckpt, 3)  # other init
    assert first + rest == straight
    assert_same(weights, expected)


def test_zero_to_fp32_reads_a_tier_checkpoint(tmp_path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    cfg = config(devices=2, async_optimizer=True, clip=1.0, lr=1e-2)
    model = tiny_qwen3(0)
    engine = engine_for(model, nvme_config(cfg, str(tmp_path)))
    try:
        train(engine, 2)
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        names = {id(p): n for n, p in engine.module.named_parameters()}
        with engine.store.materialized(writable=False):
            masters = {names[id(hp.param)]: hp.master.clone() for hp in engine.store.owned_params()}
    finally:
        engine.destroy()
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))
    for name, master in masters.items():
        assert torch.equal(fp32[name], master), name


def test_masters_outside_a_step_hold_no_memory(tmp_path) -> None:
    """Between steps no master or moment owns memory: a read outside ``resident`` fails instead
    of returning stale numbers."""
    cfg = config(devices=2, async_optimizer=True, clip=1.0)
    engine = engine_for(tiny_qwen3(0), nvme_config(cfg, str(tmp_path)))
    try:
        train(engine, 2)
        engine.synchronize()
        inner = engine.host_optimizer.optimizer
        for hp in engine.store.owned_params():
            assert hp.master.untyped_storage().nbytes() == 0
            state = inner.state.get(hp.master, {})
            for kind in ("exp_avg", "exp_avg_sq"):
                if kind in state:
                    assert state[kind].untyped_storage().nbytes() == 0
        with engine.store.resident(1):
            owned = engine.store.layers[1].owned
            assert owned and all(hp.master.untyped_storage().nbytes() > 0 for hp in owned)
            assert all(inner.state[hp.master]["step"] == 2 for hp in owned)
    finally:
        engine.destroy()


def test_the_tier_refuses_an_optimizer_that_cannot_step_per_layer(tmp_path) -> None:
    cfg = config(devices=1)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    with pytest.raises(ValueError, match='offload_optimizer.device "nvme".*DeepSpeed\'s CPU Adam'):
        engine_for(tiny_qwen3(0), nvme_config(cfg, str(tmp_path)))
    assert not os.listdir(tmp_path)


def test_step_journal_on_is_refused_with_the_tier(tmp_path) -> None:
    cfg = config(devices=1, roundpipe={"step_journal": "on"})
    with pytest.raises(ValueError, match="step_journal"):
        engine_for(tiny_qwen3(0), nvme_config(cfg, str(tmp_path)))
    assert not os.listdir(tmp_path)
