"""A training process for the kill -9 tests (test_faults.py): run as a script, or imported.

    python fault_child.py '{"mode": "save", "dir": D, "kill_at": "files", "tag": null}'
        trains 2 steps, saves (latest -> that checkpoint), trains 2 more, starts a second save
        and blocks at ``kill_at``, after writing a marker file ``D/blocked``: the test then
        kills it with SIGKILL. kill_at: "files" (the model file written, not the optimizer's),
        "swap" (saving over the same tag: the old folder renamed aside, the new one not yet in
        place), "latest" (the new folder in place, ``latest`` not yet replaced).
    python fault_child.py '{"mode": "resume", "dir": D, "steps": 4}'
        a fresh process: load ``latest``, train ``steps`` more steps, save again; prints
        ``JSON:{"global_steps_loaded": ..., "losses": [...], "leftovers": [...]}``.

The step-k batches are a function of k only, so a resumed run sees the same data as an
uninterrupted one (``straight``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
from engine_helpers import config, engine_for
from models import random_batch, tiny_qwen3

GAS = 2


def make_engine() -> Any:
    cfg = config(devices=2, gas=GAS, lr=1e-2, fwd_cuts=[2, 2], bwd_cuts=[0, 2, 2])
    return engine_for(tiny_qwen3(0, layers=4), cfg)


def step_batches(step: int) -> list[dict[str, torch.Tensor]]:
    return [random_batch(128, batch=2, seq=12, seed=1000 * step + i) for i in range(GAS)]


def train(engine: Any, steps: int) -> list[float]:
    """Train ``steps`` more steps from the engine's current step; the losses."""
    losses = []
    for _ in range(steps):
        batches = step_batches(engine.global_steps + 1)
        losses.append(float(engine.train_batch(iter(batches))))
    return losses


def straight(steps: int) -> list[float]:
    engine = make_engine()
    try:
        return train(engine, steps)
    finally:
        engine.destroy()


def _block(folder: str) -> None:
    with open(os.path.join(folder, "blocked"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)  # the test kills this process with SIGKILL here
    raise SystemExit("fault_child: not killed")


def _arm(kill_at: str, folder: str) -> None:
    """Block the next save at ``kill_at`` (after the real work before that point)."""
    from rp_engine.checkpoint import writer

    if kill_at == "files":
        real_save = torch.save
        calls = {"n": 0}

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            real_save(obj, f, *args, **kwargs)
            calls["n"] += 1
            if calls["n"] == 1:
                f.flush()
                os.fsync(f.fileno())
                _block(folder)

        torch.save = save  # the checkpoint writer calls torch.save(obj, f)
    elif kill_at == "swap":
        real_rename = os.rename

        def rename(src: Any, dst: Any) -> None:
            real_rename(src, dst)
            if ".old-" in os.fspath(dst):
                _block(folder)

        writer.os.rename = rename  # type: ignore[attr-defined]
    elif kill_at == "latest":
        real_write = writer._write_atomic

        def write_atomic(path: str, data: bytes) -> None:
            if os.path.basename(path) == "latest":
                _block(folder)
            real_write(path, data)

        writer._write_atomic = write_atomic  # type: ignore[attr-defined]
    else:
        raise ValueError(f"kill_at={kill_at!r}")


def main(spec: dict[str, Any]) -> None:
    folder = spec["dir"]
    if spec["mode"] == "save":
        engine = make_engine()
        train(engine, 2)
        engine.save_checkpoint(folder, tag=spec.get("tag"))
        train(engine, 2)
        _arm(spec["kill_at"], folder)
        engine.save_checkpoint(folder, tag=spec.get("tag"))
        raise SystemExit("fault_child: the save was not interrupted")
    print("JSON:" + json.dumps(resume(folder, spec["steps"])))


def resume(folder: str, steps: int) -> dict[str, Any]:
    """Load ``latest`` into a new engine, train ``steps`` steps, save; what happened."""
    engine = make_engine()
    try:
        path, _ = engine.load_checkpoint(folder)
        assert path is not None, f"nothing to load in {folder}"
        loaded = engine.global_steps
        losses = train(engine, steps)
        engine.save_checkpoint(folder)
    finally:
        engine.destroy()
    leftovers = sorted(n for n in os.listdir(folder) if n.startswith("."))
    return {"global_steps_loaded": loaded, "losses": losses, "leftovers": leftovers}


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
