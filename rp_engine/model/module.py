"""Any ``nn.Module`` as layers: strategy (b), traced stages, and strategy (c), the whole module.

DeepSpeed users hand ``initialize`` the models they write: ``forward(x, y)`` returning a loss, a
tuple of losses, or logits for a criterion computed outside (``loss = criterion(engine(x), y)``).
RoundPipe needs a sequence of layers; this module makes one without the user writing it:

* (b) **traced**: ``torch.fx`` traces the module symbolically (no example inputs needed, so it
  runs at ``initialize``) and ``split_module`` cuts the graph before each child of its largest
  repeated ``nn.ModuleList`` / ``nn.Sequential`` (or before the modules named in
  ``roundpipe.split_points``). Each piece is a block; the user's parameters are shared, never
  copied (the pieces hold the user's own submodules and tensors).
* (c) **whole module**: one block that calls the model. No pipelining, but weights stay on the
  host, with DeepSpeed's CPU Adam, sync or async; through ``train_batch`` they go up once per
  slot and step (DeepSpeed's imperative loop runs each forward at once, since the caller's
  criterion needs the outputs, so there the forward weights go up per micro-batch; the
  window's backwards run as one schedule at its boundary).

Both end in :class:`OutputHead`, a parameterless head that hands the model's outputs back to the
caller instead of computing a loss: ``engine.backward(loss)`` differentiates the caller's loss
with respect to those outputs and the backward stages start from that gradient. So the head
stage holds no block (``ModelShape.head_alone``).

State keys (transfer.py's convention): the call's arguments are ``arg.<i>`` / ``kw.<name>``;
a traced value crossing a cut is ``hidden.v.<node>`` when it is a floating tensor (it carries
gradient) and ``v.<node>`` otherwise (int tensors, Python ints from ``x.shape``); the outputs
are ``hidden.out.<i>`` / ``out.<i>`` plus ``out.spec``, their pytree structure. A container
holding tensors (``engine([x, y])``, ``engine({"a": x})``, a traced tuple crossing a cut: any
``torch.utils._pytree`` structure) is flattened, since only a state's top-level tensors move:
its key holds a :class:`Tree` (the structure, a plain value) and each leaf has a key of its
own, ``<key>.<j>`` (``hidden.``-prefixed for a floating leaf of a traced value). It is rebuilt
on the device, from the moved leaves, before the model sees it.

Why ``torch.fx`` and not ``torch.distributed.pipelining.pipeline()`` (torch.export): export
needs example inputs, which ``initialize`` does not have (the layers, host store and optimizer
are built there, before the first batch); fx traces with proxies and keeps every parameter the
user's object, which the host store, the optimizer handed back and checkpoints rely on.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from rp_engine.model.base import HeadModule, State, grad_key, grad_keys

__all__ = [
    "Layering",
    "OutputHead",
    "TracedStage",
    "Tree",
    "WholeModule",
    "module_batch",
    "module_layers",
    "output_leaves",
    "rebuild_outputs",
]

SPEC_KEY = "out.spec"


@dataclass(frozen=True)
class Layering:
    """How ``initialize`` made layers of the model, and why (``engine.layering``).

    ``strategy``: "shape" (a model shape rp_engine knows: Hugging Face causal LM, nn.Sequential
    + loss_fn, PipelineModule, LayerSpec list), "traced" (b) or "whole_module" (c)."""

    strategy: str
    reason: str
    split_points: tuple[str, ...] = ()


# --- containers of tensors --------------------------------------------------------------------
@dataclass(frozen=True)
class Tree:
    """The structure of a flattened container (its leaves are under ``<key>.<j>``): a plain
    value in the state, riding along uncopied while the leaves move."""

    spec: pytree.TreeSpec


def _put(state: dict[str, Any], key: str, value: Any, *, traced: bool = False) -> None:
    """``state[key] = value``, a container holding tensors flattened (module docstring).
    ``traced``: a traced value, whose floating leaves carry gradient (``grad_key``)."""
    leaves, spec = pytree.tree_flatten(value)
    if spec.is_leaf() or not any(isinstance(v, torch.Tensor) for v in leaves):
        state[grad_key(key, value) if traced else key] = value
        return
    state[key] = Tree(spec)  # type: ignore[assignment]  # a plain value: rides along uncopied
    for j, leaf in enumerate(leaves):
        state[grad_key(f"{key}.{j}", leaf) if traced else f"{key}.{j}"] = leaf


def _get(state: State, key: str) -> Any:
    """The value ``_put`` stored under ``key``, a container rebuilt from its leaves; KeyError
    when there is none."""
    value: Any = state[key]
    if not isinstance(value, Tree):
        return value
    leaves = [
        state[f"hidden.{key}.{j}"] if f"hidden.{key}.{j}" in state else state[f"{key}.{j}"]
        for j in range(value.spec.num_leaves)
    ]
    return pytree.tree_unflatten(leaves, value.spec)


def _leaf_keys(state: State) -> set[str]:
    """The keys of the flattened containers' leaves (every other key is a value's own)."""
    return {
        name
        for key, value in state.items()
        if isinstance(value, Tree)
        for j in range(value.spec.num_leaves)
        for name in (f"{key}.{j}", f"hidden.{key}.{j}")
    }


# --- batches ----------------------------------------------------------------------------------
def module_batch(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments as a micro-batch state: ``arg.<i>`` and ``kw.<name>``, a container of
    tensors flattened into its leaves (``arg.<i>.<j>``), so each tensor moves to the device.
    Values are kept as given (DeepSpeed does not cast a module's inputs); non-tensors ride
    along uncopied. Inputs carry no gradient: no key is ``hidden``."""
    out: dict[str, Any] = {}
    for i, value in enumerate(inputs):
        _put(out, f"arg.{i}", value)
    for name, value in kwargs.items():
        _put(out, f"kw.{name}", value)
    return out


