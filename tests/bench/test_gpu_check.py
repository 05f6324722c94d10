"""The GPU check cannot rot between device loans: its dry form (GPU_CHECK_DRY=1: the same script,
the tiny model on cpu:2, the CUDA tests collected and skipped, the RoundPipe library a skipped
row, the longest-sequence search on a tiny budget) runs here end to end and must leave what one
device call may bring back."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = {"roundpipe", "roundpipe_loop", "roundpipe_sync", "deepspeed", "torch", "roundpipe_auto"}
GPU_ONLY = {"roundpipe_lib"}  # a skipped row on CPU
FILES = {"gpu_check.log", "h2h.jsonl", "h2h_table.md", "longest_seq.jsonl", "gpu_check_rest.tar"}
MAX_FILES = 8  # what one device call brings back from $OUT


@pytest.mark.slow  # eight interpreters and seven tiny trainings: about a minute and a half of CPU
def test_dry_gpu_check_leaves_its_files_and_a_json_line_per_system_and_leg(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {
        **os.environ,
        "GPU_CHECK_DRY": "1",
        "OUT": str(out),
        "PYTHON": sys.executable,
        # tests/support: its sitecustomize hands the children the suite's CPU probe
        "PYTHONPATH": str(ROOT / "tests" / "support"),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    script = ROOT / "benchmarks" / "gpu_check.sh"
    proc = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=900, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]

    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert len(files) <= MAX_FILES, files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files), files  # names it brings back
    assert set(files) == FILES

    rows = [json.loads(line) for line in (out / "h2h.jsonl").read_text().splitlines()]
    assert sorted(r["system"] for r in rows) == sorted(SYSTEMS | GPU_ONLY), rows
    for row in rows:
        assert "error" not in row, row
        if row["system"] in GPU_ONLY:  # skipped, saying why, with its configuration notes
            assert row["skipped"].startswith("needs CUDA") and row["differences"], row
            continue
        assert row["model"] == "tiny" and row["tokens_per_s"] > 0
        assert len(row["step_losses"]) == 4  # 1 warm-up + 3 timed steps
    table = (out / "h2h_table.md").read_text()
    assert all(f"| {name} |" in table for name in SYSTEMS), table
    assert "| roundpipe_lib | skipped: needs CUDA" in table and "- roundpipe_lib:\n  - " in table

    # the longest-sequence legs: each probe's line, then a summary line per search
    seq = [json.loads(line) for line in (out / "longest_seq.jsonl").read_text().splitlines()]
    summaries = [r for r in seq if r["leg"] == "longest_seq"]
    probes = [r for r in seq if r["leg"] == "longest_seq_probe"]
    assert [r["layers"] for r in summaries] == [None, 2], seq  # 1.7B's leg, then the 8B's
    first = summaries[0]  # 2K tokens train in 20 MiB (4K did not as rp_engine plans today)
    assert first["longest_ok"] in (2048, 4096) and first["capped"] == (first["first_fail"] is None)
    assert {"advisor_prediction", "published", "budget_gib", "granularity"} <= set(first)
    assert 2 <= len(probes) <= 3 and all(p["ok"] or p["reason"] for p in probes), probes
    assert all(p["losses"] and p["peak_gb"] <= 0.02 * 2**30 / 1e9 for p in probes if p["ok"])

    with tarfile.open(out / "gpu_check_rest.tar") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"gpu_tests.log", "h2h.json", "h2h_children.err", "versions.txt"} <= names, names
    assert {"longest_seq.json", "longest_seq_8b.json", "longest_seq_children.err"} <= names
    log = (out / "gpu_check.log").read_text()
    assert "skipped" in log and "gpu_check: done" in log and "rp-train rc=0" in log
    assert "longest_seq rc=0" in log and "longest_seq_8b rc=0" in log
