"""Faults (issue 13 item 5): nothing is lost.

- A failed optimizer step is all-or-nothing: an exception while the host optimizer steps layer k
  of step t, after layers 0..k-1 have stepped (and layer k itself half-way), or a device failure
  after per-layer steps were issued, leaves every layer as after step t-1: fp32 masters,
  optimizer moments and step counts, and the compute weights the devices read. Training then
  goes on (optim/step_journal.py).
- ``initialize`` refuses a host that would run out of memory (host_preflight.py).
- kill -9 during ``save_checkpoint`` leaves the previous checkpoint loadable (the child process
  is tests/support/fault_child.py).
(SIGTERM/Ctrl-C in rp-train: tests/engine/test_cli_train.py::test_signal_saves_a_checkpoint_*.)
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import pytest
import torch
from engine_helpers import config, engine_for
from models import random_batch, tiny_qwen3

from rp_engine.optim.step_journal import StepJournal, journal_enabled

GAS = 2
CUTS = {"fwd_cuts": [2, 2], "bwd_cuts": [0, 2, 2]}
LAYERS = 4  # decoder layers; the engine's layer sequence adds the embedding and the head


def _batches(n: int, seed: int = 300) -> list[dict[str, torch.Tensor]]:
    return [random_batch(128, batch=2, seq=12, seed=seed + i) for i in range(n)]


def _engine(*, async_optimizer: bool, **rp: Any) -> Any:
    rp.setdefault("step_journal", "on")  # (the default takes it when host memory allows)
    cfg = config(devices=2, gas=GAS, lr=1e-2, async_optimizer=async_optimizer, roundpipe=rp, **CUTS)
    return engine_for(tiny_qwen3(0, layers=LAYERS), cfg)


def _snapshot(engine: Any) -> dict[str, torch.Tensor]:
    """Masters, moments, step counts and compute weights, by name (copies)."""
    out: dict[str, torch.Tensor] = {}
    state = engine.optimizer.state
    for hp in engine.store.owned_params():
        out[f"master {hp.name}@{hp.layer}"] = hp.master.clone()
        out[f"weight {hp.name}@{hp.layer}"] = hp.param.detach().clone()
        for key, value in state.get(hp.master, {}).items():
            out[f"{key} {hp.name}@{hp.layer}"] = torch.as_tensor(value).clone()
    return out


def _assert_same(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"changed by the failed step: {changed[:6]}"


def _fail_half_way(engine: Any) -> dict[str, int]:
    """Make the optimizer raise in the layer after half of them have stepped, after that layer
    stepped its first parameter (so it is half-stepped itself). Returns the failing layer."""
    real = engine.optimizer.step_params
    layers = len(engine.store.layers)
    target = {"layer": layers // 2}
    calls = {"n": 0}
    owner = {id(hp.master): hp.layer for hp in engine.store.owned_params()}

    def failing(params: list[torch.Tensor], **kw: Any) -> None:
        calls["n"] += 1
        if owner[id(params[0])] == target["layer"]:
            real(params[:1], **kw)  # half-way through the layer
            raise ValueError("injected optimizer fault")
        real(params, **kw)

    engine.optimizer.step_params = failing
    target["real"] = real  # type: ignore[assignment]
    return target


@pytest.mark.parametrize("async_optimizer", [False, True], ids=["sync", "async"])
def test_failed_step_changes_no_layer_and_training_goes_on(async_optimizer: bool) -> None:
    engine = _engine(async_optimizer=async_optimizer)
    batches = iter(_batches(8 * GAS))
    try:
        for _ in range(2):  # moments exist before the faulty step
            engine.train_batch(batches)
        engine.synchronize()
        before = _snapshot(engine)
        fault = _fail_half_way(engine)
        layer = fault["layer"]
        stepped = []
        real_record = engine.stepper.journal.record
        engine.stepper.journal.record = lambda s, la, m: (stepped.append(la), real_record(s, la, m))

        with pytest.raises(RuntimeError, match=rf"optimizer step failed on layer {layer} .*undone"):
            engine.train_batch(batches)  # sync: raises here
            engine.synchronize()  # async: the step runs after train_batch returned
        assert sorted(stepped) == list(range(layer + 1))  # half the layers had stepped
        _assert_same(before, _snapshot(engine))

        engine.optimizer.step_params = fault["real"]
        engine.train_batch(batches)  # the next step works, from the previous step's weights
        engine.synchronize()
        after = _snapshot(engine)
        assert all(not torch.equal(before[k], after[k]) for k in before if k.startswith("master"))
    finally:
        engine.destroy()


def test_async_fault_surfacing_in_the_next_run_changes_no_layer() -> None:
    """Async: step t fails while iteration t+1 runs; that run fails (it cannot publish step t's
    weights) after it had published step t's weights of the layers that did step; those
    compute weights go back too."""
    engine = _engine(async_optimizer=True)
    batches = iter(_batches(8 * GAS))
    try:
        for _ in range(2):
            engine.train_batch(batches)
        engine.synchronize()
        before = _snapshot(engine)
        fault = _fail_half_way(engine)
        engine.train_batch(batches)  # step 3 is issued; it fails on the optimizer thread
        with pytest.raises(RuntimeError, match=f"layer {fault['layer']}"):
            engine.train_batch(batches)
        _assert_same(before, _snapshot(engine))
        engine.optimizer.step_params = fault["real"]
        loss = engine.train_batch(batches)
        engine.synchronize()
        assert torch.isfinite(loss)
    finally:
        engine.destroy()


def test_retried_sync_step_equals_an_uninterrupted_run() -> None:
    """Nothing is lost: after a failed step, the same batches give the weights of a run that
    never failed, bit for bit (Adam's moments and step count were put back too)."""
    data = _batches(3 * GAS)
    straight = _engine(async_optimizer=False)
    engine = _engine(async_optimizer=False)
    try:
        for e in (straight, engine):
            for i in range(2):
                e.train_batch(iter(data[i * GAS : (i + 1) * GAS]))
        fault = _fail_half_way(engine)
        last = data[2 * GAS :]
        with pytest.raises(RuntimeError, match="undone"):
            engine.train_batch(iter(last))
        engine.optimizer.step_params = fault["real"]
        assert engine.global_steps == 2
        got, want = engine.train_batch(iter(last)), straight.train_batch(iter(last))
        assert float(got) == float(want)
        _assert_same(_snapshot(straight), _snapshot(engine))
    finally:
        engine.destroy()
        straight.destroy()


@pytest.mark.parametrize("all_stepped", [False, True], ids=["some-layers", "every-layer"])
def test_device_failure_after_layers_stepped_is_undone(all_stepped: bool) -> None:
    """Without clipping or the non-finite guard each layer steps as soon as its gradient has
    landed, while the backward goes on: a device failure after that must undo those layers
    (even all of them: the run failed, so the step was not counted)."""
    engine = _engine(async_optimizer=False, on_nonfinite="ignore")
    batches = iter(_batches(6 * GAS))
    try:
        assert engine.stepper.immediate
        engine.train_batch(batches)
        before = _snapshot(engine)
        ready = engine.stepper.layer_ready
        issued = []

        def fail_last(layer: int, step: int | None = None) -> None:
            last = len(issued) == len(engine.store.layers) - 1  # the last gradient to land
            if not last or all_stepped:
                issued.append(layer)
                ready(layer, step)
            if last:
                engine.stepper.wait_all()  # the issued layers' steps have run
                raise RuntimeError("injected device fault")

        engine.stepper.layer_ready = fail_last
        with pytest.raises(RuntimeError, match="injected device fault"):
            engine.train_batch(batches)
        assert len(issued) == len(engine.store.layers) - (0 if all_stepped else 1)
        _assert_same(before, _snapshot(engine))
        engine.stepper.layer_ready = ready
        engine.train_batch(batches)
        engine.synchronize()
    finally:
        engine.destroy()


def test_without_a_journal_the_error_stays() -> None:
    # drained: the failed step's own call raises (with overlap, the next one: test_async_optimizer)
    engine = _engine(async_optimizer=False, step_journal="off", overlap_iterations=False)
    try:
        assert engine.stepper.journal is None
        _fail_half_way(engine)
        batches = iter(_batches(3 * GAS))
        with pytest.raises(RuntimeError, match="optimizer step failed on layer") as first:
            engine.train_batch(batches)
        assert "undone" not in str(first.value)
        with pytest.raises(RuntimeError, match="optimizer step failed on layer"):
            engine.train_batch(batches)
    finally:
        engine.destroy()


def test_journal_by_default_only_when_host_memory_allows() -> None:
    gib = 2**30
    assert journal_enabled("if_memory_allows", gib, pending=0, available=3 * gib)
    assert not journal_enabled("if_memory_allows", gib, pending=gib, available=3 * gib)
    assert journal_enabled("on", gib, available=0)
    assert not journal_enabled("off", gib, available=100 * gib)
    with pytest.raises(ValueError, match="step_journal='yes'"):
        journal_enabled("yes", gib)


def test_journal_restores_state_created_by_the_failed_step() -> None:
    """A master stepped for the first time in the failed step had no optimizer state: it has
    none again afterwards, and a reused backup buffer holds the newest copy."""
    master = torch.ones(4)
    opt = torch.optim.Adam([master], lr=0.1)
    journal = StepJournal(opt)
    journal.record(1, 0, [master])
    assert journal.rollback(2) == set()  # not the recorded step: nothing restored
    journal.record(1, 0, [master])
    master.grad = torch.ones(4)
    opt.step()
    assert journal.rollback(1) == {0}
    assert not opt.state.get(master) and torch.equal(master, torch.ones(4))
    opt.step()  # a good step 1, committed
    journal.record(2, 0, [master])
    journal.commit(2)
    after_one = master.clone(), {k: v.clone() for k, v in opt.state[master].items()}
    journal.record(3, 0, [master])
    opt.step()
    journal.rollback(3)
    assert torch.equal(master, after_one[0])
    assert all(torch.equal(opt.state[master][k], v) for k, v in after_one[1].items())


# --- host memory preflight at initialize ---------------------------------------------------------
def test_initialize_refuses_a_host_that_would_run_out_of_memory(monkeypatch) -> None:
    import rp_engine
    from rp_engine import host_preflight
    from rp_engine.train.preflight import PreflightError

    model = tiny_qwen3(0, layers=2)
    trainable = sum(p.numel() for p in model.parameters())
    need = 16 * trainable  # masters, gradients, moments; the fp32 model is not cast
    monkeypatch.setattr(host_preflight, "available_bytes", lambda: need - 1)
    before = [p.detach().clone() for p in model.parameters()]
    cfg = config(devices=2, roundpipe={"step_journal": "if_memory_allows"})
    with pytest.raises(PreflightError) as err:
        rp_engine.initialize(model=model, config=cfg)
    text = str(err.value)
    assert f"{trainable:,} trainable parameters" in text and "OOM killer" in text
    assert "fp32 masters" in text and "Adam moments" in text and "LoRA" in text
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))

    # "on" forces the journal: 12 B/parameter more, named with its own fix
    monkeypatch.setattr(host_preflight, "available_bytes", lambda: need)
    with pytest.raises(
        PreflightError, match='(?s)step journal.*step_journal "if_memory_allows" or "off"'
    ):
        rp_engine.initialize(model=model, config=config(roundpipe={"step_journal": "on"}))

    engine = engine_for(model, cfg)  # exactly enough: it trains
    engine.destroy()
    off = config(devices=2, roundpipe={"host_preflight": False})
    monkeypatch.setattr(host_preflight, "available_bytes", lambda: 0)
    engine_for(model, off).destroy()  # the check switched off


