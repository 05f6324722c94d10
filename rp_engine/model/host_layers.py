"""The records of the host store (host_store.py) that its parts share: ``HostParam``, one
trainable parameter with its fp32 master, and ``HostLayer``, what the runtime needs to upload,
run and step one layer. Their own module so that the gradient side (host_grads.py) and the
weights side (host_store.py) both import them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["HostLayer", "HostParam"]


@dataclass(eq=False)
class HostParam:
    """One trainable parameter owned by a layer: the module's weight and its fp32 master."""

    name: str
    param: nn.Parameter  # compute weight, the user's own parameter object
    master: torch.Tensor  # fp32, requires no grad; master.grad is set while a step consumes it
    layer: int  # the owning layer: its optimizer step consumes the gradient
    slot: int = -1  # index of the gradient buffer in the store's GradBuffers


@dataclass(eq=False)
class HostLayer:
    """Everything the runtime needs to upload, run and step one layer."""

    index: int
    module: nn.Module
    params: list[tuple[str, nn.Parameter]]  # every parameter the layer uses (shared ones too)
    buffers: list[tuple[str, torch.Tensor]]
    owned: list[HostParam] = field(default_factory=list)  # trainable params this layer steps

    @property
    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for _, p in self.params) + sum(
            b.numel() * b.element_size() for _, b in self.buffers
        )
