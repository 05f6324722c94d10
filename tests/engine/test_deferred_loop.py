"""DeepSpeed's loop (``loss = engine(b); engine.backward(loss); engine.step()``) runs each
accumulation window as one schedule (engine/loop.py), and computes what plain PyTorch computes.

Each case trains the same tiny Qwen3 three ways: the loop, ``train_batch``, and plain PyTorch
(this file's reference: per-micro-batch losses and each step's pre-clip gradient norm). Adam
divides out a constant gradient factor, so the norms are compared per step (rtol 1e-5), and a
case clipped below the norm and an SGD case (scale-sensitive) are included: a 1/GAS applied twice
or never fails them all. The bytes the devices counted for a loop step equal ``train_batch``'s
for the same plan: the window is one schedule, not one run per micro-batch and pass.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from engine_helpers import AdamSlack, assert_same_weights, config, engine_for
from models import random_batch, tiny_qwen3

from rp_engine.engine.deferred import is_deferred

GAS, STEPS, LR = 4, 3, 1e-3
CUTS = {"fwd_cuts": [2, 2], "bwd_cuts": [0, 2, 2]}  # fixed: no re-plan, same plan both ways
Transform = Callable[[torch.Tensor], torch.Tensor]


def _batches(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return [random_batch(128, batch=2, seq=12, seed=seed + i) for i in range(n)]


def _model() -> torch.nn.Module:
    return tiny_qwen3(0, layers=4, hidden=32)


def _cfg(*, async_optimizer: bool, opt: str = "adamw", clip: float = 0.0, **extra: Any) -> dict:
    cfg = config(devices=2, gas=GAS, lr=LR, async_optimizer=async_optimizer, clip=clip, **CUTS,
                 **extra)  # fmt: skip
    if opt == "sgd":
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.5}}
    return cfg


def _reference(
    model: torch.nn.Module, batches: list[dict], *, windows: list[int], opt: str, clip: float,
    staleness: int, transform: Transform | None = None,
) -> tuple[list[float], list[float]]:  # fmt: skip
    """Plain PyTorch, one device: per step a window of micro-batches, each loss (through
    ``transform``) divided by GAS (DeepSpeed's ``backward``), the pre-clip global norm, clipping,
    the optimizer. ``staleness`` 1: step t's gradients are taken at w_{t-2} (async). Returns
    the per-micro-batch losses and the per-step norms."""
    if opt == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    slack = AdamSlack.of(model)
    compute = copy.deepcopy(model) if staleness else model
    history = [copy.deepcopy(model.state_dict())]
    losses, norms = [], []
    it = iter(batches)
    for step, size in enumerate(windows, start=1):
        if staleness:
            compute.load_state_dict(history[max(step - 1 - staleness, 0)])
            compute.zero_grad()
        for _ in range(size):
            loss = compute(**next(it)).loss
            losses.append(float(loss.detach()))
            ((transform(loss) if transform else loss) / GAS).backward()
        if staleness:
            for p, q in zip(model.parameters(), compute.parameters(), strict=True):
                p.grad = None if q.grad is None else q.grad.clone()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf)
        norms.append(float(norm))
        optimizer.step()
        if opt != "sgd":
            slack.record(optimizer)
        optimizer.zero_grad()
        history.append(copy.deepcopy(model.state_dict()))
    return losses, norms


def _loop(
    engine: Any, batches: list[dict], *, steps: int = STEPS,
    read: Callable[[int, str, torch.Tensor], None] | None = None,
    transform: Transform | None = None, drain: bool = False,
) -> tuple[list[float], list[float]]:  # fmt: skip
    """DeepSpeed's loop; the losses are read once every step is done (unless ``read`` reads
    them earlier: it gets the micro-batch index, "forward"/"backward" and the loss). Norms by
    step from ``step_report`` (no drain: iterations overlap), the last from
    ``get_global_grad_norm``; with ``drain`` (reads mid-window drain anyway) every step's."""
    held: list[torch.Tensor] = []
    norms: dict[int, float] = {}
    it = iter(batches)
    for step in range(steps):
        for k in range(GAS):
            mb = step * GAS + k
            loss = engine(**next(it)).loss
            if read:
                read(mb, "forward", loss)
            engine.backward(transform(loss) if transform else loss)
            if read:
                read(mb, "backward", loss)
            engine.step()
            held.append(loss)
        report = engine.step_report() if not drain else None
        if drain:
            norms[engine.global_steps] = engine.get_global_grad_norm()
        elif report is not None and report.grad_norm is not None:
            norms[report.step] = report.grad_norm
    norms[engine.global_steps] = engine.get_global_grad_norm()
    engine.synchronize()
    return [float(x) for x in held], [norms[s] for s in sorted(norms)]


