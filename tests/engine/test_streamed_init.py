"""A streamed initialize: with the parameter tier, the module's weights leave RAM layer by layer
as their bytes reach the file (storage/param_tier.py ``_write_initial``), not all at the end; a
failed initial write gives the layers already released back to the module."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from engine_helpers import config, engine_for
from models import tiny_qwen3
from nvme_helpers import nvme_config

from rp_engine.storage import param_tier
from rp_engine.storage.io_engine import ThreadEngine


def _cfg(folder: str) -> dict[str, Any]:
    cfg = config(devices=2, async_optimizer=True, bf16={"enabled": True})
    return nvme_config(cfg, folder, params=True)


def _in_ram(model: torch.nn.Module) -> int:
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def test_weights_leave_ram_layer_by_layer(tmp_path, monkeypatch) -> None:
    model = tiny_qwen3(0, layers=6).to(torch.bfloat16)
    monkeypatch.setattr(param_tier, "_RELEASE_BYTES", 1)  # release after every layer
    seen: list[int] = []
    real = param_tier.ParamTier._release

    def release(self: Any, layers: list[int], released: list[int]) -> None:
        real(self, layers, released)
        seen.append(_in_ram(model))

    monkeypatch.setattr(param_tier.ParamTier, "_release", release)
    before = _in_ram(model)
    engine = engine_for(model, _cfg(str(tmp_path)))
    try:
        paged = len(engine.param_tier.plan.paged)
        assert paged >= 6
        # one release per paged layer (and a last, empty one): RAM falls at each
        assert len(seen) == paged + 1
        assert all(a > b for a, b in zip([before, *seen[: paged - 1]], seen[:paged], strict=True))
        assert seen[-1] == seen[paged - 1] < before
    finally:
        engine.destroy()


def test_a_failed_initial_write_gives_the_weights_back(tmp_path, monkeypatch) -> None:
    model = tiny_qwen3(0, layers=6).to(torch.bfloat16)
    original = copy.deepcopy(model.state_dict())
    monkeypatch.setattr(param_tier, "_RELEASE_BYTES", 1)
    real = ThreadEngine._pwrite
    writes = {"params": 0}

    def pwrite(self: Any, path: str, buffer: torch.Tensor, offset: int) -> None:
        if path.endswith("params.swp"):
            writes["params"] += 1
            if writes["params"] == 7:  # layer 3, after layers 0-2 were released
                raise OSError(5, "injected write failure", path)
        real(self, path, buffer, offset)

    monkeypatch.setattr(ThreadEngine, "_pwrite", pwrite)
    with pytest.raises(OSError, match="injected write failure"):
        engine_for(model, _cfg(str(tmp_path)))
    assert writes["params"] >= 7
    for name, tensor in model.state_dict().items():
        assert tensor.untyped_storage().nbytes() > 0, f"{name} was not given back"
        assert torch.equal(tensor, original[name]), name
    assert not list(tmp_path.rglob("*.swp")), "the swap files are removed"
