"""Helpers for engine tests: configs, a plain-PyTorch reference trainer, per-layer RNG hooks."""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

import rp_engine
from rp_engine.runtime.executor import layer_seed


def config(
    *,
    devices: int = 2,
    gas: int = 2,
    mbs: int = 2,
    lr: float = 1e-3,
    fwd_cuts: Sequence[int] | None = None,
    bwd_cuts: Sequence[int] | None = None,
    async_optimizer: bool = False,
    clip: float = 0.0,
    **extra: Any,
) -> dict[str, Any]:
    rp: dict[str, Any] = {"devices": f"cpu:{devices}", "async_optimizer": async_optimizer}
    if fwd_cuts is not None:
        rp["fwd_cuts"] = list(fwd_cuts)
        rp["bwd_cuts"] = list(bwd_cuts or ())
    rp.update(extra.pop("roundpipe", {}))
    return {
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
        "roundpipe": rp,
        **extra,
    }


def engine_for(model: nn.Module, cfg: dict[str, Any]) -> Any:
    engine, _, _, _ = rp_engine.initialize(model=model, config=cfg)
    return engine


def train_with_norms(engine: Any, data: Any, steps: int) -> tuple[list[float], list[float]]:
    """``steps`` ``train_batch`` calls on iterator ``data``: each step's loss and global
    gradient norm, then ``synchronize`` (the newest weights published)."""
    losses, norms = [], []
    for _ in range(steps):
        losses.append(float(engine.train_batch(data)))
        norms.append(engine.get_global_grad_norm())
    engine.synchronize()
    return losses, norms


def layer_modules(model: nn.Module) -> list[nn.Module]:
    """The modules, in LayerSequence order, whose forward draws random numbers per layer."""
    from rp_engine.model.layers import to_layers

    seq = to_layers(model, loss_fn=getattr(model, "loss_fn", None))
    return list(seq.modules())


def seeded_layers(model: nn.Module, *, seed: int = 42) -> Callable[[int, int], None]:
    """Install pre-forward hooks reseeding the RNG per layer exactly as the engine does.

    Returns ``set_position(step, microbatch)``, to be called before each micro-batch's forward.
    The hooks sit on the modules the engine runs as layers (HF decoder layers, Sequential
    children), so dropout masks match the engine's, whatever device ran each layer.
    """
    pos = {"step": 1, "mb": 0}
    for index, module in enumerate(layer_modules(model)):
        target = getattr(module, "layer", module)  # HF blocks wrap the decoder layer

        def hook(_m: nn.Module, _args: Any, index: int = index) -> None:
            torch.manual_seed(layer_seed(seed, pos["step"], pos["mb"], index))

        target.register_forward_pre_hook(hook)

    def set_position(step: int, microbatch: int) -> None:
        pos["step"], pos["mb"] = step, microbatch

    return set_position


def reference_losses(
    model: nn.Module,
    batches: Sequence[Any],
    *,
    steps: int,
    gas: int,
    lr: float = 1e-3,
    staleness: int = 0,
    loss_of: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    set_position: Callable[[int, int], None] | None = None,
    make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
) -> list[float]:
    """Plain PyTorch on one device: GAS micro-batches per step, AdamW(weight_decay=0) (or
    ``make_optimizer(params)``); the per-step mean losses, ``model`` left with the final weights.

    With ``staleness`` s > 0 the gradients of step t are taken at the weights of step
    max(t-1-s, 0): w_t = AdamW(w_{t-1}, grad at w_{max(t-1-s, 0)}); s = 1 is the asynchronous
    optimizer's semantics.

    The run records its ``AdamSlack`` on ``model``: ``assert_same_weights(engine_model, model)``
    then allows each element what gradient rounding moves Adam's step by, and no more.
    """
    if make_optimizer is None:
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    else:  # e.g. DeepSpeed's CPU Adam, to compare with the engine's own kernel bit for bit
        opt = make_optimizer(model.parameters())
    slack = AdamSlack.of(model)
    loss_of = loss_of or (lambda m, b: m(**b).loss)
    compute = copy.deepcopy(model) if staleness else model
    history = [copy.deepcopy(model.state_dict())] if staleness else []
    out = []
    it = iter(batches)
    mb = 0
    for step in range(1, steps + 1):
        if staleness:
            compute.load_state_dict(history[max(step - 1 - staleness, 0)])
            compute.zero_grad()
        total = 0.0
        for _ in range(gas):
            if set_position is not None:
                set_position(step, mb)
            loss = loss_of(compute, next(it))
            (loss / gas).backward()
            total += float(loss.detach())
            mb += 1
        if staleness:
            for p, q in zip(model.parameters(), compute.parameters(), strict=True):
                p.grad = None if q.grad is None else q.grad.clone()  # unused: no gradient
        opt.step()
        slack.record(opt)
        opt.zero_grad()
        if staleness:
            history.append(copy.deepcopy(model.state_dict()))
        out.append(total / gas)
    return out


