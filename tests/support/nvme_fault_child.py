"""A training process with the NVMe optimizer tier, for the kill -9 tests (test_nvme_faults.py):
run as a script, or imported.

Folder ``D`` holds ``D/nvme`` (the tier's ``nvme_path``), ``D/ckpt`` (the checkpoints) and the
marker ``D/blocked`` (JSON) that a blocked child writes before it sleeps, waiting for SIGKILL.

    python nvme_fault_child.py '{"mode": "writeback", "dir": D}'
        trains 2 steps, saves (``latest`` -> global_step2), trains step 3, then blocks inside
        the tier's write-back of step 4's first stepped layer: the built-in I/O engine's
        ``_pwrite`` writes the first half of that record into the swap file (on disk: fsync),
        writes the marker and sleeps. The swap file is then half old, half new.
    python nvme_fault_child.py '{"mode": "save", "dir": D}'
        trains 2 steps, saves, trains 2 more, and blocks inside the second save once its first
        file (the model states) is on disk, as fault_child.py's "files" mode does.
    python nvme_fault_child.py '{"mode": "resume", "dir": D, "steps": N}'
        a fresh process: an engine with the tier on the same ``D/nvme`` (reusing the swap file a
        killed run left there; printed at once as ``ENGINE:{"swap": path}``), loads ``latest``,
        trains ``N`` steps, destroys the engine; prints ``JSON:{"global_steps_loaded": ...,
        "losses": [...], "swap": path, "swap_left": bool, "nvme_files": [...]}``.

The step-k batches are a function of k only (as in fault_child.py), so a resumed run sees the
data of an uninterrupted one (``reference``). The optimizer is asynchronous; the I/O engine is the
built-in threads (its ``_pwrite`` is what ``writeback`` patches).
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
SAVED_AT = 2  # the checkpoint every mode resumes from


def make_engine(folder: str, params: bool = False) -> Any:
    """An engine with the NVMe tier under ``folder/nvme`` (2 buffers for 6 layers, so steps
    read their state back from the file as well as write it); ``params``: the parameter tier
    too (every layer's compute weights on NVMe)."""
    nvme = os.path.join(folder, "nvme")
    zero: dict[str, Any] = {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 2},
    }
    if params:
        zero["offload_param"] = {
            "device": "nvme", "nvme_path": nvme, "buffer_count": 2, "max_in_cpu": 0,
        }  # fmt: skip
    cfg = config(
        devices=2, gas=GAS, lr=1e-2, async_optimizer=True, fwd_cuts=[2, 2], bwd_cuts=[0, 2, 2],
        roundpipe={"nvme_io_engine": "threads"}, zero_optimization=zero,
    )  # fmt: skip
    return engine_for(tiny_qwen3(0, layers=4), cfg)


def step_batches(step: int) -> list[dict[str, torch.Tensor]]:
    return [random_batch(128, batch=2, seq=12, seed=1000 * step + i) for i in range(GAS)]


def train(engine: Any, steps: int) -> list[float]:
    """Train ``steps`` more steps from the engine's current step; the losses."""
    return [
        float(engine.train_batch(iter(step_batches(engine.global_steps + 1)))) for _ in range(steps)
    ]


def reference(folder: str, steps: int) -> list[float]:
    """The uninterrupted run's losses: ``SAVED_AT`` steps, a save (as the killed runs do: with
    the asynchronous optimizer ``save_checkpoint`` drains the step in flight, which is what a
    resume starts from), then the rest, up to ``steps`` in all."""
    engine = make_engine(folder)
    try:
        losses = train(engine, SAVED_AT)
        engine.save_checkpoint(os.path.join(folder, "ckpt"))
        return losses + train(engine, steps - SAVED_AT)
    finally:
        engine.destroy()


def _block(folder: str, **facts: Any) -> None:
    """Write the marker (``facts`` and this pid, as JSON), then wait for SIGKILL."""
    tmp = os.path.join(folder, "blocked.tmp")
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), **facts}, f)
    os.rename(tmp, os.path.join(folder, "blocked"))  # the test never reads half a marker
    time.sleep(600)  # the test kills this process with SIGKILL here
    os._exit(3)  # not killed: fail loudly (a raise on an I/O thread would only fail the step)


def _arm_writeback(folder: str, tier: Any, step: int) -> None:
    """Block ``tier``'s next write-back half-way (see the module docstring)."""
    from rp_engine.storage import io_engine

    real = io_engine.ThreadEngine._pwrite

    def pwrite(self: Any, path: str, buffer: torch.Tensor, offset: int) -> None:
        if path != tier.path:
            real(self, path, buffer, offset)
            return
        half = buffer.numel() // 2 // 4096 * 4096  # O_DIRECT: a 4 KiB multiple
        real(self, path, buffer[:half], offset)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        _block(
            folder, swap=path, disk=tier.disk_bytes, step=step, offset=offset, written=half,
            nbytes=buffer.numel(),
        )  # fmt: skip

    io_engine.ThreadEngine._pwrite = pwrite  # type: ignore[method-assign]


def _arm_save(folder: str, tier: Any) -> None:
    """Block the next save once its first file is on disk (fault_child.py's "files")."""
    real_save = torch.save
    calls = {"n": 0}

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        real_save(obj, f, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 1:
            f.flush()
            os.fsync(f.fileno())
            _block(folder, swap=tier.path, disk=tier.disk_bytes)

    torch.save = save  # the checkpoint writer calls torch.save(obj, f)


def main(spec: dict[str, Any]) -> None:
    folder = spec["dir"]
    ckpt = os.path.join(folder, "ckpt")
    if spec["mode"] == "resume":
        print("JSON:" + json.dumps(resume(folder, spec["steps"], bool(spec.get("params")))))
        return
    params = bool(spec.get("params"))
    engine = make_engine(folder, params)
    train(engine, SAVED_AT)
    engine.save_checkpoint(ckpt)
    if spec["mode"] == "writeback":
        train(engine, 1)
        engine.synchronize()  # step 3 is on disk: the next write-back is step 4's
        # the optimizer's state, or (``params``) the compute weights step 4 publishes
        _arm_writeback(folder, engine.param_tier if params else engine.nvme_tier, 4)
        train(engine, 2)
        engine.synchronize()
        raise SystemExit("nvme_fault_child: the write-back was not interrupted")
    if spec["mode"] == "save":
        train(engine, 2)
        _arm_save(folder, engine.nvme_tier)
        engine.save_checkpoint(ckpt)
        raise SystemExit("nvme_fault_child: the save was not interrupted")
    raise ValueError(f"mode={spec['mode']!r}")


def resume(folder: str, steps: int, params: bool = False) -> dict[str, Any]:
    """Load ``latest`` into a new engine with the tier(s), train ``steps`` steps; what
    happened."""
    engine = make_engine(folder, params)
    try:
        swap = engine.nvme_tier.path
        print("ENGINE:" + json.dumps({"swap": swap}), flush=True)  # before anything can crash
        path, _ = engine.load_checkpoint(os.path.join(folder, "ckpt"))
        assert path is not None, f"nothing to load in {folder}/ckpt"
        loaded = engine.global_steps
        losses = train(engine, steps)
        engine.synchronize()
    finally:
        engine.destroy()
    nvme = os.path.join(folder, "nvme")
    files = sorted(os.path.relpath(os.path.join(d, n), nvme)
                   for d, _, names in os.walk(nvme) for n in names)  # fmt: skip
    return {
        "global_steps_loaded": loaded, "losses": losses, "swap": swap,
        "swap_left": os.path.exists(swap), "nvme_files": files,
    }  # fmt: skip


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
