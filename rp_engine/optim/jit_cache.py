"""Where rp_engine's JIT-built native code is cached: DeepSpeed's CPU Adam and aio ops and the
publish kernels of optim/publish_kernel.py all build once per machine into one user cache, so CI
runs and later sessions reuse builds that take minutes on 2 cores. Its own module because the
optimizer, the publish kernels and the storage tier all need it and none of them should import
another for it.

Every build runs the ninja of this interpreter's environment (the ``ninja`` package rp_engine
depends on), whatever PATH says: ninja keys each object by a hash of its command that differs
between ninja versions (1.11 and 1.13 disagree), so a build by another ninja on PATH (a system
one) rebuilds every op in the shared cache, and the next build by the first ninja rebuilds them
again (the aio op: 2-10 minutes on 2 cores). Where DeepSpeed builds its own ops into this cache
(the tests' reference runs, some benchmarks), the entry point puts the same ninja first on PATH
with ``with_own_ninja``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["cpu_adam_cache_dir", "extensions_dir", "with_own_ninja"]


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
    before = {key: os.environ.get(key) for key in ("TORCH_EXTENSIONS_DIR", "PATH")}
    os.environ["TORCH_EXTENSIONS_DIR"] = path
    os.environ["PATH"] = with_own_ninja(before["PATH"] or "")  # torch runs `ninja` off PATH
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def with_own_ninja(path: str) -> str:
    """``path`` (a PATH value) with the folder of this environment's ninja first (see the module
    docstring), or unchanged when the ``ninja`` package is not installed."""
    try:
        import ninja
    except ImportError:
        return path
    own = str(ninja.BIN_DIR)
    rest = [entry for entry in path.split(os.pathsep) if entry and entry != own]
    return os.pathsep.join([own, *rest])
