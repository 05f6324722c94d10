"""RoundPipeEngine: DeepSpeed's engine API over the RoundPipe runtime. It wires, it holds no algorithm.

Parts, each owned elsewhere::

    config.DSConfig --> Planner (cuts, plans)        --> Executor (runs plans on the DevicePool)
    model --> LayerSequence --> HostStore (weights, masters, grads, versions) <-- OptimizerStepper
    optimizer: HostOptimizer (DeepSpeedCPUAdam kernel per layer), LR scheduler, LossScaler
    checkpoint.py (DeepSpeed layout), monitor.py (W&B / CSV)

Two ways to train, with identical gradients:
- ``loss = engine(batch); engine.backward(loss); engine.step()`` (DeepSpeed's loop; one
  micro-batch at a time, ``step()`` after every micro-batch, boundary every GAS micro-batches);
- ``loss = engine.train_batch(data_iter)`` (PipelineEngine API; all GAS micro-batches in one
  RoundPipe schedule: the fast path).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from rp_engine.config import DSConfig
from rp_engine.data import build_dataloader, repeat
from rp_engine.device import make_devices
from rp_engine.device.cuda import pin as cuda_pin
from rp_engine.model.host_store import HostStore
from rp_engine.model.layers import LayerSequence, to_layers
from rp_engine.monitor import Monitor
from rp_engine.optim.build import build_optimizer, build_scheduler
from rp_engine.optim.stepper import OptimizerStepper, StepResult
from rp_engine.plan.actions import Op, Plan
from rp_engine.runtime.executor import (
    Carry,
    Executor,
    GradSink,
    RunSpec,
    RunStats,
    TimelineRecord,
)
from rp_engine.runtime.planning import ModelShape, Planner

__all__ = ["RoundPipeEngine"]

log = logging.getLogger("rp_engine")

_FORWARD_OPS = frozenset({Op.FWD, Op.HEAD})
_BACKWARD_OPS = frozenset({Op.BWD})


class RoundPipeEngine:
    """Drop-in for ``deepspeed.DeepSpeedEngine``; build it with ``rp_engine.initialize``."""

    def __init__(
        self,
        *,
        model: nn.Module,
        config: DSConfig,
        optimizer: Any = None,
        model_parameters: Any = None,
        lr_scheduler: Any = None,
        training_data: Any = None,
        collate_fn: Any = None,
    ) -> None:
        cfg, rp = config, config.roundpipe
        self._config = cfg
        self.config = dict(cfg.raw)
        summary = cfg.offload_summary()
        if summary:
            log.info(summary)
        # DeepSpeed casts the module at initialize; the host copy *is* the compute weights.
        model.to(_compute_dtype(cfg))
        self.module = model
        budget = int(rp.device_memory_gb * 2**30) if rp.device_memory_gb else None
        self.pool = make_devices(rp.devices, pcie_gbps=rp.pcie_gbps, capacity_bytes=budget)
        try:
            self._wire(cfg, model, optimizer, model_parameters, lr_scheduler, budget)
            self.training_dataloader = (
                build_dataloader(training_data, cfg, collate_fn)
                if training_data is not None
                else None
            )
            self.monitor = Monitor.from_config(cfg)
        except BaseException:
            # a bad model/config must not leave device or optimizer threads behind
            if hasattr(self, "stepper"):
                self.stepper.close()
            self.pool.close()
            raise
        self._data_iter: Iterator[Any] | None = None
        # DeepSpeed counters
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._boundary_override: bool | None = None
        self._step_applied = False
        self._last: StepResult | None = None
        self._carry: Carry | None = None
        self._carry_batch: dict[str, Any] | None = None
        self._loss_leaf: torch.Tensor | None = None
        self._timeline: list[TimelineRecord] = []
        self._stats_open = RunStats()  # runs of the optimizer step in progress
        self._step_stats: RunStats | None = None
        self.local_rank = 0
        self.global_rank = 0
        self.world_size = 1
        self.dp_world_size = 1
        self.mp_world_size = 1
        self.device = self.pool[0].torch_device
        self.training = model.training

    def _wire(
        self, cfg: DSConfig, model: nn.Module, optimizer: Any, model_parameters: Any,
        lr_scheduler: Any, budget: int | None,
    ) -> None:  # fmt: skip
        """Compose the parts: layers, host store, optimizer, stepper, planner, executor."""
        rp = cfg.roundpipe
        self.seq: LayerSequence = to_layers(
            model, loss_fn=getattr(model, "loss_fn", None), head_chunk_tokens=rp.head_chunk_tokens
        )
        modules = list(self.seq.modules())
        self.store = HostStore(modules, pin=cuda_pin if self.pool.kind == "cuda" else None)
        self.optimizer = build_optimizer(
            cfg,
            self.store,
            model=model,
            client_optimizer=optimizer,
            model_parameters=model_parameters,
        )
        self.lr_scheduler = build_scheduler(cfg, self.optimizer, client_scheduler=lr_scheduler)
        self.stepper = OptimizerStepper(
            self.store,
            self.optimizer,
            clip=cfg.gradient_clipping,
            # The Mobius baseline steps synchronously, as Mobius does.
            async_mode=rp.async_optimizer and rp.schedule != "mobius",
            fp16=cfg.fp16.enabled,
        )
        self.planner = Planner(
            _shape(self.seq, self.store),
            num_devices=len(self.pool),
            num_microbatches=cfg.gradient_accumulation_steps,
            schedule=rp.schedule,
            fwd_cuts=rp.fwd_cuts,
            bwd_cuts=rp.bwd_cuts,
            memory_budget_bytes=budget,
            profile_iterations=rp.profile_iterations,
            async_optimizer=self.stepper.async_mode,
            round_size=rp.round_size,
        )
        self._executor = self._make_executor()

    def _make_executor(self) -> Executor:
        return Executor(
            modules=list(self.seq.modules()),
            stages=self.planner.stages,
            devices=list(self.pool.devices),
            sink=GradSink(
                self.store,
                wait_free=lambda layer: self.stepper.wait_grads_free(layer, self.global_steps + 1),
                ready=lambda layer: self.stepper.layer_ready(layer),
            ),
            seed=self._config.roundpipe.seed,
            use_rng=_uses_dropout(self.module),
        )

    # --- DeepSpeed imperative loop --------------------------------------------------------------
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.forward(*inputs, **kwargs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the forward stages and the fused head of one micro-batch; returns the loss
        (a Hugging Face ``CausalLMOutput`` for HF models, else the loss tensor)."""
        self.stepper.check()
        # Transformers' Trainer passes the token count of the whole optimizer step; the model
        # then returns sum / count instead of the micro-batch mean (as HF's ForCausalLMLoss).
        num_items = kwargs.pop("num_items_in_batch", None)
        batch = self._batch_of(inputs, kwargs)
        share = self._token_share(batch, num_items)
        if not (self.module.training and torch.is_grad_enabled()):
            loss = torch.tensor(self._eval_losses([batch])[0], device=self.device)
            return self._wrap(loss * share)
        if self._carry is not None:
            raise RuntimeError(
                "engine.forward() called twice without engine.backward(): rp_engine computes the "
                "loss's gradient inside the pipeline, so each forward must be followed by backward"
            )
        step = self.global_steps + 1
        result = self._run(
            self.planner.plan(1, ops=_FORWARD_OPS),
            [batch],
            step=step,
            defer_head=True,
            closes_step=False,
        )
        self._carry, self._carry_batch = result.carry, batch
        self._loss_leaf = torch.tensor(result.losses[0], device=self.device, requires_grad=True)
        # Not the leaf itself: callers scale the loss in place (Trainer's `loss *= ...`), which
        # autograd refuses on a leaf; backward differentiates through this product.
        return self._wrap(self._loss_leaf * share)

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
            self.planner.plan(1, ops=_BACKWARD_OPS),
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
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._apply_boundary(lr_kwargs)
        else:
            self._step_applied = False
        self.micro_steps += 1

    # --- PipelineEngine API ---------------------------------------------------------------------
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over GAS micro-batches in one RoundPipe schedule; mean loss."""
        self.stepper.check()
        self.train()
        gas = self.gradient_accumulation_steps()
        batches = [self._batch_of((b,), {}) for b in self._take(data_iter, gas)]
        profile = self.planner.profile_left > 0
        result = self._run(
            self.planner.plan(gas),
            batches,
            step=self.global_steps + 1,
            closes_step=True,
            grad_scale=self.optimizer.cur_scale / gas,
            profile=profile,
        )
        self.micro_steps += gas - 1
        self._apply_boundary(None)
        self.micro_steps += 1
        if profile and self.planner.observe(result.layer_ms, result.bwd_ms):
            self._executor = self._make_executor()
        loss = torch.tensor(sum(result.losses) / len(result.losses))
        self.monitor.write_events([("Train/Samples/train_loss", float(loss), self.global_samples)])
        return loss

    def eval_batch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Forward only over ``num_micro_batches`` (default GAS) micro-batches; mean loss."""
        if return_logits or not compute_loss:
            raise NotImplementedError(
                "eval_batch computes the loss in the fused LM head; logits are never materialised "
                "(use return_logits=False, compute_loss=True)"
            )
        n = num_micro_batches or self.gradient_accumulation_steps()
        batches = [self._batch_of((b,), {}) for b in self._take(data_iter, n)]
        was_training = self.module.training
        self.eval()
        try:
            losses = self._eval_losses(batches)
        finally:
            self.train(was_training)
        if reduce_output is None:
            return [torch.tensor(x) for x in losses]
        return torch.tensor(sum(losses) / len(losses))

    # --- internals ------------------------------------------------------------------------------
    def _run(
        self, plan: Plan, batches: list[Any], *, step: int, closes_step: bool, **kw: Any
    ) -> Any:
        if closes_step:
            self.stepper.open_step(step)
        spec = RunSpec(
            plan=plan,
            batches=batches,
            version=self.stepper.required_version(step),
            step=step,
            closes_step=closes_step,
            microbatch_offset=self.micro_steps,
            **kw,
        )
        try:
            result = self._executor.run(spec)
        except BaseException:
            # Nothing half-done survives a failed run: this step's gradients are dropped (the
            # weights are untouched), so the next call starts clean.
            self._abort_step()
            raise
        if closes_step:
            self._last = self.stepper.close_step()
        self._timeline = result.timeline
        self._stats_open.add(result.stats)
        if closes_step:
            self._step_stats, self._stats_open = self._stats_open, RunStats()
            self.monitor.write_events(_stats_events(self._step_stats, self.global_samples))
        return result

    def _abort_step(self) -> None:
        with contextlib.suppress(Exception):  # the run's own error is the one to report
            self.stepper.wait_all()
        self.stepper.abandon_step()
        self.store.zero_grads()
        self._carry = self._carry_batch = None
        log.warning(
            "run failed: gradients accumulated for step %d were discarded", self.global_steps + 1
        )

    def _apply_boundary(self, lr_kwargs: dict[str, Any] | None) -> None:
        result = self._last
        overflow = bool(result and result.overflow)
        self.optimizer.overflow = overflow
        self.optimizer.loss_scaler.update(overflow)
        self._step_applied = not overflow
        if overflow:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        every = self._config.steps_per_print
        if every and self.global_steps % every == 0:
            log.info(
                "step %d lr %s grad_norm %s",
                self.global_steps,
                self.get_lr(),
                self.get_global_grad_norm(),
            )
        self.monitor.write_events([("Train/Samples/lr", self.get_lr()[0], self.global_samples)])

    def _eval_losses(self, batches: list[Any]) -> list[float]:
        step = self.global_steps + 1
        spec = RunSpec(
            plan=self.planner.plan(len(batches), ops=_FORWARD_OPS),
            batches=batches,
            version=self.stepper.required_version(step),
            step=step,
            train=False,
        )
        self.stepper.synchronize()
        return self._executor.run(spec).losses

    def _batch_of(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        if kwargs:
            raw: Any = kwargs
        elif len(inputs) == 1:
            raw = inputs[0]
        else:
            raw = inputs
        batch = self.seq.batch_to_dict(raw)
        if "labels" not in batch:
            raise ValueError(
                f"the batch has no 'labels' (keys: {sorted(batch)}): rp_engine computes the loss "
                "inside the pipeline (fused LM head + loss), so every batch needs labels; for "
                "causal-LM training pass labels=input_ids"
            )
        dtype = _compute_dtype(self._config)
        # As DeepSpeed's PipelineEngine: floating inputs follow the fp16/bf16 model; labels don't.
        return {
            k: v.to(dtype) if v.is_floating_point() and not k.startswith("labels") else v
            for k, v in batch.items()
            if isinstance(v, torch.Tensor)
        }

    def _token_share(self, batch: dict[str, Any], num_items: Any) -> float:
        """This micro-batch's share of ``num_items`` loss tokens (1 when not given): the
        pipeline's loss is the mean over the micro-batch's tokens (labels != -100, shifted for
        causal LMs as Hugging Face counts them)."""
        if num_items is None:
            return 1.0
        labels = batch["labels"]
        if self.seq.kind.startswith("hf:"):
            labels = labels[..., 1:]
        return float((labels != -100).sum()) / float(num_items)

    def _take(self, data_iter: Iterator[Any] | None, n: int) -> list[Any]:
        if data_iter is None:
            if self.training_dataloader is None:
                raise ValueError("train_batch() needs a data_iter or initialize(training_data=...)")
            if self._data_iter is None:
                self._data_iter = iter(repeat(self.training_dataloader))
            data_iter = self._data_iter
        return [next(data_iter) for _ in range(n)]

    def _wrap(self, loss: torch.Tensor) -> Any:
        if self.seq.kind.startswith("hf:"):
            from transformers.modeling_outputs import CausalLMOutputWithPast

            return CausalLMOutputWithPast(loss=loss)
        return loss

    # --- DeepSpeed accessors --------------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary_override = is_boundary

    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        return None if self._last is None else self._last.grad_norm

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def get_batch_info(self) -> tuple[int, int, int]:
        return (
            self.train_batch_size(),
            self.train_micro_batch_size_per_gpu(),
            self.gradient_accumulation_steps(),
        )

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def fp16_enabled(self) -> bool:
        return self._config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self._config.bf16.enabled

    def zero_optimization_stage(self) -> int:
        return self._config.zero.stage

    def train(self, mode: bool = True) -> RoundPipeEngine:
        self.module.train(mode)
        self.training = mode
        return self

    def eval(self) -> RoundPipeEngine:
        return self.train(False)

    def zero_grad(self) -> None:
        """DeepSpeed clears gradients itself after each step; accumulation buffers live on the
        host and are cleared by the optimizer step, so this is a no-op between micro-batches."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def last_step_stats(self) -> dict[str, Any]:
        """What the last optimizer step moved and computed, measured by the devices: bytes
        each way (all, weights, gradients, activations), weight uploads, wall seconds of its
        runs, and per device the compute busy seconds (CUDA: timing events on the compute
        stream) and busy fraction. Empty before the first step."""
        st = self._step_stats
        if st is None:
            return {}
        return {
            "h2d_bytes": st.h2d_bytes,
            "d2h_bytes": st.d2h_bytes,
            "weight_h2d_bytes": st.weight_h2d_bytes,
            "grad_d2h_bytes": st.grad_d2h_bytes,
            "activation_bytes": st.activation_bytes,
            "uploads": st.uploads,
            "downloads": st.downloads,
            "seconds": st.seconds,
            "busy_s": dict(st.busy_s),
            "busy_fraction": {
                d: (b / st.seconds if st.seconds > 0 else 0.0) for d, b in st.busy_s.items()
            },
        }

    def last_timeline(self) -> list[TimelineRecord]:
        """Compute actions of the last run: (device, action text, start s, end s)."""
        return list(self._timeline)

    def synchronize(self) -> None:
        """Wait for in-flight optimizer steps and publish the newest weights to the module."""
        self.stepper.synchronize()

    # --- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(
        self, save_dir: str, tag: str | None = None, client_state: dict[str, Any] | None = None,
        save_latest: bool = True, exclude_frozen_parameters: bool = False,
    ) -> bool:  # fmt: skip
        self.synchronize()
        _ckpt().save(
            self, save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest,
            exclude_frozen=exclude_frozen_parameters,
        )  # fmt: skip
        return True

    def load_checkpoint(
        self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
        load_module_only: bool = False, custom_load_fn: Any = None, *,
        trust_checkpoint: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]:  # fmt: skip
        """DeepSpeed's load_checkpoint. Files load with ``weights_only=True`` (DeepSpeed-written
        ones too, through an allowlist of its classes); a file holding any other Python global is
        refused unless ``trust_checkpoint=True``, which unpickles it fully (only for files you
        trust: unpickling can run code)."""
        self.synchronize()
        return _ckpt().load(
            self, load_dir, tag=tag, strict=load_module_strict,
            optimizer_states=load_optimizer_states and not load_module_only,
            scheduler_states=load_lr_scheduler_states and not load_module_only,
            module_only=load_module_only, trust=trust_checkpoint,
        )  # fmt: skip

    def save_16bit_model(
        self,
        save_dir: str,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        self.synchronize()
        return _ckpt().save_16bit(
            self, save_dir, save_filename, exclude_frozen=exclude_frozen_parameters
        )

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's flag (``stage3_gather_16bit_weights_on_model_save``), which Hugging Face
        reads to choose between saving model files and a full checkpoint. The weights here are
        never partitioned, so either way costs no gather."""
        return self._config.zero.stage3_gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor]:
        """The module's whole state_dict in the compute dtype, newest weights (DeepSpeed's
        ZeRO-3 gather; Hugging Face's save path calls it)."""
        self.synchronize()
        state = self.module.state_dict()
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters(remove_duplicate=False):
                if not p.requires_grad:
                    state.pop(name, None)
        return state

    def destroy(self) -> None:
        """Finish in-flight steps, stop workers and devices. Idempotent."""
        with contextlib.suppress(Exception):
            self.stepper.synchronize()
        self.stepper.close()
        self._executor.close()
        self.pool.close()
        self.monitor.close()

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: fall through to the wrapped module, as DeepSpeed
        # does (engine.generate(...), engine.config attributes of HF models...).
        if name == "module" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.__dict__["module"], name)


