"""Two gaps DeepSpeed's own unit tests show (issue 40, item 4), closed as DeepSpeed behaves.

Containers of tensors as call arguments: ``engine([x, y])``, ``engine({"a": x})``, tuples, any
pytree, move leaf by leaf and are rebuilt on the device (model/module.py), through the traced
split (b) and the whole module (c), in training and evaluation; a traced tuple crossing a cut
moves too. ``initialize`` without an optimizer: a forward-only engine (optim/build.py), which
returns None as the optimizer and the scheduler, keeps no masters, evaluates and checkpoints,
and refuses ``backward`` / ``step`` / ``train_batch`` as DeepSpeed's asserts do.

References are plain PyTorch; ``test_deepspeed_agrees`` runs real DeepSpeed 0.19.8 once, in a
child process (this file run as a script: DeepSpeed needs a process group, which must not leak
into the test process).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import assert_same_weights, config, engine_for, reference_losses
from torch import nn

import rp_engine
from rp_engine.model.batches import BatchAdapter
from rp_engine.model.layers import to_layers
from rp_engine.model.module import Tree, _call_args, module_batch

GAS, STEPS = 2, 2
WARMUP = {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}  # ignored without an optimizer


# --- models -------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class ListTraced(nn.Module):
    """DeepSpeed's test shape: ``forward`` takes a list of tensors and returns several outputs;
    repeated blocks, so the engine traces and splits it (b)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.out = nn.Linear(8, 4)

    def forward(self, xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = xs
        h = self.inp(x)
        for block in self.blocks:
            h = block(h) + y  # y, read from the list, crosses every cut
        return self.out(h), h.pow(2).mean()


class ListWhole(nn.Module):
    """The same call with nothing to split at: the whole module (c)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = xs
        h = torch.tanh(self.a(x)) + y
        return self.b(h), h.pow(2).mean()


class DictModel(nn.Module):
    """A dict holding a tuple, a keyword tuple holding a plain int; returns a dict of a tensor
    and a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(8, 4)

    def forward(self, batch: dict[str, Any], pair: tuple[torch.Tensor, int]) -> dict[str, Any]:
        h = batch["x"]
        scale, shift = batch["affine"]
        for block in self.blocks:
            h = block(h) * scale + shift
        h = h + pair[0] * pair[1]
        return {"logits": self.out(h), "aux": (h.mean(), h.pow(2).mean())}


class ChunkModel(nn.Module):
    """A traced tuple (``torch.chunk``'s) crossing the cuts: each later piece reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        parts = torch.chunk(h, 2, dim=-1)
        for i, block in enumerate(self.blocks):
            h = block(h) + torch.cat([parts[i % 2], parts[(i + 1) % 2]], dim=-1)
        return self.out(h)


class PairLoss(nn.Module):
    """``forward(x, y)`` returning its loss (what ``train_batch`` / ``eval_batch`` feed)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.b(torch.tanh(self.a(x))), y)


