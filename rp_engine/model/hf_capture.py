"""Hugging Face models whose forward is not Llama-shaped, pipelined by running their own code.

GPT-2, GPT-J, GPT-NeoX, Falcon, BLOOM, OPT, Phi, Cohere, Gemma 3, BERT, RoBERTa... each computes
something different before its first block (learned or ALiBi positions, rotary per layer type,
OPT's ``project_in``, embedding layer norms, the extended attention mask of an encoder) and
passes its blocks different arguments. Rather than rewrite each family's prefix, the prefix runs
the family's own forward on a *shell* of the model:

    shell   a structural copy of the model (base.structural_copy: the user's parameters, never
            copied) whose blocks are recorders and whose head modules are stubs that must not run
    prefix  calls the shell with the batch's inputs; recorder i notes the arguments block i is
            called with and passes its hidden input on; the last one stops the forward (the final
            norm, the LM head and the loss never run in the prefix)
    blocks  block i calls the real layer with the arguments recorder i noted, ``hidden`` replaced
            by the state's; the output's first element is the new ``hidden``
    head    the family's final modules (norms, projections), its LM head, logit transforms, and
            a causal (labels shifted) or masked (labels as they are) cross-entropy, in token
            chunks (hf.CausalLMHead)

The noted arguments travel in the state: every distinct tensor once, under ``ctx.<j>``, and the
per-block call templates as one plain value (``ctx.calls``) that rides along uncopied. A noted
tensor that carries gradient (which would need a backward across the stage boundary) is refused.

Which modules are the head, and where the blocks are, is data (``hf_families.py``); a family that
is not listed gets them from its repeated block list and its output embeddings, and its first
batch is checked against ``model(**batch).loss`` (``check_first_batch``) before it trains.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from rp_engine.model.base import State, structural_copy

__all__ = ["CapturedBlock", "CapturedPrefix", "Template", "resolve", "submodule"]

CALLS_KEY = "ctx.calls"
_BATCH_SKIP = ("labels", "num_items_in_batch")


def submodule(root: nn.Module, path: str) -> Any:
    """``root.a.b.c`` for path "a.b.c" (None when an attribute on the way is None)."""
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


class _Ref:
    """A template leaf: the tensor stored in the state under ``key``."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key

    def __repr__(self) -> str:
        return f"_Ref({self.key!r})"


class _HiddenSlot:
    """A template leaf: the state's ``hidden``."""

    def __repr__(self) -> str:
        return "_HIDDEN"


_HIDDEN = _HiddenSlot()


@dataclass(frozen=True)
class Template:
    """One block's call: positional and keyword arguments whose leaves are constants,
    ``_Ref``s to state tensors or the hidden slot."""

    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]


def resolve(value: Any, state: State, hidden: torch.Tensor) -> Any:
    """A template (any pytree of leaves) with refs and the hidden slot filled in."""

    def fill(leaf: Any) -> Any:
        if leaf is _HIDDEN:
            return hidden
        return state[leaf.key] if isinstance(leaf, _Ref) else leaf

    return pytree.tree_map(fill, value)


class _Out(tuple):  # type: ignore[type-arg]
    """What a recorder returns: ``(hidden,)``. A loop that indexes its block's output
    (``outputs[0]``) gets the hidden tensor; one that keeps the output as the next hidden hands
    the next recorder this tuple, which unwraps it. Either way the recording is right."""


class _Recording(threading.local):
    """The calls noted by the recorders of the prefix now running on this thread (each device
    runs its stages on a thread of its own, and each has its own replica of the shell)."""

    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] | None = None


_RECORDING = _Recording()


class _Stop(Exception):
    """Raised by the last recorder: the rest of the forward (the head) is not the prefix's."""


class _Recorder(nn.Module):
    """Stands in for block ``index`` in the shell: notes its call, passes its hidden input on."""

    def __init__(self, index: int, last: bool) -> None:
        super().__init__()
        self.index = index
        self.last = last

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        calls = _RECORDING.calls
        if calls is None:
            raise RuntimeError("a captured block's recorder ran outside its prefix")
        if len(calls) != self.index:
            raise RuntimeError(
                f"block {self.index} was called after {len(calls)} blocks: the model's forward "
                "does not call its blocks once each, in order, so its stages cannot be captured"
            )
        calls.append((args, kwargs))
        if self.last:
            raise _Stop
        hidden = args[0] if args else kwargs["hidden_states"]
        return hidden if isinstance(hidden, _Out) else _Out((hidden,))


