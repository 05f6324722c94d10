"""Loading a model from its ``save_pretrained`` folder layer by layer (rp_engine/model/folder.py).

A tiny Qwen3 (3 layers of hidden 64, vocab 128) saved in bf16 or fp32 and sharded into many
files trains to exactly the losses of the same folder loaded whole with ``from_pretrained``,
full fine-tune and LoRA, through every entry point: ``initialize(model="<folder>")``,
``initialize(model=<meta model>, checkpoint="<folder>")`` and ``rp-train``'s ``load_model``.
A LoRA base's frozen weights stay views of the files' private mappings (``/proc/self/maps``)
after ``initialize`` and after training steps; trainable weights never do. The memory-limited
acceptance run is tests/engine/test_folder_load_limited.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import config as engine_config
from engine_helpers import run_losses
from models import random_batch, tiny

import rp_engine
from rp_engine.model import folder as F

VOCAB = 128
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _save(where: Path, dtype: torch.dtype, *, tie: bool = False) -> Path:
    """The tiny Qwen3 in ``dtype``, sharded into files of at most 40 kB."""
    model = tiny("qwen3", 0, layers=3, hidden=64, vocab=VOCAB, tie=tie).to(dtype)
    model.save_pretrained(where, max_shard_size="40kB")
    assert len(list(where.glob("*.safetensors"))) > 3  # sharded: an index and many files
    return where


def _cfg(dtype: torch.dtype) -> dict[str, Any]:
    extra = {"bf16": {"enabled": True}} if dtype == torch.bfloat16 else {}
    return engine_config(devices=2, gas=2, mbs=2, **extra)


def _batches() -> list[dict[str, torch.Tensor]]:
    return [random_batch(VOCAB, batch=2, seq=16, seed=s) for s in range(8)]


def _whole(where: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(where)


def _lora(model: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
        lora_dropout=0.0, task_type="CAUSAL_LM",
    )  # fmt: skip
    torch.manual_seed(1)
    return get_peft_model(model, cfg)


def _losses_of(model_or_folder: Any, cfg: dict[str, Any], **kwargs: Any) -> list[float]:
    engine, _, _, _ = rp_engine.initialize(model=model_or_folder, config=cfg, **kwargs)
    try:
        it = iter(_batches())
        losses = [float(engine.train_batch(it)) for _ in range(2)]
        engine.synchronize()
    finally:
        engine.destroy()
    return losses


@pytest.mark.parametrize("name", list(DTYPES))
def test_full_fine_tune_from_the_folder_equals_from_pretrained(tmp_path: Path, name: str) -> None:
    dtype = DTYPES[name]
    folder = _save(tmp_path / "m", dtype)
    cfg = _cfg(dtype)
    expected = run_losses(_whole(folder), cfg, _batches(), steps=2)
    assert _losses_of(str(folder), cfg) == expected
    # a model built on meta, filled from checkpoint=
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    assert _losses_of(meta.eval(), cfg, checkpoint=folder) == expected


@pytest.mark.parametrize("name", list(DTYPES))
def test_lora_from_the_folder_equals_from_pretrained(tmp_path: Path, name: str) -> None:
    dtype = DTYPES[name]
    folder = _save(tmp_path / "m", dtype)
    cfg = _cfg(dtype)
    expected = run_losses(_lora(_whole(folder)), cfg, _batches(), steps=2)
    assert _losses_of(_lora(F.from_folder(folder, dtype=dtype)), cfg) == expected


def test_files_in_another_dtype_are_cast_per_layer(tmp_path: Path) -> None:
    """fp32 files trained in bf16: the same losses as from_pretrained's model cast by the
    engine; the cast weights are ordinary memory (counted), not views of the files."""
    folder = _save(tmp_path / "m", torch.float32)
    cfg = _cfg(torch.bfloat16)
    expected = run_losses(_lora(_whole(folder)), cfg, _batches(), steps=2)
    model = F.from_folder(folder, dtype=torch.bfloat16)
    maps = F.FileMappings.read()
    assert all(maps.path_of(p) is None for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert _losses_of(_lora(model), cfg) == expected


def _in_folder(path: str | None, folder: Path) -> bool:
    return path is not None and Path(path).parent == folder.resolve()


def test_frozen_weights_stay_views_of_the_files(tmp_path: Path) -> None:
    folder = _save(tmp_path / "m", torch.bfloat16)
    model = _lora(F.from_folder(folder, dtype=torch.bfloat16))
    frozen = [p for p in model.parameters() if not p.requires_grad]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert frozen and trainable
    engine, _, _, _ = rp_engine.initialize(model=model, config=_cfg(torch.bfloat16))
    try:
        for when in ("after initialize", "after 2 steps"):
            maps = F.FileMappings.read()
            outside = [p.shape for p in frozen if not _in_folder(maps.path_of(p), folder)]
            assert not outside, f"{when}: frozen weights copied out of the files: {outside}"
            assert all(maps.path_of(p) is None for p in trainable), when
            it = iter(_batches())
            for _ in range(2):
                engine.train_batch(it)
            engine.synchronize()
    finally:
        engine.destroy()


def test_trainable_weights_are_read_into_memory(tmp_path: Path) -> None:
    """A full fine-tune from the folder: every weight is written by the optimizer, so none may
    stay in a private file mapping (its pages would turn anonymous behind the count)."""
    folder = _save(tmp_path / "m", torch.bfloat16)
    engine, _, _, _ = rp_engine.initialize(model=str(folder), config=_cfg(torch.bfloat16))
    try:
        maps = F.FileMappings.read()
        assert all(maps.path_of(p) is None for p in engine.module.parameters())
    finally:
        engine.destroy()


def test_the_host_store_pins_no_file_backed_weight(tmp_path: Path) -> None:
    from rp_engine.model.host_store import HostStore

    folder = _save(tmp_path / "m", torch.bfloat16)
    model = _lora(F.from_folder(folder, dtype=torch.bfloat16))
    pinned: list[torch.Tensor] = []

    def pin(t: torch.Tensor) -> torch.Tensor:
        pinned.append(t)
        return t.clone()  # what a real pin does: a copy

    HostStore([model], pin=pin)
    maps = F.FileMappings.read()
    assert pinned and all(maps.path_of(t) is None for t in pinned)
    assert all(
        _in_folder(maps.path_of(p), folder) for p in model.parameters() if not p.requires_grad
    )


def test_tied_weights_are_one_parameter_read_once(tmp_path: Path) -> None:
    folder = _save(tmp_path / "m", torch.float32, tie=True)
    model = F.from_folder(folder, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    cfg = _cfg(torch.float32)
    assert _losses_of(str(folder), cfg) == run_losses(_whole(folder), cfg, _batches(), steps=2)


def test_keys_without_the_base_prefix_are_renamed(tmp_path: Path) -> None:
    """A checkpoint whose base-model keys lack ``model.`` (saved from the base model) loads as
    transformers loads it."""
    from safetensors.torch import load_file, save_file

    folder = _save(tmp_path / "m", torch.float32)
    index = json.loads((folder / F.INDEX_FILE).read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(folder / shard)
        renamed = {k.removeprefix("model."): v for k, v in tensors.items()}
        save_file(renamed, folder / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(renamed, shard))
    index["weight_map"] = weight_map
    (folder / F.INDEX_FILE).write_text(json.dumps(index))
    ours = F.from_folder(folder, dtype=torch.float32).state_dict()
    theirs = _whole(folder).state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_peft_adapter_folder_loads_its_base_from_the_files(tmp_path: Path) -> None:
    base = _save(tmp_path / "base", torch.bfloat16)
    adapter = tmp_path / "adapter"
    _lora(_whole(base)).save_pretrained(adapter)
    info = json.loads((adapter / "adapter_config.json").read_text())
    assert info["base_model_name_or_path"] == str(base)
    model = F.from_folder(adapter, dtype=torch.bfloat16)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    maps = F.FileMappings.read()
    assert all(_in_folder(maps.path_of(p), base) for p in model.parameters() if not p.requires_grad)
    cfg = _cfg(torch.bfloat16)
    expected = run_losses(_lora(_whole(base)), cfg, _batches(), steps=2)
    assert _losses_of(model, cfg) == expected


def test_rp_train_loads_a_folder_through_the_files(tmp_path: Path) -> None:
    from rp_engine.train.presets import ByteTokenizer, apply_lora, load_model

    folder = _save(tmp_path / "m", torch.bfloat16)
    ByteTokenizer().save_pretrained(folder)
    loaded = load_model(str(folder), dtype=torch.bfloat16)
    model = apply_lora(loaded.model, "4,8")
    maps = F.FileMappings.read()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and all(_in_folder(maps.path_of(p), folder) for p in frozen)


def test_errors_name_the_folder_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(F.FolderError, match="not a save_pretrained folder"):
        rp_engine.initialize(model=str(tmp_path), config=_cfg(torch.float32))
    folder = _save(tmp_path / "m", torch.float32)
    with pytest.raises(F.FolderError, match="already holds its weights"):
        rp_engine.initialize(model=_whole(folder), config=_cfg(torch.float32), checkpoint=folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("layer_types", None)  # one per layer: derived again
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    with pytest.raises(F.FolderError, match=r"no tensor for parameter.*model\.layers\.3\."):
        F.from_folder(folder)
    os.remove(folder / F.INDEX_FILE)
    with pytest.raises(F.FolderError, match="no model.safetensors"):
        F.load_weights(F.build_empty(F._load_config(folder)), folder)


def test_frozen_file_views_of_a_peft_wrapped_from_pretrained_model(tmp_path: Path) -> None:
    """What the ZeRO-3 takeover serves frozen weights from (zero3.take_over): for a model
    ``from_pretrained`` from a folder and wrapped by peft, each frozen parameter's tensor in the
    files (resolved through the wrapper: ``base_layer`` dropped), as a view of the file; nothing
    for a trainable parameter or a model that did not come from a folder."""
    folder = _save(tmp_path / "m", torch.bfloat16)
    model = _lora(_whole(folder))
    views = F.frozen_file_views(model)
    assert views is not None
    assert {p.requires_grad for p in model.parameters()} == {True, False}
    found = [(p, views(p)) for p in model.parameters()]
    maps = F.FileMappings.read()  # after the views: a file is mapped on its first view
    for p, view in found:
        if p.requires_grad:
            assert view is None
        else:
            assert view is not None and torch.equal(view, p)
            assert _in_folder(maps.path_of(view), folder)
    assert F.frozen_file_views(_lora(tiny("qwen3", 0, layers=1, hidden=64, vocab=VOCAB))) is None


@pytest.mark.parametrize("mixed", [False, True], ids=["files-only", "mixed-records"])
def test_the_param_tier_reads_frozen_weights_from_the_files(tmp_path: Path, mixed: bool) -> None:
    """``offload_param`` on NVMe with a LoRA base loaded from its folder: the frozen weights
    served from the files get no record in the tier's swap file (only the adapters page) and
    stay views of the files through training; the losses equal the run without the tier.
    ``mixed``: each layer's input norm is copied out of the files first (frozen, not file
    backed), so its records hold frozen and trainable weights (read before a publish), and the
    asynchronous optimizer double-buffers the weights."""
    from rp_engine.storage.aligned import round_up

    base = _save(tmp_path / "base", torch.bfloat16)
    adapter = tmp_path / "adapter"
    _lora(_whole(base)).save_pretrained(adapter)

    def model() -> Any:
        if not mixed:
            return str(adapter)  # initialize(model="<folder>")
        m = F.from_folder(adapter)
        for layer in m.base_model.model.model.layers:
            norm = layer.input_layernorm.weight
            norm.data = norm.data.clone()  # in ordinary memory now: pages with the adapters
        return m

    cfg = engine_config(devices=2, gas=2, mbs=2, async_optimizer=mixed, bf16={"enabled": True})
    expected = _losses_of(model(), cfg)
    swap = tmp_path / "swap"
    swap.mkdir()
    nvme = {
        **cfg,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(swap), "max_in_cpu": 0},
        },
    }
    engine, _, _, _ = rp_engine.initialize(model=model(), config=nvme)
    try:
        tier = engine.param_tier
        assert tier is not None
        named = [
            (name, p) for name, p in engine.module.named_parameters()
            if not p.requires_grad and not (mixed and "input_layernorm" in name)
        ]  # fmt: skip
        in_files = [p for _, p in named]
        paged = {id(p) for ps in tier.plan.paged.values() for p in ps}
        copied = [name for name, p in named if id(p) in paged]
        count = len(named)  # not asserted on the list: a paged weight's repr reads no memory
        assert count == 36 - 3 * mixed  # 3 layers of 11 weights, the final norm, 2 embeddings
        assert not copied, f"frozen weights copied into the swap file: {copied}"
        # the swap file holds one record per layer and weight buffer of the rest: the adapters
        # (and, mixed, the copied norms), each 64-byte aligned, records in 4 KiB multiples
        kept = {id(p) for p in in_files}
        records = [
            round_up(sum(round_up(p.numel() * p.element_size(), 64) for _, p in layer.params
                         if id(p) not in kept))
            for layer in engine.store.layers
        ]  # fmt: skip
        assert tier.disk_bytes == tier.copies * sum(records)
        assert tier.copies == (2 if mixed else 1)
        base_bytes = sum(p.numel() * p.element_size() for p in in_files)
        assert tier.disk_bytes < base_bytes
        # the host-RAM prediction (host_preflight.check_tiers): page cache, not RAM held
        assert engine.host_ram is not None and engine.host_ram.file_pages == base_bytes
        it = iter(_batches())
        losses = []
        for when in ("after initialize", "after 2 steps"):
            maps = F.FileMappings.read()
            outside = [p.shape for p in in_files if not _in_folder(maps.path_of(p), base)]
            assert not outside, f"{when}: frozen weights copied out of the files: {outside}"
            if not losses:
                losses = [float(engine.train_batch(it)) for _ in range(2)]
                engine.synchronize()
        assert losses == expected
    finally:
        engine.destroy()
