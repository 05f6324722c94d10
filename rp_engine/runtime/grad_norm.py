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
same loss scale. Per parameter the device reduces in fp32 as ``torch.linalg.vector_norm`` does
on the host; the squares are summed on the host in double, in the same way as
``HostStore.grad_sq_norm``. The two differ only by the order of each parameter's fp32
reduction (none for fp32 gradients on CPU virtual devices: the same kernel) and of the sum of
squares: within 1e-6 relative for the tests' tensors; for tensors of millions of elements,
torch's CPU fp32 reduction itself drifts by 1e-5 to 1e-4 from a float64 one, on either side
(benchmarks/RESULTS.md).

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
    """One fp32 L2 norm per gradient (at least one), as one tensor on the gradients' device.
    Queue it on the stream that then downloads the gradients: it reads them with fp32
    accumulation whatever their dtype (bf16, fp16 or fp32).

    On a GPU it is one multi-tensor kernel. On a CPU virtual device, torch's reduction of a
    bf16/fp16 tensor with an fp32 dtype runs about 30x slower than over fp32 (62 ms vs 2 ms for
    16M elements, one thread), so half gradients are first converted chunk by chunk into a
    per-thread fp32 scratch (8 ms), as ``GradBuffers`` does for its adds.
    """
    if grads[0].device.type != "cpu" or all(g.dtype == torch.float32 for g in grads):
        return torch.stack(torch._foreach_norm(list(grads), 2, dtype=torch.float32))
    return torch.tensor([_chunked_norm(g) for g in grads], dtype=torch.float32)


_local = threading.local()  # per-thread conversion scratch (download threads live long)


def _chunked_norm(g: torch.Tensor) -> float:
    if g.dtype == torch.float32:
        return float(torch.linalg.vector_norm(g))
    sq = 0.0
    for _, tmp in converted_chunks(g.reshape(-1), _local, CONVERT_CHUNK):
        sq += float(torch.linalg.vector_norm(tmp)) ** 2
    return math.sqrt(sq)


def sq_norms_by_owner(norms: Sequence[float], owners: Sequence[int]) -> dict[int, float]:
    """Sum of squared per-parameter ``norms`` (host floats) per owner layer; inf and nan
    propagate (a non-finite gradient must be seen by the guard and fp16 overflow check)."""
    out: dict[int, float] = {}
    for norm, owner in zip(norms, owners, strict=True):
        out[owner] = out.get(owner, 0.0) + norm**2
    return out