class OptionalLabels(nn.Module):
    """``forward(x, y=None)``: the loss with labels, else the logits; so a lone ``(x, y)``
    binds whole, and only the feed says it is two arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.b(torch.tanh(self.a(x)))
        return logits if y is None else F.cross_entropy(logits, y)


def list_batches(n: int, seed: int = 1) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            [torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)],
            torch.randint(0, 4, (4,), generator=g),
        )
        for _ in range(n)
    ]


def list_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits, aux = out
    return F.cross_entropy(logits, target) + aux


def train_loop(engine: Any, batches: list[Any], loss_of: Any, call: Any) -> list[float]:
    """DeepSpeed's loop: ``out = engine(...); loss = crit(out); backward; step``; per-step
    mean losses."""
    losses, total = [], 0.0
    for i, (inputs, target) in enumerate(batches):
        loss = loss_of(call(engine, inputs), target)
        engine.backward(loss)
        engine.step()
        total += float(loss.detach())
        if (i + 1) % GAS == 0:
            losses.append(total / GAS)
            total = 0.0
    return losses


def forward_only_config(stage: int = 0, **extra: Any) -> dict[str, Any]:
    """``config`` without its "optimizer" section: ZeRO stage 0, or 3 with parameters offloaded
    to the CPU (DeepSpeed's forward-only use)."""
    cfg = config(devices=2, gas=GAS, **extra)
    del cfg["optimizer"]
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    cfg["zero_optimization"] = zero
    return cfg


# --- containers as call arguments ----------------------------------------------------------------
def test_containers_become_leaves_and_come_back() -> None:
    """Each tensor of a container gets a state key of its own (so it moves, and is pinned, as
    any argument), the structure rides along as a ``Tree``; the call is rebuilt as given."""
    x, y, z = torch.randn(2, 3), torch.randn(2), torch.ones(1, dtype=torch.long)
    state = module_batch(([x, y], 7), {"d": {"a": z, "b": (x, None)}, "plain": [1, 2]})
    tensors = {k for k, v in state.items() if isinstance(v, torch.Tensor)}
    assert tensors == {"arg.0.0", "arg.0.1", "kw.d.0", "kw.d.1"}
    assert isinstance(state["arg.0"], Tree) and isinstance(state["kw.d"], Tree)
    assert state["arg.1"] == 7 and state["kw.plain"] == [1, 2]  # no tensor: kept as given
    assert not any(k.startswith("hidden.") for k in state)  # inputs carry no gradient
    args, kwargs = _call_args(state)
    assert args[0][0] is x and args[0][1] is y and args[1] == 7
    assert kwargs["d"]["a"] is z and kwargs["d"]["b"][0] is x and kwargs["d"]["b"][1] is None
    assert kwargs["plain"] == [1, 2] and isinstance(args[0], list)


def test_a_lone_list_is_one_argument_unless_fed_or_it_cannot_be() -> None:
    """``engine([x, y])`` calls ``forward([x, y])`` as DeepSpeed does; a micro-batch that
    ``train_batch`` / ``eval_batch`` took (PipelineEngine's ``(inputs, labels)``) is the
    positional arguments, and so is a lone tuple a ``forward(x, y)`` could not take whole."""
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    lists = BatchAdapter(to_layers(ListWhole()), torch.float32)
    assert set(lists.to_dict(([x, y],), {})) == {"arg.0", "arg.0.0", "arg.0.1"}
    pairs = BatchAdapter(to_layers(PairLoss()), torch.float32)
    for fed in (False, True):
        batch = pairs.to_dict(((x, y),), {}, fed=fed)
        assert batch["arg.0"] is x and batch["arg.1"] is y


def test_eval_batch_feeds_a_pair_as_two_arguments() -> None:
    """``eval_batch``'s micro-batch ``(x, y)`` is ``forward(x, y)`` even where ``forward``
    could take the pair whole (``y`` has a default)."""
    torch.manual_seed(0)
    model = OptionalLabels()
    data = [(b[0][0], b[1]) for b in list_batches(GAS, seed=11)]
    with torch.no_grad():
        want = sum(float(model(x, y)) for x, y in data) / GAS
    engine = engine_for(model, config(devices=2, gas=GAS))
    try:
        assert float(engine.eval_batch(iter(data))) == pytest.approx(want, rel=1e-6)
    finally:
        engine.destroy()


# pipeline.py's train_batch takes its micro-batches with engine._batch_of((b,), {}, fed=True)
# once the rewrite of the loop (issue 40, item 1) lands: remove this marker then
def test_train_batch_feeds_a_pair_as_two_arguments() -> None:
    """The same for ``train_batch``: it trains ``forward(x, y)``'s loss, as plain PyTorch."""
    torch.manual_seed(0)
    model = OptionalLabels()
    ref = copy.deepcopy(model)
    data = [(b[0][0], b[1]) for b in list_batches(GAS * STEPS, seed=13)]
    engine = engine_for(model, config(devices=2, gas=GAS))
    try:
        it = iter(data)
        got = [float(engine.train_batch(it)) for _ in range(STEPS)]
        engine.synchronize()
    finally:
        engine.destroy()
    want = reference_losses(ref, data, steps=STEPS, gas=GAS, loss_of=lambda m, b: m(*b))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_same_weights(model, ref)


@pytest.mark.parametrize(
    ("build", "strategy"), [(ListTraced, "traced"), (ListWhole, "whole_module")]
)
def test_a_list_argument_model_trains_with_deepspeeds_loop(build: Any, strategy: str) -> None:
    """``out = engine([x, y]); loss = crit(out); engine.backward(loss); engine.step()`` over a
    model returning two outputs equals plain PyTorch: losses and weights."""
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    batches = list_batches(GAS * STEPS)
    engine = engine_for(model, config(devices=2, gas=GAS))
    try:
        assert engine.layering.strategy == strategy, engine.layering
        got = train_loop(engine, batches, list_loss, lambda e, xs: e(xs))
        engine.eval()
        evaluated = engine(batches[0][0])
        engine.synchronize()
    finally:
        engine.destroy()
    want = reference_losses(
        ref, batches, steps=STEPS, gas=GAS, loss_of=lambda m, b: list_loss(m(b[0]), b[1])
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_same_weights(model, ref)
    with torch.no_grad():
        torch.testing.assert_close(evaluated, ref(batches[0][0]), rtol=1e-5, atol=1e-6)


def test_dicts_tuples_and_keywords_train_and_evaluate() -> None:
    """A dict holding a tuple, a keyword tuple with a plain int, a dict of outputs holding a
    tuple: evaluation returns the model's own structure; training equals PyTorch."""
    torch.manual_seed(0)
    model = DictModel()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)

    def inputs() -> tuple[dict[str, Any], tuple[torch.Tensor, int]]:
        batch = {
            "x": torch.randn(4, 8, generator=g),
            "affine": (torch.rand(8, generator=g) + 0.5, torch.randn(8, generator=g)),
        }
        return batch, (torch.randn(4, 8, generator=g), 3)

    batches = [(inputs(), torch.randint(0, 4, (4,), generator=g)) for _ in range(GAS * STEPS)]

    def loss_of(out: dict[str, Any], target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out["logits"], target) + out["aux"][0] + out["aux"][1]

    def call(m: Any, args: Any) -> Any:
        return m(args[0], pair=args[1])

    with torch.no_grad():
        want_out = call(ref, batches[0][0])
    engine = engine_for(model, config(devices=2, gas=GAS))
    try:
        assert engine.layering.strategy == "traced", engine.layering
        engine.eval()
        got_out = call(engine, batches[0][0])
        engine.train()
        got = train_loop(engine, batches, loss_of, call)
        engine.synchronize()
    finally:
        engine.destroy()
    assert set(got_out) == {"logits", "aux"} and isinstance(got_out["aux"], tuple)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
    want = reference_losses(
        ref, batches, steps=STEPS, gas=GAS, loss_of=lambda m, b: loss_of(call(m, b[0]), b[1])
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_same_weights(model, ref)


def test_a_traced_tuple_crossing_cuts_carries_gradient() -> None:
    """``torch.chunk``'s tuple, made in the first piece and read in the later ones, moves leaf
    by leaf (each a "hidden" key): the gradient through it reaches the first layer."""
    torch.manual_seed(0)
    model = ChunkModel()
    ref = copy.deepcopy(model)
    batches = [(x, y) for x, y in ((b[0][0], b[1]) for b in list_batches(GAS * STEPS, seed=5))]
    engine = engine_for(model, config(devices=2, gas=GAS))
    try:
        assert engine.layering.strategy == "traced", engine.layering
        assert len(engine.seq.blocks) == 3
        got = train_loop(engine, batches, F.cross_entropy, lambda e, x: e(x))
        engine.synchronize()
    finally:
        engine.destroy()
    want = reference_losses(
        ref, batches, steps=STEPS, gas=GAS, loss_of=lambda m, b: F.cross_entropy(m(b[0]), b[1])
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_same_weights(model, ref)


# --- initialize without an optimizer ------------------------------------------------------------
@pytest.mark.parametrize("stage", [0, 3])
def test_initialize_without_an_optimizer_is_forward_only(stage: int) -> None:
    """As DeepSpeed at ZeRO stage 0: None for the optimizer and the scheduler (a "scheduler"
    section is ignored without an optimizer), no learning rates; and no fp32 masters or
    gradient buffers are kept."""
    cfg = {**forward_only_config(stage), "scheduler": WARMUP}
    engine, optimizer, _, scheduler = rp_engine.initialize(model=ListTraced(), config=cfg)
    try:
        assert optimizer is None and scheduler is None
        assert engine.optimizer is None and engine.lr_scheduler is None
        assert engine.basic_optimizer is None and engine.client_optimizer is None
        assert engine.get_lr() == []
        assert engine.store.owned_params() == []
        assert sum(a.numel() for a in engine.store.grads.arenas) == 0
        assert not engine.stepper.async_mode  # nothing is stepped: nothing can be stale
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_stages_1_and_2_need_an_optimizer(stage: int) -> None:
    """DeepSpeed asserts "zero stage N requires an optimizer" at initialize; so does this."""
    with pytest.raises(AssertionError, match=f"zero stage {stage} requires an optimizer") as info:
        rp_engine.initialize(model=ListWhole(), config=forward_only_config(stage))
    assert isinstance(info.value, ValueError)
    assert '"optimizer" section' in str(info.value)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_forward_only_engine_evaluates(stage: int) -> None:
    """``engine(batch)`` in eval mode, under ``torch.no_grad`` and in training mode (DeepSpeed
    allows a forward with no backward), and ``eval_batch``, equal the model's own."""
    torch.manual_seed(0)
    model = ListTraced()
    ref = copy.deepcopy(model)
    xs = list_batches(1)[0][0]
    with torch.no_grad():
        want = ref(xs)
    engine, _, _, _ = rp_engine.initialize(model=model, config=forward_only_config(stage))
    try:
        engine.eval()
        evaluated = engine(xs)
        engine.train()
        with torch.no_grad():
            no_grad = engine(xs)
        trained = engine(xs)
        trained = (trained[0].detach(), trained[1].detach())
    finally:
        engine.destroy()
    for got in (evaluated, no_grad, trained):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, check_device=False)

    torch.manual_seed(0)
    loss_model = PairLoss()
    data = [(b[0][0], b[1]) for b in list_batches(GAS, seed=7)]
    with torch.no_grad():
        mean = sum(float(loss_model(x, y)) for x, y in data) / GAS
    engine, _, _, _ = rp_engine.initialize(model=loss_model, config=forward_only_config(stage))
    try:
        got_mean = float(engine.eval_batch(iter(data)))
    finally:
        engine.destroy()
    assert got_mean == pytest.approx(mean, rel=1e-6)


def test_need_optimizer_names_the_section_and_the_fix() -> None:
    """The check ``backward`` / ``step`` / ``train_batch`` make first: an AssertionError (as
    DeepSpeed's assert) naming DeepSpeed's own message, the missing section and the fix; silent
    on an engine that has an optimizer."""
    engine, _, _, _ = rp_engine.initialize(model=ListWhole(), config=forward_only_config())
    try:
        for call in ("backward", "step", "train_batch"):
            with pytest.raises(AssertionError) as info:
                engine._need_optimizer(call)
            message = str(info.value)
            assert isinstance(info.value, RuntimeError)
            assert f"must provide optimizer during init in order to use {call}" in message
            assert '"optimizer" section' in message and "optimizer=" in message
    finally:
        engine.destroy()
    engine = engine_for(ListWhole(), config(devices=2, gas=GAS))
    try:
        engine._need_optimizer("backward")
    finally:
        engine.destroy()


def test_backward_and_step_of_a_forward_only_engine_raise() -> None:
    """After a training-mode forward (DeepSpeed allows it), ``backward`` and ``step`` raise
    DeepSpeed's assertion, with the fix; the engine still evaluates afterwards."""
    torch.manual_seed(0)
    model = ListWhole()
    xs, target = list_batches(1)[0]
    engine, _, _, _ = rp_engine.initialize(model=model, config=forward_only_config())
    try:
        loss = list_loss(engine(xs), target)
        with pytest.raises(AssertionError, match="in order to use backward.*optimizer"):
            engine.backward(loss)
        with pytest.raises(AssertionError, match="in order to use step.*optimizer"):
            engine.step()
        engine.eval()
        with torch.no_grad():
            torch.testing.assert_close(engine(xs), model(xs), check_device=False)
    finally:
        engine.destroy()


# pipeline.py's train_batch calls engine._need_optimizer("train_batch") first once the rewrite
# of the loop (issue 40, item 1) lands: remove this marker then (strict: it fails when it passes)
def test_train_batch_of_a_forward_only_engine_raises() -> None:
    """``train_batch`` raises DeepSpeed's assertion before taking any data."""
    engine, _, _, _ = rp_engine.initialize(model=PairLoss(), config=forward_only_config())
    try:
        with pytest.raises(AssertionError, match="in order to use train_batch.*optimizer"):
            engine.train_batch(iter([]))  # nothing taken: an empty iterator would raise
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [0, 3])
def test_checkpoints_without_an_optimizer(stage: int, tmp_path: Path) -> None:
    """A forward-only engine loads a training checkpoint (inference from it) and saves its own
    as DeepSpeed does: the model-states file with ``optimizer`` None, no optim-states file;
    that checkpoint loads back (at ZeRO-3 the weights are its frozen fragments)."""
    torch.manual_seed(0)
    trained = PairLoss()
    data = [(b[0][0], b[1]) for b in list_batches(GAS, seed=9)]
    cfg = forward_only_config(stage)
    engine = engine_for(trained, {**cfg, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    try:
        engine.train_batch(iter(data))
        engine.save_checkpoint(str(tmp_path / "trained"), tag="t")
        want = {k: v.clone() for k, v in engine.module.state_dict().items()}
    finally:
        engine.destroy()

    engine, _, _, _ = rp_engine.initialize(model=PairLoss(), config=cfg)
    try:
        engine.load_checkpoint(str(tmp_path / "trained"), tag="t")
        for name, value in engine.module.state_dict().items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=0)
        engine.save_checkpoint(str(tmp_path / "inference"), tag="i")
    finally:
        engine.destroy()
    files = sorted(os.listdir(tmp_path / "inference" / "i"))
    assert len(files) == 1 and files[0].endswith("model_states.pt"), files
    saved = torch.load(tmp_path / "inference" / "i" / files[0], weights_only=False)
    assert saved["optimizer"] is None and saved["lr_scheduler"] is None

    engine, _, _, _ = rp_engine.initialize(model=PairLoss(), config=cfg)
    try:
        engine.load_checkpoint(str(tmp_path / "inference"), tag="i")
        for name, value in engine.module.state_dict().items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=0)
    finally:
        engine.destroy()


# --- real DeepSpeed -------------------------------------------------------------------------------
RP = {"devices": "cpu:2", "async_optimizer": False}  # rp_engine's section: DeepSpeed's staleness


def _ds_config(stage: int, *, gas: int = 1) -> dict[str, Any]:
    """The config both sides run (rp_engine adds its "roundpipe" section); no optimizer."""
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": stage},
    }


