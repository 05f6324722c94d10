"""Overlapping iterations (engine_pipeline.py): ``train_batch`` t+1's first forward runs while
iteration t's last backward, its accumulation and its optimizer step are still running, and
everything that reads weights still sees DeepSpeed's numbers.

Ordering is observed with events (a slot held until another has started, with a timeout), never
with wall-clock figures; the same probe with ``overlap_iterations: false`` is the control.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest
import torch
from engine_helpers import assert_same_weights, config, engine_for, reference_losses
from models import random_batch, tiny_qwen3

import rp_engine
from rp_engine.device.base import DeviceError
from rp_engine.optim.nonfinite import NonFiniteError

GAS = 2
CUTS = {"fwd_cuts": [2, 2], "bwd_cuts": [0, 2, 2]}
OVERLAP = {"on_nonfinite": "ignore"}  # the guarded modes overlap too (see their own tests)


def _batches(n: int, seed: int = 300) -> list[dict[str, torch.Tensor]]:
    return [random_batch(128, batch=2, seq=12, seed=seed + i) for i in range(n)]


def _engine(*, async_optimizer: bool = True, overlap: bool = True, **rp: Any) -> Any:
    cfg = config(
        devices=2, gas=GAS, lr=1e-2, async_optimizer=async_optimizer,
        roundpipe={**OVERLAP, "overlap_iterations": overlap, **rp}, **CUTS,
    )  # fmt: skip
    return engine_for(tiny_qwen3(0, layers=4), cfg)


def _probe(overlap: bool, wait_s: float, **rp: Any) -> dict[str, bool | None]:
    """Train 3 steps; hold iteration 2's last backward (the prefix recompute of its last
    micro-batch) and step 2's first optimizer finish until iteration 3's first forward has
    started, for at most ``wait_s``. Returns whether each hold saw that start."""
    engine = _engine(overlap=overlap, **rp)
    stages = engine.planner.stages
    assert stages.has_prefix and 0 in stages.bwd[-1]  # the last backward recomputes layer 0
    started = threading.Event()  # iteration 3's first forward is running
    seen: dict[str, bool | None] = {"backward": None, "optimizer": None}
    calls = {"n": 0}
    call, finish = engine._executor._call, engine.stepper._finish

    def traced_call(ctx: Any, device: Any, layer: int, state: Any, mb: int, w: Any) -> Any:
        step = ctx.spec.step
        if (step, layer, mb) == (3, 0, 0):
            started.set()
        if (step, layer, mb) == (2, 0, GAS - 1):
            calls["n"] += 1
            if calls["n"] == 2:  # 1: the forward F0, 2: the last backward's recompute
                seen["backward"] = started.wait(timeout=wait_s)
        return call(ctx, device, layer, state, mb, w)

    def held_finish(layers: list[int], step: int, **kw: Any) -> None:
        if step == 2 and seen["optimizer"] is None:
            seen["optimizer"] = started.wait(timeout=wait_s)
        finish(layers, step, **kw)

    engine._executor._call = traced_call
    engine.stepper._finish = held_finish
    try:
        it = iter(_batches(3 * GAS))
        for _ in range(3):
            engine.train_batch(it)
        engine.synchronize()
    finally:
        engine.destroy()
    return seen


@pytest.mark.parametrize("on_nonfinite", ["ignore", "raise", "skip"])
def test_next_forward_starts_before_the_last_backward_and_the_optimizer_end(
    on_nonfinite: str,
) -> None:
    """Also under the default non-finite guard ("raise"), whose skip decision for step 2 is
    only known once its last gradient landed: its boundary is applied in flight."""
    seen = _probe(overlap=True, wait_s=60, on_nonfinite=on_nonfinite)
    assert seen == {"backward": True, "optimizer": True}, seen


def test_control_without_overlap_the_next_forward_waits_for_the_last_backward() -> None:
    """The probe can fail: drained iterations never start iteration 3 during iteration 2's
    backward (the optimizer of step 2 does run during iteration 3 in async mode either way)."""
    seen = _probe(overlap=False, wait_s=2)
    assert seen["backward"] is False, seen


def test_overlap_is_on_unless_a_late_skip_could_not_be_undone() -> None:
    for rp, expected in (
        ({}, True),
        ({"on_nonfinite": "raise"}, True),  # boundaries applied in flight (engine_boundary.py)
        ({"on_nonfinite": "skip"}, True),
        ({"overlap_iterations": False}, False),
    ):
        engine = _engine(**rp)
        try:
            assert engine._overlap is expected, rp
        finally:
            engine.destroy()
    for rp, expected in (
        ({}, True),  # default: an overflow found late re-runs the next run
        ({"overlap_iterations": False}, False),
    ):
        cfg = config(devices=2, gas=GAS, roundpipe=rp, fp16={"enabled": True}, **CUTS)
        engine = engine_for(tiny_qwen3(0, layers=4), cfg)
        try:
            assert engine._overlap is expected, rp
        finally:
            engine.destroy()
    engine = engine_for(tiny_qwen3(0, layers=4), config(devices=2, gas=GAS, **CUTS))
    try:
        assert engine._overlap is True  # the default on_nonfinite "raise" overlaps
    finally:
        engine.destroy()

    class Opaque:  # a client scheduler whose state cannot be put back after a late skip
        def step(self, **_: Any) -> None:
            pass

        def get_last_lr(self) -> list[float]:
            return [1e-2]

    model = tiny_qwen3(0, layers=4)
    for rp, expected in (({}, False), ({"overlap_iterations": True}, False), (OVERLAP, True)):
        cfg = config(devices=2, gas=GAS, roundpipe=rp, **CUTS)
        engine, *_ = rp_engine.initialize(model=model, config=cfg, lr_scheduler=Opaque())
        try:
            assert engine._overlap is expected, rp
        finally:
            engine.destroy()


def test_dropout_on_cpu_devices_is_not_disturbed_by_the_callers_own_random_numbers() -> None:
    """CPU devices seed torch's one CPU generator for each dropout layer; a script drawing from
    it between train_batch calls (a shuffling sampler, torch.randint batches) ran concurrently
    with the step in flight: the backward's recomputed masks differed from the forward's and
    the script's own stream was rewound (found by the overlap soak with dropout). Such an
    engine drains each call: losses, weights and the script's draws equal the drained ones."""
    runs = []
    for overlap in (None, False):  # None: the default
        cfg = config(
            devices=2, gas=GAS, lr=1e-2, async_optimizer=True,
            roundpipe={**OVERLAP, "overlap_iterations": overlap}, **CUTS,
        )  # fmt: skip
        engine = engine_for(tiny_qwen3(0, layers=4, dropout=0.2), cfg)
        overlapped = engine._overlap
        torch.manual_seed(123)
        losses, drawn = [], []
        try:
            it = iter(_batches(5 * GAS))
            for _ in range(5):
                losses.append(float(engine.train_batch(it)))
                drawn.append(float(torch.randn(100_000).sum()))  # the script's own randomness
            engine.synchronize()
            weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
        finally:
            engine.destroy()
        runs.append((losses, drawn, weights, overlapped))
    (l1, d1, w1, o1), (l2, d2, w2, _) = runs
    assert l1 == l2 and d1 == d2
    for k in w1:
        assert torch.equal(w1[k], w2[k]), k
    assert o1 is False


