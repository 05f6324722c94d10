"""Any nn.Module through the engine (issue 29): traced pieces (b) and the whole module (c), the
caller's own loss, forward without backward, evaluation, and the two bugs the DeepSpeed-test
rewrap found (a one-layer Sequential, a parameterless first layer).

References are plain PyTorch (engine_helpers.reference_losses: AdamW, staleness 0 or 1); the
comparison with real DeepSpeed ZeRO-3 is in tests/interop/test_module_parity.py. Adam divides a
constant factor of the gradient out, so every training comparison also checks each step's
``get_global_grad_norm()`` against the reference's norm (grad_scale.py), and one case clips
below the norm and one trains with SGD, whose weights see the gradient's scale.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import (
    assert_close_named,
    assert_same_weights,
    config,
    engine_for,
    reference_losses,
    train_with_norms,
)
from grad_scale import StepNorms, sgd_reference
from torch import nn

from rp_engine.device.base import DeviceError

GAS, STEPS = 2, 3
NORM_RTOL = 1e-5  # fp32 gradients summed in another order: ~1e-7 of the norm


def adamw(lr: float = 1e-3) -> Callable[[Any], torch.optim.Optimizer]:
    """reference_losses' default optimizer, for ``StepNorms`` to wrap."""
    return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def assert_norms(got: list[float | None], want: list[float]) -> None:
    """Each step's ``get_global_grad_norm()`` is the reference's global gradient norm."""
    assert all(n is not None for n in got), got
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
        rtol=NORM_RTOL, atol=0.0,
    )  # fmt: skip


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Residual(nn.Module):
    """Repeated blocks with a skip connection, a batch-size int crossing the cuts, a weight
    read functionally in the last piece (tied to the first), and two outputs."""

    def __init__(self, width: int = 8, classes: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.inp(x)
        n = x.shape[0]
        for block in self.blocks:
            h = block(h) + h
        logits = self.out(h) + F.linear(h, self.inp.weight)[:, : self.out.out_features]
        return F.cross_entropy(logits, y), (h.pow(2).sum() / n) * 1e-2


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 3 * 3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.max_pool2d(torch.relu(self.conv(x)), 2).flatten(1))


def residual_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 8, generator=g), torch.randint(0, 8, (4,), generator=g)) for _ in range(n)
    ]


def cnn_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g))
        for _ in range(n)
    ]


def residual_loss(out: Any, _batch: Any) -> torch.Tensor:
    return out[0] + out[1]


def cnn_loss(out: Any, batch: Any) -> torch.Tensor:
    return F.cross_entropy(out, batch[1])


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[int], list[Any]], Any, bool, str]] = {
    # name: (model, batches, loss from (outputs, batch), forward takes (x, y), strategy)
    "residual": (Residual, residual_batches, residual_loss, True, "traced"),
    "cnn": (SmallCNN, cnn_batches, cnn_loss, False, "whole_module"),
}


def call(engine_or_model: Any, batch: Any, takes_labels: bool) -> Any:
    x, y = batch
    return engine_or_model(x, y) if takes_labels else engine_or_model(x)


def train_imperative(
    engine: Any, batches: list[Any], loss_of: Any, takes_labels: bool, *,
    extra_forward_at: int | None = None, norms: list[float | None] | None = None,
) -> list[float]:  # fmt: skip
    """DeepSpeed's loop; per-step mean of the caller's losses (and each step's
    ``get_global_grad_norm()`` appended to ``norms`` when given)."""
    losses: list[float] = []
    total = 0.0
    for i, batch in enumerate(batches):
        if i == extra_forward_at:  # a training-mode forward whose loss is only logged
            float(loss_of(call(engine, batch, takes_labels), batch))
        loss = loss_of(call(engine, batch, takes_labels), batch)
        engine.backward(loss)
        engine.step()
        total += float(loss)
        if (i + 1) % GAS == 0:
            losses.append(total / GAS)
            total = 0.0
            if norms is not None:
                norms.append(engine.get_global_grad_norm())
    return losses


