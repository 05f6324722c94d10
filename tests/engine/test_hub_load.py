"""Hugging Face hub ids as ``model=`` / ``--model`` (rp_engine/model/hub.py), offline.

A tiny Qwen3 saved with ``save_pretrained`` is laid out as the hub cache lays out a download
(``models--org--name/blobs`` + ``snapshots/<commit>/`` links + ``refs/main``) in a temporary
``HF_HUB_CACHE`` with ``HF_HUB_OFFLINE=1``: ``initialize(model="org/name")`` trains to exactly
the losses of ``initialize(model=<the saved folder>)``, a peft adapter repo loads its base by hub
id, ``rp-train --model org/name`` loads through the folder loader (frozen LoRA base served from
the cached files, ``from_pretrained`` never called), and a missing or partial snapshot is a
clear error naming the id, the cache and the fix, with nothing written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import config as engine_config
from models import random_batch, tiny

import rp_engine
from rp_engine.model import folder as F
from rp_engine.model import hub as H

VOCAB = 260  # the byte tokenizer's ids (rp-train tokenizes with it)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache, offline: set in the environment after huggingface_hub's import."""
    where = tmp_path / "hf-cache"
    where.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(where))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return where


def _save(where: Path) -> Path:
    """The tiny Qwen3 in bf16, sharded (an index and several files), with a tokenizer."""
    from rp_engine.train.presets import ByteTokenizer

    model = tiny("qwen3", 0, layers=3, hidden=64, vocab=VOCAB).to(torch.bfloat16)
    model.save_pretrained(where, max_shard_size="40kB")
    ByteTokenizer().save_pretrained(where)
    return where


