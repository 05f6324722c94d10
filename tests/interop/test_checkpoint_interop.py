"""Checkpoints go both ways with DeepSpeed (issue 18): rp_engine -> DeepSpeed's own engine.

rp_engine trains two steps with a DeepSpeed config (fp32 ZeRO-2; fp32 ZeRO-3 with parameters and
optimizer offloaded to CPU; fp16 ZeRO-1 with dynamic loss scaling) and saves. DeepSpeed 0.19.8, built from the same config in a subprocess,
``load_checkpoint``s it (optimizer and scheduler states included) and trains on; a fresh
rp_engine loads the same checkpoint and trains on the same batches. Checked:

- what DeepSpeed's ZeRO optimizer holds after loading is exactly rp_engine's state: its flat fp32
  partitions are the masters, the inner optimizer's flat Adam moments and step are rp_engine's;
- counters, client state, learning rate and the loss scaler carry over;
- the losses of both continuations agree (relative 1e-4) over three steps with a nonzero
  learning rate, so the moments matter.

The other direction (DeepSpeed-written checkpoints resumed by rp_engine, also fp16 with its loss
scale) is in test_checkpoint_safety.py. The learning rate of every step is nonzero
(``warmup_min_lr`` > 0): a zero first-step rate would leave the weights, hence the losses, blind
to the moments.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import engine_for
from models import random_batch, tiny_qwen3

HERE = Path(__file__).resolve().parents[1] / "support"  # ds_resume.py and its helpers
LAYERS, HIDDEN, VOCAB = 2, 32, 64
TRAIN_SEEDS, CONTINUE_SEEDS = [7, 8], [60, 61, 62]


# Case -> (ds_checkpoints config, extra zero_optimization keys, tied embeddings). The last one
# splits ZeRO-3's flat fp32 into several sub-groups (sub_group_size) and ties lm_head to the
# embedding (one master under two names; ZeRO-3 placeholders for both).
CASES: dict[str, tuple[str, dict[str, Any], bool]] = {
    "zero2": ("zero2", {}, False),
    "zero3_offload": ("zero3_offload", {}, False),
    # beyond the two: DeepSpeed's DynamicLossScaler object is written and resumed (fp16
    # losses met 1e-4 too on this CPU)
    "fp16_dynamic": ("fp16_dynamic", {}, False),
    "zero3_subgroups_tied": ("zero3_offload", {"sub_group_size": 6000}, True),
    # stage 0 fp32: DeepSpeed's plain torch optimizer reads its state from the model file
    "zero0": ("zero0", {}, False),
}


def _config(case: str) -> dict[str, Any]:
    import ds_checkpoints

    name, zero, _ = CASES[case]
    cfg = ds_checkpoints.config(name)
    # Synchronous optimizer: DeepSpeed's semantics step for step (the asynchronous one runs the
    # next forward on weights one step stale).
    return {
        **cfg,
        "zero_optimization": {**cfg["zero_optimization"], **zero},
        "roundpipe": {"devices": "cpu:1", "fwd_cuts": [LAYERS], "bwd_cuts": [0, LAYERS],
                      "async_optimizer": False},
    }  # fmt: skip


def _train(engine: Any, seeds: list[int]) -> list[float]:
    losses = [
        float(engine.train_batch(iter([random_batch(VOCAB, batch=2, seq=8, seed=s)])))
        for s in seeds
    ]
    engine.synchronize()
    return losses


def _model(case: str, seed: int) -> Any:
    return tiny_qwen3(seed, layers=LAYERS, hidden=HIDDEN, vocab=VOCAB, tie=CASES[case][2])


def _deepspeed_resume(case: str, load_dir: Path, state_out: Path) -> dict[str, Any]:
    name, zero, tie = CASES[case]
    spec = {"config": name, "zero": zero, "load": str(load_dir), "layers": LAYERS,
            "hidden": HIDDEN, "vocab": VOCAB, "tie": tie, "seeds": CONTINUE_SEEDS,
            "state_out": str(state_out)}  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1])])}
    proc = subprocess.run(
        [sys.executable, str(HERE / "ds_resume.py"), json.dumps(spec)],
        capture_output=True, text=True, env=env, timeout=1200, cwd=HERE,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON:")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][5:])


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_deepspeed_resumes_an_rp_engine_checkpoint(tmp_path: Path, name: str) -> None:
    first = engine_for(_model(name, 0), _config(name))
    try:
        _train(first, TRAIN_SEEDS)
        first.save_checkpoint(str(tmp_path / "ckpt"), client_state={"epoch": 3})
        # rp_engine's state at the save, flattened in DeepSpeed's order (parameter order, dp=1)
        owned = [hp for hp in first.store.owned_params() if hp.master.numel()]
        masters = torch.cat([hp.master.reshape(-1) for hp in owned])
        moments = {
            k: torch.cat([first.optimizer.state[hp.master][k].reshape(-1) for hp in owned])
            for k in ("exp_avg", "exp_avg_sq")
        }
        steps = {int(first.optimizer.state[hp.master]["step"]) for hp in owned}
        scaler = first.optimizer.loss_scaler.state_dict()
    finally:
        first.destroy()
    assert steps == {len(TRAIN_SEEDS)}

    second = engine_for(_model(name, 1), _config(name))
    try:
        second.load_checkpoint(str(tmp_path / "ckpt"))
        ours = _train(second, CONTINUE_SEEDS)
        our_lr = second.get_lr()
    finally:
        second.destroy()

    report = _deepspeed_resume(name, tmp_path / "ckpt", tmp_path / "ds_state.pt")
    assert report["global_steps"] == len(TRAIN_SEEDS)
    assert report["global_steps_after"] == len(TRAIN_SEEDS) + len(CONTINUE_SEEDS)
    assert report["client_state"]["epoch"] == 3
    if name == "fp16_dynamic":  # the loss scale and its counters carry over
        assert scaler["dynamic"] and scaler["cur_iter"] == len(TRAIN_SEEDS)
        for key, value in scaler.items():
            assert report["loss_scaler"][key] == value, key
    elif name == "zero0":  # DeepSpeed has no loss scaler without fp16/bf16 at stage 0
        assert report["loss_scaler"] == {}
    else:
        assert report["loss_scaler"] == {"cur_scale": 1.0, "dynamic": False}

    # What DeepSpeed's ZeRO optimizer holds after load_checkpoint: exactly rp_engine's state.
    loaded = torch.load(tmp_path / "ds_state.pt", weights_only=True)
    # one param group, dp = 1: the flat partitions (several ZeRO-3 sub-groups) in a row
    flat = torch.cat(loaded["flats"])
    n = masters.numel()
    assert (len(loaded["flats"]) > 1) == (name == "zero3_subgroups_tied")
    assert torch.equal(flat[:n], masters) and not flat[n:].any()
    for key, expected in moments.items():
        got = torch.cat([st[key] for st in loaded["state"]])
        assert torch.equal(got[:n], expected), key
    assert {int(st["step"]) for st in loaded["state"]} == {len(TRAIN_SEEDS)}

    torch.testing.assert_close(report["losses"], ours, rtol=1e-4, atol=0)
    torch.testing.assert_close(report["lr"], our_lr, rtol=1e-12, atol=0)
