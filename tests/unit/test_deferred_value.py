"""Deferred values (rp_engine/engine/deferred.py): arithmetic is recorded, a read runs what the
value waits for (never a placeholder), and ``derivative`` gives d(expression)/d(leaf) without
the value exactly when the expression is affine in it, as autograd at the real value would."""

from __future__ import annotations

import math

import pytest
import torch

from rp_engine.engine.deferred import DeferredValue, Leaf, derivative, is_deferred, resolve


def _leaf(value: float, runs: list[int]) -> tuple[Leaf, DeferredValue]:
    placeholder = torch.full((), float("nan")).requires_grad_(True)

    def run() -> None:
        runs.append(1)
        leaf.set(torch.tensor(value))

    leaf = Leaf(run, placeholder)
    return leaf, DeferredValue(leaf, placeholder)


def test_arithmetic_is_recorded_and_metadata_answers_without_a_read() -> None:
    runs: list[int] = []
    _, x = _leaf(3.0, runs)
    y = (x * 0.5 - 1) / 4
    y *= 2  # in place on a deferred value: recorded too
    z = torch.isnan(y.detach().float())
    assert all(is_deferred(v) for v in (y, z))
    assert y.shape == () and y.dtype == torch.float32 and y.requires_grad and not y.is_leaf
    assert y.dim() == 0 and y.numel() == 1 and y.device.type == "cpu"
    assert runs == []  # nothing needed the value yet
    assert float(y) == pytest.approx((3.0 * 0.5 - 1) / 4 * 2)
    assert runs == [1] and not bool(z)
    assert not is_deferred(y) and float(y + 1) == pytest.approx(1.25)
    assert runs == [1]  # resolved once; ordinary tensors from here


@pytest.mark.parametrize(
    "read",
    [
        lambda v: v.item(),
        float,
        lambda v: f"{v:.3f}",
        repr,
        lambda v: v.tolist(),
        lambda v: v.numpy(),
        lambda v: bool(v > 0),
        lambda v: torch.zeros(()).add_(v),  # an ordinary tensor changed in place
    ],
    ids=["item", "float", "format", "repr", "tolist", "numpy", "bool", "in-place-on-real"],
)
def test_every_read_runs_the_queued_work_first(read) -> None:
    runs: list[int] = []
    _, x = _leaf(2.0, runs)
    value = read(x * 3)
    assert runs == [1]
    assert "nan" not in str(value).lower()


def test_a_failed_value_raises_when_read_and_never_shows_a_placeholder() -> None:
    leaf, x = _leaf(1.0, [])
    y = x + 1
    leaf.fail(RuntimeError("window lost"))
    with pytest.raises(RuntimeError, match="never computed"):
        float(y)


AFFINE = {
    "scale": (lambda v: v * 0.25, 0.25),
    "share-then-gas": (lambda v: v * 0.3 / 4, 0.3 / 4),
    "sum-with-constant": (lambda v: 2 * v - 1 + v, 3.0),
    "negate-and-divide": (lambda v: -v / 8, -0.125),
    "dtype-and-view": (lambda v: v.double().reshape(1).sum().float() * 2, 2.0),
    "detached": (lambda v: v.detach() * 5, 0.0),
    "in-place": (lambda v: v.clone().mul_(0.5), 0.5),
}


@pytest.mark.parametrize(("expr", "slope"), AFFINE.values(), ids=AFFINE.keys())
def test_affine_expressions_have_their_slope_without_the_value(expr, slope: float) -> None:
    runs: list[int] = []
    leaf, x = _leaf(7.0, runs)
    got = derivative(expr(x), leaf)
    assert got == pytest.approx(slope, rel=1e-12, abs=0)
    assert runs == []  # the slope needed no value
    assert derivative(expr(x), leaf, divide_by=4) == pytest.approx(slope / 4, rel=1e-12)


NONLINEAR = {
    "square": lambda v: v * v,
    "power": lambda v: v**2,
    "log": torch.log,
    "clamp": lambda v: v.clamp(max=10),
    "reciprocal": lambda v: 1 / v,
    "abs": torch.abs,
}


@pytest.mark.parametrize("expr", NONLINEAR.values(), ids=NONLINEAR.keys())
def test_other_expressions_need_the_value_and_then_match_autograd(expr) -> None:
    runs: list[int] = []
    leaf, x = _leaf(3.0, runs)
    value = expr(x)
    assert derivative(value, leaf) is None and runs == []
    at = resolve(x)  # the real value: now the derivative is autograd's there
    got = derivative(value, leaf, divide_by=2, at=at)
    real = torch.tensor(3.0, requires_grad=True)
    (want,) = torch.autograd.grad(expr(real) / 2, real)
    assert got is not None and math.isclose(got, float(want), rel_tol=1e-6)


def test_a_value_not_made_from_the_leaf_has_no_slope() -> None:
    leaf, x = _leaf(1.0, [])
    other_leaf, y = _leaf(2.0, [])
    assert derivative(torch.tensor(5.0), leaf) == 0.0
    assert derivative(y * 2, leaf) == 0.0
    assert derivative(x + y, leaf) == pytest.approx(1.0)  # affine: the other leaf's value
    assert derivative(x * y, leaf) is None  # a product of two deferred values: not affine


def test_the_factor_model_fits_trainer_and_deepspeed_windows() -> None:
    """A prefetched window's factors: Trainer's are each micro-batch's share of the window's
    tokens (k = 1), DeepSpeed's loop's 1/GAS each; the model fitted to one window predicts
    the next, with other token counts; a window that follows neither fits nothing."""
    from rp_engine.engine.prefetch import FactorModel

    counts, nxt = [10, 30, 20, 40], [25, 25, 10, 40]
    trainer = [n / 100 for n in counts]
    model = FactorModel.fit(trainer, counts, None)
    assert model == FactorModel("tokens", pytest.approx(1.0))
    assert model.predict(nxt, None) == pytest.approx([n / 100 for n in nxt])
    assert model.predict(nxt, 200) == pytest.approx([n / 200 for n in nxt])  # Trainer's N
    loop = FactorModel.fit([0.25] * 4, counts, None)
    assert loop == FactorModel("uniform", 0.25)
    assert loop.predict(nxt, None) == [0.25] * 4
    assert FactorModel.fit([0.25, 0.25, 0.5, 0.25], counts, None) is None
    # equal counts: both describe the window; the token-weighted one is kept
    assert FactorModel.fit([0.25] * 4, [8] * 4, None) == FactorModel("tokens", pytest.approx(1.0))
