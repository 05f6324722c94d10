"""Per-device replicas of host modules: same code, device tensors, host module never mutated.

A replica is a structural shallow copy of a module tree: every submodule is ``copy.copy``-ed and
gets its own ``_parameters`` / ``_buffers`` / ``_modules`` dicts, so assigning device tensors into
the replica leaves the user's host module untouched. One replica exists per (device, layer) and is
only ever used from that device's compute stream (FIFO), which is what makes swapping tensors in
before each run safe. Two devices can therefore run the same layer at the same time (the forward
of micro-batch m+1 on one device while the backward of m runs on another).
"""

from __future__ import annotations

import torch
from torch import nn

from rp_engine.model.base import structural_copy

__all__ = ["Replica"]


class Replica:
    """A device-side twin of one host layer module."""

    def __init__(self, module: nn.Module) -> None:
        memo: dict[int, nn.Module] = {}
        self.module = structural_copy(module, memo)
        # (replica submodule, attribute, host tensor) for every slot; a tied tensor reached under
        # several names appears in several slots with the same host tensor.
        self._param_slots = _slots(module, memo, "_parameters")
        self._buffer_slots = _slots(module, memo, "_buffers")

    def load(
        self,
        device_tensors: dict[int, torch.Tensor],
        *,
        training: bool,
        params: dict[int, nn.Parameter] | None = None,
    ) -> None:
        """Point the replica at device tensors, keyed by ``id(host tensor)``.

        Every slot of one host parameter gets the SAME device Parameter, so a tied weight's
        gradient accumulates once, exactly as in the host module. ``params`` (keyed like
        ``device_tensors``) keeps the Parameters across calls: every micro-batch of a slot's
        round then accumulates its gradient into the same device ``.grad`` (on-device
        accumulation, downloaded once per round).
        """
        made: dict[int, nn.Parameter] = {} if params is None else params
        for owner, attr, host in self._param_slots:
            p = made.get(id(host))
            if p is None:
                p = nn.Parameter(device_tensors[id(host)], requires_grad=host.requires_grad)
                made[id(host)] = p
            owner._parameters[attr] = p
        for owner, attr, host in self._buffer_slots:
            owner._buffers[attr] = device_tensors[id(host)]
        self.module.train(training)

    def release(self) -> None:
        """Drop device tensors so their memory can be reused."""
        for owner, attr, _ in self._param_slots:
            owner._parameters[attr] = None
        for owner, attr, _ in self._buffer_slots:
            owner._buffers[attr] = None


def _slots(
    host_root: nn.Module, memo: dict[int, nn.Module], kind: str
) -> list[tuple[nn.Module, str, torch.Tensor]]:
    out = []
    for _, host_mod in host_root.named_modules(remove_duplicate=False):
        for attr, value in getattr(host_mod, kind).items():
            if value is not None:
                out.append((memo[id(host_mod)], attr, value))
    return out
