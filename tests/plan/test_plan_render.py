"""Tests for rp_engine.plan.render: the text grid, the Chrome trace and the PNG Gantt chart
(written, then opened and checked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rp_engine.plan import render, schedules, simulate
from rp_engine.plan.partition import LayerCosts


@pytest.fixture(scope="module")
def result() -> simulate.SimResult:
    costs = LayerCosts.uniform(
        6,
        fwd_ms=2.0,
        bwd_ms=4.0,
        head_fwd_ms=3.0,
        head_bwd_ms=6.0,
        comm_ms=0.2,
        param_bytes=50_000_000,
        boundary_bytes=4_000_000,
    )
    plan = schedules.roundpipe(
        fwd_cuts=[3, 3], bwd_cuts=[0, 2, 2, 2], num_devices=3, num_microbatches=6
    )
    machine = simulate.Machine(name="test", num_devices=3, h2d_gbps=20.0, d2h_gbps=20.0)
    return simulate.simulate(plan, costs, machine=machine, optimizer="sync")


def test_text_grid(result: simulate.SimResult) -> None:
    text = render.text_grid(result, width=60)
    rows = text.splitlines()
    assert [r.split("|")[0].strip() for r in rows[1:4]] == ["d0", "d1", "d2"]
    assert all(len(r.split("|")[1]) == 60 for r in rows[1:4])
    body = "".join(r.split("|")[1] for r in rows[1:4])
    assert {"F", "B", "h", "H", "r", "."} <= set(body)
    assert "bubble" in rows[-1]
    lanes = render.text_grid(result, width=40, lanes=("compute", "h2d_param", "d2h", "cpu"))
    assert "d0:h2d_param" in lanes and "host" in lanes


def test_chrome_trace_opens(result: simulate.SimResult, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    render.write_chrome_trace(result, path)
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(result.intervals)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert {"device 0", "device 1", "device 2", "host"} <= names
    assert {e["cat"] for e in spans} >= {"fwd", "bwd", "upload", "opt"}


def test_png_gantt_opens(result: simulate.SimResult, tmp_path: Path) -> None:
    import matplotlib.image

    path = tmp_path / "gantt.png"
    render.write_png(result, path, lanes=("compute", "h2d_param"))
    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert width > 1000 and height > 200
    assert image.std() > 0.05  # not a blank canvas
