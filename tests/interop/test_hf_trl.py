"""TRL's SFTTrainer on rp_engine (``integrations.hf.enable()``) vs SFTTrainer on real DeepSpeed.

A prompt/completion dataset (completion-only loss), ``loss_type="chunked_nll"`` (TRL's fused LM
head: rp_engine's head returns the per-token log-probs, entropy and top-1 hits), the shared
all-"auto" ZeRO-Infinity config. Per-step loss, grad norm, learning rate and TRL's own metrics
(entropy, mean token accuracy, token count) agree, and so does evaluation, which runs through
the engine, not the host module. Each side runs in its own subprocess (``hf_trl_run.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from subprocess_helpers import run_json
from test_hf_trainer import CONFIG

pytest.importorskip("trl")

STEPS = 4


def run(backend: str, root: Path, **extra: Any) -> dict[str, Any]:
    spec = {"backend": backend, "config": CONFIG, "steps": STEPS, "output_dir": str(root / backend)}
    return run_json("hf_trl_run.py", {**spec, **extra}, timeout=900)  # type: ignore[no-any-return]


def test_sft_trainer_matches_deepspeed(tmp_path: Path) -> None:
    theirs = run("deepspeed", tmp_path)
    ours = run("rp_engine", tmp_path, roundpipe={"devices": "cpu:2", "async_optimizer": False})
    assert [r["step"] for r in ours["log"]] == list(range(1, STEPS + 1))
    assert [r["step"] for r in theirs["log"]] == list(range(1, STEPS + 1))
    for a, b in zip(ours["log"], theirs["log"], strict=True):
        for key in ("loss", "grad_norm", "learning_rate", "entropy", "mean_token_accuracy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-12), (a["step"], key)
        assert a["num_tokens"] == b["num_tokens"]
    assert ours["log"][-1]["loss"] < ours["log"][0]["loss"]  # it trains
    # the plain SFTTrainer's fast path: one schedule per optimizer step, although TRL reads
    # every micro-batch's statistics in compute_loss, before its backward
    assert ours["training_runs"] == list(range(1, STEPS + 1))
    assert ours["eval"].keys() == theirs["eval"].keys()
    for key, value in theirs["eval"].items():
        assert ours["eval"][key] == pytest.approx(value, rel=1e-4, abs=1e-12), key
    # evaluation (TRL asks for the fused head's statistics) ran on the engine
    assert ours["eval_through_engine"] > 0 and ours["eval_host_forwards"] == 0
    # predict() needs logits: they come from the host module, the loss still matches
    assert ours["predict_host_forwards"] > 0
    assert ours["predict_logits_shape"] == theirs["predict_logits_shape"]
    assert ours["predict_loss"] == pytest.approx(theirs["predict_loss"], rel=1e-4)
