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
checkpoints of s x h x 2 bytes per layer boundary, the working set of one layer (its saved
activations and attention temporaries: ``memory_terms``), the LM head: RoundPipe
computes it in 1,024-token chunks (``memory_terms``' head term), DeepSpeed and Mobius run the
HF head unchunked (10 bytes x vocabulary per token); weights: RoundPipe one 1-layer backward
stage double buffered plus its gradient, Mobius its block double buffered plus gradients, ZeRO
two gathered layers plus 1 GB of reduce bucket; ZeRO keeps all L checkpoints of its
micro-batch, Mobius the checkpoints of its block for its N in-flight micro-batches, RoundPipe
those of one stage (the rest live on the host); kernel workspaces and the caching allocator's
slack (``WORKSPACE_BYTES``, ``ALLOCATOR_SLACK``). ``CONTEXT_BYTES`` (1.5 GB) per GPU for the
CUDA context, outside the caching allocator (and so outside the engine's
``roundpipe.device_memory_gb`` cap, which limits the allocator).

``memory_terms`` is the plan's memory rule per item (``costs.slot_memory`` counts a slot with
them) for a decoder trained by the engine (Hugging Face layers, SDPA or eager attention, the
fused chunked LM head). Its per-token activation coefficients were measured, not guessed: the
bytes autograd keeps for one Qwen3 decoder layer (q/k norms, SDPA, GQA without repeated
key/values: what transformers runs on CUDA without a padding mask), counted per storage on
CPU virtual devices (tests/plan/test_memory_rule.py measures them again); the attention,
head, workspace and slack terms are derived in their functions' docstrings.
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
    "WORKSPACE_BYTES",
    "ALLOCATOR_SLACK",
    "MemoryTerms",
    "memory_terms",
    "effective_flops_per_ms",
    "layer_costs",
    "mem_bytes",
    "max_seq",
]

# published per-layer costs, Qwen3-1.7B on one RTX 4090, 4 x 2048 tokens per micro-batch
REF_FWD_MS, REF_BWD_MS, REF_HEAD_FWD_MS, REF_HEAD_BWD_MS = 7.43, 15.83, 22.07, 43.71
REF_MICRO_BATCH, REF_SEQ_LEN = 4, 2048
CONTEXT_BYTES = 1.5e9  # the CUDA context per GPU (outside the caching allocator and its cap)
HEAD_CHUNK_TOKENS = 1024  # RoundPipe's LM-head chunk (roundpipe.head_chunk_tokens)
# cuBLAS keeps one workspace per (handle, stream), allocated through torch's caching allocator
# (so inside max_memory_allocated and the cap): torch's default CUBLAS_WORKSPACE_CONFIG is
# ":4096:8" (32 MiB) on Hopper, ":4096:2:16:8" (8.1 MiB) before it; cuBLASLt gets a workspace
# of the same size. The engine's matmuls run on one stream per device (its COMPUTE stream), and
# torch's current stream outside it takes the same again: 2 streams x 2 x 32 MiB.
WORKSPACE_BYTES = 2 * 2 * 32 * 2**20
# torch's caching allocator rounds each block to 512 B and carves blocks under 10 MiB out of
# 20 MiB segments; a segment with any live block cannot be returned, so what it reserves (what
# the cap limits) exceeds what is allocated by this fraction of the bytes in use. An estimate,
# not a measurement: the H200 run reported only max_memory_allocated (benchmarks/RESULTS.md).
ALLOCATOR_SLACK = 0.05


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


# Bytes per token one decoder layer keeps for its backward, by (compute dtype's element size,
# attention), as coefficients of (h, I, q, kv, H, K, 1, H x S): hidden size, active MLP width,
# q and kv projection widths, query and kv heads, a constant, and heads x sequence length (the
# probabilities eager attention keeps). Measured on the engine's HF Qwen3 layer (q/k norms,
# GQA without repeated key/values), least squares over 9 shapes and 4 sequence lengths, exact
# to the byte on all of them (tests/plan/test_memory_rule.py measures them again on others).
# Half precision: each RMSNorm keeps an fp32 copy of its input, so fp32 is not 2x bf16.
_ACT_PER_TOKEN: dict[tuple[int, str], tuple[int, int, int, int, int, int, int, int]] = {
    (2, "sdpa"): (16, 8, 10, 10, 8, 4, 8, 0),
    (4, "sdpa"): (20, 16, 16, 16, 8, 4, 8, 0),
    (2, "eager"): (16, 8, 14, 6, 4, 4, 8, 6),  # + the fp32 softmax output and its bf16 cast
    (4, "eager"): (20, 16, 24, 8, 4, 4, 8, 4),
}


