"""Staleness compensation methods in plain PyTorch: the reference for issue 28's exploration.

Trains the ``convergence`` benchmark's model on its data (a 2-layer, hidden-64 tiny Qwen3, the
rp-train default corpus, micro-batch 4 x accumulation 4, 32 tokens, torch AdamW, clipping at
1.0) with the staleness-1 rule of the engine's asynchronous optimizer: a copy of the model
holds the weights an iteration reads, which miss the previous iteration's update. Each method
changes only what is published into that copy (and, for delay compensation, the gradient
Adam receives), so many variants can be compared in seconds each, without the engine. The
methods the engine keeps ("predict", "lookahead") give the same gaps here as in
``engine_bench.py convergence`` (benchmarks/RESULTS.md).

Modes (comma-separated; ``name:x`` takes a number):

- ``sync[:n]``: no staleness (with n: the learning rate warmed up linearly over the first n
  steps); ``stale``: staleness 1, masters published as they are;
- ``predict[:k]``: k Adam steps along the moments at hand (k = 1: the engine's "predict");
- ``lookahead[:k]``: along the next moments if the last gradient repeats (the engine's);
- ``mix:a``: the next gradient assumed a g + (1 - a) m_hat (a = 1: lookahead, 0: predict);
- ``sign:a``: lookahead, but where the last gradient turned against the momentum before it,
  the next one assumed a times it;
- ``warm:n``: lookahead with the learning rate warmed up linearly over the first n steps;
- ``adapt:r``: lookahead scaled per tensor by the fit of the last prediction to the step it
  predicted, <true step, predicted step> / |predicted step|^2, averaged with rate r;
- ``b1:x``: lookahead with Adam's beta1 set to x (staleness adds momentum of its own);
- delay compensation, on top of lookahead: the gradient Adam receives, taken at the weights
  the iteration read, moved to the masters it is applied at, g + H (w - w_read), with a
  diagonal curvature model H (``_compensate``): ``dc:lam`` (DC-ASGD's lam g^2 /
  (sqrt(v_hat) + eps)), ``dch:c`` (c (sqrt(v_hat) + eps) / lr), ``dck:c`` (c kappa
  (sqrt(v_hat) + eps), kappa the tensor's measured secant curvature), ``dcr:rho``
  ((sqrt(v_hat) + eps) / (rho rms(w))), ``dca:rho`` (dcr after clipping) and ``dcb:k``
  (dcr:0.01 after clipping, its norm bounded by k times the clipped gradient's, per tensor),
  ``dcg:rho`` (rms(g) / (rho rms(w)) per tensor: the raw gradient's scale instead of v's),
  ``dcv:rho`` (dcr with v from a shadow copy that sees only the raw gradients), ``dcn:rho``
  (dcr, then the whole gradient rescaled to the raw one's global norm), ``dcl:rho`` (the same
  with the last step's norm ratio) and ``dce:rho``, the engine's "lookahead_dc"
  (``_engine_dc``: dcr with the norm kept per block, rms(w) from the tensor's last step);
- ``pull:mu``: lookahead, and after each step the masters pulled a fraction mu toward the
  weights the applied gradient was taken at.

Each run also reports the held-out loss of its final masters (``held_out_loss``: fixed windows,
the same for every run), the quality of what it produces apart from the weights its
iterations happened to read.

    python -m benchmarks.studies.staleness_reference --lr 2e-3 --modes sync,stale,predict,lookahead
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

from rp_engine.train.cli import batches, build_tiny_model, stdlib_corpus

GAS, MICRO, SEQ, TAIL = 4, 4, 32, 20


def _published(p: torch.Tensor, st: dict[str, Any], g: torch.Tensor, mode: str, arg: float,
               lr: float, betas: tuple[float, float], eps: float) -> torch.Tensor:  # fmt: skip
    """What the next iteration reads of master ``p`` after its step (state ``st``, gradient
    ``g`` just applied)."""
    b1, b2 = betas
    s = int(st["step"])
    m_hat, v_hat = st["exp_avg"] / (1 - b1**s), st["exp_avg_sq"] / (1 - b2**s)
    if mode == "predict":
        return p - (arg or 1.0) * lr * m_hat / (v_hat.sqrt() + eps)
    nxt = arg * g + (1 - arg) * m_hat if mode == "mix" else g
    if mode == "sign":  # where g turned against the momentum before it, assume arg * g next
        before = st["exp_avg"] - (1 - b1) * g  # b1 * m before this step
        nxt = torch.where(g * before >= 0, g, arg * g)
    m1 = (b1 * st["exp_avg"] + (1 - b1) * nxt) / (1 - b1 ** (s + 1))
    v1 = (b2 * st["exp_avg_sq"] + (1 - b2) * nxt * nxt) / (1 - b2 ** (s + 1))
    k = arg if mode == "lookahead" and arg else 1.0
    return p - k * lr * m1 / (v1.sqrt() + eps)


DELAY_COMPENSATED = ("dc", "dch", "dck", "dcr", "dca", "dcb", "dcg", "dcn", "dcv", "dcl", "dce")
AFTER_CLIPPING = ("dca", "dcb")  # the delay compensations applied to the clipped gradient


def _rms(t: torch.Tensor) -> float:
    """Root mean square of ``t``."""
    return float(t.pow(2).mean().sqrt())


@torch.no_grad()
def _compensate(g: torch.Tensor, w: torch.Tensor, w_read: torch.Tensor, st: dict[str, Any] | None,
                mode: str, arg: float, lr: float, b2: float, eps: float,
                mem: dict[str, Any]) -> None:  # fmt: skip
    """Delay compensation in place: ``g``, taken at ``w_read``, moved to the masters ``w`` it
    is applied at by a diagonal curvature model, g + H (w - w_read). H by mode:

    - ``dc``: DC-ASGD's arg g^2 / (sqrt(v_hat) + eps);
    - ``dch``: arg (sqrt(v_hat) + eps) / lr (Adam's preconditioner, scaled at the rate);
    - ``dck``: arg kappa (sqrt(v_hat) + eps), kappa the tensor's secant curvature along the
      read points, <g - g_prev, r - r_prev> / <r - r_prev, (sqrt(v_hat) + eps)(r - r_prev)>,
      a running mean;
    - ``dcr``/``dca``: (sqrt(v_hat) + eps) / (arg rms(w)) (the preconditioner over the
      tensor's own scale; ``dca`` applies it after clipping); ``dcb``: rho 0.01 after clipping,
      the correction's norm bounded by arg times the clipped gradient's, per tensor;
    - ``dcg``: rms(g) / (arg rms(w)) per tensor (the raw gradient's scale instead of v's);
    - ``dcv``: dcr's H with v from ``mem["raw_v"]``, a shadow second moment of the raw
      gradients; ``dcn``/``dcl``: dcr's (``train`` rescales the result).
    """
    if not st:  # no moments yet: the first step has nothing to scale the curvature by
        return
    v_hat = st["exp_avg_sq"] / (1 - b2 ** int(st["step"]))
    precond, gap = v_hat.sqrt() + eps, w - w_read
    if mode == "dc":
        g.add_(arg * g * g * gap / precond)
        return
    if mode == "dch":
        g.add_(arg * precond / lr * gap)
        return
    if mode == "dcg":  # no feedback through v, which the correction itself feeds
        g.add_(_rms(g) / (arg * (_rms(w) + 1e-12)) * gap)
        return
    if mode == "dcv":  # v of the raw gradients only: no feedback of the correction through v
        raw_v = mem["raw_v"] / (1 - b2 ** int(st["step"]))
        g.add_((raw_v.sqrt() + eps) / (arg * (_rms(w) + 1e-12)) * gap)
        return
    if mode in ("dcr", "dca", "dcb", "dcn", "dcl"):
        fix = precond / ((0.01 if mode == "dcb" else arg) * (_rms(w) + 1e-12)) * gap
        if mode == "dcb":  # after clipping, bounded by arg times the clipped gradient's norm
            fix.mul_(min(1.0, arg * float(g.norm()) / (float(fix.norm()) + 1e-12)))
        g.add_(fix)
        return
    if "last" in mem:  # dck
        g0, r0 = mem["last"]
        dg, dr = g - g0, w_read - r0
        den = float((dr * dr * precond).sum())
        if den > 0:
            now = float((dg * dr).sum()) / den
            mem["kappa"] = 0.9 * mem.get("kappa", now) + 0.1 * now
    mem["last"] = (g.clone(), w_read.clone())
    g.add_(arg * max(0.0, mem.get("kappa", 0.0)) * precond * gap)


DC_BLOCK = 65536  # optim/delay_compensation.py: the gradient's norm is kept per block


@torch.no_grad()
def _engine_dc(grads: list[torch.Tensor], params: list[torch.Tensor], reads: list[torch.Tensor],
               opt: torch.optim.Optimizer, rho: float, clip: float, raw_norm: float, eps: float,
               seen: dict[int, float]) -> None:  # fmt: skip
    """``dce``: delay compensation as the engine computes it (optim/delay_compensation.py), in
    place on ``grads``: clipped at the raw gradient's norm, then f = coef (sqrt(v_hat) + eps) /
    (rho rms(w)) (w - w_read) with rms(w) from the tensor's previous step (its first step only
    measures it), and per block of ``DC_BLOCK`` elements g <- |g| / |g + f| (g + f)."""
    coef = min(1.0, clip / (raw_norm + 1e-6)) if clip > 0 else 1.0
    b2 = opt.param_groups[0]["betas"][1]
    for g, p, w_read in zip(grads, params, reads, strict=True):
        g.mul_(coef)
        st, rms = opt.state.get(p), seen.get(id(p))
        seen[id(p)] = _rms(p)
        if not st or not rms:  # no moments yet, or no scale (unmeasured, or all zeros)
            continue
        v_hat = st["exp_avg_sq"] / (1 - b2 ** int(st["step"]))
        fix = coef * (v_hat.sqrt() + eps) / (rho * rms) * (p - w_read)
        flat_g, flat_c = g.view(-1), (g + fix).view(-1)
        for lo in range(0, flat_g.numel(), DC_BLOCK):
            gb, cb = flat_g[lo : lo + DC_BLOCK], flat_c[lo : lo + DC_BLOCK]
            den = cb.norm()  # a block with g + f = 0 is left as it is, as the engine's
            gb.copy_(cb * (gb.norm() / den) if den > 0 else cb)


def read_iteration(
    params: list[torch.Tensor],
    rparams: list[torch.Tensor],
    *,
    sync: bool,
    gas: int,
    micro_loss: Callable[[], torch.Tensor],
) -> tuple[float, list[torch.Tensor]]:
    """One iteration on the reader copy (``rparams``, the weights it reads): with ``sync`` the
    reader first takes the masters ``params`` (no staleness); then ``gas`` micro-batches, each
    ``micro_loss()`` backpropagated at 1/``gas``. Returns the mean loss and copies of the
    accumulated gradients (the window's mean gradient)."""
    if sync:
        with torch.no_grad():
            for r, p in zip(rparams, params, strict=True):
                r.copy_(p)
    for r in rparams:
        r.grad = None
    total = 0.0
    for _ in range(gas):
        loss = micro_loss()
        (loss / gas).backward()
        total += float(loss.detach()) / gas
    return total, [r.grad.detach().clone() for r in rparams]  # type: ignore[union-attr]


def train(
    mode_spec: str, *, lr: float, steps: int, seed: int, clip: float = 1.0
) -> tuple[list[float], torch.nn.Module]:
    """Per-step training losses of one run, and the trained model (its masters); ``clip`` is
    the gradient clipping norm (0: none)."""
    mode, _, num = mode_spec.partition(":")
    arg = float(num) if num else 0.0
    model = build_tiny_model(seed=seed, layers=2, hidden=64).float()
    reader = copy.deepcopy(model)  # the weights each iteration reads
    params, rparams = list(model.parameters()), list(reader.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    if mode == "b1":
        opt.param_groups[0]["betas"] = (arg, opt.param_groups[0]["betas"][1])
    curvature: dict[int, dict[str, Any]] = {}  # dck: per tensor, its secant's running state
    fit: dict[int, float] = {}  # adapt: per tensor, the running scale of the prediction
    last: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # adapt: (masters, published)
    betas, eps = opt.param_groups[0]["betas"], opt.param_groups[0]["eps"]
    data = batches(stdlib_corpus(), seq_len=SEQ, micro_batch=MICRO, seed=seed)
    lagged: dict[str, float] = {}  # dcl: the last step's norm ratio
    lagged_dc: dict[int, float] = {}  # dce: per tensor, the rms of its masters at its last step
    pending: list[torch.Tensor] | None = None  # stale: the gradient not yet applied
    read: list[torch.Tensor] | None = None  # the weights the pending gradient was taken at
    losses = []
    for step in range(steps):
        warm = mode in ("warm", "sync") and arg > 0
        rate = lr * min(1.0, (step + 1) / arg) if warm else lr
        for group in opt.param_groups:
            group["lr"] = rate
        total, grads = read_iteration(
            params, rparams, sync=mode == "sync", gas=GAS,
            micro_loss=lambda: reader(**next(data)).loss,
        )  # fmt: skip
        losses.append(total)
        taken_at = [r.detach().clone() for r in rparams]
        if mode == "sync":
            apply, apply_read = grads, None
        else:
            apply, apply_read, pending, read = pending, read, grads, taken_at
        if apply is None:
            continue
        before_clip = mode in DELAY_COMPENSATED and mode not in (*AFTER_CLIPPING, "dce")
        if mode == "dcv":  # the shadow v sees the raw gradient before its compensation
            for g, p in zip(apply, params, strict=True):
                mem = curvature.setdefault(id(p), {})
                mem["raw_v"] = (
                    betas[1] * mem.get("raw_v", torch.zeros_like(g)) + (1 - betas[1]) * g * g
                )
        raw_norm = float(torch.stack([g.norm() for g in apply]).norm())
        if before_clip and apply_read is not None:
            for g, p, w_read in zip(apply, params, apply_read, strict=True):
                _compensate(g, p.detach(), w_read, opt.state.get(p), mode, arg, rate, betas[1], eps,
                            curvature.setdefault(id(p), {}))  # fmt: skip
        if mode in ("dcn", "dcl") and apply_read is not None:  # to the raw gradient's norm
            ratio = raw_norm / (float(torch.stack([g.norm() for g in apply]).norm()) + 1e-12)
            scale = ratio if mode == "dcn" else lagged.get("ratio", 1.0)
            lagged["ratio"] = ratio  # dcl: this step's ratio scales the next step
            for g in apply:
                g.mul_(scale)
        if mode == "dce" and apply_read is not None:  # the engine's form (``_engine_dc``)
            _engine_dc(apply, params, apply_read, opt, arg, clip, raw_norm, eps, lagged_dc)
        for p, g in zip(params, apply, strict=True):
            p.grad = g
        if clip > 0 and not (mode == "dce" and apply_read is not None):  # dce: clipped already
            torch.nn.utils.clip_grad_norm_(params, clip)
        if mode in AFTER_CLIPPING and apply_read is not None:
            for p, w_read in zip(params, apply_read, strict=True):
                assert p.grad is not None
                _compensate(p.grad, p.detach(), w_read, opt.state.get(p), mode, arg, rate, betas[1],
                            eps, {})  # fmt: skip
        opt.step()
        if mode == "pull" and apply_read is not None:  # masters pulled toward the read weights
            with torch.no_grad():
                for p, w_read in zip(params, apply_read, strict=True):
                    p.add_(arg * (w_read - p))
        if mode == "sync":
            continue
        on_lookahead = mode in ("adapt", "b1", "pull", *DELAY_COMPENSATED)
        kind, karg = ("lookahead", 0.0) if on_lookahead else (mode, arg)
        b = opt.param_groups[0]["betas"]
        with torch.no_grad():  # publish what the next iteration reads
            for i, (r, p) in enumerate(zip(rparams, params, strict=True)):
                if mode == "stale":
                    r.copy_(p)
                    continue
                pub = _published(p, opt.state[p], p.grad, kind, karg, rate, b, eps)
                if mode == "adapt":
                    if i in last:
                        w0, r0 = last[i]
                        d_pred, d_true = r0 - w0, p - w0
                        den = float((d_pred * d_pred).sum())
                        if den > 0:
                            a = max(0.0, min(2.0, float((d_true * d_pred).sum()) / den))
                            fit[i] = (1 - arg) * fit.get(i, 1.0) + arg * a
                    pub = p + fit.get(i, 1.0) * (pub - p)
                    last[i] = (p.detach().clone(), pub.clone())
                r.copy_(pub)
    return losses, model


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, *, micro_batches: int = 32, seed: int = 1234) -> float:
    """Mean loss of ``model`` on fixed windows of the corpus (the same for every run): the
    quality of what a run produces, apart from the weights its iterations happened to read."""
    data = batches(stdlib_corpus(), seq_len=SEQ, micro_batch=MICRO, seed=seed)
    return statistics.mean(float(model(**next(data)).loss) for _ in range(micro_batches))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--modes", default="sync,stale,predict,lookahead")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clip", type=float, default=1.0, help="gradient clipping norm (0: none)")
    ap.add_argument("--sync-loss", type=float, help="compare with this sync loss instead")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    finals, held = {}, {}
    for mode in args.modes.split(","):
        losses, model = train(mode, lr=args.lr, steps=args.steps, seed=args.seed, clip=args.clip)
        finals[mode], held[mode] = statistics.mean(losses[-TAIL:]), held_out_loss(model)
        base = args.sync_loss or finals.get("sync")
        gap = f" {100 * (finals[mode] - base) / base:+.1f} %" if base else ""
        hgap = f" {100 * (held[mode] / held['sync'] - 1):+.1f} %" if "sync" in held else ""
        print(f"lr {args.lr:g} seed {args.seed} {mode}: final-{TAIL} mean {finals[mode]:.4f}{gap}"
              f", held-out {held[mode]:.4f}{hgap}", file=sys.stderr, flush=True)  # fmt: skip
    print(json.dumps({"lr": args.lr, "seed": args.seed, "steps": args.steps, "final": finals,
                      "held_out": held}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
