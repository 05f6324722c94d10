"""Host-resident model state: compute weights, fp32 master copies, gradient buffers, versions.

All model state lives here, in host memory; devices only ever hold copies for the duration of a
stage. Per layer (index in the LayerSequence order: prefix, blocks..., head) the store keeps:

- the layer's own host module parameters: the *compute weights* that uploads read (bf16/fp16/fp32,
  pinned when the pool is CUDA);
- for every trainable parameter the layer *owns*, an fp32 *master* tensor whose ``.grad`` is the
  fp32 gradient accumulation buffer. A parameter shared by several layers (tied embeddings) is
  owned by the lowest layer index that uses it: in a backward pass that layer finishes last, so its
  gradient is complete exactly when the owner's is;
- a published *version* with a condition variable: version v means "compute weights hold the
  result of optimizer step v" (0 = initial weights).

Bytes per trainable parameter on the host: compute weight (2 or 4) + master (4) + Adam m, v (8,
held by the optimizer) + gradient (4) = 18 B for bf16/fp16 models, 20 B for fp32 models.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["HostParam", "HostLayer", "HostStore"]


@dataclass(eq=False)
class HostParam:
    """One trainable parameter owned by a layer: the module's weight and its fp32 master."""

    name: str
    param: nn.Parameter  # compute weight, the user's own parameter object
    master: torch.Tensor  # fp32, requires no grad; master.grad is the accumulation buffer
    layer: int  # the owning layer: its optimizer step consumes master.grad


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


class HostStore:
    """Host state of a layer sequence. Thread-safe version protocol; no device knowledge.

    ``pin`` (e.g. the CUDA backend's pinning helper) is applied to compute weights once, so
    uploads can be asynchronous; CPU virtual devices pass ``None`` (pinning needs a GPU).
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        *,
        pin: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.layers: list[HostLayer] = []
        self._owner: dict[int, HostParam] = {}
        for index, module in enumerate(modules):
            params: list[Any] = _unique(module.named_parameters(remove_duplicate=False))
            buffers = list(_unique(module.named_buffers(remove_duplicate=False)))
            layer = HostLayer(index, module, list(params), buffers)
            for name, p in layer.params:
                if p.requires_grad and id(p) not in self._owner:
                    hp = HostParam(name, p, _make_master(p), index)
                    self._owner[id(p)] = hp
                    layer.owned.append(hp)
            self.layers.append(layer)
        if pin is not None:
            for layer in self.layers:
                for _, p in layer.params:
                    p.data = pin(p.data)
        self._grad_locks = [threading.Lock() for _ in self.layers]
        self._versions = [0] * len(self.layers)
        self._cond = threading.Condition()
        self._failure: BaseException | None = None

    # --- lookup -------------------------------------------------------------------------------
    def master_of(self, param: nn.Parameter) -> torch.Tensor:
        """The fp32 master of a trainable parameter (KeyError if frozen or unknown)."""
        return self._owner[id(param)].master

    def owned_params(self) -> list[HostParam]:
        return [hp for layer in self.layers for hp in layer.owned]

    def trainable_of(self, layer: int) -> list[nn.Parameter]:
        """Trainable parameters the layer uses (including shared ones it does not own)."""
        return [p for _, p in self.layers[layer].params if p.requires_grad]

    def owner_layer(self, param: nn.Parameter) -> int:
        """The layer whose optimizer step consumes this parameter's gradient (tied weights: the
        lowest layer using it)."""
        return self._owner[id(param)].layer

    # --- gradients ----------------------------------------------------------------------------
    def accumulate(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Add a downloaded gradient into the owner's fp32 buffer (called on a host thread).

        Several devices' download threads may add into one buffer at once (a tied weight, or
        the same stage of two rounds): the owner layer's lock makes each add whole.
        """
        owner = self._owner[id(param)]
        with self._grad_locks[owner.layer]:
            master = owner.master
            if master.grad is None:
                master.grad = grad.to(torch.float32, copy=True)
            else:
                master.grad.add_(grad)

    def zero_grads(self, layers: Iterable[int] | None = None) -> None:
        for index in range(len(self.layers)) if layers is None else layers:
            for hp in self.layers[index].owned:
                if hp.master.grad is not None:
                    hp.master.grad.zero_()

    def grad_sq_norm(self, layer: int) -> float:
        """Sum of squared fp32 gradients the layer owns (inf/nan propagate)."""
        total = 0.0
        for hp in self.layers[layer].owned:
            if hp.master.grad is not None:
                # one read of the gradient, no temporary copy (torch sums fp32 pairwise)
                total += float(torch.linalg.vector_norm(hp.master.grad)) ** 2
        return total

    # --- versions -----------------------------------------------------------------------------
    def version(self, layer: int) -> int:
        with self._cond:
            return self._versions[layer]

    def wait_version(self, layer: int, version: int) -> None:
        """Block until layer's compute weights hold step ``version`` or newer.

        Raises instead of waiting forever once the optimizer has failed (``fail``).
        """
        with self._cond:
            while self._versions[layer] < version:
                if self._failure is not None:
                    raise RuntimeError(
                        f"layer {layer} will not reach weights version {version}: the optimizer "
                        f"failed ({self._failure!r})"
                    ) from self._failure
                self._cond.wait()

    def fail(self, error: BaseException | None) -> None:
        """Record (or, with None, clear) an optimizer failure and wake every version waiter."""
        with self._cond:
            self._failure = error
            self._cond.notify_all()

    def publish(self, layer: int, version: int) -> None:
        """Copy the layer's masters into its compute weights and mark them as ``version``.

        Monotonic: publishing an older or equal version is a no-op, so a drain (which publishes
        everything) followed by the usual staleness-1 publish is harmless.
        """
        with self._cond:
            if self._versions[layer] >= version:
                return
        with torch.no_grad():
            for hp in self.layers[layer].owned:
                hp.param.data.copy_(hp.master)
        with self._cond:
            self._versions[layer] = max(self._versions[layer], version)
            self._cond.notify_all()

    def set_versions(self, version: int) -> None:
        """Declare every layer at ``version`` (after loading a checkpoint or a drain)."""
        with self._cond:
            self._versions = [version] * len(self.layers)
            self._cond.notify_all()

    def reload_masters(self) -> None:
        """Refresh masters from the compute weights (after the user edited module weights)."""
        with torch.no_grad():
            for hp in self.owned_params():
                hp.master.copy_(hp.param.data)


def _make_master(p: nn.Parameter) -> torch.Tensor:
    master = p.detach().to(device="cpu", dtype=torch.float32, copy=True)
    return master


def _unique(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Drop repeated objects within one module, keeping the first name (tied inside a layer)."""
    seen: set[int] = set()
    out = []
    for name, t in named:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out
