"""The tasks of the staleness-compensation suite (studies/compensation_suite.py, issue 43).

A task is everything one training run needs apart from the compensation method: a model
builder, a stream of micro-batches, the loss, and the optimizer's regime (learning rate,
warm-up, clipping, accumulation, steps). Each builder is deterministic for a seed, so every
method of a task trains the same model on the same batches and the runs differ only in what the
staleness-1 rule and the compensation make of the gradients.

The tasks vary along the axes the issue names:

- data: synthetic sequences (a fixed random first-order Markov chain over 64 tokens), real text
  (the standard library's docstrings, rp-train's default corpus, and the standard library's
  own Python source for the fine-tunes), a regression and a classification task on a plain
  ``nn.Module`` MLP;
- model size and depth: 2 to 6 transformer layers of hidden 32 to 128 (Qwen2 and Qwen3), MLPs
  of 3 and 6 layers;
- clipping that binds on most steps and clipping that never binds (or none);
- warm-up and none;
- learning rates from a fine-tune's (2e-4) through 5e-4 / 1e-3 to from-scratch rates (2e-3,
  5e-3);
- LoRA (peft) and full fine-tuning of a model pre-trained here (sync, a few seconds, cached).

Two tasks ("seq-qwen2-*") are issue 43's own: a small Qwen2 on synthetic sequences, AdamW
without weight decay, no warm-up, no clipping, GAS 2, 120 steps, lr 5e-3 and 2e-3, the mean
loss over steps 11-120.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rp_engine.train.cli import batches, build_tiny_model, stdlib_corpus

__all__ = ["TASKS", "Task", "lm_loss", "source_corpus"]

Batch = Any


@dataclass(frozen=True)
class Task:
    """One training regime. ``model(seed)``: the model in fp32, train mode (LoRA: only the
    adapters require grad); ``data(seed)``: endless micro-batches; ``loss(model, batch)``: the
    scalar training loss. ``warmup``: steps of linear warm-up (0: none); ``clip``: the global
    gradient-norm clip (0: none); ``burn_in``: leading steps left out of the mean loss;
    ``seeds``: how many seeds the suite averages by default (more where one seed's mean loss
    swings with when the run leaves its first plateau)."""

    name: str
    what: str
    model: Callable[[int], nn.Module]
    data: Callable[[int], Iterator[Batch]]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    lr: float
    steps: int
    gas: int
    clip: float = 0.0
    warmup: int = 0
    burn_in: int = 10
    seeds: int = 3


def lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """A causal LM's own next-token loss."""
    return model(**batch).loss


# --- synthetic sequences ------------------------------------------------------------------------
SEQ_VOCAB = 64


def _markov_table(seed: int = 1234) -> torch.Tensor:
    """A fixed first-order Markov chain over ``SEQ_VOCAB`` tokens: each token has 4 likely
    successors (logits 0-4 on them, -inf elsewhere), so the sequences are learnable well below
    log(vocab) and never deterministic. The same for every seed of a run: the task is fixed,
    the seed draws the model and the sequences."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.full((SEQ_VOCAB, SEQ_VOCAB), -torch.inf)
    for a in range(SEQ_VOCAB):
        picks = torch.randperm(SEQ_VOCAB, generator=gen)[:4]
        logits[a, picks] = 4.0 * torch.rand(4, generator=gen)
    return torch.softmax(logits, dim=-1)


def markov_sequences(*, seq_len: int, micro_batch: int, seed: int) -> Iterator[Batch]:
    """Endless micro-batches of the Markov chain's sequences (first token uniform)."""
    table = _markov_table()
    gen = torch.Generator().manual_seed(seed + 100)
    while True:
        ids = torch.empty(micro_batch, seq_len, dtype=torch.long)
        ids[:, 0] = torch.randint(0, SEQ_VOCAB, (micro_batch,), generator=gen)
        for i in range(1, seq_len):
            ids[:, i] = torch.multinomial(table[ids[:, i - 1]], 1, generator=gen).squeeze(1)
        yield {"input_ids": ids, "labels": ids.clone()}


def tiny_qwen2(seed: int, *, layers: int, hidden: int) -> nn.Module:
    """A small Qwen2 causal LM (q/k/v biases) over ``SEQ_VOCAB`` tokens, eager attention."""
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=SEQ_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=False, use_cache=False,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    return model.train()


# --- real text ----------------------------------------------------------------------------------
_SOURCE_MODULES = (
    "argparse", "textwrap", "heapq", "bisect", "fractions", "shlex", "string", "calendar",
    "difflib", "fnmatch", "glob", "pprint", "queue", "sched", "statistics", "tokenize",
)  # fmt: skip


