"""The GPU check cannot rot between device loans: its dry form (GPU_CHECK_DRY=1: the same script,
the tiny model on cpu:2, the CUDA tests collected and skipped) runs here end to end and must
leave what one device call may bring back."""

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
SYSTEMS = {"roundpipe", "roundpipe_loop", "roundpipe_sync", "deepspeed", "torch"}
MAX_FILES = 8  # what one device call brings back from $OUT


@pytest.mark.slow  # five interpreters and four tiny trainings: about a minute of CPU
def test_dry_gpu_check_leaves_its_four_files_and_a_json_line_per_system(tmp_path: Path) -> None:
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
    assert set(files) == {"gpu_check.log", "h2h.jsonl", "h2h_table.md", "gpu_check_rest.tar"}

    rows = [json.loads(line) for line in (out / "h2h.jsonl").read_text().splitlines()]
    assert sorted(r["system"] for r in rows) == sorted(SYSTEMS), rows
    for row in rows:
        assert "error" not in row, row
        assert row["model"] == "tiny" and row["tokens_per_s"] > 0
        assert len(row["step_losses"]) == 4  # 1 warm-up + 3 timed steps
    table = (out / "h2h_table.md").read_text()
    assert all(f"| {name} |" in table for name in SYSTEMS), table
    with tarfile.open(out / "gpu_check_rest.tar") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"gpu_tests.log", "h2h.json", "h2h_children.err", "versions.txt"} <= names, names
    log = (out / "gpu_check.log").read_text()
    assert "skipped" in log and "gpu_check: done" in log and "rp-train rc=0" in log
