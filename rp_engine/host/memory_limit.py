"""The host memory limit that binds this process: the cgroup's, the address-space rlimit's, a
configured budget's or the host's free memory, whichever leaves least.

A Docker, Kubernetes or Slurm job runs under a memory cgroup: past its limit the kernel's OOM
killer SIGKILLs the process, with no message, however much memory the host has free. So the
memory a run may still take is the smallest of:

  cgroup v2     ``memory.max`` and ``memory.high`` of the process's cgroup and of every ancestor
                visible in the mount (``"max"``: none; ``memory.high`` throttles and reclaims
                rather than kills, but a run held above it crawls, so it binds too)
  cgroup v1     ``memory.limit_in_bytes`` of the cgroup and its visible ancestors (values of
                2^60 and more: none), and ``memory.stat``'s ``hierarchical_memory_limit``, which
                also counts ancestors outside the mount (a container's own mount root)
  RLIMIT_AS     the address-space rlimit (``ulimit -v``), against this process's address space
                (``VmSize``: virtual, so torch's reservations count)
  budget        ``roundpipe.host_memory_gb``, against this process's resident memory
  host          ``MemAvailable`` of ``/proc/meminfo`` (what the kernel can give without swapping)

What a cgroup limit leaves is the limit minus the group's working set: its usage
(``memory.current`` / ``memory.usage_in_bytes``, which include the page cache of the files the
group read or wrote) less its inactive file pages (``memory.stat``'s ``inactive_file``; v1
``total_inactive_file``), which the kernel drops before it OOM-kills. This is the working set
that the kubelet evicts on and ``docker stats`` reports. The active file pages are kept as used:
they are usually reclaimable too (clean pages of a mapped model), but not always (tmpfs and
shared memory count as file pages, and dirty pages must be written first), so counting them is
the conservative side. An ancestor's usage includes its other children's: what it leaves is
what every process under it still shares.

Not read: cgroup limits above the mount's root other than v1's hierarchical limit (a v2
container sees only its namespace), swap (``memory.swap.max``), ``RLIMIT_DATA`` / ``RLIMIT_RSS``,
and NUMA or hugepage limits. Every root (``/proc``, the cgroup mounts) is a parameter, so tests
build fake trees. Standard library only (the host room imports nothing of rp_engine).
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BUDGET_KEY",
    "NO_LIMIT_V1",
    "HostMemory",
    "Limit",
    "find_limits",
    "host_memory",
    "status_bytes",
]

BUDGET_KEY = "roundpipe.host_memory_gb"
# cgroup v1 writes "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 on 4 KiB pages);
# anything from 2^60 (an exabyte) up is read as none
NO_LIMIT_V1 = 2**60


@dataclass(frozen=True)
class Limit:
    """One memory limit: where it comes from, its size, and what this process (or its group)
    uses of it now; ``available`` is what it leaves."""

    source: str  # "cgroup v2 memory.max at /sys/fs/cgroup/job", "RLIMIT_AS", ...
    limit: int
    used: int

    @property
    def available(self) -> int:
        return max(0, self.limit - self.used)


@dataclass(frozen=True)
class HostMemory:
    """Every limit found, and the one that binds (leaves the least)."""

    limits: tuple[Limit, ...]

    def __post_init__(self) -> None:
        if not self.limits:
            raise ValueError("HostMemory needs at least one limit (the host's MemAvailable)")

    @property
    def binding(self) -> Limit:
        return min(self.limits, key=lambda lim: lim.available)

    @property
    def available(self) -> int:
        """Bytes this process can still allocate before the binding limit is reached."""
        return self.binding.available

    @property
    def source(self) -> str:
        return self.binding.source

    def describe(self, fmt: Callable[[float], str]) -> str:
        """'1.21 GiB available under cgroup v1 memory.limit_in_bytes at ... (limit 1.46 GiB,
        0.25 GiB in use)': the binding limit for a message, sizes printed with ``fmt``."""
        b = self.binding
        return f"{fmt(b.available)} available under {b.source} (limit {fmt(b.limit)}, {fmt(b.used)} in use)"


def host_memory(
    *, budget_bytes: int | None = None, host_available: int | None = None,
    proc: Path = Path("/proc"), root: Path = Path("/"),
) -> HostMemory:  # fmt: skip
    """The limits of this process (see the module doc). ``budget_bytes``: the configured
    budget (``roundpipe.host_memory_gb``), None: none; ``host_available``: the host's free
    memory when the caller measured it (None: ``MemAvailable`` of ``proc/meminfo``); ``proc``:
    where ``self/cgroup``, ``self/mountinfo``, ``self/status`` and ``meminfo`` are; ``root``:
    prefixed to the cgroup mount points read from mountinfo (tests: a fake tree)."""
    limits = list(find_limits(proc=proc, root=root))
    if budget_bytes is not None:
        limits.append(Limit(BUDGET_KEY, budget_bytes, _status_kib(proc, "VmRSS")))
    if host_available is None:
        host_available = _meminfo_kib(proc, "MemAvailable")
    if host_available is not None:
        total = max(_meminfo_kib(proc, "MemTotal") or 0, host_available)
        limits.append(Limit("host MemAvailable", total, total - host_available))
    if not limits:  # no /proc (not Linux): nothing is known to bind
        limits.append(Limit("no limit found", 2**63, 0))
    return HostMemory(tuple(limits))


