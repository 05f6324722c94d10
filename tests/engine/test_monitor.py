"""Monitors: DeepSpeed-style CSV files, TensorBoard events and W&B's offline fallback, written
by a real run."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
import torch
from engine_helpers import config, engine_for
from models import random_batch, tiny_qwen3

from rp_engine.monitor import _start_wandb


def _three_steps(monitor: str, out: Path) -> list[float]:
    """Train 3 steps with one monitor section written to ``out/run1``; the losses."""
    section = {"enabled": True, "output_path": str(out), "job_name": "run1"}
    cfg = config(devices=1, fwd_cuts=[2], bwd_cuts=[0, 2], **{monitor: section})
    engine = engine_for(tiny_qwen3(0, layers=2), cfg)
    try:
        data = iter([random_batch(128, batch=2, seq=8, seed=i) for i in range(6)])
        return [float(engine.train_batch(data)) for _ in range(3)]
    finally:
        engine.destroy()


def test_csv_monitor_records_loss_and_lr(tmp_path) -> None:
    losses = _three_steps("csv_monitor", tmp_path)
    with open(tmp_path / "run1" / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "Train/Samples/train_loss"]
    assert [int(r[0]) for r in rows[1:]] == [4, 8, 12]  # global_samples, as DeepSpeed logs
    assert [float(r[1]) for r in rows[1:]] == losses
    assert (tmp_path / "run1" / "Train_Samples_lr.csv").exists()


def test_tensorboard_monitor_records_loss_where_deepspeed_writes(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses = _three_steps("tensorboard", tmp_path)
    log_dir = tmp_path / "run1"  # DeepSpeed's os.path.join(output_path, job_name)
    assert list(log_dir.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    assert {"Train/Samples/train_loss", "Train/Samples/lr"} <= set(acc.Tags()["scalars"])
    scalars = acc.Scalars("Train/Samples/train_loss")
    assert [s.step for s in scalars] == [4, 8, 12]  # global_samples, as DeepSpeed logs
    # event files store float32
    assert [s.value for s in scalars] == pytest.approx(losses, rel=1e-6)


def test_tensorboard_default_output_path_is_the_job_name_under_cwd(tmp_path, monkeypatch) -> None:
    from rp_engine.config import load_config
    from rp_engine.monitor import Monitor

    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        {"train_micro_batch_size_per_gpu": 1, "tensorboard": {"enabled": True, "job_name": "j"}}
    )
    monitor = Monitor.from_config(cfg)
    try:
        monitor.write_events([("Train/Samples/train_loss", 1.5, 2)])
    finally:
        monitor.close()
    assert list((tmp_path / "j").glob("events.out.tfevents.*"))  # DeepSpeed: join("", job_name)


def test_wandb_goes_offline_without_a_key(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))  # honoured when W&B starts in this test
    from rp_engine.config import load_config

    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "wandb": {"enabled": True}})
    run = _start_wandb(cfg)
    try:
        assert "WANDB_MODE" not in os.environ  # the choice is passed to wandb, not the process
        assert run.offline and not run.disabled
        run.log({"x": 1.0}, step=1)
        assert Path(run.dir).is_dir()  # files written locally, for `wandb sync` later
    finally:
        run.finish()


def test_cpu_adam_leaves_the_environment_alone(monkeypatch) -> None:
    from rp_engine.host.jit_cache import cpu_adam_cache_dir
    from rp_engine.optim.optimizer import build_inner_optimizer

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/some/where")
    assert cpu_adam_cache_dir() == "/some/where"  # the user's choice wins
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert cpu_adam_cache_dir().endswith(os.path.join("rp_engine", "torch_extensions"))
    p = torch.nn.Parameter(torch.zeros(4))
    _, per_layer = build_inner_optimizer("adamw", {"lr": 1e-3}, [{"params": [p]}])
    assert per_layer and "TORCH_EXTENSIONS_DIR" not in os.environ


def test_jit_builds_run_the_environments_own_ninja(monkeypatch) -> None:
    """Whatever PATH says, torch's JIT (which runs ``ninja`` off PATH) builds the engine's ops
    with the ninja package's binary (another ninja rebuilds the whole cache: jit_cache.py), and
    PATH is the user's again afterwards."""
    import shutil

    import ninja

    from rp_engine.host.jit_cache import extensions_dir, with_own_ninja

    own = str(ninja.BIN_DIR)
    users = os.pathsep.join(["/usr/bin", own, "/bin"])
    monkeypatch.setenv("PATH", users)
    with extensions_dir("/some/where"):
        assert os.environ["PATH"].split(os.pathsep) == [own, "/usr/bin", "/bin"]
        assert shutil.which("ninja") == os.path.join(own, "ninja")
    assert os.environ["PATH"] == users
    assert with_own_ninja("") == own