@dataclass(frozen=True)
class MemoryTerms:
    """The memory rule's terms for one micro-batch of a decoder shape (``memory_terms``), in
    bytes: the inputs of ``costs.LayerCosts``' memory fields, one name each."""

    act_bytes: int  # one layer's activations kept for its backward
    attn_bytes: int  # one layer's attention temporaries
    head_act_bytes: int  # the LM head's temporaries (one chunk's logits and gradients)
    boundary_bytes: int  # one hidden state
    workspace_bytes: int  # kernel workspaces per device
    allocator_slack: float  # fraction of the counted bytes
    grad_dtype_ratio: float  # gradient-accumulator bytes per weight byte

    def layer_costs_fields(self) -> dict[str, Any]:
        """The ``LayerCosts`` keyword arguments these terms give (per-layer ones as scalars:
        ``LayerCosts.uniform`` repeats them; ``layer_costs`` builds the tuples)."""
        return {
            "head_act_bytes": self.head_act_bytes,
            "boundary_bytes": self.boundary_bytes,
            "workspace_bytes": self.workspace_bytes,
            "allocator_slack": self.allocator_slack,
            "grad_dtype_ratio": self.grad_dtype_ratio,
            "fold_grads": True,
        }


def memory_terms(
    shape: Shape,
    *,
    micro_batch: int,
    seq_len: int,
    dtype_bytes: int = 2,
    attention: str = "sdpa",
    head_chunk_tokens: int = HEAD_CHUNK_TOKENS,
    cuda: bool = True,
    round_size: int = 2,
    token_stats: bool = False,
) -> MemoryTerms:
    """The memory rule's terms for ``micro_batch`` sequences of ``seq_len`` tokens of ``shape``
    trained by the engine in a compute dtype of ``dtype_bytes`` (2: bf16/fp16, 4: fp32).

    With T = micro_batch x seq_len tokens, e = dtype_bytes, h hidden, I the active MLP width,
    q = heads x head_dim, kv = kv_heads x head_dim, H heads, K kv heads, V vocabulary, C =
    min(head_chunk_tokens, T):

    - act_bytes = T (c_h h + c_I I + c_q q + c_kv kv + c_H H + c_K K + c_1 + c_S H seq_len),
      the coefficients of ``_ACT_PER_TOKEN`` (measured; bf16 SDPA: 16 h + 8 I + 10 (q + kv)
      + 8 H + 4 K + 8; eager attention also keeps its probabilities, c_S = e + 4 in half
      precision: the fp32 softmax output and its cast, 4 in fp32); a mixture of experts adds
      its router's fp32 probabilities, T x experts x 8 (not measured);
    - attn_bytes: eager, micro_batch x H x seq_len^2 x (e + 8) (the scores, the fp32 softmax
      input and its gradient in the backward); SDPA (flash or memory-efficient kernels), T x
      (4 q + 2 e q + 4 H): the backward's fp32 dq accumulator, dk and dv expanded to every
      query head before GQA sums them, the per-head softmax statistics;
    - head_act_bytes = C V (8 + 2 e) + T h e + C h (4 + 4 e): one chunk's fp32 log-softmax
      output, the NLL's and log-softmax's fp32 gradients and the cast's gradient (e), the
      (T, h) hidden gradient the head writes, the chunk's final norm (fp32 input, its casts
      and gradients); ``token_stats`` (TRL's fused head) + 8 C V (its log-softmax and exp in
      the forward);
    - boundary_bytes = T h e;
    - workspace_bytes = ``WORKSPACE_BYTES`` and allocator_slack = ``ALLOCATOR_SLACK`` on a
      GPU (``cuda``), 0 on CPU virtual devices;
    - grad_dtype_ratio = 2 where half-precision gradients add up in fp32 (e = 2 and rounds of
      ``round_size`` > 1 micro-batches), else 1.

    Raises ValueError for an unknown ``attention`` ("sdpa", "flash", "eager") or dtype size.
    """
    if micro_batch < 1 or seq_len < 1:
        raise ValueError(f"micro_batch and seq_len must be >= 1, got {micro_batch}, {seq_len}")
    if dtype_bytes not in (2, 4):
        raise ValueError(f"dtype_bytes must be 2 (bf16/fp16) or 4 (fp32), got {dtype_bytes}")
    if attention not in ("sdpa", "flash", "eager"):
        raise ValueError(f"attention must be 'sdpa', 'flash' or 'eager', got {attention!r}")
    e, h, i_act = dtype_bytes, shape.hidden, shape.active_intermediate
    t = micro_batch * seq_len
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    eager = attention == "eager"
    c_h, c_i, c_q, c_kv, c_hd, c_k, c_1, c_s = _ACT_PER_TOKEN[e, "eager" if eager else "sdpa"]
    heads, kv_heads = shape.heads, shape.kv_heads
    act = t * (
        c_h * h + c_i * i_act + c_q * q + c_kv * kv + c_hd * heads + c_k * kv_heads + c_1
        + c_s * heads * seq_len
    )  # fmt: skip
    act += t * shape.experts * 8 if shape.experts else 0
    if eager:
        attn = micro_batch * heads * seq_len**2 * (e + 8)
    else:
        attn = t * (4 * q + 2 * e * q + 4 * heads)
    chunk = min(head_chunk_tokens, t)
    head = chunk * shape.vocab * (8 + 2 * e + (8 if token_stats else 0))
    head += t * h * e + chunk * h * (4 + 4 * e)
    return MemoryTerms(
        act_bytes=act,
        attn_bytes=attn,
        head_act_bytes=head,
        boundary_bytes=t * h * e,
        workspace_bytes=WORKSPACE_BYTES if cuda else 0,
        allocator_slack=ALLOCATOR_SLACK if cuda else 0.0,
        grad_dtype_ratio=2.0 if e < 4 and round_size > 1 else 1.0,
    )


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
    mem = memory_terms(shape, micro_batch=micro_batch, seq_len=seq_len, cuda=not machine.host_cores)
    return LayerCosts(
        fwd_ms=(fwd,) * n,
        bwd_ms=(bwd,) * n,
        param_bytes=(2 * shape.layer_params,) * n,
        act_bytes=(mem.act_bytes,) * n,
        attn_bytes=(mem.attn_bytes,) * n,
        head_fwd_ms=REF_HEAD_FWD_MS * head_scale,
        head_bwd_ms=REF_HEAD_BWD_MS * head_scale,
        head_param_bytes=2 * shape.head_params,
        prefix_param_bytes=0 if shape.tied else 2 * shape.head_params,
        # LoRA: only the adapters have gradients (of the weights the slots upload)
        trainable_fraction=shape.trainable_params / shape.total_params if shape.lora else 1.0,
        **mem.layer_costs_fields(),
    )


