"""Give freed host memory back to the OS (glibc's ``malloc_trim``).

A model's parameters are mostly allocated from the C heap: glibc raises its mmap threshold up
to 32 MiB once a large block is freed, so later tensors of a few MiB come from ``brk`` memory,
which ``free`` keeps for reuse instead of returning it. When the NVMe tiers take the module's
weights (storage/param_tier.py: the parameters become placeholders), hundreds of MiB are freed
in the middle of the heap and the process keeps them as resident memory: the user's model stays
the size of the RSS for the whole run. ``malloc_trim(0)`` releases them (the top of the heap,
and since glibc 2.8 the free pages inside it, by ``madvise``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

__all__ = ["return_freed_memory"]

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


def return_freed_memory() -> bool:
    """Return the C heap's free memory to the OS; False where the C library cannot."""
    fn = _trim()
    if fn is None:
        return False
    fn(0)  # type: ignore[operator]
    return True
