"""Hugging Face decoder-only causal LMs as a layer sequence.

Any model shaped ``model.model.{embed_tokens, layers, norm, rotary_emb}`` + ``model.lm_head``
(Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma2, Granite, ...; peft-wrapped ones too) becomes:

    prefix  embeddings (+ family scaling), position_ids, rotary (cos, sin), causal mask(s)
    blocks  one wrapper per decoder layer, called with the kwargs the HF model passes it
    head    final norm + lm_head (+ family logit transforms) + causal-LM loss, in token chunks

The prefix mirrors ``<Family>Model.forward`` of transformers 5.24 (pinned): the masks come from
``masking_utils.create_causal_mask`` / ``create_sliding_window_causal_mask`` with the model config,
and each layer gets the mask of its type. Family differences that live outside the decoder layers
are listed in ``_FAMILIES``; every other family (GPT-2, Falcon, BERT, Gemma 3, Cohere, and any
family nobody listed) is cut through its own forward instead (hf_capture.py, hf_families.py).
Not supported here: MoE router auxiliary loss (``output_router_logits=True``), layer types other
than full/sliding attention (linear attention, Mamba).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rp_engine.model.base import HeadModule, State

__all__ = ["is_hf_causal_lm", "build_hf_blocks", "HFPrefix", "HFDecoderBlock", "CausalLMHead"]

IGNORE_INDEX = -100
_MASK_KEYS = {"full_attention": "mask_full", "sliding_attention": "mask_sliding"}


@dataclass(frozen=True)
class _Family:
    """What a family's model/causal-LM forward does outside the decoder layers."""

    # "layer_types": mask per config.layer_types; "uniform": every layer gets the sliding mask if
    # config.sliding_window is set, else the full one. None: layer_types if the config has them.
    mask_rule: str | None = None
    embedding_multiplier: str | None = None  # config attribute: embeddings *= value
    logits_divisor: str | None = None  # config attribute: logits /= value


# Families whose forward was read in transformers 5.24 and whose adapter is tested.
_FAMILIES: dict[str, _Family] = {
    # their forward is Llama's outside the decoder layers (issue 50's probe: losses equal)
    **{
        name: _Family()
        for name in (
            "phi3",
            "olmo2",
            "stablelm",
            "starcoder2",
            "mixtral",
            "glm4",
        )
    },
    "llama": _Family(),
    "qwen2": _Family(),
    "qwen3": _Family(),
    "qwen3_moe": _Family(),
    "gemma2": _Family(),  # embedding scaling lives inside its embedding module
    "mistral": _Family(mask_rule="uniform"),  # MistralModel ignores config.layer_types
    "granite": _Family(
        embedding_multiplier="embedding_multiplier", logits_divisor="logits_scaling"
    ),
}
LLAMA_STYLE_FAMILIES = frozenset(_FAMILIES)


def is_hf_causal_lm(model: nn.Module) -> bool:
    base = getattr(model, "model", None)
    return (
        isinstance(base, nn.Module)
        and isinstance(getattr(model, "lm_head", None), nn.Module)
        and all(isinstance(getattr(base, n, None), nn.Module) for n in ("embed_tokens", "norm"))
        and isinstance(getattr(base, "layers", None), nn.ModuleList)
        and getattr(base, "config", None) is not None
    )


def _family(config: Any) -> _Family:
    model_type = str(getattr(config, "model_type", "?"))
    family = _FAMILIES.get(model_type)
    if family is None:  # layers.to_layers sends only these here; others go through hf_capture
        raise NotImplementedError(
            f"{model_type!r} is not a Llama-style family ({sorted(_FAMILIES)}); it is cut "
            "through its own forward (rp_engine/model/hf_families.py)"
        )
    return family


def _mask_keys(config: Any, num_layers: int, rule: str | None) -> list[str]:
    """The state key of the mask each decoder layer uses."""
    layer_types = getattr(config, "layer_types", None)
    if rule is None:
        rule = "layer_types" if layer_types is not None else "uniform"
    if rule == "uniform":
        sliding = getattr(config, "sliding_window", None) is not None
        return ["mask_sliding" if sliding else "mask_full"] * num_layers
    types = list(layer_types or [])[:num_layers]
    unknown = sorted(set(types) - set(_MASK_KEYS))
    if unknown or len(types) != num_layers:
        raise NotImplementedError(
            f"{config.model_type!r}: layer types {unknown or types} are not supported "
            f"(only {sorted(_MASK_KEYS)}, one per layer)"
        )
    return [_MASK_KEYS[t] for t in types]


