"""The loss-reads benchmark cannot rot: its reduced form (tiny model, rp_engine systems only,
in this process) runs, and its summary judges the targets from the figures it is given."""

from __future__ import annotations

import argparse

from benchmarks.common import PRESETS
from benchmarks.head_to_head import run_system
from benchmarks.loss_reads import SETUPS, SYSTEMS, format_table, summarize


def _row(tps: float, losses: list[float]) -> dict:
    return {"tokens_per_s": tps, "step_losses": losses}


def test_every_read_pattern_runs_and_reports_its_losses() -> None:
    preset = {**PRESETS["tiny"], "gas": 4}
    args = argparse.Namespace(
        devices=None, pcie_gbps=2.0, calibrate=False, cuts=None, steps=1, warmup=1
    )
    rows = {
        name: run_system(name, preset, args, setups=SETUPS)
        for name in ("train_batch", "loop_before_backward", "loader_after_step")
    }
    for name, row in rows.items():
        assert row["tokens_per_s"] > 0 and len(row["step_losses"]) == 2, name
    summary = summarize(rows)
    # the same steps, grouped into other runs: the same losses
    assert summary["losses_ok"], summary["loss_agreement"]
    assert set(summary["loss_agreement"]) == {"loop_before_backward", "loader_after_step"}


def test_the_summary_judges_each_target_against_its_baseline() -> None:
    losses = [5.0, 4.0]
    systems = {
        "deepspeed": _row(100.0, [5.0, 4.1]),
        "train_batch": _row(400.0, losses),
        "loop_after_step": _row(199.0, losses),  # 1.99x DeepSpeed: missed
        "loop_before_backward": _row(200.0, losses),  # 2x: met
        "loader_after_step": _row(340.0, losses),  # 0.85x train_batch: met
        "loader_every_10th": _row(339.0, [5.0, 4.01]),  # 0.8475x: missed; losses differ
    }
    summary = summarize(systems)
    assert summary["targets"] == {
        "loop_after_step": False,
        "loop_before_backward": True,
        "loader_after_step": True,
        "loader_every_10th": False,
    }
    assert summary["ratios"]["train_batch"]["vs_deepspeed"] == 4.0
    assert not summary["losses_ok"] and summary["loss_agreement"]["loader_every_10th"] > 1e-3
    table = format_table(systems, summary)
    assert "MISSED" in table and table.count("| met |") + table.count(": met") >= 2
    assert set(systems) <= set(SYSTEMS)
