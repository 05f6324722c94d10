"""Building the optimizer and LR scheduler from the config or the caller's objects.

DeepSpeed semantics: a client optimizer (instance or callable on params) silently overrides the
config's ``optimizer`` section; a client scheduler (instance or callable on the optimizer)
overrides ``scheduler``. Here every optimizer runs over fp32 *master* copies on the host, so a
client optimizer instance is rebuilt over the masters with its own hyper-parameters.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from rp_engine.config import DSConfig
from rp_engine.model.host_store import HostStore
from rp_engine.optim.loss_scaler import LossScaler
from rp_engine.optim.optimizer import HostOptimizer, adam_slice, build_inner_optimizer
from rp_engine.optim.step_journal import build_journal

__all__ = ["build_optimizer", "build_scheduler", "master_groups"]

log = logging.getLogger("rp_engine.optim")


def master_groups(store: HostStore, params: Any) -> list[dict[str, Any]]:
    """Map the caller's params (or param-group dicts) onto fp32 masters, keeping group options.

    Frozen parameters are dropped (they get neither master nor optimizer state).
    """
    items = list(params)
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    out = []
    for group in groups:
        masters = []
        for p in group["params"]:
            if not p.requires_grad:
                continue
            try:
                masters.append(store.master_of(p))
            except KeyError:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} given to initialize() is not part of "
                    "the model passed as model="
                ) from None
        if masters:
            out.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
    if not out:
        raise ValueError("initialize(): the model has no trainable parameters")
    return out


def build_optimizer(
    cfg: DSConfig,
    store: HostStore,
    *,
    model: nn.Module,
    device_kind: str,
    client_optimizer: Any = None,
    model_parameters: Iterable[Any] | None = None,
) -> HostOptimizer:
    """The engine's optimizer over masters; raises ValueError when none is configured.

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
    groups = master_groups(store, source)
    if isinstance(client_optimizer, torch.optim.Optimizer):
        inner, per_layer = _rebuild(client_optimizer, store)
    elif callable(client_optimizer):
        inner = client_optimizer(groups)
        per_layer = False
    elif cfg.optimizer is not None:
        inner, per_layer = build_inner_optimizer(cfg.optimizer.type, cfg.optimizer.params, groups)
    else:
        raise ValueError(
            'no optimizer: add an "optimizer" section to the config (e.g. {"type": "AdamW", '
            '"params": {"lr": 1e-4}}) or pass optimizer= to initialize()'
        )
    if not per_layer:
        log.info(
            "optimizer %s steps all layers at once (only Adam/AdamW step layer by layer)",
            type(inner).__name__,
        )
    host = HostOptimizer(
        inner, per_layer=per_layer, scaler=scaler, slice_elems=adam_slice(device_kind)
    )
    host.journal = build_journal(cfg.roundpipe.step_journal, host)
    return host


def _rebuild(client: torch.optim.Optimizer, store: HostStore) -> tuple[torch.optim.Optimizer, bool]:
    """The same optimizer class and hyper-parameters over the masters."""
    groups = master_groups(store, client.param_groups)
    cls = type(client)
    if cls.__name__ == "DeepSpeedCPUAdam":
        adamw_mode = bool(getattr(client, "adam_w_mode", True))
        return cls(groups, adamw_mode=adamw_mode), True  # type: ignore[call-arg]
    return cls(groups, **_accepted_defaults(cls, client.defaults)), False


def _accepted_defaults(cls: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's ``defaults`` its constructor accepts: torch's AdamW records
    ``decoupled_weight_decay`` (inherited from Adam) in ``defaults`` but refuses it as an
    argument."""
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def build_scheduler(
    cfg: DSConfig, optimizer: HostOptimizer, *, client_scheduler: Any = None
) -> Any:
    """A DeepSpeed (``deepspeed.runtime.lr_schedules``) or torch LR scheduler, or None."""
    inner = optimizer.optimizer
    if client_scheduler is not None:
        if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
            return client_scheduler(inner)
        # An instance built on the caller's own optimizer: point it at ours (same groups).
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
