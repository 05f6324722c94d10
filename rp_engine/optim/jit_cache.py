"""Where rp_engine's JIT-built native code is cached: DeepSpeed's CPU Adam and aio ops and the
publish kernels of optim/publish_kernel.py all build once per machine into one user cache, so CI
runs and later sessions reuse builds that take minutes on 2 cores. Its own module because the
optimizer, the publish kernels and the storage tier all need it and none of them should import
another for it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["cpu_adam_cache_dir", "extensions_dir"]


def cpu_adam_cache_dir() -> str:
    """Where DeepSpeed's JIT-built CPU Adam lives: $TORCH_EXTENSIONS_DIR when the user set it,
    else a user cache outside any checkout, so CI runs and later sessions on one machine reuse
    the ~1-2 minute build. Reads the environment, never writes it."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "rp_engine", "torch_extensions")
    return os.environ.get("TORCH_EXTENSIONS_DIR") or default


@contextlib.contextmanager
def extensions_dir(path: str) -> Iterator[None]:
    """DeepSpeed's JIT loader reads TORCH_EXTENSIONS_DIR from the environment only: set it for
    the build/load and put the user's environment back afterwards (DeepSpeed keeps the loaded
    op in-process, so later optimizers do not look again)."""
    before = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR", None)
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = before
