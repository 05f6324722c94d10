"""Hugging Face Trainer, Accelerate and TRL on rp_engine: one line, ``enable()``.

::

    from rp_engine.integrations import hf
    hf.enable(devices="cpu:2")          # before TrainingArguments(...) / Accelerator(...)
    args = TrainingArguments(..., deepspeed="ds_config.json")
    Trainer(model=model, args=args, ...).train()

Those libraries build the DeepSpeed engine themselves: Accelerate's ``_prepare_deepspeed`` looks
``deepspeed.initialize`` up at call time. ``enable()`` therefore:

- replaces ``deepspeed.initialize`` by :func:`initialize`: a *training* call (an optimizer or
  ``model_parameters`` given) builds a :class:`~rp_engine.engine.RoundPipeEngine`; an
  inference-only call (no optimizer: Trainer's ``evaluate()`` before ``train()``, TRL reference
  models) still goes to DeepSpeed, unchanged;
- stops Transformers from registering its ZeRO-3 config weakref, so ``from_pretrained`` does not
  build the model inside ``deepspeed.zero.Init``: rp_engine wants the whole model in host memory;
- creates a one-rank gloo process group when no launcher did (Trainer and Accelerate call
  ``torch.distributed`` when DeepSpeed is on);
- makes ``Trainer`` evaluate through the engine (devices + fused head) instead of the
  host-resident module; calls that need logits still get the host module
  (:func:`_patch_trainer_eval`);
- makes ``Trainer`` (and every subclass: TRL's ``SFTTrainer``) train fast: each optimizer
  step's micro-batches, which Trainer fetches up front (``get_batch_samples``), are announced to
  the engine (``expect_micro_batches``), so the step's first forward runs the whole step as one
  RoundPipe schedule and every later forward and backward only reads its results; the gradient
  norm is read when Trainer logs, not after every step (which would wait for the step in
  flight) (:func:`_patch_trainer_window`).

TRL's ``SFTTrainer`` calls the engine with ``fused_lm_head=True``: the engine returns TRL's
``FusedCausalLMOutput`` computed by its own chunked head (``engine/fused_lm_head.py``).

The engine handed back is a :class:`DeepSpeedEngineAdapter`: a real subclass of DeepSpeed's
``DeepSpeedEngine`` (so Accelerate's ``isinstance(model, DeepSpeedEngine)`` unwrapping holds) whose
every attribute is served by the RoundPipe engine; DeepSpeed's own engine code never runs on it.
``adapter.module`` is the Hugging Face model with the newest weights (in-flight optimizer steps
drained). ``disable()`` restores everything ``enable()`` changed.

``RoundPipeTrainer`` (a ``transformers.Trainer``) runs each optimizer step's micro-batches as
one ``train_batch`` call instead (the plain Trainer is as fast now; it is kept for code that
uses it).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

# Also ``RoundPipeTrainer`` (built on first access, see ``__getattr__`` below).
__all__ = ["enable", "disable", "is_enabled", "initialize", "DeepSpeedEngineAdapter"]

log = logging.getLogger("rp_engine.hf")

_originals: dict[str, Any] = {}
_roundpipe: dict[str, Any] = {}
_owned_group = False


def enable(**roundpipe: Any) -> None:
    """Route Hugging Face's DeepSpeed path to rp_engine. Idempotent.

    Keyword arguments are ``roundpipe`` config settings (``devices="cuda:0-3"``,
    ``async_optimizer=True``...) merged over the ``roundpipe`` section of the DeepSpeed config.
    Call it before ``TrainingArguments``/``Accelerator`` are created: the ZeRO-3 weakref is set
    while ``TrainingArguments`` is built.
    """
    global _owned_group
    import deepspeed
    from transformers.integrations import deepspeed as hf_ds

    _roundpipe.clear()
    _roundpipe.update(roundpipe)
    if _originals:
        return
    _originals["initialize"] = deepspeed.initialize
    _originals["set_hf_deepspeed_config"] = hf_ds.set_hf_deepspeed_config
    deepspeed.initialize = initialize
    hf_ds.set_hf_deepspeed_config = _no_zero3_weakref
    hf_ds.unset_hf_deepspeed_config()
    _owned_group = _ensure_process_group()
    _patch_trainer_eval()
    _patch_trainer_window()


def disable() -> None:
    """Undo :func:`enable` (engines already built keep working). Idempotent."""
    global _owned_group
    if not _originals:
        return
    import deepspeed
    from transformers.integrations import deepspeed as hf_ds

    deepspeed.initialize = _originals.pop("initialize")
    hf_ds.set_hf_deepspeed_config = _originals.pop("set_hf_deepspeed_config")
    from transformers import Trainer

    for name in [k for k in _originals if k.startswith("Trainer.")]:
        setattr(Trainer, name.split(".", 1)[1], _originals.pop(name))
    _roundpipe.clear()
    if _owned_group and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _owned_group = False


def is_enabled() -> bool:
    return bool(_originals)


def initialize(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` while enabled: training calls build a RoundPipe engine (wrapped in
    :class:`DeepSpeedEngineAdapter`), inference-only calls go to DeepSpeed."""
    import rp_engine

    if args:
        raise TypeError("rp_engine.integrations.hf.initialize takes keyword arguments only")
    if kwargs.get("optimizer") is None and kwargs.get("model_parameters") is None:
        import deepspeed

        original = _originals.get("initialize", deepspeed.initialize)
        if original is initialize:  # pragma: no cover - enable() never stores itself
            raise RuntimeError("deepspeed.initialize was replaced outside enable()")
        return original(**kwargs)  # type: ignore[no-any-return]
    config = kwargs.pop("config_params", None) or kwargs.pop("config", None)
    if isinstance(config, dict):
        config = {**config, "roundpipe": {**config.get("roundpipe", {}), **_roundpipe}}
    elif _roundpipe:
        raise ValueError(
            "enable(**roundpipe) overrides need the DeepSpeed config as a dict; put them in the "
            'config file\'s "roundpipe" section instead'
        )
    engine, optimizer, loader, scheduler = rp_engine.initialize(config=config, **kwargs)
    return DeepSpeedEngineAdapter(engine), optimizer, loader, scheduler


