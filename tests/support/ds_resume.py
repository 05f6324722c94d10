"""Resume a checkpoint with DeepSpeed's own engine on CPU and continue training; print JSON.

Used by test_checkpoint_interop.py in a subprocess (DeepSpeed needs a process group, which must
not leak into the test process). Usage: ``python ds_resume.py '<spec json>'`` with spec
``{"config": name, "zero": {extra zero_optimization keys}, "load": dir, "layers": L, "hidden": H,
"vocab": V, "tie": bool, "seeds": [...], "state_out": file, "load_optimizer_states": bool}``: builds a tiny Qwen3 (weights from another seed, so only the checkpoint can
make it match) with ``ds_checkpoints.config(name)``, ``engine.load_checkpoint(load)`` (optimizer
and scheduler states included), ``torch.save``s what DeepSpeed's ZeRO optimizer then holds (its
flat fp32 partitions and the inner optimizer's per-partition state) to ``state_out``, and trains
one step per seed. Prints ``JSON:{"global_steps": n, "client_state": {...}, "loss_scale": s,
"losses": [...], "lr": [...]}``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch


def _zero_state(engine: Any) -> dict[str, Any]:
    """DeepSpeed's flat fp32 partitions and the inner optimizer's state of each, in order."""
    opt = engine.optimizer
    if not hasattr(opt, "loss_scaler"):  # stage 0 fp32: the torch optimizer on the parameters
        params = [p for g in opt.param_groups for p in g["params"]]
        first = opt.state[params[0]]
        state = {
            k: torch.cat([opt.state[p][k].reshape(-1) for p in params])
            if isinstance(v, torch.Tensor) and v.shape == params[0].shape
            else v
            for k, v in first.items()
        }
        return {"flats": [torch.cat([p.detach().reshape(-1) for p in params])], "state": [state]}
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3
        flats = list(opt.fp32_partitioned_groups_flat)
    else:  # ZeRO-1/2
        flats = list(opt.single_partition_of_fp32_groups)
    inner = opt.optimizer.state
    return {
        "flats": [f.detach().clone() for f in flats],
        "state": [
            {
                k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                for k, v in inner.get(f, {}).items()
            }
            for f in flats
        ],
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    sys.path.insert(0, os.path.dirname(__file__))
    from subprocess_helpers import single_process_group_env

    single_process_group_env()
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from ds_checkpoints import config
    from models import random_batch, tiny_qwen3

    # As in ds_checkpoints.py: DeepSpeed refuses fp16 on a CPU without mkldnn fp16; torch
    # computes fp16 on CPU anyway.
    get_accelerator().is_fp16_supported = lambda: True  # type: ignore[method-assign]

    model = tiny_qwen3(
        99, layers=spec["layers"], hidden=spec["hidden"], vocab=spec["vocab"], tie=spec["tie"]
    )
    cfg = config(spec["config"])
    cfg["zero_optimization"] = {**cfg["zero_optimization"], **spec.get("zero", {})}
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    path, client = engine.load_checkpoint(
        spec["load"], load_optimizer_states=spec.get("load_optimizer_states", True)
    )
    assert path is not None, f"DeepSpeed found no checkpoint in {spec['load']}"
    torch.save(_zero_state(engine), spec["state_out"])
    scaler = getattr(engine.optimizer, "loss_scaler", None)  # none at stage 0 fp32
    report: dict[str, Any] = {
        "global_steps": engine.global_steps,
        "client_state": {k: v for k, v in client.items() if isinstance(v, int | float | str)},
        "loss_scaler": {
            k: v
            for k, v in (vars(scaler) if scaler is not None else {}).items()
            if isinstance(v, int | float | bool)
        },
        "losses": [],
    }
    for seed in spec["seeds"]:
        batch = random_batch(spec["vocab"], batch=2, seq=8, seed=seed)
        out = engine(**{k: v.to(engine.device) for k, v in batch.items()})
        engine.backward(out.loss)
        engine.step()
        report["losses"].append(float(out.loss.detach().float()))
    report["lr"] = [float(x) for x in engine.get_lr()]
    report["global_steps_after"] = engine.global_steps
    engine.destroy()
    print("JSON:" + json.dumps(report))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
