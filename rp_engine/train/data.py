"""Training data for ``rp-train --data``: read, tokenize, mask prompts, pack, split, iterate.

Accepted inputs:

- ``.jsonl``: one JSON object per line with either ``"text"`` (every token is trained on) or
  ``"prompt"`` + ``"completion"`` (only the completion and the end-of-sequence token are: the
  prompt's labels are -100, so it is context but not a target);
- any other file: plain UTF-8 text, one document;
- a folder: every ``*.jsonl``, ``*.txt``, ``*.md`` file below it, in sorted order.

Documents are tokenized with the model's tokenizer, each followed by EOS, concatenated and cut
into ``seq_len`` windows (the last one padded with label -100). A fixed share of the windows is
held out for evaluation. Training order is a per-epoch permutation fixed by the seed, so the
data position is one integer (micro-batches consumed) and a resumed run continues exactly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DataError",
    "Example",
    "Packed",
    "read_examples",
    "pack",
    "split",
    "MicroBatches",
]

IGNORE_INDEX = -100
_TEXT_SUFFIXES = (".jsonl", ".txt", ".md")


class DataError(ValueError):
    """Bad --data input; the message names the file (and line) and what to fix."""


@dataclass(frozen=True)
class Example:
    """One document: ``prompt`` is context only (masked out of the loss), ``completion`` is
    trained on. Plain text has an empty prompt."""

    prompt: str
    completion: str


def read_examples(path: str | Path) -> list[Example]:
    """Examples of a jsonl file, a text file or a folder of them (see module docstring)."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"--data {path}: no such file or folder")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in _TEXT_SUFFIXES)
        if not files:
            raise DataError(f"--data {path}: the folder has no {'/'.join(_TEXT_SUFFIXES)} files")
        return [e for f in files for e in read_examples(f)]
    if p.suffix == ".jsonl":
        return _read_jsonl(p)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"--data {p}: not UTF-8 text ({e})") from e
    return [Example("", text)] if text.strip() else []


def _read_jsonl(path: Path) -> list[Example]:
    examples = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}): {line[:80]!r}") from e
            examples.append(_example(obj, path, lineno))
    if not examples:
        raise DataError(f"--data {path}: no examples (the file is empty)")
    return examples


def _example(obj: Any, path: Path, lineno: int) -> Example:
    where = f"{path}:{lineno}"
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise DataError(f"{where}: 'text' must be a string")
        return Example("", obj["text"])
    if "prompt" in obj and "completion" in obj:
        if not isinstance(obj["prompt"], str) or not isinstance(obj["completion"], str):
            raise DataError(f"{where}: 'prompt' and 'completion' must be strings")
        return Example(obj["prompt"], obj["completion"])
    raise DataError(
        f"{where}: expected a 'text' field or 'prompt' + 'completion' fields, got keys "
        f"{sorted(obj)}"
    )


@dataclass(frozen=True)
class Packed:
    """``seq_len`` windows: input ids and labels (-100 where there is nothing to learn)."""

    input_ids: torch.Tensor  # (num_windows, seq_len) int64
    labels: torch.Tensor  # same shape

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def _encode(tokenizer: Any, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer.encode(text, add_special_tokens=False))


def pack(examples: Sequence[Example], tokenizer: Any, seq_len: int) -> Packed:
    """Tokenize (prompt masked), append EOS to each document, concatenate, cut into windows."""
    if seq_len < 2:
        raise DataError(f"--seq-len {seq_len}: must be at least 2")
    eos = tokenizer.eos_token_id
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = eos if pad is None else pad
    ids: list[int] = []
    labels: list[int] = []
    for ex in examples:
        prompt, completion = _encode(tokenizer, ex.prompt), _encode(tokenizer, ex.completion)
        tail = [eos] if eos is not None else []
        ids += prompt + completion + tail
        labels += [IGNORE_INDEX] * len(prompt) + completion + tail
    if not ids:
        raise DataError("--data: no tokens after tokenization (all documents are empty)")
    windows = math.ceil(len(ids) / seq_len)
    fill = windows * seq_len - len(ids)
    ids += [pad] * fill
    labels += [IGNORE_INDEX] * fill
    shape = (windows, seq_len)
    return Packed(torch.tensor(ids).view(shape), torch.tensor(labels).view(shape))


def split(packed: Packed, eval_fraction: float, *, seed: int = 0) -> tuple[Packed, Packed]:
    """(train, eval): a seeded random ``eval_fraction`` of the windows (at least one when the
    fraction is > 0 and there are two or more windows) is held out."""
    n = len(packed)
    n_eval = 0 if eval_fraction <= 0 or n < 2 else max(1, round(n * eval_fraction))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 7919))
    ev, tr = order[:n_eval].sort().values, order[n_eval:].sort().values
    return (
        Packed(packed.input_ids[tr], packed.labels[tr]),
        Packed(packed.input_ids[ev], packed.labels[ev]),
    )


class MicroBatches:
    """Micro-batches of a Packed set in a seeded per-epoch order; ``position`` (micro-batches
    handed out so far) is the whole iteration state, so ``MicroBatches(..., position=k)``
    continues where a run that had consumed k micro-batches stopped."""

    def __init__(
        self, data: Packed, micro_batch: int, *, seed: int = 0, position: int = 0,
        shuffle: bool = True,
    ) -> None:  # fmt: skip
        if len(data) < micro_batch:
            raise DataError(
                f"--data gives {len(data)} training sequence(s) of the sequence length, fewer "
                f"than one micro-batch ({micro_batch}): add data, lower --seq-len or the "
                "config's train_micro_batch_size_per_gpu"
            )
        self.data = data
        self.micro_batch = micro_batch
        self.seed = seed
        self.shuffle = shuffle
        self.position = position
        self.per_epoch = len(data) // micro_batch  # an incomplete last micro-batch is dropped
        self._order: tuple[int, torch.Tensor] | None = None

    @property
    def epoch(self) -> float:
        return self.position / self.per_epoch

    def _perm(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            n = len(self.data)
            perm = (
                torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))
                if self.shuffle
                else torch.arange(n)
            )
            self._order = (epoch, perm)
        return self._order[1]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        epoch, k = divmod(self.position, self.per_epoch)
        rows = self._perm(epoch)[k * self.micro_batch : (k + 1) * self.micro_batch]
        self.position += 1
        return {"input_ids": self.data.input_ids[rows], "labels": self.data.labels[rows]}


def eval_batches(data: Packed, micro_batch: int) -> list[dict[str, torch.Tensor]]:
    """The held-out set in order, as micro-batches (the last one may be smaller)."""
    return [
        {
            "input_ids": data.input_ids[s : s + micro_batch],
            "labels": data.labels[s : s + micro_batch],
        }
        for s in range(0, len(data), micro_batch)
    ]
