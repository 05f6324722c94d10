"""What a loss read costs in DeepSpeed's loop (engine/loop.py, window.py, data.WindowLoader).

A read runs the forward of the micro-batch it needs, alone, and nothing more: its backward
waits for the window's one schedule, where the resumed micro-batches run their backward stages
and the unread ones run whole. The weights uploaded for the window's first read stay on the
devices for its next reads and its run (they do not change within a window), and the read
micro-batches' head gradients are added up on the device and come down once. The devices' own
counts show it: a step's uploads are at most train_batch's plus one forward run's, whatever the
number of reads (before this change a read also ran that micro-batch's backward, or the whole
window so far, on its own, each uploading every weight). With the
loader ``initialize(training_data=)`` returns, each window is announced ahead and runs as one
schedule at its first forward: every read pattern uploads what train_batch uploads. Losses,
gradient norms and weights are those of the loop that reads nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from engine_helpers import assert_same_weights, config
from models import random_batch, tiny_qwen3

import rp_engine
from rp_engine.engine.loop import FORWARD_OPS
from rp_engine.plan.actions import Op

GAS, STEPS = 4, 3
CUTS = {"fwd_cuts": [2, 2], "bwd_cuts": [0, 2, 2]}  # fixed: the same plan for every loop
Read = Callable[[int], bool]  # micro-step -> read its loss there

# pattern: (read before backward, read after step) per micro-step
PATTERNS: dict[str, tuple[Read, Read]] = {
    "none": (lambda mb: False, lambda mb: False),
    "after_step": (lambda mb: False, lambda mb: True),
    "before_backward": (lambda mb: True, lambda mb: False),
    "every_10th": (lambda mb: False, lambda mb: mb % 10 == 9),
}


def _batches() -> list[dict[str, torch.Tensor]]:
    return [random_batch(128, batch=2, seq=12, seed=300 + i) for i in range(STEPS * GAS)]


def _dataset(batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Samples placed so that the engine's loader (DeepSpeed's: a shuffled DistributedSampler,
    seed 0) hands out exactly ``batches``, in order."""
    rows = [{k: v[i] for k, v in b.items()} for b in batches for i in range(2)]
    order = list(torch.utils.data.DistributedSampler(rows, num_replicas=1, rank=0))
    items: list[dict[str, torch.Tensor]] = [{} for _ in rows]
    for j, index in enumerate(order):
        items[index] = rows[j]
    return items


def _train(pattern: str, *, engine_loader: bool, async_optimizer: bool = False) -> dict[str, Any]:
    """DeepSpeed's loop reading the losses as ``pattern`` says: each step's weight uploads and
    runs, every loss, each step's norm, and the trained model."""
    before, after = PATTERNS[pattern]
    batches = _batches()
    model = tiny_qwen3(0, layers=4, hidden=32)
    cfg = config(devices=2, gas=GAS, lr=1e-3, async_optimizer=async_optimizer, clip=1.0, **CUTS)
    data = _dataset(batches) if engine_loader else None
    engine, _, loader, _ = rp_engine.initialize(model=model, config=cfg, training_data=data)
    runs: list[int] = []
    start = engine._executor.start
    engine._executor.start = lambda spec: runs.append(spec.step) or start(spec)  # type: ignore
    it = iter(loader) if engine_loader else iter(batches)
    out: dict[str, Any] = {"uploads": [], "kept": [], "losses": [], "norms": [], "model": model}
    try:
        for step in range(STEPS):
            for k in range(GAS):
                mb = step * GAS + k
                batch = next(it)
                torch.testing.assert_close(batch, batches[mb], rtol=0, atol=0)
                loss = engine(**batch).loss
                if before(mb):
                    loss.item()
                engine.backward(loss)
                engine.step()
                if after(mb):
                    loss.item()
                out["losses"].append(loss)
            stats = engine.last_step_stats()
            out["uploads"].append(stats["uploads"])
            out["kept"].append(stats["kept_uploads"])
            out["norms"].append(engine.get_global_grad_norm())
        engine.synchronize()
        plans = {"fwd_uploads": engine.planner.plan(1, ops=FORWARD_OPS)}
        for k in range(GAS + 1):  # the window's run with k micro-batches read before it
            plans[f"window_uploads_{k}"] = engine.planner.plan(GAS, resumed=k, rerun_head=True)
        for key, plan in plans.items():
            out[key] = sum(1 for a in plan.actions if a.op is Op.UPLOAD)
    finally:
        engine.destroy()
    out["losses"] = [float(x) for x in out["losses"]]
    out["runs"] = [runs.count(s) for s in range(1, STEPS + 1)]
    return out


