"""What ``initialize`` returns as the optimizer for a client optimizer, and what it raises for
misuse, as facts; print JSON.

``facts(initialize, case)`` builds a tiny model, calls ``initialize`` (``deepspeed.initialize``
or ``rp_engine.initialize``) with one case of client optimizer and config, and records what came
back: whether it is the client's object (or the object the client's callable built), whether
its ``.optimizer`` is, whether it is a torch AdamW, or the error raised. Run as a script it does
so for real DeepSpeed (``spec["cases"]``) in a one-rank process group: test_client_optimizer.py
compares those facts with rp_engine's, computed in the test process by the same code.
``raised(initialize, misuse, base)`` records the classes of the error a misuse raises.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

# the cases: (client optimizer kind, config additions); every config has no "optimizer" section
# except "config_only"
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "instance_stage0_fp32": ("instance", {}),
    "callable_stage0_fp32": ("callable", {}),
    "instance_bf16": ("instance", {"bf16": {"enabled": True}}),
    "instance_zero2": ("instance", {"zero_optimization": {"stage": 2}}),
    "instance_zero3_cpu_offload": (
        "instance",
        {
            "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "cpu"},
                "offload_optimizer": {"device": "cpu"},
            },
        },
    ),
    # DeepSpeed's default zero_force_ds_cpu_optimizer refuses a torch optimizer with offload
    "instance_zero3_cpu_offload_forced": (
        "instance",
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
    ),
    "config_only": ("none", {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}),
}


def case_config(case: str, base: dict[str, Any]) -> dict[str, Any]:
    """``base`` (no "optimizer" section) with the case's additions."""
    return {**base, **CASES[case][1]}


def facts(initialize: Any, case: str, base: dict[str, Any]) -> dict[str, Any]:
    """Call ``initialize`` for ``case``; the returned optimizer's relation to the client's."""
    from models import tiny_qwen3

    kind, _ = CASES[case]
    model = tiny_qwen3(0, layers=2)
    built: list[torch.optim.Optimizer] = []

    def build(params: Any) -> torch.optim.Optimizer:
        built.append(torch.optim.AdamW(params, lr=1e-3))
        return built[-1]

    client: Any = None
    if kind == "instance":
        client = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif kind == "callable":
        client = build
    try:
        engine, opt, _, _ = initialize(
            model=model, optimizer=client, model_parameters=model.parameters(),
            config=case_config(case, base),
        )  # fmt: skip
    except Exception as exc:  # the fact recorded is which error
        return {"error": type(exc).__name__}
    try:
        own = built[0] if built else client
        return {
            "error": None,
            "returned_is_client": own is not None and opt is own,
            "inner_is_client": own is not None and getattr(opt, "optimizer", None) is own,
            "is_torch_adamw": isinstance(opt, torch.optim.AdamW),
            "is_torch_optimizer": isinstance(opt, torch.optim.Optimizer),
        }
    finally:
        destroy = getattr(engine, "destroy", None)
        if destroy is not None:
            destroy()


# misuses DeepSpeed 0.19.8 asserts against: name -> (initialize kwargs but the model, config
# changes to ``base``; a None value removes the key)
MISUSES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "no_model": ({"model": None}, {}),
    "batch_mismatch": ({}, {"train_batch_size": 3}),
    "no_batch_size": ({}, {"train_micro_batch_size_per_gpu": None}),
    "zero_micro_batch": ({}, {"train_micro_batch_size_per_gpu": 0}),
    "fp16_and_bf16": ({}, {"fp16": {"enabled": True}, "bf16": {"enabled": True}}),
    "unknown_optimizer": ({}, {"optimizer": {"type": "NoSuchOptimizer", "params": {}}}),
    "bf16_master_weights_stage0": (
        {},
        {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
    ),
    "client_optimizer_not_callable": ({"optimizer": "AdamW"}, {}),
}


def raised(initialize: Any, misuse: str, base: dict[str, Any]) -> list[str] | None:
    """The class names (MRO) of what ``initialize`` raises for ``misuse``; None if nothing."""
    from models import tiny_qwen3

    kwargs, changes = MISUSES[misuse]
    cfg = {**base, **changes}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    kwargs = {"model": tiny_qwen3(0, layers=2), "config": cfg, **kwargs}
    try:
        engine, *_ = initialize(**kwargs)
    except Exception as exc:
        return [c.__name__ for c in type(exc).__mro__]
    destroy = getattr(engine, "destroy", None)
    if destroy is not None:
        destroy()
    return None


def main() -> None:
    spec = json.loads(sys.argv[1])
    sys.path.insert(0, os.path.dirname(__file__))
    from subprocess_helpers import single_process_group_env

    single_process_group_env()
    import deepspeed

    out = {
        "facts": {case: facts(deepspeed.initialize, case, spec["base"]) for case in spec["cases"]},
        "raised": {m: raised(deepspeed.initialize, m, spec["base"]) for m in spec["misuses"]},
    }
    print("JSON:" + json.dumps(out))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
