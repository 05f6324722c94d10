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
- ``dc:lam``: lookahead plus DC-ASGD's delay compensation of the gradient Adam receives,
  g + lam g^2 (w - w_read) / (sqrt(v_hat) + eps);
- ``warm:n``: lookahead with the learning rate warmed up linearly over the first n steps.

    python -m benchmarks.staleness_reference --lr 2e-3 --modes sync,stale,predict,lookahead
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
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
    m1 = (b1 * st["exp_avg"] + (1 - b1) * nxt) / (1 - b1 ** (s + 1))
    v1 = (b2 * st["exp_avg_sq"] + (1 - b2) * nxt * nxt) / (1 - b2 ** (s + 1))
    k = arg if mode == "lookahead" and arg else 1.0
    return p - k * lr * m1 / (v1.sqrt() + eps)


def train(mode_spec: str, *, lr: float, steps: int, seed: int) -> list[float]:
    """Per-step training losses of one run."""
    mode, _, num = mode_spec.partition(":")
    arg = float(num) if num else 0.0
    model = build_tiny_model(seed=seed, layers=2, hidden=64).float()
    reader = copy.deepcopy(model)  # the weights each iteration reads
    params, rparams = list(model.parameters()), list(reader.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    betas, eps = opt.param_groups[0]["betas"], opt.param_groups[0]["eps"]
    data = batches(stdlib_corpus(), seq_len=SEQ, micro_batch=MICRO, seed=seed)
    pending: list[torch.Tensor] | None = None  # stale: the gradient not yet applied
    read: list[torch.Tensor] | None = None  # the weights the pending gradient was taken at
    losses = []
    for step in range(steps):
        warm = mode in ("warm", "sync") and arg > 0
        rate = lr * min(1.0, (step + 1) / arg) if warm else lr
        for group in opt.param_groups:
            group["lr"] = rate
        if mode == "sync":
            with torch.no_grad():
                for r, p in zip(rparams, params, strict=True):
                    r.copy_(p)
        for r in rparams:
            r.grad = None
        total = 0.0
        for _ in range(GAS):
            out = reader(**next(data))
            (out.loss / GAS).backward()
            total += float(out.loss.detach()) / GAS
        losses.append(total)
        grads = [r.grad.detach().clone() for r in rparams]  # type: ignore[union-attr]
        taken_at = [r.detach().clone() for r in rparams]
        if mode == "sync":
            apply, apply_read = grads, None
        else:
            apply, apply_read, pending, read = pending, read, grads, taken_at
        if apply is None:
            continue
        if mode == "dc" and apply_read is not None:
            for g, p, w_read in zip(apply, params, apply_read, strict=True):
                st = opt.state.get(p)
                if st:
                    v_hat = st["exp_avg_sq"] / (1 - betas[1] ** int(st["step"]))
                    g.add_(arg * g * g * (p.detach() - w_read) / (v_hat.sqrt() + eps))
        for p, g in zip(params, apply, strict=True):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if mode == "sync":
            continue
        with torch.no_grad():  # publish what the next iteration reads
            for r, p in zip(rparams, params, strict=True):
                if mode == "stale":
                    r.copy_(p)
                else:
                    r.copy_(_published(p, opt.state[p], p.grad, mode, arg, rate, betas, eps))
    return losses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--modes", default="sync,stale,predict,lookahead")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sync-loss", type=float, help="compare with this sync loss instead")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    finals = {}
    for mode in args.modes.split(","):
        finals[mode] = statistics.mean(
            train(mode, lr=args.lr, steps=args.steps, seed=args.seed)[-TAIL:]
        )
        base = args.sync_loss or finals.get("sync")
        gap = f" {100 * (finals[mode] - base) / base:+.1f} %" if base else ""
        print(f"lr {args.lr:g} seed {args.seed} {mode}: final-{TAIL} mean {finals[mode]:.4f}{gap}",
              file=sys.stderr, flush=True)  # fmt: skip
    print(json.dumps({"lr": args.lr, "seed": args.seed, "steps": args.steps, "final": finals}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
