"""The modelled transformer shapes and the closed-form ZeRO-Infinity model, shared by the
projection (projection.py) and the H200 calibration point (calibration.py).

``SHAPES``: Qwen3-1.7B, Llama-3.1-8B, Qwen3-32B and Qwen3-235B-A22B (LoRA) from their public
configs. ``layer_costs``: per-layer costs at one effective rate, from the published Qwen3-1.7B
layer on an RTX 4090 (``REF_*``), scaled by FLOPs; ``zero_infinity_tps``: ZeRO-Infinity as data
parallel ranks that fetch every layer over PCIe (an optimistic bound). The derivations are in
projection.py's docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rp_engine.plan.partition import LayerCosts
from rp_engine.plan.simulate import Machine

# published per-layer costs, Qwen3-1.7B on one RTX 4090, 4 x 2048 tokens per micro-batch
REF_FWD_MS, REF_BWD_MS, REF_HEAD_FWD_MS, REF_HEAD_BWD_MS = 7.43, 15.83, 22.07, 43.71
MBS, SEQ = 4, 2048
CONTEXT_BYTES = 1.5e9


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's shape (public config)."""

    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    experts: int = 0
    experts_per_token: int = 0
    lora: bool = False
    lora_rank: int = 16

    @property
    def attn_params(self) -> int:
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv)

    @property
    def layer_params(self) -> int:
        mlp = 3 * self.hidden * self.intermediate
        return self.attn_params + (
            mlp * self.experts + self.hidden * self.experts if self.experts else mlp
        )

    @property
    def active_layer_params(self) -> int:
        mlp = 3 * self.hidden * self.intermediate
        return self.attn_params + (mlp * self.experts_per_token if self.experts else mlp)

    @property
    def active_intermediate(self) -> int:
        return self.intermediate * (self.experts_per_token if self.experts else 1)

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def trainable_params(self) -> int:
        total = self.layers * self.layer_params + self.head_params * (1 if self.tied else 2)
        if not self.lora:
            return total
        # LoRA on q, k, v, o: rank x (in + out) per projection
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = self.lora_rank * (2 * (self.hidden + q) + 2 * (self.hidden + kv))
        return self.layers * per_layer

    def fwd_flops(self, tokens_per_seq: int, seqs: int) -> float:
        t = tokens_per_seq * seqs
        attn = 4 * seqs * tokens_per_seq**2 * self.heads * self.head_dim
        return 2 * t * self.active_layer_params + attn


SHAPES = {
    "qwen3-1.7b": Shape("Qwen3-1.7B", 2048, 28, 6144, 16, 8, 128, 151936, True),
    "llama3.1-8b": Shape("Llama-3.1-8B", 4096, 32, 14336, 32, 8, 128, 128256, False),
    "qwen3-32b": Shape("Qwen3-32B", 5120, 64, 25600, 64, 8, 128, 151936, False),
    "qwen3-235b-lora": Shape(
        "Qwen3-235B-A22B (LoRA)", 4096, 94, 1536, 64, 4, 128, 151936, False,
        experts=128, experts_per_token=8, lora=True,
    ),
}  # fmt: skip


def effective_flops_per_ms() -> float:
    """The RTX 4090's rate implied by the published Qwen3-1.7B layer forward."""
    return SHAPES["qwen3-1.7b"].fwd_flops(SEQ, MBS) / REF_FWD_MS


def layer_costs(shape: Shape, machine: Machine) -> LayerCosts:
    """Per-layer ms per micro-batch (4 x 2048) and bf16 bytes, on ``machine``."""
    rate = effective_flops_per_ms() / machine.compute_scale
    fwd = shape.fwd_flops(SEQ, MBS) / rate
    bwd_ratio = REF_BWD_MS / REF_FWD_MS
    bwd = fwd * (bwd_ratio / 2 if shape.lora else bwd_ratio)
    ref = SHAPES["qwen3-1.7b"]
    head_scale = shape.head_params / ref.head_params * machine.compute_scale
    n = shape.layers
    return LayerCosts(
        fwd_ms=(fwd,) * n,
        bwd_ms=(bwd,) * n,
        param_bytes=(2 * shape.layer_params,) * n,
        act_bytes=(MBS * SEQ * (18 * shape.hidden + 4 * shape.active_intermediate),) * n,
        head_fwd_ms=REF_HEAD_FWD_MS * head_scale,
        head_bwd_ms=REF_HEAD_BWD_MS * head_scale,
        head_param_bytes=2 * shape.head_params,
        head_act_bytes=int(1024 * shape.vocab * 8),
        boundary_bytes=MBS * SEQ * shape.hidden * 2,
        prefix_param_bytes=0 if shape.tied else 2 * shape.head_params,
    )


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
