"""Tiny model factories shared by the whole test suite.

Every model is built from a config (no download), seeded, in fp32, with the "eager" attention
implementation so CPU results are deterministic and comparable to a pipelined run. Dropout is off
unless asked for; in the Hugging Face configs the knob is ``attention_dropout``. Heavy imports
(transformers, peft, deepspeed) happen inside the factories, never at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "tiny_qwen3",
    "tiny_llama",
    "tiny_mistral",
    "tiny_qwen2",
    "tiny_qwen3_moe",
    "tiny_gemma2",
    "tiny_granite",
    "tiny_mlp",
    "mlp_batch",
    "tied_lm_layer_specs",
    "tied_projection",
    "lm_loss",
    "lora_qwen3",
    "random_batch",
]


def _common(*, layers: int, hidden: int, vocab: int, dropout: float, tie: bool) -> dict[str, Any]:
    heads = 4
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "head_dim": hidden // heads,
        "max_position_embeddings": 256,
        "attention_dropout": dropout,
        "tie_word_embeddings": tie,
        # Larger than HF's 0.02 so logits and gradients are far from zero and parity tests bite.
        "initializer_range": 0.1,
        "use_cache": False,
        "pad_token_id": 0,
    }


def _build(config_cls: type, seed: int, **kwargs: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    return model.train()


def tiny_qwen3(
    seed: int = 0,
    *,
    layers: int = 4,
    hidden: int = 64,
    vocab: int = 128,
    dropout: float = 0.0,
    tie: bool = False,
) -> nn.Module:
    """Qwen3ForCausalLM (q/k norms), ~0.2M parameters."""
    from transformers import Qwen3Config

    common = _common(layers=layers, hidden=hidden, vocab=vocab, dropout=dropout, tie=tie)
    return _build(Qwen3Config, seed, **common)


def tiny_llama(
    seed: int = 0,
    *,
    layers: int = 4,
    hidden: int = 64,
    vocab: int = 128,
    dropout: float = 0.0,
    tie: bool = False,
) -> nn.Module:
    """LlamaForCausalLM."""
    from transformers import LlamaConfig

    common = _common(layers=layers, hidden=hidden, vocab=vocab, dropout=dropout, tie=tie)
    return _build(LlamaConfig, seed, **common)


def tiny_mistral(
    seed: int = 0,
    *,
    layers: int = 4,
    hidden: int = 64,
    vocab: int = 128,
    dropout: float = 0.0,
    tie: bool = False,
    sliding_window: int | None = 8,
) -> nn.Module:
    """MistralForCausalLM; every layer uses the sliding-window mask (8 by default, so it bites
    at sequence length 16)."""
    from transformers import MistralConfig

    common = _common(layers=layers, hidden=hidden, vocab=vocab, dropout=dropout, tie=tie)
    return _build(MistralConfig, seed, sliding_window=sliding_window, **common)


def tiny_qwen2(
    seed: int = 0,
    *,
    layers: int = 4,
    hidden: int = 64,
    vocab: int = 128,
    dropout: float = 0.0,
    tie: bool = False,
    sliding_window: int | None = None,
) -> nn.Module:
    """Qwen2ForCausalLM (q/k/v biases). With ``sliding_window`` set, layers from
    ``layers // 2`` on use the sliding mask (Qwen's max_window_layers), the rest the full one."""
    from transformers import Qwen2Config

    common = _common(layers=layers, hidden=hidden, vocab=vocab, dropout=dropout, tie=tie)
    window = {
        "use_sliding_window": sliding_window is not None,
        "sliding_window": sliding_window,
        "max_window_layers": layers // 2,
    }
    return _build(Qwen2Config, seed, **window, **common)


def tiny_qwen3_moe(
    seed: int = 0,
    *,
    layers: int = 4,
    hidden: int = 64,
    vocab: int = 128,
    dropout: float = 0.0,
    tie: bool = False,
    experts: int = 4,
    experts_per_token: int = 2,
) -> nn.Module:
    """Qwen3MoeForCausalLM with a sparse MoE MLP in every layer (no router aux loss)."""
    from transformers import Qwen3MoeConfig

    common = _common(layers=layers, hidden=hidden, vocab=vocab, dropout=dropout, tie=tie)
    moe = {
        "num_experts": experts,
        "num_experts_per_tok": experts_per_token,
        "moe_intermediate_size": hidden,
        "decoder_sparse_step": 1,
        "output_router_logits": False,
    }
    return _build(Qwen3MoeConfig, seed, **moe, **common)


def tiny_gemma2(
    seed: int = 0,
    *,
    layers: int = 4,
    hidden: int = 64,
    vocab: int = 128,
    dropout: float = 0.0,
    tie: bool = True,
    softcap: float | None = 5.0,
) -> nn.Module:
    """Gemma2ForCausalLM: scaled embeddings, alternating sliding/full layers (window 8), final
    logit soft-capping (small cap so it bites), tied embeddings by default as in the family."""
    from transformers import Gemma2Config

    common = _common(layers=layers, hidden=hidden, vocab=vocab, dropout=dropout, tie=tie)
    extra = {
        "sliding_window": 8,
        "final_logit_softcapping": softcap,
        "attn_logit_softcapping": 20.0,
        "query_pre_attn_scalar": hidden // 4,
    }
    return _build(Gemma2Config, seed, **extra, **common)


