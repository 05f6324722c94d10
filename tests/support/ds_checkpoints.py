"""Write real DeepSpeed checkpoints (one per named configuration) on CPU; print JSON.

Used by test_checkpoint_safety.py in a subprocess (DeepSpeed needs a process group, which must
not leak into the test process). Usage: ``python ds_checkpoints.py '<spec json>'`` with spec
``{"out": dir, "configs": [name, ...], "layers": L, "hidden": H, "vocab": V,
"continue_seeds": [seed, ...]}``; each named configuration trains a tiny Qwen3 for one optimizer
step, saves to ``out/<name>``, then goes on for one step per continue seed (the reference for a
resumed run). Prints ``JSON:{name: {"files": {file: [unsafe globals]}, "global_steps": n,
"losses": [...], "lr": [...]}}``; the unsafe globals are those beyond PyTorch's weights_only
defaults, found by static disassembly.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

BASE: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "steps_per_print": 1000,
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 4},
    },
}
TORCH_ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}
CPU_ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
OFFLOAD_OPT = {"offload_optimizer": {"device": "cpu"}}

# name -> config beyond BASE. DeepSpeed builds FusedAdam unless the optimizer is offloaded (CPU
# Adam, prebuilt) or torch_adam is set: no extension is compiled here.
CONFIGS: dict[str, dict[str, Any]] = {
    "zero3_offload": {
        "optimizer": CPU_ADAMW,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, **OFFLOAD_OPT},
    },
    "zero2": {"optimizer": TORCH_ADAMW, "zero_optimization": {"stage": 2}},
    "fp16_dynamic": {
        "optimizer": TORCH_ADAMW,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8},
        "zero_optimization": {"stage": 1},
    },
    "bf16": {
        "optimizer": CPU_ADAMW,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, **OFFLOAD_OPT},
    },
    # Discovery only (rp_engine writes stage 0 differently: see rp_engine/checkpoint/).
    "zero0": {"optimizer": TORCH_ADAMW, "zero_optimization": {"stage": 0}},
    "zero3_bf16": {
        "optimizer": TORCH_ADAMW,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
    },  # fmt: skip
}


def config(name: str) -> dict[str, Any]:
    return {**BASE, **CONFIGS[name]}


def main() -> None:
    spec = json.loads(sys.argv[1])
    sys.path.insert(0, os.path.dirname(__file__))
    from subprocess_helpers import single_process_group_env

    single_process_group_env()
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from models import random_batch, tiny_qwen3

    # DeepSpeed refuses fp16 on a CPU without mkldnn fp16; torch computes fp16 on CPU anyway, and
    # only the files matter here.
    get_accelerator().is_fp16_supported = lambda: True  # type: ignore[method-assign]
    report: dict[str, Any] = {}
    for name in spec["configs"]:
        model = tiny_qwen3(0, layers=spec["layers"], hidden=spec["hidden"], vocab=spec["vocab"])
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config(name)
        )
        batch = random_batch(spec["vocab"], batch=2, seq=8, seed=7)
        out = engine(**{k: v.to(engine.device) for k, v in batch.items()})
        engine.backward(out.loss)
        engine.step()
        folder = os.path.join(spec["out"], name)
        engine.save_checkpoint(folder, client_state={"epoch": 3})
        files = {}
        tag_dir = os.path.join(folder, f"global_step{engine.global_steps}")
        for fname in sorted(os.listdir(tag_dir)):
            path = os.path.join(tag_dir, fname)
            files[fname] = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        report[name] = {"files": files, "global_steps": engine.global_steps, "losses": []}
        for seed in spec.get("continue_seeds", []):  # DeepSpeed's own continuation
            batch = random_batch(spec["vocab"], batch=2, seq=8, seed=seed)
            out = engine(**{k: v.to(engine.device) for k, v in batch.items()})
            engine.backward(out.loss)
            engine.step()
            report[name]["losses"].append(float(out.loss.detach().float()))
        report[name]["lr"] = [float(x) for x in engine.get_lr()]
        engine.destroy()
    print("JSON:" + json.dumps(report))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