def _check_signatures(base: Any, model_type: str) -> None:
    rotary: Any = getattr(base, "rotary_emb", None)
    if not isinstance(rotary, nn.Module):
        raise NotImplementedError(
            f"{model_type!r}: expected model.model.rotary_emb (rotary position embeddings)"
        )
    required = [
        p.name
        for p in inspect.signature(rotary.forward).parameters.values()
        if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD
    ]
    if required[2:]:  # (x, position_ids) only; Gemma3 also needs layer_type
        raise NotImplementedError(
            f"{model_type!r}: rotary_emb.forward needs {required[2:]} (per-layer-type rotary)"
        )
    layer = base.layers[0]
    if "position_embeddings" not in inspect.signature(layer.forward).parameters:
        raise NotImplementedError(
            f"{model_type!r}: {type(layer).__name__}.forward takes no position_embeddings"
        )


class HFPrefix(nn.Module):
    """batch -> {"hidden", "cos", "sin", "position_ids", "mask_full"/"mask_sliding", "labels"}.

    Mirrors ``<Family>Model.forward`` up to the first decoder layer (no cache). A mask that the
    attention implementation represents as None (e.g. sdpa without padding) is omitted. An
    optional ``num_items_in_batch`` in the batch is kept: the head then divides the loss sum by
    it (HF's gradient-accumulation convention) instead of by the number of valid labels.
    """

    def __init__(
        self,
        embed_tokens: nn.Module,
        rotary_emb: nn.Module,
        *,
        config: Any,
        mask_keys: set[str],
        embedding_multiplier: float = 1.0,
    ) -> None:
        super().__init__()
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        self.embed_tokens = embed_tokens
        self.rotary_emb = rotary_emb
        self.config = config
        self.embedding_multiplier = embedding_multiplier
        fns = {"mask_full": create_causal_mask, "mask_sliding": create_sliding_window_causal_mask}
        self.mask_fns: dict[str, Callable[..., Any]] = {k: fns[k] for k in sorted(mask_keys)}

    def forward(self, batch: dict[str, Any]) -> State:
        # "input" is what an (inputs, labels) pair becomes in batch_to_dict.
        input_ids = batch.get("input_ids", batch.get("input"))
        embeds = batch.get("inputs_embeds")
        if (input_ids is None) == (embeds is None):
            raise ValueError(
                "the batch needs exactly one of 'input_ids' (or 'input') or 'inputs_embeds' "
                f"(got keys {sorted(batch)})"
            )
        if embeds is None:
            embeds = self.embed_tokens(input_ids)  # (B, T, D)
        if self.embedding_multiplier != 1.0:
            embeds = embeds * self.embedding_multiplier
        given = batch.get("position_ids")
        position_ids = given
        if position_ids is None:
            position_ids = torch.arange(embeds.shape[1], device=embeds.device).unsqueeze(0)
        state: State = {"hidden": embeds, "position_ids": position_ids}
        for key, make_mask in self.mask_fns.items():
            # Only the batch's own position ids go to the mask: given ids, transformers looks
            # for packed sequences in them (find_packed_sequence_indices), and its
            # ``if (...).all()`` reads a device value on the host, a sync per mask per
            # micro-batch. Our own arange holds one sequence per row, so it could only answer
            # "not packed", which None says without the read: the same mask.
            mask = make_mask(
                config=self.config,
                inputs_embeds=embeds,
                attention_mask=batch.get("attention_mask"),
                cache=None,
                position_ids=given,
            )
            if mask is not None:
                if not isinstance(mask, torch.Tensor):  # flex attention's BlockMask
                    raise NotImplementedError(f"attention masks of type {type(mask).__name__}")
                state[key] = mask
        state["cos"], state["sin"] = self.rotary_emb(embeds, position_ids)
        for key in ("labels", "num_items_in_batch"):
            if batch.get(key) is not None:
                state[key] = torch.as_tensor(batch[key])
        return state