@pytest.mark.parametrize("async_optimizer", [True, False])
def test_grad_norm_is_the_last_steps_and_step_report_does_not_wait(async_optimizer: bool) -> None:
    """``get_global_grad_norm()`` (and the stats, the timeline) describe the step the last call
    ran, as DeepSpeed's, finishing it if it is in flight; ``step_report()`` gives the newest
    finished step without finishing anything."""
    drained, overlapped = (
        _engine(async_optimizer=async_optimizer, overlap=o, profile_iterations=0)
        for o in (False, True)
    )
    try:
        norms = []
        for i, batches in enumerate(_batches(2 * GAS)[j : j + GAS] for j in (0, GAS)):
            drained.train_batch(iter(batches))
            overlapped.train_batch(iter(batches))
            assert overlapped._inflight is not None  # step i+1 is still running
            report = overlapped.step_report()
            assert overlapped._inflight is not None  # ... and the report did not finish it
            assert (report is None) if i == 0 else (report.step == i), report
            if report is not None:
                assert report.grad_norm == pytest.approx(norms[-1], rel=1e-6)
            norm = overlapped.get_global_grad_norm()
            assert overlapped._inflight is None  # the norm's step was finished for it
            assert norm == pytest.approx(drained.get_global_grad_norm(), rel=1e-6)
            assert norm is not None and norm not in norms
            norms.append(norm)
            after = overlapped.step_report()
            assert after is not None and after.step == i + 1
            assert after.timeline == overlapped.last_timeline() != []
    finally:
        drained.destroy()
        overlapped.destroy()