def _train_batch(engine: Any, batches: list[dict]) -> tuple[list[float], list[float], list]:
    """``train_batch`` per step: its norms and each step's device counts."""
    norms, stats = [], []
    it = iter(batches)
    for _ in range(STEPS):
        engine.train_batch(it)
        norms.append(engine.get_global_grad_norm())
        stats.append(engine.last_step_stats())
    engine.synchronize()
    return [], norms, stats


CASES = {  # id: (async, optimizer, clip)
    "sync-adamw": (False, "adamw", 0.0),
    "async-adamw": (True, "adamw", 0.0),
    "sync-adamw-clipped": (False, "adamw", 1.0),  # the norms are ~4: clipping binds
    "async-adamw-clipped": (True, "adamw", 1.0),
    "sync-sgd": (False, "sgd", 0.0),
    "async-sgd-clipped": (True, "sgd", 1.0),
}


@pytest.mark.parametrize(("async_optimizer", "opt", "clip"), CASES.values(), ids=CASES.keys())
def test_loop_equals_train_batch_and_pytorch(async_optimizer: bool, opt: str, clip: float) -> None:
    batches = _batches(STEPS * GAS)
    cfg = _cfg(async_optimizer=async_optimizer, opt=opt, clip=clip)
    loop_model, batch_model, ref = _model(), _model(), _model()
    loop, fast = engine_for(loop_model, cfg), engine_for(batch_model, cfg)
    try:
        losses, norms = _loop(loop, batches)
        loop_uploads = loop.last_step_stats()["uploads"]
        _, fast_norms, fast_stats = _train_batch(fast, batches)
    finally:
        loop.destroy()
        fast.destroy()
    ref_losses, ref_norms = _reference(
        ref, batches, windows=[GAS] * STEPS, opt=opt, clip=clip, staleness=int(async_optimizer)
    )
    assert min(ref_norms) > 2 * clip  # the clipped cases do clip
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    torch.testing.assert_close(norms, fast_norms, rtol=1e-5, atol=0)
    assert loop_uploads == fast_stats[-1]["uploads"]  # one schedule for the whole window
    assert_same_weights(loop_model, ref)
    assert_same_weights(loop_model, batch_model, rtol=1e-6, atol=1e-7)


def test_a_loop_step_moves_the_bytes_of_train_batch() -> None:
    """The devices' own counts for one GAS-4 step: the loop's window is train_batch's plan."""
    batches = _batches(2 * GAS)
    cfg = _cfg(async_optimizer=False)
    loop, fast = engine_for(_model(), cfg), engine_for(_model(), cfg)
    try:
        _loop(loop, batches, steps=2)
        it = iter(batches)
        fast.train_batch(it)
        fast.train_batch(it)
        got, want = loop.last_step_stats(), fast.last_step_stats()
    finally:
        loop.destroy()
        fast.destroy()
    keys = ("h2d_bytes", "d2h_bytes", "weight_h2d_bytes", "grad_d2h_bytes", "uploads", "downloads")
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
    assert got["weight_h2d_bytes"] > 0


def _read_now(which: set[tuple[int, str]]) -> Callable[[int, str, torch.Tensor], None]:
    def read(mb: int, when: str, loss: torch.Tensor) -> None:
        if (mb, when) in which:
            assert math.isfinite(float(loss))  # a value, never a placeholder

    return read


READS = {  # id: (micro-batches read, transform of the loss given to backward)
    "before-backward": ({(1, "forward"), (6, "forward")}, None),
    "after-backward": ({(2, "backward"), (9, "backward")}, None),
    "every-micro-batch": ({(i, "forward") for i in range(STEPS * GAS)}, None),
    "after-every-backward": ({(i, "backward") for i in range(STEPS * GAS)}, None),
    "affine-loss": (set(), lambda loss: 2 * loss - 1),  # stays deferred
    "squared-loss": (set(), lambda loss: loss * loss / 5),  # needs the value: runs alone
}


@pytest.mark.parametrize(("reads", "transform"), READS.values(), ids=READS.keys())
def test_reads_and_loss_arithmetic_stay_exact(reads: set, transform: Transform | None) -> None:
    batches = _batches(STEPS * GAS, seed=50)
    model, ref = _model(), _model()
    engine = engine_for(model, _cfg(async_optimizer=False, clip=1.0))
    try:
        losses, norms = _loop(
            engine, batches, read=_read_now(reads), transform=transform, drain=True
        )
    finally:
        engine.destroy()
    ref_losses, ref_norms = _reference(
        ref, batches, windows=[GAS] * STEPS, opt="adamw", clip=1.0, staleness=0,
        transform=transform,
    )  # fmt: skip
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    assert_same_weights(model, ref)


