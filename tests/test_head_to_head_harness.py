"""The GPU head-to-head harness cannot rot: its reduced form runs here on CPU devices."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_head_to_head.py"


def test_head_to_head_harness_runs_each_system_and_reports_it() -> None:
    cmd = [sys.executable, str(SCRIPT), "--shape", "tiny", "--systems", "torch,roundpipe"]
    proc = subprocess.run(
        [*cmd, "--warmup", "1", "--steps", "1"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    by = {r["system"]: r for r in rows if "system" in r}
    assert set(by) == {"torch", "roundpipe"}
    for row in by.values():
        assert row["tokens_per_s"] > 0 and row["final_loss"] > 0
    # the same model, data and optimizer: the first steps agree closely
    assert abs(by["torch"]["final_loss"] - by["roundpipe"]["final_loss"]) < 0.05
    assert by["roundpipe"]["last_step"]["uploads"] > 0
