"""Data parallel over torch.distributed (rp_engine/distributed.py): two gloo processes on
localhost, launched by ``torchrun --nproc_per_node 2``, against one process on the same global
batch; checkpoints across world sizes; a collective that times out names the rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_close_named

from rp_engine.distributed import balance_layers

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # dp_run.py and its helpers
STEPS = 4


def _run(spec: dict[str, Any], nproc: int, *, timeout: float = 300) -> dict[str, Any]:
    """Run tests/support/dp_run.py in one process, or under torchrun with ``nproc`` ranks; rank 0's
    JSON result."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SUPPORT), str(SUPPORT.parents[1])]),
        "OMP_NUM_THREADS": "1",  # two ranks share this machine's cores
    }
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    script = [str(SUPPORT / "dp_run.py"), json.dumps(spec)]
    if nproc == 1:
        cmd = [sys.executable, *script]
    else:
        # rendezvous on a free port chosen by torchrun's c10d store (port 0)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:0", *script,
        ]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=SUPPORT
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON:")]
    assert proc.returncode == 0 and lines, (proc.stdout[-3000:], proc.stderr[-6000:])
    result = json.loads(lines[-1][5:])
    assert "error" not in result or "stall_rank" in spec, result["error"]
    assert (
        len(result["losses"]) == spec["steps"] - (2 if "load_dir" in spec else 0)
        or "error" in result
    )
    return result


def _weights(folder: Path, rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(folder / f"weights_rank{rank}.pt", weights_only=True)


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert_close_named(a[key], b[key], key, rtol=1e-5, atol=1e-5)


def test_layers_are_owned_by_balanced_ranks() -> None:
    assert balance_layers([10, 1, 1, 10], 2) == [0, 0, 1, 1]
    assert balance_layers([5, 5, 5], 1) == [0, 0, 0]
    owners = balance_layers([100, 3, 3, 3, 3, 100], 3)
    assert sorted(owners[i] for i in (0, 5)) == [0, 1] and set(owners) == {0, 1, 2}


def test_two_processes_match_one_and_checkpoints_reshard(tmp_path: Path) -> None:
    """Sync mode: same losses and weights; a checkpoint of either world size resumes at the
    other, losses continuing as without the interruption; zero_to_fp32 reads both."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folders = {name: tmp_path / name for name in ("one", "two", "one_from_two", "two_from_one")}
    for folder in folders.values():
        folder.mkdir()
    common = {"steps": STEPS, "global_gas": 4, "save_at": 2}
    one = _run({**common, "out": str(folders["one"]), "save_dir": str(tmp_path / "ck1")}, 1)
    two = _run({**common, "out": str(folders["two"]), "save_dir": str(tmp_path / "ck2")}, 2)
    assert two["dp_world_size"] == 2 and two["global_rank"] == 0
    assert two["sampler"] == [2, 0]  # DeepSpeed's DistributedSampler over the dp ranks
    assert one["train_batch_size"] == two["train_batch_size"] == 8  # micro 2 x GAS x dp
    assert one["global_samples"] == two["global_samples"] == 8 * STEPS
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=1e-5)
    _assert_same_weights(_weights(folders["two"]), _weights(folders["one"]))
    _assert_same_weights(_weights(folders["two"], 1), _weights(folders["two"]))  # ranks agree
    # the optimizer state is sharded: rank 0 holds the Adam moments of its own layers only
    owners = two["owners"]
    assert set(owners) == {0, 1} and one["state_layers"] == [0, 1, 2, 3]
    assert two["state_layers"] == [layer for layer, rank in enumerate(owners) if rank == 0]

    # resume: 2 -> 1 and 1 -> 2
    one_from_two = _run(
        {**common, "out": str(folders["one_from_two"]), "load_dir": str(tmp_path / "ck2")}, 1
    )
    two_from_one = _run(
        {**common, "out": str(folders["two_from_one"]), "load_dir": str(tmp_path / "ck1")}, 2
    )
    assert one_from_two["losses"] == pytest.approx(two["losses"][2:], rel=1e-5, abs=1e-5)
    assert two_from_one["losses"] == pytest.approx(one["losses"][2:], rel=1e-5, abs=1e-5)
    _assert_same_weights(_weights(folders["one_from_two"]), _weights(folders["two"]))
    _assert_same_weights(_weights(folders["two_from_one"]), _weights(folders["one"]))
    _assert_same_weights(_weights(folders["two_from_one"], 1), _weights(folders["two_from_one"]))

    # DeepSpeed's zero_to_fp32 reads both; the layout records the world that trained
    for ck, world in (("ck1", 1), ("ck2", 2)):
        fp32 = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / ck))
        model = torch.load(
            tmp_path / ck / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False
        )
        assert model["rp_data_parallel"]["dp_world_size"] == world
        assert len(model["rp_data_parallel"]["owners"]) == 4
        for key, value in fp32.items():
            assert_close_named(value, model["module"][key].float(), key)
    a = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ck1"))
    b = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ck2"))
    _assert_same_weights(a, b)


def test_two_processes_match_one_async_with_clipping(tmp_path: Path) -> None:
    """Async (staleness 1) with global-norm clipping: the norm is the global one."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    spec = {"steps": STEPS, "global_gas": 4, "async": True, "clip": 0.05}
    one = _run({**spec, "out": str(tmp_path / "one")}, 1)
    two = _run({**spec, "out": str(tmp_path / "two")}, 2)
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=1e-5)
    _assert_same_weights(_weights(tmp_path / "two"), _weights(tmp_path / "one"))
    _assert_same_weights(_weights(tmp_path / "two", 1), _weights(tmp_path / "two"))


def test_the_imperative_loop_matches_one_process(tmp_path: Path) -> None:
    """DeepSpeed's forward / backward / step loop: the boundary micro-batch reduces."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    spec = {"steps": 2, "global_gas": 4, "imperative": True}
    one = _run({**spec, "out": str(tmp_path / "one")}, 1)
    two = _run({**spec, "out": str(tmp_path / "two")}, 2)
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=1e-5)
    # the global norm of the reduced gradient, as the one process's (a 1/GAS or a reduction
    # mean applied twice would scale it)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
    _assert_same_weights(_weights(tmp_path / "two"), _weights(tmp_path / "one"))


def test_a_collective_that_times_out_names_the_rank() -> None:
    result = _run({"steps": 2, "global_gas": 2, "timeout_s": 3, "stall_rank": 1}, 2)
    error = result["error"]
    assert "DistributedError" in error and "rank 0 of 2" in error, error
    assert "timeout 3 s" in error and "layer" in error, error