def tiny_granite(
    seed: int = 0,
    *,
    layers: int = 4,
    hidden: int = 64,
    vocab: int = 128,
    dropout: float = 0.0,
    tie: bool = False,
) -> nn.Module:
    """GraniteForCausalLM: embedding multiplier and logits scaling applied outside the layers."""
    from transformers import GraniteConfig

    common = _common(layers=layers, hidden=hidden, vocab=vocab, dropout=dropout, tie=tie)
    del common["head_dim"]  # Granite derives it
    extra = {"embedding_multiplier": 3.0, "logits_scaling": 2.0, "residual_multiplier": 0.5}
    return _build(GraniteConfig, seed, **extra, **common)


def lora_qwen3(
    seed: int = 0,
    *,
    r: int = 4,
    alpha: int = 8,
    lora_dropout: float = 0.0,
    **qwen3_kwargs: Any,
) -> nn.Module:
    """PeftModelForCausalLM: LoRA on q_proj and v_proj of :func:`tiny_qwen3`. LoRA B starts
    random (``init_lora_weights=False``) rather than zero so every adapter gets a gradient."""
    from peft import LoraConfig, get_peft_model

    base = tiny_qwen3(seed, **qwen3_kwargs)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=lora_dropout,
        target_modules=["q_proj", "v_proj"],
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(seed + 1)
    return get_peft_model(base, config).train()


def tiny_mlp(
    seed: int = 0,
    *,
    layers: int = 4,
    inputs: int = 16,
    hidden: int = 32,
    classes: int = 8,
    dropout: float = 0.0,
) -> nn.Sequential:
    """nn.Sequential classifier with ``layers`` children: (Linear+GELU[+Dropout]) blocks, then a
    Linear to ``classes`` logits. Pair with ``nn.functional.cross_entropy`` and
    :func:`mlp_batch`."""
    torch.manual_seed(seed)
    children: list[nn.Module] = []
    width = inputs
    for _ in range(layers - 1):
        block: list[nn.Module] = [nn.Linear(width, hidden), nn.GELU()]
        if dropout > 0:
            block.append(nn.Dropout(dropout))
        children.append(nn.Sequential(*block))
        width = hidden
    children.append(nn.Linear(width, classes))
    return nn.Sequential(*children).train()


def mlp_batch(
    *, inputs: int = 16, classes: int = 8, batch: int = 4, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) for :func:`tiny_mlp`: x (batch, inputs) float, y (batch,) class indices."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, inputs, generator=gen)
    y = torch.randint(0, classes, (batch,), generator=gen)
    return x, y


def tied_lm_layer_specs(
    *, vocab: int = 32, hidden: int = 16
) -> tuple[list[Any], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """DeepSpeed LayerSpec list of a tiny tied-embedding LM, plus its loss_fn:
    TiedLayerSpec("embed", Embedding) -> Linear -> Tanh -> TiedLayerSpec("embed") projecting
    with the embedding weight (forward_fn). Batches: (tokens (B, T) long, labels (B, T) long).
    Seed with ``torch.manual_seed`` before building: specs hold no weights."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    specs = [
        TiedLayerSpec("embed", nn.Embedding, vocab, hidden),
        LayerSpec(nn.Linear, hidden, hidden),
        LayerSpec(nn.Tanh),
        TiedLayerSpec("embed", nn.Embedding, vocab, hidden, forward_fn=tied_projection),
    ]
    return specs, lm_loss


def tied_projection(embedding: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Output projection through a tied embedding: (B, T, D) -> (B, T, V) logits."""
    return hidden @ embedding.weight.t()


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-level cross-entropy for (B, T, V) logits and (B, T) labels (no shift)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def random_batch(
    vocab: int, batch: int = 2, seq: int = 16, seed: int = 0, *, padded: bool = False
) -> dict[str, torch.Tensor]:
    """{"input_ids", "labels"} with labels == input_ids (HF shifts them). With ``padded``, the
    last row is left-padded for a quarter of the sequence (attention_mask 0, labels -100) and the
    first row's first three labels are -100 (a masked prompt); "attention_mask" is added."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab, (batch, seq), generator=gen)
    labels = input_ids.clone()
    out = {"input_ids": input_ids, "labels": labels}
    if padded:
        pad = max(1, seq // 4)
        attention_mask = torch.ones(batch, seq, dtype=torch.long)
        attention_mask[-1, :pad] = 0
        input_ids[-1, :pad] = 0
        labels[-1, :pad] = -100
        labels[0, :3] = -100
        out["attention_mask"] = attention_mask
    return out