def _stats_events(st: RunStats, samples: int) -> list[tuple[str, float, int]]:
    """Monitor events of one optimizer step's traffic and device busy fraction."""
    busy = (
        sum(st.busy_s.values()) / (len(st.busy_s) * st.seconds) if st.busy_s and st.seconds else 0
    )
    return [
        ("Train/Samples/h2d_bytes", float(st.h2d_bytes), samples),
        ("Train/Samples/d2h_bytes", float(st.d2h_bytes), samples),
        ("Train/Samples/weight_h2d_bytes", float(st.weight_h2d_bytes), samples),
        ("Train/Samples/device_busy_fraction", float(busy), samples),
    ]


def _compute_dtype(cfg: DSConfig) -> torch.dtype:
    if cfg.bf16.enabled:
        return torch.bfloat16
    return torch.float16 if cfg.fp16.enabled else torch.float32


def _ckpt() -> Any:
    # Imported on first use: checkpointing pulls in DeepSpeed's modules, which cost seconds.
    from rp_engine import checkpoint

    return checkpoint


def _shape(seq: LayerSequence, store: HostStore) -> ModelShape:
    layers = store.layers
    p = 1 if seq.prefix is not None else 0
    return ModelShape(
        num_blocks=seq.num_blocks,
        has_prefix=seq.prefix is not None,
        block_param_bytes=tuple(layers[p + i].param_bytes for i in range(seq.num_blocks)),
        head_param_bytes=layers[-1].param_bytes,
        prefix_param_bytes=layers[0].param_bytes if p else 0,
    )


def _derivative(scaled: Any, leaf: torch.Tensor) -> float:
    """d(scaled)/d(leaf); 0 when the caller's loss does not depend on ours."""
    if not isinstance(scaled, torch.Tensor) or not scaled.requires_grad:
        return 0.0
    (grad,) = torch.autograd.grad(scaled, leaf, allow_unused=True)
    return 0.0 if grad is None else float(grad)


def _uses_dropout(model: nn.Module) -> bool:
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
