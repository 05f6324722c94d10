"""Layer sequences for models that are already a list of layers: ``nn.Sequential``, a DeepSpeed
``PipelineModule`` (its built ``forward_funcs`` and ``loss_fn``), or a plain list of DeepSpeed
``LayerSpec`` / modules / callables.

Layer i's output feeds layer i+1 (the PipelineModule contract). Blocks are all layers but the
last; the head is the last layer + ``loss_fn(outputs, labels)``. A tuple flowing between layers is
kept as state keys "hidden", "hidden.1", ...; each floating one carries gradient. DeepSpeed's per-layer reseeding (``seed_layers``)
and activation checkpointing are not reproduced: recomputation belongs to the runtime.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from rp_engine.model.base import HeadModule, State, grad_keys, writable

__all__ = [
    "FunctionBlock",
    "InputPrefix",
    "LossHead",
    "SpecModule",
    "build_from_funcs",
    "deepspeed_pipe",
]

LossFn = Callable[[Any, Any], torch.Tensor]


def deepspeed_pipe() -> Any | None:
    """DeepSpeed's pipe module if the user imported it (we never import deepspeed ourselves)."""
    return sys.modules.get("deepspeed.runtime.pipe.module")


def _gather(state: dict[str, Any], key: str) -> Any:
    """key, key.1, key.2 ... -> the value, or a tuple when there are several."""
    if key not in state:
        raise ValueError(f"the state has no {key!r} (keys: {sorted(state)})")
    items = [state[key]]
    while f"{key}.{len(items)}" in state:
        items.append(state[f"{key}.{len(items)}"])
    return items[0] if len(items) == 1 else tuple(items)


def _with_hidden(state: State, out: Any) -> State:
    """A new state whose "hidden" (and "hidden.i") keys hold ``out``."""
    new = {k: v for k, v in state.items() if k != "hidden" and not k.startswith("hidden.")}
    items = out if isinstance(out, tuple | list) else (out,)
    for i, item in enumerate(items):
        new["hidden" if i == 0 else f"hidden.{i}"] = item
    return new


class InputPrefix(nn.Module):
    """{"input"[, "input.i"], "labels"...} -> {"hidden"[, "hidden.i"], "labels"...}. No
    parameters; "hidden" may be an integer tensor (token ids) that carries no gradient."""

    def forward(self, batch: dict[str, Any]) -> State:
        if "input" not in batch:
            raise ValueError(
                f"expected an (inputs, labels) batch or a dict with 'input' and 'labels' keys, "
                f"got keys {sorted(batch)}"
            )
        state = {k: v for k, v in batch.items() if k != "input" and not k.startswith("input.")}
        return _with_hidden(state, _gather(batch, "input"))


class FunctionBlock(nn.Module):
    """One layer: ``layer(x)``, ``forward_fn(layer, x)`` (a DeepSpeed TiedLayerSpec) or
    ``forward_fn(x)`` (a parameterless callable). The layer is a registered child so a per-device
    copy of this block swaps it consistently."""

    def __init__(
        self, layer: nn.Module | None, *, forward_fn: Callable[..., Any] | None = None
    ) -> None:
        super().__init__()
        if layer is None and forward_fn is None:
            raise ValueError("FunctionBlock needs a layer or a forward_fn")
        self.layer = layer
        self.forward_fn = forward_fn

    def call(self, x: Any) -> Any:
        if self.forward_fn is None:
            assert self.layer is not None
            return self.layer(x)
        if self.layer is None:
            return self.forward_fn(x)
        return self.forward_fn(self.layer, x)

    def forward(self, state: State) -> State:
        return _with_hidden(state, self.call(_gather(state, "hidden")))


class LossHead(HeadModule):
    """The last layer + ``loss_fn(outputs, labels)``; forward_backward is a single chunk."""

    def __init__(self, last: FunctionBlock, loss_fn: LossFn) -> None:
        super().__init__()
        self.last = last
        self.loss_fn = loss_fn

    def forward(self, state: State) -> torch.Tensor:
        return self.loss_fn(self.last.call(_gather(state, "hidden")), _gather(state, "labels"))

    def forward_backward(
        self, state: State, *, grad_scale: float = 1.0
    ) -> tuple[torch.Tensor, State]:
        leaves = {k: state[k].detach().requires_grad_() for k in grad_keys(state)}
        with torch.enable_grad():  # the layer gets non-leaves: it may write them in place
            loss = self.forward({**state, **{k: writable(v) for k, v in leaves.items()}})
            if loss.requires_grad:
                torch.autograd.backward(loss * grad_scale)
        # integer inputs (token ids), or values the loss does not depend on: no gradient
        return loss.detach(), {k: v.grad for k, v in leaves.items() if v.grad is not None}


