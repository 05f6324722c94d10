"""transformers' Trainer on rp_engine (``integrations.hf.enable()``) vs Trainer on real DeepSpeed.

Same tiny Qwen3, the shared all-"auto" ZeRO-Infinity config (params + optimizer offloaded to
CPU), same data: per-step losses, grad norms and learning rates agree (relative 1e-4), eval loss
too; ``save_model`` writes the same files with the same weights; resuming from a Trainer
checkpoint reproduces the uninterrupted run; DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``
reads our checkpoint. Each side runs in its own subprocess (``hf_trainer_run.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_close_named
from subprocess_helpers import run_json

ROOT = Path(__file__).resolve().parents[2]


def _auto_config() -> dict[str, Any]:
    """The shared all-"auto" ZeRO-Infinity fixture (../shared next to the repo, or
    RP_SHARED_DIR); else the repo's own all-"auto" ZeRO-Infinity config."""
    shared = [ROOT.parent / "shared"]
    if os.environ.get("RP_SHARED_DIR"):
        shared.append(Path(os.environ["RP_SHARED_DIR"]))
    for root in shared:
        path = root / "fixtures" / "ds_configs" / "hf_zero3_offload_auto.json"
        if path.is_file():
            return json.loads(path.read_text())  # type: ignore[no-any-return]
    fallback = ROOT / "ds_configs" / "zero3_offload_hf_auto.json"
    return json.loads(fallback.read_text())  # type: ignore[no-any-return]


CONFIG = _auto_config()
STEPS = 4


def run(spec: dict[str, Any]) -> dict[str, Any]:
    return run_json("hf_trainer_run.py", spec, timeout=900)  # type: ignore[no-any-return]


def spec(backend: str, root: Path, **extra: Any) -> dict[str, Any]:
    return {
        "backend": backend,
        "config": CONFIG,
        "steps": STEPS,
        "output_dir": str(root / f"out_{backend}"),
        "save_steps": 2,
        "evaluate": True,
        "save_model": str(root / f"model_{backend}"),
        "roundpipe": {"devices": "cpu:2", "async_optimizer": False},
        **extra,
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf_trainer")


@pytest.fixture(scope="module")
def deepspeed_run(root: Path) -> dict[str, Any]:
    return run(spec("deepspeed", root))


@pytest.fixture(scope="module")
def rp_run(root: Path) -> dict[str, Any]:
    return run(spec("rp_engine", root))


def assert_logs_match(ours: list[dict], theirs: list[dict]) -> None:
    assert [r["step"] for r in ours] == [r["step"] for r in theirs]
    for a, b in zip(ours, theirs, strict=True):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-12), (a["step"], key)


def test_trainer_matches_deepspeed(deepspeed_run: dict, rp_run: dict, root: Path) -> None:
    assert len(rp_run["log"]) == STEPS
    assert_logs_match(rp_run["log"], deepspeed_run["log"])
    assert rp_run["eval_loss"] == pytest.approx(deepspeed_run["eval_loss"], rel=1e-4)
    # a plain Trainer's loss-only evaluation ran through the engine (devices + fused head), the
    # host-resident module's forward was never called
    assert rp_run["eval_through_engine"] > 0 and rp_run["eval_host_forwards"] == 0
    # predict() needs logits: the host module gives them, the loss is the same
    assert rp_run["predict_host_forwards"] > 0
    assert rp_run["predict_logits_shape"] == deepspeed_run["predict_logits_shape"]
    assert rp_run["predict_loss"] == pytest.approx(deepspeed_run["predict_loss"], rel=1e-4)
    # enable() keeps zero.Init away: the model was built whole although TrainingArguments
    # (with a ZeRO-3 config) existed first.
    assert rp_run["partitioned_at_load"] is False
    # the plain Trainer's fast path: each optimizer step's micro-batches ran as ONE schedule
    # (announced up front from get_batch_samples), not one run per micro-batch and pass
    assert rp_run["training_runs"] == list(range(1, STEPS + 1))