def _call_args(state: State) -> tuple[list[Any], dict[str, Any]]:
    """The call's positional and keyword arguments from its state, containers rebuilt."""
    leaves = _leaf_keys(state)
    roots = [k for k in state if _is_input(k) and k not in leaves]
    args = [_get(state, f"arg.{i}") for i in range(sum(k.startswith("arg.") for k in roots))]
    kwargs = {k[3:]: _get(state, k) for k in roots if k.startswith("kw.")}
    return args, kwargs


def _is_input(key: str) -> bool:
    return key.startswith(("arg.", "kw."))


# --- outputs ----------------------------------------------------------------------------------
def _pack_outputs(out: Any) -> State:
    """The model's return value as state keys + its structure under ``out.spec``."""
    leaves, spec = pytree.tree_flatten(out)
    state: State = {grad_key(f"out.{i}", v): v for i, v in enumerate(leaves)}
    state[SPEC_KEY] = spec  # type: ignore[assignment]  # a plain value: rides along uncopied
    return state


def output_leaves(outputs: State) -> list[tuple[str, Any]]:
    """(key, value) of each output leaf, in the structure's order."""
    spec: Any = outputs[SPEC_KEY]
    keys = [f"hidden.out.{i}" if f"hidden.out.{i}" in outputs else f"out.{i}" for i in
            range(spec.num_leaves)]  # fmt: skip
    return [(k, outputs[k]) for k in keys]


def rebuild_outputs(outputs: State, leaf: Callable[[str, Any], Any] | None = None) -> Any:
    """The model's return value from its packed outputs; ``leaf(key, value)`` maps each leaf
    (e.g. to a device tensor that collects the caller's gradient)."""
    values = [v if leaf is None else leaf(k, v) for k, v in output_leaves(outputs)]
    spec: Any = outputs[SPEC_KEY]
    return pytree.tree_unflatten(values, spec)


