"""The limit that binds (rp_engine/host/memory_limit.py) read from fake /proc and cgroup trees.

Each tree is built under ``tmp_path``: ``proc/self/cgroup`` and ``proc/self/mountinfo`` name the
process's groups and where they are mounted (mount points resolved under ``tmp_path / "root"``),
``proc/meminfo`` and ``proc/self/status`` the host's free memory and the process's sizes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rp_engine.host import memory_limit as ml
from rp_engine.host.units import GIB, MIB, format_mib_gib

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNT = "35 31 0:32 {root} /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"


def _proc(tmp_path: Path, cgroup: str, mountinfo: str, *, avail: int = 64 * GIB) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text(
        "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n" + mountinfo
    )
    (proc / "self" / "status").write_text(
        f"Name:\tpython\nVmSize:\t{8 * GIB // 1024} kB\nVmRSS:\t{300 * MIB // 1024} kB\n"
    )
    (proc / "meminfo").write_text(
        f"MemTotal:       {128 * GIB // 1024} kB\nMemAvailable:   {avail // 1024} kB\n"
    )
    return proc


def _group(path: Path, **files: str | int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (path / name.replace("_", ".", 1)).write_text(f"{value}\n")
    return path


def _find(tmp_path: Path, proc: Path, **kw) -> ml.HostMemory:
    return ml.host_memory(proc=proc, root=tmp_path / "root", **kw)


def test_v2_nested_the_ancestors_limit_binds_and_max_means_none(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "0::/job/step\n", V2_MOUNT)
    base = tmp_path / "root/sys/fs/cgroup"
    stat = "anon 100\nfile 3000000000\ninactive_file 1000000000\nactive_file 2000000000\n"
    _group(base / "job", memory_max=4 * GIB, memory_high="max", memory_current=3 * GIB,
           memory_stat=stat)  # fmt: skip
    _group(base / "job/step", memory_max="max", memory_high="max", memory_current=GIB,
           memory_stat="inactive_file 0\n")  # fmt: skip
    found = _find(tmp_path, proc)
    # the parent's 4 GiB less its working set (usage less inactive file pages) binds
    assert found.source == f"cgroup v2 memory.max at {base / 'job'}"
    assert found.available == 4 * GIB - (3 * GIB - 1_000_000_000)
    # "max" is no limit: the step's own group adds none; the host's MemAvailable is listed
    sources = [lim.source for lim in found.limits]
    assert not any("step" in s for s in sources) and "host MemAvailable" in sources
    assert "available under cgroup v2 memory.max" in found.describe(format_mib_gib)


def test_v2_memory_high_lower_than_max_binds(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "0::/slurm/job_7\n", V2_MOUNT)
    base = tmp_path / "root/sys/fs/cgroup"
    _group(base / "slurm", memory_max="max", memory_current=GIB)
    _group(base / "slurm/job_7", memory_max=8 * GIB, memory_high=2 * GIB,
           memory_current=GIB // 2, memory_stat="inactive_file 0\n")  # fmt: skip
    found = _find(tmp_path, proc)
    assert found.source == f"cgroup v2 memory.high at {base / 'slurm/job_7'}"
    assert found.available == 2 * GIB - GIB // 2
    assert any(lim.source.startswith("cgroup v2 memory.max") for lim in found.limits)


def test_v2_namespaced_container_reads_the_mount_root(tmp_path: Path) -> None:
    # Docker with a cgroup namespace: the process sees itself at "/", the mount is its group
    proc = _proc(tmp_path, "0::/\n", V2_MOUNT)
    _group(tmp_path / "root/sys/fs/cgroup", memory_max=int(1.46 * GIB), memory_current=MIB)
    found = _find(tmp_path, proc)
    assert found.binding.limit == int(1.46 * GIB) and found.binding.used == MIB


def test_v1_limit_walks_up_and_huge_means_none(tmp_path: Path) -> None:
    cgroup = "4:memory:/docker/abc\n3:cpu:/\n0::/\n"  # hybrid: v2 mounted without memory
    mounts = V1_MOUNT.format(root="/") + V2_MOUNT
    proc = _proc(tmp_path, cgroup, mounts)
    base = tmp_path / "root/sys/fs/cgroup/memory"
    _group(base, memory_limit_in_bytes=9223372036854771712, memory_usage_in_bytes=50 * GIB)
    _group(base / "docker", memory_limit_in_bytes=3 * GIB, memory_usage_in_bytes=2 * GIB,
           memory_stat="total_inactive_file 0\n")  # fmt: skip
    _group(base / "docker/abc", memory_limit_in_bytes=9223372036854771712,
           memory_usage_in_bytes=GIB,
           memory_stat=f"inactive_file 5\ntotal_inactive_file {GIB // 4}\n"
                       f"hierarchical_memory_limit {3 * GIB}\n")  # fmt: skip
    _group(tmp_path / "root/sys/fs/cgroup")  # the v2 hierarchy: no memory files
    found = _find(tmp_path, proc)
    assert found.source == f"cgroup v1 memory.limit_in_bytes at {base / 'docker'}"
    assert found.available == GIB
    assert [lim.limit for lim in found.limits if lim.source.startswith("cgroup")] == [3 * GIB]


def test_v1_hierarchical_limit_of_an_ancestor_outside_the_mount(tmp_path: Path) -> None:
    # the container's mount root is its own group: the limit is set on a parent it cannot see
    proc = _proc(
        tmp_path, "4:memory:/kubepods/pod1/c1\n", V1_MOUNT.format(root="/kubepods/pod1/c1")
    )
    base = tmp_path / "root/sys/fs/cgroup/memory"
    _group(base, memory_limit_in_bytes=9223372036854771712, memory_usage_in_bytes=GIB,
           memory_stat=f"total_inactive_file {GIB // 2}\nhierarchical_memory_limit {2 * GIB}\n")  # fmt: skip
    found = _find(tmp_path, proc)
    assert found.source == f"cgroup v1 hierarchical_memory_limit at {base}"
    assert found.available == 2 * GIB - GIB // 2


def test_budget_and_host_bind_when_smaller(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "0::/\n", V2_MOUNT, avail=3 * GIB)
    _group(tmp_path / "root/sys/fs/cgroup", memory_max=8 * GIB, memory_current=GIB)
    assert _find(tmp_path, proc).source == "host MemAvailable"
    assert _find(tmp_path, proc).available == 3 * GIB
    budget = _find(tmp_path, proc, budget_bytes=2 * GIB)
    # the budget counts against the process's resident memory (VmRSS)
    assert budget.source == ml.BUDGET_KEY and budget.available == 2 * GIB - 300 * MIB
    # the caller's measure of the host's free memory replaces MemAvailable
    assert _find(tmp_path, proc, host_available=MIB).available == MIB


def test_rlimit_as_counts_against_the_address_space(tmp_path: Path, monkeypatch) -> None:
    proc = _proc(tmp_path, "0::/\n", V2_MOUNT)
    monkeypatch.setattr(ml.resource, "getrlimit", lambda _: (10 * GIB, ml.resource.RLIM_INFINITY))
    found = _find(tmp_path, proc)
    assert found.source.startswith("RLIMIT_AS") and found.available == 2 * GIB  # 10 - 8 VmSize


def test_no_cgroup_files_and_no_proc(tmp_path: Path) -> None:
    found = ml.host_memory(proc=tmp_path / "none", root=tmp_path)
    assert found.available > 0 and found.source in ("no limit found", "RLIMIT_AS (ulimit -v)")
    with pytest.raises(ValueError):
        ml.HostMemory(())


def test_this_host_reads_without_error() -> None:
    found = ml.host_memory()
    assert found.available > 0 and any(lim.source == "host MemAvailable" for lim in found.limits)


# --- the preflight holds a run to the limit that binds ----------------------------------------
def test_the_budget_binds_the_initialize_preflight_and_is_named() -> None:
    import torch

    from rp_engine.config import load_config
    from rp_engine.host_preflight import PreflightError, check_initialize

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    base = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    check_initialize(model, load_config(base))  # 2 MiB of state: fits this host
    # a budget below the process's resident memory leaves nothing: refused, the key named
    tight = load_config({**base, "roundpipe": {"host_memory_gb": 0.001}})
    with pytest.raises(PreflightError) as err:
        check_initialize(model, tight)
    text = str(err.value)
    assert f"the limit that binds: 0.0 MiB available under {ml.BUDGET_KEY}" in text
    assert "fp32 masters" in text and f"raise {ml.BUDGET_KEY}" in text
    off = load_config({**base, "roundpipe": {"host_memory_gb": 0.001, "host_preflight": False}})
    check_initialize(model, off)