@pytest.mark.parametrize("async_optimizer", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", list(CASES))
def test_module_model_matches_pytorch(name: str, async_optimizer: bool) -> None:
    build, make_batches, loss_of, takes_labels, strategy = CASES[name]
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    batches = make_batches(GAS * STEPS)
    engine = engine_for(model, config(devices=2, gas=GAS, async_optimizer=async_optimizer))
    norms: list[float | None] = []
    try:
        assert engine.layering.strategy == strategy, engine.layering
        got = train_imperative(engine, batches, loss_of, takes_labels, norms=norms)
        engine.synchronize()
    finally:
        engine.destroy()
    reference = StepNorms(adamw())
    want = reference_losses(
        ref, batches, steps=STEPS, gas=GAS, staleness=1 if async_optimizer else 0,
        loss_of=lambda m, b: loss_of(call(m, b, takes_labels), b), make_optimizer=reference,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_norms(norms, reference.norms)
    assert_same_weights(model, ref)


CLIP = 0.5  # below every step's gradient norm in these runs (1.07-2.2): each step is clipped


@pytest.mark.parametrize("optimizer", ["adamw-clipped", "sgd"])
@pytest.mark.parametrize("name", list(CASES))
def test_module_model_gradient_scale(name: str, optimizer: str) -> None:
    """The gradient's scale, which Adam alone would hide: AdamW clipped below the norm (the
    clip coefficient is the reference's only if the norm is) and SGD with momentum (its steps
    are the gradient's own size), each against plain PyTorch: losses, norms and weights."""
    build, make_batches, loss_of, takes_labels, _ = CASES[name]
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    batches = make_batches(GAS * STEPS)
    sgd = {"lr": 0.1, "momentum": 0.9}
    cfg = config(devices=2, gas=GAS, clip=0.0 if optimizer == "sgd" else CLIP)
    if optimizer == "sgd":
        cfg["optimizer"] = {"type": "SGD", "params": sgd}
    engine = engine_for(model, cfg)
    norms: list[float | None] = []
    try:
        got = train_imperative(engine, batches, loss_of, takes_labels, norms=norms)
        engine.synchronize()
    finally:
        engine.destroy()

    def ref_loss(m: nn.Module, b: Any) -> torch.Tensor:
        return loss_of(call(m, b, takes_labels), b)  # type: ignore[no-any-return]

    if optimizer == "sgd":
        want, want_norms = sgd_reference(
            ref, batches, steps=STEPS, gas=GAS, **sgd, loss_of=ref_loss
        )
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert_close_named(p, q, n, rtol=1e-5, atol=1e-6)
    else:
        reference = StepNorms(adamw(), clip=CLIP)
        want = reference_losses(
            ref, batches, steps=STEPS, gas=GAS, loss_of=ref_loss, make_optimizer=reference
        )
        want_norms = reference.norms
        assert min(want_norms) > CLIP
        assert_same_weights(model, ref)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_norms(norms, want_norms)


@pytest.mark.parametrize("name", list(CASES))
def test_forward_without_backward_then_a_step(name: str) -> None:
    """DeepSpeed allows a training-mode forward with no backward (logging a loss): the next
    step's losses and weights are as if it never ran."""
    build, make_batches, loss_of, takes_labels, _ = CASES[name]
    torch.manual_seed(0)
    model = build()
    twin = copy.deepcopy(model)
    batches = make_batches(GAS * 2)
    runs = []
    for m, extra in ((model, None), (twin, 1)):
        engine = engine_for(m, config(devices=2, gas=GAS))
        try:
            runs.append(
                train_imperative(engine, batches, loss_of, takes_labels, extra_forward_at=extra)
            )
            engine.synchronize()
        finally:
            engine.destroy()
    # not bit for bit: a tied weight's contributions from two stages on two devices are added
    # on the host in the order their downloads land
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-6, atol=1e-6)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_forward_without_backward_on_a_sequential_model() -> None:
    """The same for a model whose loss is computed in the pipeline's fused head (its carry
    holds device gradients, which the next forward releases)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    model.loss_fn = F.cross_entropy  # type: ignore[assignment]
    twin = copy.deepcopy(model)
    batches = residual_batches(GAS * 2)
    runs = []
    for m, extra in ((model, None), (twin, 2)):
        engine = engine_for(m, config(devices=2, gas=GAS))
        try:
            runs.append(
                train_imperative(engine, batches, lambda o, b: o, True, extra_forward_at=extra)
            )
            engine.synchronize()
        finally:
            engine.destroy()
    assert runs[0] == runs[1]
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", list(CASES))
def test_evaluation_returns_the_models_outputs(name: str) -> None:
    build, make_batches, _, takes_labels, _ = CASES[name]
    torch.manual_seed(0)
    model = build()
    batch = make_batches(1)[0]
    want = call(model, batch, takes_labels)
    engine = engine_for(model, config(devices=2, gas=GAS))
    try:
        engine.eval()
        got = call(engine, batch, takes_labels)
        with torch.no_grad():
            engine.train()
            also = call(engine, batch, takes_labels)
    finally:
        engine.destroy()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, check_layout=False)
    torch.testing.assert_close(also, want, rtol=1e-6, atol=1e-7)
    assert type(got) is type(want)


class LossModel(nn.Module):
    """DeepSpeed's test shape: Linear layers in a ModuleList, forward(x, y) -> one loss."""

    def __init__(self, layers: int, width: int = 8) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for linear in self.linears:
            x = linear(x)
        return F.cross_entropy(x, y)


def test_train_batch_runs_a_model_that_returns_its_loss() -> None:
    """train_batch (all GAS micro-batches in one schedule) works for a model returning one
    scalar loss; a model returning several outputs is told to use DeepSpeed's loop."""
    torch.manual_seed(0)
    model = LossModel(4)
    ref = copy.deepcopy(model)
    batches = residual_batches(GAS * STEPS)
    engine = engine_for(model, config(devices=2, gas=GAS))
    try:
        assert engine.layering.strategy == "traced"
        got, norms = train_with_norms(engine, iter(batches), STEPS)
    finally:
        engine.destroy()
    reference = StepNorms(adamw())
    want = reference_losses(
        ref, batches, steps=STEPS, gas=GAS, loss_of=lambda m, b: m(*b), make_optimizer=reference
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_norms(norms, reference.norms)
    assert_same_weights(model, ref)

    engine = engine_for(Residual(), config(devices=2, gas=GAS))
    try:
        # found on the device running the head: a DeviceError whose cause is the ValueError
        with pytest.raises(DeviceError, match="one scalar loss") as info:
            engine.train_batch(iter(residual_batches(GAS)))
        assert isinstance(info.value.__cause__, ValueError)
    finally:
        engine.destroy()


class Branchy(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for linear in self.linears:
            x = linear(x) if x.sum() > 0 else -linear(x)
        return F.cross_entropy(x, y)


def test_strategy_choice_split_points_and_fallback() -> None:
    cfg = config(devices=2, gas=GAS)
    engine = engine_for(Branchy(), cfg)
    try:
        assert engine.layering.strategy == "whole_module"
        assert "cannot trace" in engine.layering.reason
        got = train_imperative(engine, residual_batches(GAS), lambda o, b: o, True)
        assert len(got) == 1
    finally:
        engine.destroy()
    engine = engine_for(LossModel(1), cfg)  # one layer: nothing repeated
    try:
        assert engine.layering.strategy == "whole_module"
        assert "no repeated" in engine.layering.reason
    finally:
        engine.destroy()
    engine = engine_for(LossModel(4), config(devices=2, gas=GAS, roundpipe={
        "split_points": ["linears.2"]}))  # fmt: skip
    try:
        assert engine.layering.strategy == "traced"
        assert engine.layering.split_points == ("linears.2",) and engine.seq.num_blocks == 2
    finally:
        engine.destroy()
    engine = engine_for(LossModel(4), config(devices=2, gas=GAS, roundpipe={
        "split_points": ["nowhere"]}))  # fmt: skip
    try:
        assert engine.layering.strategy == "whole_module"
        assert "nowhere" in engine.layering.reason
    finally:
        engine.destroy()
    with pytest.raises(ValueError, match="roundpipe.bwd_cuts .* must start with 0"):
        engine_for(LossModel(4), config(devices=2, gas=GAS, fwd_cuts=[2, 2], bwd_cuts=[2, 2]))


# --- the two bugs found by running DeepSpeed's tests over rp_engine ------------------------------
def _sequential_run(model: nn.Sequential, batches: list[Any] | None = None, **cfg: Any) -> None:
    """train_batch over a Sequential + loss_fn equals plain PyTorch (``batches``: the residual
    ones; ``cfg``: more of engine_helpers.config's arguments)."""
    model.loss_fn = F.cross_entropy  # type: ignore[assignment]
    ref = copy.deepcopy(model)
    batches = batches if batches is not None else residual_batches(GAS * STEPS)
    engine = engine_for(model, config(devices=2, gas=GAS, **cfg))
    try:
        got, norms = train_with_norms(engine, iter(batches), STEPS)
    finally:
        engine.destroy()
    reference = StepNorms(adamw())
    want = reference_losses(
        ref, batches, steps=STEPS, gas=GAS, loss_of=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
        make_optimizer=reference,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_norms(norms, reference.norms)
    assert_same_weights(model, ref)


def test_one_layer_sequential_trains() -> None:
    """Was IndexError in the planner: the one layer became the head and no block was left."""
    torch.manual_seed(0)
    _sequential_run(nn.Sequential(nn.Linear(8, 8)))


def test_parameterless_first_layer_trains() -> None:
    """Was DeviceError 'element 0 of tensors does not require grad': the first stage's output
    over the raw batch needs no gradient, and backward was called on it anyway."""
    torch.manual_seed(0)
    _sequential_run(nn.Sequential(nn.Identity(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)))


class _Pair(nn.Module):
    """(x, mask) -> (h, 2h): both tuple elements carry gradient to the next layer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        x, mask = inputs
        h = torch.tanh(self.linear(x)) * mask
        return h, h * 2


class _Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.linear(inputs[0] * inputs[1])


def test_second_tuple_element_carries_gradient_between_stages() -> None:
    """A tuple element after the first that requires grad was refused; it is now a
    "hidden.1" key whose gradient the runtime carries back like "hidden"'s."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    batches = [
        ((torch.randn(4, 8, generator=g), torch.ones(4, 8)), torch.randint(0, 8, (4,), generator=g))
        for _ in range(GAS * STEPS)
    ]
    _sequential_run(
        nn.Sequential(_Pair(), _Pair(), _Join()), batches, fwd_cuts=[1, 1], bwd_cuts=[0, 1, 1]
    )


def test_a_hugging_face_model_that_is_not_a_causal_lm_trains_whole() -> None:
    """A BERT classifier is no shape rp_engine pipelines and torch.fx cannot trace it: it trains
    as one layer (c), returning its own ModelOutput, with plain PyTorch's losses and weights."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    batches = [
        {"input_ids": torch.randint(0, 64, (2, 8), generator=g),
         "labels": torch.randint(0, 3, (2,), generator=g)}
        for _ in range(GAS * STEPS)
    ]  # fmt: skip
    engine = engine_for(model, config(devices=2, gas=GAS))
    norms = []
    try:
        assert engine.layering.strategy == "whole_module"
        assert "cannot trace" in engine.layering.reason
        got: list[float] = []
        for i, batch in enumerate(batches):
            out = engine(**batch)
            assert type(out).__name__ == "SequenceClassifierOutput"
            engine.backward(out.loss)
            engine.step()
            if i % GAS == 0:
                got.append(0.0)
            got[-1] += float(out.loss.detach()) / GAS
            if i % GAS == GAS - 1:
                norms.append(engine.get_global_grad_norm())
        engine.synchronize()
    finally:
        engine.destroy()
    reference = StepNorms(adamw())
    want = reference_losses(
        ref, batches, steps=STEPS, gas=GAS, loss_of=lambda m, b: m(**b).loss,
        make_optimizer=reference,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_norms(norms, reference.norms)
    assert_same_weights(model, ref)
