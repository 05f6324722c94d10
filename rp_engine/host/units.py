"""Byte sizes and how messages print them: one home for the constants and formatters that the
planner (plan/), the initialize preflight, and the NVMe tier (storage/) share.

Three formatters because the messages they serve differ, and changing one would change what
users read: ``format_bytes`` for plans and errors (B to GiB), ``format_mib_gib`` for the host
RAM tables (MiB or GiB), ``format_gib_exact`` for NVMe space errors (GiB and the exact bytes).
Standard library only.
"""

from __future__ import annotations

__all__ = ["ALIGN", "GIB", "KIB", "MIB", "format_bytes", "format_gib_exact", "format_mib_gib"]

KIB = 2**10
MIB = 2**20
GIB = 2**30

# O_DIRECT needs the buffer address, the file offset and the length to be multiples of the
# device's logical block size (512 B or 4 KiB); 4 KiB satisfies both and is the page size. The
# NVMe tier aligns its buffers and records to it, and the host-RAM model rounds pool buffers so.
ALIGN = 4096


def format_bytes(n: float) -> str:
    """Human-readable size for messages: '512 B', '3.0 KiB', '3.0 MiB', '22.50 GiB'."""
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n:.0f} B" if abs(n) < KIB else f"{n / KIB:.1f} KiB"


def format_mib_gib(n: float) -> str:
    """``n`` bytes as GiB (from 1 GiB on) or MiB: the host RAM tables' unit."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def format_gib_exact(n: int) -> str:
    """``n`` bytes as GiB with the exact count: '1.50 GiB (1610612736 bytes)'."""
    return f"{n / GIB:.2f} GiB ({n} bytes)"