def test_save_model_same_files_and_weights(deepspeed_run: dict, rp_run: dict, root: Path) -> None:
    from safetensors.torch import load_file

    assert rp_run["saved"] == deepspeed_run["saved"]
    ours = load_file(str(root / "model_rp_engine" / "model.safetensors"))
    theirs = load_file(str(root / "model_deepspeed" / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert_close_named(ours[name], theirs[name], name, rtol=1e-4, atol=1e-6)


def test_resume_from_trainer_checkpoint(rp_run: dict, root: Path) -> None:
    checkpoint = root / "out_rp_engine" / "checkpoint-2"
    resumed = run(
        spec(
            "rp_engine", root, output_dir=str(root / "out_resumed"), save_steps=None,
            evaluate=False, save_model=None, resume_from=str(checkpoint),
        )
    )  # fmt: skip
    # The log restarts from the checkpoint's trainer_state.json (steps 1-2), then trains 3-4.
    assert [r["step"] for r in resumed["log"]] == [1, 2, 3, 4]
    assert_logs_match(resumed["log"][2:], rp_run["log"][2:])


def test_deepspeed_reads_trainer_checkpoint(rp_run: dict, root: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    state = get_fp32_state_dict_from_zero_checkpoint(str(root / "out_rp_engine" / "checkpoint-4"))
    final = load_file(str(root / "model_rp_engine" / "model.safetensors"))
    assert set(final) <= set(state)
    for name, tensor in final.items():
        assert_close_named(state[name], tensor, name, rtol=0, atol=0)


def test_zero2_offload_without_optimizer_or_scheduler_section(root: Path) -> None:
    """Trainer builds torch AdamW (decay / no-decay groups; Accelerate maps it to DeepSpeedCPUAdam)
    and its own linear schedule, handed over as a callable; ZeRO-2 with optimizer offload."""
    cfg = {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
    }
    common = {"config": cfg, "save_steps": None, "evaluate": False, "save_model": None}
    theirs = run({**spec("deepspeed", root / "z2"), **common})
    ours = run({**spec("rp_engine", root / "z2"), **common})
    assert len(ours["log"]) == STEPS
    assert_logs_match(ours["log"], theirs["log"])
    # the linear decay reached the scheduler: not the warmup-only shape of the fixture config
    assert ours["log"][-1]["learning_rate"] < ours["log"][-2]["learning_rate"]


def test_fast_path_trainer_matches_deepspeed(deepspeed_run: dict, root: Path) -> None:
    """RoundPipeTrainer runs each optimizer step as one train_batch: DeepSpeed's numbers."""
    ours = run(
        spec(
            "rp_engine", root / "fast", save_steps=None, save_model=None, fast_path=True,
        )
    )  # fmt: skip
    assert ours["fast_path_steps"] == STEPS
    assert_logs_match(ours["log"], deepspeed_run["log"])
    # evaluated through the engine (devices + fused head), not the host module
    assert ours["eval_through_engine"] > 0
    assert ours["eval_loss"] == pytest.approx(deepspeed_run["eval_loss"], rel=1e-4)


def test_fast_path_logging_every_other_step_keeps_the_overlap(
    deepspeed_run: dict, root: Path
) -> None:
    """Trainer reads the gradient norm after every step; on the fast path it is read only for
    the rows Trainer logs (a drain there), so the steps in between overlap the next one, and
    the logged norms, learning rates and window losses are still DeepSpeed's."""
    ours = run(
        spec(
            "rp_engine", root / "logging", save_steps=None, save_model=None, fast_path=True,
            evaluate=False, logging_steps=2,
            roundpipe={"devices": "cpu:2", "async_optimizer": False, "profile_iterations": 0},
        )
    )  # fmt: skip
    theirs = {r["step"]: r for r in deepspeed_run["log"]}
    assert [r["step"] for r in ours["log"]] == [2, 4]
    for row in ours["log"]:
        step = row["step"]
        window = (theirs[step - 1]["loss"] + theirs[step]["loss"]) / 2
        assert row["loss"] == pytest.approx(window, rel=1e-4), step
        for key in ("grad_norm", "learning_rate"):
            assert row[key] == pytest.approx(theirs[step][key], rel=1e-4, abs=1e-12), (step, key)
    # steps 2 and 4 began with steps 1 and 3 still in flight; the logged rows drained 2
    assert ours["in_flight_at_start"] == [False, True, False, True]


def _stale_losses(steps: int, *, gas: int, lr: float, staleness: int) -> list[float]:
    """By hand (AdamW on gradients ``staleness`` steps old), the data in order, two samples a
    micro-batch; per-step mean losses."""
    from engine_helpers import reference_losses
    from hf_trainer_run import TokenData
    from models import tiny_qwen3

    data = TokenData(64, 16, 128)
    pairs = [(data[i], data[i + 1]) for i in range(0, 2 * steps * gas, 2)]
    batches = [{k: torch.stack([a[k], b[k]]) for k in a} for a, b in pairs]
    return reference_losses(
        tiny_qwen3(0, layers=2), batches, steps=steps, gas=gas, lr=lr, staleness=staleness
    )


def test_async_optimizer_trainer_follows_staleness_one(root: Path) -> None:
    """With the asynchronous optimizer (rp_engine's default) Trainer's losses are those of
    AdamW on gradients one step stale."""
    cfg = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
        },
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    }
    ours = run(
        {
            **spec("rp_engine", root / "async", save_steps=None, evaluate=False, save_model=None),
            "config": cfg, "roundpipe": {"devices": "cpu:2", "async_optimizer": True},
            "sampling": "sequential", "lr_scheduler_type": "constant", "warmup": 0,
            "weight_decay": 0.0, "max_grad_norm": 0.0, "lr": 1e-2, "steps": 5,
        }
    )  # fmt: skip
    got = [row["loss"] for row in ours["log"]]
    torch.testing.assert_close(
        got, _stale_losses(5, gas=2, lr=1e-2, staleness=1), rtol=1e-4, atol=0
    )
    # the test tells the two apart: the synchronous losses differ from step 3 on
    sync = _stale_losses(5, gas=2, lr=1e-2, staleness=0)
    assert all(abs(g - s) > 1e-3 * abs(s) for g, s in zip(got[2:], sync[2:], strict=True))
