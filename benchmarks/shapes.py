"""The modelled transformer shapes and the closed-form ZeRO-Infinity model, shared by the
projection (projection.py) and the H200 calibration point (calibration.py).

The shapes and the cost model live in the plan package (rp_engine/plan/shapes.py, torch-free,
also used by the configuration advisor); this module keeps the benchmarks' names. ``SHAPES``:
Qwen3-1.7B, Llama-3.1-8B, Qwen3-32B and Qwen3-235B-A22B (LoRA) from their public configs.
``layer_costs``: per-layer costs at the published micro-batch (``MBS`` x ``SEQ`` = 4 x 2,048
tokens); ``zero_infinity_tps``: ZeRO-Infinity as data parallel ranks that fetch every layer over
PCIe (an optimistic bound). The derivations are in projection.py's docstring.
"""

from __future__ import annotations

import math
from typing import Any

from rp_engine.plan.partition import LayerCosts
from rp_engine.plan.shapes import (
    CONTEXT_BYTES,
    REF_BWD_MS,
    REF_FWD_MS,
    REF_HEAD_BWD_MS,
    REF_HEAD_FWD_MS,
    SHAPES,
    Shape,
    effective_flops_per_ms,
)
from rp_engine.plan.shapes import REF_MICRO_BATCH as MBS
from rp_engine.plan.shapes import REF_SEQ_LEN as SEQ
from rp_engine.plan.shapes import layer_costs as _layer_costs
from rp_engine.plan.simulate import Machine

__all__ = [
    "CONTEXT_BYTES",
    "MBS",
    "REF_BWD_MS",
    "REF_FWD_MS",
    "REF_HEAD_BWD_MS",
    "REF_HEAD_FWD_MS",
    "SEQ",
    "SHAPES",
    "Shape",
    "effective_flops_per_ms",
    "layer_costs",
    "zero_infinity_tps",
]


def layer_costs(shape: Shape, machine: Machine) -> LayerCosts:
    """Per-layer ms per micro-batch (4 x 2048) and bf16 bytes, on ``machine``."""
    return _layer_costs(shape, machine, micro_batch=MBS, seq_len=SEQ)


def zero_infinity_tps(shape: Shape, machine: Machine, m: int) -> dict[str, Any]:
    """The closed-form ZeRO-Infinity model of the module docstring."""
    costs = layer_costs(shape, machine)
    n = machine.num_devices
    share = machine.host_link_gbps / n if machine.host_link_gbps else math.inf
    h2d, d2h = min(machine.h2d_gbps, share) * 1e6, min(machine.d2h_gbps, share) * 1e6  # B/ms
    pbytes = costs.param_bytes[0]
    gbytes = 0 if shape.lora else pbytes
    f, b = costs.fwd_ms[0], costs.bwd_ms[0]
    # forward: fetch; backward with checkpointing: fetch, recompute + backward, offload grads
    fwd = max(f, pbytes / h2d)
    bwd = max(f + b, pbytes / h2d, gbytes / d2h)
    head_bytes = costs.head_param_bytes + costs.prefix_param_bytes
    head = max(costs.head_fwd_ms, head_bytes / h2d) + max(costs.head_bwd_ms, head_bytes / h2d)
    per_mb = shape.layers * (fwd + bwd) + head
    micro = math.ceil(m / n)
    adam_ms = shape.trainable_params / machine.cpu_adam_params_per_s * 1e3
    it = micro * per_mb + adam_ms
    # every rank must hold two gathered layers and its activations: a layer over the budget OOMs
    if machine.memory_bytes and 2 * pbytes + CONTEXT_BYTES > machine.memory_bytes:
        return {"tokens_per_s": None, "why": "two gathered layers exceed the GPU (OOM)"}
    return {
        "tokens_per_s": n * micro * MBS * SEQ / (it / 1e3),
        "iteration_ms": it,
        "link_bound_fraction": (pbytes / h2d > f + b),
    }