class SpecModule(nn.Module):
    """Owns the modules built from a list of DeepSpeed LayerSpec, named as a PipelineModule would
    name them ("<index>.<param>", tied ones "tied_modules.<key>.<param>")."""

    def __init__(self) -> None:
        super().__init__()
        self.tied_modules = nn.ModuleDict()


def _spec_funcs(specs: Sequence[Any]) -> tuple[SpecModule, list[Any]]:
    """Build a LayerSpec list like PipelineModule._build does (one stage, no process group)."""
    pipe = deepspeed_pipe()
    root = SpecModule()
    funcs: list[Any] = []
    for idx, spec in enumerate(specs):
        if pipe is not None and isinstance(spec, pipe.TiedLayerSpec):
            if spec.key not in root.tied_modules:
                root.tied_modules[spec.key] = spec.build()
            tied = root.tied_modules[spec.key]
            funcs.append(tied if spec.forward_fn is None else (spec.forward_fn, tied))
        elif pipe is not None and isinstance(spec, pipe.LayerSpec):
            module = spec.build()
            root.add_module(str(idx), module)
            funcs.append(module)
        elif isinstance(spec, nn.Module):
            root.add_module(str(idx), spec)
            funcs.append(spec)
        elif callable(spec):
            funcs.append(spec)
        else:
            raise ValueError(f"layer {idx} is a {type(spec).__name__}, not a LayerSpec or module")
    return root, funcs


def _pipeline_funcs(module: Any) -> list[Any]:
    """A PipelineModule's forward_funcs, with TiedLayerSpec partials split into (fn, module)."""
    if len(module.forward_funcs) != module._num_layers:
        raise ValueError(
            f"the PipelineModule holds {len(module.forward_funcs)} of its "
            f"{module._num_layers} layers (num_stages={module.num_stages}); build it with "
            "num_stages=1: rp_engine partitions the layers itself"
        )
    funcs: list[Any] = []
    for fn in module.forward_funcs:
        args: tuple[Any, ...] = getattr(fn, "args", ())
        if not isinstance(fn, nn.Module) and len(args) == 1 and isinstance(args[0], nn.Module):
            funcs.append((fn.func, args[0]))  # functools.partial(forward_fn, tied_module)
        else:
            funcs.append(fn)
    return funcs


def _block(func: Any) -> FunctionBlock:
    if isinstance(func, nn.Module):
        return FunctionBlock(func)
    if isinstance(func, tuple):
        forward_fn, module = func
        return FunctionBlock(module, forward_fn=forward_fn)
    return FunctionBlock(None, forward_fn=func)


def build_from_funcs(
    model: Any, *, loss_fn: LossFn | None
) -> tuple[InputPrefix, list[nn.Module], LossHead, nn.Module, str]:
    """nn.Sequential / PipelineModule / LayerSpec list -> prefix, blocks, head, root, kind."""
    pipe = deepspeed_pipe()
    root: nn.Module
    if isinstance(model, nn.Sequential):
        root, funcs, kind = model, list(model.children()), "sequential"
    elif pipe is not None and isinstance(model, pipe.PipelineModule):
        root, funcs, kind = model, _pipeline_funcs(model), "pipeline"
        loss_fn = loss_fn if loss_fn is not None else model.loss_fn
    else:
        root, funcs = _spec_funcs(model)
        kind = "layer_specs"
    if loss_fn is None:
        raise ValueError(
            f"a {kind} model needs loss_fn (called as loss_fn(outputs, labels)), e.g. "
            "to_layers(model, loss_fn=torch.nn.functional.cross_entropy)"
        )
    if not funcs:
        raise ValueError(f"the {kind} model has no layers")
    if len(funcs) == 1:
        # one layer: it is the one block (the planner cuts blocks), and the head only applies
        # loss_fn to its output
        return InputPrefix(), [_block(funcs[0])], LossHead(_identity(), loss_fn), root, kind
    blocks: list[nn.Module] = [_block(f) for f in funcs[:-1]]
    return InputPrefix(), blocks, LossHead(_block(funcs[-1]), loss_fn), root, kind


def _pass(x: Any) -> Any:
    return x


def _identity() -> FunctionBlock:
    """A parameterless layer handing its input on (the head of a one-layer model)."""
    return FunctionBlock(None, forward_fn=_pass)
