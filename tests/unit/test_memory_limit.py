"""tests/support/memory_limit.py: a child past its memory limit is killed and reported so, one
within it runs to the end with its peak measured, by each mechanism this machine has (a memory
cgroup where this process may make one, and RSS sampling everywhere); the cgroup goes afterwards,
also after a timeout.

The child allocates and touches 300 MB (``bytearray`` zero-fills it; every page is written once
more), prints ``allocated`` and holds the memory 0.3 s: long enough for the 20 ms RSS sampler to
see it before it exits. Each run takes well under a second.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from memory_limit import _locate, cgroup_mechanism, run_limited

MB = 2**20
SIZE = 300 * MB
ALLOCATE = textwrap.dedent(
    """
    import sys, time
    n = int(sys.argv[1])
    b = bytearray(n)
    for i in range(0, n, 4096):
        b[i] = 1
    print("allocated", flush=True)
    time.sleep(0.3)
    """
)

CGROUP = cgroup_mechanism()
MECHANISMS = [
    pytest.param(
        CGROUP or "cgroup", marks=pytest.mark.skipif(CGROUP is None, reason="no memory cgroup")
    ),
    "rss-sampling",
]


def _allocate(size: int, limit: int, mechanism: str):
    return run_limited(
        [sys.executable, "-c", ALLOCATE, str(size)], limit, mechanism=mechanism, timeout=60
    )


def _groups() -> set[Path]:
    """This module's groups (made by any process) where this process makes its own."""
    found = _locate()
    return set(found[1].glob("rp_memlimit_*")) if found else set()


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_child_past_the_limit_is_killed(mechanism: str) -> None:
    before = _groups()
    run = _allocate(SIZE, 150 * MB, mechanism)
    assert run.mechanism == mechanism
    assert run.killed_by_limit, run
    assert run.returncode == -9, run
    assert "allocated" not in run.stdout
    assert run.peak_bytes <= SIZE
    assert _groups() <= before


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_child_within_the_limit_runs_and_its_peak_is_measured(mechanism: str) -> None:
    before = _groups()
    run = _allocate(SIZE, 2**30, mechanism)
    assert run.mechanism == mechanism
    assert not run.killed_by_limit, run
    assert run.returncode == 0, run.stderr[-6000:]
    assert run.stdout.strip() == "allocated"
    assert SIZE <= run.peak_bytes <= 2**30, run.peak_bytes / MB
    assert _groups() <= before


def test_the_default_is_the_cgroup_where_there_is_one() -> None:
    run = run_limited([sys.executable, "-c", "pass"], 256 * MB)
    assert run.mechanism == (CGROUP or "rss-sampling")
    assert run.returncode == 0 and not run.killed_by_limit


@pytest.mark.skipif(CGROUP is None, reason="no memory cgroup")
def test_the_child_runs_in_a_fresh_group_nested_under_this_process() -> None:
    show = "print(open('/proc/self/cgroup').read())"
    run = run_limited([sys.executable, "-c", show], 256 * MB)
    own = dict(line.split(":", 2)[1:] for line in Path("/proc/self/cgroup").read_text().split())
    child = dict(line.split(":", 2)[1:] for line in run.stdout.split())
    controller = "memory" if CGROUP == "cgroup-v1" else ""
    parent, _, name = child[controller].rpartition("/")
    assert name.startswith("rp_memlimit_")
    # v2 makes it beside this process's group where that one cannot delegate memory
    assert parent in (own[controller], own[controller].rpartition("/")[0])
    assert name not in {g.name for g in _groups()}


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_timeout_kills_the_child_and_removes_its_group(mechanism: str) -> None:
    before = _groups()
    # a grandchild too: both must go (the group's procs, or the child's session)
    sleeper = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "time.sleep(60)\n"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        run_limited([sys.executable, "-c", sleeper], 256 * MB, mechanism=mechanism, timeout=0.5)
    assert _groups() <= before


def test_the_sampler_counts_the_whole_process_tree() -> None:
    spawn = (
        "import subprocess, sys\n"
        f"sys.exit(subprocess.run([sys.executable, '-c', {ALLOCATE!r}, '{SIZE}']).returncode)\n"
    )
    run = run_limited([sys.executable, "-c", spawn], 150 * MB, mechanism="rss-sampling")
    assert run.killed_by_limit and run.returncode == -9, run
    assert "allocated" not in run.stdout


def test_an_unknown_or_unusable_mechanism_is_refused() -> None:
    with pytest.raises(ValueError):
        run_limited([sys.executable, "-c", "pass"], MB, mechanism="cgroup-v3")
    missing = {"cgroup-v1", "cgroup-v2"} - {CGROUP}
    for mechanism in missing:
        with pytest.raises(RuntimeError):
            run_limited([sys.executable, "-c", "pass"], MB, mechanism=mechanism)
