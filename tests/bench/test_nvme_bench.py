"""The NVMe-tier benchmark cannot rot: its rp_engine part runs here at tiny sizes, in this
process (``--quick --inline``); DeepSpeed's part is reported through the same table code."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks.nvme_bench import RP_VARIANTS, format_table, main, ratios


def _finite_positive(x: float) -> bool:
    return isinstance(x, float | int) and math.isfinite(x) and x > 0


def test_quick_run_reports_raw_tier_and_ratios(tmp_path: Path) -> None:
    out, folder = tmp_path / "nvme.json", tmp_path / "disk"
    # the built-in I/O engine: the aio op need not be built (nor loaded) for the smoke test
    argv = ["--quick", "--inline", "--io-engine", "threads", "--systems", ",".join(RP_VARIANTS)]
    assert main([*argv, "--dir", str(folder), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) == {
        "raw", "systems", "tier_bandwidth", "io_vs_compute", "ratios", "config", "machine",
        "table",
    }  # fmt: skip
    # (a) every block size, both directions, and the raw file is gone
    assert set(result["raw"]["blocks"]) == {"1", "2", "4"}
    for b in result["raw"]["blocks"].values():
        assert _finite_positive(b["read_MBps"]) and _finite_positive(b["write_MBps"])
    assert not (folder / "raw_bandwidth.bin").exists()
    # (c) every variant ran, from the same weights and data (the same first loss)
    systems = result["systems"]
    assert set(systems) == set(RP_VARIANTS)
    first = {name: row["step_losses"][0] for name, row in systems.items()}
    assert len(set(first.values())) == 1, first
    for row in systems.values():
        assert _finite_positive(row["tokens_per_s"]) and len(row["step_losses"]) == 3
    # (b) only the tier variants move bytes through the tier; in the window every layer's
    # record is read and written back, 12 B per trainable parameter each way at least
    params = systems["tier_async"]["trainable_params"]
    assert set(result["tier_bandwidth"]) == {"tier_async", "tier_sync", "both_async"}
    for name, bw in result["tier_bandwidth"].items():
        assert systems[name]["tier"]["block_size"] == bw["block_bytes"] == 1 << 20
        assert systems[name]["tier"]["io_engine"].startswith("built-in threads")
        assert bw["write_bytes_per_step"] >= 12 * params, name
        assert bw["read_bytes_per_step"] > 0, name
        for key in ("MBps", "read_ratio", "write_ratio", "efficiency"):
            assert _finite_positive(bw[key]), (name, key)
        assert math.isclose(bw["efficiency"], bw["read_ratio"] + bw["write_ratio"])
    for name in ("host_async", "host_sync"):
        assert "tier_io" not in systems[name] and "tier" not in systems[name]
    assert not list((folder / "rp_swap").rglob("*.swp")), "destroy removes the swap file"
    # the sizing estimate and the tier/host ratios
    fit = result["io_vs_compute"]
    assert _finite_positive(fit["min_io_s"]) and _finite_positive(fit["compute_s"])
    assert set(result["ratios"]) == {"tier/host async", "tier/host sync", "both tiers/host async"}
    assert all(_finite_positive(v) for v in result["ratios"].values())
    assert "| rp_engine, tier on NVMe, async |" in result["table"]
    # (e) with the weights on NVMe too, both swap files moved bytes: more than the optimizer's
    both = result["tier_bandwidth"]["both_async"]["read_bytes_per_step"]
    assert both > result["tier_bandwidth"]["tier_async"]["read_bytes_per_step"]
    assert len(systems["both_async"]["tier"]["path"]) == 2


def test_table_reports_deepspeed_failure_text_and_ratio() -> None:
    row = {"tokens_per_s": 100.0, "s_per_step": 1.0, "final_loss": 2.0, "peak_rss_mb": 900.0}
    systems = {
        "tier_async": {**row, "tokens_per_s": 150.0},
        "host_async": row,
        "deepspeed": {"error": ["RuntimeError: aio | failed", "second line"]},
    }
    assert ratios(systems) == {"tier/host async": 1.5}
    raw = {"blocks": {"1": {"write_MBps": 600.0, "read_MBps": 650.0}}}
    table = format_table(
        {
            "raw": raw,
            "systems": systems,
            "tier_bandwidth": {},
            "io_vs_compute": {},
            "ratios": ratios(systems),
        }  # fmt: skip
    )
    assert "failed: RuntimeError: aio \\| failed / second line |" in table
    assert "tier/host async = **1.50x**" in table and "| 1 MiB | 600 | 650 |" in table
    systems["deepspeed"] = {**row, "tokens_per_s": 50.0}
    assert ratios(systems)["tier async/deepspeed"] == 3.0
