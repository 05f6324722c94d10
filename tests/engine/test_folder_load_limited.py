"""Issue 49, acceptance (a): LoRA from a ``save_pretrained`` folder whose weights are twice the
memory the run may use, less a runtime allowance, trains 2 steps and saves its adapter, from bf16
files and from fp32 files, with the losses of the model loaded whole.

Sizes: a Qwen3 of hidden 1,024 (intermediate 2,048, vocab 128), 56 layers in bf16 files or 28
layers in fp32 files: 1 GiB of weights either way (520M / 260M parameters), in 200 MB shards.
The run computes in the files' dtype (so the frozen base is served from the files as it is),
on 2 CPU virtual devices of 0.15 GB each, LoRA r=4 on q_proj/v_proj, one micro-batch of 16
tokens per step (tests/support/folder_lora_child.py).

The limit is ``ALLOWANCE + weights / 2``: the weights are twice what the limit leaves after the
runtime allowance of 640 MiB (Python, torch, transformers, peft and DeepSpeed imported: about
310 MiB; the two CPU devices' 0.3 GB; activations, the adapter's state, the loader). The shards
are dropped from the page cache after they are written, so the child reads them itself, and
their pages count against its limit until the kernel evicts them (a memory cgroup counts page
cache; where there is none, tests/support/memory_limit.py samples RSS, which counts mapped file
pages too, and the test is skipped: it would measure the mapping, not the memory used).

The control: the same run with the base copied into ordinary memory (what a cast, a clone or a
pin on the way would do) is killed at the limit, so the limit is what the test says it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from memory_limit import cgroup_mechanism, run_limited
from models import tiny

from benchmarks.folder_load import drop_cache

MIB = 2**20
ALLOWANCE = 640 * MIB
WEIGHTS = 2**30
CHILD = Path(__file__).resolve().parents[1] / "support" / "folder_lora_child.py"
LAYERS = {"bf16": 56, "fp32": 28}  # 1 GiB of weights in either dtype

pytestmark = pytest.mark.skipif(
    cgroup_mechanism() is None,
    reason="needs a memory cgroup: sampled RSS counts the files' mapped pages",
)


def _save(folder: Path, name: str) -> int:
    """The model saved in ``name``'s dtype; returns the bytes of its weights. The shards are
    written to disk and dropped from the page cache, so the limited child reads them itself."""
    dtype = torch.bfloat16 if name == "bf16" else torch.float32
    torch.manual_seed(0)
    model = tiny("qwen3", 0, layers=LAYERS[name], hidden=1024, vocab=128).to(dtype)
    model.save_pretrained(folder, max_shard_size="200MB")
    del model
    shards = sorted(folder.glob("*.safetensors"))
    drop_cache(shards)
    return sum(shard.stat().st_size for shard in shards)


def _argv(folder: Path, out: Path, load: str, name: str, *extra: str) -> list[str]:
    return [sys.executable, str(CHILD), str(folder), str(out), "--load", load, "--compute", name,
            *extra]  # fmt: skip


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    support = str(CHILD.parent)
    paths = [root, support, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


@pytest.fixture(scope="module", params=list(LAYERS))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    name = request.param
    folder = tmp_path_factory.mktemp(f"folder_{name}")
    size = _save(folder, name)
    assert abs(size - WEIGHTS) < 0.05 * WEIGHTS, size
    return name, folder, size


@pytest.mark.filterwarnings("ignore")
def test_lora_from_a_folder_twice_the_limit_trains_and_saves(saved: tuple, tmp_path: Path) -> None:
    name, folder, size = saved
    limit = ALLOWANCE + size // 2
    run = run_limited(
        _argv(folder, tmp_path / "adapter", "folder", name), limit, env=_env(), timeout=600
    )
    assert not run.killed_by_limit, (
        f"killed at the {limit / MIB:.0f} MiB limit ({run.mechanism}, peak "
        f"{run.peak_bytes / MIB:.0f} MiB): {run.stderr[-3000:]}"
    )
    assert run.returncode == 0, run.stderr[-6000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    print(
        f"{name}: limit {limit / MIB:.0f} MiB, cgroup peak {run.peak_bytes / MIB:.0f} MiB "
        f"(page cache included), at the end anonymous {out['rssanon'] / MIB:.0f} MiB, "
        f"file-backed {out['rssfile'] / MIB:.0f} MiB"
    )
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert size >= 2 * (limit - ALLOWANCE)
    # the same model loaded whole by from_pretrained, without a limit
    whole = subprocess.run(
        _argv(folder, tmp_path / "whole", "whole", name), env=_env(), capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert whole.returncode == 0, whole.stderr[-6000:]
    expected = json.loads(whole.stdout.strip().splitlines()[-1])["losses"]
    assert out["losses"] == expected


@pytest.mark.filterwarnings("ignore")
def test_the_base_copied_into_memory_is_killed_at_that_limit(saved: tuple, tmp_path: Path) -> None:
    name, folder, size = saved
    if name != "bf16":
        pytest.skip("one control is enough: the limit is sized the same for both dtypes")
    limit = ALLOWANCE + size // 2
    run = run_limited(
        _argv(folder, tmp_path / "adapter", "folder", name, "--copy-base"), limit, env=_env(),
        timeout=600,
    )  # fmt: skip
    assert run.killed_by_limit and run.returncode != 0, (run.returncode, run.stderr[-3000:])
