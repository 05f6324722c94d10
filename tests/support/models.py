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
    "tiny",
    "tiny_qwen3",
    "tiny_llama",
    "tiny_mistral",
    "tiny_qwen2",
    "tiny_qwen3_moe",
    "tiny_gemma2",
    "tiny_granite",
    "tiny_hf",
    "HF_CAPTURED",
    "LLAMA_STYLE",
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


# family -> (transformers config class, family-specific config keys, default tie). One builder
# below; the tiny_* names are kept for readability at the call sites.
def _mistral_extra(layers: int, hidden: int, *, sliding_window: int | None = 8) -> dict:
    # every layer uses the sliding-window mask (8 by default, so it bites at sequence length 16)
    return {"sliding_window": sliding_window}


def _qwen2_extra(layers: int, hidden: int, *, sliding_window: int | None = None) -> dict:
    # with a window, layers from layers // 2 on slide (Qwen's max_window_layers), the rest not
    return {
        "use_sliding_window": sliding_window is not None,
        "sliding_window": sliding_window,
        "max_window_layers": layers // 2,
    }


def _moe_extra(layers: int, hidden: int, *, experts: int = 4, experts_per_token: int = 2) -> dict:
    # a sparse MoE MLP in every layer, no router aux loss
    return {
        "num_experts": experts,
        "num_experts_per_tok": experts_per_token,
        "moe_intermediate_size": hidden,
        "decoder_sparse_step": 1,
        "output_router_logits": False,
    }


def _gemma2_extra(layers: int, hidden: int, *, softcap: float | None = 5.0) -> dict:
    # scaled embeddings, alternating sliding/full layers (window 8), logit soft-capping small
    # enough to bite
    return {
        "sliding_window": 8,
        "final_logit_softcapping": softcap,
        "attn_logit_softcapping": 20.0,
        "query_pre_attn_scalar": hidden // 4,
    }


def _granite_extra(layers: int, hidden: int) -> dict:
    # embedding multiplier and logits scaling applied outside the layers; head_dim derived
    return {
        "embedding_multiplier": 3.0,
        "logits_scaling": 2.0,
        "residual_multiplier": 0.5,
        "head_dim": None,
    }


_FAMILIES: dict[str, tuple[str, Callable[..., dict[str, Any]] | None, bool]] = {
    "qwen3": ("Qwen3Config", None, False),  # q/k norms
    "llama": ("LlamaConfig", None, False),
    "mistral": ("MistralConfig", _mistral_extra, False),
    "qwen2": ("Qwen2Config", _qwen2_extra, False),  # q/k/v biases
    "qwen3_moe": ("Qwen3MoeConfig", _moe_extra, False),
    "gemma2": ("Gemma2Config", _gemma2_extra, True),  # tied embeddings, as in the family
    "granite": ("GraniteConfig", _granite_extra, False),
    # Llama's forward outside the decoder layers (issue 50's probe)
    "phi3": ("Phi3Config", None, False),
    "olmo2": ("Olmo2Config", None, False),
    "stablelm": ("StableLmConfig", None, False),
    "starcoder2": ("Starcoder2Config", lambda layers, hidden: {"sliding_window": 8}, False),
    "mixtral": (
        "MixtralConfig",
        lambda layers, hidden: {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "output_router_logits": False,
        },
        False,
    ),  # fmt: skip
    "glm4": ("Glm4Config", None, False),
}
LLAMA_STYLE = ("phi3", "olmo2", "stablelm", "starcoder2", "mixtral", "glm4")


def tiny(
    family: str,
    seed: int = 0,
    *,
    layers: int = 4,
    hidden: int = 64,
    vocab: int = 128,
    dropout: float = 0.0,
    tie: bool | None = None,
    **extra: Any,
) -> nn.Module:
    """A tiny causal LM of ``family`` (see ``_FAMILIES``), ~0.2M parameters; ``extra`` goes to
    the family's own keys (e.g. ``sliding_window``, ``experts``, ``softcap``)."""
    import transformers

    config_name, family_keys, default_tie = _FAMILIES[family]
    common = _common(
        layers=layers, hidden=hidden, vocab=vocab, dropout=dropout,
        tie=default_tie if tie is None else tie,
    )  # fmt: skip
    keys = family_keys(layers, hidden, **extra) if family_keys else dict(extra)
    for key, value in list(keys.items()):
        if key == "head_dim" and value is None:
            del common["head_dim"], keys["head_dim"]
    return _build(getattr(transformers, config_name), seed, **keys, **common)


def _family(name: str) -> Callable[..., nn.Module]:
    def make(seed: int = 0, **kwargs: Any) -> nn.Module:
        return tiny(name, seed, **kwargs)

    make.__name__ = f"tiny_{name}"
    make.__doc__ = f"``tiny({name!r}, ...)``"
    return make


tiny_qwen3 = _family("qwen3")
tiny_llama = _family("llama")
tiny_mistral = _family("mistral")
tiny_qwen2 = _family("qwen2")
tiny_qwen3_moe = _family("qwen3_moe")
tiny_gemma2 = _family("gemma2")
tiny_granite = _family("granite")


