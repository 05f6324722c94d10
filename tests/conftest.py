"""Shared test setup: DeepSpeed's CPU Adam build cache outside the checkout, built and checked by
one ninja, no background build of the aio op, sleeping OpenMP waits, quiet logs, and one CPU
probe per test process."""

from __future__ import annotations

import functools
import json
import os
import signal
from typing import Any

from rp_engine.host.jit_cache import with_own_ninja

os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    os.path.join(os.path.expanduser("~"), ".cache", "rp_engine", "torch_extensions"),
)
os.environ.setdefault("WANDB_MODE", "disabled")
# A test run never starts the aio op's detached background build (storage/io_engine.py: an NVMe
# tier on "auto" that finds the op unbuilt would, from every test and child process): `make test`
# builds the op first, with `make aio`. The child processes inherit it.
os.environ.setdefault("RP_ENGINE_AIO_BUILD", "0")
# OpenMP threads that wait at a barrier sleep instead of spinning (libgomp's default spins): the
# CPU engine runs torch (and CPU Adam) on several threads at once, each with its own OpenMP team,
# and when other processes share the 2 cores the spinning teams take the time slices of the
# threads that do the work. test_runtime_parity.py beside two busy processes: 77 s spinning,
# 29 s sleeping; on an idle machine a wash (12 engine test files: 104.5 s vs 102.8 s). Results do
# not change (same teams, same sizes). Set before anything loads libgomp (torch); the child
# processes inherit it (benchmarks/head_to_head.py sets it for its children for the same reason).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The environment's own ninja first on PATH, as `make` puts it, also for a bare `pytest`: the
# DeepSpeed reference runs and the child processes build and check the same cached ops as the
# engine (rp_engine/host/jit_cache.py; another ninja rebuilds each of them, the aio op minutes).
os.environ["PATH"] = with_own_ninja(os.environ.get("PATH", ""))
# Ctrl-C as a terminal delivers it, even when the suite was started in the background of a
# non-interactive shell (`make test &`, nohup, CI runners): POSIX has such a shell start its
# background jobs with SIGINT ignored, Python then installs no KeyboardInterrupt handler, and the
# ignore is inherited through exec by every child. The Ctrl-C fault tests (in process and in child
# processes) would see no interrupt at all. Installing Python's handler here also gives the
# children the default disposition (exec resets handled signals, not ignored ones).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _probe_the_cpu_once() -> None:
    """DeepSpeedCPUAdam's constructor calls ``cpuinfo.get_cpu_info()``, which runs a Python
    subprocess (~1.2 s, nearly all of an engine's construction on CPU); the suite builds hundreds
    of engines in one process on one CPU, so the answer is kept (it is read by ``from cpuinfo
    import get_cpu_info`` inside the constructor, hence patching the module attribute works).
    Probed here, once, and handed to the child processes too (``RP_TESTS_CPU_INFO``, read by
    tests/support/sitecustomize.py): each of them would otherwise probe three times."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed brings it; without it nothing calls it
        return
    probe = functools.cache(cpuinfo.get_cpu_info)

    def get_cpu_info() -> dict[str, Any]:
        return dict(probe())  # a copy: a caller may edit its dict

    cpuinfo.get_cpu_info = get_cpu_info
    os.environ.setdefault("RP_TESTS_CPU_INFO", json.dumps(probe()))


_probe_the_cpu_once()
