"""The gradient norm on the device: a layer whose whole step gradient comes down in one download
brings its squared norm, computed on the device, and the host never reads its fp32 buffers
for it (runtime/grad_norm.py). Everywhere else (several downloads per step, tied weights, the
imperative loop) the host pass stays. Same norms, same clipping, same non-finite decisions.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from engine_helpers import AdamSlack, assert_same_weights, config, engine_for
from models import random_batch, tiny_qwen3

import rp_engine.runtime.executor as executor_module
from rp_engine.model.host_store import HostStore
from rp_engine.model.sq_norm import sq_norm
from rp_engine.plan import schedules
from rp_engine.plan.actions import Op, Plan
from rp_engine.runtime import grad_norm
from rp_engine.runtime.grad_norm import device_norms, sole_downloads, sq_norms_by_owner
from rp_engine.transfer import WeightUpload

STEPS, GAS, CLIP = 3, 4, 0.05  # the tiny model's norm is ~1-3: clipping is active
CUTS = {"fwd_cuts": [2, 2], "bwd_cuts": [1, 1, 2]}


# --- the plan decides which downloads carry a whole gradient ----------------------------------
def _plan(devices: int, gas: int, round_size: int, resident: bool) -> Plan:
    compute = schedules.roundpipe(
        fwd_cuts=(2, 2), bwd_cuts=(1, 1, 2), num_devices=devices, num_microbatches=gas,
        round_size=round_size,
    )  # fmt: skip
    return schedules.lower(compute, optimizer="", resident=resident)


def _sole(plan: Plan, ties: dict[int, int] | None = None) -> dict[int, set[int]]:
    """Owner layer -> the slots of the downloads that carry its whole gradient. ``ties``:
    layer -> the owner of a weight it shares."""
    ties = ties or {}
    sole = sole_downloads(plan, plan.slot_layers, lambda layer: {layer, ties.get(layer, layer)})
    out: dict[int, set[int]] = {}
    for a, owners in sole.items():
        for o in owners:
            out.setdefault(o, set()).add(a.stage)
    return out


def test_one_download_per_slot_carries_every_layer_whole() -> None:
    # one device, the step in one round, or in rounds of one kept resident; GAS 1 on two devices
    for plan in (_plan(1, 4, 4, False), _plan(1, 4, 1, True), _plan(2, 1, 1, False)):
        assert _sole(plan) == {3: {2}, 2: {3}, 1: {4}, 0: {4}}, plan.to_text()


def test_several_downloads_per_step_carry_no_layer_whole() -> None:
    # rounds of one without residency; resident on two devices (a slot returns to each device)
    for plan in (_plan(1, 4, 1, False), _plan(2, 4, 1, True), _plan(2, 4, 2, False)):
        assert sum(1 for a in plan.actions if a.op is Op.DOWNLOAD) > len(plan.bwd_cuts)
        assert _sole(plan) == {}


def test_a_tied_weight_makes_its_owner_a_sum_of_two_downloads() -> None:
    """Layer 3 (backward slot 2) uses a weight layer 0 (slot 4) owns: layer 0's gradient comes
    from two downloads, so only its norm stays on the host; the others are whole."""
    assert _sole(_plan(1, 4, 4, False), ties={3: 0}) == {3: {2}, 2: {3}, 1: {4}}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_device_norms_are_the_host_pass_of_the_converted_gradient(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grad_norm, "CONVERT_CHUNK", 64)  # CPU half tensors convert in chunks
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen).to(dtype) for n in (5, 300, 7)]
    norms = device_norms(grads)
    assert norms.dtype == torch.float64 and norms.shape == (3,)  # CPU: model/sq_norm.py's
    host = [sq_norm(g.float()) for g in grads]  # the fp32 buffers, as the host pass
    exact = [float(g.double().square().sum()) for g in grads]
    sq = sq_norms_by_owner(norms.tolist(), [1, 2, 1])
    assert sq[1] == pytest.approx(host[0] + host[2], rel=1e-12)
    assert sq[2] == pytest.approx(host[1], rel=1e-12)
    assert sq[2] == pytest.approx(exact[1], rel=1e-7)
    grads[1][130] = float("inf")
    assert sq_norms_by_owner(device_norms(grads).tolist(), [1, 2, 1])[2] == float("inf")
    grads[1][130] = float("nan")
    assert math.isnan(sq_norms_by_owner(device_norms(grads).tolist(), [1, 2, 1])[2])


@pytest.mark.parametrize("n", [1, 4095, 4096, 3 * 4096 + 17, 2_000_003])
def test_sq_norm_is_the_float64_value_to_fp32_rounding(n: int) -> None:
    """torch's fp32 CPU reduction drifts ~1e-5 below the float64 sum of squares at 2M elements
    (positive terms: the rounding errors add up); sq_norm stays within fp32 rounding."""
    gen = torch.Generator().manual_seed(n)
    g = torch.rand(n, generator=gen) + 0.5
    exact = float(g.double().square().sum())
    assert sq_norm(g) == pytest.approx(exact, rel=2e-7)
    assert sq_norm(g.view(-1, 1)[::1]) == sq_norm(g)  # any shape
    g[n // 2] = float("inf")
    assert sq_norm(g) == float("inf")
    g[n // 2] = float("nan")
    assert math.isnan(sq_norm(g))


# --- the engine --------------------------------------------------------------------------------
@pytest.fixture
def host_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every layer whose norm the host computed by reading its fp32 buffers, in call order."""
    calls: list[int] = []
    real = HostStore.grad_sq_norm

    def counted(self: HostStore, layer: int) -> float:
        calls.append(layer)
        return real(self, layer)

    monkeypatch.setattr(HostStore, "grad_sq_norm", counted)
    return calls


