"""Plain ``nn.Module`` test models (no Hugging Face, no pipeline specs) in the shapes DeepSpeed's
own unit tests train, for issue 29 (``rp_engine.initialize`` accepting any module).

Each builder is deterministic from its ``seed`` (it seeds the global RNG, then builds on CPU in
fp32, in training mode). Each model comes with a batch maker, deterministic from its ``seed``
(a private generator: the global RNG is left alone), whose targets are a fixed function of the
inputs (frozen class prototypes plus noise, or a frozen token permutation), so a few optimizer
steps visibly lower the loss even though every micro-batch is new data.

How the loss is computed differs per model, as it does in user code; :data:`MODELS` records it:

============== ======================== ================== =====================================
name            builder                  engine inputs      loss from the engine's output
============== ======================== ================== =====================================
linear_1        linear_stack(1)          (x, y)             the output (forward returns the loss)
linear_4        linear_stack(4)          (x, y)             the output
linear_4_unused linear_stack(4, unused)  (x, y)             the output
two_losses      two_losses               (x, y)             ``l1 + l2`` of the returned pair,
                                                            summed OUTSIDE the model
small_cnn       small_cnn                (x,)               ``F.cross_entropy(logits, y)``
                                                            (an external criterion)
tied            tied_model               (tokens, labels)   the output
============== ======================== ================== =====================================

A training loop over a case therefore reads (see tests/support/ds_module_reference.py)::

    case = MODELS[name]
    model = case.build(seed)
    for batch in make_batches(name, n):
        out = engine(*case.inputs(batch))
        loss = case.loss(out, batch)
        engine.backward(loss)
        engine.step()
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "HIDDEN",
    "MODELS",
    "ModuleCase",
    "LinearStack",
    "TwoLosses",
    "SmallCNN",
    "TiedModel",
    "linear_stack",
    "two_losses",
    "small_cnn",
    "tied_model",
    "make_batches",
]

HIDDEN = 16  # width of the linear / two-loss / tied models (DeepSpeed's unit tests use 10-16)
CNN_CHANNELS, CNN_SIDE, CNN_CLASSES = 3, 8, 10
VOCAB, SEQ = 32, 8  # the tied model's token vocabulary and sequence length
TEACHER_SEED = 12345  # the frozen map from inputs to targets, shared by every batch

Batch = tuple[torch.Tensor, ...]


# ---------------------------------------------------------------------------------------------
# models


class LinearStack(nn.Module):
    """``n_layers`` Linear(hidden, hidden) in ``self.linears`` (an nn.ModuleList), applied in
    order; ``forward(x, y)`` returns ``F.cross_entropy(h, y)`` over ``hidden`` classes. With
    ``unused_layer`` there is also ``self.unused`` (a Linear that forward never calls: its
    parameters never get a gradient, like DeepSpeed's "empty grad" test model)."""

    def __init__(self, n_layers: int, hidden: int, *, unused_layer: bool) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(n_layers)])
        self.unused = nn.Linear(hidden, hidden) if unused_layer else None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.linears:
            h = layer(h)
        return F.cross_entropy(h, y)


