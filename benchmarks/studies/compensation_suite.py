"""The staleness-compensation suite that ``"auto"`` is chosen on (issue 43).

Every task of benchmarks/studies/compensation_tasks.py is trained once per method and seed (a seed
fixes the model and the batches, the same for every method), in a pure-PyTorch loop with the engine's staleness-1 rule: a copy
of the model holds the weights an iteration reads, which miss the previous iteration's update
(iteration t reads w_{t-2}, or the prediction published for it). The forms are those of
benchmarks/studies/staleness_reference.py, which the engine equals to rounding
(tests/engine/test_compensation_combos.py):

- ``sync``: no staleness; ``stale``: plain async, the masters published as they are;
- ``predict``, ``lookahead``: the weights published one Adam step ahead (the engine's);
- ``lookahead_dc``: lookahead, and each gradient delay-compensated as the engine does it
  (reference mode ``dce:0.01``);
- ``dc_when_clipped``: a run-time rule that was a candidate for ``"auto"`` and was not kept:
  lookahead, with the delay compensation only on the steps where global-norm clipping binds
  (the engine knows each step's clip coefficient before any layer steps); the compensation's
  per-tensor scale is measured on those steps only;
- ``auto``: what the engine's ``"auto"`` resolves to (``auto_method``: rp_engine/optim/
  stepper.py ``staleness_compensation``), so the suite and its tests follow the engine's rule.

A task's learning rate is applied with warm-up as the engine applies it: the gradient of
iteration t is applied by step t with step t's rate, whenever that step runs. The measure is the
mean training loss over the steps after the task's burn-in (issue 43: steps 11-120), relative
to sync's, averaged over the task's seeds; the "closed" figure is the share of plain async's gap
a method closes. The criteria "auto" is chosen by (``summary``): on every task no worse than
plain async by more than ``TOLERANCE`` of its loss, and on average closing at least half of
plain async's gap (over the tasks where that gap exceeds ``TOLERANCE``).

    python -m benchmarks.studies.compensation_suite --jsonl suite.jsonl   # every task, method, seed
    python -m benchmarks.studies.compensation_suite --tasks seq-qwen2-2e-3 \
        --methods stale,auto --seeds 0
    python -m benchmarks.studies.compensation_suite --table-from suite.jsonl   # the table again

Prints one JSON line per run (and appends it to ``--jsonl``), then a markdown table (every task,
every method, the gap to sync; where ``auto`` lands) and each method against the criteria. One
run is 0.3-10 s on one core of this 2-core host; the whole suite about 25 minutes.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.studies.compensation_tasks import TASKS, Task
from benchmarks.studies.staleness_reference import _engine_dc, _published, read_iteration
from rp_engine.optim.delay_compensation import RHO
from rp_engine.optim.stepper import staleness_compensation

__all__ = [
    "METHODS", "TOLERANCE", "Run", "aggregate", "auto_method", "dc_on_step", "gap",
    "run_records", "train", "verdict",
]  # fmt: skip

# method -> when the delay compensation runs: "never", "always", or "clipped" (the steps where
# the global-norm clip binds). None: no compensation at all (sync, stale, predict). "auto" is
# looked up as the method the engine resolves it to (``auto_method``).
METHODS: dict[str, str | None] = {
    "sync": None,
    "stale": None,
    "predict": None,
    "lookahead": "never",
    "lookahead_dc": "always",
    "dc_when_clipped": "clipped",
    "auto": None,
}
TOLERANCE = 0.005  # issue 43: "auto" may be worse than plain async by at most 0.5 % of the loss


def auto_method() -> str:
    """The method the engine's ``"auto"`` runs where it applies (the asynchronous optimizer on
    DeepSpeed's CPU Adam, one process)."""
    return staleness_compensation("auto", async_mode=True, can_predict=True, data_parallel=False)


def dc_on_step(rule: str | None, clip: float, raw_norm: float) -> bool:
    """Whether a step whose raw (unclipped) gradient has global norm ``raw_norm`` is delay-
    compensated under ``rule`` (``METHODS``'s values) with clipping at ``clip`` (0: none)."""
    if rule == "always":
        return True
    if rule == "clipped":
        return clip > 0 and raw_norm > clip
    return False


@torch.no_grad()
def _apply(
    grads: list[torch.Tensor], read: list[torch.Tensor] | None, lr: float, *,
    params: list[torch.Tensor], opt: torch.optim.Optimizer, method: str, clip: float,
    seen: dict[int, float],
) -> tuple[bool, bool]:  # fmt: skip
    """One optimizer step with ``grads`` (taken at ``read``; None: not stale) at rate ``lr``:
    clip, compensate, step Adam. Returns (clipping bound, delay-compensated)."""
    for group in opt.param_groups:
        group["lr"] = lr
    raw_norm = float(torch.stack([g.norm() for g in grads]).norm())
    bound = clip > 0 and raw_norm > clip
    dc = read is not None and dc_on_step(METHODS[method], clip, raw_norm)
    eps = opt.param_groups[0]["eps"]
    if dc:  # clips at the raw norm itself, then compensates (the engine's order)
        assert read is not None
        _engine_dc(grads, params, read, opt, RHO, clip, raw_norm, eps, seen)
    elif bound:
        coef = clip / (raw_norm + 1e-6)
        for g in grads:
            g.mul_(coef)
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt.step()
    return bound, dc