def test_preflight_counts_the_cast_to_a_wider_dtype() -> None:
    from rp_engine.host_preflight import host_need

    model = tiny_qwen3(0, layers=2).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    assert host_need(model, dtype=torch.float32, journal="off").cast == 2 * n
    assert host_need(model, dtype=torch.bfloat16, journal="off").cast == 0
    for p in model.model.layers.parameters():
        p.requires_grad_(False)
    frozen = sum(p.numel() for p in model.model.layers.parameters())
    assert host_need(model, dtype=torch.bfloat16, journal="on").total == 28 * (n - frozen)


# --- kill -9 during save_checkpoint ------------------------------------------------------------
@functools.cache
def _straight() -> list[float]:
    import fault_child

    return fault_child.straight(6)


@pytest.mark.parametrize(
    ("kill_at", "tag"), [("files", None), ("swap", "ckpt"), ("latest", None)],
    ids=["mid-files", "mid-swap-same-tag", "before-latest"],
)  # fmt: skip
def test_kill_9_during_save_leaves_the_previous_checkpoint_loadable(
    tmp_path: Any, kill_at: str, tag: str | None
) -> None:
    """SIGKILL while save_checkpoint writes (the process blocks at a chosen point, then is
    killed): a fresh process resumes from ``latest`` = the previous checkpoint (step 2) and
    trains on with the losses of a run that was never interrupted."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import fault_child
    from subprocess_helpers import run_json

    here = Path(__file__).resolve().parents[1] / "support"  # fault_child.py
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parents[1])])}
    spec = {"mode": "save", "dir": str(tmp_path), "kill_at": kill_at, "tag": tag}
    proc = subprocess.Popen(
        [sys.executable, str(here / "fault_child.py"), json.dumps(spec)],
        env=env, cwd=here, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "blocked").exists():
            assert proc.poll() is None, proc.stderr.read()[-4000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "the save never reached the kill point"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (tmp_path / "blocked").unlink()
    previous = tag or "global_step2"
    assert (tmp_path / "latest").read_text() == previous
    if kill_at == "latest":
        assert (tmp_path / "global_step4").is_dir()  # complete, but not the latest yet
    if kill_at == "swap":
        assert not (tmp_path / "ckpt").exists()  # renamed aside: the load puts it back

    if kill_at == "files":  # a fresh process, as after a real crash
        got = run_json("fault_child.py", {"mode": "resume", "dir": str(tmp_path), "steps": 4})
    else:  # the same, in this process (a new engine; saves a ~10 s interpreter start)
        got = fault_child.resume(str(tmp_path), 4)
    assert got["global_steps_loaded"] == 2
    assert got["losses"] == pytest.approx(_straight()[2:], rel=0, abs=1e-6)
    assert got["leftovers"] == []  # the next save cleared what the killed one left


def test_the_journal_gives_way_to_overlap_unless_asked_for() -> None:
    """Overlapping iterations keep two steps open, which the journal's undo does not cover: with
    the default the journal goes at the first overlapped train_batch (or imperative loop
    window: it overlaps as train_batch does); an explicit "on" keeps the journal and turns the
    overlap off instead."""
    default = _engine(
        async_optimizer=True, step_journal="if_memory_allows", overlap_iterations=True
    )
    forced = _engine(async_optimizer=True, step_journal="on", overlap_iterations=True)
    try:
        assert default._overlap and default.stepper.journal is not None
        assert not forced._overlap and forced.stepper.journal is not None
        assert default.planner.profile_left == 0  # fixed cuts: no drained profiling calls
        default.train_batch(iter(_batches(GAS)))
        assert default._inflight is not None and default.stepper.journal is None
    finally:
        default.destroy()
        forced.destroy()
    loop = _engine(async_optimizer=True, step_journal="if_memory_allows", overlap_iterations=True)
    try:
        for b in _batches(GAS):  # DeepSpeed's loop: its window overlaps as train_batch's
            loop.backward(loop(**b))
            loop.step()
        assert loop._inflight is not None and loop.stepper.journal is None
    finally:
        loop.destroy()


def test_the_imperative_loop_keeps_an_explicit_journal() -> None:
    """With step_journal "on" the imperative loop drains its windows and keeps the journal:
    its failed step is undone (HF Trainer's loop), training goes on."""
    engine = _engine(async_optimizer=False, step_journal="on", overlap_iterations=True)
    batches = _batches(3 * GAS)
    try:
        assert not engine._overlap and engine.stepper.journal is not None

        def step_of(start: int) -> None:
            for b in batches[start : start + GAS]:
                engine.backward(engine(**b))
                engine.step()

        step_of(0)
        before = _snapshot(engine)
        fault = _fail_half_way(engine)
        with pytest.raises(RuntimeError, match=rf"layer {fault['layer']} .*undone"):
            step_of(GAS)
        _assert_same(before, _snapshot(engine))
        engine.optimizer.step_params = fault["real"]
        step_of(2 * GAS)  # training goes on from the previous step's weights
        engine.synchronize()
        after = _snapshot(engine)
        assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("master"))
    finally:
        engine.destroy()


