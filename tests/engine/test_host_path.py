"""The host path: fp32 gradient arena (copy-then-add, no zeroing, no per-step allocation) and the
sliced CPU Adam step (bit-identical to one kernel call, never freezing other Python threads)."""

from __future__ import annotations

import threading

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


def test_adam_kernel_calls_are_bounded_slices_so_other_threads_get_the_gil() -> None:
    """DeepSpeed's binding holds the GIL for a whole ``adam_update`` call, so a pipeline thread
    waits at most one call: every call must cover at most ``slice_elems`` elements, and one
    step of n elements takes ceil(n / slice) calls. Counted, not timed; the pause a Python
    thread sees is measured in benchmarks/host_path_bench.py gil (RESULTS.md)."""
    n, size = 10_000, 1024
    p = torch.zeros(n)
    p.grad = torch.ones(n)
    opt = HostOptimizer(_cpu_adam([p]), per_layer=True, scaler=LossScaler(), slice_elems=size)
    inner = opt.optimizer
    kernel = inner.ds_opt_adam
    calls: list[int] = []

    class Spy:
        def adam_update(self, *args: object) -> object:
            calls.append(args[8].numel())  # type: ignore[attr-defined]  # the param slice
            return kernel.adam_update(*args)

    inner.ds_opt_adam = Spy()
    try:
        for _ in range(2):
            opt.step_params([p], groups=snapshot_groups(inner), grad_coef=0.5)
    finally:
        inner.ds_opt_adam = kernel
    assert len(calls) == 2 * -(-n // size) and max(calls) <= size and sum(calls) == 2 * n


# --- pinned memory (CUDA only) ----------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_memory_is_exact_size_page_locked_and_released() -> None:
    import mmap

    from rp_engine.device.cuda import pin, pinned_empty

    n = 38_912_003  # 155.6 MB: the caching host allocator would lock 256 MiB
    arena = pinned_empty(n)
    assert arena.is_pinned() and arena.numel() == n and arena.dtype == torch.float32
    assert arena.untyped_storage().nbytes() < n * 4 + 3 * mmap.PAGESIZE
    dev = torch.arange(n, device="cuda", dtype=torch.float32)
    arena.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(arena, dev.cpu())
    weight = torch.randn(1000, 3).to(torch.bfloat16)
    pinned = pin(weight)
    assert pinned.is_pinned() and torch.equal(pinned, weight) and pinned.shape == weight.shape
    for _ in range(20):  # neighbours never share a registered page; freeing unregisters
        small = [pinned_empty(1000) for _ in range(8)]
        assert all(t.is_pinned() for t in small)
        del small
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    store = HostStore(list(model), pin=pin, alloc=pinned_empty)
    assert store.grads.arena.is_pinned()
    assert all(p.is_pinned() for p in model.parameters())


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
