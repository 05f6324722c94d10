"""Host RAM that does not grow with the model: with both NVMe tiers a model whose training state
is four times the memory the process may use trains, and a deeper model needs no more RAM.

The model is a bf16 Qwen2 of 512-wide layers (benchmarks/bounded_ram.py) on 2 CPU
virtual devices with 60 MB each, both tiers on NVMe, asynchronous CPU Adam with clipping. Its
training state is 18 B per parameter (bf16 weights, fp32 masters, Adam moments, fp32 gradients);
what stays in RAM is the optimizer tier's and the gradient tier's buffers (a few layers each),
the parameter tier's pool, the devices and Python. The user's bf16 model itself (2 B per
parameter) is in RAM until ``initialize`` has written it to NVMe, layer by layer.

The limit is a memory cgroup when the tests run as root with cgroups (CI on these machines);
otherwise the process's sampled RSS (tests/support/memory_limit.py).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from memory_limit import run_limited
from prebuild import cpu_adam_here

from benchmarks import bounded_ram

SPEC = {"hidden": 512, "vocab": 8192, "steps": 2, "device_memory_gb": 0.06}
MIB = 2**20


def _params(layers: int) -> int:
    return int(bounded_ram.run({**SPEC, "layers": layers, "count_only": True})["params"])


def _env() -> dict[str, str]:
    paths = [str(bounded_ram.ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


@pytest.mark.filterwarnings("ignore")
def test_a_model_four_times_the_memory_limit_trains(tmp_path: Path) -> None:
    layers = 128
    state = 18 * _params(layers)
    limit = state // 4
    spec = {**SPEC, "layers": layers, "tiers": True, "dir": str(tmp_path)}
    cpu_adam_here()
    run = run_limited(
        bounded_ram.command(spec), limit, env=_env(), timeout=900, cwd=str(bounded_ram.ROOT)
    )
    assert not run.killed_by_limit, (
        f"killed at the {limit / MIB:.0f} MiB limit ({run.mechanism}, peak "
        f"{run.peak_bytes / MIB:.0f} MiB): {run.stderr[-3000:]}"
    )
    assert run.returncode == 0, run.stderr[-6000:]
    out = bounded_ram.parse(run.stdout)
    assert out["state"] >= 4 * limit
    # Python, torch, transformers and DeepSpeed imported: a minority of the limit
    assert out["import_rss"] < limit / 3
    assert run.peak_bytes <= limit
    assert all(math.isfinite(x) for x in out["losses"])
    # the same model host-resident (no limit: it needs the state in RAM) trains the same losses
    host = bounded_ram.run({**spec, "tiers": False})
    assert out["losses"] == host["losses"]
    assert host["peak_rss"] > state, "the host-resident run holds the state in RAM"


@pytest.mark.filterwarnings("ignore")
def test_a_deeper_model_needs_no_more_ram(tmp_path: Path) -> None:
    """48 and 96 layers: the peak RSS of the whole run (initialize included) grows by less
    than 10 % of the added training state. (Both depths fill the devices' stages: up to
    there a deeper model gets larger stages, and with them larger staging and device copies,
    RAM that follows the devices' memory, not the depth.)"""
    runs = {}
    for layers in (48, 96):
        folder = tmp_path / str(layers)
        folder.mkdir()
        runs[layers] = bounded_ram.run(
            {**SPEC, "layers": layers, "tiers": True, "dir": str(folder)}
        )
    added = runs[96]["state"] - runs[48]["state"]
    grew = runs[96]["peak_rss"] - runs[48]["peak_rss"]
    assert added > 1800 * MIB
    assert grew < 0.10 * added, (
        f"peak RSS {runs[48]['peak_rss'] / MIB:.0f} -> {runs[96]['peak_rss'] / MIB:.0f} MiB for "
        f"{added / MIB:.0f} MiB more state"
    )
    assert all(math.isfinite(x) for r in runs.values() for x in r["losses"])
    # the initialize preflight's prediction (plan/host_ram.py) is the measured peak, +-20 %
    # (the runs' peaks vary by about +-5 % from run to run and machine to machine)
    for layers, r in runs.items():
        assert abs(r["predicted_peak"] - r["peak_rss"]) <= 0.20 * r["peak_rss"], (layers, r)


@pytest.mark.filterwarnings("ignore")
def test_a_budget_shrinks_the_pools_and_the_prediction_holds(tmp_path: Path) -> None:
    """Issue 49 (d): at two budgets, none and one between the configured pools' need and the
    fewest buffers', the prediction is the measured peak +-20 %; the second run's pools shrank
    to fit its budget (roundpipe.host_memory_gb, counted against the process's RSS) and its
    losses are the first's, bit for bit."""
    spec = {**SPEC, "layers": 48, "tiers": True}
    (tmp_path / "a").mkdir()
    free = bounded_ram.run({**spec, "dir": str(tmp_path / "a")})
    assert free["least_peak"] < free["predicted_peak"]
    budget = (free["predicted_peak"] + free["least_peak"]) / 2
    (tmp_path / "b").mkdir()
    tight = bounded_ram.run({**spec, "dir": str(tmp_path / "b"), "host_memory_gb": budget / 2**30})
    assert tight["pool_counts"] != free["pool_counts"], (free["pool_counts"], tight["pool_counts"])
    assert tight["predicted_peak"] <= budget
    for r in (free, tight):
        assert abs(r["predicted_peak"] - r["peak_rss"]) <= 0.20 * r["peak_rss"], r
    assert tight["losses"] == free["losses"]
