"""DeepSpeed's own unit test ``unit/runtime/test_ds_initialize.py::TestNoOptim::test[stage]``,
reproduced on rp_engine (DeepSpeed's tests are not shipped in its wheel).

The test builds its ``SimpleModel`` (a stack of ``nlayers`` Linear(hidden, hidden) where layer
``i`` adds ``linears[i // 2](x)``, then cross entropy against class labels) with 78 layers of
hidden size 4 inside ``deepspeed.zero.Init(enabled=stage == 3, config_dict_or_path=ds)``, calls
``initialize(model=model, config=ds)`` with no optimizer, and runs one training-mode forward per
sample of its ``random_dataloader`` (50 samples, batch ``train_micro_batch_size_per_gpu``, inputs
in the model's half dtype), with no backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

HIDDEN = 4
LAYERS = 78
SAMPLES = 50


class SimpleModel(nn.Module):
    """DeepSpeed's tests/unit/simple_model.py ``SimpleModel`` (without its empty_grad option)."""

    def __init__(self, hidden_dim: int, nlayers: int = 1) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers)])
        self.cross_entropy_loss = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if len(self.linears) == 1:
            x = self.linears[0](x)
        else:
            for i, layer in enumerate(self.linears):
                x = self.linears[i // 2](x) + layer(x)
        return self.cross_entropy_loss(x, y)


def ds_config(stage: int) -> dict[str, Any]:
    """The test's config on a CPU that has bf16 (DeepSpeed's CPU accelerator: no fp16)."""
    return {
        "train_batch_size": 1,
        "zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"}},
        "bf16": {"enabled": True},
        "roundpipe": {"devices": "cpu:2"},
    }


def run_no_optim(stage: int, *, forwards: int = SAMPLES) -> int:
    """The test's body on rp_engine; returns the number of forwards that ran. At stage 3 the
    process needs a process group (zero.Init's), at stage 0 none."""
    import deepspeed

    import rp_engine

    ds = ds_config(stage)
    with deepspeed.zero.Init(enabled=stage == 3, config_dict_or_path=ds):
        model = SimpleModel(HIDDEN, nlayers=LAYERS)
    engine, optimizer, _, scheduler = rp_engine.initialize(model=model, config=ds)
    assert optimizer is None and scheduler is None
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, HIDDEN, generator=gen).to(torch.bfloat16)
    y = torch.randint(0, HIDDEN, (SAMPLES,), generator=gen)
    ran = 0
    try:
        for k in range(forwards):
            loss = engine(x[k : k + 1], y[k : k + 1])
            assert torch.isfinite(loss.float()).all()
            ran += 1
    finally:
        engine.destroy()
    return ran