def mem_bytes(system: str, shape: Shape, s: int, n: int, block: int = 1) -> float:
    """Bytes one GPU needs for ``s`` tokens in flight per micro-batch (the module docstring's
    memory model); ``system`` "roundpipe", "mobius" (blocks of ``block`` layers; default 1,
    the most favourable to it) or "zero_infinity"; ``n`` devices."""
    h, layer_b = shape.hidden, 2 * shape.layer_params
    mem = memory_terms(shape, micro_batch=1, seq_len=s)
    grad_b = 0 if shape.lora else layer_b
    # RoundPipe's: fp32 accumulators for a bf16 model (its rounds), and the micro-batch's own
    # gradient until it is folded in (costs.slot_memory's grads and step_grads)
    rp_grad_b = 0 if shape.lora else int(layer_b * mem.grad_dtype_ratio) + layer_b
    ckpt = s * h * 2
    # one layer's working set (the memory rule's items for one layer: memory_terms)
    work = mem.act_bytes + mem.attn_bytes + mem.workspace_bytes
    chunked_head = mem.head_act_bytes
    hf_head = s * shape.vocab * 10

    def slack(nbytes: float) -> float:  # the caching allocator's, then the CUDA context
        return nbytes * (1 + mem.allocator_slack) + CONTEXT_BYTES

    if system == "roundpipe":
        return slack(2 * layer_b + rp_grad_b + ckpt + work + chunked_head)
    if system == "mobius":
        # its block double buffered with its gradients, the head bound to one GPU, and the
        # checkpoints of all its L/N layers for the N micro-batches in flight (GPipe order)
        head_b = 2 * shape.head_params * (1 if shape.lora else 2)
        weights = 2 * block * layer_b + block * grad_b + head_b
        return slack(weights + n * math.ceil(shape.layers / n) * ckpt + work + hf_head)
    if system == "zero_infinity":
        return slack(2 * layer_b + 1e9 + shape.layers * ckpt + work + hf_head)
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