def test_sync_mode_with_overlap_matches_plain_pytorch() -> None:
    model, ref = tiny_qwen3(0, layers=4), tiny_qwen3(0, layers=4)
    batches = _batches(4 * GAS)
    expected = reference_losses(ref, batches, steps=4, gas=GAS, lr=1e-2)
    cfg = config(devices=2, gas=GAS, lr=1e-2, roundpipe=OVERLAP, **CUTS)
    engine = engine_for(model, cfg)
    try:
        assert engine._overlap
        it = iter(batches)
        got = [float(engine.train_batch(it)) for _ in range(4)]
        assert engine._inflight is not None  # the last step is still in flight
        assert engine.global_steps == 4 and engine.micro_steps == 4 * GAS
        engine.synchronize()
        assert engine._inflight is None
    finally:
        engine.destroy()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert_same_weights(model, ref)


def test_eval_and_module_between_overlapped_steps_see_the_drained_weights() -> None:
    """eval_batch and engine.module finish the run in flight first: the same numbers as an
    engine that never overlapped, and the training after them goes on identically."""
    results = []
    for overlap in (True, False):
        engine = _engine(overlap=overlap)
        try:
            it, evals = iter(_batches(4 * GAS)), _batches(GAS, seed=900)
            losses = [float(engine.train_batch(it)) for _ in range(2)]
            ev = float(engine.eval_batch(iter(evals)))
            weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
            losses += [float(engine.train_batch(it)) for _ in range(2)]
            engine.synchronize()
            final = {k: v.clone() for k, v in engine.module.state_dict().items()}
        finally:
            engine.destroy()
        results.append((losses, ev, weights, final))
    (l1, e1, w1, f1), (l2, e2, w2, f2) = results
    assert l1 == l2 and e1 == e2
    for k in w1:
        assert torch.equal(w1[k], w2[k]) and torch.equal(f1[k], f2[k]), k


def test_checkpoint_resume_with_overlap_matches_the_uninterrupted_run(tmp_path) -> None:
    batches = _batches(6 * GAS)
    straight = _engine()
    try:
        it = iter(batches)
        want = [float(straight.train_batch(it)) for _ in range(3)]
        straight.synchronize()  # the drain save_checkpoint does: the staleness window restarts
        want += [float(straight.train_batch(it)) for _ in range(3)]
    finally:
        straight.destroy()
    a = _engine()
    try:
        it = iter(batches)
        got = [float(a.train_batch(it)) for _ in range(3)]
        a.save_checkpoint(str(tmp_path))  # drains: the step in flight is saved
        assert a._inflight is None and a.global_steps == 3
    finally:
        a.destroy()
    b = _engine()
    try:
        b.load_checkpoint(str(tmp_path))
        it = iter(batches[3 * GAS :])
        got += [float(b.train_batch(it)) for _ in range(3)]
    finally:
        b.destroy()
    assert got[:3] == want[:3]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_destroy_applies_the_step_in_flight() -> None:
    model, ref = tiny_qwen3(0, layers=4), tiny_qwen3(0, layers=4)
    batches = _batches(3 * GAS)
    reference_losses(ref, batches, steps=3, gas=GAS, lr=1e-2, staleness=1)
    cfg = config(devices=2, gas=GAS, lr=1e-2, async_optimizer=True, roundpipe=OVERLAP, **CUTS)
    engine = engine_for(model, cfg)
    it = iter(batches)
    for _ in range(3):
        engine.train_batch(it)
    assert engine._inflight is not None
    engine.destroy()  # no synchronize: destroy finishes run 3 and applies step 3
    assert_same_weights(model, ref)


