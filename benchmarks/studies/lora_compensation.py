"""LoRA fine-tune of a saved model on text at 2e-4 with rp-train: sync vs async vs compensated.

Issue 28's acceptance item: "run a LoRA fine-tune of a saved model on text at 2e-4 (rp-train),
with its loss curves in one PNG". Five fine-tunes with the same seed, data and steps:

- ``sync``: ``--sync-optimizer`` (no stale weights);
- ``async``: the asynchronous optimizer (iteration t reads w_{t-2}: staleness 1) with
  ``roundpipe.staleness_compensation: "none"`` (RoundPipe's rule);
- ``predict``: the asynchronous optimizer with ``"predict"`` (the published weights
  extrapolated one Adam step ahead along the moments; rp_engine/optim/stepper.py);
- ``lookahead``: with ``"lookahead"`` (one step ahead along the moments the next step makes if
  the last gradient repeats);
- ``lookahead_dc``: with ``"lookahead_dc"`` (lookahead, and each gradient delay-compensated
  from the weights its iteration read to the masters it is applied at; what ``"auto"``
  resolves to: optim/delay_compensation.py).

How it runs, all offline (nothing is downloaded):

1. The saved model. ``rp-train --model tiny-qwen3`` trains the tiny Qwen3 preset from scratch
   on its embedded corpus (standard-library docstrings) and saves it in ``<run>/model``
   (``save_pretrained`` weights plus a Hugging Face fast tokenizer with its byte-level ids),
   which ``rp-train --model <folder>`` loads like any local model.
2. The text. Different from the pretraining corpus: the license texts in
   ``/usr/share/common-licenses`` (Debian's base-files; regular files only, symlinked aliases
   skipped, sorted by name), else the running Python's ``LICENSE.txt``, concatenated into one
   UTF-8 ``.txt`` file (its sources and sha256 go in the JSON summary).
3. The fine-tunes. ``rp-train --model <folder> --data <text> --lora 8,16 --lr 2e-4 --deepspeed
   <config>`` (plus ``--sync-optimizer`` for sync), where the config holds the rp-train
   defaults as "auto" values, ``roundpipe.staleness_compensation`` and a ``csv_monitor``
   section: the engine writes every optimizer step's training loss
   (``Train/Samples/train_loss``, keyed by samples) to CSV, which is what is plotted.

Output: one PNG (the three loss curves, raw and smoothed, final-20-step means in the legend;
and each async curve's smoothed relative gap to sync), and a JSON summary on stdout (and in
``--json``): final means, relative gaps vs sync, steps, seconds per run.

    python -m benchmarks.studies.lora_compensation                  # 300 steps each
    python -m benchmarks.studies.lora_compensation --steps 100 --json /tmp/lora.json
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "VARIANTS",
    "Variant",
    "check_tokenizer",
    "finetune_text",
    "ds_config",
    "final_mean",
    "main",
]

DEFAULT_PNG = Path("benchmarks/data/lora_compensation.png")
LICENSES = Path("/usr/share/common-licenses")
FINAL_WINDOW = 20  # steps averaged for the "final" loss (the curves are noisy step to step)
SMOOTH = 10  # moving-average window of the plotted smoothed curves
LOSS_CSV = "Train_Samples_train_loss.csv"  # rp_engine/monitor.py: tag "/" -> "_"


@dataclass(frozen=True)
class Variant:
    """One fine-tune: its name, whether the optimizer is synchronous, and the
    ``roundpipe.staleness_compensation`` value."""

    name: str
    sync: bool
    compensation: str
    label: str


VARIANTS = (
    Variant("sync", True, "none", "sync optimizer"),
    Variant("async", False, "none", "async, staleness 1, no compensation"),
    Variant("predict", False, "predict", 'async, staleness 1, "predict"'),
    Variant("lookahead", False, "lookahead", 'async, staleness 1, "lookahead"'),
    Variant("lookahead_dc", False, "lookahead_dc", 'async, staleness 1, "lookahead_dc"'),
)


# --- the saved model ------------------------------------------------------------------------------
def check_tokenizer(folder: Path) -> None:
    """The saved tokenizer, loaded as rp-train loads it, must give ByteTokenizer's ids."""
    from transformers import AutoTokenizer

    from rp_engine.train.presets import ByteTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    ref = ByteTokenizer()
    sample = "Copyright (C) 2007 — “Free” software; naïve  spaces\n\ttabs 😀"
    got = list(tok.encode(sample, add_special_tokens=False))
    ids = (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    if got != ref.encode(sample) or ids != (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id):
        raise RuntimeError(f"{folder}: the saved tokenizer does not match ByteTokenizer's ids")


# --- the text -------------------------------------------------------------------------------------
def finetune_text(dest: Path) -> dict[str, Any]:
    """Write the fine-tuning text to ``dest``; returns its sources, size and sha256.

    The license texts of /usr/share/common-licenses (every Debian system has them), regular
    files only (GPL -> GPL-3 and the like are symlinks: no text twice), sorted; where that
    folder is missing, the running Python's LICENSE.txt. Deterministic on a given system."""
    files = sorted(p for p in LICENSES.glob("*") if p.is_file() and not p.is_symlink())
    if not files:
        stdlib = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
        files = [stdlib] if stdlib.is_file() else []
    if not files:
        raise FileNotFoundError(f"no fine-tuning text: neither {LICENSES} nor Python's LICENSE.txt")
    text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
    data = text.encode("utf-8")
    dest.write_bytes(data)
    return {
        "path": str(dest),
        "sources": [str(p) for p in files],
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


# --- rp-train -------------------------------------------------------------------------------------
def ds_config(compensation: str, csv_root: Path) -> dict[str, Any]:
    """rp-train's default job config with "auto" values (filled by --lr, --micro-batch,
    --grad-accum, --warmup as Hugging Face does), the staleness compensation, and a CSV monitor
    that records every optimizer step's training loss."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 10**9,  # the CSV has the losses; keep the logs short
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
            },
        },
        "csv_monitor": {"enabled": True, "output_path": str(csv_root), "job_name": "csv"},
        "roundpipe": {"staleness_compensation": compensation},
    }


def rp_train(argv: Sequence[str], log_path: Path) -> tuple[dict[str, Any], float]:
    """Run ``rp-train <argv> --json`` in a child process (its own interpreter: each run starts
    from the same state); returns its JSON summary and wall seconds. Output goes to
    ``log_path``; a failure raises with the log's tail."""
    cmd = [sys.executable, "-m", "rp_engine.train.cli", *argv, "--json"]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    seconds = time.perf_counter() - t0
    lines = log_path.read_text(errors="replace").splitlines()
    if rc != 0:
        tail = "\n".join(lines[-40:])
        raise RuntimeError(f"rp-train {' '.join(argv)} exited with {rc}:\n{tail}")
    for line in reversed(lines):  # --json prints the summary as the last JSON line
        if line.startswith("{"):
            return json.loads(line), seconds
    raise RuntimeError(f"rp-train {' '.join(argv)}: no JSON summary in {log_path}")


def read_losses(csv_path: Path, batch_size: int) -> list[tuple[int, float]]:
    """(optimizer step, training loss) from the engine's CSV monitor (keyed by samples)."""
    with open(csv_path, newline="") as f:
        rows = list(csv.reader(f))[1:]  # header: step, tag
    return [(int(samples) // batch_size, float(loss)) for samples, loss in rows]


def final_mean(losses: Sequence[tuple[int, float]], window: int = FINAL_WINDOW) -> float:
    """Mean training loss over the last ``window`` steps."""
    tail = [v for _, v in losses[-window:]]
    return sum(tail) / len(tail) if tail else math.nan


# --- the figure -----------------------------------------------------------------------------------
def _smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (shorter at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot(
    path: Path, runs: dict[str, list[tuple[int, float]]], means: dict[str, float], title: str
) -> None:
    """Left: each variant's loss per step (thin) and its moving average (thick), final means in
    the legend. Right: the async variants' smoothed loss relative to sync's, in percent."""
    from matplotlib.figure import Figure

    colors = {
        "sync": "tab:blue",
        "async": "tab:red",
        "predict": "tab:green",
        "lookahead": "tab:purple",
        "lookahead_dc": "tab:orange",
    }
    fig = Figure(figsize=(12, 4.6))
    ax, gap = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    smoothed: dict[str, list[float]] = {}
    for v in VARIANTS:
        losses = runs[v.name]
        steps, values = [s for s, _ in losses], [x for _, x in losses]
        smoothed[v.name] = _smooth(values, SMOOTH)
        c = colors[v.name]
        ax.plot(steps, values, color=c, lw=0.6, alpha=0.3)
        label = f"{v.label}: final-{FINAL_WINDOW} mean {means[v.name]:.4f}"
        ax.plot(steps, smoothed[v.name], color=c, lw=1.8, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"training loss (thin: per step; thick: {SMOOTH}-step mean)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    base = smoothed["sync"]
    for v in VARIANTS[1:]:
        steps = [s for s, _ in runs[v.name]]
        rel = [100 * (x - b) / b for x, b in zip(smoothed[v.name], base, strict=False)]
        gap.plot(steps[: len(rel)], rel, color=colors[v.name], lw=1.5, label=v.label)
    gap.axhline(0, color=colors["sync"], lw=1, ls="--", label="sync")
    gap.set_xlabel("optimizer step")
    gap.set_ylabel(f"{SMOOTH}-step mean loss vs sync (%)")
    gap.set_title("relative gap to the synchronous optimizer", fontsize=10)
    gap.grid(alpha=0.3)
    gap.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --- the job --------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--steps", type=int, default=300, help="optimizer steps of each LoRA fine-tune (300)")
    a("--pretrain-steps", type=int, default=100, help="from-scratch steps of the saved model (100)")
    a("--lr", type=float, default=2e-4, help="LoRA learning rate (2e-4)")
    a("--lora", default="8,16", help="rp-train --lora (8,16: q_proj,v_proj)")
    a("--seed", type=int, default=0)
    a("--devices", help="rp-train --devices (default: rp-train's, i.e. all GPUs, else cpu:2)")
    a("--out-png", type=Path, default=DEFAULT_PNG, help=f"the figure ({DEFAULT_PNG})")
    a("--json", type=Path, help="also write the JSON summary here")
    a("--workdir", type=Path, help="keep the run folders here (default: a temporary folder)")
    return p


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Pretrain + save, write the text, fine-tune the variants; returns the summary."""
    common = ["--seed", str(args.seed), "--no-wandb"]
    if args.devices:
        common += ["--devices", args.devices]
    t0 = time.perf_counter()
    pre_argv = ["--model", "tiny-qwen3", "--steps", str(args.pretrain_steps), "--out"]
    pre, pre_s = rp_train([*pre_argv, str(work / "pretrain"), *common], work / "pretrain.log")
    folder = work / "pretrain" / "model"  # rp-train's save_pretrained export of the run
    check_tokenizer(folder)
    print(
        f"saved model: {folder} (tiny-qwen3, {args.pretrain_steps} steps from scratch, loss "
        f"{pre['first_loss']:.3f} -> {pre['final_loss']:.3f}, {pre_s:.0f} s)",
        file=sys.stderr,
    )
    text = finetune_text(work / "finetune.txt")

    runs: dict[str, list[tuple[int, float]]] = {}
    results: dict[str, dict[str, Any]] = {}
    for v in VARIANTS:
        run_dir = work / f"lora-{v.name}"
        run_dir.mkdir()
        cfg = run_dir.parent / f"ds_config_{v.name}.json"
        cfg.write_text(json.dumps(ds_config(v.compensation, run_dir), indent=2) + "\n")
        argv = [
            "--model", str(folder), "--data", text["path"], "--lora", args.lora,
            "--lr", str(args.lr), "--steps", str(args.steps), "--deepspeed", str(cfg),
            "--out", str(run_dir), "--no-save", *common,
        ]  # fmt: skip
        if v.sync:
            argv.append("--sync-optimizer")
        summary, seconds = rp_train(argv, work / f"lora-{v.name}.log")
        resolved = json.loads((run_dir / "ds_config.json").read_text())
        batch = resolved["train_micro_batch_size_per_gpu"] * resolved["gradient_accumulation_steps"]
        losses = read_losses(run_dir / "csv" / LOSS_CSV, batch)
        if len(losses) != args.steps:
            raise RuntimeError(f"{v.name}: {len(losses)} losses recorded for {args.steps} steps")
        runs[v.name] = losses
        results[v.name] = {
            "async_optimizer": not v.sync,
            "staleness_compensation": v.compensation,
            "first_loss": losses[0][1],
            f"final_{FINAL_WINDOW}_mean": final_mean(losses),
            "final_eval_loss": summary["final_eval_loss"],
            "seconds": round(seconds, 1),
            "tokens_per_s": summary["tokens_per_s"],
        }
        print(
            f"{v.name}: final-{FINAL_WINDOW} mean {final_mean(losses):.4f}, {seconds:.0f} s",
            file=sys.stderr,
        )

    means = {k: r[f"final_{FINAL_WINDOW}_mean"] for k, r in results.items()}
    gaps = {v.name: (means[v.name] - means["sync"]) / means["sync"] for v in VARIANTS[1:]}
    vs = ", ".join(f"{k} {100 * g:+.2f} %" for k, g in gaps.items())
    title = (
        f"LoRA {args.lora} fine-tune of a saved tiny-qwen3 on license texts, lr {args.lr:g}, "
        f"{args.steps} steps (rp-train)\nvs sync: {vs} (final-{FINAL_WINDOW} means)"
    )
    args.out_png.parent.mkdir(parents=True, exist_ok=True)
    plot(args.out_png, runs, means, title)
    return {
        "steps": args.steps,
        "lr": args.lr,
        "lora": args.lora,
        "seed": args.seed,
        "final_window": FINAL_WINDOW,
        "pretrain": {
            "model": "tiny-qwen3",
            "steps": args.pretrain_steps,
            "first_loss": pre["first_loss"],
            "final_loss": pre["final_loss"],
            "seconds": round(pre_s, 1),
        },
        "data": {k: text[k] for k in ("sources", "bytes", "sha256")},
        "micro_batch_x_accum": batch,
        "devices": summary["devices"],
        "runs": results,
        "final_means": means,
        "relative_gap_vs_sync": gaps,
        "png": str(args.out_png),
        "total_seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # 2 cores: no tokenizer threads
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        summary = run(args, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="lora_compensation-") as tmp:
            summary = run(args, Path(tmp))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
