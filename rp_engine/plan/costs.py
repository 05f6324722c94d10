"""Per-layer costs and what a slot holds on a device (the one memory rule of the plan package).

Owns ``LayerCosts`` (per-layer time and memory, from profiling or a COSTS.json), ``StageCosts``
(the same folded onto the slots of one cut), ``load_costs`` and ``slot_memory``: the bytes a slot
holds on a device while it computes (its weights, its gradient buffers when it is a backward
slot, and its working set). The partitioner's memory check, ``StageCosts`` and through it the
device walks of ``memory.py`` (validate, the simulator) all count a slot with this one rule.
No timing model here: see simulate/.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["LayerCosts", "StageCosts", "SlotMemory", "slot_memory", "load_costs"]

_DESCRIPTIVE_KEYS = frozenset(
    {
        "model",
        "source",
        "notes",
        "measured_on",
        "tokens",
        "pcie_gbps",
        "microbatch",
        "sequence_length",
        "dtype",
    }
)


@dataclass(frozen=True)
class StageCosts:
    """Costs of the slots of one cut (slot numbering of actions.py).

    ``pre_ms`` is the part of a slot that needs only its input (forward, recompute, head forward
    with the head stage's layers); ``post_ms`` the part that needs the upstream gradient
    (backward; head backward). Forward slots have ``post_ms == 0``.
    """

    pre_ms: tuple[float, ...]
    post_ms: tuple[float, ...]
    param_bytes: tuple[int, ...]
    grad_bytes: tuple[int, ...]
    work_bytes: tuple[int, ...]  # working set while the slot computes (activations)
    boundary_bytes: int  # one hidden state crossing a stage boundary (per micro-batch)
    layer_param_bytes: tuple[int, ...]  # per layer, then the head (index L): optimizer work

    def busy_ms(self, slot: int) -> float:
        return self.pre_ms[slot] + self.post_ms[slot]


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer costs of the L decoder layers (ms per micro-batch, bytes), plus the head.

    ``recompute_ms`` defaults to ``fwd_ms``; byte lists default to zeros. ``comm_ms`` is the
    fixed delay of a cross-device edge in the simulation conventions (no machine model);
    ``boundary_bytes`` the size of one hidden state crossing a stage boundary.
    """

    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    recompute_ms: tuple[float, ...] = ()
    param_bytes: tuple[int, ...] = ()
    act_bytes: tuple[int, ...] = ()
    head_fwd_ms: float = 0.0
    head_bwd_ms: float = 0.0
    head_param_bytes: int = 0
    head_act_bytes: int = 0
    boundary_bytes: int = 0
    comm_ms: float = 0.0
    # activation traffic of the runtime (plan/traffic.py): one micro-batch's input tensors and
    # one upstream gradient crossing a backward boundary (0: the size of a boundary state)
    batch_bytes: int = 0
    boundary_grad_bytes: int = 0
    # the prefix (embeddings, rotary): uploaded with forward slot 0 and the last backward slot
    prefix_param_bytes: int = 0

    def __post_init__(self) -> None:
        n = len(self.fwd_ms)
        norm = {
            "fwd_ms": tuple(float(v) for v in self.fwd_ms),
            "bwd_ms": tuple(float(v) for v in self.bwd_ms),
            "recompute_ms": tuple(float(v) for v in (self.recompute_ms or self.fwd_ms)),
            "param_bytes": tuple(int(v) for v in (self.param_bytes or (0,) * n)),
            "act_bytes": tuple(int(v) for v in (self.act_bytes or (0,) * n)),
        }
        for name, values in norm.items():
            if len(values) != n:
                raise ValueError(f"LayerCosts.{name} has {len(values)} entries, fwd_ms has {n}")
            if any(v < 0 for v in values):
                raise ValueError(f"LayerCosts.{name} must be >= 0: {list(values)}")
            object.__setattr__(self, name, values)
        if n < 1:
            raise ValueError("LayerCosts needs at least one decoder layer")

    @property
    def num_layers(self) -> int:
        return len(self.fwd_ms)

    @classmethod
    def uniform(cls, num_layers: int, *, fwd_ms: float, bwd_ms: float, **kw: Any) -> LayerCosts:
        """Same cost for every layer; scalar byte sizes are repeated too."""
        lists: dict[str, Any] = {
            k: (kw.pop(k),) * num_layers
            for k in ("recompute_ms", "param_bytes", "act_bytes")
            if k in kw
        }
        return cls(fwd_ms=(fwd_ms,) * num_layers, bwd_ms=(bwd_ms,) * num_layers, **lists, **kw)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayerCosts:
        """COSTS.json form: ``{"num_layers": 28, "fwd_ms": 7.43, "bwd_ms": 15.83, ...}``;
        per-layer fields may be scalars or lists of length ``num_layers``."""
        known = {
            "num_layers",
            "fwd_ms",
            "bwd_ms",
            "recompute_ms",
            "param_bytes",
            "act_bytes",
            "head_fwd_ms",
            "head_bwd_ms",
            "head_param_bytes",
            "head_act_bytes",
            "boundary_bytes",
            "batch_bytes",
            "boundary_grad_bytes",
            "comm_ms",
            "prefix_param_bytes",
        }
        unknown = sorted(set(data) - known - _DESCRIPTIVE_KEYS)
        if unknown:
            raise ValueError(f"costs: unknown keys {unknown}; expected some of {sorted(known)}")
        if "fwd_ms" not in data or "bwd_ms" not in data:
            raise ValueError("costs: 'fwd_ms' and 'bwd_ms' are required")
        n = int(data.get("num_layers") or _list_len(data["fwd_ms"]))

        def per_layer(key: str) -> tuple[Any, ...]:
            value = data.get(key)
            if value is None:
                return ()
            values = tuple(value) if isinstance(value, list | tuple) else (value,) * n
            if len(values) != n:
                raise ValueError(f"costs.{key}: {len(values)} entries for num_layers={n}")
            return values

        return cls(
            fwd_ms=per_layer("fwd_ms"),
            bwd_ms=per_layer("bwd_ms"),
            recompute_ms=per_layer("recompute_ms"),
            param_bytes=per_layer("param_bytes"),
            act_bytes=per_layer("act_bytes"),
            head_fwd_ms=float(data.get("head_fwd_ms", 0.0)),
            head_bwd_ms=float(data.get("head_bwd_ms", 0.0)),
            comm_ms=float(data.get("comm_ms", 0.0)),
            head_param_bytes=int(data.get("head_param_bytes", 0)),
            head_act_bytes=int(data.get("head_act_bytes", 0)),
            boundary_bytes=int(data.get("boundary_bytes", 0)),
            batch_bytes=int(data.get("batch_bytes", 0)),
            boundary_grad_bytes=int(data.get("boundary_grad_bytes", 0)),
            prefix_param_bytes=int(data.get("prefix_param_bytes", 0)),
        )

    def stages(
        self, fwd_cuts: Sequence[int], bwd_cuts: Sequence[int], *, fused_head: bool = True
    ) -> StageCosts:
        """Fold the layer costs onto the slots of a cut (memoised: the partitioner asks for the
        same cut many times; costs are frozen, so the answer never changes)."""
        return _fold(self, tuple(fwd_cuts), tuple(bwd_cuts), fused_head)

    def _stages(
        self, fwd_cuts: tuple[int, ...], bwd_cuts: tuple[int, ...], fused_head: bool
    ) -> StageCosts:
        """As the runtime runs a cut: with a fused head, the head stage's blocks run once, in
        the HEAD slot (forward + backward, no recompute), never in a forward slot; the prefix
        rides with forward slot 0 and the last backward slot (its recompute)."""
        L = self.num_layers
        if sum(fwd_cuts) != L or sum(bwd_cuts) != L:
            raise ValueError(f"cuts {list(fwd_cuts)} / {list(bwd_cuts)} must each sum to L={L}")
        head_first = L - bwd_cuts[0] if fused_head else L
        pre, post, params, grads, work = [], [], [], [], []
        start = 0
        for s, n in enumerate(fwd_cuts):
            layers = range(start, min(start + n, head_first))
            head = not fused_head and s == len(fwd_cuts) - 1
            pre.append(sum(self.fwd_ms[i] for i in layers) + (self.head_fwd_ms if head else 0.0))
            post.append(0.0)
            held = slot_memory(self, layers, backward=False, head=head, prefix=s == 0)
            params.append(held.weights)
            grads.append(held.grads)
            work.append(held.work)
            start += n
        end = L
        for j, n in enumerate(bwd_cuts):
            layers = range(end - n, end)
            head = j == 0
            fused = head and fused_head
            head_fwd = self.head_fwd_ms if fused else 0.0
            redo = self.fwd_ms if fused else self.recompute_ms  # the HEAD slot does not recompute
            pre.append(sum(redo[i] for i in layers) + head_fwd)
            post.append(sum(self.bwd_ms[i] for i in layers) + (self.head_bwd_ms if head else 0.0))
            last = j == len(bwd_cuts) - 1
            held = slot_memory(self, layers, backward=True, head=head, prefix=last)
            params.append(held.weights)
            grads.append(held.grads)
            work.append(held.work)
            end -= n
        return StageCosts(
            pre_ms=tuple(pre),
            post_ms=tuple(post),
            param_bytes=tuple(params),
            grad_bytes=tuple(grads),
            work_bytes=tuple(work),
            boundary_bytes=self.boundary_bytes,
            layer_param_bytes=self.param_bytes + (self.head_param_bytes,),
        )


@functools.lru_cache(maxsize=4096)
def _fold(
    costs: LayerCosts, fwd_cuts: tuple[int, ...], bwd_cuts: tuple[int, ...], fused_head: bool
) -> StageCosts:
    return costs._stages(fwd_cuts, bwd_cuts, fused_head)


@dataclass(frozen=True)
class SlotMemory:
    """What a slot holds on a device while it computes, in bytes."""

    weights: int  # its layers' weights (and the head's, and the prefix's where it rides along)
    grads: int  # weight-gradient buffers: a backward slot accumulates its round's gradients
    work: int  # working set: activations while computing, boundary hidden states in and out

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.work


def slot_memory(
    costs: LayerCosts, layers: range, *, backward: bool, head: bool, prefix: bool = False
) -> SlotMemory:
    """The memory rule: bytes a slot over ``layers`` holds on its device while it computes.

    Weights of the layers (plus the head's with ``head``, the prefix's with ``prefix``); a
    backward slot also holds gradient buffers of the same size and keeps every layer's
    activations for the backward (a forward slot, running without autograd, one layer's at a
    time); the head's activations with ``head``; two boundary hidden states (in and out).
    """
    lo, hi = layers.start, layers.stop
    weights = sum(costs.param_bytes[lo:hi]) + (costs.head_param_bytes if head else 0)
    weights += costs.prefix_param_bytes if prefix else 0
    acts = costs.act_bytes[lo:hi]
    work = (sum(acts) if backward else max(acts, default=0)) + 2 * costs.boundary_bytes
    return SlotMemory(
        weights=weights,
        grads=weights if backward else 0,
        work=work + (costs.head_act_bytes if head else 0),
    )


def _list_len(value: object) -> int:
    if isinstance(value, list | tuple):
        return len(value)
    raise ValueError("costs: 'num_layers' is required when fwd_ms is a scalar")


def load_costs(path: str | os.PathLike[str]) -> LayerCosts:
    """Read a COSTS.json file (see ``LayerCosts.from_dict``)."""
    with open(path) as f:
        return LayerCosts.from_dict(json.load(f))