def test_collected_engine_applies_the_step_in_flight() -> None:
    """Without destroy(): the finaliser (at collection or exit) finishes the run in flight."""
    import gc

    model, ref = tiny_qwen3(0, layers=4), tiny_qwen3(0, layers=4)
    batches = _batches(3 * GAS)
    reference_losses(ref, batches, steps=3, gas=GAS, lr=1e-2, staleness=1)
    cfg = config(devices=2, gas=GAS, lr=1e-2, async_optimizer=True, roundpipe=OVERLAP, **CUTS)
    engine = engine_for(model, cfg)
    it = iter(batches)
    for _ in range(3):
        engine.train_batch(it)
    finalizer = engine._finalizer
    del engine, it
    gc.collect()
    if finalizer.alive:  # still referenced by a queued closure: run it as exit would
        finalizer()
    assert_same_weights(model, ref)


@pytest.mark.parametrize("where", ["tail", "start"])
def test_a_failed_run_discards_the_steps_in_flight_and_training_goes_on(where: str) -> None:
    engine = _engine()
    call = engine._executor._call
    fail = {"armed": True}

    # "tail": iteration 2's last backward (a recompute, after its losses were returned);
    # "start": iteration 3's first forward
    target = {"tail": (2, 0, GAS - 1, True), "start": (3, 0, 0, False)}[where]

    def failing(ctx: Any, device: Any, layer: int, state: Any, mb: int, w: Any) -> Any:
        if fail["armed"] and (ctx.spec.step, layer, mb, torch.is_grad_enabled()) == target:
            fail["armed"] = False
            raise ValueError("injected")
        return call(ctx, device, layer, state, mb, w)

    engine._executor._call = failing
    try:
        it = iter(_batches(6 * GAS))
        engine.train_batch(it)
        engine.train_batch(it)
        with pytest.raises(Exception, match="injected"):
            engine.train_batch(it)
        assert engine._inflight is None
        # the step counted when its losses were returned is counted as skipped
        assert engine.skipped_steps == (1 if where == "tail" else 0)
        steps = engine.global_steps
        losses = [float(engine.train_batch(it)) for _ in range(2)]
        engine.synchronize()
        assert engine.global_steps == steps + 2
        assert all(torch.isfinite(torch.tensor(losses)))
        for hp in engine.store.owned_params():
            torch.testing.assert_close(hp.param.detach(), hp.master, rtol=0, atol=0)
    finally:
        engine.destroy()


