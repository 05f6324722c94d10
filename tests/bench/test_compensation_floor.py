"""The compensation-floor benchmark cannot rot, and its floor is the engine's computation: a
small run reports every variant against DeepSpeed's step, and its hand-vectorized compensated
step agrees with the engine's ``adam_step`` to the fused-step test's rounding bounds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.compensation_floor import VARIANTS, avx2_fma, main
from rp_engine.optim import publish_kernel

pytestmark = pytest.mark.skipif(
    not avx2_fma() or publish_kernel.compiler() is None,
    reason="the floor kernels need AVX2 + FMA and a C compiler",
)


def test_small_run_reports_every_variant_and_agrees_with_adam_step(tmp_path: Path) -> None:
    out = tmp_path / "floor.json"
    assert main(["--elems", str(3 * 65536 + 8), "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    expected = {"off", "engine_lookahead", "engine_lookahead_dc", "adam_step_plain",
                "adam_step_lookahead", *VARIANTS}  # fmt: skip
    assert set(result["vs_off"]) == expected
    assert result["vs_off"]["off"] == 1.0
    assert all(math.isfinite(x) and x > 0 for x in result["seconds"].values())
    agreement = result["agreement_with_adam_step"]
    for key in ("w_err_over_bound", "m_err_over_bound", "v_err_over_bound"):
        assert agreement[key] <= 1.0, agreement
    assert agreement["out_err_ulps"] <= 3.0, agreement


def test_a_size_the_kernels_cannot_step_is_refused() -> None:
    with pytest.raises(ValueError, match="--elems 12: expected a positive multiple of 8"):
        main(["--elems", "12"])
