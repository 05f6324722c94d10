"""Train one plain ``nn.Module`` of module_models.MODELS with REAL DeepSpeed (ZeRO-3, params and
optimizer offloaded to CPU, DeepSpeed's CPU Adam, fp32); print JSON. The reference data of issue
29 (``rp_engine.initialize`` accepting any module).

Run it in a subprocess (DeepSpeed needs a process group, which must not leak into the test
process): ``run_json("ds_module_reference.py", spec)``. The spec (all keys but "model" optional,
defaults shown)::

    {"model": name in MODELS, "micro_batches": 6, "gas": 1, "mbs": 8, "lr": 3e-2,
     "seed": 0,            # the model's seed
     "data_seed": 100,     # micro-batch i is make_batches(..., seed=data_seed)[i]
     "forward_without_backward_at": null | k,
     "save_dir": null | directory for engine.save_checkpoint at the end,
     "weights_path": null | file for the gathered fp32 parameters after training,
     "label": null | a name for the run, echoed back (several runs of one model),
     "config": null | a full DeepSpeed config replacing reference_config(gas, mbs, lr)}

With ``forward_without_backward_at = k``, micro-step k first runs an extra training-mode forward
(same inputs) whose output is discarded without a backward, then the normal forward, backward and
step. The printed line is ``JSON:`` + :func:`train_module`'s dict plus::

    "model": name, "label": spec's label or name, "config": the DeepSpeed config used,
    "param_sums": {parameter name: float sum of the full (gathered) fp32 tensor after training},
    "weights_path": null | where {parameter name: full tensor} was saved (``torch.save``),
    "checkpoint": null | {"dir": save_dir, "tag": "global_step<n>"},
    "seconds": {"import": s, "initialize": s, "train": s, "save": s}

The spec may instead be ``{"runs": [spec, ...]}``: the runs happen one after the other in the one
process (one DeepSpeed import for all; each run its own engine, destroyed after it) and the JSON
is the list of their results ("import" only in the first one's "seconds").

The same :func:`train_module` and :func:`reference_config` drive rp_engine in the tests, so both
sides run the identical loop, data and configuration.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch


def reference_config(*, gas: int = 1, mbs: int = 8, lr: float = 3e-2) -> dict[str, Any]:
    """The DeepSpeed config of the reference: ZeRO-3, params and optimizer offloaded to CPU,
    optimizer "Adam" (DeepSpeed builds its CPU Adam, AdamW mode, for an offloaded optimizer),
    fp32, no scheduler, no clipping."""
    return {
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": lr}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
        },
    }


def train_module(
    engine: Any,
    name: str,
    batches: list[tuple[torch.Tensor, ...]],
    *,
    forward_without_backward_at: int | None = None,
) -> dict[str, Any]:
    """The DeepSpeed imperative loop over ``batches`` for model ``name`` of MODELS, on any engine
    with DeepSpeed's surface: per micro-batch ``out = engine(*inputs); loss = case.loss(out,
    batch); engine.backward(loss); engine.step()``. Returns::

        {"losses": [float per micro-step],
         "global_steps": [engine.global_steps after each step()],
         "grad_norms": [engine.get_global_grad_norm() after each optimizer step],
         "final_global_steps": int,
         "discarded_loss": null | float (the extra forward's loss at forward_without_backward_at)}
    """
    from module_models import MODELS

    case = MODELS[name]
    losses: list[float] = []
    steps: list[int] = []
    norms: list[float] = []
    discarded: float | None = None
    for k, batch in enumerate(batches):
        inputs = case.inputs(batch)
        if k == forward_without_backward_at:
            # a training-mode forward whose graph is dropped unused (e.g. a metric computed
            # with the training model); DeepSpeed accepts it before the real micro-step
            discarded = float(case.loss(engine(*inputs), batch).detach())
        loss = case.loss(engine(*inputs), batch)
        engine.backward(loss)
        before = int(engine.global_steps)
        engine.step()
        losses.append(float(loss.detach()))
        steps.append(int(engine.global_steps))
        if steps[-1] != before:  # an optimizer step: its global norm (unscaled, unclipped)
            norms.append(float(engine.get_global_grad_norm()))
    return {
        "losses": losses,
        "global_steps": steps,
        "grad_norms": norms,
        "final_global_steps": int(engine.global_steps),
        "discarded_loss": discarded,
    }


def _gathered(engine: Any) -> dict[str, torch.Tensor]:
    """Copies of each full fp32 parameter (ZeRO-3 keeps only partitions: gather them first).
    Tied parameters appear once, under their first name."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {n: p.detach().clone() for n, p in params.items()}


def _probe_the_cpu_once() -> None:
    """DeepSpeed calls ``cpuinfo.get_cpu_info()`` (a ~1.2 s Python subprocess) three times per
    engine; keep its answer, as tests/conftest.py does in the test process."""
    import functools

    import cpuinfo

    probe = functools.cache(cpuinfo.get_cpu_info)
    cpuinfo.get_cpu_info = lambda: dict(probe())  # a copy: a caller may edit its dict


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One reference run (see the module docstring for ``spec`` and the result)."""
    import deepspeed
    from module_models import MODELS, make_batches

    t1 = time.perf_counter()
    name = spec["model"]
    n = spec.get("micro_batches", 6)
    mbs = spec.get("mbs", 8)
    config = spec.get("config") or reference_config(
        gas=spec.get("gas", 1), mbs=mbs, lr=spec.get("lr", 3e-2)
    )
    model = MODELS[name].build(spec.get("seed", 0))
    batches = make_batches(name, n, batch_size=mbs, seed=spec.get("data_seed", 100))
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    t2 = time.perf_counter()
    result = train_module(
        engine, name, batches, forward_without_backward_at=spec.get("forward_without_backward_at")
    )
    t3 = time.perf_counter()
    checkpoint = None
    if spec.get("save_dir"):
        engine.save_checkpoint(spec["save_dir"])
        checkpoint = {"dir": spec["save_dir"], "tag": f"global_step{engine.global_steps}"}
    t4 = time.perf_counter()
    weights = _gathered(engine)
    if spec.get("weights_path"):
        torch.save(weights, spec["weights_path"])
    result.update(
        model=name,
        label=spec.get("label", name),
        config=config,
        param_sums={n: float(p.double().sum()) for n, p in weights.items()},
        weights_path=spec.get("weights_path"),
        checkpoint=checkpoint,
        seconds={"initialize": t2 - t1, "train": t3 - t2, "save": t4 - t3},
    )
    engine.destroy()
    return result


def main() -> None:
    t0 = time.perf_counter()
    spec = json.loads(sys.argv[1])
    sys.path.insert(0, os.path.dirname(__file__))
    from subprocess_helpers import single_process_group_env

    single_process_group_env()
    import deepspeed  # noqa: F401  (timed here, not in the first run)

    _probe_the_cpu_once()
    imported = time.perf_counter() - t0
    if "runs" in spec:
        out: Any = [run_one(run) for run in spec["runs"]]
        out[0]["seconds"]["import"] = imported
    else:
        out = run_one(spec)
        out["seconds"]["import"] = imported
    print("JSON:" + json.dumps(out))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
