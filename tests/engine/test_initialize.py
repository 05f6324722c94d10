"""The doors: initialize's arguments and return value, add_config_arguments, engine surface."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from engine_helpers import config
from models import random_batch, tiny_qwen3

import rp_engine
from rp_engine.config import ConfigError


def _tiny_cfg(**extra):
    return config(devices=1, gas=2, fwd_cuts=[2], bwd_cuts=[0, 2], **extra)


def test_returns_the_deepspeed_four_tuple() -> None:
    model = tiny_qwen3(0, layers=2)
    engine, optimizer, loader, scheduler = rp_engine.initialize(
        model=model, model_parameters=model.parameters(), config=_tiny_cfg()
    )
    try:
        assert optimizer is engine.optimizer and loader is None and scheduler is None
        assert engine.module is model and engine.config["gradient_accumulation_steps"] == 2
        assert isinstance(engine.get_lr(), list) and engine.get_global_grad_norm() is None
        assert engine.train_batch_size() == 4 and engine.gradient_accumulation_steps() == 2
        assert engine.train_micro_batch_size_per_gpu() == 2
        assert engine.zero_optimization_stage() == 0 and not engine.fp16_enabled()
        assert not engine.bfloat16_enabled() and engine.world_size == 1 and engine.local_rank == 0
        assert engine.get_input_embeddings() is model.get_input_embeddings()  # fall-through
    finally:
        engine.destroy()
        engine.destroy()  # idempotent


def test_config_from_args_path(tmp_path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text("// comments are fine\n" + json.dumps(_tiny_cfg()))
    parser = rp_engine.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=0)  # what the deepspeed launcher adds
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path), "--local_rank=0"])
    assert args.deepspeed and args.deepspeed_config == str(path)
    engine, *_ = rp_engine.initialize(args=args, model=tiny_qwen3(0, layers=2))
    engine.destroy()
    with pytest.raises((ValueError, AssertionError)):
        rp_engine.initialize(args=args, model=tiny_qwen3(0, layers=2), config=_tiny_cfg())
    with pytest.raises((ValueError, AssertionError), match="config"):
        rp_engine.initialize(model=tiny_qwen3(0, layers=2))


def test_client_optimizer_and_scheduler_override_the_config() -> None:
    model = tiny_qwen3(0, layers=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine, optimizer, _, scheduler = rp_engine.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=_tiny_cfg()
    )
    try:
        # stage 0, fp32: DeepSpeed returns the client's optimizer itself
        assert (
            optimizer is opt and engine.optimizer is opt and engine.host_optimizer.optimizer is opt
        )
        assert scheduler is sched and sched.optimizer is opt
        engine.train_batch(iter([random_batch(128, batch=2, seq=8, seed=i) for i in range(2)]))
        assert engine.get_lr() == [0.25]
    finally:
        engine.destroy()


def test_training_data_builds_the_loader() -> None:
    data = [random_batch(128, batch=1, seq=8, seed=i) for i in range(8)]
    items = [{k: v[0] for k, v in b.items()} for b in data]
    engine, _, loader, _ = rp_engine.initialize(
        model=tiny_qwen3(0, layers=2), config=_tiny_cfg(), training_data=items
    )
    try:
        assert loader is not None and next(iter(loader))["input_ids"].shape == (2, 8)
        loss = engine.train_batch()  # no iterator: the engine's own repeating loader
        assert torch.isfinite(loss) and engine.global_steps == 1
    finally:
        engine.destroy()


def test_unfilled_auto_names_the_key() -> None:
    cfg = {**_tiny_cfg(), "gradient_clipping": "auto"}
    with pytest.raises(ConfigError, match="gradient_clipping"):
        rp_engine.initialize(model=tiny_qwen3(0, layers=2), config=cfg)
    engine, *_ = rp_engine.initialize(
        model=tiny_qwen3(0, layers=2), config=cfg, auto_values={"gradient_clipping": 1.0}
    )
    assert engine.gradient_clipping() == 1.0
    engine.destroy()


def test_forward_twice_without_backward_is_allowed() -> None:
    """DeepSpeed allows a training-mode forward without backward (its graph is dropped at the
    next forward); a backward needs a forward before it (test_module_models.py checks the
    losses and weights are unchanged by the dropped forward)."""
    engine, *_ = rp_engine.initialize(model=tiny_qwen3(0, layers=2), config=_tiny_cfg())
    try:
        batch = random_batch(128, batch=2, seq=8)
        first = engine(**batch).loss
        second = engine(**batch).loss
        assert float(first) == float(second)
        engine.backward(second)
        engine.step()
        with pytest.raises(RuntimeError, match="needs a preceding engine.forward"):
            engine.backward(second)
    finally:
        engine.destroy()


def test_eval_forward_and_eval_batch() -> None:
    model = tiny_qwen3(0, layers=2)
    engine, *_ = rp_engine.initialize(model=model, config=_tiny_cfg())
    try:
        batch = random_batch(128, batch=2, seq=8)
        expected = float(model(**batch).loss.detach())
        engine.eval()
        with torch.no_grad():
            out = engine(**batch)
        assert float(out.loss) == pytest.approx(expected, rel=1e-5)
        mean = engine.eval_batch(iter([batch, batch]))
        assert float(mean) == pytest.approx(expected, rel=1e-5)
        assert engine.global_steps == 0 and engine.micro_steps == 0
    finally:
        engine.destroy()


def test_batch_without_labels_fails_at_the_door() -> None:
    engine, *_ = rp_engine.initialize(model=tiny_qwen3(0, layers=2), config=_tiny_cfg())
    try:
        batch = random_batch(128, batch=2, seq=8)
        batch.pop("labels")
        with pytest.raises(ValueError, match="labels"):
            engine(**batch)
        with pytest.raises(ValueError, match="labels"):
            engine.train_batch(iter([batch, batch]))
        assert engine.global_steps == 0
    finally:
        engine.destroy()


def test_failed_initialize_leaves_no_threads_behind() -> None:
    import threading

    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match="budget"):
        rp_engine.initialize(
            model=tiny_qwen3(0, layers=2),
            config=config(devices=2, roundpipe={"device_memory_gb": 1e-6}),
        )
    leaked = {t.name for t in threading.enumerate() if t.is_alive()} - before
    assert not {n for n in leaked if n.startswith(("rp-cpu", "rp-optimizer"))}, leaked


def test_a_multi_process_launch_without_its_rendezvous_variables_is_refused_clearly(
    monkeypatch,
) -> None:
    # WORLD_SIZE > 1 means data parallel (tests/engine/test_data_parallel.py); without RANK and the
    # master address no process group can form: say which variables and how to launch.
    monkeypatch.setenv("WORLD_SIZE", "4")
    for key in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="RANK, MASTER_ADDR, MASTER_PORT not set.*torchrun"):
        rp_engine.initialize(model=tiny_qwen3(0, layers=2), config=_tiny_cfg())
