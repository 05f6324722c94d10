"""A run under a memory limit too small for it is refused at ``initialize``, naming the limit
and the need, before it writes anything (issue 49, acceptance (c)).

The child (tests/support/limit_refusal_child.py) trains a bf16 Qwen2 of 4 layers 1,024 wide with
both NVMe tiers on 2 CPU virtual devices: about 0.45 GiB resident before ``initialize`` and,
predicted, about 1.1 GiB more for the tiers' pools, staging and devices, 0.3 GiB with every pool
at its fewest buffers, the optimizer state in its smallest slices and stages of one layer. Two
limits, each a kernel's: a memory cgroup of 560 MiB (where this process may make one: root with cgroupfs,
tests/support/memory_limit.py; skipped elsewhere, where that module only samples the RSS, a
limit the child cannot read), and ``RLIMIT_AS`` at the child's address space plus 300 MiB (any
Linux; the host-resident run, whose 16 B per parameter need about 0.7 GiB). Before the limit was read (host_preflight compared the need with
the host's free memory only) the cgroup run went on and was OOM-killed without a message, and
the rlimit run failed on an allocation or trained; now both are refused with the source of the
limit and the predicted need by part, and neither the NVMe folder nor the checkpoint folder
gets a file.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from memory_limit import cgroup_mechanism, run_limited
from subprocess_helpers import HERE, run_json

CHILD = HERE / "limit_refusal_child.py"
MIB = 2**20
SPEC = {"hidden": 1024, "layers": 4}


def _folders(tmp_path: Path) -> dict[str, str]:
    nvme = tmp_path / "nvme"
    nvme.mkdir()  # the tier refuses a missing nvme_path: it must exist, and stay empty
    return {"dir": str(nvme), "ckpt": str(tmp_path / "ckpt")}


def _assert_refused(out: dict, tmp_path: Path, source: str, parts: tuple[str, ...]) -> str:
    text = out["refused"]
    assert text is not None, f"not refused: it trained ({out})"
    assert "needs about" in text and "is available" in text, text
    # the need by part, the limit that binds and where it comes from, and the knobs
    assert all(part in text for part in parts), text
    assert "the limit that binds: " in text and source in text, text
    assert "roundpipe.host_memory_gb" in text and "LoRA" in text, text
    assert not list((tmp_path / "nvme").iterdir()), "a file was written in the NVMe folder"
    assert not (tmp_path / "ckpt").exists(), "the checkpoint folder was made"
    return str(text)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.skipif(
    cgroup_mechanism() == "rss-sampling", reason="no writable memory cgroup (root needed)"
)
def test_a_cgroup_limit_too_small_is_refused_naming_the_cgroup(tmp_path: Path) -> None:
    spec = {**SPEC, **_folders(tmp_path)}
    paths = [str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    run = run_limited(
        [sys.executable, str(CHILD), json.dumps(spec)], 560 * MIB, env=env, timeout=600,
        cwd=str(HERE),
    )  # fmt: skip
    assert not run.killed_by_limit, f"killed at the limit, not refused: {run.stderr[-3000:]}"
    assert run.returncode == 0, run.stderr[-6000:]
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("JSON:")]
    assert lines, run.stderr[-6000:]
    kind = "v1 memory.limit_in_bytes" if run.mechanism == "cgroup-v1" else "v2 memory.max"
    tiers = ("gradient tier buffers", "optimizer tier buffers", "every pool at its fewest buffers")
    text = _assert_refused(json.loads(lines[-1][5:]), tmp_path, f"cgroup {kind} at ", tiers)
    assert "with the NVMe tiers this run needs about" in text
    assert "rp_memlimit_" in text  # the child's own group (tests/support/memory_limit.py)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_address_space_limit_too_small_is_refused(tmp_path: Path) -> None:
    """Host-resident (no tiers): refused by the first check, before the engine is built. (With
    the tiers the second check comes after the CPU devices' threads are started, whose stacks
    and malloc arenas take address space: under an RLIMIT_AS that tight an allocation fails
    before it, so the tiers are checked under the cgroup above.)"""
    spec = {**SPEC, **_folders(tmp_path), "tiers": False, "rlimit_margin_mb": 300}
    out = run_json("limit_refusal_child.py", spec)
    text = _assert_refused(out, tmp_path, "RLIMIT_AS", ("fp32 masters", "Adam moments"))
    assert "trainable parameters" in text
