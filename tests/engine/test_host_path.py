"""The host path: fp32 gradient arena (copy-then-add, no zeroing, no per-step allocation) and the
sliced CPU Adam step (bit-identical to one kernel call, never freezing other Python threads)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from rp_engine.model.grad_buffers import GradBuffers
from rp_engine.model.host_store import HostStore
from rp_engine.optim.loss_scaler import LossScaler
from rp_engine.optim.optimizer import HostOptimizer, snapshot_groups


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _bf16_grads(shape: tuple[int, ...], n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(n)]


# --- gradient arena -------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1 << 20, 1000])  # 1000: several scratch chunks and a ragged tail
def test_accumulation_is_bitwise_an_fp32_add_of_converted_gradients(chunk: int) -> None:
    masters = [torch.zeros(37, 101), torch.zeros(5)]
    bufs = GradBuffers(masters, chunk=chunk)
    grads = _bf16_grads((37, 101), 4, seed=0)
    for g in grads:
        bufs.write(0, g)
    expected = grads[0].float()
    for g in grads[1:]:
        expected = expected + g.float()
    assert torch.equal(_bits(bufs.buffer(0)), _bits(expected))
    assert bufs.has(0) and not bufs.has(1)
    # fp32 gradients (fp32 models) add directly
    f = [torch.randn(5) for _ in range(3)]
    for g in f:
        bufs.write(1, g)
    assert torch.equal(_bits(bufs.buffer(1)), _bits(f[0] + f[1] + f[2]))


def test_wrong_gradient_shape_names_both_shapes() -> None:
    bufs = GradBuffers([torch.zeros(4, 4)])
    with pytest.raises(ValueError, match=r"\(4, 3\).*\(4, 4\)"):
        bufs.write(0, torch.zeros(4, 3))


def _store(
    dtype: torch.dtype = torch.bfloat16, *, double: bool = False
) -> tuple[nn.Sequential, HostStore]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1100, 1100), nn.Linear(1100, 8)).to(dtype)
    return model, HostStore(list(model), double_buffer=double)


def test_buffers_are_views_into_one_arena_with_stable_addresses() -> None:
    model, store = _store()
    arena = store.grads.arena
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel() * 4
    params = [p for p in model.parameters()]
    first = {id(p): store.grad_buffer(p).data_ptr() for p in params}
    for step in range(3):
        for p in params:
            for g in _bf16_grads(tuple(p.shape), 2, seed=step):
                store.accumulate(p, g)
            grad = store.master_of(p).grad
            assert grad is not None and grad.data_ptr() == first[id(p)]
            assert lo <= grad.data_ptr() < hi and grad.dtype == torch.float32
        store.attach_grads()
        store.zero_grads()
        assert all(store.master_of(p).grad is None for p in params)
    assert store.grads.arena is arena


def test_no_gradient_sized_allocation_after_the_first_step() -> None:
    """The profiler sees every CPU allocation: accumulating a 1.2M-element bf16 gradient twice
    into its fp32 buffer allocates nothing of gradient size (``fp32.add_(bf16)`` would: a full
    fp32 temporary of the gradient)."""
    model, store = _store()
    weight = model[0].weight
    grad_bytes = weight.numel() * 4
    grads = _bf16_grads(tuple(weight.shape), 2, seed=1)
    for g in grads:  # step 1: this thread's conversion scratch is made once here
        store.accumulate(weight, g)
    store.zero_grads()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(2):  # steps 2 and 3
            for g in grads:
                store.accumulate(weight, g)
            store.attach_grads()
            store.zero_grads()
    biggest = max((e.self_cpu_memory_usage for e in prof.events()), default=0)
    assert biggest < grad_bytes // 4, f"allocated {biggest} B for a {grad_bytes} B gradient"
    # and the measurement can fail: the old add path allocates a whole fp32 temporary
    buf = store.grad_buffer(weight)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        buf.add_(grads[0])
    assert max(e.self_cpu_memory_usage for e in prof.events()) >= grad_bytes


def test_first_contribution_overwrites_without_a_zeroing_pass() -> None:
    model, store = _store()
    weight, head = model[0].weight, model[1].weight
    store.accumulate(weight, torch.ones_like(weight))
    store.accumulate(head, torch.ones_like(head))
    store.attach_grads()
    store.zero_grads()
    buf = store.grad_buffer(weight)
    assert torch.equal(buf, torch.ones_like(buf))  # stale values stay: nothing was zeroed
    assert store.grad_sq_norm(0) == 0.0  # ... but they do not count
    g = torch.full_like(weight, 2.0)
    store.accumulate(weight, g)
    assert torch.equal(store.master_of(weight).grad, g.float())  # copy, not add
    assert store.has_grad(weight) and not store.has_grad(head)
    assert store.grad_sq_norm(1) == 0.0
    store.attach_grads()
    # a parameter with gradients before but none this step steps with a zero gradient;
    # one that never had any is not stepped at all
    head_grad = store.master_of(head).grad
    assert head_grad is not None and not head_grad.any()
    assert store.master_of(model[1].bias).grad is None


def test_grad_slot_reports_the_first_contribution() -> None:
    model, store = _store(torch.float32)
    bias = model[1].bias
    with store.grad_slot(bias) as (buf, first):
        assert first
        buf.copy_(torch.ones(8))
    with store.grad_slot(bias) as (buf, first):
        assert not first
        buf.add_(torch.ones(8))
    assert torch.equal(store.master_of(bias).grad, torch.full((8,), 2.0))
    store.zero_grads()
    with pytest.raises(RuntimeError, match="copy failed"), store.grad_slot(bias) as (buf, first):
        raise RuntimeError("copy failed")
    assert not store.has_grad(bias)  # a failed write is not a contribution


# --- direct landings: a step's first contribution copied by the device into its buffer --------
class _Fence:
    """A fake device event: ``synchronize`` blocks until ``done()`` (or raises ``error``)."""

    def __init__(self, *, error: BaseException | None = None) -> None:
        self._set = threading.Event()
        self.error = error
        self.waited = 0

    def done(self) -> None:
        self._set.set()

    def synchronize(self) -> None:
        self.waited += 1
        assert self._set.wait(timeout=30)
        if self.error is not None:
            raise self.error

    def query(self) -> bool:
        return self._set.is_set()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("chunk", [1 << 20, 1000])  # 1000: several widening chunks, ragged tail
def test_a_landed_gradient_is_bitwise_a_converted_copy(dtype: torch.dtype, chunk: int) -> None:
    """A 2-byte gradient lands in the upper half of its fp32 buffer and is widened in place,
    low chunks first: exactly ``buf.copy_(grad)``, with the later adds unchanged too."""
    masters = [torch.zeros(5), torch.zeros(37, 101), torch.zeros(3)]  # neighbours stay intact
    bufs = GradBuffers(masters, chunk=chunk)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(37, 101, generator=gen).to(dtype) for _ in range(3)]
    for i in (0, 2):
        bufs.write(i, torch.full(masters[i].shape, float(i + 1)))
    target = bufs.landing(1, dtype)
    assert target is not None and target.dtype == dtype and target.shape == (37, 101)
    lo, hi = bufs.buffer(1).data_ptr(), bufs.buffer(1).data_ptr() + 37 * 101 * 4
    assert lo <= target.data_ptr() and target.data_ptr() + target.numel() * dtype.itemsize <= hi
    target.copy_(grads[0])  # what the device's copy engine writes
    bufs.land(1, bufs.current(1), dtype)
    assert bufs.has(1) and torch.equal(_bits(bufs.buffer(1)), _bits(grads[0].float()))
    for g in grads[1:]:
        bufs.write(1, g)
    expected = grads[0].float() + grads[1].float() + grads[2].float()
    assert torch.equal(_bits(bufs.buffer(1)), _bits(expected))
    assert torch.equal(bufs.buffer(0), torch.ones(5)) and torch.equal(
        bufs.buffer(2), torch.full((3,), 3.0)
    )
    assert bufs.landing(1, torch.float64) is None  # no room for it: it takes a temporary


def _land(store: HostStore, p: nn.Parameter, g: torch.Tensor, *, free: bool = True) -> bool:
    """What the executor does for one download: announce, copy, fence, land or accumulate.
    Returns whether the copy landed in the buffer directly."""
    landing = store.announce(p, g, free=free)
    if landing.target is None:
        store.accumulate(p, g.clone(), landing=landing)
        return False
    landing.target.copy_(g)
    fence = _Fence()
    fence.done()
    store.fenced([landing], fence)
    store.land(landing)
    return True


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_first_contributions_land_directly_and_sum_as_before(dtype: torch.dtype) -> None:
    """Per step, the first contribution lands in the buffer, later ones are added: the fp32
    result is bitwise what accumulating every contribution gave, step after step."""
    model, store = _store(dtype)
    ref_model, reference = _store(dtype)
    params, ref_params = list(model.parameters()), list(ref_model.parameters())
    for step in range(3):
        for p, q in zip(params, ref_params, strict=True):
            grads = _bf16_grads(tuple(p.shape), 3, seed=step)
            landed = [_land(store, p, g.to(dtype)) for g in grads]
            assert landed == [True, False, False]
            for g in grads:
                reference.accumulate(q, g.to(dtype))
            got, want = store.master_of(p).grad, reference.master_of(q).grad
            assert got is not None and want is not None
            assert got.data_ptr() == store.grad_buffer(p).data_ptr()  # master.grad exposed
            assert torch.equal(_bits(got), _bits(want))
        for s in (store, reference):
            s.attach_grads()
            s.zero_grads()


def test_no_direct_landing_while_the_buffer_is_busy_or_another_contribution_is_due() -> None:
    model, store = _store(torch.float32)
    w = model[0].weight
    g = torch.ones_like(w)
    assert store.announce(w, g, free=False).target is None  # the optimizer still reads it
    store.zero_grads()
    due = store.announce(w, g, free=False)  # announced, not landed yet
    assert store.announce(w, g, free=True).target is None  # it must stay the first
    store.zero_grads()  # a failed run's announcements are forgotten
    assert store.announce(w, g, free=True).target is not None
    store.zero_grads()
    store.accumulate(w, g, landing=due)  # stale: nothing to settle, it simply lands
    assert store.announce(w, g, free=True).target is None  # a contribution is there
    store.zero_grads()
    assert store.announce(w, g[:-1], free=True).target is None  # wrong shape: ``write`` says so


def test_a_contribution_added_before_the_direct_copy_landed_waits_for_it() -> None:
    """A later contribution (another device's, for a tied weight) accumulated while the first
    one's copy is still in flight waits for that copy's fence, lands it, then adds: never an
    overwrite of a copy under way, nor an add into memory the copy is still writing."""
    model, store = _store(torch.bfloat16)
    w = model[0].weight
    g0, g1 = _bf16_grads(tuple(w.shape), 2, seed=5)
    first = store.announce(w, g0, free=True)
    second = store.announce(w, g1, free=True)
    assert first.target is not None and second.target is None
    fence = _Fence()
    adder = threading.Thread(target=store.accumulate, args=(w, g1), kwargs={"landing": second})
    adder.start()  # the copy is not even issued: it waits for ``fenced``
    adder.join(timeout=0.2)
    assert adder.is_alive()
    store.fenced([first], fence)
    adder.join(timeout=0.2)
    assert adder.is_alive() and fence.waited == 1  # now on the copy itself
    first.target.copy_(g0)  # the copy completes
    fence.done()
    adder.join(timeout=30)
    assert not adder.is_alive()
    expected = g0.float() + g1.float()
    assert torch.equal(_bits(store.master_of(w).grad), _bits(expected))
    store.land(first)  # the copy thread's own landing comes late: nothing happens
    assert torch.equal(_bits(store.master_of(w).grad), _bits(expected))


def test_a_failed_direct_copy_fails_the_contribution_that_waits_for_it() -> None:
    model, store = _store(torch.float32)
    w = model[0].weight
    g = torch.ones_like(w)
    first = store.announce(w, g, free=True)
    second = store.announce(w, g, free=True)
    fence = _Fence(error=RuntimeError("copy failed"))
    fence.done()
    store.fenced([first], fence)
    with pytest.raises(RuntimeError, match="copy failed"):
        store.accumulate(w, g, landing=second)
    store.withdraw([first])  # the download's own host task gives it up
    assert not store.has_grad(w)
    assert store.announce(w, g, free=True).target is not None  # nothing is stuck


def test_buffers_and_weights_are_pinned_and_the_arena_is_not_read_uninitialised() -> None:
    """``pin`` reaches the layers' buffers as well as their parameters (uploads read both), in
    place; without ``alloc`` the arena is pinned from zeros, never from uninitialised memory."""
    seen: list[int] = []  # data_ptr of every tensor handed to pin
    args: list[torch.Tensor] = []  # a copy of each, as pin saw it

    def pin(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.data_ptr())
        args.append(t.clone())
        return t.clone()  # "pinned": new storage

    norm = nn.BatchNorm1d(4)
    model = nn.Sequential(nn.Linear(4, 4), norm)
    tensors = {name: t for name, t in [*model.named_parameters(), *model.named_buffers()]}
    before = {name: t.data_ptr() for name, t in tensors.items()}
    store = HostStore(list(model), pin=pin, double_buffer=False)
    now = dict([*model.named_parameters(), *model.named_buffers()])
    for name, t in tensors.items():
        assert now[name] is t, name  # the modules keep their objects
        assert before[name] in seen and t.data_ptr() != before[name], f"{name} not pinned"
    n = store.grads.arena.numel()
    arena_args = [a for a in args if a.dim() == 1 and a.numel() == n]
    assert len(arena_args) == 1 and not arena_args[0].any()


def _engine_masters(
    monkeypatch: pytest.MonkeyPatch, *, bf16: bool, round_size: int, tie: bool, direct: bool
) -> tuple[list[torch.Tensor], int, int]:
    """Two steps of a tiny Qwen3 on two CPU devices (async optimizer, clipping). Returns
    the fp32 masters, the bytes the gradient download threads copied into host memory other
    than the fp32 arena (a staging buffer, or a tensor ``to_host`` allocated itself), and the
    gradient bytes downloaded. ``direct=False``: no buffer is ever free at download time, so
    every gradient comes down into memory of its own (the old path)."""
    from engine_helpers import config, engine_for
    from models import random_batch, tiny_qwen3

    from rp_engine.device.cpu import CPUDevice

    fresh = [0]
    real = CPUDevice.to_host
    arenas: list[int] = []  # storage data_ptr of the fp32 arenas

    def to_host(self: CPUDevice, dev: torch.Tensor, out: torch.Tensor | None = None):
        got = real(self, dev, out)
        in_arena = out is not None and out.untyped_storage().data_ptr() in arenas
        if not in_arena and threading.current_thread().name.endswith("-d2h"):
            fresh[0] += got.numel() * got.element_size()
        return got

    monkeypatch.setattr(CPUDevice, "to_host", to_host)
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    cfg = config(
        devices=2, gas=2, clip=1.0, async_optimizer=True,
        roundpipe={"round_size": round_size}, **extra,
    )  # fmt: skip
    engine = engine_for(tiny_qwen3(0, tie=tie), cfg)
    arenas.extend(a.untyped_storage().data_ptr() for a in engine.store.grads.arenas)
    if not direct:
        engine._executor.sink.is_free = lambda layer, step: False
    try:
        for step in range(2):
            engine.train_batch(iter([random_batch(128, seed=10 * step + m) for m in range(2)]))
        grad_bytes = 2 * engine.last_step_stats()["grad_d2h_bytes"]  # the same every step
        engine.synchronize()  # the async optimizer's last step too
        masters = [hp.master.clone() for hp in engine.store.owned_params()]
    finally:
        engine.destroy()
        monkeypatch.setattr(CPUDevice, "to_host", real)
    return masters, fresh[0], grad_bytes


@pytest.mark.parametrize(("bf16", "round_size", "tie"), [(False, 2, True), (True, 1, False)])
def test_engine_gradients_land_in_the_arena_with_bitwise_the_same_weights(
    monkeypatch: pytest.MonkeyPatch, bf16: bool, round_size: int, tie: bool
) -> None:
    """End to end, the step's first contribution of every gradient comes down straight into its
    fp32 buffer (fp32 gradients of one 2-micro-batch round, the tied embedding's second
    contribution added from a temporary; bf16 gradients of 1-micro-batch rounds, the second
    round's added from a temporary), and the weights are bitwise those of the old path, where
    every gradient came down into a fresh host tensor first. (Two contributions per gradient:
    their fp32 sum does not depend on which of two devices lands first.)"""
    kw = {"bf16": bf16, "round_size": round_size, "tie": tie}
    new, new_fresh, grad_bytes = _engine_masters(monkeypatch, **kw, direct=True)
    old, old_fresh, _ = _engine_masters(monkeypatch, **kw, direct=False)
    for a, b in zip(new, old, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    assert old_fresh >= grad_bytes > 0  # the measurement sees every fresh gradient tensor
    # what still needs one: the later rounds' contributions, the tied weight's second one (it
    # comes down as fp32: its head round accumulates 2 micro-batches), the norm vectors
    rounds = 2 // round_size
    tied = 2 * 128 * 64 * 4 if tie else 0  # two steps of the (vocab, hidden) fp32 gradient
    assert new_fresh <= grad_bytes * (rounds - 1) // rounds + tied + grad_bytes // 100


def _fresh_host_bytes_per_step(
    monkeypatch: pytest.MonkeyPatch, *, bf16: bool, round_size: int, tie: bool
) -> tuple[list[int], list[int]]:
    """Four steps of a tiny Qwen3 on two CPU devices (async optimizer, clipping). Per step:
    host bytes the gradient downloads allocated (``to_host`` without ``out`` on a download
    thread, plus the devices' ``host_buffer`` allocations), and the gradient bytes downloaded
    into memory other than the fp32 arena (the later contributions)."""
    from engine_helpers import config, engine_for
    from models import random_batch, tiny_qwen3

    from rp_engine.device.cpu import CPUDevice

    fresh = [0]
    real = CPUDevice.to_host

    def to_host(self: CPUDevice, dev: torch.Tensor, out: torch.Tensor | None = None):
        got = real(self, dev, out)
        if out is None and threading.current_thread().name.endswith("-d2h"):
            fresh[0] += got.numel() * got.element_size()
        return got

    monkeypatch.setattr(CPUDevice, "to_host", to_host)
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    cfg = config(
        devices=2,
        gas=2,
        clip=1.0,
        async_optimizer=True,
        fwd_cuts=[2, 2],
        bwd_cuts=[0, 2, 2],
        roundpipe={"round_size": round_size},
        **extra,
    )  # fmt: skip  (fixed cuts: a profiled plan may change, and its downloads with it)
    engine = engine_for(tiny_qwen3(0, tie=tie), cfg)

    def allocated() -> int:
        stats = [d.memory_stats() for d in engine.pool]
        return fresh[0] + sum(s.get("host_alloc_bytes", 0) for s in stats)

    per_step, staged = [], []
    try:
        for step in range(4):
            before = allocated()
            engine.train_batch(iter([random_batch(128, seed=10 * step + m) for m in range(2)]))
            engine.synchronize()  # every accumulation of the step is done
            per_step.append(allocated() - before)
            staging = getattr(engine._executor, "_staging", {})
            assert all(s.out() == 0 for s in staging.values())  # every buffer given back
            staged.append(sum(s.held_bytes() for s in staging.values()))
    finally:
        engine.destroy()
        monkeypatch.setattr(CPUDevice, "to_host", real)
    return per_step, staged


@pytest.mark.parametrize(("bf16", "round_size", "tie"), [(False, 2, True), (True, 1, False)])
def test_later_contributions_allocate_no_host_memory_after_warm_up(
    monkeypatch: pytest.MonkeyPatch, bf16: bool, round_size: int, tie: bool
) -> None:
    """The contributions that cannot land in their fp32 buffer (the tied embedding's second
    one; the second round's) and the norm vectors come down into the device's staging buffers:
    the first step allocates them (exact sizes), later steps reuse them, allocating nothing.
    (Before: a fresh host tensor per contribution per step, pinned on CUDA.)"""
    per_step, held = _fresh_host_bytes_per_step(
        monkeypatch, bf16=bf16, round_size=round_size, tie=tie
    )
    assert per_step[0] > 0  # the measurement sees the staging allocations
    assert per_step[2:] == [0, 0], per_step  # after warm-up: nothing new
    assert held[-1] == held[1] > 0  # the pool stopped growing at what is in flight


def test_a_failed_staged_download_keeps_its_buffers_until_the_reset_reclaims_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy into a staging buffer fails mid-download: the step fails, the buffers that
    download took are not handed out again while it fails, the engine's reset reclaims them,
    and the next steps run on the same buffers (nothing allocated, nothing left out)."""
    from engine_helpers import config, engine_for
    from models import random_batch, tiny_qwen3

    from rp_engine.device.cpu import CPUDevice
    from rp_engine.runtime.staging import HostStaging

    real_to_host, real_take = CPUDevice.to_host, HostStaging.take
    taken: set[int] = set()  # data_ptr of every staging buffer
    armed = [False]
    seen_out: list[int] = []

    def take(self: HostStaging, numel: int, dtype: torch.dtype, **kw: object) -> torch.Tensor:
        buf = real_take(self, numel, dtype, **kw)
        taken.add(buf.data_ptr())
        return buf

    def to_host(self: CPUDevice, dev: torch.Tensor, out: torch.Tensor | None = None):
        if armed[0] and out is not None and out.data_ptr() in taken and dev.numel() > 64:
            armed[0] = False
            seen_out.append(sum(s.out() for s in staging.values()))
            raise RuntimeError("injected staged copy failure")
        return real_to_host(self, dev, out)

    monkeypatch.setattr(HostStaging, "take", take)
    monkeypatch.setattr(CPUDevice, "to_host", to_host)
    cfg = config(
        devices=2, gas=2, clip=1.0, async_optimizer=True, fwd_cuts=[2, 2], bwd_cuts=[0, 2, 2],
        roundpipe={"round_size": 1}, bf16={"enabled": True},
    )  # fmt: skip
    engine = engine_for(tiny_qwen3(0, tie=True), cfg)
    staging = engine._executor._staging

    def step(i: int) -> None:
        engine.train_batch(iter([random_batch(128, seed=10 * i + m) for m in range(2)]))

    try:
        for i in range(2):
            step(i)
        engine.synchronize()
        held = sum(s.held_bytes() for s in staging.values())
        made = sum(s.allocated_bytes for s in staging.values())
        armed[0] = True
        with pytest.raises(Exception, match="injected staged copy failure"):
            for i in range(2, 5):  # the failure may surface at the next call (overlap)
                step(i)
                engine.synchronize()
        assert seen_out and seen_out[0] > 0  # buffers were out when the copy failed
        assert all(s.out() == 0 for s in staging.values())  # the reset reclaimed them
        for i in range(5, 7):
            step(i)
        engine.synchronize()
        assert all(s.out() == 0 for s in staging.values())
        assert sum(s.held_bytes() for s in staging.values()) == held
        assert sum(s.allocated_bytes for s in staging.values()) == made
    finally:
        engine.destroy()


def test_staging_reuses_exact_buffers_and_reclaims_failed_ones() -> None:
    """``HostStaging``: exact sizes by (numel, dtype), a buffer out is never handed out again
    until given back, and a failed download's buffers (never given back) come back only on
    ``reclaim``."""
    from rp_engine.runtime.staging import HostStaging

    made: list[tuple[int, torch.dtype]] = []

    def alloc(n: int, dtype: torch.dtype) -> torch.Tensor:
        made.append((n, dtype))
        return torch.empty(n, dtype=dtype)

    pool = HostStaging(alloc)
    a, b = pool.take(10, torch.float32), pool.take(10, torch.float32)
    assert a.data_ptr() != b.data_ptr() and a.numel() == 10
    c = pool.take(10, torch.bfloat16)
    assert made == [(10, torch.float32)] * 2 + [(10, torch.bfloat16)]
    pool.give([a])
    assert pool.take(10, torch.float32) is a and pool.out() == 3  # reused, not a new one
    assert pool.take(12, torch.float32).numel() == 12 and len(made) == 4  # exact size
    pool.give([a, c])
    assert pool.out() == 2  # b and the 12: "failed", kept out
    assert pool.take(10, torch.float32) is a and len(made) == 4
    pool.reclaim()
    assert pool.out() == 0
    assert {id(pool.take(10, torch.float32)) for _ in range(2)} == {id(a), id(b)}
    assert len(made) == 4 and pool.allocated_bytes == 10 * 4 * 2 + 10 * 2 + 12 * 4


# --- double-buffered gradients ---------------------------------------------------------------
def test_double_buffers_alternate_between_two_fixed_addresses() -> None:
    model, store = _store(double=True)
    weight = model[0].weight
    seen = []
    for step in range(4):
        g = torch.full_like(weight, float(step + 1))
        store.accumulate(weight, g)
        seen.append(store.grad_buffer(weight).data_ptr())
        for layer in range(2):
            store.seal_grads(layer)
        store.accumulate(weight, torch.full_like(weight, 9.0))  # next step, other buffer
        store.attach_grads()
        assert torch.equal(store.master_of(weight).grad, g.float())  # the sealed step's
        store.release_grads(range(2))
        store.zero_grads()
    assert seen[0] == seen[2] and seen[1] == seen[3] and seen[0] != seen[1]
    # the weight is the first buffer of each arena
    assert sorted(seen[:2]) == sorted(a.data_ptr() for a in store.grads.arenas)


def _stepper_run(double: bool) -> tuple[list[torch.Tensor], bool]:
    """Two async steps; step 1's optimizer is held back while step 2's gradients arrive.
    Returns the masters and whether step 2's buffer was free while step 1 was still held."""
    from rp_engine.optim.optimizer import build_inner_optimizer
    from rp_engine.optim.stepper import OptimizerStepper

    model, store = _store(torch.float32, double=double)
    masters = [hp.master for hp in store.owned_params()]
    inner, per_layer = build_inner_optimizer("adamw", {"lr": 1e-2}, [{"params": masters}])
    opt = HostOptimizer(inner, per_layer=per_layer, scaler=LossScaler(), slice_elems=1 << 14)
    stepper = OptimizerStepper(store, opt, clip=0.0, async_mode=True, fp16=False)
    hold = threading.Event()
    real = opt.step_params

    def held(*args, **kwargs) -> None:
        assert hold.wait(timeout=60)
        real(*args, **kwargs)

    opt.step_params = held  # type: ignore[method-assign]
    params = [hp.param for hp in store.owned_params()]
    gen = torch.Generator().manual_seed(3)
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(2)]
    try:
        stepper.open_step(1)
        for p, g in zip(params, grads[0], strict=True):
            store.accumulate(p, g)
        for layer in (1, 0):
            stepper.layer_ready(layer)
        stepper.close_step()
        free = threading.Thread(target=lambda: [stepper.wait_grads_free(x, 2) for x in (1, 0)])
        free.start()
        free.join(timeout=0.5 if not double else 30)
        was_free = not free.is_alive()
        if was_free:  # double-buffered: step 2's gradients land while step 1 is held
            for p, g in zip(params, grads[1], strict=True):
                store.accumulate(p, g)
        hold.set()
        free.join(timeout=30)
        stepper.open_step(2)
        if not was_free:
            for p, g in zip(params, grads[1], strict=True):
                store.accumulate(p, g)
        for layer in (1, 0):
            stepper.layer_ready(layer)
        stepper.close_step()
        stepper.synchronize()
    finally:
        hold.set()
        stepper.close()
    return [m.clone() for m in masters], was_free


def test_double_buffering_lets_the_next_step_land_during_the_optimizer_step() -> None:
    """Async: with two buffers step 2's gradients land while step 1's optimizer is still held;
    with one they must wait. Both give bit-identical weights (each step read its own grads)."""
    double, double_free = _stepper_run(True)
    single, single_free = _stepper_run(False)
    assert double_free and not single_free
    for a, b in zip(double, single, strict=True):
        assert torch.equal(_bits(a), _bits(b))


# --- sliced CPU Adam --------------------------------------------------------------------------
def _cpu_adam(params: list[torch.Tensor], **kw):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, **kw)


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_sliced_adam_is_bitwise_one_kernel_call(adamw_mode: bool) -> None:
    """10,007 elements in 256-element slices (39 calls with the same step number, a ragged
    tail) against DeepSpeedCPUAdam.step itself, clipping coefficient included."""
    torch.manual_seed(0)
    init = torch.randn(10_007)
    sliced_p, whole_p, torch_p = (init.clone() for _ in range(3))
    sliced = HostOptimizer(
        _cpu_adam([sliced_p], adamw_mode=adamw_mode),
        per_layer=True,
        scaler=LossScaler(),
        slice_elems=256,
    )
    whole = _cpu_adam([whole_p], adamw_mode=adamw_mode)
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    reference = cls([torch_p], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for step in range(4):
        g = torch.randn(10_007)
        coef = 0.5 if step % 2 else 1.0
        sliced_p.grad, whole_p.grad, torch_p.grad = g.clone(), g * coef, g * coef
        sliced.step_params([sliced_p], groups=snapshot_groups(sliced.optimizer), grad_coef=coef)
        whole.step()
        reference.step()
        assert torch.equal(_bits(sliced_p), _bits(whole_p)), f"step {step}"
        assert torch.equal(sliced_p.grad, whole_p.grad)  # the coefficient was applied in place
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(sliced.state[sliced_p][key], whole.state[whole_p][key])
    torch.testing.assert_close(sliced_p, torch_p, rtol=1e-5, atol=1e-6)


def test_slice_size_must_keep_the_kernel_simd_split() -> None:
    with pytest.raises(ValueError, match="slice_elems=1000"):
        HostOptimizer(torch.optim.SGD([torch.zeros(1)], lr=1), per_layer=False,
                      scaler=LossScaler(), slice_elems=1000)  # fmt: skip


def test_an_engine_on_gpus_steps_cpu_adam_in_smaller_slices(monkeypatch) -> None:
    """Through DeepSpeed's binding a call holds the GIL for its whole slice and GPU device
    threads launch kernels from Python: an engine whose pool is CUDA then steps in
    ``CUDA_ADAM_SLICE`` (512K) calls, one on CPU virtual devices keeps ``ADAM_SLICE`` (2M), and
    so does every pool with ``roundpipe.release_gil`` (the default). The pool's kind is what decides (the engine's
    own wiring: a CPU pool reporting "cuda" stands in for GPUs here)."""
    from engine_helpers import config, engine_for
    from models import tiny_qwen3

    import rp_engine.engine.core as engine_module
    from rp_engine.optim.optimizer import ADAM_SLICE, CUDA_ADAM_SLICE, adam_slice

    assert adam_slice("cuda") == CUDA_ADAM_SLICE == 1 << 19
    assert adam_slice("cpu") == ADAM_SLICE == 1 << 21
    assert CUDA_ADAM_SLICE % 128 == 0  # the kernel's SIMD split (test above)
    with pytest.raises(ValueError, match="device_kind 'tpu'"):
        adam_slice("tpu")
    slices = {}
    make_devices = engine_module.make_devices
    for kind in ("cpu", "cuda"):

        def made_of_kind(*args: Any, kind: str = kind, **kw: Any) -> Any:
            pool = make_devices(*args, **kw)
            pool.kind = kind
            return pool

        monkeypatch.setattr(engine_module, "make_devices", made_of_kind)
        for release in (True, False):
            cfg = config(devices=1, gas=1, roundpipe={"release_gil": release})
            engine = engine_for(tiny_qwen3(0, layers=2), cfg)
            try:
                assert engine.pool.kind == kind
                slices[kind, release] = engine.optimizer.slice_elems
            finally:
                engine.destroy()
    # without the GIL (the default) a call stalls no launch: GPUs take the CPU's slice too
    assert slices == {
        ("cpu", True): ADAM_SLICE,
        ("cpu", False): ADAM_SLICE,
        ("cuda", True): ADAM_SLICE,
        ("cuda", False): CUDA_ADAM_SLICE,
    }


@pytest.mark.parametrize("release_gil", [False, True], ids=["binding", "gil_free"])
def test_adam_kernel_calls_are_bounded_slices_so_other_threads_get_the_gil(
    release_gil: bool,
) -> None:
    """DeepSpeed's binding holds the GIL for a whole ``adam_update`` call, so a pipeline thread
    waits at most one call: every call must cover at most ``slice_elems`` elements, and one
    step of n elements takes ceil(n / slice) calls. Counted, not timed; the pause a Python
    thread sees is measured in benchmarks/studies/host_path_bench.py gil (RESULTS.md). The GIL-free
    call (``roundpipe.release_gil``) is sliced the same way (each slice's publish reads it
    from cache)."""
    n, size = 10_000, 1024
    p = torch.zeros(n)
    p.grad = torch.ones(n)
    opt = HostOptimizer(
        _cpu_adam([p]), per_layer=True, scaler=LossScaler(), slice_elems=size,
        release_gil=release_gil,
    )  # fmt: skip
    assert opt.releases_gil == release_gil
    inner = opt.optimizer
    owner: Any = opt._nogil if release_gil else inner  # noqa: SLF001 - the call site
    attr = "update" if release_gil else "ds_opt_adam"
    real = getattr(owner, attr)
    calls: list[int] = []

    def update(*args: Any) -> object:
        calls.append(args[8].numel())  # the param slice
        return (real if release_gil else real.adam_update)(*args)

    class Spy:
        adam_update = staticmethod(update)

    setattr(owner, attr, update if release_gil else Spy())
    try:
        for _ in range(2):
            opt.step_params([p], groups=snapshot_groups(inner), grad_coef=0.5)
    finally:
        if release_gil:
            del owner.update  # the method again
        else:
            inner.ds_opt_adam = real
    assert len(calls) == 2 * -(-n // size) and max(calls) <= size and sum(calls) == 2 * n


# --- pinned memory (CUDA only) ----------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_memory_is_exact_size_page_locked_and_released() -> None:
    import mmap

    from rp_engine.device.cuda import is_pinned, pin, pinned_empty

    n = 38_912_003  # 155.6 MB: the caching host allocator would lock 256 MiB
    arena = pinned_empty(n)
    assert is_pinned(arena) and arena.numel() == n and arena.dtype == torch.float32
    assert arena.untyped_storage().nbytes() < n * 4 + 3 * mmap.PAGESIZE
    dev = torch.arange(n, device="cuda", dtype=torch.float32)
    arena.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(arena, dev.cpu())
    weight = torch.randn(1000, 3).to(torch.bfloat16)
    pinned = pin(weight)
    assert is_pinned(pinned) and torch.equal(pinned, weight) and pinned.shape == weight.shape
    for _ in range(20):  # neighbours never share a registered page; freeing unregisters
        small = [pinned_empty(1000) for _ in range(8)]
        assert all(is_pinned(t) for t in small)
        del small
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 8))
    store = HostStore(list(model), pin=pin, alloc=pinned_empty)
    assert is_pinned(store.grads.arena)
    assert all(is_pinned(p) for p in model.parameters())
    assert all(is_pinned(b) for b in model.buffers())  # uploads read them too


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_first_contribution_lands_in_the_pinned_arena(dtype: torch.dtype) -> None:
    """On a GPU: the first gradient is copied by the D2H stream straight into its pinned fp32
    buffer (bf16: the upper half, widened on the host); a second contribution accumulated while
    that copy is still held back on the GPU waits for the copy's fence, so the sum is exact."""
    from rp_engine.device.base import StreamRole
    from rp_engine.device.cuda import CUDADevice, is_pinned, pin, pinned_empty

    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 8)).to(dtype)
    store = HostStore(list(model), pin=pin, alloc=pinned_empty, double_buffer=False)
    w = model[0].weight
    gen = torch.Generator().manual_seed(0)
    g0, g1 = (torch.randn(w.shape, generator=gen).to(dtype) for _ in range(2))
    dev = CUDADevice(0)
    issued = threading.Event()
    box: dict[str, object] = {}
    try:
        g0_dev = g0.cuda()
        torch.cuda.synchronize()

        def download() -> None:
            landing = store.announce(w, g0_dev, free=True)
            assert landing.target is not None and is_pinned(landing.target)
            torch.cuda._sleep(200_000_000)  # hold the copy back on the GPU (~0.1 s)
            dev.to_host(g0_dev, out=landing.target)
            store.fenced([landing], dev.fence())
            box["landing"] = landing
            issued.set()

        d2h = dev.stream(StreamRole.D2H)
        d2h.submit(download, label="D0")
        assert issued.wait(timeout=60)
        second = store.announce(w, g1, free=True)
        assert second.target is None
        store.accumulate(w, g1, landing=second)  # waits for the first copy, lands it, adds
        expected = g0.float() + g1.float()
        assert torch.equal(_bits(store.master_of(w).grad), _bits(expected))
        d2h.record().synchronize()
        store.land(box["landing"])  # type: ignore[arg-type]
        assert torch.equal(_bits(store.master_of(w).grad), _bits(expected))
    finally:
        dev.close()