def _train_sgd(engine: Any, batches: list[Any]) -> list[float]:
    """DeepSpeed's loop with a list argument; every micro-batch's loss."""
    losses = []
    for xs, target in batches:
        loss = list_loss(engine(xs), target)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _deepspeed_child() -> None:
    """Run in a child process (``python this_file.py``): DeepSpeed's answers, as JSON."""
    from subprocess_helpers import single_process_group_env

    single_process_group_env()
    import deepspeed

    facts: dict[str, Any] = {}
    torch.manual_seed(0)
    cfg = {**_ds_config(0), "scheduler": WARMUP}
    engine, optimizer, _, scheduler = deepspeed.initialize(model=ListWhole(), config=cfg)
    xs, target = list_batches(1)[0]
    facts["stage0"] = {"optimizer": repr(optimizer), "scheduler": repr(scheduler),
                       "lr": engine.get_lr()}  # fmt: skip
    loss = list_loss(engine(xs), target)
    for call in ("backward", "step"):
        try:
            engine.backward(loss) if call == "backward" else engine.step()
            facts["stage0"][call] = None
        except AssertionError as e:
            facts["stage0"][call] = str(e)
    for stage in (1, 2):
        try:
            deepspeed.initialize(model=ListWhole(), config=_ds_config(stage))
            facts[f"stage{stage}"] = None
        except AssertionError as e:
            facts[f"stage{stage}"] = str(e)
    torch.manual_seed(0)
    model = ListTraced()
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config=_ds_config(0, gas=GAS),
    )  # fmt: skip
    facts["losses"] = _train_sgd(engine, list_batches(GAS * STEPS))
    facts["weights"] = {k: v.tolist() for k, v in model.state_dict().items()}
    print("JSON:" + json.dumps(facts))


