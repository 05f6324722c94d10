"""Hugging Face hub ids (``"org/name"``, ``"org/name@revision"``) resolved to a local folder.

``rp_engine.initialize(model=...)`` and ``rp-train --model`` take a hub id where they take a
``save_pretrained`` folder: :func:`local_folder` turns it into the snapshot folder of the
Hugging Face cache (``huggingface_hub.snapshot_download``), which then loads exactly as a local
folder does (model/folder.py: built on meta, read layer by layer, frozen weights served from the
files). Only the files that loader reads are fetched (:data:`HUB_FILES`: configs, safetensors
weights and their index, tokenizer and peft adapter files), never ``.bin`` / ``.pth`` copies.

The cache is tried first (``local_files_only=True``: no network call, works offline), then a
download unless ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set. Both environment and
cache folder are read at call time (``huggingface_hub`` reads them once, at import), so a
process that sets ``HF_HUB_CACHE`` / ``HF_HUB_OFFLINE`` after importing it is honoured. When
neither gives a usable folder the error names the id, the cache folder and the fix.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from rp_engine.model.folder_layout import FolderError, is_model_folder

log = logging.getLogger("rp_engine")

__all__ = ["HUB_FILES", "HubError", "local_folder", "looks_like_hub_id", "snapshot_folder"]

# What model/folder.py, AutoConfig, AutoTokenizer and peft read from a folder. Explicit names
# rather than "*.safetensors": some repos also ship e.g. a "consolidated.safetensors" copy of
# every weight, which would double the download.
CONFIG_FILES = [
    "config.json",
    "generation_config.json",
    "adapter_config.json",
    "tokenizer*",  # tokenizer.json, tokenizer_config.json, tokenizer.model (sentencepiece)
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
    "chat_template*",
]
WEIGHT_FILES = ["model*.safetensors", "model.safetensors.index.json", "adapter_model.safetensors"]
HUB_FILES = CONFIG_FILES + WEIGHT_FILES

_TRUE = {"1", "ON", "YES", "TRUE"}


class HubError(FolderError):
    """A hub id that gives no usable local folder; the message names the id, the cache folder
    and the fix."""


def looks_like_hub_id(spec: str) -> bool:
    """``"org/name"`` or ``"org/name@revision"``: exactly one ``/`` before any ``@``, both parts
    non-empty, not starting like a path (``.``, ``/``, ``~``). Syntax only: callers check first
    that no local path of that name exists (a local folder wins)."""
    repo, _, _ = spec.partition("@")
    org, sep, name = repo.partition("/")
    return bool(sep and org and name) and "/" not in name and not spec.startswith((".", "/", "~"))


def _split(spec: str) -> tuple[str, str | None]:
    """``"org/name@rev"`` -> ``("org/name", "rev")``; no ``@`` -> revision None (``main``)."""
    repo, at, revision = spec.partition("@")
    return repo, (revision or None) if at else None


def _cache_dir() -> str:
    """The hub cache folder as ``huggingface_hub.constants`` derives it, from the environment
    of now rather than of its import."""
    from huggingface_hub import constants

    env = os.environ
    where = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not where and env.get("HF_HOME"):
        where = os.path.join(env["HF_HOME"], "hub")
    return os.path.expandvars(os.path.expanduser(where or constants.HF_HUB_CACHE))


def _offline() -> bool:
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any((f or "").upper() in _TRUE for f in flags)


def _usable(folder: Path, weights: bool) -> bool:
    """The folder holds what is needed: a config (model or peft adapter), and with ``weights``
    safetensors weights too (a cached snapshot may hold only a config fetched earlier)."""
    if (folder / "adapter_config.json").is_file():
        return not weights or (folder / "adapter_model.safetensors").is_file()
    if not weights:
        return (folder / "config.json").is_file()

    return is_model_folder(folder)


def snapshot_folder(hub_id: str, *, weights: bool = True) -> Path:
    """The local snapshot folder of ``hub_id`` (``"org/name"`` or ``"org/name@revision"``):
    from the cache if it holds the files, else downloaded (``snapshot_download``, with its own
    progress bars) unless offline. ``weights=False`` fetches configs and tokenizer only (shapes
    for a plan). Raises :class:`HubError` naming the id, the cache folder and the fix."""
    from huggingface_hub import snapshot_download

    repo, revision = _split(hub_id)
    cache = _cache_dir()
    patterns = HUB_FILES if weights else CONFIG_FILES
    errors: list[str] = []
    for local_only in (True, False):
        if not local_only and _offline():
            errors.append("HF_HUB_OFFLINE is set: nothing downloaded")
            break
        try:
            got = snapshot_download(
                repo, revision=revision, cache_dir=cache, allow_patterns=patterns,
                local_files_only=local_only,
            )  # fmt: skip
        except (OSError, ValueError) as e:  # not cached, no network, no such repo, bad id...
            errors.append(f"{type(e).__name__}: {e}")
            continue
        folder = Path(got)
        if _usable(folder, weights):
            log.info("rp_engine: hub id %s: using snapshot folder %s", hub_id, folder)
            return folder
        errors.append(f"{folder} lacks config.json or safetensors weights")
    what = "config.json and safetensors weights (model*.safetensors)" if weights else "config.json"
    raise HubError(
        f"hub id {hub_id!r}: no snapshot with {what} in the Hugging Face cache {cache}, and "
        f"none could be downloaded ({'; '.join(errors)}). Fix: download it where there is "
        f"network (`hf download {repo}`{f' --revision {revision}' if revision else ''} with "
        "HF_HUB_CACHE pointing at this cache, or unset HF_HUB_OFFLINE), or pass the path of a "
        "save_pretrained folder instead; repos with only .bin weights are not loaded this way"
    )


def local_folder(spec: str | os.PathLike[str], *, weights: bool = True) -> Path:
    """The folder ``spec`` names: an existing path as given (``~`` expanded); else a hub id's
    snapshot folder (:func:`snapshot_folder`); else the path as given, for the caller's own
    "not a folder" error."""
    path = Path(os.fspath(spec)).expanduser()
    if path.exists() or not looks_like_hub_id(os.fspath(spec)):
        return path
    return snapshot_folder(os.fspath(spec), weights=weights)
