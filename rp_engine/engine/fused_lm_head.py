"""``engine(**batch, fused_lm_head=True)``: TRL's fused-LM-head output from rp_engine's head.

TRL (``SFTTrainer``, 1.16) patches the model so that ``model(..., fused_lm_head=True)`` returns a
``FusedCausalLMOutput`` with per-token ``log_probs`` (differentiable), ``entropy``, ``is_top1``
and ``label_mask``, shaped ``(batch, seq - 1)``, zero where the label is -100, computed in chunks
without the full logits, and builds its loss as ``-log_probs.sum() / num_tokens``. rp_engine's
head computes the same statistics chunk-wise on the devices (``CausalLMHead`` ``stats=``); this
module turns them into that output.

Gradients: the head's backward already ran on the device for the mean NLL of the micro-batch (the
engine's loss leaf ``L = -sum(log_probs) / n``). ``log_probs`` is tied to ``L`` so that a caller's
loss whose derivative is the *same* for every valid token (``c``: TRL's ``loss_type="nll"``, the
default) gives ``dL = -c * n``, which ``engine.backward`` turns into exactly the gradients of the
caller's loss. Per-token weights (``loss_type="dft"``: ``-log_p * p``) would need the head's
backward redone with those weights; they raise NotImplementedError in ``backward`` instead of
training on wrong gradients. Fields TRL can also ask for (``log_sum_sq_probs``, ``mean_logits``)
are not computed: they are None, which TRL treats as "not requested".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["fused_output"]


class _TiedLogProbs(torch.autograd.Function):
    """values (no grad of their own) whose gradient flows into the micro-batch's loss leaf."""

    @staticmethod
    def forward(ctx: Any, leaf: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> Any:
        ctx.save_for_backward(mask)
        return values.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (mask,) = ctx.saved_tensors
        valid = grad[mask]
        if valid.numel() and not torch.allclose(valid, valid[:1].expand_as(valid), rtol=1e-5):
            raise NotImplementedError(
                "the loss weights the fused head's log_probs per token (e.g. TRL "
                "loss_type='dft'): rp_engine's fused head computes its gradient on the devices "
                "for a uniform weight over the valid tokens only; use loss_type='nll'"
            )
        # L = -sum(log_probs) / n, so dF/dL = -sum over valid tokens of dF/dlog_prob
        return -valid.sum().reshape(()).to(grad.dtype), None, None


def fused_output(
    loss: torch.Tensor, stats: dict[str, torch.Tensor], *, leaf: torch.Tensor | None
) -> Any:
    """TRL's ``FusedCausalLMOutput`` for one micro-batch.

    ``stats`` are the head's per-token tensors (labels' shape, position ``t`` scoring label
    ``t + 1``); ``leaf`` is the engine's loss leaf (train mode) or None (evaluation: no grad).
    """
    device = loss.device
    mask = stats["label_mask"][:, :-1].to(device)
    values = stats["log_probs"][:, :-1].to(device)
    log_probs = values if leaf is None else _TiedLogProbs.apply(leaf, values, mask)
    return _output_class()(
        loss=loss,
        log_probs=log_probs,
        entropy=stats["entropy"][:, :-1].to(device),
        is_top1=stats["is_top1"][:, :-1].to(device),
        label_mask=mask,
    )


@functools.cache
def _output_class() -> Any:
    try:
        from trl.trainer.utils import FusedCausalLMOutput
    except ImportError:  # TRL not installed: the same fields on a plain ModelOutput
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return _fallback_output(CausalLMOutputWithPast)
    return FusedCausalLMOutput


def _fallback_output(base: type) -> Any:
    @dataclass
    class FusedCausalLMOutput(base):  # type: ignore[misc, valid-type]
        log_probs: torch.Tensor | None = None
        entropy: torch.Tensor | None = None
        is_top1: torch.Tensor | None = None
        label_mask: torch.Tensor | None = None

    return FusedCausalLMOutput
