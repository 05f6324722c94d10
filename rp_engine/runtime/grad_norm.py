"""Gradient norms computed where the gradient is: on the device, with the download.

The optimizer needs the squared global norm of each step's gradient (clipping, fp16 overflow,
the non-finite guard, DeepSpeed's ``get_global_grad_norm``). Read on the host, that is a full
pass over every fp32 master gradient after its last contribution (about 7 GB of host memory
traffic per step for 1.7B parameters). When ONE download carries a layer's whole gradient of
the step, the device that is about to copy it can compute the norm instead, for the cost of
a read of memory it has at hundreds of GB/s, and send one fp32 number per parameter with it.

Which downloads qualify is decided from the plan, before the run (``sole_downloads``): a layer
whose owned parameters receive contributions from exactly one DOWNLOAD action of the run (a
resident holding covering every micro-batch on one device, or a single round). A parameter
shared with a layer of another slot (tied embeddings) makes its owner's gradient a sum of two
downloads, so that owner keeps the host pass, as do runs that are not a whole step (the
imperative loop's runs when a read split its window) and data parallel (the norm is of the reduced gradient): see
``RunSpec.whole_step`` and ``OptimizerStepper._layer_ready``.

The device norm is of exactly the values the host accumulates: the downloaded tensor,
converted to fp32 (``buf.copy_(grad)`` on the host, ``dtype=torch.float32`` here), with the
same loss scale. Both match the float64 norm to fp32 rounding, as DeepSpeed's does: on the host
and on CPU virtual devices each parameter's squared norm is ``model/sq_norm.py``'s (fp32 rows,
summed in float64), on a GPU torch's fp32 tree reduction; the squares are summed on the host in
double, in the same way as ``HostStore.grad_sq_norm``.

Safety net: a sole owner whose buffer already held a contribution of the step when this
download lands (a run wrongly taken for the whole step) keeps the host pass.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import torch

from rp_engine.model.grad_buffers import CONVERT_CHUNK, converted_chunks
from rp_engine.model.sq_norm import sq_norm
from rp_engine.plan.actions import Action, Op, Plan

__all__ = ["sole_downloads", "device_norms", "sq_norms_by_owner"]


def sole_downloads(
    plan: Plan,
    slot_layers: Callable[[int], Iterable[int]],
    owners_of: Callable[[int], Iterable[int]],
) -> dict[Action, frozenset[int]]:
    """Per DOWNLOAD action of ``plan`` (one run, one step): the owner layers whose whole
    gradient for the step that download carries.

    ``slot_layers(slot)``: the host layers a plan slot runs. ``owners_of(layer)``: the layers
    owning the trainable parameters ``layer`` uses (itself, and the owner of a tied weight).
    An owner qualifies when exactly one DOWNLOAD of the plan touches any parameter it owns;
    every DOWNLOAD of the run counts, whatever its iteration (the executor adds them all into
    one step's buffers). Downloads with no such owner map to an empty set.
    """
    touched: dict[Action, frozenset[int]] = {}
    for a in plan.actions:
        if a.op is Op.DOWNLOAD:
            touched[a] = frozenset(o for layer in slot_layers(a.stage) for o in owners_of(layer))
    count = Counter(o for owners in touched.values() for o in owners)
    return {a: frozenset(o for o in owners if count[o] == 1) for a, owners in touched.items()}


@torch.no_grad()
def device_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """One L2 norm per gradient (at least one), as one tensor on the gradients' device. Queue
    it on the stream that then downloads the gradients: it reads them with (at least) fp32
    accumulation whatever their dtype (bf16, fp16 or fp32).

    On a GPU it is one multi-tensor kernel (fp32, a tree reduction: within about 1e-7 of the
    float64 norm). On a CPU virtual device torch's fp32 reduction drifts far more over long
    tensors (model/sq_norm.py), so each norm is ``sq_norm``'s, float64 (the tensor's dtype).
    A bf16/fp16 gradient's reduction with an fp32 dtype runs about 30x slower than over fp32 on
    a CPU (62 ms vs 2 ms for 16M elements, one thread), so half gradients are first converted
    chunk by chunk into a per-thread fp32 scratch (8 ms), as ``GradBuffers`` does for its adds.
    """
    if grads[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(list(grads), 2, dtype=torch.float32))
    return torch.tensor([math.sqrt(_chunked_sq_norm(g)) for g in grads], dtype=torch.float64)


_local = threading.local()  # per-thread conversion scratch (download threads live long)


def _chunked_sq_norm(g: torch.Tensor) -> float:
    if g.dtype == torch.float32:
        return sq_norm(g)
    sq = 0.0
    for _, tmp in converted_chunks(g.reshape(-1), _local, CONVERT_CHUNK):
        sq += sq_norm(tmp)
    return sq


def sq_norms_by_owner(norms: Sequence[float], owners: Sequence[int]) -> dict[int, float]:
    """Sum of squared per-parameter ``norms`` (host floats) per owner layer; inf and nan
    propagate (a non-finite gradient must be seen by the guard and fp16 overflow check)."""
    out: dict[int, float] = {}
    for norm, owner in zip(norms, owners, strict=True):
        out[owner] = out.get(owner, 0.0) + norm**2
    return out
