"""The compensation-floor benchmark cannot rot, and its floor is the engine's computation: a
small run reports every variant against DeepSpeed's step, and its hand-vectorized compensated
step agrees with the engine's ``adam_step`` to the fused-step test's rounding bounds."""

from __future__ import annotations

import ctypes
import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks.studies.compensation_floor import VARIANTS, Terms, avx2_fma, load, main
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


def test_the_shared_denominator_lookahead_is_the_next_step_under_a_constant_gradient() -> None:
    """The cheaper method the benchmark times (``hand_shared_lookahead``) predicts exactly the
    next step's masters when the gradient repeats, as the engine's methods do, to rounding."""
    lib, n, lr = load(), 4096, 1e-3
    gen = torch.Generator().manual_seed(5)
    w, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    m, v = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    sums = (ctypes.c_double * 3)()
    predicted: torch.Tensor | None = None  # the previous step's prediction of this step
    for step in range(1, 6):
        bc1, bc1_next = 1 - 0.9**step, 1 - 0.9 ** (step + 1)
        rbc2_next = (1 - 0.999 ** (step + 1)) ** 0.5
        terms = Terms(
            0.0, 0.0, 0.0, 0.9, 0.999, -lr / bc1, 1 / (1 - 0.999**step) ** 0.5, 1e-8, 0.0,
            1.0, -lr * rbc2_next / bc1_next, 1e-8 * rbc2_next, -lr / bc1_next,
        )  # fmt: skip
        before = w.clone()
        lib.floor_step(g.data_ptr(), w.data_ptr(), m.data_ptr(), v.data_ptr(), out.data_ptr(),
                       n, n, 3, 0, ctypes.byref(terms), ctypes.addressof(sums))  # fmt: skip
        if predicted is not None:
            ulp = w.abs() * torch.finfo(torch.bfloat16).eps
            assert ((predicted - w).abs() <= ulp + (w - before).abs() * 1e-4).all()
        predicted = out.float()
