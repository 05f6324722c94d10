"""What a training call hands the engine, made into the pipeline's micro-batch dict.

DeepSpeed users pass a dict (``engine(**batch)``), a tuple (PipelineEngine's ``(inputs,
labels)``) or a single tensor; rp_engine computes the loss inside the pipeline (fused LM head),
so every micro-batch needs labels. Floating inputs follow the fp16/bf16 model, as DeepSpeed's
PipelineEngine casts them; labels keep their dtype. For Hugging Face models the loss comes back
as a ``CausalLMOutputWithPast``, as the model itself would return it.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

from rp_engine.device.cuda import is_pinned
from rp_engine.model.base import LayerSequence, batch_to_dict
from rp_engine.model.batch_checks import check_batch
from rp_engine.model.module import module_batch

if TYPE_CHECKING:
    from rp_engine.config import DSConfig

__all__ = ["BatchAdapter", "compute_dtype"]


class BatchAdapter:
    """Batches in, losses out, for one layer sequence and compute dtype."""

    def __init__(self, seq: LayerSequence, dtype: torch.dtype, *, pin: bool = False) -> None:
        """``pin``: hand out page-locked copies (CUDA pools), so the pipeline's batch uploads
        are truly asynchronous instead of staging through a pageable bounce buffer."""
        self.seq = seq
        self.dtype = dtype
        self.pin = pin
        self._hf = seq.kind.startswith("hf:")
        # a masked LM (BERT, RoBERTa) scores every position's own label; a causal LM the next's
        self._masked_lm = self._hf and not getattr(seq.head, "shift_labels", True)

    def to_dict(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any], *, fed: bool = False
    ) -> dict[str, Any]:
        """The micro-batch as ``{name: tensor}``; ValueError when it has no labels.

        A module model's call arguments are kept as given (``module_batch``; containers of
        tensors move leaf by leaf). A lone tuple/list is the model's positional arguments when
        ``fed`` (a ``train_batch`` / ``eval_batch`` micro-batch: PipelineEngine's ``(inputs,
        labels)``) or when the model's forward cannot take it whole (``engine((x, y))`` for
        ``forward(x, y)``); otherwise it is the one argument, as DeepSpeed passes it
        (``engine([x, y])`` for ``forward(xs)``)."""
        if self.seq.returns_outputs:
            lone = len(inputs) == 1 and not kwargs and isinstance(inputs[0], tuple | list)
            if lone and (fed or not _binds(self.seq.root, inputs)):
                inputs = tuple(inputs[0])
            batch = module_batch(inputs, kwargs)
            if self.pin:
                batch = {k: _pinned(v) for k, v in batch.items()}
            return batch
        if kwargs:
            raw: Any = kwargs
        elif len(inputs) == 1:
            raw = inputs[0]
        else:
            raw = inputs
        batch = batch_to_dict(raw)
        if "labels" not in batch:
            raise ValueError(
                f"the batch has no 'labels' (keys: {sorted(batch)}): rp_engine computes the loss "
                "inside the pipeline (fused LM head + loss), so every batch needs labels; for "
                "causal-LM training pass labels=input_ids"
            )
        check_batch(batch, self.seq)  # before any device work: name the bad tensor
        if self.seq.first_batch_check is not None:
            self.seq.first_batch_check(self.seq, batch)
        out = {
            k: v.to(self.dtype) if v.is_floating_point() and not k.startswith("labels") else v
            for k, v in batch.items()
            if isinstance(v, torch.Tensor)
        }
        if self.pin:
            out = {k: _pinned(v) for k, v in out.items()}
        return out

    def token_share(self, batch: dict[str, Any], num_items: Any) -> float:
        """This micro-batch's share of ``num_items`` loss tokens (1 when not given): the
        pipeline's loss is the mean over the micro-batch's tokens (labels != -100, shifted for
        causal LMs as Hugging Face counts them)."""
        if num_items is None:
            return 1.0
        return self.token_count(batch) / float(num_items)

    def token_count(self, batch: dict[str, Any]) -> int:
        """The micro-batch's loss tokens: labels != -100 (shifted for causal LMs, as Hugging
        Face's Trainer counts ``num_items_in_batch``)."""
        labels = batch["labels"]
        if self._hf and not self._masked_lm:
            labels = labels[..., 1:]
        return int((labels != -100).sum())

    def wrap_loss(self, loss: torch.Tensor) -> Any:
        """The loss as the model's own forward would return it."""
        if self._hf:
            from transformers.modeling_outputs import CausalLMOutputWithPast, MaskedLMOutput

            return (MaskedLMOutput if self._masked_lm else CausalLMOutputWithPast)(loss=loss)
        return loss


def _binds(model: torch.nn.Module, inputs: tuple[Any, ...]) -> bool:
    """Whether ``model.forward`` accepts ``inputs`` as its positional arguments (True when its
    signature cannot be read: the call is then made as given, as DeepSpeed makes it)."""
    try:
        inspect.signature(model.forward).bind(*inputs)
    except TypeError:
        return False
    except ValueError:  # no signature to read
        return True
    return True


def _pinned(value: Any) -> Any:
    # batches are small (token ids): torch's caching pinned allocator suits them
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and not is_pinned(value):
        return value.pin_memory()
    return value


def compute_dtype(cfg: DSConfig) -> torch.dtype:
    """The dtype DeepSpeed casts the model to at initialize: bf16, fp16, else fp32."""
    if cfg.bf16.enabled:
        return torch.bfloat16
    return torch.float16 if cfg.fp16.enabled else torch.float32
