"""Devices: the only place that knows CUDA. See base.py for the protocol.

``make_devices(spec)`` turns the ``roundpipe.devices`` setting into a ``DevicePool`` (a sequence
of ``Device`` that owns their worker threads; close it, or use it as a context manager).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import overload

import torch

from .base import Device, DeviceError, Event, Stream, StreamRole
from .cpu import CPUDevice, CPUPool
from .cuda import CUDADevice, is_pinned, pin

__all__ = [
    "CPUDevice",
    "CPUPool",
    "CUDADevice",
    "Device",
    "DeviceError",
    "DevicePool",
    "Event",
    "Stream",
    "StreamRole",
    "make_devices",
    "parse_device_spec",
    "is_pinned",
    "pin",
]

_DEFAULT_CPU_DEVICES = 2
_VALID_FORMS = (
    "'cpu:N' (N virtual CPU devices, N >= 1), 'cuda' (every visible GPU) or "
    "'cuda:I,J,...' (GPU indices)"
)


class DevicePool(Sequence[Device]):
    """The devices of one engine, all of one kind ("cpu" or "cuda"), and their shutdown."""

    def __init__(
        self, devices: list[Device], *, kind: str, on_close: Callable[[], None] | None = None
    ) -> None:
        self.devices = devices
        self.kind = kind
        self._on_close = on_close
        self._closed = False

    def __len__(self) -> int:
        return len(self.devices)

    @overload
    def __getitem__(self, i: int) -> Device: ...
    @overload
    def __getitem__(self, i: slice) -> list[Device]: ...
    def __getitem__(self, i: int | slice) -> Device | list[Device]:
        return self.devices[i]

    def close(self) -> None:
        """Stop every device's worker threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._on_close is not None:
            self._on_close()
        else:
            for d in self.devices:
                d.close()

    def __enter__(self) -> DevicePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DevicePool(kind={self.kind!r}, n={len(self.devices)})"


def _bad_spec(spec: str, why: str = "is not a valid device list") -> ValueError:
    return ValueError(f"roundpipe.devices={spec!r} {why}; use {_VALID_FORMS}")


def parse_device_spec(spec: str, *, num_gpus: int) -> tuple[str, list[int]]:
    """``"cpu:4"`` -> ("cpu", [0, 1, 2, 3]); ``"cuda:0,1"`` -> ("cuda", [0, 1]).

    ``num_gpus`` is the number of visible GPUs (``torch.cuda.device_count()``); pure otherwise.
    Raises ValueError naming ``roundpipe.devices``, the value and the valid forms.
    """
    text = spec.strip().lower()
    kind, sep, rest = text.partition(":")
    if kind == "cpu":
        if not sep:
            return "cpu", list(range(_DEFAULT_CPU_DEVICES))
        if not rest.strip().isdigit() or int(rest) < 1:
            raise _bad_spec(spec, "needs a positive number of CPU devices after 'cpu:'")
        return "cpu", list(range(int(rest)))
    if kind != "cuda":
        raise _bad_spec(spec)
    if num_gpus == 0:
        raise ValueError(
            f"roundpipe.devices={spec!r} but no GPU is visible (torch.cuda.is_available() is "
            "False); use 'cpu:N' to train on N virtual CPU devices"
        )
    if not sep:
        return "cuda", list(range(num_gpus))
    parts = [p.strip() for p in rest.split(",")]
    if not all(p.isdigit() for p in parts):
        raise _bad_spec(spec, "needs comma-separated GPU indices after 'cuda:'")
    indices = [int(p) for p in parts]
    if len(set(indices)) != len(indices):
        raise _bad_spec(spec, "names a GPU twice")
    missing = [i for i in indices if i >= num_gpus]
    if missing:
        raise _bad_spec(
            spec,
            f"names GPU {missing[0]} but only {num_gpus} GPU(s) are visible (0..{num_gpus - 1})",
        )
    return "cuda", indices


def make_devices(
    spec: str | None,
    *,
    pcie_gbps: float | None = None,
    capacity_bytes: int | None = None,
    meter_cpu_compute: bool | None = None,
) -> DevicePool:
    """Build the device pool for ``roundpipe.devices``.

    None -> every visible GPU, else ``cpu:2``. ``pcie_gbps`` (emulated link) applies to CPU
    devices only; ``capacity_bytes`` is the per-device memory budget on both kinds (on CPU
    devices it bounds their compute's storages too unless ``meter_cpu_compute`` is False:
    ``CPUDevice.meter_compute``; None meters exactly when there is a budget).
    """
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec is None:
        spec = "cuda" if num_gpus else f"cpu:{_DEFAULT_CPU_DEVICES}"
    kind, indices = parse_device_spec(spec, num_gpus=num_gpus)
    if kind == "cpu":
        pool = CPUPool(
            len(indices), pcie_gbps=pcie_gbps, capacity_bytes=capacity_bytes,
            meter=meter_cpu_compute,
        )  # fmt: skip
        return DevicePool(list(pool.devices), kind="cpu", on_close=pool.close)
    cuda_devices: list[Device] = []
    try:
        for i in indices:
            cuda_devices.append(CUDADevice(i, capacity_bytes=capacity_bytes))
    except BaseException:
        for d in cuda_devices:
            d.close()
        raise
    return DevicePool(cuda_devices, kind="cuda")
