"""Shared by the NVMe tier tests: configs with the tiers, training, and reading the results.

``weights_of`` reads the module's weights inside ``store.materialized``: with the parameter tier
the module's paged parameters own no memory between steps (storage/param_tier.py).
"""

from __future__ import annotations

import copy
from typing import Any

import prebuild
import pytest
import torch
from engine_helpers import engine_for
from models import random_batch

from rp_engine.storage.io_engine import aio_op_built

STEPS = 4


def nvme_config(
    cfg: dict[str, Any], folder: str, *, engine: str = "threads", buffers: int = 2,
    params: bool = False, optimizer: bool = True, max_in_cpu: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """``cfg`` with the optimizer tier (2 buffers for 6 layers: it must read) and, with
    ``params``, the parameter tier (nothing kept in RAM by ``max_in_cpu`` by default), both
    under ``folder``."""
    out = copy.deepcopy(cfg)
    zero: dict[str, Any] = {"stage": 3}
    if optimizer:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": folder, "buffer_count": buffers}
    if params:
        zero["offload_param"] = {
            "device": "nvme", "nvme_path": folder, "buffer_count": buffers,
            "max_in_cpu": max_in_cpu,
        }  # fmt: skip
    out["zero_optimization"] = zero
    out["roundpipe"]["nvme_io_engine"] = engine
    return out


def batches(step: int, gas: int) -> list[dict[str, torch.Tensor]]:
    return [random_batch(128, batch=2, seq=12, seed=100 * step + i) for i in range(gas)]


def train(engine: Any, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        data = batches(engine.global_steps + 1, engine.gradient_accumulation_steps())
        losses.append(float(engine.train_batch(iter(data))))
    return losses


def weights_of(engine: Any) -> dict[str, torch.Tensor]:
    """Copies of the module's newest weights (read from the tiers when they live there)."""
    engine.synchronize()
    with engine.store.materialized(writable=False):
        return {k: v.clone() for k, v in engine.module.state_dict().items()}


def run(model: torch.nn.Module, cfg: dict[str, Any], steps: int = STEPS) -> tuple[list, dict]:
    """Losses, final weights, last-step stats and, per tier present, its I/O totals, swap
    file size and path (``io``: the optimizer tier, ``param_io``: the parameter tier,
    ``grad_io``: the gradient tier)."""
    engine = engine_for(model, cfg)
    try:
        losses = train(engine, steps)
        engine.synchronize()
        out: dict[str, Any] = {"stats": engine.last_step_stats()}
        tiers = (
            ("io", engine.nvme_tier), ("param_io", engine.param_tier),
            ("grad_io", engine.grad_tier),
        )  # fmt: skip
        for key, tier in tiers:
            out[key] = (
                {"stats": tier.stats, "disk": tier.disk_bytes, "path": tier.path} if tier else {}
            )  # counted before weights_of reads the files whole
        out["weights"] = weights_of(engine)
    finally:
        engine.destroy()
    return losses, out


def save_after(model: torch.nn.Module, cfg: dict, folder: str, steps: int) -> list[float]:
    engine = engine_for(model, cfg)
    try:
        losses = train(engine, steps)
        engine.save_checkpoint(folder)
    finally:
        engine.destroy()
    return losses


def resume_from(model: torch.nn.Module, cfg: dict, folder: str, steps: int) -> tuple[list, dict]:
    engine = engine_for(model, cfg)
    try:
        engine.load_checkpoint(folder)
        losses = train(engine, steps)
        weights = weights_of(engine)
    finally:
        engine.destroy()
    return losses, weights


def save_and_go_on(model: torch.nn.Module, cfg: dict, folder: str) -> tuple[list, dict]:
    """The run that saves after 2 steps and trains 3 more in the same engine (with the async
    optimizer a save drains, so this, not a run that never saved, is what a resume equals)."""
    engine = engine_for(model, cfg)
    try:
        losses = train(engine, 2)
        engine.save_checkpoint(folder)
        losses += train(engine, 3)
        weights = weights_of(engine)
    finally:
        engine.destroy()
    return losses, weights


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def aio_engine() -> str:
    """ "aio", or a skip saying why DeepSpeed's aio op cannot run here (after its background
    build under `make test` ended: tests/support/prebuild.py)."""
    prebuild.wait("aio")
    if not aio_op_built():
        pytest.skip(
            "DeepSpeed's aio op is not built here (needs libaio-dev; `make aio` builds it "
            "when it can, `make test` runs it): the built-in engine's cases cover the tier"
        )
    return "aio"