class HFDecoderBlock(nn.Module):
    """One HF decoder layer: state -> state with a new "hidden". ``mask_key`` picks the mask of
    the layer's type ("mask_full" or "mask_sliding")."""

    def __init__(self, layer: nn.Module, *, mask_key: str) -> None:
        super().__init__()
        self.layer = layer
        self.mask_key = mask_key

    def forward(self, state: State) -> State:
        out = self.layer(
            state["hidden"],
            attention_mask=state.get(self.mask_key),
            position_ids=state["position_ids"],
            position_embeddings=(state["cos"], state["sin"]),
        )
        if isinstance(out, tuple):  # older / MoE layers may return (hidden, router_logits, ...)
            out = out[0]
        new = dict(state)
        new["hidden"] = out
        return new


class CausalLMHead(HeadModule):
    """Final norm + lm_head + causal-LM cross-entropy, ``chunk_tokens`` tokens at a time.

    ``norm`` is whatever runs between the last block and ``lm_head`` (a final norm, or a chain
    of them with OPT's ``project_out``; Identity for a masked LM, whose ``lm_head`` is its whole
    prediction head). With ``shift_labels=False`` the loss is a masked LM's: each position
    scores its own label. Otherwise it is HF's ``ForCausalLMLoss``: labels shifted left (last
    position ignored). Either way the logits are upcast to fp32, ``ignore_index=-100``, and the
    sum is divided by the number of valid labels (or by ``state["num_items_in_batch"]`` when
    present). As in HF, a batch with no valid label gives NaN.
    The norm is per token, so chunking over tokens is exact up to summation order.

    Token statistics (``token_stats = True``): given a dict as ``stats``, ``forward`` and
    ``forward_backward`` also fill it, from the same chunks' logits (never the whole
    ``(tokens, vocab)`` logits), with per-token tensors shaped like ``state["labels"]``, position
    ``t`` scoring label ``t + 1`` (the last position is always masked):
    ``log_probs`` (fp32, log-probability of the label; 0 where masked), ``entropy`` (fp32, of
    the next-token distribution; 0 where masked), ``is_top1`` (bool, label is the arg-max) and
    ``label_mask`` (bool, label != -100). They carry no gradient: the loss's gradient is the
    only one the head computes. This is what TRL's fused LM head returns (``log_probs``,
    ``entropy``, ``is_top1``, ``label_mask``).
    """

    token_stats = True

    def __init__(
        self,
        norm: nn.Module,
        lm_head: nn.Module,
        *,
        chunk_tokens: int,
        softcap: float | None = None,
        logits_divisor: float = 1.0,
        logits_multiplier: float = 1.0,
        shift_labels: bool = True,
    ) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.chunk_tokens = chunk_tokens
        self.softcap = softcap
        self.logits_divisor = logits_divisor
        self.logits_multiplier = logits_multiplier
        # False: a masked LM's loss, each position scoring its own label (BERT, RoBERTa)
        self.shift_labels = shift_labels

    def _loss_sum(
        self, hidden_ND: torch.Tensor, labels_N: torch.Tensor, stats: list[torch.Tensor] | None
    ) -> torch.Tensor:
        logits_NV = self.lm_head(self.norm(hidden_ND))
        if self.logits_multiplier != 1.0:  # Cohere's logit_scale
            logits_NV = logits_NV * self.logits_multiplier
        if self.logits_divisor != 1.0:  # Granite's logits_scaling
            logits_NV = logits_NV / self.logits_divisor
        if self.softcap is not None:  # Gemma2-style final logit soft-capping
            logits_NV = torch.tanh(logits_NV / self.softcap) * self.softcap
        logits_NV = logits_NV.float()
        if stats is None:
            return nn.functional.cross_entropy(
                logits_NV, labels_N, ignore_index=IGNORE_INDEX, reduction="sum"
            )
        nll_N = nn.functional.cross_entropy(
            logits_NV, labels_N, ignore_index=IGNORE_INDEX, reduction="none"
        )
        with torch.no_grad():  # from this chunk's logits, while they exist
            mask_N = labels_N != IGNORE_INDEX
            logp_NV = torch.log_softmax(logits_NV.detach(), dim=-1)
            entropy_N = -(logp_NV.exp() * logp_NV).sum(-1)
            top1_N = logits_NV.detach().argmax(-1) == labels_N
            stats.append(
                torch.stack([-nll_N.detach(), entropy_N * mask_N, (top1_N & mask_N).float()])
            )
        return nll_N.sum()

    def _flatten(self, state: State) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> hidden (N, D), shifted labels (N,), loss denominator (0-dim tensor)."""
        labels = state.get("labels")
        if labels is None:
            raise ValueError("the state has no 'labels': the batch must carry labels for a loss")
        hidden = state["hidden"]
        if self.shift_labels:
            labels = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        labels_N = labels.reshape(-1).to(hidden.device)
        denom = state.get("num_items_in_batch")
        if denom is None:
            denom = (labels_N != IGNORE_INDEX).sum()
        # A tensor denominator keeps the head free of host-device synchronisation.
        return hidden.reshape(-1, hidden.shape[-1]), labels_N, denom.to(hidden.device)

    def forward(
        self, state: State, *, stats: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        hidden_ND, labels_N, denom = self._flatten(state)
        chunks: list[torch.Tensor] | None = None if stats is None else []
        total = sum(
            self._loss_sum(
                hidden_ND[s : s + self.chunk_tokens], labels_N[s : s + self.chunk_tokens], chunks
            )
            for s in range(0, hidden_ND.shape[0], self.chunk_tokens)
        )
        if stats is not None and chunks is not None:
            _fill_stats(stats, chunks, labels_N, state["labels"].shape)
        return torch.as_tensor(total) / denom

    def forward_backward(
        self,
        state: State,
        *,
        grad_scale: float = 1.0,
        stats: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_ND, labels_N, denom = self._flatten(state)
        hidden_ND = hidden_ND.detach()
        grad_ND = torch.empty_like(hidden_ND)
        total = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
        scale = grad_scale / denom
        chunks: list[torch.Tensor] | None = None if stats is None else []
        with torch.enable_grad():
            for s in range(0, hidden_ND.shape[0], self.chunk_tokens):
                # Each chunk is its own leaf so its backward touches only (chunk, D) of hidden
                # and its (chunk, vocab) logits are freed before the next chunk.
                chunk = hidden_ND[s : s + self.chunk_tokens].requires_grad_()
                loss = self._loss_sum(chunk, labels_N[s : s + self.chunk_tokens], chunks)
                torch.autograd.backward(loss * scale)
                assert chunk.grad is not None
                grad_ND[s : s + self.chunk_tokens] = chunk.grad
                total += loss.detach()
        if stats is not None and chunks is not None:
            _fill_stats(stats, chunks, labels_N, state["labels"].shape)
        return total / denom, grad_ND.view(state["hidden"].shape)


def _fill_stats(
    stats: dict[str, torch.Tensor],
    chunks: list[torch.Tensor],
    labels_N: torch.Tensor,
    shape: torch.Size,
) -> None:
    """Per-chunk (3, chunk) rows [log_prob, entropy, top1] -> per-token tensors of ``shape``."""
    log_probs, entropy, top1 = torch.cat(chunks, dim=1)
    stats["log_probs"] = log_probs.view(shape)
    stats["entropy"] = entropy.view(shape)
    stats["is_top1"] = top1.bool().view(shape)
    stats["label_mask"] = (labels_N != IGNORE_INDEX).view(shape)


def build_hf_blocks(
    model: Any, *, chunk_tokens: int
) -> tuple[HFPrefix, list[nn.Module], CausalLMHead, str]:
    """Split an HF causal LM (already unwrapped from peft) -> prefix, blocks, head, model_type."""
    base: Any = model.model
    config = base.config
    model_type = str(getattr(config, "model_type", "?"))
    family = _family(config)
    if getattr(config, "output_router_logits", False):
        raise NotImplementedError(
            f"{model_type!r}: the MoE router auxiliary loss is not supported; set "
            "config.output_router_logits = False"
        )
    _check_signatures(base, model_type)
    layers = list(base.layers)[: config.num_hidden_layers]
    keys = _mask_keys(config, len(layers), family.mask_rule)

    def factor(attr: str | None) -> float:
        return 1.0 if attr is None else float(getattr(config, attr))

    prefix = HFPrefix(
        base.embed_tokens,
        base.rotary_emb,
        config=config,
        mask_keys=set(keys),
        embedding_multiplier=factor(family.embedding_multiplier),
    )
    blocks: list[nn.Module] = [
        HFDecoderBlock(layer, mask_key=k) for layer, k in zip(layers, keys, strict=True)
    ]
    head = CausalLMHead(
        base.norm,
        model.lm_head,
        chunk_tokens=chunk_tokens,
        softcap=getattr(config, "final_logit_softcapping", None),
        logits_divisor=factor(family.logits_divisor),
    )
    return prefix, blocks, head, model_type
