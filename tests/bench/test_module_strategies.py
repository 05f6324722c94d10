"""The issue-29 strategy benchmark cannot rot: its rp_engine part runs here in a tiny
configuration, in this process (DeepSpeed's part is the head-to-head's, tested there)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.module_strategies import FORCE_WHOLE, format_table, main, ratios

TINY = ["--features", "8", "--hidden", "32", "--blocks", "3", "--classes", "5", "--mbs", "2"]
TINY += ["--tokens", "3", "--gas", "2", "--warmup", "1", "--steps", "1", "--repeats", "1"]


def test_rp_engine_part_reports_both_strategies_as_claimed(tmp_path: Path) -> None:
    out = tmp_path / "ms.json"
    systems = "traced,whole_module,whole_module_train_batch"
    argv = [*TINY, "--pcie-gbps", "5", "--systems", systems, "--inline"]
    assert main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) == {"systems", "ratios", "config", "machine", "table"}
    traced, whole = result["systems"]["traced"], result["systems"]["whole_module"]
    # (b): one traced stage per block, cut before every block after the first
    assert traced["strategy"] == "traced" and sum(traced["fwd_cuts"]) == 3
    assert traced["split_points"] == ["blocks.1", "blocks.2"]
    # (c): forced through the documented fallback, which says why
    assert whole["strategy"] == "whole_module" and sum(whole["fwd_cuts"]) == 1
    assert FORCE_WHOLE in whole["reason"] and whole["split_points"] == []
    for row in (traced, whole):
        assert row["samples_per_s"] > 0 and len(row["step_losses"]) == 2
        assert row["bytes_per_step"] > 0 and row["weight_h2d_bytes_per_step"] > 0
        assert row["bytes_modelled"] is False
    # the same weights and data: the first step's loss is the same under both strategies
    assert abs(traced["first_loss"] - whole["first_loss"]) < 1e-5
    assert set(result["ratios"]) == {"traced/whole_module"}
    # train_batch: all GAS micro-batches in one schedule, one upload per slot and step. In
    # DeepSpeed's loop the forwards run at once (the caller's criterion needs the outputs) and
    # the window's backwards as one schedule; the first forward's weights stay on the device for
    # the window's next runs (the executor's kept weights): the same bytes as train_batch (they
    # were 3 uploads against 2 at GAS 2 before)
    tb = result["systems"]["whole_module_train_batch"]
    assert tb["strategy"] == "whole_module"
    assert tb["weight_h2d_bytes_per_step"] == whole["weight_h2d_bytes_per_step"]
    assert abs(tb["first_loss"] - whole["first_loss"]) < 1e-5
    assert result["config"]["ds_config"]["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert "| rp_engine (b) traced | traced, 3 layer(s) |" in result["table"]


def test_ratios_and_table_with_deepspeed_and_a_failed_system() -> None:
    row = {"strategy": "deepspeed", "samples_per_s": 10.0, "s_per_step": 1.0,
           "first_loss": 1.0, "final_loss": 0.5, "bytes_per_step": 2e6, "bytes_modelled": True}  # fmt: skip
    systems = {
        "traced": {**row, "strategy": "traced", "samples_per_s": 30.0, "fwd_cuts": [2, 1]},
        "whole_module": {"error": ["boom"]},
        "deepspeed": row,
    }
    assert ratios(systems) == {"traced/deepspeed": 3.0}
    table = format_table({"systems": systems, "ratios": ratios(systems)})
    assert "| rp_engine (c) whole module | failed: boom |" in table
    assert "2.0 (model)" in table and "traced/deepspeed = **3.00x**" in table
