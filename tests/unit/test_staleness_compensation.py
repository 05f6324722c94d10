"""Staleness compensation by weight prediction (``roundpipe.staleness_compensation``).

The asynchronous optimizer's iteration t reads the compute weights published for step t-2; with
"predict" those are w_{t-2} extrapolated one Adam step ahead (optim/stepper.py,
``HostOptimizer.predict_into``), while the fp32 masters and moments stay exactly Adam's. The
stepper is driven here by hand (no devices), so every publish is observed directly.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import config, engine_for, run_losses
from models import random_batch, tiny_qwen3
from torch import nn

from rp_engine.config import ConfigError, load_config
from rp_engine.model.host_store import HostStore
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
        self, step: int, grads: list[torch.Tensor], *, skip: bool = False, next_lr: float | None
    ) -> None:
        """Apply step ``step`` with ``grads`` (one per owned parameter); ``next_lr``: the LR the
        boundary sets for step ``step + 1`` (as the engine's scheduler would)."""
        self.stepper.open_step(step)
        for hp, g in zip(self.store.owned_params(), grads, strict=True):
            self.store.accumulate(hp.param, g)
        for layer in range(len(self.modules)):
            self.stepper.layer_ready(layer, step)
        self.stepper.close_step(step=step, skip=skip)
        if next_lr is not None:
            self.opt.param_groups[0]["lr"] = next_lr
        self.stepper.note_hyperparams(step + 1, self.opt.snapshot())
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


@pytest.mark.parametrize(
    "lrs", [[1e-2] * 5, [0.0, 2e-3, 4e-3, 6e-3, 8e-3]], ids=["constant", "warmup"]
)
def test_prediction_is_the_next_step_under_a_constant_gradient(lrs: list[float]) -> None:
    """Constant gradients: the weights published for step s are the masters of step s+1, to
    fp32 rounding (a run a step ahead is the reference), from step 1's bias corrections on and
    with an LR that changes every step (warm-up from 0: step 1 moves nothing)."""
    h = _Harness(lr=lrs[0])
    try:
        g = _grads(1)
        predicted: list[list[torch.Tensor]] = []
        for step in range(1, len(lrs) + 1):
            h.step(step, g, next_lr=lrs[step] if step < len(lrs) else lrs[-1])
            if predicted:  # the previous step's prediction against this step's masters
                for got, want in zip(predicted[-1], h.masters(), strict=True):
                    # fp32 rounding of the moments and of the two computations: a few ulps of
                    # the weight; a wrong bias correction or LR is off by ~1e-3 of a step of 1e-2
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-7)
            predicted.append(h.published(step))
            assert h.store.predicted(0)[step % 2]
        moved = [(a - b).abs().max() for a, b in zip(predicted[-1], h.masters(), strict=True)]
        assert min(moved) > 1e-3  # the prediction is a real step ahead, not the masters
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
                h.step(step, _grads(step), next_lr=None)
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
        h.step(1, _grads(1), next_lr=None)
        before = h.masters()
        h.step(2, [g * float("nan") for g in _grads(2)], skip=True, next_lr=None)
        assert h.store.predicted(0)[0] is False
        for got, want in zip(h.published(2), before, strict=True):
            assert torch.equal(got, want)
        h.step(3, _grads(3), next_lr=None)
        ref.step(1, _grads(1), next_lr=None)  # the same run without the skipped step
        ref.step(2, _grads(3), next_lr=None)
        for x, y in zip(h.published(3), ref.published(2), strict=True):
            assert torch.equal(x, y)
    finally:
        h.close()
        ref.close()


def test_resumed_moments_predict_as_the_run_that_saved() -> None:
    """Resume: masters and optimizer state loaded into a new optimizer (checkpoint load): the
    prediction is bit-identical to the run that saved (it reads only the masters, the loaded
    moments and step counts, and the next step's hyper-parameters)."""
    a, b = _Harness(seed=0), _Harness(seed=1)
    try:
        a.step(1, _grads(1), next_lr=None)
        a.step(2, _grads(2), next_lr=None)
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
    assert all(c in text for c in ('"none"', '"auto"', '"predict"')), text
    assert (
        staleness_compensation("auto", async_mode=True, can_predict=True, data_parallel=False)
        == "predict"
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


def test_engine_none_is_bit_identical_and_predict_keeps_true_masters() -> None:
    """Engine level: "none" trains bit for bit as the default (the staleness-1 rule that
    test_async_optimizer.py checks against its reference); "predict" changes the losses from
    step 3 on (the first iteration that reads a predicted version), and after training the
    module holds the true masters."""
    steps, gas = 5, 2
    cuts = {"fwd_cuts": [2, 2], "bwd_cuts": [0, 2, 2]}
    runs = {}
    models = {}
    for mode in ("default", "none", "predict"):
        extra = {} if mode == "default" else {"staleness_compensation": mode}
        models[mode] = tiny_qwen3(0, layers=4)
        cfg = config(devices=2, gas=gas, lr=1e-2, async_optimizer=True, roundpipe=extra, **cuts)
        runs[mode] = run_losses(models[mode], cfg, _batches(steps * gas), steps=steps)
    assert runs["none"] == runs["default"]
    for p, q in zip(models["none"].parameters(), models["default"].parameters(), strict=True):
        assert torch.equal(p, q)
    assert runs["predict"][:2] == runs["none"][:2]
    assert runs["predict"][2] != runs["none"][2]
    # the trained module holds the masters (synchronized), not a prediction
    engine = engine_for(
        tiny_qwen3(0, layers=4),
        config(devices=2, gas=gas, lr=1e-2, async_optimizer=True,
               roundpipe={"staleness_compensation": "predict"}, **cuts),
    )  # fmt: skip
    try:
        assert engine.stepper.predicts
        it = iter(_batches(steps * gas))
        for _ in range(steps):
            engine.train_batch(it)
        module = engine.module  # drains and publishes
        for hp in engine.store.owned_params():
            assert torch.equal(hp.param.detach(), hp.master.to(hp.param.dtype)), hp.name
        assert module is engine.module
    finally:
        engine.destroy()
