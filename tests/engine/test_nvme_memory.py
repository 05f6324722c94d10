"""The NVMe optimizer tier takes the masters and moments out of RAM, measured.

Two fresh processes train the same ~105 M-parameter model (64 Linear layers, fp32), one
host-resident, one with ``offload_optimizer.device: "nvme"``; each reports its own peak RSS.
The masters and Adam moments are 12 B per parameter, about 1.26 GB: the tier's run must peak at
least 0.8 x that below the host-resident one (the tier keeps 4 buffers of one layer's state,
about 80 MB, instead). Both runs train the same steps to the same losses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from subprocess_helpers import run_json

SPEC = {"layers": 64, "width": 1280, "steps": 3}


@pytest.fixture(scope="module")
def tier_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """The optimizer tier's run and its folder, compared with the host-resident run and with the
    run of both tiers: one child for both tests (the same spec runs the same training)."""
    folder = tmp_path_factory.mktemp("tier")
    return run_json("nvme_memory_child.py", {**SPEC, "tier": True, "dir": str(folder)}), folder


@pytest.mark.filterwarnings("ignore")
def test_the_tier_moves_masters_and_moments_out_of_ram(
    tier_run: tuple[dict[str, Any], Path],
) -> None:
    host = run_json("nvme_memory_child.py", {**SPEC, "tier": False, "dir": ""})
    tier, folder = tier_run
    state = 12 * host["trainable"]
    assert state >= 2**30, "the model must have at least 1 GB of masters and moments"
    saved = host["peak_rss"] - tier["peak_rss"]
    assert saved >= 0.8 * state, (
        f"peak RSS host-resident {host['peak_rss'] / 2**30:.2f} GiB, with the tier "
        f"{tier['peak_rss'] / 2**30:.2f} GiB: saved {saved / 2**30:.2f} GiB of "
        f"{state / 2**30:.2f} GiB masters + moments"
    )
    assert tier["losses"] == host["losses"]
    assert not list(folder.rglob("*.swp")), "the swap file is removed at destroy"


@pytest.mark.filterwarnings("ignore")
def test_the_parameter_tier_moves_the_compute_weights_out_of_ram(
    tmp_path: Path, tier_run: tuple[dict[str, Any], Path]
) -> None:
    """With ``offload_param.device: "nvme"`` too, the compute weights (fp32 here, double-buffered
    by the asynchronous optimizer: 8 B per parameter, about 0.84 GB) leave RAM as well.

    Right after ``initialize`` (the host state alone) the saving is every buffer of them. At the
    peak it is at least one buffer: CPU virtual devices keep their "device" copies of the
    uploaded weights, gradients and activations in the same RAM, which a GPU keeps on the card.
    """
    opt, opt_folder = tier_run  # the optimizer tier alone
    both = run_json(
        "nvme_memory_child.py", {**SPEC, "tier": True, "params": True, "dir": str(tmp_path)}
    )
    one_copy = 4 * opt["trainable"]  # fp32 compute weights
    weights = opt["weight_copies"] * one_copy
    assert weights >= 2**29
    saved_init = opt["init_rss"] - both["init_rss"]
    saved_peak = opt["peak_rss"] - both["peak_rss"]
    report = (
        f"after initialize {opt['init_rss'] / 2**30:.2f} -> {both['init_rss'] / 2**30:.2f} GiB, "
        f"peak {opt['peak_rss'] / 2**30:.2f} -> {both['peak_rss'] / 2**30:.2f} GiB; compute "
        f"weights {weights / 2**30:.2f} GiB"
    )
    assert saved_init >= 0.8 * weights, report
    assert saved_peak >= 0.8 * one_copy, report
    assert both["losses"] == opt["losses"]
    swap_files = [*opt_folder.rglob("*.swp"), *tmp_path.rglob("*.swp")]
    assert not swap_files, "both swap files are removed at destroy"


@pytest.mark.filterwarnings("ignore")
def test_checkpoints_stream_through_the_tiers(tmp_path) -> None:
    """With both tiers, ``save_checkpoint`` streams the masters, moments and weights out of the
    tiers layer by layer, and ``load_checkpoint`` fills them the same way: neither holds the
    state in RAM. The state is 16 B per parameter here (fp32 masters, moments and compute
    weights, about 1.7 GB); memory may rise by at most a quarter of it during either (the
    tiers' buffer pools, a layer each; the code before streaming rose by about twice it).

    The load goes into a fresh engine over a model initialised from another seed, and its
    first loss equals, bit for bit, the next loss of the run that saved: only a load that
    restored every weight, master and moment gives it (one that reads nothing trains the
    other seed's weights)."""
    spec = {**SPEC, "tier": True, "params": True, "dir": str(tmp_path)}
    run = run_json("nvme_memory_child.py", {**spec, "checkpoint": str(tmp_path / "ckpt")})
    state = 16 * run["trainable"]
    assert state >= 2**30
    report = (
        f"save rose {run['save_rise'] / 2**20:.0f} MiB, load {run['load_rise'] / 2**20:.0f} MiB "
        f"(anonymous), state {state / 2**20:.0f} MiB"
    )
    assert run["save_rise"] <= state / 4, report
    assert run["load_rise"] <= state / 4, report
    assert len(run["losses"]) == SPEC["steps"]
    assert run["loaded_next"] == run["saved_next"], (run["loaded_next"], run["saved_next"])