@functools.cache
def source_corpus() -> bytes:
    """UTF-8 Python source of some pure-Python standard-library modules: text of another kind
    than the docstrings the base model is pre-trained on (the fine-tunes' data)."""
    parts = [inspect.getsource(importlib.import_module(name)) for name in _SOURCE_MODULES]
    return "\n\n".join(parts).encode("utf-8")


@functools.cache
def _docs() -> bytes:
    return stdlib_corpus()


def _text(corpus: Callable[[], bytes], seq_len: int, micro_batch: int) -> Callable[[int], Any]:
    return lambda seed: batches(corpus(), seq_len=seq_len, micro_batch=micro_batch, seed=seed)


PRETRAIN_STEPS = 150


@functools.cache
def _pretrained_state(seed: int) -> dict[str, torch.Tensor]:
    """A tiny Qwen3 (2 layers, hidden 64) trained synchronously on the docstrings for
    ``PRETRAIN_STEPS`` steps at 2e-3 (AdamW, clip 1.0, GAS 4 x 4 x 32 tokens): the base the
    fine-tunes start from. Cached per seed: every method fine-tunes the same base."""
    model = build_tiny_model(seed=seed, layers=2, hidden=64).float()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    data = batches(_docs(), seq_len=32, micro_batch=4, seed=seed + 7)
    for _ in range(PRETRAIN_STEPS):
        opt.zero_grad()
        for _ in range(4):
            (model(**next(data)).loss / 4).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def pretrained(seed: int) -> nn.Module:
    """The pre-trained base (``_pretrained_state``), fully trainable."""
    model = build_tiny_model(seed=seed, layers=2, hidden=64).float()
    model.load_state_dict(_pretrained_state(seed))
    return model.train()


def pretrained_lora(seed: int) -> nn.Module:
    """The pre-trained base with a peft LoRA adapter (r 8, alpha 16) on q/k/v/o and the MLP:
    only the adapters train."""
    from peft import LoraConfig, get_peft_model

    base = pretrained(seed)
    torch.manual_seed(seed + 1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0)
    return get_peft_model(base, cfg).train()


# --- plain nn.Module tasks ----------------------------------------------------------------------
def mlp(seed: int, *, dims: list[int]) -> nn.Module:
    """A plain MLP (Linear + GELU, no norm layers) with the layer widths ``dims``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims, dims[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if i < len(dims) - 2:
            layers.append(nn.GELU())
    return nn.Sequential(*layers).train()


def _teacher(inputs: int, outputs: int) -> nn.Module:
    """A fixed random teacher network (the same for every seed: the task is fixed)."""
    return mlp(4321, dims=[inputs, 64, 64, outputs]).eval()


def regression_data(seed: int, *, micro_batch: int = 32) -> Iterator[Batch]:
    """Gaussian inputs (16 features), targets a fixed teacher's 4 outputs plus noise 0.1."""
    teacher = _teacher(16, 4)
    gen = torch.Generator().manual_seed(seed + 200)
    while True:
        x = torch.randn(micro_batch, 16, generator=gen)
        with torch.no_grad():
            y = teacher(x) + 0.1 * torch.randn(micro_batch, 4, generator=gen)
        yield x, y


def classification_data(seed: int, *, micro_batch: int = 32) -> Iterator[Batch]:
    """Gaussian inputs (32 features), labels the argmax of a fixed teacher's 10 logits taken
    at a temperature (noisy labels: the Bayes loss is well above 0)."""
    teacher = _teacher(32, 10)
    gen = torch.Generator().manual_seed(seed + 300)
    while True:
        x = torch.randn(micro_batch, 32, generator=gen)
        with torch.no_grad():
            probs = torch.softmax(4.0 * teacher(x), dim=-1)
        yield x, torch.multinomial(probs, 1, generator=gen).squeeze(1)


