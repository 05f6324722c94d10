"""Staleness compensation by weight prediction (``roundpipe.staleness_compensation``).

The asynchronous optimizer's iteration t reads the compute weights published for step t-2; with
"predict" those are w_{t-2} extrapolated one more Adam step along the moments ("lookahead":
along the moments the next step makes if step t-2's gradient repeats), with step t-2's own
hyper-parameters (optim/stepper.py, ``HostOptimizer.step_params`` writes it as each slice
is stepped), while the fp32 masters and moments stay exactly Adam's. The stepper is driven here
by hand (no devices), so every publish is observed directly.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from engine_helpers import config, engine_for, run_losses
from models import random_batch, tiny_qwen3
from torch import nn

from rp_engine.config import ConfigError, load_config
from rp_engine.model.host_store import HostStore
from rp_engine.optim import publish_kernel
from rp_engine.optim.delay_compensation import BLOCK, RHO, DelayCompensation, DelayTerms
from rp_engine.optim.loss_scaler import LossScaler
from rp_engine.optim.optimizer import HostOptimizer, build_inner_optimizer
from rp_engine.optim.stepper import OptimizerStepper, staleness_compensation

WD = 0.01


class _Harness:
    """A HostStore over two fp32 layers, DeepSpeed CPU AdamW and an async stepper predicting."""

    def __init__(self, seed: int = 0, *, lr: float = 1e-2, compensation: str = "predict") -> None:
        torch.manual_seed(seed)
        self.modules = [nn.Linear(8, 300), nn.Linear(300, 4)]  # 2400- and 1200-element weights
        self.store = HostStore(self.modules, double_buffer=False)
        self.store.double_buffer_weights(True)
        masters = [hp.master for hp in self.store.owned_params()]
        inner, per_layer = build_inner_optimizer(
            "adamw", {"lr": lr, "weight_decay": WD}, [{"params": masters}]
        )
        self.opt = HostOptimizer(inner, per_layer=per_layer, scaler=LossScaler(cur_scale=1.0))
        self.stepper = OptimizerStepper(
            self.store, self.opt, clip=1e9, async_mode=True, fp16=False, guard_nonfinite=True,
            compensation=compensation,
        )  # fmt: skip

    def step(
        self, step: int, grads: list[torch.Tensor], *, skip: bool = False, lr: float | None = None
    ) -> None:
        """Apply step ``step`` with ``grads`` (one per owned parameter) at ``lr`` (None: the
        LR as it is; set before the step opens, as the engine's scheduler does)."""
        if lr is not None:
            self.opt.param_groups[0]["lr"] = lr
        self.stepper.open_step(step)
        for hp, g in zip(self.store.owned_params(), grads, strict=True):
            self.store.accumulate(hp.param, g)
        for layer in range(len(self.modules)):
            self.stepper.layer_ready(layer, step)
        self.stepper.close_step(step=step, skip=skip)
        self.stepper.wait_all()

    def published(self, version: int) -> list[torch.Tensor]:
        """The compute weights of ``version``'s buffer, per owned parameter."""
        sources = self.store.weight_sources([hp.param for hp in self.store.owned_params()], version)
        return [t.detach().clone() for t in sources]

    def masters(self) -> list[torch.Tensor]:
        return [hp.master.clone() for hp in self.store.owned_params()]

    def close(self) -> None:
        self.stepper.close()


def _grads(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in ((300, 8), (300,), (4, 300), (4,))]


@pytest.mark.parametrize("method", ["predict", "lookahead"])
@pytest.mark.parametrize(
    "lrs", [[1e-2] * 5, [0.0, 2e-3, 4e-3, 6e-3, 8e-3]], ids=["constant", "warmup"]
)
def test_prediction_is_one_more_step_at_the_same_rate_under_a_constant_gradient(
    lrs: list[float], method: str
) -> None:
    """Constant gradients: the weights published for step s are the masters one more step at
    step s's LR gives, to fp32 rounding (a run that repeats step s's LR is the reference),
    from step 1's bias corrections on; at a constant LR that is the next step's masters. With
    warm-up from 0, step 1 moves nothing and its publish is the masters."""
    h = _Harness(lr=lrs[0], compensation=method)
    try:
        g = _grads(1)
        for step, lr in enumerate(lrs, 1):
            h.step(step, g, lr=lr)
            published = h.published(step)
            ref = _Harness(lr=lrs[0])
            try:
                for s, rate in enumerate([*lrs[:step], lr], 1):
                    ref.step(s, g, lr=rate)
                want = ref.masters()
            finally:
                ref.close()
            for got, w in zip(published, want, strict=True):
                # fp32 rounding of the moments and of the two computations: a few ulps of the
                # weight; a wrong bias correction or LR is off by ~1e-3 of a step of 1e-2
                torch.testing.assert_close(got, w, rtol=1e-5, atol=5e-7)
            if lr == 0.0:
                for got, w in zip(published, h.masters(), strict=True):
                    assert torch.equal(got, w)
            else:
                moved = [(a - b).abs().max() for a, b in zip(published, h.masters(), strict=True)]
                assert min(moved) > 1e-4  # a real step ahead of the masters
        if lrs[0] == lrs[-1]:  # constant: the prediction of step 4 is step 5's masters
            h2 = _Harness(lr=lrs[0], compensation=method)
            try:
                for step in range(1, 5):
                    h2.step(step, g)
                predicted = h2.published(4)
            finally:
                h2.close()
            for got, w in zip(predicted, h.masters(), strict=True):
                torch.testing.assert_close(got, w, rtol=1e-5, atol=5e-7)
    finally:
        h.close()


def test_a_layer_publishes_its_prediction_before_the_step_closes() -> None:
    """Immediate stepping (no clipping, no guard): a layer steps as soon as its gradient is
    complete, in the middle of the iteration's backward, and its predicted weights are
    published right then. The prediction uses the step's own hyper-parameters, so it never waits
    for the next step's (known only at the boundary): before, a publish waited there and held
    up the optimizer worker, and so every later layer's step, until the boundary."""
    h = _Harness()
    h.stepper.clip = 0.0
    h.stepper.guard_nonfinite = False
    assert h.stepper.immediate
    try:
        h.step(1, _grads(1))
        h.stepper.open_step(2)
        for hp, g in zip(h.store.owned_params(), _grads(2), strict=True):
            h.store.accumulate(hp.param, g)
        for layer in range(len(h.modules)):
            h.stepper.layer_ready(layer, 2)
        done = threading.Event()
        waiter = threading.Thread(
            target=lambda: (h.store.wait_version(0, 2), h.store.wait_version(1, 2), done.set()),
            daemon=True,
        )
        waiter.start()
        # a liveness bound, not a timing: the publish is a few microseconds of work; the old
        # design waited for a boundary that this test never reaches
        assert done.wait(timeout=60), "the step's publish waited for the next boundary"
        assert h.store.predicted(0)[0]
        h.stepper.close_step(step=2)
        h.stepper.wait_all()
    finally:
        h.close()


def test_masters_and_moments_stay_adams_and_a_drain_publishes_them() -> None:
    """Prediction changes only the compute weights: the masters and moments are bit-identical
    to an engine without it, and ``synchronize`` (drains, checkpoints, engine.module) puts the
    true masters into every buffer."""
    a, b = _Harness(compensation="predict"), _Harness(compensation="none")
    try:
        for step in range(1, 4):
            for h in (a, b):
                h.step(step, _grads(step))
        for x, y in zip(a.masters(), b.masters(), strict=True):
            assert torch.equal(x, y)
        for p, q in zip(a.opt.state.values(), b.opt.state.values(), strict=True):
            assert torch.equal(p["exp_avg"], q["exp_avg"])
            assert torch.equal(p["exp_avg_sq"], q["exp_avg_sq"])
        assert not torch.equal(a.published(3)[0], b.published(3)[0])  # b publishes the masters
        a.stepper.synchronize()
        for version in (2, 3):  # both buffers
            for got, want in zip(a.published(version), a.masters(), strict=True):
                assert torch.equal(got, want)
        assert a.store.predicted(0) == [False, False]
    finally:
        a.close()
        b.close()


def test_a_skipped_step_publishes_the_masters() -> None:
    """A skipped step (overflow, non-finite) publishes the unchanged masters, never a prediction
    from the update that was dropped; the next applied step predicts again from moments that the
    skip left as they were."""
    h, ref = _Harness(), _Harness()
    try:
        h.step(1, _grads(1))
        before = h.masters()
        h.step(2, [g * float("nan") for g in _grads(2)], skip=True)
        assert h.store.predicted(0)[0] is False
        for got, want in zip(h.published(2), before, strict=True):
            assert torch.equal(got, want)
        h.step(3, _grads(3))
        ref.step(1, _grads(1))  # the same run without the skipped step
        ref.step(2, _grads(3))
        for x, y in zip(h.published(3), ref.published(2), strict=True):
            assert torch.equal(x, y)
    finally:
        h.close()
        ref.close()


def test_resumed_moments_predict_as_the_run_that_saved() -> None:
    """Resume: masters and optimizer state loaded into a new optimizer (checkpoint load): the
    prediction is bit-identical to the run that saved (it reads only the masters, the loaded
    moments and step counts, and the step's hyper-parameters)."""
    a, b = _Harness(seed=0), _Harness(seed=1)
    try:
        a.step(1, _grads(1))
        a.step(2, _grads(2))
        with torch.no_grad():
            for x, y in zip(b.store.owned_params(), a.store.owned_params(), strict=True):
                x.master.copy_(y.master)
                x.param.copy_(y.master)
        b.opt.load_state_dict(a.opt.state_dict())
        b.stepper.set_step(2)
        groups = a.opt.snapshot()
        for x, y in zip(a.store.owned_params(), b.store.owned_params(), strict=True):
            got, want = torch.empty_like(y.master), torch.empty_like(x.master)
            assert b.opt.predict_into(y.master, got, groups)
            assert a.opt.predict_into(x.master, want, groups)
            assert torch.equal(got, want)
            assert not torch.equal(got, x.master)
    finally:
        a.close()
        b.close()


def test_config_key_and_resolution() -> None:
    base = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    cfg = load_config({**base, "roundpipe": {"staleness_compensation": "auto"}})
    assert cfg.roundpipe.staleness_compensation == "auto"
    assert load_config(base).roundpipe.staleness_compensation == "none"
    with pytest.raises(ConfigError) as err:
        load_config({**base, "roundpipe": {"staleness_compensation": "dc"}})
    text = str(err.value)
    assert "roundpipe.staleness_compensation" in text
    choices = ('"none"', '"auto"', '"predict"', '"lookahead"', '"lookahead_dc"')
    assert all(c in text for c in choices), text
    # issue 43: "auto" is "lookahead", chosen by its worst case
    # (benchmarks/studies/compensation_suite.py)
    assert (
        staleness_compensation("auto", async_mode=True, can_predict=True, data_parallel=False)
        == "lookahead"
    )
    for method in ("predict", "lookahead", "lookahead_dc"):
        assert (
            load_config(
                {**base, "roundpipe": {"staleness_compensation": method}}
            ).roundpipe.staleness_compensation
            == method
        )
        assert (
            staleness_compensation(method, async_mode=True, can_predict=True, data_parallel=False)
            == method
        )
    assert (
        staleness_compensation("auto", async_mode=True, can_predict=False, data_parallel=False)
        == "none"
    )
    assert (
        staleness_compensation("predict", async_mode=False, can_predict=True, data_parallel=False)
        == "none"
    )
    with pytest.raises(ValueError, match="staleness_compensation.*torch_adam"):
        staleness_compensation("predict", async_mode=True, can_predict=False, data_parallel=False)
    with pytest.raises(ValueError, match="data parallel"):
        staleness_compensation("predict", async_mode=True, can_predict=True, data_parallel=True)


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    return [random_batch(128, batch=2, seq=12, seed=300 + i) for i in range(n)]


@pytest.mark.parametrize("method", ["predict", "lookahead", "lookahead_dc"])
def test_engine_none_is_bit_identical_and_predict_keeps_true_masters(method: str) -> None:
    """Engine level: "none" trains bit for bit as the default (the staleness-1 rule that
    test_async_optimizer.py checks against its reference); "predict" changes the losses from
    step 3 on (the first iteration that reads a predicted version), and after training the
    module holds the true masters."""
    steps, gas = 5, 2
    cuts = {"fwd_cuts": [2, 2], "bwd_cuts": [0, 2, 2]}
    runs = {}
    models = {}
    for mode in ("default", "none", method):
        extra = {} if mode == "default" else {"staleness_compensation": mode}
        models[mode] = tiny_qwen3(0, layers=4)
        cfg = config(devices=2, gas=gas, lr=1e-2, async_optimizer=True, roundpipe=extra, **cuts)
        runs[mode] = run_losses(models[mode], cfg, _batches(steps * gas), steps=steps)
    assert runs["none"] == runs["default"]
    for p, q in zip(models["none"].parameters(), models["default"].parameters(), strict=True):
        assert torch.equal(p, q)
    assert runs[method][:2] == runs["none"][:2]
    assert runs[method][2] != runs["none"][2]
    # the trained module holds the masters (synchronized), not a prediction
    engine = engine_for(
        tiny_qwen3(0, layers=4),
        config(devices=2, gas=gas, lr=1e-2, async_optimizer=True,
               roundpipe={"staleness_compensation": method}, **cuts),
    )  # fmt: skip
    try:
        assert engine.stepper.predicts
        it = iter(_batches(steps * gas))
        for _ in range(steps):
            engine.train_batch(it)
        engine.module.state_dict()  # a weight read through it drains and publishes
        module = engine.module
        for hp in engine.store.owned_params():
            assert torch.equal(hp.param.detach(), hp.master.to(hp.param.dtype)), hp.name
        assert module is engine.module
    finally:
        engine.destroy()


def _compensated_by_the_formula(
    g: torch.Tensor,
    w: torch.Tensor,
    v: torch.Tensor,
    read: torch.Tensor,
    *,
    moments: int,
    rms: float,
    clip_coef: float,
    block: int,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    rho: float = RHO,
) -> torch.Tensor:
    """Delay compensation as optim/delay_compensation.py's docstring states it, in float64:
    ``f = clip_coef (sqrt(v_hat) + eps) / (rho rms) (w - read)`` with ``v_hat = v / (1 -
    beta2^moments)`` and ``rms`` the root mean square of the masters before the tensor's
    previous step; then per ``block`` elements ``g <- (g + f) |g| / |g + f|``. ``g`` is the
    clipped gradient (its clip coefficient ``clip_coef``)."""
    v_hat = v.double() / (1 - betas[1] ** moments)
    fix = clip_coef * (v_hat.sqrt() + eps) / (rho * rms) * (w.double() - read.double())
    flat_g, flat_c = g.double().flatten(), (g.double() + fix).flatten()
    out = torch.empty_like(flat_g)
    for lo in range(0, flat_g.numel(), block):
        gb, cb = flat_g[lo : lo + block], flat_c[lo : lo + block]
        out[lo : lo + block] = cb * (gb.norm() / cb.norm())
    return out.view_as(g).float()


@pytest.mark.parametrize("read_dtype", [torch.float32, torch.bfloat16])
def test_delay_terms_and_record_follow_the_formula(read_dtype: torch.dtype) -> None:
    """``DelayCompensation.record`` keeps the rms of the masters before a tensor's step (from
    the sum of squares the kernel returns), and ``terms`` (bias correction of v, eps, h) with
    it make ``compensate_delay`` give the formula written out above, for a clipped gradient
    (clip coefficient 0.3) over whole and partial blocks. Before a scale is recorded, and
    without moments, the gradient is left as it is (h = 0)."""
    clip_coef, block, moments = 0.3, 8, 3
    group = {"betas": (0.9, 0.999), "eps": 1e-8, "bias_correction": True, "lr": 1e-2}
    gen = torch.Generator().manual_seed(7)
    shape = (5, 7)  # 35 elements: four blocks of 8 and one of 3
    w_prev = torch.randn(shape, generator=gen) * 0.5  # the masters before the previous step
    w = w_prev + 0.01 * torch.randn(shape, generator=gen)  # the masters now
    read = (w - 0.003 * torch.randn(shape, generator=gen)).to(read_dtype)
    v = torch.rand(shape, generator=gen) * 1e-3 + 1e-5
    g = clip_coef * torch.randn(shape, generator=gen)

    dc = DelayCompensation(RHO)
    assert dc.scale(w) is None
    assert dc.terms(w, moments, group, clip_coef) == DelayTerms(1.0, 0.0, 0.0)
    # the previous step: its kernel pass returns the masters' sum of squares before it
    sums = publish_kernel.compensate_delay(
        g.clone(), w_prev, v, read, block=block, vcoef=1.0, eps=0.0, h=0.0
    )
    assert sums[0] == pytest.approx(float(g.double().square().sum()), rel=1e-6)
    assert sums[2] == pytest.approx(float(w_prev.double().square().sum()), rel=1e-6)
    dc.record(w, sums[2])
    rms = math.sqrt(float(w_prev.double().square().mean()))
    assert dc.scale(w) == pytest.approx(rms, rel=1e-6)
    assert dc.terms(w, 0, group, clip_coef).h == 0.0  # no moments: no curvature scale yet

    terms = dc.terms(w, moments, group, clip_coef)
    got = g.clone()
    publish_kernel.compensate_delay(
        got, w, v, read, block=block, vcoef=terms.vcoef, eps=terms.eps, h=terms.h
    )
    want = _compensated_by_the_formula(
        g, w, v, read, moments=moments, rms=rms, clip_coef=clip_coef, block=block
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # not vacuous: the fix turns the gradient by a lot, and the clip coefficient counts
    assert float((want - g).norm()) > 0.1 * float(g.norm())
    unclipped = _compensated_by_the_formula(
        g, w, v, read, moments=moments, rms=rms, clip_coef=1.0, block=block
    )
    assert float((unclipped - want).norm()) > 0.1 * float(g.norm())
    # without bias correction v is used as it is
    plain = dc.terms(w, moments, {**group, "bias_correction": False}, clip_coef)
    assert plain.vcoef == 1.0 and plain.h == terms.h


def test_delay_compensation_reads_the_weights_each_gradient_was_taken_at(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With "lookahead_dc" each step's gradient is compensated from the compute weights its
    iteration read (step t's: version t-2's buffer, which step t's publish then overwrites)
    and the masters before the step, once a tensor has moments and its scale (rms) measured at
    its previous step (from step 2 on, h > 0); the compensated gradient keeps the raw one's
    norm; a skipped step compensates nothing. The compensated run leaves the plain
    look-ahead's masters."""
    from rp_engine.optim import optimizer as optimizer_module

    calls: list[tuple[int, list[torch.Tensor], torch.Tensor, dict]] = []  # type: ignore[type-arg]
    real = optimizer_module.adam_step

    def spy(g, w, m, v, out, **kw):  # type: ignore[no-untyped-def]
        before = [t.clone() for t in (g, w, m, v, out)]
        sums = real(g, w, m, v, out, **kw)
        assert torch.equal(g, before[0])  # the gradient is read, never written
        calls.append((w.data_ptr(), before, w.clone(), kw))
        return sums

    monkeypatch.setattr(optimizer_module, "adam_step", spy)
    h, plain = _Harness(compensation="lookahead_dc"), _Harness(compensation="lookahead")
    try:
        assert h.stepper.delay is not None
        index = {hp.master.data_ptr(): i for i, hp in enumerate(h.store.owned_params())}
        scale: list[float] | None = None  # rms of the masters before the last applied step
        applied = 0  # the steps the moments hold
        for step in range(1, 7):
            read, before = h.published(max(step - 2, 0)), h.masters()
            calls.clear()
            skip = step == 5
            h.step(step, _grads(step), skip=skip)
            plain.step(step, _grads(step), skip=skip)
            if skip:
                assert calls == []
                continue
            assert sorted(index[c[0]] for c in calls) == [0, 1, 2, 3]
            for ptr, (raw, w, m, v, r), stepped, kw in calls:
                i = index[ptr]
                assert torch.equal(r.flatten(), read[i].flatten()), (step, i)
                assert torch.equal(w.flatten(), before[i].flatten()), (step, i)
                vcoef, eps, hh = kw["delay"]
                assert (hh > 0) is (step > 1), (step, hh)
                if step > 2:  # w has moved from what was read: a new direction, the same norm
                    assert scale is not None
                    # the formula from what the test saw (no clipping: clip coefficient 1)
                    fixed = _compensated_by_the_formula(
                        raw, w, v, r, moments=applied, rms=scale[i], clip_coef=1.0, block=BLOCK
                    )
                    assert not torch.equal(fixed, raw)
                    torch.testing.assert_close(fixed.norm(), raw.norm())
                    # the step applied that gradient: Adam on it, uncompensated, lands there too
                    again = w.clone()
                    real(fixed, again, m.clone(), v.clone(), r.clone(), **{**kw, "delay": None})
                    torch.testing.assert_close(again, stepped, rtol=1e-6, atol=1e-8)
            scale = [math.sqrt(float(t.double().square().mean())) for t in before]
            applied += 1
        moved = [(a - b).abs().max() for a, b in zip(h.masters(), plain.masters(), strict=True)]
        assert min(moved) > 1e-5
    finally:
        h.close()
        plain.close()


def test_delay_compensation_without_a_second_weight_buffer_warns_and_steps_as_lookahead(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One compute-weight buffer: the weights a gradient was taken at are overwritten before
    its step, so "lookahead_dc" cannot compensate; it says so once and steps as "lookahead"
    (the same masters, bit for bit)."""
    from rp_engine.optim import optimizer as optimizer_module

    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("compensated without the weights the gradient was taken at")

    monkeypatch.setattr(optimizer_module, "adam_step", refuse)
    runs = {}
    for method in ("lookahead_dc", "lookahead"):
        h = _Harness(compensation=method)
        h.stepper.close()
        store = HostStore(h.modules, double_buffer=False)  # one weight buffer
        masters = [hp.master for hp in store.owned_params()]
        inner, per_layer = build_inner_optimizer(
            "adamw", {"lr": 1e-2, "weight_decay": WD}, [{"params": masters}]
        )
        opt = HostOptimizer(inner, per_layer=per_layer, scaler=LossScaler(cur_scale=1.0))
        h.store, h.opt = store, opt
        h.stepper = OptimizerStepper(
            store, opt, clip=1e9, async_mode=True, fp16=False, guard_nonfinite=True,
            compensation=method,
        )  # fmt: skip
        assert not h.stepper.publishes_at_step_end
        with caplog.at_level("WARNING", logger="rp_engine.optim"):
            for step in range(1, 5):
                h.step(step, _grads(step))
        runs[method] = h.masters()
        warned = [r for r in caplog.records if "cannot be delay-compensated" in r.message]
        assert len(warned) == (1 if method == "lookahead_dc" else 0)
        caplog.clear()
        h.close()
    for a, b in zip(runs["lookahead_dc"], runs["lookahead"], strict=True):
        assert torch.equal(a, b)
