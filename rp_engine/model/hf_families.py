"""Hugging Face families pipelined through their own forward (hf_capture.py): where each one's
blocks are and which modules are its head. Data, read in transformers 5.24 (pinned).

A family listed here is cut into prefix (its forward up to the first block, captured), one stage
per block, and a head (``final`` modules in order, ``lm_head``, logit transforms, loss). The loss
is a masked LM's (labels as they are) for a ``...ForMaskedLM`` class, a causal LM's (labels
shifted left) otherwise. A family not listed, with a repeated block list and output embeddings,
is cut the same way with its head guessed (``generic_family``), and its first batch is checked
against ``model(**batch).loss`` (``FirstBatchCheck``) before it trains.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rp_engine.model.base import LayerSequence, batch_to_dict
from rp_engine.model.hf import CausalLMHead
from rp_engine.model.hf_capture import CapturedBlock, CapturedPrefix, submodule

log = logging.getLogger("rp_engine")

__all__ = [
    "CAPTURED_FAMILIES",
    "CapturedFamily",
    "FirstBatchCheck",
    "build_captured",
    "captured_family",
]


@dataclass(frozen=True)
class CapturedFamily:
    """Where a family's blocks and head are, as attribute paths from the task model."""

    blocks: str  # the nn.ModuleList of its blocks
    lm_head: str  # the output projection (a masked LM: its whole prediction head)
    final: tuple[str, ...] = ()  # applied to the last hidden state before lm_head; None: skipped
    logits_multiplier: str | None = None  # config attribute: logits *= value
    softcap: str | None = None  # config attribute: logits = tanh(logits / c) * c


CAPTURED_FAMILIES: dict[str, CapturedFamily] = {
    "gpt2": CapturedFamily("transformer.h", "lm_head", ("transformer.ln_f",)),
    "gpt_bigcode": CapturedFamily("transformer.h", "lm_head", ("transformer.ln_f",)),
    "gptj": CapturedFamily("transformer.h", "lm_head", ("transformer.ln_f",)),
    "gpt_neox": CapturedFamily("gpt_neox.layers", "lm_head", ("gpt_neox.final_layer_norm",)),
    "falcon": CapturedFamily("transformer.h", "lm_head", ("transformer.ln_f",)),
    "bloom": CapturedFamily("transformer.h", "lm_head", ("transformer.ln_f",)),
    # OPT: the final norm is None for the post-norm variants (opt-350m), project_out is None
    # unless word_embed_proj_dim differs from hidden_size
    "opt": CapturedFamily(
        "model.decoder.layers",
        "lm_head",
        ("model.decoder.final_layer_norm", "model.decoder.project_out"),
    ),
    "phi": CapturedFamily("model.layers", "lm_head", ("model.final_layernorm",)),
    "cohere": CapturedFamily("model.layers", "lm_head", ("model.norm",), "logit_scale"),
    "gemma3_text": CapturedFamily(
        "model.layers", "lm_head", ("model.norm",), softcap="final_logit_softcapping"
    ),
    "bert": CapturedFamily("bert.encoder.layer", "cls"),
    "roberta": CapturedFamily("roberta.encoder.layer", "lm_head"),
}

# The final norms' names in the families read (for a family not listed).
_FINAL_NAMES = (
    "norm",
    "ln_f",
    "final_layer_norm",
    "final_layernorm",
    "norm_f",
    "final_norm",
    "ln_out",
)


def _is_task_lm(model: nn.Module) -> bool:
    name = type(model).__name__
    return name.endswith(("ForCausalLM", "LMHeadModel", "ForMaskedLM"))


def captured_family(model: nn.Module) -> tuple[str, CapturedFamily] | None:
    """The family of a Hugging Face LM this module pipelines, or None. A family not listed
    gets ``generic_family``'s guess (None when it has no repeated block list)."""
    config = getattr(model, "config", None)
    if config is None or not _is_task_lm(model):
        return None
    model_type = str(getattr(config, "model_type", "?"))
    family = CAPTURED_FAMILIES.get(model_type)
    if family is not None:
        return (model_type, family) if submodule(model, family.lm_head) is not None else None
    guessed = generic_family(model)
    return None if guessed is None else (model_type, guessed)


def generic_family(model: nn.Module) -> CapturedFamily | None:
    """For a family nobody listed: its blocks are its largest ``nn.ModuleList`` of two or more
    modules of one class; its head is the child of the model holding its output embeddings,
    after the final norms found beside the blocks by their usual names."""
    lists = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1
    ]
    if not lists:
        return None
    blocks_path, _ = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    get_output: Any = getattr(model, "get_output_embeddings", None)
    out = get_output() if callable(get_output) else None
    if not isinstance(out, nn.Module):
        return None
    head_path = next(
        (name for name, child in model.named_children() if any(m is out for m in child.modules())),
        None,
    )
    if head_path is None:
        return None
    parent = blocks_path.rpartition(".")[0]
    beside = [f"{parent}.{n}" if parent else n for n in _FINAL_NAMES]
    final = tuple(path for path in beside if isinstance(submodule(model, path), nn.Module))
    return CapturedFamily(blocks_path, head_path, final)


