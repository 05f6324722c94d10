"""``rp-train``'s command line: the arguments, their defaults and help. Apart from train/cli.py
(the run) so that a reader looking for a flag does not walk through the run; cli.py re-exports
``_parser``.
"""

from __future__ import annotations

import argparse
from typing import Any

from rp_engine.plan.schedules import ENGINE_SCHEDULES

__all__ = ["DESCRIPTION"]

# the first line of train/cli.py's docstring: what ``rp-train --help`` opens with
DESCRIPTION = (
    "``rp-train``: the main job. Fine-tunes a causal LM with rp_engine from a DeepSpeed config."
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rp-train", description=DESCRIPTION)
    a = p.add_argument
    a(
        "--model",
        default="tiny-qwen3",
        help="preset (tiny-qwen3, tiny-llama, qwen3-0.6b, qwen3-1.7b, llama-3.1-8b), a local "
        "save_pretrained folder, or a Hugging Face hub id (downloaded only then)",
    )
    a(
        "--data",
        help="jsonl (text or prompt/completion), text file, or folder; default: the "
        "embedded standard-library corpus",
    )
    a(
        "--config",
        "--ds-config",
        "--deepspeed",
        dest="config",
        help='DeepSpeed config (json/hjson); "auto" values are filled as Hugging Face does',
    )
    a(
        "--lora",
        metavar="R,ALPHA[,TARGETS]",
        help="train a peft LoRA adapter, e.g. 8,16 or "
        "8,16,q_proj,k_proj,v_proj,o_proj (default targets q_proj,v_proj)",
    )
    a("--devices", help='"cpu:N", "cuda", "cuda:0,1" (default: all GPUs, else cpu:2)')
    a(
        "--steps",
        type=int,
        help="optimizer steps (default: 30 on the embedded corpus, else one epoch)",
    )
    a("--epochs", type=float, help="epochs over the training split (instead of --steps)")
    a("--seq-len", type=int, default=128, action=_Given, help="tokens per sequence (128)")
    a(
        "--micro-batch",
        type=int,
        default=4,
        action=_Given,
        help='micro-batch size (a --deepspeed config: fills "auto")',
    )
    a(
        "--grad-accum",
        type=int,
        default=4,
        action=_Given,
        help='gradient accumulation steps (a --deepspeed config: fills "auto")',
    )
    a(
        "--lr",
        type=float,
        help='fills "auto" (default 2e-3 from scratch, 2e-4 LoRA, 2e-5 full fine-tune)',
    )
    a("--warmup", type=int, default=5, help='warmup steps for "auto"')
    a(
        "--eval-every",
        type=int,
        default=0,
        help="evaluate on the held-out split every N steps "
        "(and at the start and the end); 0: only at the end",
    )
    a("--eval-split", type=float, default=0.05, help="share of sequences held out (0.05)")
    a("--eval-batches", type=int, default=4, help="micro-batches per evaluation (4)")
    a("--save-every", type=int, default=0, help="checkpoint every N steps (and at the end)")
    a("--no-save", action="store_true", help="write no checkpoint at the end")
    a(
        "--resume",
        nargs="?",
        const="latest",
        metavar="PATH|latest",
        help="continue from a checkpoint folder (or run folder); 'latest': --out's, else the "
        "newest run of this model",
    )
    a("--out", help="run folder (default ./rp-runs/<time>-<model>)")
    a("--no-wandb", action="store_true", help="no W&B run (default: on, offline without a key)")
    a("--tensorboard", action="store_true", help="TensorBoard events in <run folder>/tensorboard")
    a("--no-preflight", action="store_true", help="skip the host-memory check")
    a(
        "--plan",
        action="store_true",
        help="advise: the fastest micro-batch, accumulation, round size, cuts and optimizer "
        "tier on --machine (simulated; --seq-len/--micro-batch/--grad-accum kept when given, "
        "else searched at 2048 tokens), write the best as <run folder>/ds_config.json and "
        "exit without training",
    )
    a("--machine", default="rtx4090_pcie4_8x", help="machine preset for --plan")
    a("--plan-devices", type=int, help="devices for --plan (default: the machine's)")
    a("--layers", type=int, default=4, help="tiny presets only")
    a("--hidden", type=int, default=128, help="tiny presets only")
    a("--schedule", choices=ENGINE_SCHEDULES)
    a("--sync-optimizer", action="store_true", help="disable the async optimizer")
    a("--save-dir", help="checkpoint folder (default: <run folder>/checkpoints)")
    a("--seed", type=int, default=0)
    a("--json", action="store_true", help="print the summary as JSON at the end")
    a("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    return p  # fmt: skip


class _Given(argparse.Action):
    """Stores the value and records that the user gave it (``args.given``): ``--plan`` keeps
    what was given and searches the rest."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
        option_string: str | None = None,
    ) -> None:  # fmt: skip
        setattr(namespace, self.dest, values)
        given = set(getattr(namespace, "given", set()))
        given.add(self.dest)
        namespace.given = given
