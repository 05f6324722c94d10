"""Model shapes and the analytic cost and memory model of a decoder (no profiling, no torch).

Owns ``Shape`` (a decoder-only transformer's public-config shape; ``Shape.from_hf_config``
reads a Hugging Face ``config.json`` dict), ``SHAPES`` (the four shapes of the projection,
benchmarks/projection.py), ``layer_costs`` (per-layer ``LayerCosts`` at any micro-batch and
sequence length on a ``Machine``) and the per-GPU memory model of one micro-batch
(``mem_bytes``, ``max_seq``: the longest sequence).

Cost model. One rate, from the published Qwen3-1.7B layer on one RTX 4090 at 4 x 2,048 tokens
per micro-batch (forward 7.43 ms, backward 15.83 ms, LM head 22.07 / 43.71 ms;
shared/reference/schedules_and_baselines.md): forward FLOPs (2 x tokens x active parameters +
4 b s^2 h attention) divided by 7.43 ms is the card's effective rate; every layer's forward is
its FLOPs at that rate (so the attention term makes long sequences dearer per token), the
backward keeps the measured 15.83 / 7.43 ratio (LoRA: half of it, no weight gradients), the head
scales with vocabulary x hidden x tokens. ``Machine.compute_scale`` scales it all to another GPU.

Memory model (bytes one GPU needs for ``s`` tokens in flight per micro-batch, bf16): activation
checkpoints of s x h x 2 bytes per layer boundary, the working set of one layer s x (18 h + 4
I_active) (flash attention: no s^2 term), the LM head: RoundPipe computes it in 1,024-token
chunks (fp32 logits and gradient of one chunk), DeepSpeed and Mobius run the HF head unchunked
(10 bytes x vocabulary per token); weights: RoundPipe one 1-layer backward stage double
buffered plus its gradient, Mobius its block double buffered plus gradients, ZeRO two gathered
layers plus 1 GB of reduce bucket; ZeRO keeps all L checkpoints of its micro-batch, Mobius the
checkpoints of its block for its N in-flight micro-batches, RoundPipe those of one stage (the
rest live on the host). ``CONTEXT_BYTES`` (1.5 GB) per GPU for the CUDA context and allocator
slack.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .costs import LayerCosts
from .simulate import Machine

__all__ = [
    "Shape",
    "SHAPES",
    "REF_MICRO_BATCH",
    "REF_SEQ_LEN",
    "CONTEXT_BYTES",
    "effective_flops_per_ms",
    "layer_costs",
    "mem_bytes",
    "max_seq",
]

# published per-layer costs, Qwen3-1.7B on one RTX 4090, 4 x 2048 tokens per micro-batch
REF_FWD_MS, REF_BWD_MS, REF_HEAD_FWD_MS, REF_HEAD_BWD_MS = 7.43, 15.83, 22.07, 43.71
REF_MICRO_BATCH, REF_SEQ_LEN = 4, 2048
CONTEXT_BYTES = 1.5e9  # CUDA context and allocator slack per GPU
HEAD_CHUNK_TOKENS = 1024  # RoundPipe's LM-head chunk (roundpipe.head_chunk_tokens)


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's shape (public config). ``intermediate`` is one expert's
    for a mixture of experts (``experts`` > 0, ``experts_per_token`` active per token);
    ``lora``: only LoRA adapters of rank ``lora_rank`` on q, k, v and o train."""

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

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str | None = None) -> Shape:
        """The shape of a Hugging Face ``config.json`` dict (Llama, Qwen, Mistral, Qwen-MoE
        style keys). Raises ValueError naming the missing key."""
        cfg = dict(config.get("text_config") or config)  # multimodal: the language model's

        def need(key: str) -> int:
            if cfg.get(key) is None:
                raise ValueError(
                    f"config.json has no {key!r}: not a decoder-only transformer config "
                    "(expected hidden_size, num_hidden_layers, intermediate_size, "
                    "num_attention_heads, vocab_size)"
                )
            return int(cfg[key])

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        if experts:
            inter = int(cfg.get("moe_intermediate_size") or need("intermediate_size"))
            per_token = int(cfg.get("num_experts_per_tok") or 1)
        else:
            inter, per_token = need("intermediate_size"), 0
        return cls(
            name=name or str(cfg.get("_name_or_path") or cfg.get("model_type") or "model"),
            hidden=hidden,
            layers=need("num_hidden_layers"),
            intermediate=inter,
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab=need("vocab_size"),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            experts=experts,
            experts_per_token=per_token,
        )

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
    def total_params(self) -> int:
        """Every parameter (layers, embedding, untied LM head; norms neglected)."""
        return self.layers * self.layer_params + self.head_params * (1 if self.tied else 2)

    @property
    def trainable_params(self) -> int:
        if not self.lora:
            return self.total_params
        # LoRA on q, k, v, o: rank x (in + out) per projection
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = self.lora_rank * (2 * (self.hidden + q) + 2 * (self.hidden + kv))
        return self.layers * per_layer

    def fwd_flops(self, tokens_per_seq: int, seqs: int) -> float:
        t = tokens_per_seq * seqs
        attn = 4 * seqs * tokens_per_seq**2 * self.heads * self.head_dim
        return 2 * t * self.active_layer_params + attn


