"""Models for ``rp-train --model``: built-in presets or a Hugging Face path / hub id.

Presets are built from a config with random weights (nothing is downloaded): ``tiny-qwen3`` (the
embedded default) and ``tiny-llama`` for quick runs, and the real shapes ``qwen3-0.6b``,
``qwen3-1.7b`` and ``llama-3.1-8b`` (their public ``config.json`` values) for benchmarking. Presets
use the byte-level tokenizer below. A local ``save_pretrained`` folder with safetensors weights
is loaded layer by layer by model/folder.py (frozen weights, a LoRA base, stay served from the
files: a model bigger than RAM fine-tunes), other local folders (``.bin`` weights) with
``from_pretrained``, offline. A hub id ("org/name[@revision]") is resolved to its snapshot folder
of the Hugging Face cache, downloaded only if not cached (model/hub.py), then loaded as a local
folder.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rp_engine.model.hub import HubError, looks_like_hub_id, snapshot_folder

__all__ = [
    "PRESETS",
    "ByteTokenizer",
    "LoadedModel",
    "ModelError",
    "load_model",
    "parse_lora",
    "apply_lora",
]

BYTE_VOCAB = 260  # 256 bytes + BOS/EOS/PAD + 1 spare


class ModelError(ValueError):
    """A --model / --lora value that cannot be used; the message names it and the fix."""


class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255) + EOS 257 / PAD 258: needs no files and no network."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = BYTE_VOCAB

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def save_pretrained(self, path: str | Path) -> None:
        """Write the same tokenizer as Hugging Face files (``hf_byte_tokenizer``), so a model
        saved beside it loads with ``AutoTokenizer`` (``rp-train --model <folder>``) and keeps
        its token ids."""
        hf_byte_tokenizer().save_pretrained(str(path))


def hf_byte_tokenizer() -> Any:
    """A Hugging Face fast tokenizer with ByteTokenizer's ids: UTF-8 byte b -> id b (a BPE
    without merges over the 256 byte characters), then BOS/EOS/PAD/spare as 256..259, so a
    model trained with the preset's tokenizer keeps its meaning after ``save_pretrained``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte map

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # no regex split and no prefix space: the ids are exactly the text's bytes
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|rp_bos|>", "<|rp_eos|>", "<|rp_pad|>", "<|rp_spare|>"]
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1], pad_token=specials[2]
    )


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # ByteTokenizer or a transformers tokenizer (encode / eos_token_id)
    name: str  # short name for the run folder
    source: str  # "preset" | "local" | "hub"
    hidden_size: int | None


def _qwen3(**kw: Any) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**kw)


def _llama(**kw: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**kw)


