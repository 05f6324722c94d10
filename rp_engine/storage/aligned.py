"""Buffers that O_DIRECT (and DeepSpeed's aio op) can read into and write from.

O_DIRECT needs the buffer address, the file offset and the length to be multiples of the
device's logical block size (512 B or 4 KiB); 4 KiB (``ALIGN``, host/units.py) satisfies both,
and is the page size, so an aligned buffer never shares a page with other data.
"""

from __future__ import annotations

import torch

from rp_engine.host.units import ALIGN

__all__ = ["ALIGN", "aligned_empty", "round_up"]


def round_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


def aligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``round_up(nbytes)`` bytes whose first byte is 4 KiB
    aligned (a view into a slightly larger allocation, which it keeps alive)."""
    size = round_up(max(nbytes, 1))
    raw = torch.empty(size + ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start : start + size]
