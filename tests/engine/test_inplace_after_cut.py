"""No leaf where the user may write in place (issue 52, item 4).

A stage's input crosses a cut as a tensor that collects the gradient for the stage before it.
It used to be handed to the user's first layer as that leaf (``detach().requires_grad_()``), so
an in-place first op (``nn.ReLU(inplace=True)``) raised "a leaf Variable that requires grad is
being used in an in-place operation"; so did an in-place scaling of the loss a whole-module
model returns (Hugging Face's Trainer: ``loss *= loss_scale``). DeepSpeed hands on ordinary
tensors. Here every layering trains with plain PyTorch's losses, norms and weights when in-place
ops sit right after the cuts, including one that is not idempotent (a doubling: the input the
backward recomputes from must be the one the forward saw, not the one it overwrote).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import assert_same_weights, config, engine_for, reference_losses
from grad_scale import StepNorms
from torch import nn

GAS, STEPS = 2, 3


class Doubled(nn.Module):
    """``x *= 2`` in place: not idempotent, so a recompute from an overwritten input is seen."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2.0)


def batches(n: int, width: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(4, width, generator=g), torch.randint(0, width, (4,), generator=g))
        for _ in range(n)
    ]


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)


def _train_batch_matches_pytorch(
    model: nn.Module, forward: Callable[[nn.Module, Any], torch.Tensor], **cuts: Any
) -> None:
    """train_batch over ``model`` (with a loss_fn) equals plain PyTorch: losses, norms, weights."""
    ref = copy.deepcopy(model)
    data = batches(GAS * STEPS)
    inputs = [x.clone() for x, _ in data]
    engine = engine_for(model, config(devices=2, gas=GAS, **cuts))
    try:
        it = iter(data)
        got, norms = [], []
        for _ in range(STEPS):
            got.append(float(engine.train_batch(it)))
            norms.append(engine.get_global_grad_norm())
        engine.synchronize()
    finally:
        engine.destroy()
    for (x, _), before in zip(data, inputs, strict=True):  # the caller's batches, unchanged
        assert torch.equal(x, before)
    reference = StepNorms(adamw)
    want = reference_losses(
        ref, data, steps=STEPS, gas=GAS, make_optimizer=reference,
        loss_of=lambda m, b: F.cross_entropy(forward(m, b[0]), b[1]),
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms, reference.norms, rtol=1e-5, atol=0.0)
    assert_same_weights(model, ref)


def test_sequential_with_in_place_ops_right_after_the_cuts() -> None:
    """Blocks 0 Linear, 1 Tanh, 2 Linear, 3 Doubled, 4 Linear, 5 ReLU(inplace); head Linear.
    Forward stages [0-2] [3-5]; backward stages: the head stage (5, head), [3, 4], [0-2]. So the
    doubling starts a forward stage and the recomputed backward stage (whose input the forward
    saved), and the ReLU starts the head stage. (Each writes a Linear's output: plain PyTorch
    refuses in-place writes to a Tanh's, which its backward reads.)"""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), Doubled(), nn.Linear(8, 8),
        nn.ReLU(inplace=True), nn.Linear(8, 8),
    )  # fmt: skip
    model.loss_fn = F.cross_entropy  # type: ignore[assignment]
    _train_batch_matches_pytorch(model, lambda m, x: m(x), fwd_cuts=[3, 3], bwd_cuts=[1, 2, 3])