def run_losses(
    model: nn.Module,
    cfg: dict[str, Any],
    batches: Sequence[Any],
    *,
    steps: int,
    overlap: bool | None = None,
) -> list[float]:
    """Train an engine over ``model`` with ``cfg`` for ``steps`` steps of ``batches``; the
    per-step losses. The engine is synchronized (``model`` holds the final weights) and
    destroyed, also when training fails. ``overlap`` (when given) is asserted to be whether
    the engine overlaps iterations, so a test's drained or overlapped variant is what it says."""
    engine = engine_for(model, cfg)
    try:
        assert overlap is None or engine._overlap is overlap, (overlap, cfg.get("roundpipe"))
        it = iter(batches)
        losses = [float(engine.train_batch(it)) for _ in range(steps)]
        engine.synchronize()
    finally:
        engine.destroy()
    return losses


# Rounding noise of an fp32 gradient element, as a fraction of its tensor's largest gradient
# element. The engine's gradients and plain PyTorch's (the same maths, arranged differently) differ
# by up to 6.4e-7 of it with torch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2, as
# tests/support/avx2_cpu_adam.py runs them), and not at all with its AVX-512 ones, on the tiny
# models of these tests (step 1 of the Qwen3 overlap tests, every tensor).
GRAD_NOISE = 2e-6

_SLACKS: weakref.WeakKeyDictionary[nn.Module, AdamSlack] = weakref.WeakKeyDictionary()


