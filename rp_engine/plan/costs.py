"""Per-layer costs and what a slot holds on a device (the one memory rule of the plan package).

Owns ``LayerCosts`` (per-layer time and memory, from profiling or a COSTS.json), ``StageCosts``
(the same folded onto the slots of one cut), ``load_costs`` and ``slot_memory``: the bytes a slot
holds on a device while it computes (its weights, its gradient buffers when it is a backward
slot, and its working set). The partitioner's memory check, ``StageCosts`` and through it the
device walks of ``memory.py`` (validate, the simulator) all count a slot with this one rule.
No timing model here: see simulate/.

The rule is data: ``SlotMemory`` names every item it counts (weights, gradient accumulators,
saved activations, the micro-batch's own gradients before they are folded, attention
temporaries, the LM head's chunk temporaries, boundary states, kernel workspaces, the caching
allocator's slack), so reports and tests can read each one; the byte sizes come from
``LayerCosts`` (``shapes.memory_terms`` derives them for a decoder shape; a COSTS.json may give
them). Each later term's field defaults to leaving it out, which is the rule as it was before
them (weights, gradients, activations, boundaries, the head's activations).
"""

from __future__ import annotations

import dataclasses
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
    work_bytes: tuple[int, ...]  # working set while the slot computes (SlotMemory.work)
    boundary_bytes: int  # one hidden state crossing a stage boundary (per micro-batch)
    layer_param_bytes: tuple[int, ...]  # per layer, then the head (index L): optimizer work
    # per slot, every item the rule counts (``slot_memory``): what reports and tests read
    memory: tuple[SlotMemory, ...] = ()

    def busy_ms(self, slot: int) -> float:
        return self.pre_ms[slot] + self.post_ms[slot]


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer costs of the L decoder layers (ms per micro-batch, bytes), plus the head.

    ``recompute_ms`` defaults to ``fwd_ms``; byte lists default to zeros. ``comm_ms`` is the
    fixed delay of a cross-device edge in the simulation conventions (no machine model);
    ``boundary_bytes`` the size of one hidden state crossing a stage boundary.

    Memory terms (``slot_memory`` says how a slot counts them; all bytes per micro-batch):
    ``act_bytes`` a layer's activations autograd keeps for its backward; ``attn_bytes`` its
    attention temporaries (transient: the S x S scores of eager attention, a fused kernel's
    backward accumulators); ``head_act_bytes`` the LM head's temporaries (one chunk's logits
    and their gradients, the hidden-state gradient); ``workspace_bytes`` kernel workspaces a
    device keeps (cuBLAS, per stream); ``allocator_slack`` the caching allocator's rounding and
    fragmentation, a fraction of the bytes counted; ``grad_dtype_ratio`` gradient-accumulator
    bytes per weight byte (2 where a half-precision model's gradients add up in fp32 over a
    round: ``transfer.fold_grads``); ``fold_grads`` whether a micro-batch's gradients exist
    beside the accumulators until the action folds them in (the engine's executor: True;
    False leaves the term out); ``trainable_fraction`` the part of the weight bytes that has
    gradients (LoRA: the adapters'), which scales both gradient terms.
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
    # the memory rule's further terms (class docstring); 0 leaves each out
    attn_bytes: tuple[int, ...] = ()
    workspace_bytes: int = 0
    allocator_slack: float = 0.0
    grad_dtype_ratio: float = 1.0
    fold_grads: bool = False  # count ``SlotMemory.step_grads`` (the engine's executor has them)
    trainable_fraction: float = 1.0  # of the weight bytes that have gradients (LoRA: adapters)

    def __post_init__(self) -> None:
        n = len(self.fwd_ms)
        norm = {
            "fwd_ms": tuple(float(v) for v in self.fwd_ms),
            "bwd_ms": tuple(float(v) for v in self.bwd_ms),
            "recompute_ms": tuple(float(v) for v in (self.recompute_ms or self.fwd_ms)),
            "param_bytes": tuple(int(v) for v in (self.param_bytes or (0,) * n)),
            "act_bytes": tuple(int(v) for v in (self.act_bytes or (0,) * n)),
            "attn_bytes": tuple(int(v) for v in (self.attn_bytes or (0,) * n)),
        }
        for name, values in norm.items():
            if len(values) != n:
                raise ValueError(f"LayerCosts.{name} has {len(values)} entries, fwd_ms has {n}")
            if any(v < 0 for v in values):
                raise ValueError(f"LayerCosts.{name} must be >= 0: {list(values)}")
            object.__setattr__(self, name, values)
        if n < 1:
            raise ValueError("LayerCosts needs at least one decoder layer")
        if (
            self.allocator_slack < 0 or self.grad_dtype_ratio <= 0 or self.workspace_bytes < 0
            or not 0 <= self.trainable_fraction <= 1
        ):  # fmt: skip
            raise ValueError(
                "LayerCosts: allocator_slack and workspace_bytes must be >= 0, grad_dtype_ratio "
                f"> 0 and trainable_fraction in [0, 1], got {self.allocator_slack}, "
                f"{self.workspace_bytes}, {self.grad_dtype_ratio}, {self.trainable_fraction}"
            )

    @property
    def num_layers(self) -> int:
        return len(self.fwd_ms)

    @classmethod
    def uniform(cls, num_layers: int, *, fwd_ms: float, bwd_ms: float, **kw: Any) -> LayerCosts:
        """Same cost for every layer; scalar byte sizes are repeated too."""
        lists: dict[str, Any] = {
            k: (kw.pop(k),) * num_layers
            for k in ("recompute_ms", "param_bytes", "act_bytes", "attn_bytes")
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
            "attn_bytes",
            "workspace_bytes",
            "allocator_slack",
            "grad_dtype_ratio",
            "fold_grads",
            "trainable_fraction",
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
            attn_bytes=per_layer("attn_bytes"),
            workspace_bytes=int(data.get("workspace_bytes", 0)),
            allocator_slack=float(data.get("allocator_slack", 0.0)),
            grad_dtype_ratio=float(data.get("grad_dtype_ratio", 1.0)),
            fold_grads=bool(data.get("fold_grads", False)),
            trainable_fraction=float(data.get("trainable_fraction", 1.0)),
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
        memory: list[SlotMemory] = []
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
            memory.append(held)
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
            memory.append(held)
            end -= n
        return StageCosts(
            pre_ms=tuple(pre),
            post_ms=tuple(post),
            param_bytes=tuple(params),
            grad_bytes=tuple(grads),
            work_bytes=tuple(work),
            boundary_bytes=self.boundary_bytes,
            layer_param_bytes=self.param_bytes + (self.head_param_bytes,),
            memory=tuple(memory),
        )


@functools.lru_cache(maxsize=4096)
def _fold(
    costs: LayerCosts, fwd_cuts: tuple[int, ...], bwd_cuts: tuple[int, ...], fused_head: bool
) -> StageCosts:
    return costs._stages(fwd_cuts, bwd_cuts, fused_head)


@dataclass(frozen=True)
class SlotMemory:
    """What a slot holds on a device while it computes, in bytes, item by item (the memory
    rule; ``slot_memory`` says how each is counted). ``weights`` and ``grads`` stay for the
    slot's whole group on the device; the rest, ``work``, only while one of its actions runs."""

    weights: int  # its layers' weights (and the head's, and the prefix's where it rides along)
    grads: int  # weight-gradient accumulators: a backward slot adds up its round's gradients
    activations: int = 0  # saved for the backward (a backward slot), else one layer's
    step_grads: int = 0  # this micro-batch's own gradients, before they are folded in
    attention: int = 0  # one layer's attention temporaries
    head: int = 0  # the LM head's chunk temporaries and the hidden-state gradient
    boundary: int = 0  # the hidden states in and out
    workspace: int = 0  # kernel workspaces (cuBLAS)
    slack: int = 0  # the caching allocator's rounding and fragmentation

    @property
    def work(self) -> int:
        """The working set: every item but the weights and gradient accumulators."""
        return (
            self.activations + self.step_grads + self.attention + self.head
            + self.boundary + self.workspace + self.slack
        )  # fmt: skip

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.work

    def items(self) -> dict[str, int]:
        """Every item by name (the fields), for reports."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def slot_memory(
    costs: LayerCosts, layers: range, *, backward: bool, head: bool, prefix: bool = False
) -> SlotMemory:
    """The memory rule: bytes a slot over ``layers`` holds on its device while it computes.

    - weights: of the layers, plus the head's with ``head`` and the prefix's with ``prefix``;
    - grads: a backward slot's accumulators, ``grad_dtype_ratio`` x its trainable weights
      (``trainable_fraction`` of them);
    - activations: a backward slot recomputes its layers with autograd and keeps every
      layer's ``act_bytes`` until its backward reaches it; a forward slot runs without
      autograd, one layer's at a time (the largest);
    - step_grads (with ``fold_grads``): the micro-batch's own gradients exist until the action
      folds them into the accumulators. The backward runs the head first, then the layers
      last to first: while layer l runs, the activations of layers ..l and the gradients of
      the head and of layers l.. are held. The largest such sum, less the activations
      (counted above). A layer's other backward temporaries (the gradients of its
      activations) are not a term: they live while part of its activations is freed already
      and the earlier layers' gradients do not exist yet, and measured on CPU devices they
      never took a slot past this bound (tests/plan/test_memory_rule.py);
    - attention: one layer's at a time (the largest over the layers);
    - head: the head's ``head_act_bytes`` with ``head``. Counted beside the layers'
      attention temporaries although the two never overlap in time: a bound, by the smaller;
    - boundary: the hidden states in and out (two ``boundary_bytes``);
    - workspace: ``workspace_bytes``, once per slot;
    - slack: ``allocator_slack`` x the sum of all the above.
    """
    lo, hi = layers.start, layers.stop
    weights = sum(costs.param_bytes[lo:hi]) + (costs.head_param_bytes if head else 0)
    weights += costs.prefix_param_bytes if prefix else 0
    acts = costs.act_bytes[lo:hi]
    step_grads = 0
    if backward:
        activations = sum(acts)
    else:
        activations = max(acts, default=0)
    if backward and costs.fold_grads:
        f = costs.trainable_fraction
        held = fresh = f * costs.head_param_bytes if head else 0.0  # the head's backward first
        freed = 0  # activations of the layers already back-propagated
        for i in range(hi - 1, lo - 1, -1):  # then layer i, with layers lo..i still saved
            fresh += f * costs.param_bytes[i]
            held = max(held, fresh - freed)
            freed += costs.act_bytes[i]
        if prefix:  # the prefix's backward comes last, every activation freed by then
            held = max(held, fresh + f * costs.prefix_param_bytes - activations)
        step_grads = max(int(held), 0)
    body = SlotMemory(
        weights=weights,
        grads=int(weights * costs.trainable_fraction * costs.grad_dtype_ratio) if backward else 0,
        activations=activations,
        step_grads=step_grads,
        attention=max(costs.attn_bytes[lo:hi], default=0),
        head=costs.head_act_bytes if head else 0,
        boundary=2 * costs.boundary_bytes,
        workspace=costs.workspace_bytes,
    )
    return dataclasses.replace(body, slack=int(costs.allocator_slack * body.total))


def _list_len(value: object) -> int:
    if isinstance(value, list | tuple):
        return len(value)
    raise ValueError("costs: 'num_layers' is required when fwd_ms is a scalar")


def load_costs(path: str | os.PathLike[str]) -> LayerCosts:
    """Read a COSTS.json file (see ``LayerCosts.from_dict``)."""
    with open(path) as f:
        return LayerCosts.from_dict(json.load(f))