def test_sequential_whose_first_layer_writes_the_micro_batch_in_place() -> None:
    """The last backward stage recomputes from the micro-batch: a first layer that doubles it
    must not change it (nor the caller's batch: DeepSpeed's pipeline clones it). CPU virtual
    devices copy every upload, so this holds here without InPlaceGuard; on a GPU a batch already
    on the device is not copied, and the guard's copy is what keeps it."""
    torch.manual_seed(0)
    model = nn.Sequential(Doubled(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    model.loss_fn = F.cross_entropy  # type: ignore[assignment]
    _train_batch_matches_pytorch(model, lambda m, x: m(x.clone()), fwd_cuts=[1, 2],
                                 bwd_cuts=[1, 2])  # fmt: skip


def test_sequential_whose_head_writes_its_input_in_place() -> None:
    """The head stage holds the head alone: its input is the cut, and its layer a ReLU."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(inplace=True))
    model.loss_fn = F.cross_entropy  # type: ignore[assignment]
    _train_batch_matches_pytorch(model, lambda m, x: m(x), fwd_cuts=[2, 1], bwd_cuts=[0, 1, 2])


class _WritesItsInput(nn.Module):
    """A block that first writes its input in place: a ReLU, or a doubling."""

    def __init__(self, relu: bool) -> None:
        super().__init__()
        self.relu = relu
        self.linear = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(F.relu(h, inplace=True) if self.relu else h.mul_(2.0))


class _Stack(nn.Module):
    """Not a Sequential: traced into pieces (b), cut before each block, so each piece after the
    first starts with an in-place write of its input (a Linear's output, which plain PyTorch
    allows to be written in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(_WritesItsInput(relu=i % 2 == 0) for i in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return h


def test_traced_module_with_in_place_ops_after_the_cuts() -> None:
    """DeepSpeed's loop over a traced module model: the caller's own loss from its outputs."""
    torch.manual_seed(0)
    model = _Stack()
    ref = copy.deepcopy(model)
    data = batches(GAS * STEPS)
    engine = engine_for(model, config(devices=2, gas=GAS))
    try:
        assert engine.layering.strategy == "traced"
        got, total = [], 0.0
        for i, (x, y) in enumerate(data):
            loss = F.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += float(loss)
            if i % GAS == GAS - 1:
                got.append(total / GAS)
                total = 0.0
        engine.synchronize()
    finally:
        engine.destroy()
    want = reference_losses(
        ref, data, steps=STEPS, gas=GAS, make_optimizer=adamw,
        loss_of=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_same_weights(model, ref)


class _ReturnsLoss(nn.Module):
    """A model that returns its own loss and that runs as one whole-module layer (c)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.b(torch.tanh(self.a(x)))
        return {"loss": F.cross_entropy(logits, y), "logits": logits}


def test_in_place_scaling_of_a_whole_module_models_loss() -> None:
    """Hugging Face's Trainer scales the returned loss in place (``loss *= loss_scale``): the
    loss and outputs are ordinary tensors, and the scaling reaches the gradients (SGD: the
    weights see the gradient's scale), as under DeepSpeed."""
    torch.manual_seed(0)
    model = _ReturnsLoss()
    ref = copy.deepcopy(model)
    data = batches(GAS * STEPS)
    cfg = config(devices=2, gas=GAS)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    engine = engine_for(model, cfg)
    try:
        assert engine.layering.strategy == "whole_module", engine.layering
        for x, y in data:
            out = engine(x, y)
            loss = out["loss"]
            assert not loss.is_leaf and not out["logits"].is_leaf
            out["logits"].relu_()  # the caller may write any output in place
            loss *= 2.0
            engine.backward(loss)
            engine.step()
        engine.synchronize()
    finally:
        engine.destroy()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i, (x, y) in enumerate(data):
        (ref(x, y)["loss"] * 2.0 / GAS).backward()
        if i % GAS == GAS - 1:
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_in_place_scaling_of_a_deferred_loss() -> None:
    """A model rp_engine pipelines returns a deferred loss: ``loss *= 2`` and ``loss /= 4`` are
    recorded, and their factor reaches the gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    model.loss_fn = F.cross_entropy  # type: ignore[assignment]
    ref = copy.deepcopy(model)
    data = batches(GAS * STEPS)
    cfg = config(devices=2, gas=GAS)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    engine = engine_for(model, cfg)
    got = []
    try:
        for x, y in data:
            loss = engine(x, y)
            loss *= 2.0
            loss /= 4.0
            engine.backward(loss)
            engine.step()
            got.append(float(loss))
        engine.synchronize()
    finally:
        engine.destroy()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for i, (x, y) in enumerate(data):
        loss = F.cross_entropy(ref(x), y) * 2.0 / 4.0
        (loss / GAS).backward()
        want.append(float(loss))
        if i % GAS == GAS - 1:
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_in_place_guard_learns_which_layers_write_their_input() -> None:
    """A layer first gets a copy and its versions tell; a writer keeps getting copies; a layer
    that did not write gets the kept input itself, and a later write by it raises (the input
    kept for the recomputation would be lost) instead of training on wrong gradients."""
    from rp_engine.runtime.inplace import InPlaceGuard, versions

    guard = InPlaceGuard()

    def call(layer: int, write: bool) -> dict[str, torch.Tensor]:
        kept = {"hidden": torch.ones(3)}
        given = guard.given(layer, kept)
        before = versions(given)
        if write:
            given["hidden"].mul_(2.0)
        guard.after(layer, kept, given, before)
        assert torch.equal(kept["hidden"], torch.ones(3)) or given is kept
        return given if given is not kept else kept

    assert guard.writes(0) is None
    call(0, write=True)
    call(1, write=False)
    assert guard.writes(0) is True and guard.writes(1) is False
    assert call(0, write=True)["hidden"][0] == 2.0  # a copy again; the kept input unchanged
    call(1, write=False)
    with pytest.raises(RuntimeError, match="layer 1 wrote its input in place"):
        call(1, write=True)


_PIPELINE_SCRIPT = """
import copy, torch, torch.nn.functional as F
from subprocess_helpers import single_process_group_env
single_process_group_env()
import deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn
from engine_helpers import assert_same_weights, config, engine_for, reference_losses
from test_inplace_after_cut import Doubled, batches, adamw
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
specs = [LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 8, 8),
         LayerSpec(nn.ReLU, inplace=True), LayerSpec(nn.Linear, 8, 8), LayerSpec(Doubled),
         LayerSpec(nn.Linear, 8, 8)]
pm = PipelineModule(specs, num_stages=1, loss_fn=F.cross_entropy, partition_method="uniform")
ref = nn.Sequential(*[copy.deepcopy(f) for f in pm.forward_funcs])
data = batches(6)
engine = engine_for(pm, config(devices=2, gas=2, fwd_cuts=[3, 3], bwd_cuts=[1, 2, 3]))
it = iter(data)
got = [float(engine.train_batch(it)) for _ in range(3)]
engine.synchronize()
engine.destroy()
want = reference_losses(ref, data, steps=3, gas=2, make_optimizer=adamw,
                        loss_of=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
assert_same_weights(pm, ref)
print("PIPELINE-INPLACE-OK", got)
"""


@pytest.mark.slow  # the first DeepSpeed init_distributed on a machine compiles its shm op (~60 s)
def test_pipeline_module_with_in_place_ops_after_the_cuts() -> None:
    """A DeepSpeed PipelineModule (its layers run as a LayerSpec list's): the ReLU(inplace)
    starts a forward stage and the recomputed backward stage, the doubling the head stage. A
    subprocess: the process group and DeepSpeed's comm globals must not leak into other tests."""
    root = Path(__file__).resolve().parents[2]
    paths = [root, root / "tests" / "support", Path(__file__).resolve().parent]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in paths))
    env.setdefault(
        "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "rp_engine" / "torch_extensions")
    )
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_PIPELINE_SCRIPT)],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "PIPELINE-INPLACE-OK" in result.stdout
