"""Batches checked on the host, before any device work.

A bad batch otherwise fails deep inside a device thread with a message about the model's insides
(``The size of tensor a (4) must match the size of tensor b (16)``, ``index out of range in
self``). :func:`check_batch` names the tensor, what it saw and what it expected, and raises
ValueError.

What is checked is what the layer sequence would trip over; nothing DeepSpeed or the Hugging Face
model accepts is refused. In particular the micro-batch size is *not* compared with
``train_micro_batch_size_per_gpu``: DeepSpeed's engine accepts any batch size at ``forward``
(a data loader's last, smaller batch), and so does rp_engine, micro-batch by micro-batch.

Hugging Face causal LMs (``seq.kind`` "hf:*"): ``input_ids`` (or ``input``) an integer tensor
(micro_batch, seq) with ids in 0..vocab-1, or ``inputs_embeds`` floating (micro_batch, seq,
hidden); ``labels`` int64 of the same (micro_batch, seq), each -100 or a token id (the
first position is never a target after the causal shift, so it is not checked);
``attention_mask`` (micro_batch, seq) or the 4-D (micro_batch, 1, seq, seq) form;
``position_ids`` (micro_batch, seq) or (1, seq). Other models (nn.Sequential, PipelineModule,
LayerSpec lists) take arbitrary inputs: only their ``labels`` must be tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from rp_engine.model.base import LayerSequence

__all__ = ["check_batch", "vocab_size"]

IGNORE_INDEX = -100
_ID_DTYPES = (torch.int64, torch.int32)  # what nn.Embedding indexes with
_LABEL_DTYPES = (torch.int64,)  # cross_entropy takes Long; the -100 shift padding rules out uint8


def vocab_size(seq: LayerSequence) -> int | None:
    """Number of rows of the model's token embedding (the real bound on ids, which can exceed
    ``config.vocab_size`` after ``resize_token_embeddings``); None when the model has none."""
    embed = getattr(seq.prefix, "embed_tokens", None)
    if embed is None:
        return None
    rows = getattr(embed, "num_embeddings", None)
    if rows is None:  # a wrapped embedding (peft): fall back on the model config
        rows = getattr(getattr(seq.prefix, "config", None), "vocab_size", None)
    return int(rows) if rows is not None else None


def check_batch(batch: dict[str, Any], seq: LayerSequence) -> None:
    """Raise ValueError naming the first bad tensor of ``batch`` (a dict from ``batch_to_dict``)
    for the model ``seq``: its shape or dtype and the one expected, or the out-of-range id and
    the vocabulary size. Returns None for a batch the model can run."""
    labels = [k for k in batch if k == "labels" or k.startswith("labels.")]
    for key in labels:
        _tensor(batch, key)
    if not seq.kind.startswith("hf:"):
        return
    _check_hf(batch, vocab_size(seq))


def _check_hf(batch: dict[str, Any], vocab: int | None) -> None:
    ids_key = "input_ids" if "input_ids" in batch else "input" if "input" in batch else None
    has_embeds = batch.get("inputs_embeds") is not None
    if (ids_key is not None) == has_embeds:
        raise ValueError(
            "the batch needs exactly one of 'input_ids' (or 'input') or 'inputs_embeds' "
            f"(got keys {sorted(batch)})"
        )
    if ids_key is not None:
        ids = _tensor(batch, ids_key)
        _ndim(ids, ids_key, 2, "(micro_batch, seq)")
        if ids.dtype not in _ID_DTYPES:
            raise ValueError(
                f"{ids_key} has dtype {ids.dtype}; expected token ids as torch.long (or "
                f"torch.int32): convert with {ids_key}.long()"
            )
        shape = tuple(ids.shape)
        _nonempty(ids, ids_key)
        if vocab is not None:
            _ids_in_vocab(ids, ids_key, vocab)
    else:
        embeds = _tensor(batch, "inputs_embeds")
        _ndim(embeds, "inputs_embeds", 3, "(micro_batch, seq, hidden)")
        if not embeds.is_floating_point():
            raise ValueError(f"inputs_embeds has dtype {embeds.dtype}; expected a floating dtype")
        _nonempty(embeds, "inputs_embeds")
        shape = tuple(embeds.shape[:2])
    b, t = shape
    if "labels" in batch:
        lab = _tensor(batch, "labels")
        if tuple(lab.shape) != shape:
            raise ValueError(
                f"labels has shape {tuple(lab.shape)}; expected {shape} (micro_batch, seq), the "
                f"shape of {ids_key or 'inputs_embeds'}: one label per token, -100 where no loss "
                "is wanted (the model shifts labels itself)"
            )
        if lab.dtype not in _LABEL_DTYPES:
            raise ValueError(
                f"labels has dtype {lab.dtype}; expected torch.long: convert with labels.long()"
            )
        if vocab is not None:
            _labels_in_vocab(lab, vocab)
    if batch.get("attention_mask") is not None:
        mask = _tensor(batch, "attention_mask")
        if tuple(mask.shape) not in ((b, t), (b, 1, t, t)):
            raise ValueError(
                f"attention_mask has shape {tuple(mask.shape)}; expected {(b, t)} (micro_batch, "
                f"seq), the shape of {ids_key or 'inputs_embeds'} (or the 4-D {(b, 1, t, t)})"
            )
    if batch.get("position_ids") is not None:
        pos = _tensor(batch, "position_ids")
        if tuple(pos.shape) not in ((b, t), (1, t)) or pos.is_floating_point():
            raise ValueError(
                f"position_ids has shape {tuple(pos.shape)} and dtype {pos.dtype}; expected "
                f"integers of shape {(b, t)} (micro_batch, seq) or {(1, t)}"
            )


def _tensor(batch: dict[str, Any], key: str) -> torch.Tensor:
    value = batch[key]
    if not isinstance(value, torch.Tensor):
        raise ValueError(
            f"batch[{key!r}] is a {type(value).__name__}; expected a torch.Tensor (a collate_fn "
            "returning tensors, e.g. transformers' DataCollatorForLanguageModeling)"
        )
    return value


def _ndim(t: torch.Tensor, key: str, ndim: int, expected: str) -> None:
    if t.dim() != ndim:
        hint = f": add the batch dimension with {key}.unsqueeze(0)" if t.dim() == ndim - 1 else ""
        raise ValueError(
            f"{key} has shape {tuple(t.shape)} ({t.dim()}-D); expected {ndim}-D {expected}{hint}"
        )


def _nonempty(t: torch.Tensor, key: str) -> None:
    if t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{key} has shape {tuple(t.shape)}: an empty micro-batch or sequence")


def _ids_in_vocab(ids: torch.Tensor, key: str, vocab: int) -> None:
    lo, hi = int(ids.min()), int(ids.max())
    if hi >= vocab:
        raise ValueError(
            f"{key} holds token id {hi}, but the model's vocabulary has {vocab} entries (ids 0.."
            f"{vocab - 1}): the tokenizer and the model disagree (model.resize_token_embeddings"
            "(len(tokenizer)) before rp_engine.initialize)"
        )
    if lo < 0:
        raise ValueError(
            f"{key} holds token id {lo}; ids must be in 0..{vocab - 1} (-100 belongs in labels "
            "only: pad input_ids with the tokenizer's pad_token_id)"
        )


def _labels_in_vocab(labels: torch.Tensor, vocab: int) -> None:
    targets = labels[:, 1:].long()  # position 0 is never a target after the causal shift
    bad = targets[(targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab))]
    if bad.numel():
        worst = int(bad.max()) if int(bad.max()) >= vocab else int(bad.min())
        raise ValueError(
            f"labels holds {worst}, but each label must be -100 (no loss) or a token id in 0.."
            f"{vocab - 1} (the model's vocabulary has {vocab} entries)"
        )