def find_limits(*, proc: Path = Path("/proc"), root: Path = Path("/")) -> list[Limit]:
    """The cgroup (v2, v1) and RLIMIT_AS limits of this process, in that order; none found:
    empty."""
    limits = []
    for kind, directory, mount in _memory_cgroups(proc, root):
        reader = _v2_limits if kind == "v2" else _v1_limits
        limits.extend(reader(directory, mount))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(Limit("RLIMIT_AS (ulimit -v)", soft, _status_kib(proc, "VmSize")))
    return limits


# --- cgroups ------------------------------------------------------------------------------------
def _memory_cgroups(proc: Path, root: Path) -> list[tuple[str, Path, Path]]:
    """("v1" or "v2", this process's cgroup directory, its mount point) for the v1 memory
    hierarchy and the v2 unified one, each where mounted and found (on a hybrid host the
    unified one has no memory files: it then yields no limit)."""
    try:
        membership = (proc / "self" / "cgroup").read_text().splitlines()
        mounts = (proc / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return []
    paths: dict[str, str] = {}  # "v1" / "v2" -> path within the hierarchy
    for line in membership:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and controllers == "":
            paths["v2"] = path
        elif "memory" in controllers.split(","):
            paths["v1"] = path
    found = []
    for line in mounts:
        # mountinfo: id parent major:minor root mount-point options [optional...] - fstype source super
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        fstype, super_opts = fields[sep + 1], fields[-1].split(",")
        kind = (
            "v2"
            if fstype == "cgroup2"
            else "v1"
            if fstype == "cgroup" and "memory" in super_opts
            else None
        )
        if kind is None or kind not in paths:
            continue
        mount_root, mount_point = _unescape(fields[3]), _unescape(fields[4])
        mount = root / mount_point.lstrip("/")
        inner = _relative(paths.pop(kind), mount_root)
        directory = mount / inner if inner is not None else mount
        if directory.is_dir():
            found.append((kind, directory, mount))
    return found


def _relative(path: str, mount_root: str) -> str | None:
    """``path`` (a cgroup path from /proc/self/cgroup) within a mount of ``mount_root``; None
    when outside it (a namespace's view: the mount is the process's cgroup then)."""
    if mount_root == "/":
        return path.lstrip("/")
    if path == mount_root:
        return ""
    if path.startswith(mount_root.rstrip("/") + "/"):
        return path[len(mount_root.rstrip("/")) + 1 :]
    return None


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040...)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _ancestors(directory: Path, mount: Path) -> list[Path]:
    """``directory`` and its parents up to and including the mount point."""
    out = [directory]
    while out[-1] != mount and mount in out[-1].parents:
        out.append(out[-1].parent)
    return out


def _v2_limits(directory: Path, mount: Path) -> list[Limit]:
    limits = []
    for group in _ancestors(directory, mount):
        used = _working_set(group / "memory.current", group / "memory.stat", "inactive_file")
        for name in ("memory.max", "memory.high"):
            value = _read_int(group / name)
            if value is not None and used is not None:
                limits.append(Limit(f"cgroup v2 {name} at {group}", value, used))
    return limits


def _v1_limits(directory: Path, mount: Path) -> list[Limit]:
    limits = []
    for group in _ancestors(directory, mount):
        value = _read_int(group / "memory.limit_in_bytes")
        used = _working_set(
            group / "memory.usage_in_bytes", group / "memory.stat", "total_inactive_file"
        )
        if value is not None and value < NO_LIMIT_V1 and used is not None:
            limits.append(Limit(f"cgroup v1 memory.limit_in_bytes at {group}", value, used))
    # the kernel's own minimum over every ancestor, those above the mount's root included
    hierarchical = _stat(directory / "memory.stat").get("hierarchical_memory_limit")
    used = _working_set(
        directory / "memory.usage_in_bytes", directory / "memory.stat", "total_inactive_file"
    )
    if (
        hierarchical is not None and hierarchical < NO_LIMIT_V1 and used is not None
        and all(hierarchical < lim.limit for lim in limits)
    ):  # fmt: skip
        limits.append(
            Limit(f"cgroup v1 hierarchical_memory_limit at {directory}", hierarchical, used)
        )
    return limits


def _working_set(usage_file: Path, stat_file: Path, inactive_key: str) -> int | None:
    """The group's usage less its inactive file pages (the module doc); None: no usage file."""
    usage = _read_int(usage_file)
    if usage is None:
        return None
    stat = _stat(stat_file)
    inactive = stat.get(inactive_key, stat.get("inactive_file", 0))
    return max(0, usage - inactive)


def _read_int(path: Path) -> int | None:
    """An integer file; None where absent, unreadable or "max"."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    try:
        return int(text)
    except ValueError:
        return None  # "max"


def _stat(path: Path) -> dict[str, int]:
    """A flat-keyed file ("key value" lines) as a dict; empty where absent."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


# --- /proc --------------------------------------------------------------------------------------
def _kib_field(path: Path, key: str) -> int | None:
    """``key:   123 kB`` of a /proc file, in bytes; None where absent."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == key:
            parts = value.split()
            return int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return None


def _meminfo_kib(proc: Path, key: str) -> int | None:
    return _kib_field(proc / "meminfo", key)


def status_bytes(key: str, *, proc: Path = Path("/proc")) -> int | None:
    """This process's ``key`` of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ``RssAnon``,
    ``RssFile``, ``VmSize``...), bytes; None where there is no such line (or no /proc)."""
    return _kib_field(proc / "self" / "status", key)


def _status_kib(proc: Path, key: str) -> int:
    return status_bytes(key, proc=proc) or 0