# Families cut through their own forward (rp_engine/model/hf_families.py): each with its own
# config keys (4 layers of hidden 64 by default). name -> (config class, keys of (layers, hidden,
# vocab), masked LM?).
def _gpt2_keys(layers: int, hidden: int, vocab: int) -> dict[str, Any]:
    return {"n_layer": layers, "n_embd": hidden, "n_head": 4, "n_positions": 256,
            "vocab_size": vocab, "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0}  # fmt: skip


def _gptj_keys(layers: int, hidden: int, vocab: int) -> dict[str, Any]:
    # GPT-2's names, rotary positions on part of each head, an untied head
    return {**_gpt2_keys(layers, hidden, vocab), "rotary_dim": 8, "tie_word_embeddings": False}


def _llama_like_keys(layers: int, hidden: int, vocab: int) -> dict[str, Any]:
    return {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": 4,
            "intermediate_size": 2 * hidden, "vocab_size": vocab,
            "max_position_embeddings": 256}  # fmt: skip


def _neox_keys(layers: int, hidden: int, vocab: int) -> dict[str, Any]:
    return {**_llama_like_keys(layers, hidden, vocab), "rotary_pct": 0.5,
            "tie_word_embeddings": False}  # fmt: skip


def _falcon_keys(layers: int, hidden: int, vocab: int) -> dict[str, Any]:
    # rotary (not ALiBi), the parallel attention + MLP of falcon-7b
    return {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": 4,
            "vocab_size": vocab, "alibi": False, "parallel_attn": True, "bias": False,
            "new_decoder_architecture": False, "multi_query": True}  # fmt: skip


def _bloom_keys(layers: int, hidden: int, vocab: int) -> dict[str, Any]:
    # ALiBi positions, the embedding layer norm
    return {"n_layer": layers, "hidden_size": hidden, "n_head": 4, "vocab_size": vocab}


def _opt_keys(layers: int, hidden: int, vocab: int) -> dict[str, Any]:
    # learned positions (offset 2), project_in/project_out around the blocks (embedding width
    # hidden // 2, as opt-350m has), pre-norm with the final layer norm
    return {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": 4,
            "ffn_dim": 2 * hidden, "vocab_size": vocab, "max_position_embeddings": 256,
            "word_embed_proj_dim": hidden // 2, "dropout": 0.0, "pad_token_id": 1}  # fmt: skip


def _phi_keys(layers: int, hidden: int, vocab: int) -> dict[str, Any]:
    return {**_llama_like_keys(layers, hidden, vocab), "partial_rotary_factor": 0.5,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0}  # fmt: skip


def _cohere_keys(layers: int, hidden: int, vocab: int) -> dict[str, Any]:
    return {**_llama_like_keys(layers, hidden, vocab), "num_key_value_heads": 2,
            "logit_scale": 0.5}  # fmt: skip


def _gemma3_keys(layers: int, hidden: int, vocab: int) -> dict[str, Any]:
    # sliding and full layers (every 2nd full) with their own rotary bases, soft-capping
    return {**_llama_like_keys(layers, hidden, vocab), "num_key_value_heads": 2,
            "head_dim": hidden // 4, "sliding_window": 8, "sliding_window_pattern": 2,
            "final_logit_softcapping": 5.0, "query_pre_attn_scalar": hidden // 4}  # fmt: skip


def _bert_keys(layers: int, hidden: int, vocab: int) -> dict[str, Any]:
    return {**_llama_like_keys(layers, hidden, vocab), "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0, "max_position_embeddings": 64}  # fmt: skip


_HF_FAMILIES: dict[str, tuple[str, Callable[[int, int, int], dict[str, Any]], bool]] = {
    "gpt2": ("GPT2Config", _gpt2_keys, False),
    "gpt_bigcode": ("GPTBigCodeConfig", _gpt2_keys, False),
    "gptj": ("GPTJConfig", _gptj_keys, False),
    "gpt_neox": ("GPTNeoXConfig", _neox_keys, False),
    "falcon": ("FalconConfig", _falcon_keys, False),
    "bloom": ("BloomConfig", _bloom_keys, False),
    "opt": ("OPTConfig", _opt_keys, False),
    "phi": ("PhiConfig", _phi_keys, False),
    "cohere": ("CohereConfig", _cohere_keys, False),
    "gemma3_text": ("Gemma3TextConfig", _gemma3_keys, False),
    "bert": ("BertConfig", _bert_keys, True),
    "roberta": ("RobertaConfig", _bert_keys, True),
}
HF_CAPTURED = tuple(_HF_FAMILIES)


def tiny_hf(
    family: str, seed: int = 0, *, layers: int = 4, hidden: int = 64, vocab: int = 128, **extra: Any
) -> nn.Module:
    """A tiny model of a family of ``_HF_FAMILIES`` (a causal LM, or a masked LM for BERT and
    RoBERTa), seeded, fp32, eager attention, no dropout; ``extra`` overrides config keys."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    config_name, keys, masked = _HF_FAMILIES[family]
    config = getattr(transformers, config_name)(
        **{**keys(layers, hidden, vocab), "initializer_range": 0.1, "use_cache": False, **extra}
    )
    torch.manual_seed(seed)
    auto = AutoModelForMaskedLM if masked else AutoModelForCausalLM
    return auto.from_config(config, attn_implementation="eager", dtype=torch.float32).train()


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
