"""The CUDA backend's host waits sleep instead of spinning (device/cuda.py), checked without a
GPU: ``torch.cuda.Event`` is replaced by a fake that records how each event was made. Every event
a host thread may synchronize on must be ``blocking=True``: a default event's ``synchronize()``
spins a core for the whole wait. (On a GPU, test_device_cuda.py measures the waiting thread's
CPU time.)"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rp_engine.device.cuda import CUDADevice, CUDAEvent, CUDATimer


class _FakeEvent:
    """Stands in for ``torch.cuda.Event``: keeps its flags, records and syncs as no-ops."""

    made: list[_FakeEvent] = []

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.enable_timing, self.blocking = enable_timing, blocking
        self.synchronized = False
        _FakeEvent.made.append(self)

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        self.synchronized = True


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[_FakeEvent]:
    _FakeEvent.made = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    return _FakeEvent.made


def test_stream_events_are_blocking_and_untimed(fake_cuda: list[_FakeEvent]) -> None:
    event = CUDAEvent(0)
    assert fake_cuda == [event.cuda_event]
    assert event.cuda_event.blocking and not event.cuda_event.enable_timing


def test_timer_events_are_blocking(fake_cuda: list[_FakeEvent]) -> None:
    CUDATimer(0)
    assert len(fake_cuda) == 2
    assert all(e.blocking and e.enable_timing for e in fake_cuda)


def test_host_sync_waits_on_a_blocking_event(fake_cuda: list[_FakeEvent]) -> None:
    CUDADevice.host_sync(SimpleNamespace(torch_device=torch.device("cuda", 0)))  # type: ignore[arg-type]
    assert len(fake_cuda) == 1
    assert fake_cuda[0].blocking and fake_cuda[0].synchronized
