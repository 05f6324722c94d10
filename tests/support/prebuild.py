"""The native ops `make test` builds in the background while lint and the first tests run.

On a fresh 2-core machine DeepSpeed's aio op takes about 4 minutes to build and the AVX2 CPU
Adam of the AVX2 leg about 2; built one after the other before the tests they were a fifth of
the run (issue 51). The Makefile starts both at once, before ``make lint``, each writing
``<name>.log`` and, when it ends, ``<name>.done`` (its exit status) into the folder named by
``RP_TESTS_PREBUILD``; the compilers take what the tests leave of the two cores. A test that
needs an op calls :func:`wait` first, so it never finds the op half-built and skips:

    python tests/support/prebuild.py wait aio avx2    # the Makefile, before the AVX2 leg

Without ``RP_TESTS_PREBUILD`` (a bare ``pytest``) nothing is waited for.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ENV = "RP_TESTS_PREBUILD"
_NOTICE_S = 30.0


def wait(name: str, *, timeout_s: float = 1800.0) -> int | None:
    """Block until the background build ``name`` ended; its exit status (None: no such build
    was started, or no ``RP_TESTS_PREBUILD``). Says every 30 s what it waits for."""
    folder = os.environ.get(ENV)
    if not folder or not (Path(folder) / f"{name}.log").exists():
        return None
    done = Path(folder) / f"{name}.done"
    start = last = time.monotonic()
    while not done.exists():
        now = time.monotonic()
        if now - start > timeout_s:
            raise TimeoutError(f"the background build {name!r} did not end in {timeout_s:.0f} s")
        if now - last > _NOTICE_S:
            last = now
            print(f"waiting for the background build {name!r} ({now - start:.0f} s)", flush=True)
        time.sleep(0.5)
    text = done.read_text().strip()
    return int(text) if text.lstrip("-").isdigit() else 1


def cpu_adam_here() -> None:
    """DeepSpeed's CPU Adam built (or found built) for this venv, in this process: call it
    before running a child under a memory limit, where a JIT build (the compiler's processes
    join the child's cgroup, ~2 GB each) would be killed at the limit, a build and not the
    training (a fresh clone hits it when another venv's run rebuilt the shared cache just
    before)."""
    import torch

    from rp_engine.optim.optimizer import _cpu_adam

    _cpu_adam([{"params": [torch.nn.Parameter(torch.zeros(4))]}], adamw_mode=True, lr=1e-3)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "wait":
        print("usage: prebuild.py wait NAME...", file=sys.stderr)
        return 2
    status = 0
    for name in argv[1:]:
        rc = wait(name)
        log = Path(os.environ.get(ENV, ".")) / f"{name}.log"
        if rc:
            tail = log.read_text().splitlines()[-20:] if log.exists() else []
            print(f"background build {name!r} failed ({rc}):", *tail, sep="\n", file=sys.stderr)
            status = rc
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
