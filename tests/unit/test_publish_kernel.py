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


def test_fp16_rounds_as_torch_at_every_boundary(kernel: str) -> None:
    """The kernels' own fp32 -> fp16 rounding (integer operations, so that their loops
    vectorize; the cast itself uses F16C where the CPU has it) against torch's, bit for bit:
    every finite fp16 value, each midpoint between neighbours (ties to even), one fp32 ulp
    either side of it, and the overflow edge, both signs. Through ``write_prediction`` with a
    zero step term: what it writes is the rounding of w alone."""
    finite = torch.arange(1, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16)
    v = finite.float()  # the positive finite fp16 values, exact in fp32
    mids = (v[:-1] + v[1:]) / 2  # exact: 12 significant bits
    top = torch.tensor([65504.0, 65519.996, 65520.0, 65520.004, 65536.0, 1e6, float("inf")])
    tiny = torch.tensor([2.0**-25, 2.0**-25 * 1.0000001, 2.0**-26, 1e-45, 2.0**-24 * 1.5])
    x = torch.cat([v, mids, torch.nextafter(mids, v[1:]), torch.nextafter(mids, v[:-1]), top,
                   tiny])  # fmt: skip
    x = torch.cat([x, -x])
    got = torch.empty(x.shape, dtype=torch.float16)
    zero = torch.zeros_like(x)
    publish_kernel.write_prediction(x, zero, zero, got, decay=1.0, coef=0.0, eps=1.0)
    want = x.to(torch.float16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_delay_compensation_is_the_formula_to_rounding(kernel: str, dtype: torch.dtype) -> None:
    """Per block, g <- (g + f) |g| / |g + f| with f = (sqrt(v) vcoef + eps) h (w - read),
    ``read`` widened from ``dtype``, against float64 with the fp32 scalars the kernel receives
    (blocks of 1000 over 65,537 elements: a partial last one); the sums of g^2, (g + f)^2 and
    w^2 to float64's; with h = 0 the gradient is left bit for bit, and taken where it is
    applied (read = w) to rounding."""
    gen = torch.Generator().manual_seed(3)
    n, block = 65_537, 1000
    w, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    v = torch.rand(n, generator=gen) * 1e-4
    read = (w + torch.randn(n, generator=gen) * 1e-3).to(dtype)
    v[:16] = 0.0  # no second moment yet: the fix scales by eps alone
    g[2000:3000] = 0.0  # a block without gradient: nothing to keep the norm of
    terms = {"vcoef": 31.6, "eps": 1e-8, "h": 250.0}
    got = g.clone()
    sums = publish_kernel.compensate_delay(got, w, v, read, block=block, **terms)
    t = {k: float(torch.tensor(x, dtype=torch.float32)) for k, x in terms.items()}
    fix = (v.double().sqrt() * t["vcoef"] + t["eps"]) * t["h"] * (w.double() - read.double())
    c = g.double() + fix
    want = torch.cat([
        c[lo : lo + block] * (g.double()[lo : lo + block].norm() / c[lo : lo + block].norm())
        for lo in range(0, n, block)
    ])  # fmt: skip
    assert torch.count_nonzero(got[2000:3000]) == 0
    assert bool(torch.all((got[:2000] != 0) == (want[:2000] != 0)))
    err = (got.double() - want).abs()
    assert (err <= want.abs() * 2**-18 + want.abs().max() * 2**-22).all(), float(err.max())
    for block_norm in (got.double()[:block].norm(), got.double()[-537:].norm()):
        assert block_norm > 0
    torch.testing.assert_close(
        got.double()[:block].norm(), g.double()[:block].norm(), rtol=1e-5, atol=0
    )
    ref = (g.double().square().sum(), c.square().sum(), w.double().square().sum())
    for s, r in zip(sums, ref, strict=True):
        assert s == pytest.approx(float(r), rel=1e-5)
    same = g.clone()
    publish_kernel.compensate_delay(same, w, v, read, block=block, vcoef=1.0, eps=0.0, h=0.0)
    assert torch.equal(same, g)
    if dtype == torch.float32:  # read where it is applied: nothing to compensate
        publish_kernel.compensate_delay(same, w, v, w.clone(), block=block, **terms)
        torch.testing.assert_close(same, g, rtol=1e-6, atol=0)


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


def test_an_unknown_prediction_is_refused() -> None:
    """``step_params`` names its predictions: anything else (a bool, as the cost benchmark once
    passed, which then silently published the plain cast) raises instead of publishing
    something other than what was asked."""
    store, opt, masters = _layer_store(4096)
    for hp in store.owned_params():
        store.accumulate(hp.param, torch.ones_like(hp.master))
    store.attach_grads([0])
    owned = {id(hp.master): hp for hp in store.owned_params()}
    with store.publishing(0, 1, predicted=True) as dst:
        assert dst is not None
        with pytest.raises(ValueError, match="predict True"):
            opt.step_params(
                masters, groups=opt.snapshot(), grad_coef=1.0,
                publish=lambda p: dst(owned[id(p)]), predict=True,  # type: ignore[arg-type]
            )  # fmt: skip


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam-l2"])
@pytest.mark.parametrize("publish", [None, "lookahead"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_adam_step_is_deepspeeds_step_then_the_publish(
    kernel: str, dtype: torch.dtype, publish: str | None, adamw: bool
) -> None:
    """``adam_step`` without compensation: DeepSpeed's CPU Adam (``adam_update``, AdamW's
    decoupled decay or Adam's L2 decay, bias corrections of step 3) then the publish, to fp32
    rounding; with compensation (``delay``): ``compensate_delay`` first, from ``out``'s old
    values."""
    gen = torch.Generator().manual_seed(4)
    n, lr, wd, step = 200_003, 1e-3, 0.1, 3
    w, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    m, v = torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-5
    read = (w + torch.randn(n, generator=gen) * 1e-3).to(dtype)
    inner, _ = build_inner_optimizer(
        "adamw" if adamw else "adam",
        {"lr": lr, "weight_decay": wd, **({} if adamw else {"adam_w_mode": False})},
        [{"params": [torch.zeros(1)]}],
    )
    opt = HostOptimizer(inner, per_layer=True, scaler=LossScaler(cur_scale=1.0))
    group = opt.snapshot()[0]
    adam = opt._adam_terms(group, step)
    terms = None
    if publish == "lookahead":
        terms = {**opt._step_terms(group, step + 1), "b1": 0.9, "b2": 0.999,
                 "l2": 0.0 if adamw else wd}  # fmt: skip
    for delay in (None, (31.6, 1e-8, 250.0)):
        want = [t.clone() for t in (g, w, m, v, read)]
        if delay is not None:
            publish_kernel.compensate_delay(
                want[0], want[1], want[3], want[4], block=65536,
                vcoef=delay[0], eps=delay[1], h=delay[2],
            )  # fmt: skip
        inner.ds_opt_adam.adam_update(
            inner.opt_id, step, lr, 0.9, 0.999, 1e-8, wd, True, *want[1:2], want[0], *want[2:4]
        )
        if publish is None:
            publish_kernel.write_copy(want[1], want[4])
        else:
            assert terms is not None
            publish_kernel.write_lookahead(want[1], want[0], want[2], want[3], want[4], **terms)
        got = [t.clone() for t in (g, w, m, v, read)]
        publish_kernel.adam_step(
            *got, adam=adam, block=65536, delay=delay, publish=publish, terms=terms
        )
        assert torch.equal(got[0], g)  # the gradient is read, never written
        # the moments to rounding of their two terms (with or without FMA: m may cancel), and
        # of the compensated g
        gd = want[0] if adamw else want[0] + wd * w
        for x, y, b, old, new in (
            (got[2], want[2], 0.9, m, gd),
            (got[3], want[3], 0.999, v, gd * gd),
        ):
            bound = 1e-5 * (b * old.abs() + (1 - b) * new.abs())  # g itself is to 2e-6
            assert ((x - y).abs() <= bound + 1e-30).all()
        step_size = (want[1] - w).abs() + 1e-12  # the update, to which rounding is relative
        w_err = (got[1] - want[1]).abs()
        assert (w_err <= 2 * want[1].abs() * 2**-24 + step_size * 1e-5).all(), float(w_err.max())
        ulp = want[4].float().abs() * torch.finfo(dtype).eps
        assert ((got[4].float() - want[4].float()).abs() <= 3 * ulp + step_size * 1e-4).all()
