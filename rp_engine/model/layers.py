"""``to_layers``: any supported model -> a :class:`LayerSequence` (prefix, blocks, head).

Supported shapes, tried in this order:
  * a list/tuple of DeepSpeed ``LayerSpec`` / ``TiedLayerSpec`` / modules / callables + loss_fn
  * a DeepSpeed ``PipelineModule`` built with num_stages=1 (its loss_fn unless one is given)
  * a Hugging Face causal LM shaped ``model.model.{embed_tokens, layers, norm, rotary_emb}`` +
    ``model.lm_head`` (Llama, Mistral, Qwen2/3, Qwen3-MoE, Gemma2, Granite...), peft-wrapped or not
  * an ``nn.Sequential`` + loss_fn
  * any other ``nn.Module`` (module.py): traced pieces at its repeated block, else the whole
    module as one layer; its outputs go to the caller
The adapters live in ``hf.py``, ``sequential.py`` and ``module.py``; this module only dispatches
and checks that every parameter of the model belongs to some layer.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from rp_engine.model.base import HeadModule, LayerSequence, State, batch_to_dict
from rp_engine.model.hf import LLAMA_STYLE_FAMILIES, build_hf_blocks, is_hf_causal_lm
from rp_engine.model.hf_families import build_captured, captured_family
from rp_engine.model.module import module_layers
from rp_engine.model.sequential import build_from_funcs, deepspeed_pipe

log = logging.getLogger("rp_engine")

__all__ = ["to_layers", "LayerSequence", "HeadModule", "State", "batch_to_dict", "uses_dropout"]

_EXPECTED = (
    "expected an nn.Module (a Hugging Face causal LM, an nn.Sequential with loss_fn, a DeepSpeed "
    "PipelineModule, or any module), or a list of DeepSpeed LayerSpec with loss_fn"
)


def _unwrap_peft(model: nn.Module) -> nn.Module:
    """PeftModelForCausalLM -> the HF model inside (base_model.model); others unchanged."""
    peft = sys.modules.get("peft")
    if peft is not None and isinstance(model, peft.PeftModel):
        return model.get_base_model()
    return model


def to_layers(
    model: nn.Module | list[Any] | tuple[Any, ...],
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    head_chunk_tokens: int = 1024,
    split_points: Sequence[str] | None = None,
) -> LayerSequence:
    """Cut ``model`` into a :class:`LayerSequence` whose modules share the model's parameters.

    ``loss_fn(outputs, labels)`` is required for nn.Sequential and LayerSpec lists, optional for
    a PipelineModule (overrides its own), and refused for Hugging Face models (the head computes
    the model's own causal-LM loss). ``head_chunk_tokens`` bounds the tokens per LM-head chunk.
    Any other ``nn.Module`` is traced into pieces at its repeated block (or before the modules
    named in ``split_points``), or else runs as one layer (model/module.py); its outputs go to
    the caller, whose loss seeds the backward.
    """
    if isinstance(head_chunk_tokens, bool) or not isinstance(head_chunk_tokens, int):
        raise ValueError(f"head_chunk_tokens must be a positive int, got {head_chunk_tokens!r}")
    if head_chunk_tokens < 1:
        raise ValueError(f"head_chunk_tokens must be a positive int, got {head_chunk_tokens}")

    pipe = deepspeed_pipe()
    if isinstance(model, list | tuple) or (
        pipe is not None and isinstance(model, pipe.PipelineModule)
    ):
        prefix, blocks, head, root, kind = build_from_funcs(model, loss_fn=loss_fn)
        return _checked(LayerSequence(prefix, blocks, head, root, kind))

    if not isinstance(model, nn.Module):
        raise ValueError(f"got a {type(model).__name__}: {_EXPECTED}")
    inner = _unwrap_peft(model)
    model_type = str(getattr(getattr(inner, "config", None), "model_type", "?"))
    llama_style = is_hf_causal_lm(inner) and model_type in LLAMA_STYLE_FAMILIES
    captured = None if llama_style else captured_family(inner)
    if (llama_style or captured is not None) and loss_fn is not None:
        raise ValueError(
            "loss_fn is not supported for Hugging Face language models: the head computes the "
            "model's own loss (pass loss_fn=None)"
        )
    if llama_style:
        hf_prefix, hf_blocks, hf_head, model_type = build_hf_blocks(
            inner, chunk_tokens=head_chunk_tokens
        )
        return _checked(LayerSequence(hf_prefix, hf_blocks, hf_head, model, f"hf:{model_type}"))
    if captured is not None:
        model_type, family = captured
        cap_prefix, cap_blocks, cap_head, check = build_captured(
            inner, model_type, family, chunk_tokens=head_chunk_tokens
        )
        return _checked(
            LayerSequence(
                cap_prefix, cap_blocks, cap_head, model, f"hf:{model_type}", first_batch_check=check
            )
        )
    if isinstance(model, nn.Sequential) and loss_fn is not None:
        prefix, blocks, head, root, kind = build_from_funcs(model, loss_fn=loss_fn)
        return _checked(LayerSequence(prefix, blocks, head, root, kind))
    # any other module: traced pieces (b) or the whole module (c), its outputs to the caller
    module_blocks, out_head, layering = module_layers(model, split_points=split_points)
    # the whole module as one layer is a fallback the user must see (no pipelining of it)
    level = logging.WARNING if layering.strategy == "whole_module" else logging.INFO
    log.log(level, "rp_engine: %s model: %s (%s)", type(model).__name__, layering.strategy,
            layering.reason)  # fmt: skip
    return _checked(
        LayerSequence(None, module_blocks, out_head, model, f"module:{layering.strategy}", layering)
    )


def _checked(seq: LayerSequence) -> LayerSequence:
    """Every parameter of the root must live in some layer, or training would silently skip it
    (e.g. a model whose forward uses modules outside the expected shape)."""
    covered = {id(p) for layer in seq.modules() for p in layer.parameters()}
    missing = [name for name, p in seq.root.named_parameters() if id(p) not in covered]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(
            f"{len(missing)} parameter(s) of the {seq.kind} model belong to no layer ({shown}); "
            f"{_EXPECTED}"
        )
    return seq


def uses_dropout(model: nn.Module) -> bool:
    """Whether any layer draws random numbers in training (then RNG is seeded per layer)."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
    config = getattr(model, "config", None)
    if config is not None:
        for key, value in vars(config).items():
            if "dropout" in key and isinstance(value, int | float) and value > 0:
                return True
    return False