def mse(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def cross_entropy(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _seq(seq_len: int, micro_batch: int) -> Callable[[int], Iterator[Batch]]:
    return lambda seed: markov_sequences(seq_len=seq_len, micro_batch=micro_batch, seed=seed)


def _qwen2(layers: int, hidden: int) -> Callable[[int], nn.Module]:
    return lambda seed: tiny_qwen2(seed, layers=layers, hidden=hidden)


def _qwen3(layers: int, hidden: int) -> Callable[[int], nn.Module]:
    return lambda seed: build_tiny_model(seed=seed, layers=layers, hidden=hidden).float().train()


def _mlp(dims: list[int]) -> Callable[[int], nn.Module]:
    return lambda seed: mlp(seed, dims=dims)


_ISSUE = "synthetic sequences, Qwen2 4x64, no clip, no warm-up, GAS 2, 120 steps"
_CLIPPED = "the same, clip 0.3 (binds on every step)"
_DEEP = "synthetic sequences, Qwen2 6x32, warm-up 20, GAS 4"
_WIDE = "stdlib docs, Qwen3 4x128, warm-up 20, GAS 2, 100 steps"
_LORA = "LoRA r8 of a pre-trained Qwen3 2x64 on stdlib source, GAS 4"
# fmt: off
TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        # issue 43's task, at its two rates: no clipping, no warm-up; then with clipping that
        # binds on every step
        # at 5e-3 one seed's async gap ranges over +27 to +89 %: six seeds
        Task("seq-qwen2-5e-3", _ISSUE, _qwen2(4, 64), _seq(32, 8), lm_loss, 5e-3, 120, 2,
             seeds=6),
        Task("seq-qwen2-2e-3", _ISSUE, _qwen2(4, 64), _seq(32, 8), lm_loss, 2e-3, 120, 2),
        Task("seq-qwen2-5e-3-clip", _CLIPPED, _qwen2(4, 64), _seq(32, 8), lm_loss, 5e-3, 120, 2,
             clip=0.3, seeds=6),
        Task("seq-qwen2-2e-3-clip", _CLIPPED, _qwen2(4, 64), _seq(32, 8), lm_loss, 2e-3, 120, 2,
             clip=0.3),
        # deeper and narrower, warm-up, a clip that never binds and one that binds
        Task("seq-qwen2-deep-1e-3", _DEEP + ", clip 30 (never binds)", _qwen2(6, 32),
             _seq(32, 4), lm_loss, 1e-3, 120, 4, clip=30.0, warmup=20),
        Task("seq-qwen2-deep-1e-3-clip", _DEEP + ", clip 0.5 (binds)", _qwen2(6, 32),
             _seq(32, 4), lm_loss, 1e-3, 120, 4, clip=0.5, warmup=20),
        # the convergence benchmark's regime (rp-train's corpus, clip 1.0) at a from-scratch rate
        Task("text-qwen3-2e-3", "stdlib docs, Qwen3 2x64, clip 1.0 (binds on most steps), "
             "GAS 4, 150 steps", _qwen3(2, 64), _text(_docs, 32, 4), lm_loss, 2e-3, 150, 4,
             clip=1.0),
        # wider and deeper, warm-up, a middle rate: no clipping, and clipping that binds
        Task("text-qwen3-wide-5e-4", _WIDE + ", no clip", _qwen3(4, 128), _text(_docs, 32, 4),
             lm_loss, 5e-4, 100, 2, warmup=20),
        Task("text-qwen3-wide-5e-4-clip", _WIDE + ", clip 1.0 (binds on most steps)",
             _qwen3(4, 128), _text(_docs, 32, 4), lm_loss, 5e-4, 100, 2, clip=1.0, warmup=20),
        # fine-tunes of a pre-trained base on another text, at a fine-tune's rate
        Task("ft-lora-2e-4", _LORA + ", clip 1.0 (never binds)", pretrained_lora,
             _text(source_corpus, 64, 4), lm_loss, 2e-4, 100, 4, clip=1.0),
        Task("ft-lora-2e-4-clip", _LORA + ", clip 0.1 (binds on every step)", pretrained_lora,
             _text(source_corpus, 64, 4), lm_loss, 2e-4, 100, 4, clip=0.1),
        Task("ft-full-2e-4", "full fine-tune of the same base on stdlib source, warm-up 10, "
             "no clip, GAS 4", pretrained, _text(source_corpus, 64, 4), lm_loss, 2e-4, 100, 4,
             warmup=10),
        # plain nn.Module tasks
        Task("mlp-regression-1e-3", "teacher regression, MLP 16-128x3-4, no clip, GAS 2",
             _mlp([16, 128, 128, 128, 4]), regression_data, mse, 1e-3, 200, 2),
        Task("mlp-classify-5e-3", "noisy-teacher classification, MLP 32-64x6-10, clip 0.05 "
             "(binds on most steps), warm-up 20, GAS 2", _mlp([32] + [64] * 6 + [10]),
             classification_data, cross_entropy, 5e-3, 200, 2, clip=0.05, warmup=20),
    )
}
# fmt: on