class TwoLosses(nn.Module):
    """A shared trunk (``self.trunk``: ModuleList of Linear+ReLU) and two heads;
    ``forward(x, y)`` returns ``(l1, l2)``: head_a's cross-entropy against ``y`` and head_b's
    against ``y % 4`` (a coarser label). The model does not add them: the training loop does
    (``loss = l1 + l2``), as with DeepSpeed's multi-output test model."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.trunk = nn.ModuleList(
            [nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(2)]
        )
        self.head_a = nn.Linear(hidden, hidden)
        self.head_b = nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x
        for block in self.trunk:
            h = block(h)
        return F.cross_entropy(self.head_a(h), y), F.cross_entropy(self.head_b(h), y % 4)


class SmallCNN(nn.Module):
    """conv(3->8, 3x3, pad 1) -> ReLU -> 2x2 max-pool -> flatten -> Linear(8*4*4, 10); no
    repeated block. ``forward(x)`` takes (B, 3, 8, 8) images and returns (B, 10) logits; the
    loss is an external criterion: ``F.cross_entropy(engine(x), y)``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(CNN_CHANNELS, 8, kernel_size=3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * (CNN_SIDE // 2) ** 2, CNN_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(F.relu(self.conv(x)))
        return self.fc(torch.flatten(h, 1))  # type: ignore[no-any-return]


class TiedModel(nn.Module):
    """A token model whose input embedding and output projection share ONE weight, with a
    ModuleList of blocks between them (so the two users of the weight are not adjacent):
    ``self.embed`` (Embedding(vocab, hidden)) -> ``self.blocks`` (2 x Linear+Tanh) ->
    ``self.out`` (Linear(hidden, vocab, bias=False), ``self.out.weight is self.embed.weight``).
    ``forward(tokens, labels)`` takes (B, T) longs and returns the token cross-entropy."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(2)]
        )
        self.out = nn.Linear(hidden, vocab, bias=False)
        self.out.weight = self.embed.weight  # the tie: one Parameter, two modules

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        logits = self.out(h)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def linear_stack(
    n_layers: int, hidden: int = HIDDEN, *, unused_layer: bool = False, seed: int
) -> LinearStack:
    """:class:`LinearStack` seeded with ``seed`` (``n_layers`` is 1 or 4 in the tests)."""
    torch.manual_seed(seed)
    return LinearStack(n_layers, hidden, unused_layer=unused_layer).train()


def two_losses(seed: int) -> TwoLosses:
    """:class:`TwoLosses` seeded with ``seed``; train on ``l1 + l2`` of its output."""
    torch.manual_seed(seed)
    return TwoLosses(HIDDEN).train()


def small_cnn(seed: int) -> SmallCNN:
    """:class:`SmallCNN` seeded with ``seed``; train on ``F.cross_entropy(output, y)``."""
    torch.manual_seed(seed)
    return SmallCNN().train()


def tied_model(seed: int) -> TiedModel:
    """:class:`TiedModel` seeded with ``seed`` (embedding and output projection tied)."""
    torch.manual_seed(seed)
    return TiedModel(VOCAB, HIDDEN).train()


# ---------------------------------------------------------------------------------------------
# batches: each label drawn at random, each input its label's fixed prototype plus noise (the
# prototypes are frozen and shared by every batch, so the task is learnable across batches)


@functools.cache
def _prototypes(classes: int, *shape: int) -> torch.Tensor:
    """A fixed (classes, *shape) random tensor: the noiseless input of each class."""
    gen = torch.Generator().manual_seed(TEACHER_SEED)
    return torch.randn(classes, *shape, generator=gen)


def vector_batch(seed: int, batch: int = 4) -> Batch:
    """(x (batch, HIDDEN) float, y (batch,) long in [0, HIDDEN)) for the linear and two-loss
    models."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, HIDDEN, (batch,), generator=gen)
    x = _prototypes(HIDDEN, HIDDEN)[y] + 0.5 * torch.randn(batch, HIDDEN, generator=gen)
    return x, y


def image_batch(seed: int, batch: int = 4) -> Batch:
    """(x (batch, 3, 8, 8) float, y (batch,) long in [0, 10)) for :func:`small_cnn`."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CNN_CLASSES, (batch,), generator=gen)
    shape = (CNN_CHANNELS, CNN_SIDE, CNN_SIDE)
    x = _prototypes(CNN_CLASSES, *shape)[y] + 0.5 * torch.randn(batch, *shape, generator=gen)
    return x, y


def token_batch(seed: int, batch: int = 4) -> Batch:
    """(tokens (batch, SEQ) long, labels (batch, SEQ) long) for :func:`tied_model`; each label
    is a fixed permutation of its token (a learnable token-to-token map)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(TEACHER_SEED))
    return tokens, perm[tokens]


# ---------------------------------------------------------------------------------------------
# the table


def _loss_is_output(out: torch.Tensor, batch: Batch) -> torch.Tensor:
    return out


def _sum_of_pair(out: tuple[torch.Tensor, torch.Tensor], batch: Batch) -> torch.Tensor:
    l1, l2 = out
    return l1 + l2


def _external_cross_entropy(out: torch.Tensor, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(out, batch[1])


def _all(batch: Batch) -> Batch:
    return batch


def _inputs_only(batch: Batch) -> Batch:
    return batch[:1]


class ModuleCase(NamedTuple):
    """How to train one model of :data:`MODELS`.

    - ``build(seed) -> nn.Module``: the model, deterministic from ``seed``.
    - ``batch(seed, batch_size) -> tuple of tensors``: one micro-batch, deterministic.
    - ``inputs(batch) -> tuple``: the positional arguments of ``engine(...)``.
    - ``loss(output, batch) -> scalar tensor``: the loss to pass to ``engine.backward``.
    """

    build: Callable[[int], nn.Module]
    batch: Callable[..., Batch]
    inputs: Callable[[Batch], Batch]
    loss: Callable[[Any, Batch], torch.Tensor]


MODELS: dict[str, ModuleCase] = {
    "linear_1": ModuleCase(
        lambda seed: linear_stack(1, seed=seed), vector_batch, _all, _loss_is_output
    ),
    "linear_4": ModuleCase(
        lambda seed: linear_stack(4, seed=seed), vector_batch, _all, _loss_is_output
    ),
    "linear_4_unused": ModuleCase(
        lambda seed: linear_stack(4, unused_layer=True, seed=seed),
        vector_batch,
        _all,
        _loss_is_output,
    ),
    "two_losses": ModuleCase(two_losses, vector_batch, _all, _sum_of_pair),
    "small_cnn": ModuleCase(small_cnn, image_batch, _inputs_only, _external_cross_entropy),
    "tied": ModuleCase(tied_model, token_batch, _all, _loss_is_output),
}


def make_batches(name: str, n: int, *, batch_size: int = 8, seed: int = 100) -> list[Batch]:
    """``n`` micro-batches for model ``name``; micro-batch ``i`` is seeded ``seed + i`` (so a
    longer run starts with a shorter run's batches)."""
    make = MODELS[name].batch
    return [make(seed + i, batch_size) for i in range(n)]
