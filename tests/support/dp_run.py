"""One side of a data-parallel comparison: train a tiny model on a fixed global batch sequence.

Run as ``python dp_run.py '<spec JSON>'`` (one process) or under ``torchrun --nproc_per_node N``
(data parallel): each rank takes its contiguous share of every step's global micro-batches, so
both see the same global batch. Spec keys: ``steps``, ``global_gas`` (micro-batches per step
over all ranks), ``async``, ``clip``, ``save_dir`` / ``save_at`` (checkpoint after that step),
``load_dir`` (resume from its latest), ``out`` (folder for ``weights_rank{r}.pt``),
``timeout_s`` (process-group timeout), ``stall_rank`` (that rank stops taking part after
initialize: the others' collectives time out), ``seq`` / ``hidden`` / ``layers`` (model and
batch size, for benchmarks/studies/dp_scaling.py), ``imperative`` (DeepSpeed's forward / backward /
step loop instead of ``train_batch``). Rank 0 prints ``JSON:{...}`` (losses, step times).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
from engine_helpers import config
from models import random_batch, tiny_qwen3

import rp_engine

VOCAB = 128


def main(spec: dict) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        timeout = datetime.timedelta(seconds=float(spec.get("timeout_s", 120)))
        rp_engine.init_distributed("gloo", timeout=timeout)
    rank = int(os.environ.get("RANK", "0"))
    gas = spec["global_gas"] // world
    seq, hidden, layers = spec.get("seq", 16), spec.get("hidden", 64), spec.get("layers", 2)
    cfg = config(
        devices=1, gas=gas, mbs=2, lr=1e-2, fwd_cuts=[layers], bwd_cuts=[0, layers],
        async_optimizer=spec.get("async", False), clip=spec.get("clip", 0.0),
    )  # fmt: skip
    dataset = [random_batch(VOCAB, seed=i)["input_ids"][0] for i in range(8)]
    model = tiny_qwen3(0, layers=layers, hidden=hidden, vocab=VOCAB)
    engine, _, loader, _ = rp_engine.initialize(model=model, config=cfg, training_data=dataset)
    sampler = loader.sampler
    result: dict = {
        "dp_world_size": engine.dp_world_size,
        "train_batch_size": engine.train_batch_size(),
        "sampler": [sampler.num_replicas, sampler.rank],
        "global_rank": engine.global_rank,
    }
    if spec.get("stall_rank") == rank:
        time.sleep(float(spec["timeout_s"]) * 3)  # alive but never joining a collective
        os._exit(0)
    start = 0
    if spec.get("load_dir"):
        engine.load_checkpoint(spec["load_dir"])
        start = engine.global_steps
    losses: list[float] = []
    seconds: list[float] = []
    try:
        for step in range(start, spec["steps"]):
            first = step * spec["global_gas"] + rank * gas
            mine = range(first, first + gas)
            batches = iter([random_batch(VOCAB, seq=seq, seed=1000 + i) for i in mine])
            t0 = time.perf_counter()
            if spec.get("imperative"):  # DeepSpeed's loop; the mean of the ranks' step losses
                step_losses = []
                for batch in batches:
                    loss = engine(**batch).loss
                    engine.backward(loss)
                    engine.step()
                    step_losses.append(loss)  # read after the window: it runs as one schedule
                mean = sum(float(x) for x in step_losses) / len(step_losses)
                losses.append(engine._dp_mean(mean))
                result.setdefault("grad_norms", []).append(engine.get_global_grad_norm())
            else:
                losses.append(float(engine.train_batch(batches)))  # (averaged over the ranks)
            seconds.append(time.perf_counter() - t0)
            if spec.get("save_dir") and engine.global_steps == spec.get("save_at"):
                engine.save_checkpoint(spec["save_dir"])
    except Exception as exc:  # the timeout test reports the message
        result["error"] = f"{type(exc).__name__}: {exc}"
    result.update(
        losses=losses,
        step_seconds=seconds,
        tokens_per_step_per_process=gas * 2 * seq,
        global_steps=engine.global_steps,
        global_samples=engine.global_samples,
    )
    inner = engine.optimizer.optimizer  # which layers' Adam state this rank holds
    result["state_layers"] = sorted(
        {hp.layer for hp in engine.store.owned_params() if inner.state.get(hp.master)}
    )
    result["owners"] = engine.stepper.dp.owners if engine.stepper.dp else None
    if "error" not in result and spec.get("out"):
        weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        torch.save(weights, Path(spec["out"]) / f"weights_rank{rank}.pt")
    if "error" not in result:
        engine.destroy()
    if rank == 0:
        print("JSON:" + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # a timed-out peer's threads must not keep this process alive


if __name__ == "__main__":
    # the deepspeed launcher passes --local_rank=N (launch/all_gpus.sh puts it after the script)
    main(json.loads([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]))