def test_initialize_with_the_tiers_predicts_host_ram_and_refuses_what_does_not_fit(
    tmp_path, monkeypatch
) -> None:
    """With the NVMe tiers, the need is the pools, staging and devices (plan/host_ram.py), not
    the model's state: the prediction is logged, and a run needing more than is available is
    refused with both numbers before any tier allocates or writes (the model untouched)."""
    import rp_engine
    from rp_engine import host_preflight
    from rp_engine.train.preflight import PreflightError

    model = tiny_qwen3(0, layers=4).to(torch.bfloat16)  # as initialize casts it
    cfg = config(devices=2, async_optimizer=True, bf16={"enabled": True})
    cfg["zero_optimization"] = {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
    }
    engine = engine_for(copy.deepcopy(model), cfg)
    try:
        need = engine.host_ram
        assert need is not None
        parts = dict(need.parts)
        # the gradients are the pool's (8 buffers for 2 devices), never a whole-model arena
        assert parts["gradient tier buffers"] > 0 and "fp32 gradients" not in parts
        assert "optimizer tier buffers" in parts and "parameter tier buffers" in parts
    finally:
        engine.destroy()
    before = [p.detach().clone() for p in model.parameters()]
    monkeypatch.setattr(host_preflight, "available_bytes", lambda: 1)
    with pytest.raises(PreflightError) as err:
        rp_engine.initialize(model=model, config=cfg)
    text = str(err.value)
    assert "with the NVMe tiers this run needs about" in text and "is available" in text
    assert "gradient tier buffers" in text and "every pool at its fewest buffers" in text
    assert not list(tmp_path.rglob("*.swp")), "refused before any tier wrote"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    off = copy.deepcopy(cfg)
    off["roundpipe"]["host_preflight"] = False
    engine_for(model, off).destroy()  # the check switched off


