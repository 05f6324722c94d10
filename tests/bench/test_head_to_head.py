"""The head-to-head harness cannot rot: its reduced form (two steps, tiny model) runs here."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.emulated_link import EmulatedZeroLink
from benchmarks.executor_timing import PARTS
from benchmarks.head_to_head import (
    GPU_ONLY,
    SYSTEMS,
    TRAINER_SYSTEMS,
    _append_jsonl,
    format_table,
    loss_agreement,
    run_child,
)

ROOT = Path(__file__).resolve().parents[2]


def test_head_to_head_reduced_run_reports_every_system(tmp_path: Path) -> None:
    out = tmp_path / "h2h.json"
    cmd = [sys.executable, "-m", "benchmarks.head_to_head", "--model", "tiny", "--warmup", "1"]
    cmd += ["--steps", "1", "--repeats", "1", "--pcie-gbps", "2", "--json", str(out)]
    # tests/support: its sitecustomize hands the children the suite's CPU probe (conftest.py)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "support")]),
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result) >= {"systems", "ratios", "config", "machine", "loss_agreement"}
    assert set(result["systems"]) == set(SYSTEMS)
    ran = set(SYSTEMS) - set(GPU_ONLY)  # the RoundPipe library: skipped on CPU, saying why
    for name in GPU_ONLY:
        assert result["systems"][name]["skipped"] == GPU_ONLY[name]
    for name, row in result["systems"].items():
        if name in GPU_ONLY:
            continue
        for key in ("tokens_per_s", "final_loss", "peak_host_gb", "peak_device_gb"):
            assert key in row, (name, key)
        logged = 1 if name in TRAINER_SYSTEMS else 2  # Trainer logs at its last step only
        assert row["tokens_per_s"] > 0 and len(row["step_losses"]) == logged
    assert result["ratios"]["deepspeed"] == 1.0 and set(result["ratios"]) == ran
    assert not result["lib_loss_agreement"]["checked"]
    # the fp32 acceptance criterion: DeepSpeed and rp_engine sync agree step by step
    assert result["loss_agreement"]["ok"], result["loss_agreement"]
    for name in ("roundpipe", "roundpipe_sync", "mobius"):
        row = result["systems"][name]
        assert row["bytes_per_step"] > 0 and row["calibration"]["predicted_ms"] > 0
        cal = row["calibration"]  # the overhead is measured on the same plan, and charged
        assert cal["action_overhead_ms"] >= 0
        assert cal["predicted_no_overhead_ms"] > 0
        # compute through the executor's path (its parts, in-engine factors), the cores other
        # sessions left (k = 1 .. devices + 2), and the predictions it is compared with
        assert set(cal["executor_parts_ms"]) == set(PARTS) and set(cal["in_engine_factors"]) == {
            "k_f", "k_b", "k_h",
        }  # fmt: skip
        assert len(cal["host_share"]) == 4 and cal["external_load"]["sessions"] >= 0
        for key in ("no_load", "isolated", "layer_timing"):
            assert cal[f"predicted_{key}_ms"] > 0
        assert len(cal["repeats"]) == 1 and cal["repeats"][0]["measured_ms"] > 0
    assert result["systems"]["deepspeed"]["bytes_modelled"] is True
    # DeepSpeed's loop on rp_engine and the plain Trainer take the one-schedule path: the same
    # losses as train_batch's and RoundPipeTrainer's, the same bytes per step
    systems = result["systems"]
    assert systems["roundpipe_loop"]["step_losses"] == pytest.approx(
        systems["roundpipe"]["step_losses"], rel=1e-5
    )
    trainer, fast = systems["hf_trainer"], systems["hf_roundpipe_trainer"]
    assert trainer["final_loss"] == pytest.approx(fast["final_loss"], rel=1e-5)
    assert trainer["last_step"]["uploads"] == fast["last_step"]["uploads"]
    assert "| mobius |" in proc.stdout and "vs DeepSpeed" in proc.stdout


def test_loss_agreement_flags_a_diverging_step() -> None:
    systems = {
        "deepspeed": {"step_losses": [2.0, 1.0]},
        "roundpipe_sync": {"step_losses": [2.0, 1.01]},
    }
    got = loss_agreement(systems)
    assert got["checked"] and not got["ok"] and abs(got["max_rel"] - 0.01) < 1e-9
    bf16 = loss_agreement(systems, fp32=False)  # reported, not judged: fp32's criterion
    assert bf16["ok"] is None and not bf16["checked"] and abs(bf16["max_rel"] - 0.01) < 1e-9


def test_a_system_past_its_timeout_is_a_failed_row_and_the_next_one_runs(tmp_path: Path) -> None:
    """--timeout kills a system's process (here before it has imported torch) and reports it as
    failed; --child-log keeps its stderr; --jsonl gets the row at once, without the timeline."""
    log, lines = tmp_path / "children.err", tmp_path / "h2h.jsonl"
    args = argparse.Namespace(
        model="tiny", warmup=1, steps=1, devices=None, pcie_gbps=None, calibrate=False,
        timeout=0.2, child_log=str(log),
    )  # fmt: skip
    row = run_child("torch", args)
    assert row == {"system": "torch", "error": ["timed out after 0.2 s"]}
    assert "---- torch ----" in log.read_text()
    _append_jsonl(str(lines), "tiny", 0, row)
    _append_jsonl(str(lines), "tiny", 0, {"system": "roundpipe", "timeline": [[0, "F0.0", 0, 1]]})
    got = [json.loads(line) for line in lines.read_text().splitlines()]
    assert got == [
        {"model": "tiny", "repeat": 0, **row},
        {"model": "tiny", "repeat": 0, "system": "roundpipe"},
    ]


def test_format_table_marks_a_failed_system() -> None:
    result = {"systems": {"deepspeed": {"error": ["boom"]}}, "ratios": {}}
    assert "| deepspeed | failed: boom |" in format_table(result)


def test_emulated_link_charges_fetches_and_offloads_and_waits_for_them() -> None:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(3)]
    model = torch.nn.Sequential(*layers)
    nbytes = 2_000_000  # 2 ms per transfer at 1 GB/s
    link = EmulatedZeroLink(layers, [nbytes] * 3, [nbytes] * 3, gbps=1.0)
    x = torch.randn(4, 8, requires_grad=True)
    start = time.perf_counter()
    model(x).sum().backward()
    link.wait_gradients()
    elapsed = time.perf_counter() - start
    assert link.h2d_bytes == 6 * nbytes  # every layer fetched for forward and for backward
    assert link.d2h_bytes == 3 * nbytes  # and its gradients offloaded once
    assert elapsed >= 6 * nbytes / 1e9  # the serial fetches bound the pass from below
    link.close()
    with pytest.raises(ValueError, match="pcie_gbps"):
        EmulatedZeroLink(layers, [1] * 3, [1] * 3, gbps=0)
