"""A plain Accelerate loop (DeepSpeedPlugin, accumulate, save_state/load_state, get_state_dict)
on a tiny model in this process; print JSON.

``python hf_accelerate_run.py SPEC_JSON``; SPEC["backend"] is "deepspeed" or "rp_engine". The
loop trains ``steps`` optimizer steps, saves the state after ``save_after`` of them, then loads
it back and replays the remaining steps: both passes' losses are printed, and the final
``get_state_dict`` weights are saved to SPEC["weights"].
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    from subprocess_helpers import select_backend

    select_backend(spec)
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from hf_trainer_run import TokenData
    from models import tiny_qwen3

    gas = spec.get("gas", 2)
    model = tiny_qwen3(0, layers=spec.get("layers", 2))
    plugin = DeepSpeedPlugin(hf_ds_config=spec["config"], gradient_accumulation_steps=gas)
    acc = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=gas, cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.get("lr", 3e-3), weight_decay=0.01)
    loader = torch.utils.data.DataLoader(TokenData(64, 16, 128), batch_size=2, shuffle=False)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    batches = list(loader)
    per_step = gas

    def train(first: int, last: int) -> list[float]:
        losses = []
        for batch in batches[first * per_step : last * per_step]:
            with acc.accumulate(model):
                out = model(**batch)
                acc.backward(out.loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(float(out.loss.detach()))
        return losses

    steps, save_after = spec.get("steps", 4), spec.get("save_after", 2)
    first = train(0, save_after)
    acc.save_state(spec["state_dir"])
    rest = train(save_after, steps)
    acc.load_state(spec["state_dir"])
    replay = train(save_after, steps)
    state = acc.get_state_dict(model)
    torch.save({k: v.detach().clone() for k, v in state.items()}, spec["weights"])
    unwrapped = acc.unwrap_model(model)
    print(
        "JSON:"
        + json.dumps(
            {
                "losses": first + rest,
                "replay": replay,
                "unwrapped": type(unwrapped).__name__,
                "lr": [float(g["lr"]) for g in optimizer.param_groups],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
