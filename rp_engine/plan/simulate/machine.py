"""The machine model a plan is simulated on (``Machine``) and its presets (presets/*.json)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Machine", "load_machine", "preset_names"]

_PRESETS = Path(__file__).parent.parent / "presets"  # rp_engine/plan/presets


@dataclass(frozen=True)
class Machine:
    """Where a plan runs: bandwidths in GB/s (1e9 bytes/s), memory in bytes.

    ``host_link_gbps`` is shared by every host<->device copy of every device (host memory or a
    PCIe root); None = no shared limit. ``compute_scale`` multiplies the profiled compute times
    (e.g. 0.53 to run RTX 4090 measurements on an A800). ``p2p`` sends activations device to
    device at ``p2p_gbps``; without it they go through host memory (D2H, then H2D).
    ``action_overhead_ms``: host time each action holds its lane before its work (see the module
    docstring); 0 in the GPU presets (not measured on CUDA), measured per run on CPU virtual
    devices by ``benchmarks/calibration.py``. ``serial_overhead``: those overheads run one at a
    time on one host lane, whichever stream they are for (Python work of every worker thread
    holds the one interpreter lock; the CPU virtual devices), instead of on each stream's own.
    ``host_cores``: the devices are CPU virtual devices computing on this many host cores, which
    the host optimizer and the host overhead use too (see the module docstring); None: devices
    have their own compute (GPUs). ``host_share``: on a shared host, the cores the run gets while
    k = 1, 2, ... of its tasks want them (benchmarks/host_load.py); empty: all ``host_cores``.
    ``nvme_read_gbps``: read bandwidth of the NVMe drive the parameter tier keeps weights on
    (a plan's READs, one at a time on one host-wide lane); default a PCIe 4.0 x4 SSD's
    sequential read, about 3.5 GB/s.
    """

    name: str
    num_devices: int = 8
    h2d_gbps: float = 24.0
    d2h_gbps: float = 26.6
    p2p: bool = False
    p2p_gbps: float = 0.0
    host_link_gbps: float | None = None
    memory_bytes: int | None = None
    cpu_adam_params_per_s: float = 1.4e9
    bytes_per_param: float = 2.0  # uploaded weights are bf16
    compute_scale: float = 1.0
    device_order: tuple[int, ...] | None = None  # Mobius cross mapping over PCIe switches
    action_overhead_ms: float = 0.0
    serial_overhead: bool = False  # every lane's overhead on one host lane (one interpreter lock)
    host_cores: float | None = None  # devices compute on the host's cores (CPU virtual devices)
    host_share: tuple[float, ...] = ()  # cores the run gets with k = 1, 2, ... tasks on them
    nvme_read_gbps: float = 3.5  # the parameter tier's NVMe reads (PCIe 4.0 x4 SSD)
    info: Mapping[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        positive = {
            "num_devices": self.num_devices,
            "h2d_gbps": self.h2d_gbps,
            "d2h_gbps": self.d2h_gbps,
            "cpu_adam_params_per_s": self.cpu_adam_params_per_s,
            "bytes_per_param": self.bytes_per_param,
            "compute_scale": self.compute_scale,
            "nvme_read_gbps": self.nvme_read_gbps,
        }
        if self.p2p:
            positive["p2p_gbps (p2p is on)"] = self.p2p_gbps
        if self.host_link_gbps is not None:
            positive["host_link_gbps"] = self.host_link_gbps
        if self.host_cores is not None:
            positive["host_cores"] = self.host_cores
        bad = {k: v for k, v in positive.items() if not v > 0}
        if bad:
            raise ValueError(f"machine {self.name!r}: these must be > 0: {bad}")
        if any(not v > 0 for v in self.host_share):
            raise ValueError(f"machine {self.name!r}: host_share must be > 0: {self.host_share}")
        if not self.action_overhead_ms >= 0:
            raise ValueError(
                f"machine {self.name!r}: action_overhead_ms must be >= 0, got "
                f"{self.action_overhead_ms}"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Machine:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in data if k not in names and not k.startswith("_"))
        if unknown:
            raise ValueError(f"machine: unknown keys {unknown}; expected some of {sorted(names)}")
        kwargs = {k: v for k, v in data.items() if k in names}
        if kwargs.get("device_order") is not None:
            kwargs["device_order"] = tuple(kwargs["device_order"])
        if kwargs.get("host_share") is not None:
            kwargs["host_share"] = tuple(kwargs["host_share"])
        return cls(**kwargs)


def preset_names() -> list[str]:
    """Names of the machine presets shipped in presets/."""
    return sorted(p.stem for p in _PRESETS.glob("*.json"))


def load_machine(name_or_path: str) -> Machine:
    """A preset by name (see ``preset_names()``) or a JSON file path."""
    path = Path(name_or_path)
    if not path.is_file():
        path = _PRESETS / f"{name_or_path}.json"
    if not path.is_file():
        raise ValueError(
            f"no machine {name_or_path!r}: give a JSON path or one of {preset_names()}"
        )
    return Machine.from_dict(json.loads(path.read_text()))