class OutputHead(HeadModule):
    """The head of a module model: no parameters, it hands the outputs to the caller
    (``returns_outputs``; the executor downloads them) and the caller's loss seeds backward.

    In ``train_batch`` (no caller between forward and backward) the model must return a scalar
    loss: :meth:`forward_backward` then differentiates that loss, as the fused heads do.
    Parameters the trace never reached (a layer ``forward`` does not use) live here, so every
    parameter has a layer; they receive no gradient, as under DeepSpeed."""

    returns_outputs = True

    def __init__(self, unused: Sequence[nn.Module] = ()) -> None:
        super().__init__()
        self.unused = nn.ModuleList(unused)

    @staticmethod
    def outputs(state: State) -> State:
        """The output keys of the last block's state."""
        return {k: v for k, v in state.items() if k.startswith(("out.", "hidden.out."))}

    @staticmethod
    def loss_of(outputs: State) -> torch.Tensor:
        """What the run reports as this micro-batch's loss: the first scalar floating output
        (a model returning its loss), else 0 (the caller's criterion is not known here)."""
        for _, v in output_leaves(outputs):
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() == 1:
                return v.detach().reshape(())
        return torch.zeros(())

    def forward(self, state: State) -> Any:
        """The model's return value (the plain autograd path: references, evaluation)."""
        return rebuild_outputs(self.outputs(state))

    def forward_backward(
        self, state: State, *, grad_scale: float = 1.0
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        outputs = self.outputs(state)
        leaves = output_leaves(outputs)
        floating = set(grad_keys(outputs))
        losses = [(k, v) for k, v in leaves if k in floating]
        if len(losses) != 1 or losses[0][1].numel() != 1:
            raise ValueError(
                "train_batch needs a model whose forward returns one scalar loss; this one "
                f"returns {len(leaves)} value(s). Train it with DeepSpeed's loop instead: "
                "loss = criterion(engine(...)); engine.backward(loss); engine.step()"
            )
        key, loss = losses[0]
        return loss.detach().reshape(()), {key: torch.full_like(loss, grad_scale)}


# --- (c): the whole module --------------------------------------------------------------------
class WholeModule(nn.Module):
    """Strategy (c): one block that calls the user's model on the call's arguments."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, state: State) -> State:
        args, kwargs = _call_args(state)
        return _pack_outputs(self.model(*args, **kwargs))


# --- (b): traced stages -----------------------------------------------------------------------
class TracedStage(nn.Module):
    """One piece of the traced graph: reads its inputs from the state, writes its outputs,
    hands on what later pieces need (``keep``) and, last, packs the model's outputs."""

    def __init__(
        self,
        stage: nn.Module,
        *,
        inputs: Sequence[str],
        outputs: Sequence[str],
        single: bool,
        keep: frozenset[str],
        signature: _Signature,
        attrs: dict[str, torch.Tensor] | None = None,
        result: Any = None,
    ) -> None:
        super().__init__()
        self.stage = stage
        # tensors the split graph reads by attribute and hands this piece as arguments (a tied
        # weight used functionally): registered here, so a device replica swaps them too
        self.attrs = nn.Module()
        self._attr_names = {}
        for i, (name, t) in enumerate((attrs or {}).items()):
            self._attr_names[name] = f"a{i}"
            if isinstance(t, nn.Parameter):
                self.attrs.register_parameter(f"a{i}", t)
            else:
                self.attrs.register_buffer(f"a{i}", t)
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.single = single  # the piece returns one value (not a tuple of them)
        self.keep = keep  # value names later pieces or the result read
        self.signature = signature
        self.result = result  # the last piece: the model's return value, leaves are names

    def forward(self, state: State) -> State:
        args = [self._value(state, name) for name in self.inputs]
        out = self.stage(*args)
        values = [out] if self.single else list(out)
        new: State = {k: v for k, v in state.items() if _is_input(k) or _name(k) in self.keep}
        for name, value in zip(self.outputs, values, strict=True):
            _put(new, f"v.{name}", value, traced=True)  # a tuple of tensors: each leaf moves
        if self.result is None:
            return new
        leaves, spec = self.result
        seen = {**state, **new}
        values = [self._value(seen, _arg_name(x)) if isinstance(x, fx.Node) else x for x in leaves]
        return _pack_outputs(pytree.tree_unflatten(values, spec))

    def _value(self, state: State, name: str) -> Any:
        attr = self._attr_names.get(name)
        if attr is not None:
            return getattr(self.attrs, attr)
        for key in (f"hidden.v.{name}", f"v.{name}"):
            if key in state:
                return _get(state, key)
        return self.signature.value(state, name)


def _name(key: str) -> str:
    """The traced value a key belongs to (a flattened container's leaves: the container's)."""
    return key.removeprefix("hidden.").removeprefix("v.").split(".", 1)[0]


@dataclass(frozen=True)
class _Signature:
    """Where a traced placeholder (a ``forward`` parameter) is found in a call's state."""

    positions: dict[str, int]
    defaults: dict[str, Any]

    @classmethod
    def of(cls, model: nn.Module) -> _Signature:
        params = list(inspect.signature(model.forward).parameters.values())
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        return cls(
            positions={p.name: i for i, p in enumerate(params) if p.kind in positional},
            defaults={p.name: p.default for p in params if p.default is not p.empty},
        )

    def value(self, state: State, name: str) -> Any:
        if f"kw.{name}" in state:
            return _get(state, f"kw.{name}")
        pos = self.positions.get(name)
        if pos is not None and f"arg.{pos}" in state:
            return _get(state, f"arg.{pos}")
        if name in self.defaults:
            return self.defaults[name]
        raise TypeError(f"the model's forward() is missing the argument {name!r}")


class TraceRefused(Exception):
    """The model cannot be traced or split (the reason is the message): use strategy (c)."""


def repeated_container(model: nn.Module) -> tuple[str, list[str]] | None:
    """The largest (by parameters) ``nn.ModuleList`` / ``nn.Sequential`` holding at least two
    children of one class with parameters: (its name, the names of its children that have
    parameters). None when the model has none."""
    best: tuple[int, str, list[str]] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        children = [(n, c) for n, c in module.named_children() if any(True for _ in c.parameters())]
        classes = [type(c) for _, c in children]
        if not any(classes.count(t) >= 2 for t in classes):
            continue
        size = sum(p.numel() for p in module.parameters())
        prefix = f"{name}." if name else ""
        if best is None or size > best[0]:
            best = (size, name, [prefix + n for n, _ in children])
    return None if best is None else (best[1], best[2])


def _node_module(node: fx.Node) -> str:
    """The deepest module a node was traced in ("" at the model's top level)."""
    if node.op in ("call_module", "get_attr"):
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] if isinstance(v, tuple) else str(k) for k, v in stack.items()]
    return paths[-1] if paths else ""


