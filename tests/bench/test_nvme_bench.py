"""The NVMe-tier benchmark cannot rot: its rp_engine part runs here at tiny sizes, in this
process (``--quick --inline``), and (f), RAM against the state, at tiny sizes in its own
processes; DeepSpeed's part is reported through the same table code."""

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
        "raw", "systems", "tier_bandwidth", "io_vs_compute", "ratios", "ram", "config",
        "machine", "table",
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
    assert set(result["tier_bandwidth"]) == {
        "tier_async", "tier_arena_async", "tier_sync", "both_async"
    }  # fmt: skip
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
    # the bounded tier (the default with the optimizer tier) has a gradient tier and reports
    # its own window; the previous tier (grad_buffers 0) has none
    for name in ("tier_async", "tier_sync", "both_async"):
        g, io = systems[name]["grad_tier"], systems[name]["grad_io"]
        assert g["buffer_count"] == 2 * 2 + 4 and _finite_positive(g["buffer_bytes"]), name
        assert g["path"].endswith("grads.swp"), name
        for key in ("read_bytes_per_step", "write_bytes_per_step", "busy_s_per_step"):
            assert isinstance(io[key], float | int) and io[key] >= 0, (name, key)
        # its bytes are part of the tiers' summed window
        assert io["write_bytes"] <= systems[name]["tier_io"]["write_bytes"], name
    arena = systems["tier_arena_async"]
    assert "grad_tier" not in arena and "grad_io" not in arena
    assert arena["config"]["roundpipe"]["grad_buffers"] == 0
    assert len(arena["tier"]["path"]) == 1 and len(systems["tier_async"]["tier"]["path"]) == 2
    assert not list((folder / "rp_swap").rglob("*.swp")), "destroy removes the swap file"
    # the sizing estimate and the tier/host ratios
    fit = result["io_vs_compute"]
    assert _finite_positive(fit["min_io_s"]) and _finite_positive(fit["compute_s"])
    assert set(result["ratios"]) == {
        "tier/host async", "bounded tier/previous tier async", "previous tier/host async",
        "tier/host sync", "both tiers/host async",
    }  # fmt: skip
    assert all(_finite_positive(v) for v in result["ratios"].values())
    table = result["table"]
    assert "| rp_engine, tier on NVMe, bounded gradients, async |" in table
    assert "| rp_engine, tier on NVMe, gradient arena (previous tier), async |" in table
    assert "bounded tier/previous tier async = **" in table
    assert "**The gradient tier**" in table
    # (e) with the weights on NVMe too, both swap files moved bytes: more than the optimizer's
    both = result["tier_bandwidth"]["both_async"]["read_bytes_per_step"]
    assert both > result["tier_bandwidth"]["tier_async"]["read_bytes_per_step"]
    paths = systems["both_async"]["tier"]["path"]
    assert sorted(Path(x).name for x in paths) == ["grads.swp", "optimizer.swp", "params.swp"]
    # (f) both tiers at two depths and host-resident at the smaller, each in its own process
    ram = result["ram"]
    assert ram["spec"]["layers"] == [8, 16]
    assert set(ram["runs"]) == {"tiers_8", "tiers_16", "host_8"}
    for name, r in ram["runs"].items():
        assert "error" not in r, (name, r.get("error"))
        for key in ("params", "state", "peak_rss", "train_peak", "init_peak", "peak_over_state"):
            assert _finite_positive(r[key]), (name, key)
        assert r["state"] == 18 * r["params"] and math.isfinite(r["final_loss"])
    assert ram["runs"]["tiers_16"]["params"] > ram["runs"]["tiers_8"]["params"]
    growth = ram["growth"]
    assert (growth["from"], growth["to"]) == (8, 16) and math.isfinite(growth["fraction"])
    assert (
        growth["added_state"] == ram["runs"]["tiers_16"]["state"] - ram["runs"]["tiers_8"]["state"]
    )
    assert "**(f) RAM against the state**" in table and "| host-resident | 8 |" in table
    assert not list(folder.glob("ram_*")), "each (f) run's folder is removed"


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
