"""The embedded default job of ``rp-train`` (no arguments): a small Qwen3 built from a config, on
byte-level tokens of the standard library's own documentation, with its DeepSpeed config. Needs
nothing from the network. Apart from train/cli.py (the run) because the benchmarks and tests
train on the same corpus and model without a command line; cli.py re-exports these names.
"""

from __future__ import annotations

import importlib
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from rp_engine.train.presets import BYTE_VOCAB

__all__ = ["VOCAB", "batches", "build_tiny_model", "default_config", "stdlib_corpus"]

# Modules whose docstrings make the default corpus: plain English prose present on every Python.
_CORPUS_MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "email", "enum", "fractions", "functools", "heapq", "http.client",
    "inspect", "io", "itertools", "json", "logging", "os", "pathlib", "pickle", "random", "re",
    "shutil", "socket", "statistics", "string", "subprocess", "tarfile", "textwrap", "threading",
    "typing", "unittest", "urllib.parse", "uuid", "zipfile",
)  # fmt: skip

VOCAB = BYTE_VOCAB  # 256 bytes + BOS/EOS/PAD + 1 spare


def default_config(
    devices: str | None, *, micro_batch: int = 4, grad_accum: int = 4, lr: float = 2e-3,
    warmup: int = 5,
) -> dict[str, Any]:  # fmt: skip
    """The embedded DeepSpeed config of the default job (fp32, AdamW, warmup, clipping; the
    async optimizer's staleness compensated: a from-scratch rate, where it matters most)."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": 1.0,
        "steps_per_print": 10,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": lr, "warmup_num_steps": warmup},
        },
        "roundpipe": {
            "staleness_compensation": "auto",
            **({"devices": devices} if devices else {}),
        },
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
                member = getattr(mod, attr, None)
                doc = getattr(member, "__doc__", None)
            # Submodules show up as attributes only once something imported them: skipping them
            # keeps the corpus (and a resumed run's data position) the same in every process.
            if isinstance(member, types.ModuleType):
                continue
            if attr.startswith("_") or not isinstance(doc, str) or len(doc) < 80:
                continue
            parts.append(doc)
    return "\n\n".join(dict.fromkeys(parts)).encode("utf-8")  # dedupe, keep order


def build_tiny_model(*, seed: int = 0, layers: int = 4, hidden: int = 128) -> torch.nn.Module:
    """A small Qwen3 causal LM from a config (no download), byte-level vocabulary."""
    from rp_engine.train.presets import load_model

    return load_model("tiny-qwen3", layers=layers, hidden=hidden, seed=seed).model


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
