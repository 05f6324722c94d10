"""The layer-sequence types every model adapter produces: ``State``, ``HeadModule``,
``LayerSequence``, and ``batch_to_dict``.

A model becomes prefix -> blocks -> head. Values crossing a boundary are a ``State`` dict of
tensors; only "hidden" and "hidden.<name>" carry gradient, every other key passes through
unchanged. The modules are the user's own (or thin wrappers holding references to them):
parameters are shared, never copied.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "State",
    "HeadModule",
    "LayerSequence",
    "batch_to_dict",
    "grad_key",
    "grad_keys",
    "structural_copy",
    "writable",
]

State = dict[str, torch.Tensor]


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def grad_key(name: str, value: Any) -> str:
    """The state key for ``value`` named ``name``: "hidden.<name>" when it is a floating tensor
    (it carries gradient between stages), else ``name``."""
    return f"hidden.{name}" if _floating(value) else name


def grad_keys(state: Mapping[str, Any]) -> list[str]:
    """The keys of ``state`` that carry gradient between stages: "hidden" and "hidden.<name>"
    holding a floating tensor; every other key passes through."""
    return [
        k for k, v in state.items() if (k == "hidden" or k.startswith("hidden.")) and _floating(v)
    ]


class _Handover(torch.autograd.Function):
    """The identity, as an autograd node: its output is a new tensor object over the input's
    storage (``detach``: no copy, not a view in autograd's sense) whose ``grad_fn`` is this
    node, which passes the gradient through to the input unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # noqa: ARG004 - autograd's API
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return grad


def writable(leaf: torch.Tensor) -> torch.Tensor:
    """What the user's code gets in place of ``leaf``, a tensor that collects a gradient for us
    (a stage's input across a cut, an output the caller's loss is differentiated through): the
    same values, and ``leaf.grad`` (or ``autograd.grad(..., leaf)``) is still d(loss)/d(leaf).

    Autograd refuses in-place ops on a leaf that requires grad, and on a view of one, so the
    leaf itself, ``leaf.view_as(leaf)`` or ``leaf[...]`` would break an ``nn.ReLU(inplace=True)``
    or Hugging Face's ``loss *= scale``, which DeepSpeed's ordinary tensors allow. ``clone()`` or
    ``leaf * 1`` would work but copy the tensor (a stage's whole input, every micro-batch:
    ~15 ms for 4M fp32 elements on a CPU core); this node costs ~5 us whatever the size. An
    in-place op on the result writes the leaf's storage too: our callers read only the leaf's
    gradient afterwards, never its values."""
    if not leaf.requires_grad:
        return leaf
    out: torch.Tensor = _Handover.apply(leaf)
    return out


class HeadModule(nn.Module):
    """The last stage: output layer(s) + loss.

    ``forward(state) -> loss`` is the plain autograd path (evaluation, references).
    ``forward_backward(state, *, grad_scale)`` runs forward, loss and backward together: parameter
    gradients (scaled by ``grad_scale``) accumulate into this module's parameters' ``.grad`` and
    the gradient with respect to ``state["hidden"]`` is returned (a tensor, or a dict holding
    the gradient of each "hidden" / "hidden.<name>" key that received one), so the head stage
    never needs a recomputation. The returned loss is detached and unscaled.

    A head with ``token_stats = True`` also accepts ``stats=<dict>`` in both methods and fills it
    with per-token statistics (see ``CausalLMHead``); the executor asks only such heads.
    """

    token_stats = False

    def forward(self, state: State) -> torch.Tensor:
        raise NotImplementedError

    def forward_backward(
        self, state: State, *, grad_scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor | State]:
        raise NotImplementedError


def _add_flat(out: dict[str, Any], key: str, value: Any) -> None:
    # A tuple of tensors becomes key, key.1, key.2, ... (sequential._gather reverses it).
    if isinstance(value, tuple | list):
        if not value:
            raise ValueError(f"batch {key!r} is an empty {type(value).__name__}")
        for i, item in enumerate(value):
            out[key if i == 0 else f"{key}.{i}"] = item
    else:
        out[key] = value


def batch_to_dict(batch: Any) -> dict[str, Any]:
    """Normalise a training batch to a dict.

    Mappings (Hugging Face style, e.g. ``{"input_ids", "attention_mask", "labels"}``) pass through
    as a new dict. An ``(inputs, labels)`` pair (the DeepSpeed pipeline convention) becomes
    ``{"input": inputs, "labels": labels}``; a tuple of inputs or labels is flattened to
    ``"input", "input.1", ...`` / ``"labels", "labels.1", ...``.
    """
    if isinstance(batch, Mapping):
        return dict(batch)
    if isinstance(batch, tuple | list) and len(batch) == 2:
        out: dict[str, Any] = {}
        _add_flat(out, "input", batch[0])
        _add_flat(out, "labels", batch[1])
        return out
    raise TypeError(
        f"cannot interpret a batch of type {type(batch).__name__}: expected a dict of tensors "
        "(Hugging Face style) or an (inputs, labels) pair"
    )


@dataclass(frozen=True, eq=False)  # identity semantics: it holds live modules
class LayerSequence:
    """A model cut into ``prefix`` -> ``blocks`` (the L layers the planner cuts) -> ``head``.

    ``root`` is the module the parameter names refer to: the user's model, or for a list of
    DeepSpeed ``LayerSpec`` the module built from it (so its parameters can be handed to an
    optimizer). ``kind`` says which adapter built it (e.g. "hf:qwen3", "sequential", "pipeline").
    """

    prefix: nn.Module | None
    blocks: list[nn.Module]
    head: HeadModule
    root: nn.Module
    kind: str
    # how the layers were made and why (model/module.py's Layering; None: a recognised shape)
    layering: Any = None
    # called as ``check(seq, batch)`` with each micro-batch dict before it runs; checks the
    # first one (a family whose head was guessed: hf_families.FirstBatchCheck), None: nothing
    first_batch_check: Any = None

    @property
    def returns_outputs(self) -> bool:
        """Whether the head hands the model's outputs to the caller (a module model), whose
        loss then seeds the backward, instead of computing the loss itself."""
        return bool(getattr(self.head, "returns_outputs", False))

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def modules(self) -> Iterator[nn.Module]:
        """Every layer in execution order: prefix (if any), blocks..., head."""
        if self.prefix is not None:
            yield self.prefix
        yield from self.blocks
        yield self.head

    def run_reference(self, batch: Any) -> torch.Tensor:
        """prefix -> blocks -> head under ordinary autograd; returns the loss (for tests)."""
        state = batch_to_dict(batch)
        if self.prefix is not None:
            state = self.prefix(state)
        for block in self.blocks:
            state = block(state)
        return self.head(state)

    def named_parameters_by_layer(self) -> list[list[tuple[str, nn.Parameter]]]:
        """Per layer (order of :meth:`modules`), its parameters named as in
        ``root.named_parameters()``. A shared parameter (tied embeddings) is listed in every layer
        that uses it, under the same name; compare by identity to find it."""
        names = {id(p): name for name, p in self.root.named_parameters()}
        return [_named(layer.parameters(), names, "parameter") for layer in self.modules()]

    def buffers_by_layer(self) -> list[list[tuple[str, torch.Tensor]]]:
        """Like :meth:`named_parameters_by_layer` for buffers (rotary ``inv_freq`` sits with the
        prefix)."""
        names = {id(b): name for name, b in self.root.named_buffers()}
        return [_named(layer.buffers(), names, "buffer") for layer in self.modules()]


def _named(tensors: Iterator[Any], names: dict[int, str], what: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for t in tensors:  # Module.parameters()/buffers() already drop duplicates within a layer
        name = names.get(id(t))
        if name is None:
            raise ValueError(f"a {what} of shape {tuple(t.shape)} is not part of the root model")
        out.append((name, t))
    return out


def structural_copy(module: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    """A copy of ``module``'s tree in which every submodule is ``copy.copy``-ed with its own
    ``_parameters`` / ``_buffers`` / ``_modules`` dicts holding the same tensors: assigning into
    the copy leaves the original untouched, and nothing is copied but the containers. ``memo``
    (id of an original -> its copy) keeps a submodule reused in two places one object; an entry
    put there beforehand replaces that submodule in the copy (hf_capture's stand-ins)."""
    if id(module) in memo:
        return memo[id(module)]
    clone = copy.copy(module)
    memo[id(module)] = clone
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    clone._modules = {
        name: (None if child is None else structural_copy(child, memo))
        for name, child in module._modules.items()
    }
    return clone
