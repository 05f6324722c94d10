"""The client's optimizer: what initialize returns, and the engine stepping the client's object.

DeepSpeed 0.19.8 facts these tests mirror (established by running it on CPU; the comparison
with real DeepSpeed is tests/interop/test_client_optimizer_parity.py):

- a torch optimizer instance with ZeRO stage 0 and fp32 comes back as the same object
  (``ds_optimizer is client``); a callable client's result comes back as is (an instance of
  the callable's class);
- with ZeRO (1-3) or fp16/bf16 DeepSpeed returns its wrapper, whose ``.optimizer`` is the
  client's object;
- ``engine.step()`` steps the client's object, so LR / param-group edits made on it (directly
  or by an LR scheduler built on it) apply to the next step.

Misuse that DeepSpeed asserts against raises here an error that is also an AssertionError
(still a ValueError/TypeError, as before).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytest
import torch
from engine_helpers import config
from models import random_batch, tiny_qwen3

import rp_engine
from rp_engine.config import load_config
from rp_engine.optim.optimizer import HostOptimizer

VOCAB = 128


def _cfg(**extra: Any) -> dict[str, Any]:
    """One CPU device, GAS 1, no "optimizer" section (the client's optimizer is the one)."""
    cfg = config(devices=1, gas=1, fwd_cuts=[2], bwd_cuts=[0, 2], **extra)
    del cfg["optimizer"]
    return cfg


def _batches(seed: int, n: int = 1) -> Any:
    return iter([random_batch(VOCAB, batch=2, seq=8, seed=seed + i) for i in range(n)])


def _weights(engine: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _masters(engine: Any) -> set[int]:
    return {id(engine.store.master_of(p)) for p in engine.module.parameters() if p.requires_grad}


def test_client_instance_is_returned_and_optimizes_the_masters() -> None:
    """DeepSpeed, stage 0 fp32: ``initialize`` returns the client's object itself."""
    model = tiny_qwen3(0, layers=2)
    client = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    engine, opt, _, _ = rp_engine.initialize(model=model, optimizer=client, config=_cfg())
    try:
        assert opt is client and type(opt) is torch.optim.AdamW
        assert engine.client_optimizer is client and engine.basic_optimizer is client
        assert engine.optimizer is client  # DeepSpeed's engine.optimizer is the same object
        assert isinstance(engine.host_optimizer, HostOptimizer)
        assert engine.host_optimizer.optimizer is client
        masters = _masters(engine)
        assert {id(p) for g in client.param_groups for p in g["params"]} == masters
        engine.train_batch(_batches(0))
        engine.synchronize()  # the step may still be in flight (overlapped iterations)
        # the real state lives in the client's object, keyed by the masters
        assert {id(p) for p in client.state} == masters
        assert all(int(s["step"]) == 1 for s in client.state.values())
    finally:
        engine.destroy()


def test_callable_client_result_is_returned() -> None:
    """DeepSpeed, stage 0 fp32: ``optimizer=lambda params: AdamW(params)`` comes back as the
    AdamW the callable built (``isinstance(ds_optimizer, torch.optim.AdamW)``)."""
    model = tiny_qwen3(0, layers=2)
    built: list[torch.optim.Optimizer] = []

    def make(params: Any) -> torch.optim.Optimizer:
        built.append(torch.optim.AdamW(params, lr=1e-3))
        return built[-1]

    engine, opt, _, _ = rp_engine.initialize(model=model, optimizer=make, config=_cfg())
    try:
        assert isinstance(opt, torch.optim.AdamW) and opt is built[0]
        assert {id(p) for g in opt.param_groups for p in g["params"]} == _masters(engine)
    finally:
        engine.destroy()


@pytest.mark.parametrize(
    "extra",
    [{"zero_optimization": {"stage": 2}}, {"bf16": {"enabled": True}}],
    ids=["zero2", "bf16"],
)
def test_wrapping_configs_return_a_wrapper_around_the_client(extra: dict[str, Any]) -> None:
    """DeepSpeed wraps with ZeRO or fp16/bf16: the wrapper's ``.optimizer`` is the client's."""
    model = tiny_qwen3(0, layers=2)
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, opt, _, _ = rp_engine.initialize(model=model, optimizer=client, config=_cfg(**extra))
    try:
        assert opt is engine.optimizer and opt.optimizer is client
        assert opt.param_groups is client.param_groups
    finally:
        engine.destroy()


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_client_lr_edit_changes_the_next_step(async_optimizer: bool) -> None:
    """``opt.param_groups[0]["lr"] = ...`` on the returned optimizer applies to the next step
    (DeepSpeed steps the client's own object): lr 0 leaves the weights where they are."""
    model = tiny_qwen3(0, layers=2)
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = _cfg(async_optimizer=async_optimizer)
    engine, opt, _, _ = rp_engine.initialize(model=model, optimizer=client, config=cfg)
    try:
        before = _weights(engine)
        engine.train_batch(_batches(0))
        moved = _weights(engine)
        assert not _same(before, moved)
        opt.param_groups[0]["lr"] = 0.0
        engine.train_batch(_batches(1))
        assert _same(moved, _weights(engine)) and engine.get_lr() == [0.0]
        opt.param_groups[0]["lr"] = 0.1
        engine.train_batch(_batches(2))
        assert not _same(moved, _weights(engine))
    finally:
        engine.destroy()


def test_scheduler_built_on_the_returned_optimizer_drives_the_lr() -> None:
    """A torch LR scheduler the user builds on the returned optimizer after initialize and steps
    after engine.step() (as with DeepSpeed) sets the LR of the engine's next step, without
    torch's "optimizer.step() overridden" / "scheduler before optimizer" warnings."""
    model = tiny_qwen3(0, layers=2)
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, opt, _, _ = rp_engine.initialize(model=model, optimizer=client, config=_cfg())
    try:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.0)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            engine.train_batch(_batches(0))
            sched.step()
        assert not [str(w.message) for w in record if "lr_scheduler" in str(w.message)]
        assert engine.get_lr() == [0.0]
        moved = _weights(engine)
        engine.train_batch(_batches(1))
        assert _same(moved, _weights(engine))  # the scheduler's lr 0 reached the step
    finally:
        engine.destroy()


def test_user_step_and_zero_grad_neither_double_step_nor_drop_gradients(caplog) -> None:
    """Under DeepSpeed ``engine.step()`` steps the optimizer; a user's own ``optimizer.step()``
    / ``zero_grad()`` on it must not step again nor clear the accumulated gradients: the run
    ends with the same weights as one that never calls them (and says so once in the log)."""

    def run(user_calls: bool) -> list[torch.Tensor]:
        model = tiny_qwen3(0, layers=2)
        client = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        cfg = _cfg()
        cfg["gradient_accumulation_steps"] = 2
        engine, opt, _, _ = rp_engine.initialize(model=model, optimizer=client, config=cfg)
        try:
            for i in range(4):  # two optimizer steps of two micro-batches
                loss = engine(**random_batch(VOCAB, batch=2, seq=8, seed=i)).loss
                engine.backward(loss)
                if user_calls:
                    opt.zero_grad()  # between micro-batches: would drop the first's gradient
                    opt.step()
                engine.step()
                if user_calls:
                    opt.step()
            return _weights(engine)
        finally:
            engine.destroy()

    with caplog.at_level(logging.WARNING, logger="rp_engine.optim"):
        called = run(True)
    assert sum("does nothing" in r.getMessage() for r in caplog.records) == 1
    assert _same(run(False), called)


def test_client_state_moves_to_the_masters() -> None:
    """State the client's object holds before initialize (stepped or loaded) stays its state,
    now keyed by the masters its groups point at."""
    model = tiny_qwen3(0, layers=2)
    client = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(**random_batch(VOCAB, batch=2, seq=8)).loss.backward()
    client.step()
    buffers = {id(p): client.state[p]["momentum_buffer"] for p in model.parameters()}
    engine, opt, _, _ = rp_engine.initialize(model=model, optimizer=client, config=_cfg())
    try:
        for p in model.parameters():
            master = engine.store.master_of(p)
            assert opt.state[master]["momentum_buffer"] is buffers[id(p)]
        assert len(opt.state) == len(buffers)
    finally:
        engine.destroy()


def test_deepspeed_cpu_adam_client_steps_layer_by_layer() -> None:
    """A DeepSpeedCPUAdam instance is returned as is (DeepSpeed does) and still steps per layer
    through its own kernel."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from rp_engine.host.jit_cache import cpu_adam_cache_dir, extensions_dir

    model = tiny_qwen3(0, layers=2)
    with extensions_dir(cpu_adam_cache_dir()):  # the cached build, not a new one
        client = DeepSpeedCPUAdam(model.parameters(), lr=1e-3)
    engine, opt, _, _ = rp_engine.initialize(model=model, optimizer=client, config=_cfg())
    try:
        assert opt is client and engine.host_optimizer.per_layer
        before = _weights(engine)
        engine.train_batch(_batches(0))
        assert not _same(before, _weights(engine))
        assert all(int(s["step"]) == 1 for s in client.state.values()) and client.state
    finally:
        engine.destroy()


def test_checkpoint_round_trip_into_a_client_optimizer(tmp_path) -> None:
    """The client's state is what a checkpoint saves, and loading restores it into the new
    engine's client object (keyed by its masters)."""

    def make() -> tuple[Any, torch.optim.Optimizer]:
        model = tiny_qwen3(0, layers=2)
        client = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        engine, opt, _, _ = rp_engine.initialize(model=model, optimizer=client, config=_cfg())
        return engine, opt

    a, opt_a = make()
    try:
        a.train_batch(_batches(0))
        a.save_checkpoint(str(tmp_path), tag="t")
        saved = [opt_a.state[p]["momentum_buffer"].clone() for p in opt_a.param_groups[0]["params"]]
    finally:
        a.destroy()
    b, opt_b = make()
    try:
        b.load_checkpoint(str(tmp_path), tag="t")
        loaded = [opt_b.state[p]["momentum_buffer"] for p in opt_b.param_groups[0]["params"]]
        assert _same(saved, loaded)
        assert {id(p) for p in opt_b.state} == _masters(b)
    finally:
        b.destroy()


# --- misuse DeepSpeed asserts against: also an AssertionError, still ValueError/TypeError ------


def test_no_model_is_an_assertion_error() -> None:
    with pytest.raises(AssertionError, match="model=") as info:
        rp_engine.initialize(config=_cfg())
    assert isinstance(info.value, ValueError)


def test_client_optimizer_of_the_wrong_type_is_an_assertion_error() -> None:
    with pytest.raises(AssertionError, match="torch.optim.Optimizer") as info:
        rp_engine.initialize(model=tiny_qwen3(0, layers=2), optimizer="AdamW", config=_cfg())
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize(
    "changes",
    [
        {"train_batch_size": 3},
        {"train_micro_batch_size_per_gpu": None},
        {"train_micro_batch_size_per_gpu": 0},
        {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
        {"optimizer": {"type": "NoSuchOptimizer"}},
        {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
        {"bf16": {"enabled": True, "bf16_optimizer_states": True}, "zero_optimization": {"stage": 1}},
    ],
    ids=[
        "batch_mismatch", "no_batch_size", "zero_micro_batch", "fp16_and_bf16",
        "unknown_optimizer", "bf16_master_weights_stage0", "bf16_states_without_master",
    ],
)  # fmt: skip
def test_config_checks_deepspeed_asserts_are_assertion_errors(changes: dict[str, Any]) -> None:
    cfg = {**_cfg(), **changes}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(AssertionError) as info:
        load_config(cfg)
    assert isinstance(info.value, ValueError)
