"""The NVMe optimizer tier takes the masters and moments out of RAM, measured.

Two fresh processes train the same ~105 M-parameter model (64 Linear layers, fp32), one
host-resident, one with ``offload_optimizer.device: "nvme"``; each reports its own peak RSS.
The masters and Adam moments are 12 B per parameter, about 1.26 GB: the tier's run must peak at
least 0.8 x that below the host-resident one (the tier keeps 4 buffers of one layer's state,
about 80 MB, instead). Both runs train the same steps to the same losses.
"""

from __future__ import annotations

import pytest
from subprocess_helpers import run_json

SPEC = {"layers": 64, "width": 1280, "steps": 3}


@pytest.mark.filterwarnings("ignore")
def test_the_tier_moves_masters_and_moments_out_of_ram(tmp_path) -> None:
    host = run_json("nvme_memory_child.py", {**SPEC, "tier": False, "dir": ""})
    tier = run_json("nvme_memory_child.py", {**SPEC, "tier": True, "dir": str(tmp_path)})
    state = 12 * host["trainable"]
    assert state >= 2**30, "the model must have at least 1 GB of masters and moments"
    saved = host["peak_rss"] - tier["peak_rss"]
    assert saved >= 0.8 * state, (
        f"peak RSS host-resident {host['peak_rss'] / 2**30:.2f} GiB, with the tier "
        f"{tier['peak_rss'] / 2**30:.2f} GiB: saved {saved / 2**30:.2f} GiB of "
        f"{state / 2**30:.2f} GiB masters + moments"
    )
    assert tier["losses"] == host["losses"]
    assert not list(tmp_path.rglob("*.swp")), "the swap file is removed at destroy"