def test_a_loss_is_deferred_until_its_window_runs() -> None:
    engine = engine_for(_model(), _cfg(async_optimizer=False))
    try:
        batches = _batches(GAS)
        losses = []
        for k, batch in enumerate(batches):
            loss = engine(**batch).loss
            assert is_deferred(loss) and loss.requires_grad and loss.shape == ()
            scaled = engine.backward(loss)
            assert is_deferred(scaled) == (k < GAS - 1)  # the boundary's backward runs it
            engine.step()
            losses.append((loss, scaled))
        assert not any(is_deferred(x) for pair in losses for x in pair)
        for loss, scaled in losses:
            torch.testing.assert_close(scaled, loss / GAS)
    finally:
        engine.destroy()


def test_unmanaged_accumulation_closes_at_every_step() -> None:
    """``managed_gradient_accumulation: false``: each step() is the boundary of the backwards
    since the last one (windows of 2, 3 and 1 here); the loss is still scaled by 1/GAS, and
    samples are counted per micro-batch (DeepSpeed 0.19.8)."""
    windows = [2, 3, 1]
    batches = _batches(sum(windows), seed=80)
    model, ref = _model(), _model()
    engine = engine_for(model, {**_cfg(async_optimizer=False, clip=1.0),
                                "managed_gradient_accumulation": False})  # fmt: skip
    try:
        it, losses, norms = iter(batches), [], []
        for size in windows:
            for _ in range(size):
                loss = engine(**next(it)).loss
                engine.backward(loss)
                assert not engine.is_gradient_accumulation_boundary()
                losses.append(loss)
            engine.step()
            norms.append(engine.get_global_grad_norm())
        with pytest.raises(AssertionError, match="managed_gradient_accumulation"):
            engine.set_gradient_accumulation_boundary(True)
        assert engine.global_steps == 3 and engine.micro_steps == 3
        assert engine.global_samples == 2 * sum(windows)  # micro-batch size 2
        engine.synchronize()
    finally:
        engine.destroy()
    ref_losses, ref_norms = _reference(
        ref, batches, windows=windows, opt="adamw", clip=1.0, staleness=0
    )
    torch.testing.assert_close([float(x) for x in losses], ref_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    assert_same_weights(model, ref)


def test_eval_forward_and_module_read_mid_window() -> None:
    batches = _batches(STEPS * GAS, seed=20)
    model, ref = _model(), _model()
    engine = engine_for(model, _cfg(async_optimizer=False))
    evals = []

    def mid_window(mb: int, when: str, _loss: torch.Tensor) -> None:
        if when == "backward" and mb % GAS == 1:
            engine.eval()
            with torch.no_grad():
                evals.append(float(engine(**batches[0]).loss))
            engine.train()
            assert engine.module is model

    try:
        losses, norms = _loop(engine, batches, read=mid_window, drain=True)
    finally:
        engine.destroy()
    ref_losses, ref_norms = _reference(
        ref, batches, windows=[GAS] * STEPS, opt="adamw", clip=0.0, staleness=0
    )
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    assert_same_weights(model, ref)
    assert len(evals) == STEPS and evals[0] == pytest.approx(losses[0], rel=1e-5)


def test_fp16_overflow_and_scheduler_as_train_batch() -> None:
    """fp16 with a loss scale that overflows first (steps skipped, the scale lowered, the
    scheduler not stepped on them) and WarmupLR: the loop's counters, scale, LRs, norms and
    weights are train_batch's."""
    extra = {
        "fp16": {"enabled": True, "initial_scale_power": 32, "loss_scale_window": 2},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3,
                                                     "warmup_max_lr": LR}},
    }  # fmt: skip
    steps = 5
    batches = _batches(steps * GAS, seed=30)
    cfg = _cfg(async_optimizer=True, clip=1.0, **extra)
    loop_model, batch_model = _model(), _model()
    loop, fast = engine_for(loop_model, cfg), engine_for(batch_model, cfg)
    seen: dict[str, list] = {"loop": [], "fast": []}
    try:
        it = iter(batches)
        for _ in range(steps):
            for _ in range(GAS):
                loss = loop(**next(it)).loss
                loop.backward(loss)
                loop.step()
            seen["loop"].append(
                (
                    loop.get_lr(),
                    loop.skipped_steps,
                    loop.was_step_applied(),
                    loop.host_optimizer.cur_scale,
                    loop.get_global_grad_norm(),
                )
            )
        it = iter(batches)
        for _ in range(steps):
            fast.train_batch(it)
            seen["fast"].append(
                (
                    fast.get_lr(),
                    fast.skipped_steps,
                    fast.was_step_applied(),
                    fast.host_optimizer.cur_scale,
                    fast.get_global_grad_norm(),
                )
            )
        loop.synchronize()
        fast.synchronize()
    finally:
        loop.destroy()
        fast.destroy()
    assert seen["loop"][-1][1] > 0  # steps were skipped
    for a, b in zip(seen["loop"], seen["fast"], strict=True):
        assert a[:4] == b[:4]
        assert a[4] == pytest.approx(b[4], rel=1e-5) or not math.isfinite(b[4])
    assert_same_weights(loop_model, batch_model, rtol=1e-6, atol=1e-7)


