"""A CUDA device emulating a smaller card: the caching allocator capped at a budget.

Shared by the benchmarks that must fail where a card of the budget's size would (the
longest-sequence search, the RoundPipe library's head-to-head run); a leaf module, so each of
them can import it without importing the others.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GIB", "cap_cuda_memory"]

GIB = 2**30  # rp_engine reads device_memory_gb as GiB


def cap_cuda_memory(budget_gib: float) -> dict[str, Any]:
    """Emulate a card of ``budget_gib`` GiB: cap this process's caching allocator at the budget
    less what the device already holds (the CUDA context, other processes), so allocating past
    the budget raises ``torch.OutOfMemoryError``. Call before any allocation; returns the
    figures (bytes)."""
    import torch

    free, total = torch.cuda.mem_get_info()  # initialises the context first
    resident = total - free
    allowed = int(budget_gib * GIB) - resident
    if allowed <= 0:
        raise RuntimeError(
            f"{resident / GIB:.2f} GiB already resident: over a {budget_gib} GiB budget"
        )
    fraction = min(1.0, allowed / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    return {"budget_bytes": int(budget_gib * GIB), "total_bytes": total,
            "resident_bytes": resident, "fraction": fraction}  # fmt: skip
