"""Models built under DeepSpeed's ``zero.Init`` (ZeRO-3 partitions) handed to ``initialize``.

Every parameter of such a model is empty, its values in DeepSpeed's partition (host memory or an
NVMe swap file). ``initialize`` takes the model over layer by layer (rp_engine/model/zero3.py);
before it did, the first forward failed ("The size of tensor a (0) must match ...", "mat2 must
be a matrix, got 1-D tensor"). The ZeRO-3 models are built in a child process
(tests/support/zero3_child.py): zero.Init needs a process group and patches torch globals. A
parameter holding no data is refused by name, ZeRO-3 or not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models import random_batch, tiny_mlp, tiny_qwen3
from subprocess_helpers import run_json

import rp_engine
from rp_engine.model.zero3 import EmptyParameterError, layer_groups

VOCAB = 128
# DeepSpeed swaps a partition to NVMe from 1 MiB on (smaller ones stay in RAM): at hidden 512
# the q/o (512x512) and MLP weights of each block are swapped, the k/v and norms are not
HIDDEN = 512
MICRO_BATCHES = 6  # GAS 2: 3 optimizer steps


def _config(offload: str, nvme_path: Path) -> dict[str, Any]:
    offload_param: dict[str, Any] = {"device": offload}
    if offload == "nvme":
        # 2 swap buffers of 1M elements: a decoder block's 5 swapped weights take 3 gathers
        offload_param.update(nvme_path=str(nvme_path), buffer_count=2, buffer_size=2**20)
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "offload_param": offload_param},
        # sync: the losses are a function of the weights alone
        "roundpipe": {"devices": "cpu:2", "async_optimizer": False},
    }


def _losses_loaded_normally(config: dict[str, Any]) -> list[float]:
    model = tiny_qwen3(0, layers=2, hidden=HIDDEN)
    engine, _, _, _ = rp_engine.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    losses = []
    try:
        for i in range(MICRO_BATCHES):
            loss = engine(**random_batch(VOCAB, batch=2, seq=16, seed=100 + i)).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    finally:
        engine.destroy()
    return losses


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_qwen3")
    tiny_qwen3(0, layers=2, hidden=HIDDEN).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("case", "offload"),
    [("hf", "cpu"), ("hf", "nvme"), ("init", "nvme"), ("init", "none")],
    ids=["HfDeepSpeedConfig-cpu", "HfDeepSpeedConfig-nvme", "zero.Init-nvme", "zero.Init-none"],
)
def test_zero3_model_trains_as_the_model_loaded_normally(
    model_dir: Path, tmp_path: Path, case: str, offload: str
) -> None:
    """``HfDeepSpeedConfig(ds)`` before ``from_pretrained``, or ``with deepspeed.zero.Init(
    remote_device="nvme" / None, config_dict_or_path=ds)``: the partitioned model trains with
    the losses of the same weights loaded normally (same config: with ``offload_param`` nvme the
    engine's parameter tier holds the weights in both runs)."""
    spec = {
        "case": case,
        "remote_device": None if offload == "none" else offload,
        "model_dir": str(model_dir),
        "vocab": VOCAB,
        "micro_batches": MICRO_BATCHES,
        "config": _config(offload, tmp_path / "child_nvme"),
    }
    (tmp_path / "child_nvme").mkdir()
    (tmp_path / "ours_nvme").mkdir()
    child = run_json("zero3_child.py", spec, timeout=900)
    # a plain module afterwards: no DeepSpeed attribute, torch's own linear, no swap file left
    assert child["ds_params"] == []
    assert child["linear_restored"]
    assert child["swap_files"] == 0
    if offload == "nvme":
        assert child["swap_files_before"] > 0  # the partitions were on NVMe indeed
    theirs = child["losses"]
    ours = _losses_loaded_normally(_config(offload, tmp_path / "ours_nvme"))
    assert len(theirs) == MICRO_BATCHES
    # same weights, same engine: equal up to the thread count's rounding (child: 1 thread)
    torch.testing.assert_close(torch.tensor(theirs), torch.tensor(ours), rtol=1e-5, atol=0)


@pytest.mark.parametrize("stage", [0, 3])
def test_deepspeed_no_optim_78_layers(stage: int) -> None:
    """DeepSpeed's ``unit/runtime/test_ds_initialize.py::TestNoOptim::test[stage]`` on
    rp_engine (tests/support/ds_no_optim.py): 78 Linear(4, 4) built under ``zero.Init`` (enabled
    at stage 3 only), bf16, offload_param cpu, no optimizer, 50 training-mode forwards."""
    ran = run_json("zero3_child.py", {"case": "noopt", "stage": stage, "forwards": 50}, timeout=900)
    assert ran == 50


def _empty(p: torch.nn.Parameter) -> None:
    p.data = torch.empty(0)


def _freed(p: torch.nn.Parameter) -> None:
    p.data.untyped_storage().resize_(0)  # FSDP's way of freeing a flat parameter's storage


@pytest.mark.parametrize("free", [_empty, _freed], ids=["empty-data", "storage-resized-to-0"])
def test_parameter_without_data_is_refused_by_name(free: Any) -> None:
    model = tiny_mlp(0, layers=3)
    free(model[1][0].weight)
    with pytest.raises(EmptyParameterError, match=r"parameter '1\.0\.weight' holds no weights"):
        rp_engine.initialize(model=model, config={"train_micro_batch_size_per_gpu": 4})


def test_layer_groups_one_layer_at_a_time_tied_once() -> None:
    """The takeover's unit: each decoder block is one group, every other module with weights its
    own, and a tied weight comes once."""
    model = tiny_qwen3(0, layers=2, tie=True)
    groups = dict(layer_groups(model))
    assert list(groups) == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"]
    assert sum(len(g) for g in groups.values()) == len(list(model.parameters()))


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_qwen3_bf16")
    tiny_qwen3(0, layers=2, hidden=64).to(torch.bfloat16).save_pretrained(path)
    return path


CHANGED = "model.layers.0.mlp.down_proj.weight"


@pytest.mark.parametrize("change", [None, CHANGED], ids=["as-saved", "frozen-weight-changed"])
def test_frozen_weights_of_a_folder_model_are_served_from_its_files(
    bf16_dir: Path, change: str | None
) -> None:
    """``HfDeepSpeedConfig(ds)``, ``from_pretrained(<bf16 folder>)``, a peft LoRA (base frozen),
    ``initialize``: the takeover serves each frozen weight equal to the folder's tensor from the
    file mapping (model/folder.py) instead of a copy of DeepSpeed's gather; a frozen weight the
    user changed after loading keeps its gathered (changed) value. Both train 2 steps to the
    losses of the same script without ZeRO-3 (same process, so exactly)."""
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
        "roundpipe": {"devices": "cpu:2", "async_optimizer": False},
    }
    spec = {
        "case": "folder_lora", "model_dir": str(bf16_dir), "vocab": VOCAB, "steps": 2,
        "change": change, "config": config,
    }  # fmt: skip
    child = run_json("zero3_child.py", spec, timeout=900)
    zero3, plain = child["zero3"], child["plain"]
    assert zero3["trainable_in_files"] == []
    changed = [f"base_model.model.{change}"] if change else []
    assert zero3["frozen_not_in_files"] == changed
    assert len(zero3["frozen_in_files"]) > 10  # embeddings, norms, every block's projections
    if change:
        assert zero3["changed_kept"] and plain["changed_kept"]
    assert len(zero3["losses"]) == 2
    assert zero3["losses"] == plain["losses"]
