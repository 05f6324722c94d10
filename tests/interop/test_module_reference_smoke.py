"""Self-check of issue 29's reference harness: real DeepSpeed (ZeRO-3, params and optimizer on
CPU, CPU Adam, fp32) trains every plain-module model of module_models.MODELS through
ds_module_reference.py, and its output is what the later rp_engine comparisons rely on.

All runs share one subprocess (one DeepSpeed import, one engine per run): per model, the right
number of finite losses that go down, and a first loss equal to the untrained model's loss
computed here (the child builds the very model and data this process builds); gradient
accumulation's global_steps; a discarded forward that changes nothing; the unused layer left
untouched; the tied weight held once; a checkpoint written where asked.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from module_models import MODELS, make_batches
from subprocess_helpers import run_json

N = 8  # micro-batches per run (enough for the loss to fall visibly at the default lr)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One child, all runs: {model name: result} plus the variant runs under their own keys."""
    ckpt = tmp_path_factory.mktemp("ds_module_ckpt")
    runs: dict[str, dict[str, Any]] = {name: {"model": name, "micro_batches": N} for name in MODELS}
    runs["linear_4/gas2"] = {"model": "linear_4", "micro_batches": N, "gas": 2}
    runs["linear_4/discard"] = {"model": "linear_4", "micro_batches": N,
                                "forward_without_backward_at": 3}  # fmt: skip
    runs["tied/save"] = {"model": "tied", "micro_batches": 4, "save_dir": str(ckpt)}
    out = run_json("ds_module_reference.py", {"runs": list(runs.values())}, timeout=600)
    return dict(zip(runs, out, strict=True))


@pytest.mark.parametrize("name", list(MODELS))
def test_each_model_trains_and_starts_from_the_same_model_and_data(
    results: dict[str, Any], name: str
) -> None:
    res = results[name]
    losses = res["losses"]
    assert len(losses) == N and all(math.isfinite(x) for x in losses), losses
    assert res["global_steps"] == list(range(1, N + 1)) and res["final_global_steps"] == N
    assert res["discarded_loss"] is None and res["checkpoint"] is None
    # decreasing-ish: the last three micro-steps' mean below the first three's
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    case = MODELS[name]
    batch = make_batches(name, 1)[0]
    with torch.no_grad():
        first = case.loss(case.build(0)(*case.inputs(batch)), batch)
    assert losses[0] == pytest.approx(float(first), rel=1e-6)


def test_gradient_accumulation_steps_counts_global_steps(results: dict[str, Any]) -> None:
    res = results["linear_4/gas2"]
    assert res["global_steps"] == [(k + 1) // 2 for k in range(N)]
    assert res["final_global_steps"] == N // 2
    assert all(math.isfinite(x) for x in res["losses"])
    # micro-step 1 comes before the first update: the untrained model's loss on batch 1
    case, batch = MODELS["linear_4"], make_batches("linear_4", 2)[1]
    with torch.no_grad():
        before_update = float(case.loss(case.build(0)(*case.inputs(batch)), batch))
    assert res["losses"][1] == pytest.approx(before_update, rel=1e-6)
    assert res["losses"][1] != pytest.approx(results["linear_4"]["losses"][1], rel=1e-3)


def test_forward_without_backward_changes_nothing(results: dict[str, Any]) -> None:
    plain, res = results["linear_4"], results["linear_4/discard"]
    assert res["discarded_loss"] == res["losses"][3]
    assert res["losses"] == plain["losses"]
    assert res["param_sums"] == plain["param_sums"]


def test_unused_layer_is_left_untouched(results: dict[str, Any]) -> None:
    res = results["linear_4_unused"]
    untrained = MODELS["linear_4_unused"].build(0)
    for key in ("unused.weight", "unused.bias"):
        initial = float(untrained.get_parameter(key).detach().double().sum())
        assert res["param_sums"][key] == pytest.approx(initial, rel=1e-12, abs=1e-12)
    # the unused layer is built after the used ones: the training is linear_4's
    assert res["losses"] == results["linear_4"]["losses"]


def test_tied_weight_is_one_parameter(results: dict[str, Any]) -> None:
    sums = results["tied"]["param_sums"]
    assert "embed.weight" in sums and "out.weight" not in sums


def test_checkpoint_is_written(results: dict[str, Any]) -> None:
    res = results["tied/save"]
    assert res["checkpoint"]["tag"] == "global_step4"
    root = Path(res["checkpoint"]["dir"])
    assert (root / "latest").read_text().strip() == "global_step4"
    files = {p.name for p in (root / "global_step4").iterdir()}
    assert any(f.endswith("model_states.pt") for f in files), files
    assert any(f.endswith("optim_states.pt") for f in files), files
