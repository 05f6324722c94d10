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
from rp_engine.model.module import rebuild_outputs
from rp_engine.plan.actions import Op

if TYPE_CHECKING:
    from rp_engine.model.batches import BatchAdapter
    from rp_engine.optim.nonfinite import NonFiniteGuard
    from rp_engine.optim.optimizer import HostOptimizer
    from rp_engine.optim.stepper import OptimizerStepper
    from rp_engine.runtime.counters import StepCounters
    from rp_engine.runtime.executor import Carry, Executor
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
    _leaves: dict[str, torch.Tensor] = {}  # noqa: RUF012 - a module model's outputs (replaced)

    if TYPE_CHECKING:  # provided by RoundPipeEngine
        stepper: OptimizerStepper
        device: torch.device
        planner: Planner
        host_optimizer: HostOptimizer
        global_steps: int
        _counters: StepCounters
        _guard: NonFiniteGuard
        _batches: BatchAdapter
        _module: torch.nn.Module
        _executor: Executor

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
        if self._batches.seq.returns_outputs:
            return self._forward_outputs(inputs, kwargs)
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
        self._release_carry()
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
        outputs = self._batches.seq.returns_outputs
        if self._carry is None or (self._loss_leaf is None and not outputs):
            raise RuntimeError("engine.backward() needs a preceding engine.forward() in train mode")
        loss_t = getattr(loss, "loss", loss)
        scaled = loss_t / self.gradient_accumulation_steps() if scale_wrt_gas else loss_t
        run: dict[str, Any] = {}
        if outputs:  # d(loss)/d(each output) seeds the backward stages (model/module.py)
            run["output_grads"] = _output_grads(
                scaled * self.host_optimizer.cur_scale, self._leaves
            )
        else:
            assert self._loss_leaf is not None
            run["head_factor"] = (
                _derivative(scaled, self._loss_leaf) * self.host_optimizer.cur_scale
            )
        closes = self.is_gradient_accumulation_boundary()
        carry, batch = self._carry, self._carry_batch
        self._carry = self._carry_batch = None
        self._leaves = {}
        self._run(
            self.planner.plan(1, ops=BACKWARD_OPS),
            [batch],  # type: ignore[list-item]
            step=self.global_steps + 1,
            closes_step=closes,
            carry=carry,
            **run,
        )
        return scaled.detach()

    def _forward_outputs(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A module model's forward: its own return value, rebuilt from the head's outputs
        (training: floating tensors on the engine's device that collect the caller's
        gradient for ``backward``)."""
        batch = self._batch_of(inputs, kwargs)
        if not (self._module.training and torch.is_grad_enabled()):
            outputs = self._eval_run([batch]).outputs[0]
            return rebuild_outputs(outputs, lambda _k, v: _to(v, self.device))
        self._release_carry()
        result = self._run(
            self.planner.plan(1, ops=FORWARD_OPS),
            [batch],
            step=self.global_steps + 1,
            defer_head=True,
            closes_step=False,
        )
        self._carry, self._carry_batch = result.carry, batch
        leaves: dict[str, torch.Tensor] = {}

        def leaf(key: str, value: Any) -> Any:
            value = _to(value, self.device)
            if key.startswith("hidden."):  # a floating output: it may carry the loss's gradient
                value = leaves[key] = value.detach().requires_grad_(True)
            return value

        out = rebuild_outputs(result.outputs[0], leaf)
        self._leaves = leaves
        return out

    def _release_carry(self) -> None:
        """A training-mode forward whose backward never came (a loss logged, say): DeepSpeed
        allows it; its graph is released here, at the next forward. Nothing of it reached the
        host's gradients (they land in backward), so dropping it is the whole release."""
        if self._carry is not None:
            self._executor.release(self._carry)
        self._carry = self._carry_batch = self._loss_leaf = None
        self._leaves = {}

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


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _output_grads(scaled: Any, leaves: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """d(scaled)/d(each output leaf), on the host (the backward run uploads them); outputs the
    loss does not depend on get none (nothing flows back from them)."""
    if not isinstance(scaled, torch.Tensor) or not scaled.requires_grad or not leaves:
        return {}
    keys = list(leaves)
    grads = torch.autograd.grad(scaled, [leaves[k] for k in keys], allow_unused=True)
    return {k: g.detach().cpu() for k, g in zip(keys, grads, strict=True) if g is not None}


def _derivative(scaled: Any, leaf: torch.Tensor) -> float:
    """d(scaled)/d(leaf); 0 when the caller's loss does not depend on ours."""
    if not isinstance(scaled, torch.Tensor) or not scaled.requires_grad:
        return 0.0
    (grad,) = torch.autograd.grad(scaled, leaf, allow_unused=True)
    return 0.0 if grad is None else float(grad)
