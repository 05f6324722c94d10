"""Building the optimizer and LR scheduler from the config or the caller's objects.

DeepSpeed semantics: a client optimizer (instance or callable on params) silently overrides the
config's ``optimizer`` section; a client scheduler (instance or callable on the optimizer)
overrides ``scheduler``. Here every optimizer runs over fp32 *master* copies on the host:

- a client optimizer *instance* is adopted, not copied: its param groups are re-pointed at the
  masters of their parameters (DeepSpeed's ZeRO optimizers re-point the client's groups at
  their fp32 partitions the same way), keeping the group dicts, their options and any state it
  already holds. So the client's object is the one the engine steps: LR and param-group edits
  made on it, or by an LR scheduler built on it, reach the engine's next step.
- a client *callable* is called with the masters (param groups when it was given groups).
- ``step()`` and ``zero_grad()`` of a client's object become no-ops for user code (the engine
  owns the gradient buffers and steps the optimizer at the accumulation boundary, as
  ``engine.step()`` does under DeepSpeed); the engine keeps the original ``step``.

``returned_optimizer`` picks what ``initialize`` returns, as DeepSpeed 0.19.8 does.

Without either (no client optimizer, no ``optimizer`` section) the engine is forward-only, as
DeepSpeed allows at ZeRO stage 0 and 3: ``initialize`` returns None as the optimizer and the LR
scheduler, the engine drives a ``HostOptimizer`` over :class:`NoOptimizer` (no parameters, so
the host store keeps no fp32 masters and no gradient buffers) and refuses ``backward`` /
``step`` / ``train_batch`` (``RoundPipeEngine._need_optimizer``). ZeRO stages 1 and 2 need an
optimizer, as DeepSpeed asserts.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from rp_engine.config import DSConfig
from rp_engine.config.errors import _ConfigAssertError, _InitArgTypeError
from rp_engine.model.host_store import HostStore
from rp_engine.optim.loss_scaler import LossScaler
from rp_engine.optim.optimizer import HostOptimizer, adam_slice, build_inner_optimizer
from rp_engine.optim.step_journal import build_journal

__all__ = [
    "NoOptimizer",
    "build_optimizer",
    "build_scheduler",
    "has_optimizer",
    "master_groups",
    "returned_optimizer",
]

log = logging.getLogger("rp_engine.optim")


class NoOptimizer(torch.optim.Optimizer):
    """The inner optimizer of a forward-only engine: no parameter groups, no state (its
    ``state_dict`` is empty). Nothing ever steps it: the engine refuses to train first."""

    def __init__(self) -> None:
        super().__init__([torch.empty(0)], {})  # torch refuses an empty list: a stand-in,
        self.param_groups.clear()  # dropped at once

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise RuntimeError("a forward-only engine (initialize without an optimizer) never steps")


def has_optimizer(cfg: DSConfig, client_optimizer: Any) -> bool:
    """Whether ``initialize`` has an optimizer to train with: the caller's, or the config's
    ``optimizer`` section. Without one the engine is forward-only, which DeepSpeed refuses at
    ZeRO stages 1 and 2 (``zero stage N requires an optimizer``): so does this."""
    if client_optimizer is not None or cfg.optimizer is not None:
        return True
    stage = int(cfg.zero.stage)
    if stage in (1, 2):
        raise _ConfigAssertError(
            f'zero_optimization.stage = {stage} needs an optimizer (DeepSpeed asserts "zero stage '
            f'{stage} requires an optimizer"): add an "optimizer" section to the config (e.g. '
            '{"type": "AdamW", "params": {"lr": 1e-4}}) or pass optimizer= to initialize(); for '
            "forward-only use (no optimizer) use ZeRO stage 0 or 3"
        )
    return False


def master_groups(store: HostStore, params: Any) -> list[dict[str, Any]]:
    """Map the caller's params (or param-group dicts) onto fp32 masters, keeping group options.

    Frozen parameters are dropped (they get neither master nor optimizer state).
    """
    items = list(params)
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    out = []
    for group in groups:
        masters = _masters(store, group["params"])
        if masters:
            out.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
    if not out:
        raise ValueError("initialize(): the model has no trainable parameters")
    return out


def _masters(store: HostStore, params: Iterable[Any]) -> list[torch.Tensor]:
    """The fp32 masters of the trainable ones of ``params`` (frozen ones have none)."""
    masters = []
    for p in params:
        if not p.requires_grad:
            continue
        try:
            masters.append(store.master_of(p))
        except KeyError:
            raise ValueError(
                f"a parameter of shape {tuple(p.shape)} given to initialize() is not part of "
                "the model passed as model="
            ) from None
    return masters


def build_optimizer(
    cfg: DSConfig,
    store: HostStore,
    *,
    model: nn.Module,
    device_kind: str,
    client_optimizer: Any = None,
    model_parameters: Iterable[Any] | None = None,
) -> HostOptimizer:
    """The engine's optimizer over masters; over :class:`NoOptimizer` when there is none
    (``has_optimizer``: a forward-only engine, whose ``store`` then holds no masters).

    ``device_kind`` ("cpu" or "cuda": the pool's) sizes CPU Adam's slices (``adam_slice``)."""
    fp16 = cfg.fp16
    scaler = LossScaler.from_fp16(
        enabled=fp16.enabled,
        loss_scale=fp16.loss_scale,
        initial_scale_power=fp16.initial_scale_power,
        loss_scale_window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        min_loss_scale=fp16.min_loss_scale,
    )
    source = model_parameters if model_parameters is not None else model.parameters()
    step_fn = None
    if client_optimizer is not None and not (
        isinstance(client_optimizer, torch.optim.Optimizer) or callable(client_optimizer)
    ):
        raise _InitArgTypeError(  # DeepSpeed asserts the type (engine._do_sanity_check)
            f"initialize(optimizer=...) got a {type(client_optimizer).__name__}: pass a "
            "torch.optim.Optimizer instance, a callable that builds one from parameters, or "
            'None to use the config\'s "optimizer" section'
        )
    if isinstance(client_optimizer, torch.optim.Optimizer):
        inner = _adopt(client_optimizer, store)
        step_fn = _guard_client(inner)
    elif callable(client_optimizer):
        groups = master_groups(store, source)
        plain = len(groups) == 1 and set(groups[0]) == {"params"}
        # DeepSpeed calls it with model_parameters as given: a list of tensors stays one
        inner = client_optimizer(groups[0]["params"] if plain and _plain(source) else groups)
        if not hasattr(inner, "param_groups") or not hasattr(inner, "state"):
            raise _InitArgTypeError(
                f"initialize(optimizer=callable) returned a {type(inner).__name__}: the "
                "callable must build a torch.optim.Optimizer from the parameters it is given"
            )
        step_fn = _guard_client(inner)
    elif cfg.optimizer is not None:
        groups = master_groups(store, source)
        inner, _ = build_inner_optimizer(cfg.optimizer.type, cfg.optimizer.params, groups)
    else:  # forward-only (has_optimizer): "per layer" only keeps data parallel's check quiet
        return HostOptimizer(
            NoOptimizer(), per_layer=True, scaler=scaler, slice_elems=adam_slice(device_kind)
        )
    # Only DeepSpeed's CPU Adam exposes a kernel that steps a subset of the parameters.
    per_layer = type(inner).__name__ == "DeepSpeedCPUAdam"
    if not per_layer:
        log.info(
            "optimizer %s steps all layers at once (only Adam/AdamW step layer by layer)",
            type(inner).__name__,
        )
    release_gil = cfg.roundpipe.release_gil
    host = HostOptimizer(
        inner, per_layer=per_layer, scaler=scaler, step_fn=step_fn, release_gil=release_gil,
        slice_elems=adam_slice(device_kind, release_gil=release_gil),
    )  # fmt: skip
    host.journal = build_journal(cfg.roundpipe.step_journal, host)
    return host


def returned_optimizer(host: HostOptimizer, cfg: DSConfig, *, client_given: bool) -> Any:
    """What ``initialize`` returns as the optimizer, as DeepSpeed 0.19.8 decides it.

    DeepSpeed returns the basic optimizer itself when it needs no wrapper (ZeRO stage 0 and
    fp32: ``_do_optimizer_sanity_check`` returns None), so a client instance comes back as the
    same object and a client callable's result as an instance of its class; with ZeRO or
    fp16/bf16 it returns a wrapper whose ``.optimizer`` is the basic optimizer. rp_engine's
    wrapper is ``host`` (``host.optimizer`` is the client's object). Without a client
    optimizer, DeepSpeed would return its own basic optimizer (FusedAdam, a torch.optim class);
    rp_engine returns ``host`` there, as before. A forward-only engine returns None, as
    DeepSpeed does at ZeRO stage 0 (at stage 3 DeepSpeed returns its parameter-offload object,
    ``DeepSpeedZeRoOffload``, which cannot step either).
    """
    if host.empty:
        return None
    wraps = cfg.zero.stage > 0 or cfg.fp16.enabled or cfg.bf16.enabled
    return host.optimizer if client_given and not wraps else host


def _plain(source: Any) -> bool:
    """Whether ``model_parameters`` was tensors rather than param-group dicts (peeking at a
    generator is not possible: it was consumed, and a generator yields tensors)."""
    if isinstance(source, list | tuple):
        return not (source and isinstance(source[0], dict))
    return True


def _adopt(client: torch.optim.Optimizer, store: HostStore) -> torch.optim.Optimizer:
    """Re-point ``client``'s param groups (and state keys) at the fp32 masters, in place.

    The group dicts stay the same objects (an LR scheduler built on ``client`` holds their
    ``initial_lr``); groups left with no trainable parameter are dropped, as DeepSpeed drops
    empty groups. State ``client`` already holds (loaded or stepped before initialize) moves to
    the masters' keys."""
    kept = []
    moved: dict[int, torch.Tensor] = {}
    for group in client.param_groups:
        trainable = [p for p in group["params"] if p.requires_grad]
        masters = _masters(store, trainable)
        moved.update((id(p), m) for p, m in zip(trainable, masters, strict=True))
        if masters:
            group["params"] = masters
            kept.append(group)
    if not kept:
        raise ValueError("initialize(): the model has no trainable parameters")
    client.param_groups[:] = kept
    state = client.state
    old = list(state.items())
    state.clear()  # the same defaultdict: the optimizer's own code keeps using it
    for p, s in old:
        if id(p) in moved:
            state[moved[id(p)]] = s
    return client


def _guard_client(opt: Any) -> Any:
    """Make ``opt.step()``/``opt.zero_grad()`` no-ops for user code; return the real ``step``.

    Under DeepSpeed ``engine.step()`` steps the optimizer and clears the gradients; a user's
    own ``optimizer.step()`` after it finds no gradient and does nothing. Here the masters'
    gradients are the engine's accumulation buffers, live between micro-steps and read by the
    background optimizer worker: a user ``step()`` would step twice (or race the worker) and a
    ``zero_grad()`` would drop accumulated gradients, so both do nothing, and ``step`` says so
    once in the log. The guard is marked as torch LR schedulers mark their wrapper, so a
    scheduler built on ``opt`` later neither re-wraps it nor warns that step() was replaced."""
    real_step = opt.step
    warned = False

    @functools.wraps(real_step)
    def step(closure: Any = None) -> None:
        nonlocal warned
        if not warned:
            warned = True
            log.warning(
                "%s.step() called by user code does nothing: rp_engine steps it in "
                "engine.step() (DeepSpeed semantics: call engine.backward(loss); engine.step())",
                type(opt).__name__,
            )

    def zero_grad(set_to_none: bool = True) -> None:
        """No-op: the engine owns the gradient buffers and clears them after each step."""

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = step
    opt.zero_grad = zero_grad
    return real_step


def build_scheduler(
    cfg: DSConfig, optimizer: HostOptimizer, *, client_scheduler: Any = None
) -> Any:
    """A DeepSpeed (``deepspeed.runtime.lr_schedules``) or torch LR scheduler, or None; None
    for a forward-only engine, whatever was asked (DeepSpeed builds none without an optimizer)."""
    if optimizer.empty:
        return None
    inner = optimizer.optimizer
    if client_scheduler is not None:
        if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
            return client_scheduler(inner)
        # An instance: built on the client's optimizer, which is ``inner`` itself (adopted), or
        # on another one (the client gave a callable or none): point it at ``inner``.
        if hasattr(client_scheduler, "optimizer"):
            client_scheduler.optimizer = inner
            _track_steps(inner)
        return client_scheduler
    if cfg.scheduler is None:
        return None
    kind, params = cfg.scheduler.type, dict(cfg.scheduler.params)
    from deepspeed.runtime import lr_schedules

    if kind in lr_schedules.VALID_LR_SCHEDULES:
        return getattr(lr_schedules, kind)(inner, **params)
    return getattr(torch.optim.lr_scheduler, kind)(inner, **params)


def _track_steps(opt: torch.optim.Optimizer) -> None:
    """Give ``opt`` the step wrapper torch's LR schedulers install on the optimizer they are
    built with (a rebound scheduler would otherwise warn that step() was overridden)."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    step = opt.step

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = wrapper  # type: ignore[method-assign]