def test_the_optimizer_reads_the_oldest_sealed_step() -> None:
    """Double-buffered, step t+1 can seal its gradient before step t's optimizer has read its
    own (overlapping iterations, a slow optimizer): ``attach`` must still give step t's, then
    step t+1's after the release. The single 'sealed copy' index gave step t+1's to both."""
    from rp_engine.model.grad_buffers import GradBuffers

    bufs = GradBuffers([torch.zeros(4)], copies=2)
    bufs.write(0, torch.full((4,), 1.0))
    bufs.seal(0)  # step t complete
    bufs.write(0, torch.full((4,), 2.0))
    bufs.seal(0)  # step t+1 complete, step t not consumed yet
    got = bufs.attach(0)
    assert got is not None and torch.equal(got, torch.full((4,), 1.0))
    bufs.release([0])
    got = bufs.attach(0)
    assert got is not None and torch.equal(got, torch.full((4,), 2.0))
    bufs.release([0])
    assert not bufs.has(0)


def test_the_global_norm_does_not_depend_on_the_order_layers_land() -> None:
    """Layers land from several device threads in an order that varies between runs; the
    step's global norm (and so the clipping coefficient and the weights) must not: the squares
    are summed in layer order. With squares 1e16, 1, 1 a float sum in landing order gives 1e16
    for (0, 1, 2) and 1e16 + 2 for (1, 2, 0), which it did before (summed as layers landed)."""
    from rp_engine.optim.optimizer import build_inner_optimizer
    from rp_engine.optim.stepper import OptimizerStepper

    squares = [1e16, 1.0, 1.0]
    norms = []
    for order in ((0, 1, 2), (1, 2, 0), (2, 0, 1)):
        torch.manual_seed(0)
        store = HostStore([nn.Linear(1, 1, bias=False) for _ in squares])
        masters = [hp.master for hp in store.owned_params()]
        inner, per_layer = build_inner_optimizer("adamw", {"lr": 1e-2}, [{"params": masters}])
        opt = HostOptimizer(inner, per_layer=per_layer, scaler=LossScaler(), slice_elems=1 << 14)
        stepper = OptimizerStepper(store, opt, clip=1.0, async_mode=False, fp16=False)
        store.take_sq_norm = lambda layer, step: squares[layer]  # type: ignore[method-assign]
        try:
            stepper.open_step(1)
            for layer in order:
                stepper.layer_ready(layer)
            norms.append(stepper.close_step(skip=True).grad_norm)
        finally:
            stepper.close()
    assert norms[0] == norms[1] == norms[2], norms
