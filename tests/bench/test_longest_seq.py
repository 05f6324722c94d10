"""The longest-sequence search (benchmarks/longest_seq.py) on fake probes, in milliseconds; the
real probes run in the dry GPU check (tests/bench/test_gpu_check.py) and on a GPU."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.common import PRESETS
from benchmarks.longest_seq import advisor_prediction, format_table, probe_preset, search


def _fake(limit: int) -> tuple[Any, list[int]]:
    """A probe that trains every length up to ``limit``; records what was asked."""
    asked: list[int] = []

    def probe(seq: int) -> dict[str, Any]:
        asked.append(seq)
        return {"seq": seq, "ok": seq <= limit, "reason": None if seq <= limit else "OOM"}

    return probe, asked


def test_doubling_then_bisection_brackets_the_limit_within_the_step() -> None:
    probe, asked = _fake(100_000)
    got = search(probe, start=65536, minimum=8192, maximum=262144, step=8192)
    assert asked[:2] == [65536, 131072]  # up until a failure, then halve the gap
    assert got["longest_ok"] <= 100_000 < got["first_fail"]
    assert got["first_fail"] - got["longest_ok"] <= 8192 and got["longest_ok"] % 8192 == 0
    assert not got["capped"] and got["stopped"] is None and len(got["probes"]) == len(asked)


def test_halving_from_a_failing_start_and_nothing_fitting() -> None:
    probe, asked = _fake(20_000)
    got = search(probe, start=65536, minimum=4096, maximum=131072, step=4096)
    assert asked[:3] == [65536, 32768, 16384]
    assert got["longest_ok"] == 16384 and got["first_fail"] == 20480
    probe, asked = _fake(1000)
    got = search(probe, start=8192, minimum=4096, maximum=131072, step=4096)
    assert asked == [8192, 4096] and got["longest_ok"] is None and got["first_fail"] == 4096


def test_a_search_capped_at_its_maximum_and_one_out_of_time() -> None:
    probe, asked = _fake(10**9)
    got = search(probe, start=32768, minimum=4096, maximum=131072, step=8192)
    assert asked == [32768, 65536, 131072] and got["capped"] and got["longest_ok"] == 131072
    probe, asked = _fake(100_000)
    clock = iter([100.0, 100.0, 10.0, 10.0])  # enough for two probes, then not
    got = search(probe, start=65536, minimum=4096, maximum=262144, step=8192,
                 time_left=lambda: next(clock), min_probe_s=30)  # fmt: skip
    assert asked == [65536, 131072] and got["stopped"].startswith("time budget")
    assert (got["longest_ok"], got["first_fail"]) == (65536, 131072)


def test_the_advisor_prediction_and_the_table() -> None:
    preset = probe_preset("qwen3-1.7b", 65536, 24.0, None)
    assert preset["mbs"] == 1 and preset["gas"] == 1 and preset["seq"] == 65536
    predicted = advisor_prediction(preset, 24.0)
    # the memory model's longest single sequence in 24 GiB: tens of K tokens, in 1K steps
    assert predicted is not None and predicted % 1024 == 0 and 16384 <= predicted <= 1 << 22
    assert advisor_prediction(preset, 48.0) > predicted
    assert probe_preset("qwen3-8b", 8192, 24.0, 4)["num_hidden_layers"] == 4
    result = {"model": "qwen3-1.7b", "layers": None, "budget_gib": 24.0, "longest_ok": 90112,
              "first_fail": 98304, "capped": False, "advisor_prediction": predicted,
              "published": {"tokens": "73K"},
              "probes": [{"seq": 98304, "ok": False, "reason": "OutOfMemoryError: CUDA"}]}  # fmt: skip
    table = format_table(result)
    assert "| qwen3-1.7b | 24 GiB | 88K | 96K (OutOfMemoryError: CUDA) |" in table
    assert table.rstrip().endswith("| 73K |")


@pytest.mark.parametrize("model", ["qwen3-1.7b", "qwen3-8b", "tiny"])
def test_probe_presets_keep_the_head_to_head_shapes(model: str) -> None:
    got = probe_preset(model, 4096, 1.0, None)
    assert {k: v for k, v in got.items() if k in ("hidden_size", "vocab_size", "dtype")} == {
        k: PRESETS[model][k] for k in ("hidden_size", "vocab_size", "dtype")
    }
    assert got["max_position_embeddings"] >= 4096 and got["device_memory_gb"] == 1.0