def test_a_failure_inside_the_window_raises_and_the_step_is_not_applied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _model()
    engine = engine_for(model, _cfg(async_optimizer=True))
    try:
        batches = _batches(3 * GAS, seed=40)
        it = iter(batches)
        for _ in range(GAS):  # a first, good step
            engine.backward(engine(**next(it)).loss)
            engine.step()
        engine.synchronize()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        head_cls = type(engine.seq.head)  # the devices run copies of the head: patch its class
        original = head_cls.forward_backward
        calls = {"n": 0}

        def fails_once(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 3:  # the third micro-batch of the window
                raise RuntimeError("injected head failure")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(head_cls, "forward_backward", fails_once)
        held = []
        for _ in range(GAS - 1):
            held.append(engine(**next(it)).loss)
            engine.backward(held[-1])
            engine.step()
        held.append(engine(**next(it)).loss)
        with pytest.raises(Exception, match="injected head failure"):
            engine.backward(held[-1])  # the boundary's backward runs the window: it raises
        engine.step()  # the lost step counts as skipped
        assert not engine.was_step_applied() and engine.skipped_steps == 1
        assert engine.global_steps == 2
        with pytest.raises(RuntimeError, match="never computed"):
            float(held[0])
        engine.synchronize()
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, before[k], rtol=0, atol=0)
        for _ in range(GAS):  # and training goes on
            loss = engine(**next(it)).loss
            engine.backward(loss)
            engine.step()
        assert engine.was_step_applied() and math.isfinite(float(loss))
    finally:
        engine.destroy()


def test_no_sync_as_deepspeed() -> None:
    engine = engine_for(_model(), _cfg(async_optimizer=False))
    try:
        with engine.no_sync():
            engine.backward(engine(**_batches(1)[0]).loss)
            with pytest.raises(AssertionError, match="inside the no_sync"):
                engine.step()
            with pytest.raises(AssertionError, match="reentry"), engine.no_sync():
                pass
        engine.step()
    finally:
        engine.destroy()
    zero3 = engine_for(_model(), {**_cfg(async_optimizer=False),
                                  "zero_optimization": {"stage": 3}})  # fmt: skip
    try:
        with pytest.raises(AssertionError, match="ZeRO stage 3"), zero3.no_sync():
            pass
    finally:
        zero3.destroy()


def test_a_checkpoint_mid_window_loses_nothing(tmp_path: Any) -> None:
    """DeepSpeed allows save_checkpoint anywhere. Saved after two micro-batches of a window,
    the queued micro-batches are kept (the window still runs as one at its boundary: the run
    equals one without the save), and a fresh engine loading the checkpoint saved at the
    boundary before continues as the uninterrupted run."""
    batches = _batches(3 * GAS, seed=60)
    cfg = _cfg(async_optimizer=False, clip=1.0)
    straight_model, saved_model, resumed_model = _model(), _model(), _model()
    straight = engine_for(straight_model, cfg)
    saving = engine_for(saved_model, cfg)
    try:
        want, _ = _loop(straight, batches)
        it, got = iter(batches), []
        for mb in range(3 * GAS):
            loss = saving(**next(it)).loss
            saving.backward(loss)
            saving.step()
            got.append(loss)
            if mb == GAS - 1:
                saving.save_checkpoint(str(tmp_path), tag="boundary")
            if mb == GAS + 1:  # mid-window: two micro-batches queued
                saving.save_checkpoint(str(tmp_path), tag="mid")
        saving.synchronize()
        assert [float(x) for x in got] == want
        assert_same_weights(saved_model, straight_model, rtol=0, atol=0)
    finally:
        straight.destroy()
        saving.destroy()
    resumed = engine_for(resumed_model, cfg)
    try:
        resumed.load_checkpoint(str(tmp_path), tag="boundary")
        assert resumed.global_steps == 1  # (micro_steps restarts at 0, as DeepSpeed's)
        more, _ = _loop(resumed, batches[GAS:], steps=2)
    finally:
        resumed.destroy()
    assert more == want[GAS:]
    assert_same_weights(resumed_model, straight_model, rtol=0, atol=0)