@torch.no_grad()
def _publish(params: Sequence[torch.Tensor], rparams: Sequence[torch.Tensor], method: str,
             lr: float, opt: torch.optim.Optimizer) -> None:  # fmt: skip
    """Write what the next iteration reads of each master into the reader's copy."""
    group = opt.param_groups[0]
    for p, r in zip(params, rparams, strict=True):
        if method == "stale":
            r.copy_(p)
            continue
        kind = "predict" if method == "predict" else "lookahead"
        assert p.grad is not None  # the gradient just applied (the look-ahead repeats it)
        r.copy_(_published(p, opt.state[p], p.grad, kind, 0.0, lr, group["betas"], group["eps"]))


@dataclass(frozen=True)
class Run:
    """One method's run of one task: per-step training losses and how many of its steps the
    clip bound and the delay compensation ran on."""

    task: str
    method: str
    seed: int
    losses: list[float]
    clipped: int
    compensated: int
    seconds: float

    def mean(self, burn_in: int) -> float:
        """The mean training loss after the first ``burn_in`` steps."""
        return statistics.mean(self.losses[burn_in:])


def train(task: Task, method: str, seed: int = 0) -> Run:
    """Train ``task`` with ``method`` (``METHODS``) from ``seed`` under the staleness-1 rule
    (sync: none); returns the run."""
    if method not in METHODS:
        raise ValueError(f"method {method!r}: expected one of {list(METHODS)}")
    label = method
    if method == "auto":  # the engine's "none" is the suite's plain async
        method = {"none": "stale"}.get(auto_method(), auto_method())
    if method not in METHODS or method == "auto":
        raise ValueError(f'"auto" resolves to {method!r}, which the suite does not know')
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = task.model(seed)
    reader = copy.deepcopy(model)  # the weights each iteration reads
    pairs = [
        (p, r)
        for p, r in zip(model.parameters(), reader.parameters(), strict=True)
        if p.requires_grad
    ]
    params, rparams = [p for p, _ in pairs], [r for _, r in pairs]
    opt = torch.optim.AdamW(params, lr=task.lr, weight_decay=0.0)
    data = task.data(seed)
    seen: dict[int, float] = {}  # the delay compensation's per-tensor scale (rms at its last step)
    pending: tuple[list[torch.Tensor], list[torch.Tensor], float] | None = None
    losses: list[float] = []
    clipped = compensated = 0
    for step in range(task.steps):
        lr = task.lr * min(1.0, (step + 1) / task.warmup) if task.warmup else task.lr
        total, grads = read_iteration(
            params, rparams, sync=method == "sync", gas=task.gas,
            micro_loss=lambda: task.loss(reader, next(data)),
        )  # fmt: skip
        losses.append(total)
        kw: dict[str, Any] = dict(params=params, opt=opt, method=method, clip=task.clip, seen=seen)
        if method == "sync":
            bound, dc = _apply(grads, None, lr, **kw)
        else:  # step t's gradient is applied while iteration t+1 computes, at step t's rate
            taken_at = [r.detach().clone() for r in rparams]
            apply, pending = pending, (grads, taken_at, lr)
            if apply is None:
                continue
            bound, dc = _apply(*apply, **kw)
            _publish(params, rparams, method, apply[2], opt)
        clipped += bound
        compensated += dc
    return Run(task.name, label, seed, losses, clipped, compensated, time.perf_counter() - t0)


def gap(run: Run, sync: Run, burn_in: int) -> float:
    """``run``'s mean loss relative to sync's, minus 1."""
    return run.mean(burn_in) / sync.mean(burn_in) - 1.0


def verdict(gaps: dict[str, float], method: str = "auto") -> str:
    """Where ``method`` lands on one task: against plain async (``stale``) within
    ``TOLERANCE``, and the share of async's gap to sync it closes."""
    own, stale = gaps[method], gaps["stale"]
    worse = (1 + own) / (1 + stale) - 1  # relative to async's loss
    if worse > TOLERANCE:
        return f"**worse than async** ({100 * worse:+.2f} % of its loss)"
    closed = f", closes {100 * (stale - own) / stale:.0f} % of async's gap" if stale > 0 else ""
    return f"not worse than async ({100 * worse:+.2f} %){closed}"


