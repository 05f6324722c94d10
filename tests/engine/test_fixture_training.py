"""Users' real configs drive the engine end to end: ZeRO-Infinity (bf16, WarmupDecayLR, W&B),
the Hugging Face "auto" config (filled as HF does), and the shipped ds_configs/."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from config_fixtures import DS_CONFIGS, _fixture
from models import random_batch, tiny_qwen3

import rp_engine
from rp_engine.config import hf_auto_values


def _train_two_steps(config, **kw) -> rp_engine.RoundPipeEngine:
    model = tiny_qwen3(0, layers=2)
    engine, *_ = rp_engine.initialize(model=model, config=config, **kw)
    gas = engine.gradient_accumulation_steps()
    mbs = engine.train_micro_batch_size_per_gpu()
    data = iter([random_batch(128, batch=mbs, seq=8, seed=i) for i in range(2 * gas)])
    losses = [float(engine.train_batch(data)) for _ in range(2)]
    assert all(torch.isfinite(torch.tensor(losses))) and engine.global_steps == 2
    return engine


def test_zero_infinity_fixture_trains_with_wandb_offline(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    raw = json.loads(_fixture("zero_infinity_cpu.json").read_text())
    raw["roundpipe"] = {"devices": "cpu:2"}
    with caplog.at_level(logging.INFO, logger="rp_engine"):
        engine = _train_two_steps(raw)
    try:
        run = engine.monitor._wandb  # W&B in the process may have been started by an earlier
        assert run is not None and run.offline  # test, so check the run, not a folder
        assert engine.bfloat16_enabled() and engine.zero_optimization_stage() == 3
        assert next(engine.module.parameters()).dtype == torch.bfloat16
        assert any("offload" in r.message for r in caplog.records)  # mapped, said in a log line
        assert engine.get_lr()[0] > 0  # WarmupDecayLR stepped
    finally:
        engine.destroy()


def test_hf_auto_fixture_trains_with_auto_values() -> None:
    auto = hf_auto_values(
        hidden_size=64, micro_batch_size=2, gradient_accumulation_steps=2, lr=1e-3,
        warmup_steps=2, total_steps=10,
    )  # fmt: skip
    engine = _train_two_steps(str(_fixture("hf_zero3_offload_auto.json")), auto_values=auto)
    engine.destroy()


def test_bad_aio_fixture_is_rejected_clearly() -> None:
    with pytest.raises(ValueError, match="top level"):
        rp_engine.initialize(
            model=tiny_qwen3(0, layers=2), config=str(_fixture("zero_infinity_nvme_bad_aio.json"))
        )


@pytest.mark.parametrize("path", sorted(DS_CONFIGS.glob("*.json")), ids=lambda p: p.name)
def test_shipped_configs_train(path: Path) -> None:
    raw = json.loads(path.read_text())
    raw.setdefault("roundpipe", {})["devices"] = "cpu:2"
    raw.pop("wandb", None)  # W&B is covered above
    auto = hf_auto_values(
        hidden_size=64, micro_batch_size=2, gradient_accumulation_steps=2, lr=1e-3,
        warmup_steps=2, total_steps=10,
    )  # fmt: skip
    _train_two_steps(raw, auto_values=auto).destroy()