@pytest.fixture(scope="module")
def unread() -> dict[str, Any]:
    """The loop that reads nothing before each window's end: train_batch's one schedule."""
    return _train("none", engine_loader=False)


@pytest.mark.parametrize("pattern", ["after_step", "before_backward", "every_10th"])
def test_a_read_costs_one_forward_pass(unread: dict[str, Any], pattern: str) -> None:
    got = _train(pattern, engine_loader=False)
    before, after = PATTERNS[pattern]
    for step in range(STEPS):
        window = range(step * GAS, (step + 1) * GAS)
        # a read forces its micro-batch's forward unless the window's run already gave it
        # (the boundary's backward runs the window: a read after the last step() is free)
        early = [mb for mb in window if before(mb) or (after(mb) and mb != window[-1])]
        # the plans' UPLOADs: one forward run per early read, then the window's run (the read
        # micro-batches run their head and backward stages, the others whole)
        cold = len(early) * got["fwd_uploads"] + got[f"window_uploads_{len(early)}"]
        assert got["uploads"][step] + got["kept"][step] == cold, (step, got, unread)
        # the first read's weights stay on the devices (the executor's kept weights): the
        # further reads upload nothing, and the window's run uploads no more than train_batch
        if early:
            assert got["kept"][step] >= (len(early) - 1) * got["fwd_uploads"], (step, got)
        assert got["uploads"][step] <= unread["uploads"][step] + got["fwd_uploads"]
        assert got["runs"][step] == len(early) + 1  # the forwards, then ONE for the window
    assert unread["runs"] == [1] * STEPS and unread["kept"] == [0] * STEPS
    torch.testing.assert_close(got["losses"], unread["losses"], rtol=1e-6, atol=0)
    torch.testing.assert_close(got["norms"], unread["norms"], rtol=1e-6, atol=0)
    assert_same_weights(got["model"], unread["model"], rtol=1e-6, atol=1e-7)


LOADER_CASES = {  # id: (pattern, async)
    "after_step": ("after_step", False),
    "before_backward": ("before_backward", False),
    "every_10th": ("every_10th", False),
    "after_step-async": ("after_step", True),
}


@pytest.mark.parametrize(("pattern", "async_optimizer"), LOADER_CASES.values(), ids=LOADER_CASES)
def test_the_engines_loader_makes_every_read_free(
    unread: dict[str, Any], pattern: str, async_optimizer: bool
) -> None:
    got = _train(pattern, engine_loader=True, async_optimizer=async_optimizer)
    assert got["runs"] == [1] * STEPS  # each window announced ahead: one schedule per step
    assert got["uploads"] == unread["uploads"]
    if async_optimizer:
        return  # (staleness 1: other losses than the sync reference's, by design)
    torch.testing.assert_close(got["losses"], unread["losses"], rtol=1e-6, atol=0)
    torch.testing.assert_close(got["norms"], unread["norms"], rtol=1e-6, atol=0)
    assert_same_weights(got["model"], unread["model"], rtol=1e-6, atol=1e-7)