def _table(results: dict[str, dict[str, float]], methods: Sequence[str]) -> str:
    """The markdown table: per task, each method's gap to sync (mean over the seeds), and where
    auto lands against plain async (``verdict``; its worst single seed too)."""
    shown = [m for m in methods if m != "sync"]
    head = "| task | what | seeds | sync loss | " + " | ".join(shown) + " | auto lands |"
    rule = "|---|---|---:|---:|" + "---:|" * len(shown) + "---|"
    lines = [head, rule]
    for name, row in results.items():
        cells = [f"{100 * row[m]:+.2f} %" for m in shown]
        lands = verdict(row) if "auto" in row and "stale" in row else ""
        if "auto_worst_seed" in row:
            lands += f"; worst seed {100 * row['auto_worst_seed']:+.2f} %"
        lines.append(f"| {name} | {TASKS[name].what} | {row['seeds']:.0f} | "
                     f"{row['sync_loss']:.4f} | " + " | ".join(cells) + f" | {lands} |")  # fmt: skip
    return "\n".join(lines)


def summary(results: dict[str, dict[str, float]], method: str = "auto") -> str:
    """The two criteria over the tasks: the worst excess over async, and the mean share of
    async's gap closed (over the tasks where async's gap exceeds ``TOLERANCE``)."""
    worst = max((1 + r[method]) / (1 + r["stale"]) - 1 for r in results.values())
    shares = [(r["stale"] - r[method]) / r["stale"] for r in results.values()
              if r["stale"] > TOLERANCE]  # fmt: skip
    mean_gap = statistics.mean(r[method] for r in results.values())
    mean_stale = statistics.mean(r["stale"] for r in results.values())
    closed = statistics.mean(shares) if shares else float("nan")
    return (f"{method}: worst vs async {100 * worst:+.2f} % (tolerance +{100 * TOLERANCE:.1f} %); "
            f"mean share of async's gap closed {100 * closed:.0f} % over {len(shares)} tasks; "
            f"mean gap {100 * mean_gap:+.2f} % vs async's {100 * mean_stale:+.2f} %")  # fmt: skip


def run_records(names: Sequence[str], methods: Sequence[str], seeds: Sequence[int] | None,
                jsonl: str | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Train every task of ``names`` with every method and seed (None: the task's own
    ``seeds`` first seeds); one record per run (printed as a JSON line, and appended to
    ``jsonl``)."""
    records = []
    for name in names:
        task = TASKS[name]
        for seed in range(task.seeds) if seeds is None else seeds:
            runs = {m: train(task, m, seed) for m in methods}
            for m, run in runs.items():
                record = {"task": name, "method": m, "seed": seed, "lr": task.lr,
                          "mean_loss": run.mean(task.burn_in),
                          "gap": gap(run, runs["sync"], task.burn_in),
                          "clipped_steps": run.clipped, "compensated_steps": run.compensated,
                          "steps": task.steps, "burn_in": task.burn_in,
                          "seconds": round(run.seconds, 2)}  # fmt: skip
                records.append(record)
                print(json.dumps(record), flush=True)
                if jsonl:
                    with open(jsonl, "a") as f:
                        f.write(json.dumps(record) + "\n")
    return records


def aggregate(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per task (in ``TASKS``' order): each method's gap to sync averaged over the seeds that
    every method ran, sync's mean loss, the number of seeds, and ``auto_worst_seed``, the
    largest excess of auto's loss over plain async's on one seed."""
    results: dict[str, dict[str, float]] = {}
    for name in [n for n in TASKS if any(r["task"] == n for r in records)]:
        rows = [r for r in records if r["task"] == name]
        methods = dict.fromkeys(r["method"] for r in rows)
        # the seeds every method ran (records merged from several runs may be ragged)
        ran = {(r["method"], r["seed"]) for r in rows}
        seeds = sorted(s for s in {r["seed"] for r in rows} if all((m, s) in ran for m in methods))
        rows = [r for r in rows if r["seed"] in seeds]
        row: dict[str, float] = {
            m: statistics.mean(r["gap"] for r in rows if r["method"] == m) for m in methods
        }
        row["sync_loss"] = statistics.mean(r["mean_loss"] for r in rows if r["method"] == "sync")
        row["seeds"] = len(seeds)
        if "auto" in methods and "stale" in methods:
            by = {(r["method"], r["seed"]): r["mean_loss"] for r in rows}
            row["auto_worst_seed"] = max(by["auto", s] / by["stale", s] - 1 for s in seeds)
        results[name] = row
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated task names")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated; sync first")
    ap.add_argument("--seeds", help="comma-separated, for every task (default: each task's "
                    "own count, 0, 1, ...); the gaps are averaged over them")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--jsonl", help="append one JSON line per run to this file")
    ap.add_argument("--table-from", help="no runs: the table of the records in this JSONL file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    if "sync" not in methods:
        methods.insert(0, "sync")
    if args.table_from:
        with open(args.table_from) as f:
            records = [json.loads(line) for line in f if line.strip()]
        methods = [m for m in METHODS if any(r["method"] == m for r in records)]
    else:
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
        records = run_records(args.tasks.split(","), methods, seeds, args.jsonl)
    results = aggregate(records)
    print()
    print(_table(results, methods))
    if "stale" in methods:
        print()
        for m in methods:
            if m not in ("sync", "stale"):
                print("- " + summary(results, m))
    return 0


if __name__ == "__main__":
    sys.exit(main())