class AdamSlack:
    """How far gradient rounding may move each weight of an Adam reference run.

    Adam steps an element by lr * m / (sqrt(v) + eps) (bias-corrected): it divides out the
    gradient's scale, so an element whose gradient is near the rounding noise of its tensor gets a
    step made of noise, and two fp32 computations of the same gradients (the engine's and plain
    PyTorch's; torch's AVX2 and AVX-512 kernels) can move it differently by far more than any fp32
    tolerance on the weight. Noise ``n`` in the gradients so far changes a step by at most about
    lr * 2n / (sqrt(v) + eps) (n through m, n again through v), and never by more than two whole
    steps (Adam's normalised step is about one at most). ``record`` adds that bound per element
    after each step, from the reference run's own Adam state, with n = ``GRAD_NOISE`` x the
    largest gradient element the tensor has had: a few 1e-6 for an element with a typical
    gradient (under the fp32 tolerance), up to Adam's own step for one whose gradient is noise,
    and nothing for one that never had a gradient (an embedding row no batch used: its steps
    are exactly zero in any arrangement).

    A staleness or ordering bug changes gradients by their own size, not by their rounding: it
    moves every element with a real gradient by a sizeable part of lr, far outside its slack.

    The allowance only grows (a running maximum of the gradient, a sum over steps), so it could
    go vacuous: ``vacuous`` names the tensors where more than ``VACUOUS_SHARE`` of the elements
    carry ``VACUOUS_STEPS`` x the summed learning rate or more (Adam's whole movement is about
    one lr per step), and ``assert_same_weights`` fails on them. ``had_gradient`` is the mask of
    elements that ever had a non-zero gradient: the ones a negative control must see fail.
    """

    def __init__(self, noise: float = GRAD_NOISE) -> None:
        self.noise = noise
        self._slack: dict[int, torch.Tensor] = {}  # id(parameter) -> per-element allowance
        self._scale: dict[int, float] = {}  # id(parameter) -> largest |gradient| so far
        self._had: dict[int, torch.Tensor] = {}  # id(parameter) -> ever a non-zero gradient
        self._lr_sum: dict[int, float] = {}  # id(parameter) -> sum of the steps' lr

    @classmethod
    def of(cls, model: nn.Module) -> AdamSlack:
        """The record of the reference runs over ``model`` (a second run goes on adding to the
        first's), which ``assert_same_weights`` applies when ``model`` is the expected side."""
        if model not in _SLACKS:
            _SLACKS[model] = cls()
        return _SLACKS[model]

    @torch.no_grad()
    def record(self, optimizer: torch.optim.Optimizer) -> None:
        """Add one step's allowance; call after ``optimizer.step()``, before ``zero_grad``."""
        for group in optimizer.param_groups:
            lr, eps, (_, beta2) = group["lr"], group["eps"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                key = id(p)
                self._scale[key] = max(self._scale.get(key, 0.0), float(p.grad.abs().max()))
                state = optimizer.state[p]
                v_hat = state["exp_avg_sq"] / (1 - beta2 ** float(state["step"]))
                noise = self.noise * self._scale[key]
                step = (2 * noise / (v_hat.sqrt() + eps)).clamp_(max=2.0).mul_(lr)
                step.masked_fill_(v_hat == 0, 0.0)  # no gradient yet: m = v = 0, no step
                self._slack[key] = self._slack[key] + step if key in self._slack else step
                had = p.grad != 0
                self._had[key] = self._had[key] | had if key in self._had else had
                self._lr_sum[key] = self._lr_sum.get(key, 0.0) + float(lr)

    @classmethod
    @contextlib.contextmanager
    def recording(cls) -> Iterator[AdamSlack]:
        """A slack that records every ``torch.optim.AdamW`` step taken inside the block: for a
        reference run whose optimizer loop is not ``reference_losses``' (a study's own trainer).
        ``attach`` it to the run's model afterwards."""
        slack, real = cls(), torch.optim.AdamW.step

        def step(self: torch.optim.Optimizer, *args: Any, **kw: Any) -> Any:
            out = real(self, *args, **kw)
            slack.record(self)
            return out

        with _monkeypatch() as patch:
            patch.setattr(torch.optim.AdamW, "step", step)
            yield slack

    def attach(self, model: nn.Module) -> None:
        """Make this the record of the reference runs over ``model`` (what ``of`` returns and
        ``assert_same_weights`` applies when ``model`` is the expected side)."""
        _SLACKS[model] = self

    def get(self, param: torch.Tensor) -> torch.Tensor | None:
        return self._slack.get(id(param))

    def had_gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """The elements of ``param`` that had a non-zero gradient in a recorded step."""
        return self._had.get(id(param))

    def vacuous(self, model: nn.Module) -> dict[str, float]:
        """Parameter name -> the share of its elements whose allowance reached
        ``VACUOUS_STEPS`` x the summed lr of its steps, for the tensors where that share is
        over ``VACUOUS_SHARE`` (none: the slack still checks nearly every element)."""
        out = {}
        for name, p in model.named_parameters():
            slack = self._slack.get(id(p))
            if slack is None or slack.numel() == 0:
                continue
            share = float((slack >= VACUOUS_STEPS * self._lr_sum[id(p)]).float().mean())
            if share > VACUOUS_SHARE:
                out[name] = share
        return out


def _monkeypatch() -> Any:
    import pytest  # the helpers are also imported by support scripts that run without pytest

    return pytest.MonkeyPatch.context()


def rounding_noise(scale: float) -> Callable[[nn.Module], None]:
    """A gradient edit standing for another arrangement of the same fp32 sums: each gradient
    element moved by up to ``scale`` x its tensor's largest element (a fixed seed: the same
    noise every run). An exact zero stays zero: no arrangement of no terms makes anything
    else. Apply it to a model's gradients right before its optimizer steps."""
    gen = torch.Generator().manual_seed(0)

    def perturb(model: nn.Module) -> None:
        for p in model.parameters():
            if p.grad is not None:
                noise = (torch.rand(p.shape, generator=gen) * 2 - 1) * (p.grad != 0)
                p.grad.add_(noise * scale * float(p.grad.abs().max()))

    return perturb


# An allowance of half the summed lr is half of everything Adam can have moved an element (its
# normalised step is about one at most): such an element is no longer checked. More than 1 % of
# a tensor's elements there and the comparison has gone vacuous (issue 41).
VACUOUS_STEPS, VACUOUS_SHARE = 0.5, 0.01


def assert_same_weights(
    a: nn.Module, b: nn.Module, *, rtol: float = 1e-4, atol: float = 1e-5
) -> None:
    """Every parameter of ``a`` close to ``b``'s, in order (fp32 tolerances by default); a
    mismatch is reported as :func:`assert_close_named` reports it.

    When ``b`` is a reference run's model (``reference_losses``), each element may also differ
    by its ``AdamSlack``: what the rounding of its gradients can move Adam's steps by. A slack
    gone vacuous (``AdamSlack.vacuous``) fails the comparison, whatever the weights."""
    slack = _SLACKS.get(b)
    if slack is not None:
        vacuous = slack.vacuous(b)
        assert not vacuous, (
            f"the Adam slack went vacuous: these tensors have more than {VACUOUS_SHARE:.0%} of "
            f"their elements allowed {VACUOUS_STEPS} x the summed lr or more (share): {vacuous}"
        )
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        extra = slack.get(q) if slack is not None else None
        assert_weight_close(p, q, rtol=rtol, atol=atol, slack=extra, name=f"parameter {name!r}")


def outside_allowance(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    rtol: float,
    atol: float,
    slack: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(|actual - expected|, allowed, mask of the elements outside it): allowed is
    atol + rtol * |expected| + ``slack`` (0 without one); NaN is outside."""
    diff = (actual.detach() - expected.detach()).abs()
    allowed = atol + rtol * expected.detach().abs()
    if slack is not None:
        allowed = allowed + slack
    return diff, allowed, ~(diff <= allowed)


def mismatch_shares(
    a: nn.Module, b: nn.Module, *, rtol: float = 1e-4, atol: float = 1e-5
) -> dict[str, float]:
    """For a negative control: per parameter of ``b`` (a reference run's model) that had a
    gradient, the share of those elements of ``a`` outside their allowance (what
    ``assert_same_weights`` allows them)."""
    slack = _SLACKS[b]
    out = {}
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        had = slack.had_gradient(q)
        if had is None or not bool(had.any()):
            continue
        _, _, bad = outside_allowance(p, q, rtol=rtol, atol=atol, slack=slack.get(q))
        out[name] = float(bad[had].float().mean())
    return out


def slack_used(a: nn.Module, b: nn.Module, *, rtol: float = 1e-4, atol: float = 1e-5) -> float:
    """For a positive control: the largest share of its Adam slack an element of ``a`` needs
    beyond the plain tolerance to match ``b`` (a reference run's model): 0 when the fp32
    tolerance alone holds everything, over 1 when ``assert_same_weights`` fails."""
    slack = _SLACKS[b]
    used = 0.0
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        extra = slack.get(q)
        diff, allowed, _ = outside_allowance(p, q, rtol=rtol, atol=atol, slack=None)
        over = (diff - allowed).clamp(min=0)
        if extra is None:
            used = max(used, float("inf") if bool(over.any()) else 0.0)
            continue
        need = torch.where(over > 0, over / extra, torch.zeros_like(over))  # x / 0 = inf
        used = max(used, float(need.max()))
    return used


def assert_weight_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    rtol: float,
    atol: float,
    slack: torch.Tensor | None,
    name: str,
) -> None:
    """``torch.testing.assert_close``, each element allowed ``slack`` more when given:
    |actual - expected| <= atol + rtol * |expected| + slack."""
    if slack is None:
        assert_close_named(actual, expected, name, rtol=rtol, atol=atol)
        return
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
    diff, allowed, bad = outside_allowance(actual, expected, rtol=rtol, atol=atol, slack=slack)
    if bool(bad.any()):
        i = int(torch.where(bad.flatten(), diff.flatten() - allowed.flatten(), -1.0).argmax())
        raise AssertionError(
            f"{name}: largest |difference| {diff.max().item():.6g}; {int(bad.sum())} of "
            f"{diff.numel()} elements differ by more than "
            f"atol + rtol * |expected| + Adam slack; worst at flat index {i}: actual "
            f"{actual.flatten()[i].item():.9g}, expected {expected.flatten()[i].item():.9g}, "
            f"|diff| {diff.flatten()[i].item():.3g} > allowed {allowed.flatten()[i].item():.3g} "
            f"(slack {slack.flatten()[i].item():.3g})"
        )


def assert_close_named(actual: Any, expected: Any, name: str, **tolerances: Any) -> None:
    """``torch.testing.assert_close`` whose failure names the tensor and its largest absolute
    difference, then gives torch's own report (mismatched elements, greatest differences and
    where); ``msg=name`` would replace that report with the name alone."""

    def report(torch_report: str) -> str:
        try:
            a, b = torch.as_tensor(actual), torch.as_tensor(expected)
        except (TypeError, ValueError, RuntimeError):  # not tensor-like: torch's report alone
            return f"{name}\n{torch_report}"
        if a.shape == b.shape and a.is_floating_point() and b.is_floating_point():
            largest = (a.detach().double() - b.detach().double()).abs().max().item()
            return f"{name}: largest |difference| {largest:.6g}\n{torch_report}"
        return f"{name}\n{torch_report}"

    torch.testing.assert_close(actual, expected, msg=report, **tolerances)


def measured_peak_with_runs_in_flight(
    engine: Any, batches: Callable[[int], list[Any]], *, steps: int = 3, wait_s: float = 1.0
) -> int:
    """Train ``steps`` steps and return the largest device peak from the last step's call
    on (the peaks are reset just before it; the engine never resets them), after a drain. With overlapping iterations the run
    before it is still in flight when it is issued; its last compute on each device is held
    until the last run has landed ``prefetch_depth + 1`` weight uploads there (or ``wait_s``
    passed: the executor may rightly make them wait for that very compute's FREE), so the two
    runs' weights meet on the device as they may on a GPU, where the last backward slots are
    slow. Without overlap nothing is held (nothing of the last run starts before the drain)."""
    from rp_engine.device.base import StreamRole

    executor = engine._executor
    held_step, last_step = engine.global_steps + steps - 1, engine.global_steps + steps
    wanted = engine.planner.prefetch_depth + 1
    landed = {d.index: 0 for d in engine.pool}
    enough = {d.index: threading.Event() for d in engine.pool}
    lock = threading.Lock()
    upload, launch = executor._upload, executor._launch

    def counted_upload(ctx: Any, a: Any) -> None:
        upload(ctx, a)
        if ctx.spec.step != last_step:
            return

        def count() -> None:
            with lock:
                landed[a.device] += 1
                if landed[a.device] >= wanted:
                    enough[a.device].set()

        executor.devices[a.device].stream(StreamRole.H2D_PARAM).submit(count, label="probe")

    def held_launch(ctx: Any, a: Any, layers: Any, inputs: Any, body: Any, **kw: Any) -> Any:
        mine = [x for x in ctx.spec.plan.per_device(a.device) if x.is_compute]
        if engine._overlap and ctx.spec.step == held_step and a == mine[-1]:
            inner = body

            def body(device: Any, weights: Any) -> None:
                enough[device.index].wait(timeout=wait_s)
                inner(device, weights)

        return launch(ctx, a, layers, inputs, body, **kw)

    executor._upload, executor._launch = counted_upload, held_launch
    try:
        for i in range(steps):
            if i == steps - 1:
                for device in engine.pool:
                    device.reset_peak()
            engine.train_batch(iter(batches(i)))
        engine.synchronize()
    finally:
        executor._upload, executor._launch = upload, launch
    return max(d.memory_stats()["peak"] for d in engine.pool)
