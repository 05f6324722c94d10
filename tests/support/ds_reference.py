"""Run real DeepSpeed (ZeRO-3, params + optimizer offloaded to CPU) on a tiny model; print JSON.

Used by test_deepspeed_parity.py in a subprocess (DeepSpeed needs a process group, which must
not leak into the test process). Records per micro-step: the loss, backward's return value, the
counters and get_lr() after step().
"""

from __future__ import annotations

import json
import os
import sys

import torch


def record(engine, batches, *, backward_ret) -> list[dict]:
    rows = []
    for batch in batches:
        out = engine(**batch)
        ret = backward_ret(engine, out.loss)
        engine.step()
        rows.append(
            {
                "loss": float(out.loss.detach()),
                "backward": float(ret),
                "micro_steps": engine.micro_steps,
                "global_steps": engine.global_steps,
                "global_samples": engine.global_samples,
                "lr": [float(x) for x in engine.get_lr()],
                "applied": bool(engine.was_step_applied()),
                "boundary_next": bool(engine.is_gradient_accumulation_boundary()),
            }
        )
    return rows


def main() -> None:
    spec = json.loads(sys.argv[1])
    sys.path.insert(0, os.path.dirname(__file__))
    from subprocess_helpers import single_process_group_env

    single_process_group_env()
    import deepspeed
    from models import random_batch, tiny_qwen3

    model = tiny_qwen3(0, layers=spec["layers"])
    batches = [
        random_batch(spec["vocab"], batch=spec["mbs"], seq=spec["seq"], seed=100 + i)
        for i in range(spec["micro_batches"])
    ]
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=spec["config"]
    )
    rows = record(engine, batches, backward_ret=lambda e, loss: e.backward(loss))
    print("JSON:" + json.dumps(rows))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