def _patch_trainer_eval() -> None:
    """Evaluation through the engine: Trainer evaluates ``self.model`` (the host-resident
    module) even under DeepSpeed. While enabled, a Trainer holding a RoundPipe engine evaluates
    the engine instead (its forward stages on the devices and the fused head's loss), and only
    the calls that need logits go to the host module:

    - ``_wrap_model(model, training=False)`` returns the adapter;
    - ``prediction_step`` with ``prediction_loss_only=False`` (``compute_metrics``, ``predict``)
      gets the host module: logits are never built by the engine;
    - the adapter itself sends a label-less evaluation call (label smoothing,
      ``compute_loss_func``, TRL's logits pass) to the host module.
    """
    from transformers import Trainer

    wrap, predict = Trainer._wrap_model, Trainer.prediction_step
    _originals["Trainer._wrap_model"] = wrap
    _originals["Trainer.prediction_step"] = predict

    def _wrap_model(self: Any, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        out = wrap(self, model, training, dataloader)
        adapter = getattr(self, "model_wrapped", None)
        if not training and out is self.model and isinstance(adapter, DeepSpeedEngineAdapter):
            return adapter
        return out

    def prediction_step(
        self: Any, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None
    ) -> Any:
        if isinstance(model, DeepSpeedEngineAdapter) and not prediction_loss_only:
            model = model.module  # logits wanted: the host module, newest weights
        return predict(self, model, inputs, prediction_loss_only, ignore_keys)

    Trainer._wrap_model = _wrap_model  # type: ignore[method-assign]
    Trainer.prediction_step = prediction_step  # type: ignore[method-assign]


def _patch_trainer_window() -> None:
    """Trainer's training loop on the engine's fast path, while enabled, for a Trainer whose
    model is a RoundPipe engine (any other Trainer is left as it was):

    - ``get_batch_samples`` keeps the step's micro-batches; ``training_step`` of the step's
      first one prepares them all and announces them (``engine.expect_micro_batches``), then
      hands each micro-batch on as prepared, so the engine recognises it (the same tensors)
      and Trainer's own loss code (``compute_loss``, TRL's metrics) runs as it always does;
    - ``_clip_grad_norm`` / ``_get_grad_norm`` (called after every step) return None instead
      of reading the norm, which would wait for the step in flight; ``_maybe_log_save_evaluate``
      reads it when Trainer logs (the exact norm of the step just taken)."""
    from transformers import Trainer

    originals = {
        name: getattr(Trainer, name)
        for name in ("get_batch_samples", "training_step", "_clip_grad_norm", "_get_grad_norm",
                     "_maybe_log_save_evaluate")
    }  # fmt: skip
    for name, fn in originals.items():
        _originals[f"Trainer.{name}"] = fn

    def get_batch_samples(self: Any, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        batches, num_items = originals["get_batch_samples"](
            self, epoch_iterator, num_batches, device
        )
        self._rp_window = [batches, None]  # the step's micro-batches; prepared at the first
        return batches, num_items

    def training_step(
        self: Any, model: Any, inputs: Any, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        engine = _engine_of(model)
        window = getattr(self, "_rp_window", None)
        index = _position(window[0], inputs) if engine is not None and window else None
        if index is None:
            return originals["training_step"](self, model, inputs, num_items_in_batch)  # type: ignore[no-any-return]
        assert window is not None
        if window[1] is None:  # the step's first micro-batch: announce the whole step
            window[1] = [self._prepare_inputs(b) for b in window[0]]
            engine.expect_micro_batches(window[1])
        return originals["training_step"](self, model, window[1][index], num_items_in_batch)  # type: ignore[no-any-return]

    def _clip_grad_norm(self: Any, model: Any) -> Any:
        if _engine_of(model) is not None:
            return None  # read when logging (below): reading it now waits for the step
        return originals["_clip_grad_norm"](self, model)

    def _get_grad_norm(self: Any, model: Any, grad_norm: Any = None) -> Any:
        if _engine_of(model) is not None:
            return grad_norm
        return originals["_get_grad_norm"](self, model, grad_norm=grad_norm)

    def _maybe_log_save_evaluate(
        self: Any, tr_loss: Any, grad_norm: Any, model: Any, *args: Any, **kwargs: Any
    ) -> None:
        engine = _engine_of(model)
        if engine is not None and grad_norm is None and self.control.should_log:
            grad_norm = engine.get_global_grad_norm()  # this step's: finishes it
        originals["_maybe_log_save_evaluate"](self, tr_loss, grad_norm, model, *args, **kwargs)

    Trainer.get_batch_samples = get_batch_samples  # type: ignore[method-assign]
    Trainer.training_step = training_step  # type: ignore[method-assign]
    Trainer._clip_grad_norm = _clip_grad_norm  # type: ignore[method-assign]
    Trainer._get_grad_norm = _get_grad_norm  # type: ignore[method-assign]
    Trainer._maybe_log_save_evaluate = _maybe_log_save_evaluate  # type: ignore[method-assign]


def _engine_of(model: Any) -> Any:
    """The RoundPipe engine behind Trainer's model, or None (not rp_engine's)."""
    if isinstance(model, DeepSpeedEngineAdapter):
        return model.roundpipe_engine
    return None


def _position(batches: list[Any], inputs: Any) -> int | None:
    """Where ``inputs`` (the very object) sits in the step's micro-batches, or None."""
    return next((i for i, b in enumerate(batches) if b is inputs), None)


def _no_zero3_weakref(_config: Any) -> None:
    """Replaces transformers' ``set_hf_deepspeed_config``: ``is_deepspeed_zero3_enabled()`` stays
    False, so models load whole (no ``zero.Init`` partitioning) into host memory."""


def _ensure_process_group() -> bool:
    """A one-rank gloo group when no launcher made one; True if this call created it."""
    dist = torch.distributed
    if not dist.is_available() or dist.is_initialized():
        return False
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        return False  # a launcher's job: rp_engine.initialize joins its group (data parallel)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def _deepspeed_engine_class() -> type:
    from deepspeed.runtime.engine import DeepSpeedEngine

    return DeepSpeedEngine


# Names the adapter keeps for itself; every other attribute is the RoundPipe engine's.
_OWN = frozenset(
    {"roundpipe_engine", "module", "__class__", "__dict__", "__getstate__", "__setstate__"}
)


class DeepSpeedEngineAdapter(_deepspeed_engine_class()):  # type: ignore[misc]
    """A ``DeepSpeedEngine`` whose whole API is the RoundPipe engine's.

    It subclasses DeepSpeed's class only so that type checks written for DeepSpeed
    (Accelerate's ``extract_model_from_parallel``, ``isinstance(m, DeepSpeedEngine)``) recognise
    it; DeepSpeed's ``__init__`` and methods never run: every attribute read, write and call is
    forwarded to ``roundpipe_engine``. A DeepSpeed method rp_engine lacks raises AttributeError.
    """

    def __init__(self, engine: Any) -> None:  # no super().__init__: nothing of DeepSpeed's runs
        object.__setattr__(self, "roundpipe_engine", engine)

    @property
    def module(self) -> Any:
        """The Hugging Face model with the newest weights: in-flight optimizer steps are drained
        first. Accelerate's ``unwrap_model`` and ``get_state_dict`` read it."""
        engine = self.roundpipe_engine
        engine.synchronize()
        return engine.module

    def __getattribute__(self, name: str) -> Any:
        if name in _OWN:
            return object.__getattribute__(self, name)
        return getattr(object.__getattribute__(self, "roundpipe_engine"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.roundpipe_engine, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self.roundpipe_engine, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.roundpipe_engine
        if not engine.training and not args and kwargs.get("labels") is None:
            # Evaluation asking for logits (no labels: label smoothing, compute_loss_func,
            # TRL's logits pass): the engine's fused head never builds logits, so the host
            # module (newest weights) answers, on the host.
            return self.module(**kwargs)
        return engine(*args, **kwargs)

    def __repr__(self) -> str:
        return f"DeepSpeedEngineAdapter({type(self.roundpipe_engine).__name__})"

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self.roundpipe_engine)) | _OWN)


_trainer_cls: type | None = None


def __getattr__(name: str) -> Any:
    # RoundPipeTrainer subclasses transformers.Trainer, whose import costs seconds: built on use.
    if name == "RoundPipeTrainer":
        return _roundpipe_trainer()
    raise AttributeError(name)


def _roundpipe_trainer() -> type:
    global _trainer_cls
    if _trainer_cls is not None:
        return _trainer_cls
    from transformers import Trainer

    class RoundPipeTrainer(Trainer):  # type: ignore[misc]
        """``transformers.Trainer`` that feeds all micro-batches of one optimizer step to
        ``engine.train_batch`` (one RoundPipe schedule: the fast path) instead of one
        forward/backward per micro-batch.

        Same losses, gradients and logs as the plain Trainer. It falls back to the plain
        per-micro-batch path (still correct, just slower) when the step is not a full
        accumulation window (an epoch's last, short step), when the micro-batches hold different
        numbers of loss tokens (Trainer then weights them by token count, ``train_batch``
        equally), with ``compute_loss_func`` or label smoothing, or when the engine is not
        rp_engine's. ``fast_path_steps`` counts the optimizer steps that took the fast path.
        """

        fast_path_steps = 0
        _rp_pending: tuple[list[Any], Any] | None = None
        _rp_fast = False

        def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
            batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
            self._rp_pending = (batches, num_items)
            return batches, num_items

        def training_step(
            self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None
        ) -> torch.Tensor:
            engine: Any = getattr(model, "roundpipe_engine", None)
            pending = self._rp_pending
            if pending is not None and inputs is pending[0][0]:
                self._rp_pending = None
                self._rp_fast = engine is not None and self._fast_path_ok(engine, pending[0])
                if self._rp_fast:
                    batches = [self._prepare_inputs(b) for b in pending[0]]
                    loss = engine.train_batch(iter(batches))
                    self.fast_path_steps += 1
                    return loss.detach().to(self.args.device)
            if self._rp_fast:
                # the rest of a step train_batch already ran: its loss was reported once
                return torch.zeros((), device=self.args.device)
            return super().training_step(model, inputs, num_items_in_batch)

        # The gradient norm: Trainer reads it after every step (through accelerate's
        # clip_grad_norm_), which with overlapping iterations would finish the step in flight
        # each time. On the fast path it is read only when Trainer logs, still exact.
        def _clip_grad_norm(self, model: Any) -> Any:
            return None if self._rp_fast else super()._clip_grad_norm(model)

        def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
            return None if self._rp_fast else super()._get_grad_norm(model, grad_norm=grad_norm)

        def _maybe_log_save_evaluate(
            self, tr_loss: Any, grad_norm: Any, model: Any, *args: Any, **kwargs: Any
        ) -> None:
            engine: Any = getattr(model, "roundpipe_engine", None)
            if self._rp_fast and engine is not None and self.control.should_log:
                grad_norm = engine.get_global_grad_norm()  # this step's: finishes it
            super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, *args, **kwargs)

        def _fast_path_ok(self, engine: Any, batches: list[Any]) -> bool:
            if len(batches) != engine.gradient_accumulation_steps():
                return False
            if self.compute_loss_func is not None or self.label_smoother is not None:
                return False
            try:
                counts = {int((b["labels"][..., 1:] != -100).sum()) for b in batches}
            except (KeyError, TypeError):
                return False
            return len(counts) == 1

    _trainer_cls = RoundPipeTrainer
    return RoundPipeTrainer