class _RaiseInBackward(torch.autograd.Function):
    """Identity forward; its backward raises (a device failure inside a backward action)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("injected backward failure")


def _fail_backward_of_iteration(model: Any, iteration: int) -> None:
    """Make the backward through layer 1's MLP output raise in iteration ``iteration``'s first
    micro-batch. Only backward recomputes run that MLP with autograd on (forwards run under
    no_grad, the head stage holds no block with these cuts): GAS such calls per iteration. The
    hook sits on the host module; the device replicas share its hook dict (runtime/replica.py)."""
    calls = {"n": 0}

    def hook(_module: Any, _args: Any, out: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return out
        calls["n"] += 1
        return _RaiseInBackward.apply(out) if calls["n"] == GAS * (iteration - 1) + 1 else out

    model.model.layers[1].mlp.register_forward_hook(hook)


def _in_thread(fn: Any, timeout_s: float) -> tuple[bool, Any]:
    """Run ``fn`` in a daemon thread for at most ``timeout_s``: (returned, result or exception).
    The timeout only detects a hang (a healthy call takes well under a second here)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["out"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["out"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive(), box.get("out")


@pytest.mark.parametrize("mode", ["sync", "async", "async_one_buffer"])
def test_a_failure_in_an_iterations_tail_raises_and_destroy_returns(mode: str, monkeypatch) -> None:
    """Iteration 3's backward fails after its losses were returned; call 4 finishes run 3 with
    run 4 already issued. Run 4's uploads wait for a weight version step 3 was to produce (sync:
    w_3; async with one weight buffer: w_2, published at run 3's layer_ready), so the reset of
    the devices must come after those waits are woken (cancel, fail, then reset), or call 4
    hangs. Call 4 raises the device error, the in-flight step counts as skipped, training goes
    on, and ``destroy()`` returns."""
    import rp_engine.model.host_store as host_store

    if mode == "async_one_buffer":  # no room for second buffers, as in the tight-memory test
        monkeypatch.setattr(host_store, "_second_arena_fits", lambda nbytes: False)
    model = tiny_qwen3(0, layers=4)
    _fail_backward_of_iteration(model, iteration=3)
    cfg = config(
        devices=2, gas=GAS, lr=1e-2, async_optimizer=mode != "sync", roundpipe=OVERLAP, **CUTS
    )
    engine = engine_for(model, cfg)
    assert engine._overlap
    assert engine.store.weight_copies == (2 if mode == "async" else 1)
    it = iter(_batches(6 * GAS))
    results: list[Any] = []

    def train() -> list[Any]:
        for _ in range(6):
            try:
                results.append(float(engine.train_batch(it)))
            except Exception as exc:  # noqa: BLE001 - recorded: the failing call is asserted
                results.append(exc)
        return results

    returned, _ = _in_thread(train, timeout_s=60)
    if not returned:  # wake the hung waits so the rest of the session can go on
        engine.stepper.cancel(RuntimeError("test: hang"))
        engine.store.fail(RuntimeError("test: hang"))
        pytest.fail(f"a training call hung ({mode}); calls done: {results}")
    error = results[3]
    assert isinstance(error, DeviceError), results
    assert "injected backward failure" in repr(error.__cause__) + str(error)
    assert all(isinstance(x, float) and x == x for i, x in enumerate(results) if i != 3), results
    assert engine.skipped_steps == 1  # step 3, counted when its losses were returned
    assert engine.global_steps == 5  # the failed call 4 counts no step (as drained)
    returned, out = _in_thread(engine.destroy, timeout_s=60)
    assert returned, f"destroy() hung after the failure ({mode})"
    assert out is None
    for hp in engine.store.owned_params():  # destroy published the last applied step
        torch.testing.assert_close(hp.param.detach(), hp.master, rtol=0, atol=0)


_EXIT_SCRIPT = """
import sys, weakref
import torch
from engine_helpers import config, engine_for
from models import random_batch, tiny_qwen3

model = tiny_qwen3(0, layers=4)
out = sys.argv[1]
# Created before the engine, so at exit it runs after the engine's own finaliser (newest first).
class Anchor:
    pass


anchor = Anchor()
weakref.finalize(anchor, lambda: torch.save(model.state_dict(), out))
cfg = config(devices=2, gas=2, lr=1e-2, async_optimizer=True, roundpipe={"on_nonfinite": "ignore"},
             fwd_cuts=[2, 2], bwd_cuts=[0, 2, 2])
engine = engine_for(model, cfg)
it = iter([random_batch(128, batch=2, seq=12, seed=300 + i) for i in range(6)])
for _ in range(3):
    engine.train_batch(it)
assert engine._inflight is not None
print("LAST LINE", flush=True)  # no destroy(): the step in flight is applied at exit
"""


def test_script_ending_with_a_step_in_flight_applies_it_and_exits_cleanly(tmp_path) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script, out = tmp_path / "train.py", tmp_path / "weights.pt"
    script.write_text(_EXIT_SCRIPT)
    # the caller's PYTHONPATH stays after ours (tests/support/avx2_cpu_adam.py loads its build
    # through it)
    paths = [str(root), str(root / "tests" / "support"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    r = subprocess.run(
        [sys.executable, str(script), str(out)], cwd=root, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "LAST LINE"
    ref = tiny_qwen3(0, layers=4)
    reference_losses(ref, _batches(3 * GAS), steps=3, gas=GAS, lr=1e-2, staleness=1)
    got = tiny_qwen3(0, layers=4)
    got.load_state_dict(torch.load(out, weights_only=True))  # strict: the same entries
    assert_same_weights(got, ref)
    for name, value in ref.named_buffers():
        torch.testing.assert_close(got.get_buffer(name), value, rtol=1e-4, atol=1e-5, msg=name)


def test_tight_host_memory_overlaps_with_one_buffer_and_keeps_staleness_one(monkeypatch) -> None:
    """Without room for second buffers (weights and gradients), async overlap still reads
    exactly w_{t-1} in iteration t+1: w_{t-1} is published at iteration t's layer_ready, and
    a download waits for the previous step's optimizer."""
    import rp_engine.model.host_store as host_store

    monkeypatch.setattr(host_store, "_second_arena_fits", lambda nbytes: False)
    model, ref = tiny_qwen3(0, layers=4), tiny_qwen3(0, layers=4)
    batches = _batches(5 * GAS)
    expected = reference_losses(ref, batches, steps=5, gas=GAS, lr=1e-2, staleness=1)
    cfg = config(devices=2, gas=GAS, lr=1e-2, async_optimizer=True, roundpipe=OVERLAP, **CUTS)
    engine = engine_for(model, cfg)
    try:
        assert engine._overlap and engine.store.weight_copies == 1
        assert not engine.store.double_buffered
        it = iter(batches)
        got = [float(engine.train_batch(it)) for _ in range(5)]
        engine.synchronize()
    finally:
        engine.destroy()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert_same_weights(model, ref)


# ------------------------------------------------------------- non-finite steps in flight
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 2e-2,
                                          "warmup_num_steps": 10}}  # fmt: skip


def _poison_gradients(engine: Any, step: int) -> None:
    """Iteration ``step``'s gradients become non-finite while its losses stay finite: the
    backward through layer 1's output is multiplied by inf (found only when the step closes)."""
    call = engine._executor._call

    def poisoned(ctx: Any, device: Any, layer: int, state: Any, mb: int, w: Any) -> Any:
        out = call(ctx, device, layer, state, mb, w)
        if ctx.spec.step == step and layer == 1 and torch.is_grad_enabled():
            for t in out.values() if isinstance(out, dict) else [out]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(lambda g: g * float("inf"))
        return out

    engine._executor._call = poisoned


@pytest.mark.parametrize("async_optimizer", [True, False])
@pytest.mark.parametrize("mode", ["skip", "raise"])
def test_a_step_skipped_late_ends_where_deepspeed_would(mode: str, async_optimizer: bool) -> None:
    """Step 2 has finite losses and an infinite gradient norm. With overlap its boundary was
    applied as applied (LR stepped, counted) before the step closed; the close puts the schedule
    and counters back: weights (bitwise), LR, counters and later steps equal the drained
    engine's, and "raise" raises one call later, naming step 2."""
    runs = {}
    for overlap in (True, False):
        cfg = config(
            devices=2, gas=GAS, lr=1e-2, async_optimizer=async_optimizer, scheduler=WARMUP,
            roundpipe={"on_nonfinite": mode, "overlap_iterations": overlap}, **CUTS,
        )  # fmt: skip
        engine = engine_for(tiny_qwen3(0, layers=4), cfg)
        assert engine._overlap is overlap
        _poison_gradients(engine, step=2)
        errors, losses = [], []
        try:
            it = iter(_batches(5 * GAS))
            for call in range(1, 6):
                try:
                    losses.append(float(engine.train_batch(it)))
                except NonFiniteError as exc:
                    errors.append((call, str(exc)))
            engine.synchronize()
            runs[overlap] = {
                "errors": errors, "losses": losses, "lr": engine.get_lr(),
                "counters": (engine.global_steps, engine.skipped_steps, engine.micro_steps),
                "weights": {k: v.clone() for k, v in engine.module.state_dict().items()},
            }  # fmt: skip
        finally:
            engine.destroy()
    late, drained = runs[True], runs[False]
    assert drained["counters"] == late["counters"] == (5, 1, 5 * GAS)
    assert late["lr"] == drained["lr"]
    for k, w in drained["weights"].items():
        assert torch.equal(w, late["weights"][k]), k
    if mode == "raise":
        assert [c for c, _ in drained["errors"]] == [2]
        assert [c for c, _ in late["errors"]] == [3]  # raised by the call that finished step 2
        assert "step 2: non-finite gradient norm" in late["errors"][0][1]
        # returned losses: drained calls 1, 3, 4, 5; late calls 1, 2, 4, 5 (3 raised instead)
        assert drained["losses"][0] == late["losses"][0]
        assert drained["losses"][2:] == late["losses"][2:]
    else:
        assert not late["errors"] and late["losses"] == drained["losses"]


@pytest.mark.parametrize("drain", [False, True])
def test_a_late_skips_error_is_not_lost_when_the_next_step_raises_at_once(drain: bool) -> None:
    """Under "raise", step 2 is skipped late (finite losses, infinite gradient norm) and step 3
    has a NaN loss. Drained, call 2 raises for step 2 and call 3 for step 3. Overlapped, both
    errors come due at call 3 (step 2's when its close was found, by call 3 itself or by the
    drain before it; step 3's at once): call 3 raises one error naming both steps, never only
    step 3's (found by tests/test_overlap_soak.py)."""
    engine = _engine(on_nonfinite="raise")
    _poison_gradients(engine, step=2)
    try:
        it = iter(_batches(2 * GAS))
        engine.train_batch(it)
        engine.train_batch(it)  # step 2: the late skip is not known yet
        if drain:
            engine.get_global_grad_norm()  # finishes step 2: the error waits for a train call
        good, bad = _batches(2, seed=700)
        bad = {**bad, "labels": torch.full((2, 12), -100)}  # loss 0/0 = NaN
        with pytest.raises(NonFiniteError) as raised:
            engine.train_batch(iter([good, bad]))
        text = str(raised.value)
        assert "step 2: non-finite gradient norm" in text, text
        assert "step 3: non-finite loss in micro-batch(es) 1" in text, text
        assert (engine.global_steps, engine.skipped_steps) == (3, 2)
        engine.train_batch(iter(_batches(GAS, seed=800)))  # nothing else owed
    finally:
        engine.destroy()


@pytest.mark.parametrize("end", ["destroy", "save_then_destroy", "finaliser"])
def test_a_late_skip_after_the_last_training_call_is_logged_under_raise(
    end: str, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under "raise" the last call's step 2 is skipped late. Drained, that call raised; with
    overlap no training call is left to raise it, so the shutdown that finds it (destroy, a
    checkpoint's drain then destroy, or the exit finaliser without destroy) logs the error."""
    import gc
    import logging

    engine = _engine(on_nonfinite="raise")
    _poison_gradients(engine, step=2)
    it = iter(_batches(2 * GAS))
    engine.train_batch(it)
    engine.train_batch(it)
    with caplog.at_level(logging.ERROR, logger="rp_engine"):
        if end == "finaliser":
            finalizer = engine._finalizer
            del engine, it
            gc.collect()
            if finalizer.alive:  # still referenced by a queued closure: run it as exit would
                finalizer()
        else:
            if end == "save_then_destroy":
                engine.save_checkpoint(str(tmp_path))  # the drain finds the skip: owed
            assert engine.skipped_steps == (1 if end == "save_then_destroy" else 0)
            engine.destroy()
            assert engine.skipped_steps == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "step 2: non-finite gradient norm" in errors[0], errors


def test_a_non_finite_loss_in_flight_is_skipped_at_once_and_at_shutdown() -> None:
    """A non-finite loss is known when train_batch returns: the boundary is a skipped one at
    once, and the run's close (here by the exit finaliser, no destroy) skips the step."""
    import gc

    results = []
    for overlap in (True, False):
        engine = _engine(overlap=overlap, on_nonfinite="skip")
        model = engine._module
        it = iter(_batches(2 * GAS))
        engine.train_batch(it)
        bad = [next(it), {**next(it), "labels": torch.full((2, 12), -100)}]  # loss 0/0 = NaN
        lr = engine.get_lr()
        loss = engine.train_batch(iter(bad))
        assert not torch.isfinite(loss)
        assert (engine.global_steps, engine.skipped_steps) == (2, 1) and engine.get_lr() == lr
        assert (engine._inflight is not None) is overlap
        finalizer = engine._finalizer
        del engine, it
        gc.collect()
        if finalizer.alive:
            finalizer()
        results.append({k: v.clone() for k, v in model.state_dict().items()})
    for k, w in results[1].items():
        assert torch.equal(w, results[0][k]), k


@pytest.mark.parametrize("async_optimizer", [True, False])
def test_fp16_overflows_in_flight_follow_deepspeeds_loss_scale_sequence(
    async_optimizer: bool,
) -> None:
    """fp16 with a loss scale that overflows at first: each overflow is found when its step
    closes, after the next run was issued with the old scale; that run is issued again with the
    lowered scale. Losses, skips, the scale and the weights equal the drained engine's (whose
    sequence is DeepSpeed's: test_async_optimizer.py, test_checkpoint_interop.py)."""
    runs = {}
    for overlap in (True, False):
        cfg = config(
            devices=2, gas=GAS, lr=1e-2, async_optimizer=async_optimizer, scheduler=WARMUP,
            fp16={"enabled": True, "initial_scale_power": 20, "hysteresis": 1},
            roundpipe={"overlap_iterations": overlap}, **CUTS,
        )  # fmt: skip
        engine = engine_for(tiny_qwen3(0, layers=4), cfg)
        assert engine._overlap is overlap
        reissued: list[int] = []
        if overlap:
            real = engine._reissue

            def counted(cur: Any, spec: Any, real: Any = real, log: list[int] = reissued) -> None:
                log.append(spec.step)
                real(cur, spec)

            engine._reissue = counted
        try:
            it = iter(_batches(6 * GAS))
            losses = [float(engine.train_batch(it)) for _ in range(6)]
            engine.synchronize()
            runs[overlap] = {
                "losses": losses, "scale": engine.optimizer.cur_scale, "lr": engine.get_lr(),
                "counters": (engine.global_steps, engine.skipped_steps),
                "weights": {k: v.clone() for k, v in engine.module.state_dict().items()},
                "reissued": reissued,
            }  # fmt: skip
        finally:
            engine.destroy()
    late, drained = runs[True], runs[False]
    skipped = drained["counters"][1]
    assert 2 <= skipped < 6, "the test needs overflows, then applied steps"
    assert late["counters"] == drained["counters"] and late["scale"] == drained["scale"]
    assert late["losses"] == drained["losses"] and late["lr"] == drained["lr"]
    for k, w in drained["weights"].items():
        assert torch.equal(w, late["weights"][k]), k
    assert len(late["reissued"]) == skipped  # one re-run per overflow (the last one drained)


@pytest.mark.parametrize("async_optimizer", [True, False])
def test_a_torch_scheduler_stepped_in_flight_does_not_warn_of_its_order(
    async_optimizer: bool,
) -> None:
    """With overlap the boundary (the scheduler's step) of step t is applied while step t's
    optimizer has yet to run; torch's "lr_scheduler.step() before optimizer.step()" warning is
    for scripts that order them wrongly, not for an engine-driven schedule, and must not fire."""
    cfg = config(
        devices=2, gas=GAS, lr=1e-2, async_optimizer=async_optimizer, roundpipe=OVERLAP,
        scheduler={"type": "StepLR", "params": {"step_size": 1, "gamma": 0.5}}, **CUTS,
    )  # fmt: skip
    engine = engine_for(tiny_qwen3(0, layers=4), cfg)
    try:
        assert engine._overlap
        it = iter(_batches(2 * GAS))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                engine.train_batch(it)
            engine.synchronize()
        order = [w for w in caught if "lr_scheduler.step()" in str(w.message)]
        assert not order, [str(w.message) for w in order]
        assert engine.get_lr() == [pytest.approx(1e-2 * 0.25)]
    finally:
        engine.destroy()