class _Unreached(nn.Module):
    """Stands in for a head module in the shell: the prefix stops before the head runs."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ARG002
        raise RuntimeError(
            f"the model's forward used {self.path!r} (a module of the head) before its last "
            "block: its stages cannot be captured"
        )


class CapturedPrefix(nn.Module):
    """batch -> state: {"hidden", "ctx.<j>"..., "ctx.calls", "labels"[, "num_items_in_batch"]}.

    Runs ``model``'s own forward on a shell whose ``blocks`` record their calls (module
    docstring). ``head_modules`` (with their paths, for messages) are stubbed out of the shell:
    their parameters belong to the head, unless the prefix uses them too (a tied embedding is
    the same Parameter under both)."""

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module],
        head_modules: Sequence[tuple[str, nn.Module]],
    ) -> None:
        super().__init__()
        n = len(blocks)
        swaps: dict[int, nn.Module] = {
            id(b): _Recorder(i, last=i == n - 1) for i, b in enumerate(blocks)
        }
        for path, module in head_modules:
            swaps.setdefault(id(module), _Unreached(path))
        self.shell = structural_copy(model, swaps)  # the stand-ins replace theirs
        self.num_blocks = n
        forward = inspect.signature(model.forward).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in forward.values())
        # the forward's own cache is off: the prefix runs once per micro-batch, nothing is kept
        self._fixed = {"use_cache": False} if takes_any or "use_cache" in forward else {}
        get_embeddings: Any = getattr(model, "get_input_embeddings", None)
        embed = get_embeddings() if callable(get_embeddings) else None
        # read by batch_checks.vocab_size; not a submodule of this layer (it is in the shell)
        object.__setattr__(self, "embed_tokens", embed)

    def forward(self, batch: dict[str, Any]) -> State:
        inputs = {k: v for k, v in batch.items() if k not in _BATCH_SKIP}
        if "input" in inputs:  # what an (inputs, labels) pair becomes in batch_to_dict
            inputs["input_ids"] = inputs.pop("input")
        calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        _RECORDING.calls = calls
        try:
            self.shell(**inputs, **self._fixed)
        except _Stop:
            pass
        finally:
            _RECORDING.calls = None
        if len(calls) != self.num_blocks:
            raise RuntimeError(
                f"the model's forward called {len(calls)} of its {self.num_blocks} blocks: its "
                "stages cannot be captured"
            )
        state = _state_of(calls)
        for key in _BATCH_SKIP:
            if batch.get(key) is not None:
                state[key] = torch.as_tensor(batch[key])
        return state


def _state_of(calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> State:
    """The recorded calls as a state: the first block's hidden input, each distinct tensor
    argument once, and the per-block templates."""
    state: dict[str, Any] = {}
    keys: dict[int, str] = {}

    def leaf(path: Any, value: Any, where: str) -> Any:
        if isinstance(value, _Out):  # the hidden state a recorder passed on
            return _HIDDEN
        if not isinstance(value, torch.Tensor):
            return value
        if value.requires_grad:
            raise NotImplementedError(
                f"{where}{pytree.keystr(path)} is a tensor that carries gradient; rp_engine "
                "passes only the hidden state's gradient between stages"
            )
        key = keys.get(id(value))
        if key is None:
            key = keys[id(value)] = f"ctx.{len(keys)}"
            state[key] = value
        return _Ref(key)

    templates = []
    for i, (args, kwargs) in enumerate(calls):
        if args:
            hidden, args = args[0], (_HIDDEN, *args[1:])
        else:  # the hidden state passed as ``hidden_states=``
            hidden, kwargs = kwargs.get("hidden_states"), {**kwargs, "hidden_states": _HIDDEN}
        if i == 0:
            if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point():
                raise NotImplementedError(
                    "the first block's first argument is not a floating tensor (the hidden "
                    f"state): got {type(hidden).__name__}"
                )
            state["hidden"] = hidden

        def note(path: Any, value: Any, i: int = i) -> Any:
            return leaf(path, value, f"block {i} argument ")

        args = pytree.tree_map_with_path(note, args)
        kwargs = pytree.tree_map_with_path(note, kwargs)
        templates.append(Template(tuple(args), tuple(kwargs.items())))
    state[CALLS_KEY] = tuple(templates)
    return state


class CapturedBlock(nn.Module):
    """Block ``index``: the real layer called as the model's forward called it (the recorded
    template), with the state's ``hidden``; its output's first element is the new hidden."""

    def __init__(self, layer: nn.Module, index: int) -> None:
        super().__init__()
        self.layer = layer
        self.index = index

    def forward(self, state: State) -> State:
        calls: Any = state[CALLS_KEY]  # a plain value riding in the state (module docstring)
        template: Template = calls[self.index]
        hidden = state["hidden"]
        args = resolve(template.args, state, hidden)
        kwargs = resolve(dict(template.kwargs), state, hidden)
        out = self.layer(*args, **kwargs)
        if isinstance(out, tuple | list):
            out = out[0]
        new = dict(state)
        new["hidden"] = out
        return new
