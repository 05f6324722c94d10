"""The publish kernels (optim/publish_kernel.py) and the fused step-and-publish of
``HostOptimizer.step_params``: the compiled casts are torch's casts bit for bit, the prediction
is the formula to fp32 rounding, and writing each slice right after Adam steps it gives exactly
what a separate publish pass gives."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from rp_engine.model.host_store import HostStore
from rp_engine.optim import publish_kernel
from rp_engine.optim.loss_scaler import LossScaler
from rp_engine.optim.optimizer import HostOptimizer, build_inner_optimizer

SLICE = 1024  # elements per Adam call in these tests: several slices per tensor


def _values(n: int, seed: int = 0) -> torch.Tensor:
    """fp32 values over the whole exponent range, with zeros, subnormals and infinities."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.logspace(-44, 38, n).index_select(
        0, torch.randperm(n, generator=gen)
    )
    x[:6] = torch.tensor([0.0, -0.0, 1e-45, -3e-39, float("inf"), -float("inf")])
    return x


@pytest.fixture(params=["native", "torch"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both implementations: the compiled one, and the torch fallback used without a
    compiler."""
    if request.param == "torch":
        monkeypatch.setattr(publish_kernel, "native", lambda: None)
    return str(request.param)


def test_the_kernel_builds_where_a_compiler_exists() -> None:
    if not any(shutil.which(c) for c in ("cc", "gcc")):
        pytest.skip("no C compiler: the torch fallback publishes")
    assert publish_kernel.native() is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_cast_is_torchs_cast_bit_for_bit(kernel: str, dtype: torch.dtype) -> None:
    x = _values(100_003)
    got = torch.empty(x.shape, dtype=dtype)
    publish_kernel.write_copy(x, got)
    want = x.to(dtype)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    nan = torch.full((37,), float("nan"))
    out = torch.zeros(37, dtype=dtype)
    publish_kernel.write_copy(nan, out)
    assert out.isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_lookahead_is_the_formula_to_rounding(kernel: str, dtype: torch.dtype) -> None:
    """The next moments for a repeated gradient (L2 decay folded into it), then the step, in
    float64: within the roundings of the result plus 2^-20 of the step term."""
    gen = torch.Generator().manual_seed(2)
    n = 65_537
    w, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    m, v = torch.randn(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 1e-4
    g[:16], m[:16], v[:16] = 0.0, 0.0, 0.0  # a param that never saw a gradient
    terms = {"decay": 1.0, "b1": 0.9, "b2": 0.999, "coef": -1e-3, "eps": 1e-8, "l2": 0.01}
    got = torch.empty(n, dtype=dtype)
    publish_kernel.write_lookahead(w, g, m, v, got, **terms)
    t = {k: float(torch.tensor(x, dtype=torch.float32)) for k, x in terms.items()}
    gg = g.double() + t["l2"] * w.double()
    m1 = t["b1"] * m.double() + (1 - t["b1"]) * gg
    v1 = t["b2"] * v.double() + (1 - t["b2"]) * gg * gg
    step = t["coef"] * m1 / (v1.sqrt() + t["eps"])
    want = t["decay"] * w.double() + step
    ulp = want.abs() * torch.finfo(dtype).eps + torch.finfo(dtype).tiny
    err = (got.double() - want).abs()
    assert (err <= 2 * ulp + step.abs() * 2**-20).all(), float((err / ulp).max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_prediction_is_the_formula_to_rounding(kernel: str, dtype: torch.dtype) -> None:
    """decay * w + coef * m / (sqrt(v) + eps) against float64 (with the fp32 scalars the
    kernel receives): within two roundings of ``dtype`` (of decay * w, and of the sum) plus
    2^-20 of the step term (the ~23-bit reciprocals)."""
    gen = torch.Generator().manual_seed(1)
    n = 65_537
    w, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    v = torch.rand(n, generator=gen) * 1e-4
    v[:16] = 0.0  # no gradient yet on these: the step is m / eps
    m[:8] = 0.0
    decay, coef, eps = 1.0 - 1e-5, -1e-3, 1e-8
    got = torch.empty(n, dtype=dtype)
    publish_kernel.write_prediction(w, m, v, got, decay=decay, coef=coef, eps=eps)
    f32 = [float(torch.tensor(x, dtype=torch.float32)) for x in (decay, coef, eps)]
    step = f32[1] * m.double() / (v.double().sqrt() + f32[2])
    want = f32[0] * w.double() + step
    ulp = want.abs() * torch.finfo(dtype).eps + torch.finfo(dtype).tiny
    err = (got.double() - want).abs()
    assert (err <= 2 * ulp + step.abs() * 2**-20).all(), float((err / ulp).max())


def _layer_store(n: int) -> tuple[HostStore, HostOptimizer, list[torch.Tensor]]:
    torch.manual_seed(0)
    layer = nn.ParameterList(
        [
            nn.Parameter(torch.randn(n, dtype=torch.bfloat16)),
            nn.Parameter(torch.randn(3, 129, dtype=torch.bfloat16)),  # not a slice multiple
        ]
    )
    store = HostStore([layer], double_buffer=False)
    store.double_buffer_weights(True)
    masters = [hp.master for hp in store.owned_params()]
    inner, per_layer = build_inner_optimizer(
        "adamw", {"lr": 1e-2, "weight_decay": 0.01}, [{"params": masters}]
    )
    opt = HostOptimizer(
        inner, per_layer=per_layer, scaler=LossScaler(cur_scale=1.0), slice_elems=SLICE
    )
    return store, opt, masters


def _separate_publish(
    store: HostStore, opt: HostOptimizer, version: int, predict: str | None
) -> None:
    """The reference: the layer's publish as a pass of its own after the step."""
    groups = opt.snapshot()
    with store.publishing(0, version, predicted=predict is not None) as dst:
        assert dst is not None
        for hp in store.owned_params():
            out, state = dst(hp), opt.state[hp.master]
            if predict == "lookahead" and hp.master.grad is not None:
                terms = opt._lookahead_terms(hp.master, groups[0])
                assert terms is not None
                publish_kernel.write_lookahead(
                    hp.master, hp.master.grad, state["exp_avg"], state["exp_avg_sq"], out,
                    **terms,
                )  # fmt: skip
            elif not (predict and opt.predict_into(hp.master, out, groups)):
                publish_kernel.write_copy(hp.master, out)


@pytest.mark.parametrize("predict", [None, "predict", "lookahead"])
def test_fused_publish_equals_a_separate_pass(predict: str | None) -> None:
    """``step_params`` writing each slice as it steps (several slices per tensor) gives the
    same masters, moments and compute weights, bit for bit, as stepping and then publishing
    the layer in a separate pass; a param without a gradient is published too."""
    n = 5 * SLICE + 1000
    runs = []
    for fused in (True, False):
        store, opt, masters = _layer_store(n)
        owned = {id(hp.master): hp for hp in store.owned_params()}
        groups = opt.snapshot()
        for version in (1, 2, 3):
            gen = torch.Generator().manual_seed(version)
            for hp in store.owned_params()[: 1 if version == 3 else 2]:  # 3: one has no grad
                store.accumulate(hp.param, torch.randn(hp.param.shape, generator=gen))
            store.attach_grads([0])
            if fused:
                with store.publishing(0, version, predicted=predict is not None) as dst:
                    assert dst is not None
                    opt.step_params(
                        masters, groups=groups, grad_coef=0.5,
                        publish=lambda p, dst=dst, owned=owned: dst(owned[id(p)]),
                        predict=predict,
                    )  # fmt: skip
            else:
                opt.step_params(masters, groups=groups, grad_coef=0.5)
                _separate_publish(store, opt, version, predict)
            store.release_grads([0])
            assert store.predicted(0)[version % 2] is (predict is not None)
        params = [hp.param for hp in store.owned_params()]
        state = [t for s in opt.state.values() for t in (s["exp_avg"], s["exp_avg_sq"])]
        runs.append(
            (
                [m.clone() for m in masters],
                [t.clone() for t in state],
                [t.clone() for v in (2, 3) for t in store.weight_sources(params, v)],
            )
        )
    for a, b in zip(runs[0], runs[1], strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
    published = runs[0][2][2:]
    for got, master in zip(published, runs[0][0], strict=True):
        # the cast publishes exactly the masters; a prediction is a step away from them
        assert torch.equal(got, master.to(torch.bfloat16)) is (predict is None)


def test_a_publish_that_raises_leaves_the_buffer_holding_no_version() -> None:
    """``publishing``: a step that fails part-way leaves a half-written buffer, which then holds
    no version at all (neither the new one nor the one it held), so no upload reads it as
    either; the next publish writes it whole."""
    store, opt, masters = _layer_store(1000)
    with pytest.raises(RuntimeError, match="boom"), store.publishing(0, 1, predicted=False):
        raise RuntimeError("boom")
    assert store.version(0) == 0  # the other buffer still holds version 0
    with store.publishing(0, 3, predicted=False) as dst:  # buffer 1 again
        assert dst is not None
    assert store.version(0) == 3
    with store.publishing(0, 1, predicted=False) as dst:
        assert dst is None  # held already: nothing to write
