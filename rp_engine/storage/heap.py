"""Give freed host memory back to the OS (glibc's ``malloc_trim``).

A model's parameters are mostly allocated from the C heap: glibc raises its mmap threshold up
to 32 MiB once a large block is freed, so later tensors of a few MiB come from ``brk`` memory,
which ``free`` keeps for reuse instead of returning it. When the NVMe tiers take the module's
weights (storage/param_tier.py: the parameters become placeholders), hundreds of MiB are freed
in the middle of the heap and the process keeps them as resident memory: the user's model stays
the size of the RSS for the whole run. ``malloc_trim(0)`` releases them (the top of the heap,
and since glibc 2.8 the free pages inside it, by ``madvise``).

The same rise keeps the training's own large temporaries (a CPU virtual device's activations
and gradients, a layer's fp32 conversions: 1-50 MiB each, made and freed every step, on many
threads, each with its own malloc arena) in the heap once freed: measured, 450 MiB more anonymous
memory than any live tensor on a 713M-parameter full fine-tune with both NVMe tiers
(benchmarks/RESULTS.md, "Sliced pools"). ``bound_heap`` fixes the threshold at
``MMAP_THRESHOLD`` (``mallopt(M_MMAP_THRESHOLD)``, which also stops the rise), so every block
of that size is its own mapping, returned to the OS when freed: what the process holds is then
what is alive. The engine does it when the NVMe tiers bound the run's host memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

__all__ = ["MMAP_THRESHOLD", "bound_heap", "return_freed_memory"]

# Blocks from this size up are mapped and unmapped on their own (``bound_heap``): 1 MiB, past
# the small tensors and buffers that the heap serves best, below every weight or gradient piece
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter

log = logging.getLogger("rp_engine.storage")


@functools.cache
def _trim() -> object | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _mallopt() -> object | None:
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc: its allocator has its own rules
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def bound_heap(threshold: int = MMAP_THRESHOLD) -> bool:
    """Blocks of ``threshold`` bytes and more are mapped apart and unmapped when freed, for
    the rest of the process (see the module doc); False where the C library cannot."""
    fn = _mallopt()
    if fn is None or not fn(_M_MMAP_THRESHOLD, threshold):  # type: ignore[operator]
        return False
    log.info("host heap: blocks of %d KiB and more go back to the OS when freed", threshold >> 10)
    return True


def return_freed_memory() -> bool:
    """Return the C heap's free memory to the OS; False where the C library cannot."""
    fn = _trim()
    if fn is None:
        return False
    fn(0)  # type: ignore[operator]
    return True