def _publish(cache: Path, repo: str, folder: Path, only: tuple[str, ...] = ()) -> Path:
    """``folder``'s files (or just ``only``) as the cache holds a download of ``repo``: content-
    named blobs, the snapshot's relative links to them, ``refs/main`` -> the commit."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot, blobs = root / "snapshots" / COMMIT, root / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in sorted(folder.iterdir()):
        if only and f.name not in only:
            continue
        blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    return snapshot


def _cfg() -> dict[str, Any]:
    return engine_config(devices=2, gas=2, mbs=2, bf16={"enabled": True})


def _losses_of(model: Any, **kwargs: Any) -> list[float]:
    engine, _, _, _ = rp_engine.initialize(model=model, config=_cfg(), **kwargs)
    try:
        it = iter([random_batch(VOCAB, batch=2, seq=16, seed=s) for s in range(4)])
        losses = [float(engine.train_batch(it)) for _ in range(2)]
        engine.synchronize()
    finally:
        engine.destroy()
    return losses


def _files(where: Path) -> list[tuple[str, int]]:
    return sorted((str(p), p.stat().st_size) for p in where.rglob("*") if p.is_file())


def _in_blobs(path: str | None, cache: Path, repo: str) -> bool:
    blobs = cache.resolve() / f"models--{repo.replace('/', '--')}" / "blobs"
    return path is not None and Path(path).parent == blobs


def test_hub_id_syntax() -> None:
    assert H.looks_like_hub_id("org/name") and H.looks_like_hub_id("org/name@refs/pr/1")
    for spec in ("name", "org/", "/org/name", "./org/name", "~/org", "a/b/c", "tiny-qwen3"):
        assert not H.looks_like_hub_id(spec), spec


def test_only_the_files_the_folder_loader_reads_are_fetched(tmp_path: Path) -> None:
    from huggingface_hub.utils import filter_repo_objects

    saved = [p.name for p in _save(tmp_path / "m").iterdir()]
    extra = ["consolidated.safetensors", "pytorch_model.bin", "original/consolidated.00.pth"]
    extra += ["adapter_model.bin", "README.md", "model.gguf"]
    got = set(filter_repo_objects(saved + extra, allow_patterns=H.HUB_FILES))
    assert got == set(saved)
    weights = {n for n in saved if n.startswith("model")}
    assert set(filter_repo_objects(saved, allow_patterns=H.CONFIG_FILES)) == set(saved) - weights


def test_the_cache_first_then_a_download(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Online: ``local_files_only=True`` first (no network call when cached), then a download
    into the cache named by the environment of now, restricted to HUB_FILES."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    folder, calls = _save(tmp_path / "m"), []

    def fake(repo: str, **kw: Any) -> str:
        calls.append(kw)
        if kw["local_files_only"]:
            raise LocalEntryNotFoundError("not cached")
        return str(_publish(Path(kw["cache_dir"]), repo, folder))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert H.snapshot_folder("org/tiny@v2") == cache / "models--org--tiny" / "snapshots" / COMMIT
    assert [c["local_files_only"] for c in calls] == [True, False]
    assert all(c["cache_dir"] == str(cache) and c["revision"] == "v2" for c in calls)
    assert all(c["allow_patterns"] == H.HUB_FILES for c in calls)


def test_initialize_a_hub_id_trains_as_its_folder(
    tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _save(tmp_path / "m")
    snapshot = _publish(cache, "org/tiny", folder)
    for spec in ("org/tiny", "org/tiny@main", f"org/tiny@{COMMIT}"):
        assert H.local_folder(spec) == snapshot
    with caplog.at_level(logging.INFO, logger="rp_engine"):
        losses = _losses_of("org/tiny")
    assert f"using snapshot folder {snapshot}" in caplog.text
    assert losses == _losses_of(str(folder))
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # a meta model filled from checkpoint=<hub id>
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    assert _losses_of(meta.eval(), checkpoint="org/tiny") == losses


def test_a_peft_adapter_repo_loads_its_base_by_hub_id(tmp_path: Path, cache: Path) -> None:
    from peft import LoraConfig, get_peft_model

    base = _save(tmp_path / "base")
    _publish(cache, "org/base", base)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
        lora_dropout=0.0, task_type="CAUSAL_LM",
    )  # fmt: skip
    torch.manual_seed(1)
    adapter = tmp_path / "adapter"
    get_peft_model(F.from_folder(base), lora).save_pretrained(adapter)
    expected = _losses_of(str(adapter))  # its base by local path
    info = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(
        json.dumps({**info, "base_model_name_or_path": "org/base"})
    )
    _publish(cache, "org/adapter", adapter)
    model = F.from_folder("org/adapter")
    maps = F.FileMappings.read()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and all(_in_blobs(maps.path_of(p), cache, "org/base") for p in frozen)
    assert _losses_of("org/adapter") == expected


def test_rp_train_loads_a_hub_id_through_the_files(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from transformers import AutoModelForCausalLM

    from rp_engine.train import cli
    from rp_engine.train.presets import apply_lora, load_model

    _publish(cache, "org/tiny", _save(tmp_path / "m"))
    loaded = load_model("org/tiny", dtype=torch.bfloat16)
    assert loaded.name == "tiny" and loaded.source == "hub"
    model = apply_lora(loaded.model, "4,8")
    maps = F.FileMappings.read()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and all(_in_blobs(maps.path_of(p), cache, "org/tiny") for p in frozen)

    def whole(*a: Any, **k: Any) -> Any:
        raise AssertionError("from_pretrained loads the whole model: the folder loader must")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", whole)
    run, data = tmp_path / "run", tmp_path / "data.txt"
    data.write_text("a few words to train on, again and again.\n" * 20)
    argv = [
        "--model", "org/tiny", "--data", str(data), "--lora", "4,8", "--steps", "1", "--seq-len", "16",
        "--micro-batch", "2", "--grad-accum", "1", "--devices", "cpu:2", "--sync-optimizer",
        "--no-wandb", "--eval-every", "0", "--eval-split", "0", "--out", str(run),
    ]  # fmt: skip
    rc = cli.main(argv)
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    assert json.loads((run / "summary.json").read_text())["steps"] == 1


def test_a_missing_or_partial_snapshot_is_a_clear_error(
    tmp_path: Path, cache: Path, capsys
) -> None:
    from rp_engine.train import cli
    from rp_engine.train.presets import load_model

    before = _files(cache)
    with pytest.raises(H.HubError) as e:
        rp_engine.initialize(model="org/missing", config=_cfg())
    message = str(e.value)
    assert "'org/missing'" in message and str(cache) in message
    assert "hf download org/missing" in message and "HF_HUB_OFFLINE" in message
    run = tmp_path / "run"
    assert cli.main(["--model", "org/missing@v1", "--out", str(run), "--no-wandb"]) == 2
    err = capsys.readouterr().err
    assert "org/missing@v1" in err and "--revision v1" in err
    assert _files(cache) == before and not run.exists()  # nothing written

    # configs and tokenizer cached, no weights: shapes for a plan load, training refuses
    folder = _save(tmp_path / "m")
    configs = tuple(p.name for p in folder.iterdir() if not p.name.startswith("model"))
    _publish(cache, "org/part", folder, only=configs)
    assert load_model("org/part", meta=True).model.config.num_hidden_layers == 3
    with pytest.raises(H.HubError, match=r"org/part.*lacks config.json or safetensors"):
        rp_engine.initialize(model="org/part", config=_cfg())