def test_the_engines_loader_is_the_plain_loader_outside_the_loop() -> None:
    """len(), dataset, batch size are DeepSpeed's loader's; mid-window nothing is announced."""
    batches = _batches()
    model = tiny_qwen3(0, layers=4, hidden=32)
    cfg = config(devices=2, gas=GAS, lr=1e-3, **CUTS)
    engine, _, loader, _ = rp_engine.initialize(
        model=model, config=cfg, training_data=_dataset(batches)
    )
    try:
        assert len(loader) == len(batches) and loader.batch_size == 2
        assert len(loader.dataset) == 2 * len(batches)
        it = iter(loader)
        other = random_batch(128, batch=2, seq=12, seed=999)
        engine.backward(engine(**other).loss)  # a window opened outside the loader
        engine.step()
        assert engine._prefetch is None
        for _ in range(GAS - 1):  # mid-window: read one at a time, nothing announced
            loss = engine(**next(it)).loss
            assert engine._prefetch is None
            engine.backward(loss)
            engine.step()
        next(it)  # at the boundary: the next window is read and announced
        assert engine._prefetch is not None and len(engine._prefetch.batches) == GAS
    finally:
        engine.destroy()


def test_reading_submodules_and_attributes_does_not_wait_for_the_step() -> None:
    """A script that reads ``model.model`` or ``engine.module.config`` every step keeps the
    optimizer step in flight; a call, a method or a tensor read waits for it (and sees it)."""
    batches = _batches()
    model = tiny_qwen3(0, layers=4, hidden=32)
    cfg = config(devices=2, gas=GAS, lr=1e-3, async_optimizer=True, **CUTS)
    engine, _, _, _ = rp_engine.initialize(model=model, config=cfg)
    waits: list[int] = []
    synchronize = engine.synchronize
    engine.synchronize = lambda: waits.append(engine.global_steps) or synchronize()
    try:
        it = iter(batches)
        for _ in range(2):
            engine.train_batch(it)
            inner = engine.model  # falls through to the HF model's submodule
            assert isinstance(inner, type(model.model)) and isinstance(inner, torch.nn.Module)
            assert engine.module.model.config is model.config
            assert engine.config["gradient_accumulation_steps"] == GAS  # DeepSpeed's dict
            assert len(engine.module.model.layers) == 4
            assert engine.module.training and inner.layers[0].self_attn.head_dim == 8
        assert waits == []  # nothing above read a weight
        weight = engine.module.model.layers[0].mlp.up_proj.weight  # a tensor: waits
        assert waits == [2]
        assert weight is model.model.layers[0].mlp.up_proj.weight
        assert engine.module.model.layers[0].mlp.up_proj.weight is weight  # no wait: published
        assert waits == [2]
        engine.train_batch(it)
        state = engine.module.model.state_dict()  # a method: waits, the newest weights
        assert waits == [2, 3]
        torch.testing.assert_close(state["norm.weight"], model.model.norm.weight)
        assert engine.module is model  # published: the model itself
    finally:
        engine.destroy()


def test_the_engines_loader_feeds_the_planners_profile() -> None:
    """Without fixed cuts the planner times its first steps and may re-plan: the loader's
    prefetched windows are those steps here (each run drained for the planner, its step closed
    once every backward matched), and every step reports what it moved."""
    batches = _batches()
    model = tiny_qwen3(0, layers=4, hidden=32)
    cfg = config(devices=2, gas=GAS, lr=1e-3)
    engine, _, loader, _ = rp_engine.initialize(
        model=model, config=cfg, training_data=_dataset(batches)
    )
    try:
        assert engine.planner.profile_left > 0
        it = iter(loader)
        for _ in range(STEPS):
            for _ in range(GAS):
                loss = engine(**next(it)).loss
                engine.backward(loss)
                engine.step()
                loss.item()
            assert engine.last_step_stats()["uploads"] > 0  # the step's own traffic
        assert engine.planner.profile_left == 0
    finally:
        engine.destroy()