SHAPES: dict[str, Shape] = {
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
    return SHAPES["qwen3-1.7b"].fwd_flops(REF_SEQ_LEN, REF_MICRO_BATCH) / REF_FWD_MS


def layer_costs(
    shape: Shape,
    machine: Machine,
    *,
    micro_batch: int = REF_MICRO_BATCH,
    seq_len: int = REF_SEQ_LEN,
) -> LayerCosts:
    """Per-layer ms per micro-batch of ``micro_batch`` sequences x ``seq_len`` tokens, and
    bf16 bytes, on ``machine`` (the module docstring's cost model)."""
    if micro_batch < 1 or seq_len < 1:
        raise ValueError(f"micro_batch and seq_len must be >= 1, got {micro_batch}, {seq_len}")
    rate = effective_flops_per_ms() / machine.compute_scale
    fwd = shape.fwd_flops(seq_len, micro_batch) / rate
    bwd_ratio = REF_BWD_MS / REF_FWD_MS
    bwd = fwd * (bwd_ratio / 2 if shape.lora else bwd_ratio)
    ref = SHAPES["qwen3-1.7b"]
    tokens = micro_batch * seq_len
    head_scale = (
        shape.head_params / ref.head_params * machine.compute_scale
        * (tokens / (REF_MICRO_BATCH * REF_SEQ_LEN))
    )  # fmt: skip
    n = shape.layers
    return LayerCosts(
        fwd_ms=(fwd,) * n,
        bwd_ms=(bwd,) * n,
        param_bytes=(2 * shape.layer_params,) * n,
        act_bytes=(tokens * (18 * shape.hidden + 4 * shape.active_intermediate),) * n,
        head_fwd_ms=REF_HEAD_FWD_MS * head_scale,
        head_bwd_ms=REF_HEAD_BWD_MS * head_scale,
        head_param_bytes=2 * shape.head_params,
        head_act_bytes=int(HEAD_CHUNK_TOKENS * shape.vocab * 8),
        boundary_bytes=tokens * shape.hidden * 2,
        prefix_param_bytes=0 if shape.tied else 2 * shape.head_params,
    )


def mem_bytes(system: str, shape: Shape, s: int, n: int, block: int = 1) -> float:
    """Bytes one GPU needs for ``s`` tokens in flight per micro-batch (the module docstring's
    memory model); ``system`` "roundpipe", "mobius" (blocks of ``block`` layers; default 1,
    the most favourable to it) or "zero_infinity"; ``n`` devices."""
    h, layer_b = shape.hidden, 2 * shape.layer_params
    grad_b = 0 if shape.lora else layer_b
    ckpt = s * h * 2
    work = s * (18 * h + 4 * shape.active_intermediate)
    chunked_head = HEAD_CHUNK_TOKENS * shape.vocab * 8 + s * h * 4
    hf_head = s * shape.vocab * 10
    if system == "roundpipe":
        return 2 * layer_b + grad_b + ckpt + work + chunked_head + CONTEXT_BYTES
    if system == "mobius":
        # its block double buffered with its gradients, the head bound to one GPU, and the
        # checkpoints of all its L/N layers for the N micro-batches in flight (GPipe order)
        head_b = 2 * shape.head_params * (1 if shape.lora else 2)
        weights = 2 * block * layer_b + block * grad_b + head_b
        return weights + n * math.ceil(shape.layers / n) * ckpt + work + hf_head + CONTEXT_BYTES
    if system == "zero_infinity":
        return 2 * layer_b + 1e9 + shape.layers * ckpt + work + hf_head + CONTEXT_BYTES
    raise ValueError(f"unknown system {system!r}: roundpipe, mobius or zero_infinity")


def max_seq(system: str, shape: Shape, machine: Machine) -> int | None:
    """Longest single sequence (multiples of 1K) whose memory fits ``machine.memory_bytes``;
    None when not even 1K does."""
    budget = machine.memory_bytes or 0
    best = None
    s = 1024
    while s <= 1 << 22 and mem_bytes(system, shape, s, machine.num_devices) <= budget:
        best, s = s, s + 1024
    return best