def test_the_pools_shrink_to_fit_the_limit_and_train_the_same(tmp_path, monkeypatch) -> None:
    """Issue 49: a limit that the configured pools exceed but their fewest buffers fit: the
    pools get fewer buffers (a warning says which), the prediction fits the limit, and the
    losses are bit for bit those of the configured pools (the tiers move the same bytes)."""
    from nvme_helpers import nvme_config, run

    from rp_engine import host_preflight
    from rp_engine.plan.host_ram import PoolCounts

    # 512 wide: the pools' buffers differ by tens of MB, more than the process's RSS (the
    # runtime the check measures) moves between two engines
    model = tiny_qwen3(0, layers=4, hidden=512)

    def cfg_in(folder: str) -> dict:
        (tmp_path / folder).mkdir()
        base = config(devices=2, async_optimizer=True)
        return nvme_config(base, str(tmp_path / folder), params=True, buffers=6)

    cfg = cfg_in("a")
    losses, _ = run(copy.deepcopy(model), cfg)
    engine = engine_for(copy.deepcopy(model), cfg)
    try:
        fit = engine.tier_fit
        assert fit is not None and fit.counts == PoolCounts(6, 8, 6)  # what the config asks
        held = fit.least.runtime + fit.least.model
        room = (fit.need.peak + fit.least.peak) // 2 - held  # between the fewest and the asked
    finally:
        engine.destroy()
    monkeypatch.setattr(host_preflight, "available_bytes", lambda: room)
    shrunk_cfg = cfg_in("b")
    engine = engine_for(copy.deepcopy(model), shrunk_cfg)
    try:
        fit = engine.tier_fit
        assert fit is not None
        assert fit.counts != PoolCounts(6, 8, 6)
        assert fit.need.peak - (fit.least.runtime + fit.least.model) <= room
    finally:
        engine.destroy()
    shrunk, _ = run(copy.deepcopy(model), shrunk_cfg)
    assert shrunk == losses
