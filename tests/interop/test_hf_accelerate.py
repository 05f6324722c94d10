"""A plain Accelerate loop on rp_engine (``integrations.hf.enable()``) vs on real DeepSpeed.

ZeRO-3 with params and optimizer offloaded, no optimizer section (the loop's torch AdamW is
used; with ``zero_force_ds_cpu_optimizer`` Accelerate maps it to DeepSpeedCPUAdam):
``DeepSpeedPlugin``, ``accumulate``, ``save_state``/``load_state`` and ``get_state_dict``.
Per-micro-batch losses agree (relative 1e-4), replaying after ``load_state`` reproduces the
run, ``get_state_dict`` returns the same weights and ``unwrap_model`` the Hugging Face model.
Each side runs in its own subprocess (``hf_accelerate_run.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_close_named
from subprocess_helpers import run_json


def config(force_ds_cpu_optimizer: bool) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": 1.0,
        "zero_force_ds_cpu_optimizer": force_ds_cpu_optimizer,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
        },
    }


def run(backend: str, root: Path, force: bool, **extra: Any) -> dict[str, Any]:
    tag = f"{backend}_{force}"
    spec = {
        "backend": backend,
        "config": config(force),
        "state_dir": str(root / f"state_{tag}"),
        "weights": str(root / f"weights_{tag}.pt"),
        "roundpipe": {"devices": "cpu:2", "async_optimizer": False},
        **extra,
    }
    return {**run_json("hf_accelerate_run.py", spec, timeout=900), "weights": spec["weights"]}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf_accelerate")


@pytest.fixture(scope="module")
def deepspeed_run(root: Path) -> dict[str, Any]:
    # With zero_force_ds_cpu_optimizer false DeepSpeed steps the loop's own torch AdamW.
    return run("deepspeed", root, False)


# False: rp_engine rebuilds the torch AdamW over its masters (the `decoupled_weight_decay`
# regression); True: Accelerate hands over a DeepSpeedCPUAdam (rp_engine's per-layer kernel).
@pytest.mark.parametrize("force_ds_cpu_optimizer", [False, True])
def test_accelerate_loop_matches_deepspeed(
    deepspeed_run: dict, root: Path, force_ds_cpu_optimizer: bool
) -> None:
    ours = run("rp_engine", root, force_ds_cpu_optimizer)
    assert len(ours["losses"]) == len(deepspeed_run["losses"]) == 8
    torch.testing.assert_close(ours["losses"], deepspeed_run["losses"], rtol=1e-4, atol=0)
    # load_state restored weights, optimizer and scheduler: the replay is the same run.
    torch.testing.assert_close(ours["replay"], ours["losses"][4:], rtol=1e-5, atol=0)
    assert ours["unwrapped"] == "Qwen3ForCausalLM"
    assert ours["lr"] == deepspeed_run["lr"]
    mine = torch.load(ours["weights"], weights_only=True)
    theirs = torch.load(deepspeed_run["weights"], weights_only=True)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert_close_named(mine[name], theirs[name], name, rtol=1e-4, atol=1e-6)
