"""A model built under DeepSpeed's ``zero.Init`` (ZeRO-3 partitions), handed to rp_engine; prints
JSON. Used by tests/interop/test_zero3_models.py in a subprocess: zero.Init needs a process group
(DeepSpeed's, gloo on CPU), and it patches torch globals, neither of which may leak into the test
process.

Cases (``spec["case"]``):
- ``"hf"``: Transformers' ``HfDeepSpeedConfig(ds)`` alive, then ``from_pretrained`` of a saved
  tiny causal LM (Transformers builds it inside ``zero.Init``); trains ``spec["micro_batches"]``
  micro-steps with DeepSpeed's loop; prints the losses and what is left of DeepSpeed's
  partitions (``_deepspeed_leftovers``);
- ``"init"``: the same model's class built inside ``deepspeed.zero.Init(remote_device=...,
  config_dict_or_path=ds)`` directly, its weights copied in under ``GatheredParameters`` (how a
  user loads a state dict into such a model); trains and prints the losses likewise;
- ``"folder_lora"``: a bf16 folder loaded with ``from_pretrained`` and given a peft LoRA (base
  frozen), optionally with one frozen weight changed after loading (``spec["change"]``: its
  name), trained ``spec["steps"]`` steps with ``train_batch``: once loaded normally, once with
  ``HfDeepSpeedConfig(ds)`` alive (ZeRO-3 partitions taken over); prints both runs' losses and,
  of the ZeRO-3 one after ``initialize``, which frozen weights lie in the folder's files
  (model/folder.py ``file_backing``) and the changed weight's value check;
- ``"noopt"``: DeepSpeed's ``unit/runtime/test_ds_initialize.py::TestNoOptim::test[3]``
  (tests/support/ds_no_optim.py); prints how many forwards ran.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch


def _partitioned(model: torch.nn.Module) -> bool:
    return all(p.numel() == 0 and hasattr(p, "ds_tensor") for p in model.parameters())


def _train(model: torch.nn.Module, spec: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's loop on rp_engine; the losses, and what the takeover left of DeepSpeed."""
    from models import random_batch

    import rp_engine

    swapped = _swap_files(spec)  # DeepSpeed's partitions on NVMe before the takeover
    engine, _, _, _ = rp_engine.initialize(
        model=model, model_parameters=model.parameters(), config=spec["config"]
    )
    left = {**_deepspeed_leftovers(model, spec), "swap_files_before": swapped}
    try:
        losses = []
        for i in range(spec["micro_batches"]):
            loss = engine(**random_batch(spec["vocab"], batch=2, seq=16, seed=100 + i)).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    finally:
        engine.destroy()
    return {"losses": losses, **left}