def _within(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def trace_stages(
    model: nn.Module, split_points: Sequence[str]
) -> tuple[list[TracedStage], list[nn.Module]]:
    """Strategy (b): the traced pieces of ``model``, cut before each module in ``split_points``
    (in execution order), and the modules whose parameters the trace never reached. Raises
    TraceRefused naming the reason when the model cannot be traced or cut so."""
    try:
        gm = fx.symbolic_trace(model)
    except Exception as e:  # noqa: BLE001 - any tracing failure means: use strategy (c)
        raise TraceRefused(f"torch.fx cannot trace it ({type(e).__name__}: {e})") from None
    points = list(split_points)
    names = dict(model.named_modules())
    missing = [p for p in points if p not in names]
    if missing:
        raise TraceRefused(f"split point(s) {missing} are not modules of the model")
    part: dict[fx.Node, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        path = _node_module(node)
        for i, point in enumerate(points[current:], start=current + 1):
            if path and _within(path, point):
                current = i
                break
        if path and any(_within(path, p) for p in points[: current - 1]) and node.op != "get_attr":
            raise TraceRefused(f"the graph returns to {path!r} after a later split point")
        part[node] = current
    if current != len(points):
        raise TraceRefused(f"the forward never runs split point {points[current]!r}")
    # a tied weight read through get_attr goes with its reader, not with where it is declared
    for node in list(part):
        if node.op == "get_attr" and node.users:
            part[node] = min(part[u] for u in node.users if u in part)
    split = split_module(gm, model, lambda n: part[n], keep_original_order=True)
    return _stages_of(split, model), _unreached(model, split)


def _stages_of(split: fx.GraphModule, model: nn.Module) -> list[TracedStage]:
    """Read the split graph's top level: per piece, its input and output value names."""
    signature = _Signature.of(model)
    calls = [n for n in split.graph.nodes if n.op == "call_module"]
    output = next(n for n in split.graph.nodes if n.op == "output")
    leaves, spec = pytree.tree_flatten(output.args[0])
    produced: dict[fx.Node, tuple[fx.Node, ...]] = {}
    for call in calls:
        users = list(call.users)
        if users and all(u.op == "call_function" and u.target.__name__ == "getitem" for u in users):
            produced[call] = tuple(sorted(users, key=lambda u: int(u.args[1])))  # type: ignore[arg-type]
        else:
            produced[call] = (call,)
    stages: list[TracedStage] = []
    for i, call in enumerate(calls):
        later = [
            a for c in calls[i + 1 :] for a in c.args
            if isinstance(a, fx.Node) and a.op != "get_attr"
        ]  # fmt: skip
        later += [x for x in leaves if isinstance(x, fx.Node)]
        single = produced[call] == (call,)
        attrs = {
            a.name: _fetch(split, str(a.target))
            for a in call.args
            if isinstance(a, fx.Node) and a.op == "get_attr"
        }
        stages.append(
            TracedStage(
                getattr(split, str(call.target)),
                inputs=[_arg_name(a) for a in call.args],
                outputs=[n.name for n in produced[call]],
                single=single,
                keep=frozenset(n.name for n in later),
                signature=signature,
                attrs=attrs,
                result=(leaves, spec) if i == len(calls) - 1 else None,
            )
        )
    return stages


def _fetch(module: nn.Module, target: str) -> torch.Tensor:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    if not isinstance(value, torch.Tensor):
        raise TraceRefused(f"the graph reads {target!r}, a {type(value).__name__}, by attribute")
    return value


def _arg_name(arg: Any) -> str:
    if not isinstance(arg, fx.Node):
        raise TraceRefused(f"a piece takes a constant argument ({arg!r})")
    return str(arg.target) if arg.op == "placeholder" else arg.name


def _unreached(model: nn.Module, split: nn.Module) -> list[nn.Module]:
    """The model's leaf-most modules holding parameters the split graph does not use."""
    used = {id(p) for p in split.parameters()}
    out: list[nn.Module] = []
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if own and not any(id(p) in used for p in own):
            out.append(module)
    return out


def module_layers(
    model: nn.Module, *, split_points: Sequence[str] | None = None
) -> tuple[list[nn.Module], OutputHead, Layering]:
    """Blocks and head for any module: traced pieces (b) when it has a repeated block or the
    config names split points, else (or when it cannot be traced) the whole module (c)."""
    if split_points:
        points, why = list(split_points), f"roundpipe.split_points {list(split_points)}"
    else:
        found = repeated_container(model)
        if found is None:
            reason = "no repeated nn.ModuleList / nn.Sequential block to split at"
            return _whole(model, reason)
        name, children = found
        points = children[1:]
        why = f"split before each child of its largest repeated block {name or '(root)'!r}"
    try:
        stages, unused = trace_stages(model, points)
    except TraceRefused as e:
        return _whole(model, f"not traced: {e}")
    layering = Layering("traced", f"{len(stages)} traced stages: {why}", tuple(points))
    return list(stages), OutputHead(unused), layering


def _whole(model: nn.Module, reason: str) -> tuple[list[nn.Module], OutputHead, Layering]:
    return [WholeModule(model)], OutputHead(), Layering("whole_module", reason)
