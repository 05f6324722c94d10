"""The squared L2 norm of a gradient, as DeepSpeed's global norm has it: the float64 value to
within fp32 rounding (about 1e-8 relative), for reporting and clipping alike.

torch's CPU reduction of a long fp32 tensor (``torch.linalg.vector_norm``, ``_foreach_norm``)
adds each of a few SIMD accumulators sequentially over millions of elements: for a sum of
squares, all positive, its rounding errors add up: 2e-3 to 8e-3 relative below the float64
value at 50M elements, ~1e-5 at 1M, ~1e-6 at 0.2M. DeepSpeed's norm is the
float64 one. Upcasting to float64 (``vector_norm(g, dtype=torch.float64)``) is exact but 40x
slower on a CPU; this module instead reduces rows of :data:`ROW` fp32 elements in one call
(each row's reduction short enough to be accurate: ~3e-9; its norm's fp32 rounding, random
from row to row, averages out), then sums the rows' squares in float64; the last partial row,
and so any tensor under ``ROW`` elements, is summed in float64 outright.

Measured on 50M fp32 elements (2 threads, a shared machine): 1.2x to 1.8x the plain fp32
reduction's time (11.5 ms against 9.7 ms at best), for 6e-9 instead of 8e-3 relative error;
the norm reads each gradient once per step, beside the optimizer's own passes over it.
"""

from __future__ import annotations

import torch

__all__ = ["ROW", "sq_norm"]

ROW = 4096  # elements per fp32 row reduction: error ~ROW * 1e-12, cost flat from 4096 up


@torch.no_grad()
def sq_norm(t: torch.Tensor) -> float:
    """Sum of squares of ``t`` (fp32, any shape; contiguous or not), accumulated as described
    above. inf and nan propagate (a non-finite gradient must reach the guard)."""
    flat = t.reshape(-1)
    whole = flat.numel() // ROW * ROW
    total = 0.0
    if whole:
        rows = torch.linalg.vector_norm(flat[:whole].view(-1, ROW), dim=1)
        total += float(rows.double().square().sum())
    if whole < flat.numel():  # under ROW elements: float64 outright costs nothing
        total += float(flat[whole:].double().square().sum())
    return total