def build_captured(
    model: nn.Module, model_type: str, family: CapturedFamily, *, chunk_tokens: int
) -> tuple[CapturedPrefix, list[nn.Module], CausalLMHead, FirstBatchCheck | None]:
    """prefix, blocks, head of ``model`` (unwrapped from peft) cut as ``family`` says, and the
    first-batch check of a family that is not listed (its head was guessed; None: listed)."""
    config: Any = model.config
    layers_list = submodule(model, family.blocks)
    if not isinstance(layers_list, nn.ModuleList):
        raise NotImplementedError(f"{model_type!r}: {family.blocks!r} is not an nn.ModuleList")
    count = getattr(config, "num_hidden_layers", None)
    layers = list(layers_list)[:count] if isinstance(count, int) else list(layers_list)
    final = [(p, submodule(model, p)) for p in family.final]
    final = [(p, m) for p, m in final if m is not None]
    lm_head = submodule(model, family.lm_head)
    masked = type(model).__name__.endswith("ForMaskedLM")
    prefix = CapturedPrefix(model, layers, [*final, (family.lm_head, lm_head)])
    blocks: list[nn.Module] = [CapturedBlock(layer, i) for i, layer in enumerate(layers)]

    def factor(attr: str | None, default: float | None) -> Any:
        value = None if attr is None else getattr(config, attr, None)
        return default if value is None else float(value)

    head = CausalLMHead(
        nn.Sequential(*(m for _, m in final)) if final else nn.Identity(),
        lm_head,
        chunk_tokens=chunk_tokens,
        softcap=factor(family.softcap, None),
        logits_multiplier=factor(family.logits_multiplier, 1.0),
        shift_labels=not masked,
    )
    if model_type in CAPTURED_FAMILIES:
        return prefix, blocks, head, None
    log.warning(
        "rp_engine: Hugging Face family %r is not among the mapped ones; pipelined through "
        "its own forward with blocks %r and head %s; its first batch is checked against "
        "model(**batch).loss",
        model_type,
        family.blocks,
        [*family.final, family.lm_head],
    )
    return prefix, blocks, head, FirstBatchCheck()


class FirstBatchCheck:
    """Once, on the first batch: the layer sequence's loss against the model's own
    ``model(**batch).loss``, both on the host in eval mode (no dropout), on the batch's first
    row cut to ``max_tokens`` tokens (bounded cost). A mismatch raises with both numbers: a
    family whose head was guessed must never train silently wrong."""

    def __init__(self, *, rtol: float | None = None, max_tokens: int = 64) -> None:
        self.rtol = rtol  # None: 1e-3 for fp32 weights, 2e-2 for fp16/bf16 (their rounding)
        self.max_tokens = max_tokens
        self.done = False

    def __call__(self, seq: LayerSequence, batch: dict[str, Any]) -> None:
        """Check ``seq`` (the sequence holding this check) on ``batch``, the first time."""
        if self.done:
            return
        self.done = True
        model = seq.root
        params = list(model.parameters())
        if any(p.device.type != "cpu" or p.untyped_storage().size() == 0 for p in params):
            log.warning(
                "rp_engine: the first-batch check of a guessed family was skipped: the model's "
                "weights are not in host memory"
            )
            return
        small = {
            k: v[:1, : self.max_tokens] if isinstance(v, torch.Tensor) and v.dim() >= 2 else v
            for k, v in batch_to_dict(batch).items()
        }
        small.pop("num_items_in_batch", None)
        if "input" in small:
            small["input_ids"] = small.pop("input")
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        try:
            with torch.no_grad():
                # ours first: the model's own forward may leave state in its modules (a value
                # handed to its blocks by attribute) that would hide a difference
                got = float(seq.run_reference(small))
                want = float(model(**small).loss)
        finally:
            for m, mode in modes:
                m.training = mode
        rtol = self.rtol
        if rtol is None:
            rtol = 1e-3 if all(p.dtype == torch.float32 for p in params) else 2e-2
        if not abs(got - want) <= rtol * abs(want):
            raise RuntimeError(
                f"rp_engine: the pipelined form of this {type(model).__name__} does not compute "
                f"the model's loss on the first batch: {got:.6g} against model(**batch).loss "
                f"{want:.6g}. Its family is not mapped and its head was guessed; it is not "
                "trained silently wrong. Map the family: a row in CAPTURED_FAMILIES "
                "(rp_engine/model/hf_families.py) naming its blocks, final modules and LM head."
            )