def _batches(n: int, seed: int = 300) -> list[dict[str, torch.Tensor]]:
    return [random_batch(128, batch=2, seq=12, seed=seed + i) for i in range(n)]


def _assert_as_pytorch(
    model: torch.nn.Module, ref: torch.nn.Module, batches: list, losses: list, norms: list
) -> None:
    """Losses, global norms and final weights are those of plain PyTorch (``_reference`` on
    ``ref``, a copy of ``model``'s initial weights) on the same batches."""
    ref_losses, ref_norms = _reference(ref, batches)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    assert_same_weights(model, ref)


def _train(
    model: torch.nn.Module, cfg: dict, batches: list, *, imperative: bool = False, gas: int = GAS
) -> tuple[list[float], list[float | None]]:
    """(losses, global grad norms) per step; ``model`` holds the final weights. The norms are
    read from ``step_report()`` as each step finishes, which does not finish a step in flight
    (``get_global_grad_norm()`` would: overlapping iterations would not overlap)."""
    engine = engine_for(model, cfg)
    losses, by_step = [], {}

    def note_finished() -> None:
        report = engine.step_report()
        if report is not None:
            by_step[report.step] = report.grad_norm

    try:
        it = iter(batches)
        for _ in range(len(batches) // gas):
            if imperative:
                total = 0.0
                for _ in range(engine.gradient_accumulation_steps()):
                    loss = engine(**next(it)).loss
                    engine.backward(loss)
                    engine.step()
                    total += float(loss.detach())
                losses.append(total / engine.gradient_accumulation_steps())
            else:
                losses.append(float(engine.train_batch(it)))
            note_finished()
        engine.synchronize()
        note_finished()
    finally:
        engine.destroy()
    return losses, [by_step.get(step) for step in range(1, len(losses) + 1)]


def _reference(model: torch.nn.Module, batches: list) -> tuple[list[float], list[float]]:
    """Plain PyTorch: GAS micro-batches, the global norm clipped to CLIP, AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    slack = AdamSlack.of(model)  # see engine_helpers.reference_losses
    it: Iterator = iter(batches)
    losses, norms = [], []
    for _ in range(STEPS):
        total = 0.0
        for _ in range(GAS):
            loss = model(**next(it)).loss
            (loss / GAS).backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        slack.record(opt)
        opt.zero_grad()
        losses.append(total / GAS)
    return losses, norms


def _host_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old path: no download counts as a whole gradient, every norm is the host pass."""
    monkeypatch.setattr(executor_module, "sole_downloads", lambda plan, *a: {})


# one device, the step's micro-batches in one round; or rounds of one kept resident
WHOLE = {
    "one_round": {"round_size": GAS},
    "resident": {"round_size": 1, "device_memory_gb": 1.0},
}


@pytest.mark.parametrize("rp", WHOLE.values(), ids=WHOLE.keys())
def test_whole_downloads_bring_their_norm_and_clip_as_pytorch(
    rp: dict, host_passes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    batches = _batches(STEPS * GAS)
    cfg = config(devices=1, gas=GAS, clip=CLIP, roundpipe=rp, **CUTS)
    model, ref, old = (tiny_qwen3(0, layers=4) for _ in range(3))
    losses, norms = _train(model, cfg, batches)
    assert host_passes == []  # no layer's fp32 buffers were read for the norm
    _assert_as_pytorch(model, ref, batches, losses, norms)
    assert min(norms) > CLIP  # clipping was active in every step
    # the host pass over the very same gradients: the same norms within fp32 rounding
    _host_only(monkeypatch)
    old_losses, old_norms = _train(old, cfg, batches)
    assert len(host_passes) == STEPS * 6  # prefix, 4 blocks, head: each step
    torch.testing.assert_close(norms, old_norms, rtol=1e-6, atol=0)
    assert old_losses == losses
    assert_same_weights(model, old, rtol=1e-6, atol=1e-7)


SPLIT = {  # several downloads per step for every layer, or for a tied weight's owner
    "rounds_on_two_devices": (
        dict(devices=2, roundpipe={"round_size": 1}), False, 6),
    "tied_embedding": (dict(devices=1, roundpipe={"round_size": GAS}), True, 1),
    "imperative_loop": (dict(devices=1, roundpipe={"round_size": GAS}), False, 6),
}  # fmt: skip


@pytest.mark.parametrize(("kw", "tie", "host_layers"), SPLIT.values(), ids=SPLIT.keys())
def test_split_gradients_keep_the_host_pass(
    kw: dict, tie: bool, host_layers: int, host_passes: list[int], request: pytest.FixtureRequest
) -> None:
    imperative = "imperative" in request.node.callspec.id
    batches = _batches(STEPS * GAS)
    cfg = config(gas=GAS, clip=CLIP, **kw, **CUTS)
    model, ref = tiny_qwen3(0, layers=4, tie=tie), tiny_qwen3(0, layers=4, tie=tie)
    losses, norms = _train(model, cfg, batches, imperative=imperative)
    assert len(host_passes) == STEPS * host_layers
    if tie:
        assert set(host_passes) == {0}  # the embedding's owner, also used by the head
    _assert_as_pytorch(model, ref, batches, losses, norms)


def test_a_loop_that_reads_every_loss_lands_each_step_in_one_run(
    host_passes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed's loop reading each loss after its step(): the reads run forwards only, so the
    window's run is the only one that lands gradients, and its device norms serve, as
    train_batch's. Every closing run is taken for the whole step here: a run landing after
    another run of the step would show as host passes (the safety net: a layer whose buffer
    already held a contribution keeps the host pass; before the reads ran forwards only, this
    loop split each step into GAS runs and took that path). Still PyTorch's norms and weights."""
    monkeypatch.setattr(
        executor_module.RunSpec, "whole_step", property(lambda s: s.train and s.closes_step)
    )
    batches = _batches(STEPS * GAS)
    cfg = config(devices=1, gas=GAS, clip=CLIP, roundpipe={"round_size": GAS}, **CUTS)
    model, ref = tiny_qwen3(0, layers=4), tiny_qwen3(0, layers=4)
    losses, norms = _train(model, cfg, batches, imperative=True)
    assert host_passes == []
    _assert_as_pytorch(model, ref, batches, losses, norms)


def test_a_nonfinite_gradient_is_seen_by_the_device_norm(
    host_passes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NaN in one device gradient (finite loss): the device norm is NaN, the guard skips the
    step (on_nonfinite "skip"), no weight moves, and training goes on."""
    poisoned = {"left": 0}
    real = WeightUpload.grads

    def grads(self: WeightUpload) -> dict[int, torch.Tensor]:
        out = real(self)
        if poisoned["left"] and out:
            poisoned["left"] -= 1
            key = next(iter(out))
            out[key] = out[key].clone()
            out[key].view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(WeightUpload, "grads", grads)
    model = tiny_qwen3(0, layers=4)
    cfg = config(devices=1, gas=GAS, roundpipe={"round_size": GAS, "on_nonfinite": "skip"}, **CUTS)
    engine = engine_for(model, cfg)
    try:
        it = iter(_batches(3 * GAS))
        engine.train_batch(it)
        engine.synchronize()
        before = [p.detach().clone() for p in model.parameters()]
        poisoned["left"] = 1
        engine.train_batch(it)
        engine.synchronize()
        assert not engine.was_step_applied() and engine.skipped_steps == 1
        for p, b in zip(model.parameters(), before, strict=True):
            torch.testing.assert_close(p, b, rtol=0, atol=0)
        engine.train_batch(it)
        engine.synchronize()
        assert engine.was_step_applied()
        assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    finally:
        engine.destroy()
    assert host_passes == []


def test_overlapping_iterations_take_each_steps_own_norm(
    host_passes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Async optimizer with overlapping iterations (on_nonfinite "ignore"), GAS 1 on two devices
    (one download per slot and step), clipping on: step t+1's norms may land before step t's
    are taken; each step takes its own, so norms and weights are the host pass's."""
    rp = {"on_nonfinite": "ignore", "round_size": 1, "profile_iterations": 0}
    cfg = config(devices=2, gas=1, clip=CLIP, async_optimizer=True, roundpipe=rp, **CUTS)
    batches = _batches(2 * STEPS)
    model, old = tiny_qwen3(0, layers=4), tiny_qwen3(0, layers=4)
    losses, norms = _train(model, cfg, batches, gas=1)
    assert host_passes == []
    _host_only(monkeypatch)
    old_losses, old_norms = _train(old, cfg, batches, gas=1)
    assert len(host_passes) == 2 * STEPS * 6
    assert None not in norms  # every step's own norm, read as it finished
    torch.testing.assert_close(norms, old_norms, rtol=1e-6, atol=0)
    assert old_losses == losses
    assert_same_weights(model, old, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_norms_are_the_host_pass(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen).to(dtype) for n in (5, 3_000_000, 7)]
    norms = device_norms([g.cuda() for g in grads])
    assert norms.is_cuda and norms.dtype == torch.float32
    host = [float(torch.linalg.vector_norm(g.double())) for g in grads]
    torch.testing.assert_close(
        norms.cpu().double(), torch.tensor(host, dtype=torch.float64), rtol=1e-5, atol=0
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_whole_downloads_bring_their_norm(
    host_passes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU (bf16, the step in one round): no host pass; norms and losses those of the host
    pass."""
    batches = _batches(STEPS * GAS)
    cfg = config(devices=1, gas=GAS, clip=CLIP, roundpipe={"round_size": GAS}, **CUTS)
    cfg["roundpipe"]["devices"] = "cuda:0"
    cfg["bf16"] = {"enabled": True}
    model, old = tiny_qwen3(0, layers=4), tiny_qwen3(0, layers=4)
    losses, norms = _train(model, cfg, batches)
    assert host_passes == []
    _host_only(monkeypatch)
    old_losses, old_norms = _train(old, cfg, batches)
    assert len(host_passes) == STEPS * 6
    # bf16 weights: a clip coefficient 1e-7 apart can round a weight differently, and GPU
    # backward kernels need not be deterministic run to run
    torch.testing.assert_close(norms, old_norms, rtol=1e-3, atol=0)
    torch.testing.assert_close(losses, old_losses, rtol=1e-3, atol=0)


# --- the global norm as DeepSpeed computes it (issue 52) -------------------------------------
class _Float64Norms:
    """AdamW whose ``step`` first records the float64 global norm of the gradients: DeepSpeed's
    ``get_global_grad_norm()`` is that value (to fp32 rounding)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def __call__(self, params: Iterator[torch.nn.Parameter]) -> torch.optim.Optimizer:
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
        inner = opt.step

        def step(*args: object, **kwargs: object) -> object:
            grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
            self.norms.append(math.sqrt(sum(float(g.double().square().sum()) for g in grads)))
            return inner(*args, **kwargs)

        opt.step = step  # type: ignore[method-assign]
        return opt


@pytest.mark.parametrize("host_only", [False, True], ids=["device_norms", "host_pass"])
def test_the_global_norm_is_the_float64_norm(
    host_only: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A multi-layer model whose LM head holds 2M elements (torch's fp32 CPU reduction of it
    alone drifts ~1e-5): ``get_global_grad_norm()`` is plain PyTorch's float64 norm of the same
    gradients within 1e-6 relative (was 2e-6 to 2.3e-5 below, DeepSpeed's is the float64 one),
    whether the norm comes with the downloads or from the host's pass."""
    from engine_helpers import reference_losses

    if host_only:
        _host_only(monkeypatch)
    vocab = 32768
    batches = [random_batch(vocab, batch=2, seq=12, seed=400 + i) for i in range(STEPS * GAS)]
    cfg = config(devices=1, gas=GAS, roundpipe={"round_size": GAS}, **CUTS)
    model, ref = tiny_qwen3(0, layers=4, vocab=vocab), tiny_qwen3(0, layers=4, vocab=vocab)
    losses, norms = _train(model, cfg, batches)
    reference = _Float64Norms()
    want = reference_losses(ref, batches, steps=STEPS, gas=GAS, make_optimizer=reference)
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms, reference.norms, rtol=1e-6, atol=0)