@pytest.mark.slow  # one DeepSpeed import and process group (~15 s on one CPU)
def test_deepspeed_agrees() -> None:
    """Real DeepSpeed: stage 0 without an optimizer returns None (optimizer, scheduler), no
    learning rates, and asserts in ``backward`` / ``step`` with the message rp_engine quotes;
    stages 1 and 2 assert at initialize; a list-argument model returning two outputs trains
    (client SGD, GAS 2) to the losses and weights rp_engine computes."""
    here = Path(__file__).resolve()
    support, root = here.parents[1] / "support", here.parents[2]
    paths = [str(support), str(root), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    proc = subprocess.run(
        [sys.executable, str(here)], capture_output=True, text=True, env=env, timeout=1200
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON:")]
    assert proc.returncode == 0 and lines, proc.stderr[-6000:]
    ds = json.loads(lines[-1][5:])

    stage0 = ds["stage0"]
    assert stage0["optimizer"] == "None" and stage0["scheduler"] == "None" and stage0["lr"] == []
    for stage in (1, 2):
        assert ds[f"stage{stage}"] == f"zero stage {stage} requires an optimizer"
        with pytest.raises(AssertionError, match=ds[f"stage{stage}"]):
            rp_engine.initialize(model=ListWhole(), config=forward_only_config(stage))
    cfg = {**_ds_config(0), "roundpipe": RP, "scheduler": WARMUP}
    engine, optimizer, _, scheduler = rp_engine.initialize(model=ListWhole(), config=cfg)
    try:
        assert optimizer is None and scheduler is None and engine.get_lr() == stage0["lr"]
        for call in ("backward", "step"):
            with pytest.raises(AssertionError) as info:
                engine._need_optimizer(call)
            assert stage0[call] in str(info.value)
    finally:
        engine.destroy()

    torch.manual_seed(0)
    model = ListTraced()
    cfg = {**_ds_config(0, gas=GAS), "roundpipe": RP}
    engine, _, _, _ = rp_engine.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg
    )
    try:
        losses = _train_sgd(engine, list_batches(GAS * STEPS))
        engine.synchronize()
    finally:
        engine.destroy()
    torch.testing.assert_close(losses, ds["losses"], rtol=1e-5, atol=1e-6)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, torch.tensor(ds["weights"][name]), rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    torch.set_num_threads(1)
    _deepspeed_child()
