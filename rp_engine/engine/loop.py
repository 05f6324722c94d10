"""DeepSpeed's imperative loop over RoundPipe: ``loss = engine(batch); engine.backward(loss);
engine.step()``, one micro-batch at a time.

``forward`` runs the forward stages and the fused head of one micro-batch and keeps the head's
gradients on the device (the ``Carry``); ``backward(loss)`` scales them by d(loss)/d(our loss),
so whatever the caller did to the loss is honoured, and runs the backward stages; ``step`` closes
the optimizer step at the accumulation boundary. ``train_batch`` (pipeline.py) is the fast path:
all GAS micro-batches in one schedule, with identical gradients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rp_engine.engine.fused_lm_head import fused_output
from rp_engine.plan.actions import Op

if TYPE_CHECKING:
    from rp_engine.model.batches import BatchAdapter
    from rp_engine.optim.nonfinite import NonFiniteGuard
    from rp_engine.optim.optimizer import HostOptimizer
    from rp_engine.optim.stepper import OptimizerStepper
    from rp_engine.runtime.counters import StepCounters
    from rp_engine.runtime.executor import Carry
    from rp_engine.runtime.planning import Planner

__all__ = ["ImperativeLoop", "FORWARD_OPS", "BACKWARD_OPS"]

FORWARD_OPS = frozenset({Op.FWD, Op.HEAD})
BACKWARD_OPS = frozenset({Op.BWD})


class ImperativeLoop:
    """``__call__`` / ``forward`` / ``backward`` / ``step`` of ``deepspeed.DeepSpeedEngine``."""

    # the micro-batch between forward() and backward(): its carry, batch and loss leaf
    _carry: Carry | None = None
    _carry_batch: dict[str, Any] | None = None
    _loss_leaf: torch.Tensor | None = None

    if TYPE_CHECKING:  # provided by RoundPipeEngine
        stepper: OptimizerStepper
        device: torch.device
        planner: Planner
        optimizer: HostOptimizer
        global_steps: int
        _counters: StepCounters
        _guard: NonFiniteGuard
        _batches: BatchAdapter
        _module: torch.nn.Module

        def _batch_of(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]: ...
        def _run(
            self, plan: Any, batches: list[Any], *, step: int, closes_step: bool, **kw: Any
        ) -> Any: ...
        def _eval_run(self, batches: list[Any], **kw: Any) -> Any: ...
        def _apply_boundary(self, lr_kwargs: dict[str, Any] | None) -> bool: ...
        def gradient_accumulation_steps(self) -> int: ...
        def is_gradient_accumulation_boundary(self) -> bool: ...

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.forward(*inputs, **kwargs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the forward stages and the fused head of one micro-batch; returns the loss
        (a Hugging Face ``CausalLMOutput`` for HF models, else the loss tensor).

        ``fused_lm_head=True`` (TRL's fused LM head) returns TRL's ``FusedCausalLMOutput``
        instead: per-token log-probs, entropy, top-1 hits, label mask (integrations/
        fused_lm_head.py)."""
        self.stepper.check()
        # Transformers' Trainer passes the token count of the whole optimizer step; the model
        # then returns sum / count instead of the micro-batch mean (as HF's ForCausalLMLoss).
        num_items = kwargs.pop("num_items_in_batch", None)
        fused = _fused_request(kwargs.pop("fused_lm_head", False), self._batches.seq.head)
        batch = self._batch_of(inputs, kwargs)
        share = self._batches.token_share(batch, num_items)
        if not (self._module.training and torch.is_grad_enabled()):
            result = self._eval_run([batch], token_stats=fused)
            loss = torch.tensor(result.losses[0], device=self.device) * share
            if fused:
                return fused_output(loss, result.token_stats[0], leaf=None)
            return self._batches.wrap_loss(loss)
        if self._carry is not None:
            raise RuntimeError(
                "engine.forward() called twice without engine.backward(): rp_engine computes the "
                "loss's gradient inside the pipeline, so each forward must be followed by backward"
            )
        step = self.global_steps + 1
        result = self._run(
            self.planner.plan(1, ops=FORWARD_OPS),
            [batch],
            step=step,
            defer_head=True,
            closes_step=False,
            token_stats=fused,
        )
        self._carry, self._carry_batch = result.carry, batch
        self._loss_leaf = torch.tensor(result.losses[0], device=self.device, requires_grad=True)
        # Not the leaf itself: callers scale the loss in place (Trainer's `loss *= ...`), which
        # autograd refuses on a leaf; backward differentiates through this product.
        if fused:
            stats = result.token_stats[0]
            return fused_output(self._loss_leaf * share, stats, leaf=self._loss_leaf)
        return self._batches.wrap_loss(self._loss_leaf * share)

    def backward(
        self, loss: Any, retain_graph: bool = False, scale_wrt_gas: bool = True, **kwargs: Any
    ) -> torch.Tensor:
        """Backward of the last forward's micro-batch. Returns the loss scaled by 1/GAS (as
        DeepSpeed). Whatever the caller did to the loss is honoured: its derivative with respect
        to the returned loss scales the gradients."""
        self.stepper.check()
        if self._carry is None or self._loss_leaf is None:
            raise RuntimeError("engine.backward() needs a preceding engine.forward() in train mode")
        loss_t = getattr(loss, "loss", loss)
        scaled = loss_t / self.gradient_accumulation_steps() if scale_wrt_gas else loss_t
        factor = _derivative(scaled, self._loss_leaf) * self.optimizer.cur_scale
        closes = self.is_gradient_accumulation_boundary()
        carry, batch = self._carry, self._carry_batch
        self._carry = self._carry_batch = None
        self._run(
            self.planner.plan(1, ops=BACKWARD_OPS),
            [batch],  # type: ignore[list-item]
            step=self.global_steps + 1,
            closes_step=closes,
            carry=carry,
            head_factor=factor,
        )
        return scaled.detach()

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Called after every micro-batch; applies the optimizer at the accumulation boundary."""
        self.stepper.check()
        if self._counters.is_boundary():
            self._counters.step(applied=self._apply_boundary(lr_kwargs))
        else:
            self._counters.step(applied=None)
        self._guard.raise_failed()  # after the counters: the engine is consistent when it raises


def _fused_request(flag: Any, head: Any) -> bool:
    """Whether the caller asked for TRL's fused-LM-head output; an error if the head can't."""
    if flag and not getattr(head, "token_stats", False):
        raise NotImplementedError(
            f"fused_lm_head=True needs per-token statistics from the model's head, which "
            f"{type(head).__name__} does not compute (only Hugging Face causal LMs' "
            "CausalLMHead does); call the engine without fused_lm_head"
        )
    return bool(flag)


def _derivative(scaled: Any, leaf: torch.Tensor) -> float:
    """d(scaled)/d(leaf); 0 when the caller's loss does not depend on ours."""
    if not isinstance(scaled, torch.Tensor) or not scaled.requires_grad:
        return 0.0
    (grad,) = torch.autograd.grad(scaled, leaf, allow_unused=True)
    return 0.0 if grad is None else float(grad)
