"""``rp-train``: the main job. Fine-tunes a causal LM with rp_engine from a DeepSpeed config.

With no arguments it trains its embedded default, which needs nothing from the network: a small
Qwen3 built from a config, on byte-level tokens of text that ships with every Python (the
standard library's own documentation), on CPU virtual devices when no GPU is visible.

    rp-train                                   # embedded default, 30 steps
    rp-train --config ds_config.json --devices cpu:4 --steps 100 --save-dir runs/ckpt
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["main", "default_config", "stdlib_corpus", "build_tiny_model", "batches"]

log = logging.getLogger("rp_engine.cli")

# Modules whose docstrings make the default corpus: plain English prose present on every Python.
_CORPUS_MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "email", "enum", "fractions", "functools", "heapq", "http.client",
    "inspect", "io", "itertools", "json", "logging", "os", "pathlib", "pickle", "random", "re",
    "shutil", "socket", "statistics", "string", "subprocess", "tarfile", "textwrap", "threading",
    "typing", "unittest", "urllib.parse", "uuid", "zipfile",
)  # fmt: skip

VOCAB = 260  # 256 bytes + BOS/EOS/PAD + 1 spare


def default_config(devices: str | None) -> dict[str, Any]:
    """The embedded DeepSpeed config of the default job (fp32, AdamW, warmup, clipping)."""
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0,
        "steps_per_print": 10,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-3, "warmup_num_steps": 5},
        },
        "roundpipe": {"devices": devices} if devices else {},
    }


def stdlib_corpus() -> bytes:
    """UTF-8 text of the docstrings of common standard-library modules and their members."""
    parts: list[str] = []
    for name in _CORPUS_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # pragma: no cover - stdlib, always there
            continue
        if mod.__doc__:
            parts.append(mod.__doc__)
        for attr in sorted(vars(mod)):
            with warnings.catch_warnings():  # deprecated aliases (typing.io) warn on access
                warnings.simplefilter("ignore")
                doc = getattr(getattr(mod, attr, None), "__doc__", None)
            if attr.startswith("_") or not isinstance(doc, str) or len(doc) < 80:
                continue
            parts.append(doc)
    return "\n\n".join(dict.fromkeys(parts)).encode("utf-8")  # dedupe, keep order


def build_tiny_model(*, seed: int = 0, layers: int = 4, hidden: int = 128) -> torch.nn.Module:
    """A small Qwen3 causal LM from a config (no download), byte-level vocabulary."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    return Qwen3ForCausalLM(config)


def batches(
    data: bytes, *, seq_len: int, micro_batch: int, seed: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless random windows of the corpus as {"input_ids", "labels"} micro-batches."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(tokens) - seq_len - 1, (micro_batch,), generator=gen)
        ids = torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])
        yield {"input_ids": ids, "labels": ids.clone()}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rp-train", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="DeepSpeed config (json/hjson path); default: embedded")
    p.add_argument("--devices", help='"cpu:N", "cuda", "cuda:0,1" (default: all GPUs, else cpu:2)')
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--schedule", choices=("roundpipe", "mobius"))
    p.add_argument("--sync-optimizer", action="store_true", help="disable the async optimizer")
    p.add_argument("--save-dir", help="write a DeepSpeed-layout checkpoint here at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    return p


def _overrides(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    rp = dict(cfg.get("roundpipe", {}))
    if args.devices:
        rp["devices"] = args.devices
    if args.schedule:
        rp["schedule"] = args.schedule
    if args.sync_optimizer:
        rp["async_optimizer"] = False
    return {**cfg, "roundpipe": rp}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import rp_engine
    from rp_engine.config import hf_auto_values, load_config

    # "auto" values as Hugging Face fills them, for configs written for the HF Trainer.
    auto = hf_auto_values(
        hidden_size=args.hidden, micro_batch_size=4, gradient_accumulation_steps=4, lr=2e-3,
        warmup_steps=5, total_steps=args.steps,
    )  # fmt: skip
    if args.config:
        raw = load_config(args.config, auto_values=auto).to_dict()
    else:
        raw = default_config(args.devices)
    model = build_tiny_model(seed=args.seed, layers=args.layers, hidden=args.hidden)
    engine, _, _, _ = rp_engine.initialize(model=model, config=_overrides(raw, args))
    mbs = engine.train_micro_batch_size_per_gpu()
    data = batches(stdlib_corpus(), seq_len=args.seq_len, micro_batch=mbs, seed=args.seed)
    from tqdm import tqdm

    losses: list[float] = []
    tokens_per_step = engine.train_batch_size() * args.seq_len
    start = time.perf_counter()
    bar = tqdm(range(args.steps), desc="rp-train", unit="step", file=sys.stderr)
    for _ in bar:
        loss = float(engine.train_batch(data))
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{engine.get_lr()[0]:.2e}")
    elapsed = time.perf_counter() - start
    if args.save_dir:
        engine.save_checkpoint(args.save_dir)
    summary = {
        "steps": args.steps,
        "first_loss": losses[0] if losses else math.nan,
        "final_loss": losses[-1] if losses else math.nan,
        "tokens_per_s": tokens_per_step * args.steps / elapsed if elapsed > 0 else math.nan,
        "devices": len(engine.pool),
        "fwd_cuts": list(engine.planner.fwd_cuts),
        "bwd_cuts": list(engine.planner.bwd_cuts),
    }
    engine.destroy()
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"trained {args.steps} steps on {summary['devices']} device(s): loss "
            f"{summary['first_loss']:.3f} -> {summary['final_loss']:.3f}, "
            f"{summary['tokens_per_s']:.0f} tokens/s"
        )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