def test_dropout_masks_as_train_batch() -> None:
    """With dropout each layer's masks come from (step, micro-batch, layer) seeds: the loop's
    window numbers its micro-batches as train_batch does (also when one of them ran alone, a
    loss read before its backward), so losses and weights are train_batch's."""
    batches = _batches(STEPS * GAS, seed=90)
    cfg = _cfg(async_optimizer=False)
    loop_model = tiny_qwen3(0, layers=4, hidden=32, dropout=0.1)
    batch_model = tiny_qwen3(0, layers=4, hidden=32, dropout=0.1)
    loop, fast = engine_for(loop_model, cfg), engine_for(batch_model, cfg)
    try:
        losses, _ = _loop(loop, batches, read=_read_now({(5, "forward")}), drain=True)
        it = iter(batches)
        means = [float(fast.train_batch(it)) for _ in range(STEPS)]
        fast.synchronize()
    finally:
        loop.destroy()
        fast.destroy()
    per_step = [sum(losses[i * GAS : (i + 1) * GAS]) / GAS for i in range(STEPS)]
    torch.testing.assert_close(per_step, means, rtol=1e-5, atol=1e-6)
    assert_same_weights(loop_model, batch_model, rtol=1e-5, atol=1e-6)


PREFETCHED = {  # id: (async, optimizer, extra config)
    "sync-sgd": (False, "sgd", {}),
    "async-sgd": (True, "sgd", {}),
    # Adam without clipping or guard steps each layer as soon as its gradient lands: the
    # prefetched run's gradients must not reach it before their factors are checked
    "async-adamw-immediate": (True, "adamw", {"on_nonfinite": "ignore"}),
}


@pytest.mark.parametrize(("async_optimizer", "opt", "rp"), PREFETCHED.values(), ids=PREFETCHED)
def test_a_prefetched_window_reads_free_and_checks_each_factor(
    async_optimizer: bool, opt: str, rp: dict
) -> None:
    """``expect_micro_batches`` (what Trainer's patch calls): the window runs at its first
    forward, every read after is free, one schedule per step. Its d(loss) factors are predicted
    (window.py ``FactorModel``); micro-batch 6's loss is doubled here, so step 2's prediction
    is wrong: its gradients run again at the boundary with the real factors.
    SGD and the norms see any factor; all equal plain PyTorch's."""
    batches = _batches(STEPS * GAS, seed=70)
    model, ref = _model(), _model()
    cfg = _cfg(async_optimizer=async_optimizer, opt=opt, roundpipe=rp)
    engine = engine_for(model, cfg)
    assert engine.stepper.immediate == bool(rp)
    factor = {6: 2.0}  # micro-batch -> the caller's factor on its loss
    runs: list[int] = []
    start = engine._executor.start
    engine._executor.start = lambda spec: runs.append(spec.step) or start(spec)  # type: ignore
    try:
        losses, norms, mb = [], [], 0
        for step in range(STEPS):
            window = batches[step * GAS : (step + 1) * GAS]
            engine.expect_micro_batches(window)
            for batch in window:
                loss = engine(**batch).loss
                losses.append(float(loss.detach()))  # read before backward: no extra run
                engine.backward(loss * factor.get(mb, 1.0))
                engine.step()
                mb += 1
            norms.append(engine.get_global_grad_norm())
        engine.synchronize()
    finally:
        engine.destroy()
    # one schedule per step (the first guess, each micro-batch's share of the window's tokens,
    # is this loop's 1/GAS: equal token counts), and step 2's micro-batch 6 breaks it
    assert runs == [1, 2, 2, 3]
    counter = iter(range(STEPS * GAS))
    ref_losses, ref_norms = _reference(
        ref, batches, windows=[GAS] * STEPS, opt=opt, clip=0.0,
        staleness=int(async_optimizer),
        transform=lambda loss: loss * factor.get(next(counter), 1.0),
    )  # fmt: skip
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    assert_same_weights(model, ref)