def _tiny_qwen3(layers: int, hidden: int) -> Any:
    return _qwen3(
        vocab_size=BYTE_VOCAB, hidden_size=hidden, intermediate_size=hidden * 3,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden // 4, max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip


def _tiny_llama(layers: int, hidden: int) -> Any:
    return _llama(
        vocab_size=BYTE_VOCAB, hidden_size=hidden, intermediate_size=hidden * 3,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip


# Public config.json values of the released checkpoints (random weights here).
def _qwen3_06b(layers: int, hidden: int) -> Any:
    return _qwen3(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
    )  # fmt: skip


def _qwen3_17b(layers: int, hidden: int) -> Any:
    return _qwen3(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
    )  # fmt: skip


def _llama31_8b(layers: int, hidden: int) -> Any:
    return _llama(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
    )  # fmt: skip


# name -> config builder(layers, hidden); only the tiny ones use --layers/--hidden.
PRESETS: dict[str, Callable[[int, int], Any]] = {
    "tiny-qwen3": _tiny_qwen3,
    "tiny-llama": _tiny_llama,
    "qwen3-0.6b": _qwen3_06b,
    "qwen3-1.7b": _qwen3_17b,
    "llama-3.1-8b": _llama31_8b,
}


@contextlib.contextmanager
def _meta_device(enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    with torch.device("meta"):
        yield


def load_model(
    spec: str, *, layers: int = 4, hidden: int = 128, seed: int = 0, meta: bool = False,
    dtype: torch.dtype | None = None,
) -> LoadedModel:  # fmt: skip
    """A preset name, a local model directory, or a hub id ("org/name[@revision]", resolved to
    its snapshot folder of the Hugging Face cache, see model/hub.py) -> model + tokenizer.

    ``meta=True`` builds presets on the meta device (shapes only, no memory): for ``--plan``.
    ``dtype``: the run's compute dtype; a local folder's weights in another dtype are cast to it
    layer by layer while read (None: the folder's config dtype).
    Raises ModelError for an unknown preset or a path that does not exist.
    """
    from transformers import AutoModelForCausalLM

    if spec in PRESETS:
        config = PRESETS[spec](layers, hidden)
        config._attn_implementation = "eager"
        torch.manual_seed(seed)
        with _meta_device(meta):
            model = AutoModelForCausalLM.from_config(config)
        return LoadedModel(model, ByteTokenizer(), spec, "preset", config.hidden_size)
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError(
                f"--model {spec}: {path} has no config.json; give a folder written by "
                "save_pretrained (config.json + weights + tokenizer files)"
            )
        return _from_pretrained(str(path), path.resolve().name, "local", meta, dtype)
    if looks_like_hub_id(spec):
        try:  # its snapshot folder (configs only for shapes), then loaded as a local folder
            folder = snapshot_folder(spec, weights=not meta)
        except HubError as e:
            raise ModelError(f"--model {spec!r}: no such local path; {e}") from e
        name = spec.partition("@")[0].split("/")[1]
        return _from_pretrained(str(folder), name, "hub", meta, dtype)
    raise ModelError(
        f"--model {spec!r}: not a preset ({', '.join(PRESETS)}), not an existing path, and not "
        "a Hugging Face hub id (org/name or org/name@revision)"
    )


def _from_pretrained(
    where: str, name: str, source: str, meta: bool, dtype: torch.dtype | None = None
) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rp_engine.model.folder import FolderError, from_folder, is_model_folder

    # always a local folder: a hub id arrives as its snapshot folder (model/hub.py)
    config = AutoConfig.from_pretrained(where, local_files_only=True)
    if meta:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    elif is_model_folder(where):
        try:  # layer by layer, frozen weights served from the files (model/folder.py)
            model = from_folder(where, dtype=dtype)
        except FolderError as e:
            raise ModelError(f"--model {where}: {e}") from e
    else:
        model = AutoModelForCausalLM.from_pretrained(where, local_files_only=True)
    try:
        tokenizer: Any = AutoTokenizer.from_pretrained(where, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelError(
            f"--model {where}: no tokenizer could be loaded ({e}); save one next to the weights "
            "with tokenizer.save_pretrained"
        ) from e
    return LoadedModel(model, tokenizer, name, source, getattr(config, "hidden_size", None))


def parse_lora(text: str) -> tuple[int, int, list[str]]:
    """``"r,alpha[,target,target...]"`` -> (r, alpha, targets); default targets q_proj,v_proj."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        r, alpha = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ModelError(
            f"--lora {text!r}: expected 'r,alpha[,targets]', e.g. --lora 8,16 or "
            "--lora 8,16,q_proj,k_proj,v_proj,o_proj"
        ) from None
    if r < 1 or alpha < 1:
        raise ModelError(f"--lora {text!r}: r and alpha must be integers >= 1")
    return r, alpha, parts[2:] or ["q_proj", "v_proj"]


def apply_lora(model: nn.Module, text: str) -> nn.Module:
    """Wrap ``model`` with peft LoRA (base weights frozen: no master/grad/Adam state for them)."""
    from peft import LoraConfig, get_peft_model

    r, alpha, targets = parse_lora(text)
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    try:
        return get_peft_model(model, config)  # type: ignore[arg-type]
    except ValueError as e:
        raise ModelError(f"--lora {text!r}: {e}") from e