def _deepspeed_leftovers(model: torch.nn.Module, spec: dict[str, Any]) -> dict[str, Any]:
    """After initialize: parameters still carrying DeepSpeed attributes, whether zero.Init's
    ``torch.nn.functional.linear`` replacement is gone, and DeepSpeed's NVMe swap files left."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    return {
        "ds_params": [
            n for n, p in model.named_parameters() if any(k.startswith("ds_") for k in vars(p))
        ],
        "linear_restored": torch.nn.functional.linear is not zero3_linear_wrap,
        "swap_files": _swap_files(spec),
    }


def _swap_files(spec: dict[str, Any]) -> int:
    nvme = spec["config"]["zero_optimization"]["offload_param"].get("nvme_path")
    return len(list(Path(nvme, "zero_stage_3").rglob("*.swp"))) if nvme else 0


def _hf(spec: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    keep = HfDeepSpeedConfig(spec["config"])  # alive while the model is built, as the docs say
    model = AutoModelForCausalLM.from_pretrained(
        spec["model_dir"], attn_implementation="eager", dtype=torch.float32
    )
    assert _partitioned(model), "Transformers did not build the model under zero.Init"
    result = _train(model.train(), spec)
    del keep
    return result


def _init(spec: dict[str, Any]) -> dict[str, Any]:
    import deepspeed
    from transformers import AutoModelForCausalLM

    # loaded (and Transformers' lazy modules imported) first: zero.Init patches torch.Tensor's
    # constructor, which torch._dynamo's first import refuses
    loaded = AutoModelForCausalLM.from_pretrained(
        spec["model_dir"], attn_implementation="eager", dtype=torch.float32
    )
    config = loaded.config
    # Transformers' weight init zeroes the padding row by indexing the weight, which a
    # partitioned (empty) weight refuses when the class is built inside zero.Init without
    # HfDeepSpeedConfig; the batches never hold token 0, so the padding row plays no part
    config.pad_token_id = None
    with deepspeed.zero.Init(
        remote_device=spec["remote_device"], config_dict_or_path=spec["config"]
    ):
        model = type(loaded)(config)
    assert _partitioned(model), "zero.Init did not partition the model"
    weights = loaded.state_dict()
    del loaded
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            param.data.copy_(weights[name])
    return _train(model.train(), spec)


def _folder_lora(spec: dict[str, Any]) -> dict[str, Any]:
    from transformers.integrations import HfDeepSpeedConfig

    plain = _lora_run(spec, zero3=False)
    keep = HfDeepSpeedConfig(spec["config"])  # alive while the model is built, as the docs say
    zero3 = _lora_run(spec, zero3=True)
    del keep
    return {"plain": plain, "zero3": zero3}


def _lora_run(spec: dict[str, Any], *, zero3: bool) -> dict[str, Any]:
    """from_pretrained, the change (if any), peft LoRA, initialize, ``spec["steps"]`` steps."""
    import deepspeed
    from models import random_batch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import rp_engine
    from rp_engine.model.folder import FileMappings

    model = AutoModelForCausalLM.from_pretrained(
        spec["model_dir"], attn_implementation="eager", dtype=torch.bfloat16
    )
    assert _partitioned(model) == zero3, "Transformers did not build the model as expected"
    changed = None
    if spec["change"]:
        changed = model.get_parameter(spec["change"])
        with deepspeed.zero.GatheredParameters([changed], modifier_rank=0, enabled=zero3):
            changed.data.add_(0.25)  # a weight the user changed after loading
            expected = changed.data.clone()
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
        lora_dropout=0.0, task_type="CAUSAL_LM",
    )  # fmt: skip
    torch.manual_seed(1)
    model = get_peft_model(model, lora)
    engine, _, _, _ = rp_engine.initialize(model=model, config=spec["config"])
    folder = str(Path(spec["model_dir"]).resolve())
    maps = FileMappings.read()

    def in_folder(p: torch.Tensor) -> bool:
        return str(Path(maps.path_of(p) or "/").parent) == folder

    frozen = {n: in_folder(p) for n, p in model.named_parameters() if not p.requires_grad}
    out: dict[str, Any] = {
        "frozen_in_files": sorted(n for n, on in frozen.items() if on),
        "frozen_not_in_files": sorted(n for n, on in frozen.items() if not on),
        "trainable_in_files": [
            n for n, p in model.named_parameters() if p.requires_grad and in_folder(p)
        ],
    }
    if changed is not None:
        out["changed_kept"] = bool(torch.equal(changed.data, expected))
    try:
        batches = iter([random_batch(spec["vocab"], batch=2, seq=16, seed=s) for s in range(8)])
        out["losses"] = [float(engine.train_batch(batches)) for _ in range(spec["steps"])]
        engine.synchronize()
    finally:
        engine.destroy()
    return out


def _noopt(spec: dict[str, Any]) -> int:
    from ds_no_optim import run_no_optim

    return run_no_optim(spec["stage"], forwards=spec["forwards"])


def main() -> None:
    spec = json.loads(sys.argv[1])
    sys.path.insert(0, os.path.dirname(__file__))
    from subprocess_helpers import single_process_group_env

    single_process_group_env()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    run = {"hf": _hf, "init": _init, "folder_lora": _folder_lora, "noopt": _noopt}[spec["case"]]
    result = run(spec)
    print("JSON:" + json.dumps(result))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
