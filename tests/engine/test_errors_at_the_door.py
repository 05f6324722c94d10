"""Clear errors at the door (issue 13, item 4): bad batches, bad checkpoint files and non-finite
steps say what is wrong, where, before anything breaks; random configs and batches either work
or raise the documented error naming the key or tensor."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_helpers import config, engine_for
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from models import random_batch, tiny_qwen3

from rp_engine.checkpoint.checks import CheckpointError
from rp_engine.config import load_config
from rp_engine.model.batch_checks import check_batch, vocab_size
from rp_engine.model.layers import to_layers
from rp_engine.optim.nonfinite import NonFiniteError, NonFiniteGuard
from rp_engine.optim.stepper import StepResult

VOCAB = 128


def _engine(**kw: Any) -> Any:
    model = kw.pop("model", None) or tiny_qwen3(layers=2)
    return engine_for(model, config(gas=2, mbs=2, **kw))


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    e = _engine()
    yield e
    e.destroy()


def _good(seed: int = 0, batch: int = 2) -> dict[str, torch.Tensor]:
    return random_batch(VOCAB, batch=batch, seed=seed)


def _masters(e: Any) -> list[torch.Tensor]:
    return [hp.master.clone() for hp in e.store.owned_params()]


def _weights(e: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in e.module.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        torch.allclose(x, y, rtol=0, atol=0, equal_nan=True) for x, y in zip(a, b, strict=True)
    )


# --------------------------------------------------------------------------- bad batches
BAD_BATCHES = [
    (  # the first example: a 1-D input_ids
        lambda b: {"input_ids": b["input_ids"][0], "labels": b["labels"][0]},
        r"input_ids has shape \(16,\) \(1-D\); expected 2-D \(micro_batch, seq\).*unsqueeze\(0\)",
    ),
    (  # a token id outside the vocabulary names the id and the vocabulary size
        lambda b: {"input_ids": b["input_ids"] + 200, "labels": b["labels"]},
        r"input_ids holds token id 3\d\d, but the model's vocabulary has 128 entries",
    ),
    (
        lambda b: {"input_ids": b["input_ids"] - 200, "labels": b["labels"]},
        r"input_ids holds token id -\d+; ids must be in 0..127",
    ),
    (
        lambda b: {"input_ids": b["input_ids"].float(), "labels": b["labels"]},
        r"input_ids has dtype torch.float32; expected token ids as torch.long",
    ),
    (
        lambda b: {"input_ids": b["input_ids"], "labels": b["labels"][:, :8]},
        r"labels has shape \(2, 8\); expected \(2, 16\) \(micro_batch, seq\)",
    ),
    (
        lambda b: {"input_ids": b["input_ids"], "labels": b["labels"].int()},
        r"labels has dtype torch.int32; expected torch.long",
    ),
    (
        lambda b: {"input_ids": b["input_ids"], "labels": torch.full((2, 16), 500)},
        r"labels holds 500, but each label must be -100 \(no loss\) or a token id in 0..127",
    ),
    (
        lambda b: {**b, "attention_mask": torch.ones(2, 15, dtype=torch.long)},
        r"attention_mask has shape \(2, 15\); expected \(2, 16\) \(micro_batch, seq\)",
    ),
    (
        lambda b: {**b, "labels": b["labels"].tolist()},
        r"batch\['labels'\] is a list; expected a torch.Tensor",
    ),
    (
        lambda b: {**b, "position_ids": torch.arange(16)},
        r"position_ids has shape \(16,\).*\(2, 16\) \(micro_batch, seq\) or \(1, 16\)",
    ),
    (
        lambda b: {**b, "inputs_embeds": torch.zeros(2, 16, 64)},
        r"exactly one of 'input_ids' \(or 'input'\) or 'inputs_embeds'",
    ),
]


@pytest.mark.parametrize(("make", "message"), BAD_BATCHES)
def test_bad_batch_is_named_before_device_work(
    engine: Any, make: Any, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_device_work(_spec: Any) -> Any:
        raise AssertionError("the executor ran a plan for a batch that should have been refused")

    monkeypatch.setattr(engine._executor, "run", no_device_work)
    steps, micro = engine.global_steps, engine.micro_steps
    with pytest.raises(ValueError, match=message):
        engine.train_batch(iter([_good(), make(_good(1))]))
    with pytest.raises(ValueError, match=message):
        engine(**make(_good(1)))  # the DeepSpeed loop checks at forward
    assert (engine.global_steps, engine.micro_steps) == (steps, micro)


def test_engine_trains_after_a_refused_batch_and_accepts_other_micro_batch_sizes(
    engine: Any,
) -> None:
    with pytest.raises(ValueError):
        engine.train_batch(iter([_good(), {"input_ids": _good()["input_ids"][0]}]))
    steps = engine.global_steps
    # DeepSpeed accepts any micro-batch size at forward (a loader's last batch): so do we.
    loss = engine.train_batch(iter([_good(2, batch=3), _good(3, batch=1)]))
    assert torch.isfinite(loss) and engine.global_steps == steps + 1


def test_vocab_size_comes_from_the_embedding_rows() -> None:
    model = tiny_qwen3(layers=1)
    model.resize_token_embeddings(VOCAB + 8)
    seq = to_layers(model)
    assert vocab_size(seq) == VOCAB + 8
    check_batch({"input_ids": torch.tensor([[VOCAB + 7]]), "labels": torch.tensor([[1]])}, seq)


# --------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def saved(engine: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("ckpt"))
    engine.train_batch(iter([_good(4), _good(5)]))
    engine.save_checkpoint(path, tag="good")
    return path


def _copy(src: str, dst: str) -> str:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("which", ["mp_rank_00_model_states.pt", "optim_states.pt"])
def test_truncated_checkpoint_names_the_file(
    engine: Any, saved: str, tmp_path: Any, which: str
) -> None:
    folder = _copy(saved, str(tmp_path / "c"))
    name = next(n for n in os.listdir(os.path.join(folder, "good")) if n.endswith(which))
    path = os.path.join(folder, "good", name)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    before = _weights(engine)
    with pytest.raises(CheckpointError, match=rf"{name}.*(truncated|not a complete).*interrupted"):
        engine.load_checkpoint(folder)
    assert _same(before, _weights(engine))


def test_checkpoint_of_another_shape_names_file_and_tensor_and_changes_nothing(
    saved: str,
) -> None:
    other = _engine(model=tiny_qwen3(layers=2, vocab=VOCAB * 2))
    try:
        before = _weights(other)
        with pytest.raises(
            CheckpointError,
            match=r"mp_rank_00_model_states.pt' does not fit this Qwen3ForCausalLM: 2 tensor\(s\) "
            r"of another shape \(.*embed_tokens.weight: checkpoint \(128, 64\), model \(256, 64\)",
        ):
            other.load_checkpoint(saved)
        # torch's load_state_dict used to copy the tensors that fit before raising
        assert _same(before, _weights(other))
        with pytest.raises(CheckpointError, match="Missing key.*layers.2"):
            deeper = _engine(model=tiny_qwen3(layers=3))
            try:
                deeper.load_checkpoint(saved)
            finally:
                deeper.destroy()
    finally:
        other.destroy()


def test_checkpoint_dtype_differences(
    saved: str, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _copy(saved, str(tmp_path / "c"))
    path = os.path.join(folder, "good", "mp_rank_00_model_states.pt")
    state = torch.load(path, weights_only=True)
    e = _engine(bf16={"enabled": True})
    try:
        # another floating precision loads (cast), and says so naming the file
        with caplog.at_level(logging.WARNING, logger="rp_engine.checkpoint"):
            e.load_checkpoint(folder)
        assert "mp_rank_00_model_states.pt" in caplog.text
        assert "torch.float32 -> torch.bfloat16" in caplog.text
        # integer data for a floating weight (e.g. a quantised file) is refused
        key = "model.layers.0.mlp.up_proj.weight"
        state["module"][key] = state["module"][key].to(torch.int8)
        torch.save(state, path)
        with pytest.raises(CheckpointError, match=rf"{key}: checkpoint torch.int8, model"):
            e.load_checkpoint(folder)
    finally:
        e.destroy()


# --------------------------------------------------------------------------- non-finite steps
def _nan_model() -> torch.nn.Module:
    model = tiny_qwen3(layers=2)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.fill_(float("nan"))
    return model


def test_nan_weights_raise_by_default_naming_step_and_micro_batch() -> None:
    e = _engine(model=_nan_model())
    try:
        masters = _masters(e)
        with pytest.raises(NonFiniteError, match=r"step 1: non-finite loss in micro-batch\(es\) 0"):
            e.train_batch(iter([_good(), _good(1)]))
        assert _same(masters, _masters(e))
        assert (e.global_steps, e.skipped_steps, e.was_step_applied()) == (1, 1, False)
    finally:
        e.destroy()


def _all_ignored(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # a micro-batch whose labels are all -100: its loss is 0/0 = NaN (as in Hugging Face)
    return {**b, "labels": torch.full_like(b["labels"], -100)}


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_raise_leaves_weights_untouched_and_engine_usable(async_optimizer: bool) -> None:
    e = _engine(async_optimizer=async_optimizer)
    try:
        e.train_batch(iter([_good(), _good(1)]))
        e.synchronize()
        masters, weights = _masters(e), _weights(e)
        with pytest.raises(NonFiniteError, match=r"step 2: .*micro-batch\(es\) 1 \(loss nan\)"):
            e.train_batch(iter([_good(2), _all_ignored(_good(3))]))
        e.synchronize()
        assert _same(masters, _masters(e)) and _same(weights, _weights(e))
        assert (e.global_steps, e.skipped_steps) == (2, 1)
        loss = e.train_batch(iter([_good(4), _good(5)]))
        e.synchronize()
        assert torch.isfinite(loss) and e.was_step_applied() and e.global_steps == 3
        assert all(torch.isfinite(m).all() for m in _masters(e))
        assert not _same(masters, _masters(e))
    finally:
        e.destroy()


def test_deepspeed_loop_raises_at_the_boundary_step() -> None:
    e = _engine()
    try:
        masters = _masters(e)
        e.backward(e(**_good()))
        e.step()  # not a boundary
        e.backward(e(**_all_ignored(_good(1))))
        with pytest.raises(NonFiniteError, match=r"step 1: .*micro-batch\(es\) 1"):
            e.step()
        assert _same(masters, _masters(e)) and e.micro_steps == 2 and e.global_steps == 1
        e.backward(e(**_good(2)))
        e.step()
        e.backward(e(**_good(3)))
        e.step()
        assert e.was_step_applied() and e.skipped_steps == 1
    finally:
        e.destroy()


def test_skip_warns_and_ignore_applies(caplog: pytest.LogCaptureFixture) -> None:
    e = _engine(model=_nan_model(), roundpipe={"on_nonfinite": "skip"})
    try:
        masters = _masters(e)
        with caplog.at_level(logging.WARNING, logger="rp_engine"):
            loss = e.train_batch(iter([_good(), _good(1)]))
        assert not torch.isfinite(loss) and e.skipped_steps == 1
        assert "step 1: non-finite loss" in caplog.text and _same(masters, _masters(e))
    finally:
        e.destroy()
    e = _engine(model=_nan_model(), roundpipe={"on_nonfinite": "ignore"})
    try:
        e.train_batch(iter([_good(), _good(1)]))
        assert e.skipped_steps == 0 and e.was_step_applied()
    finally:
        e.destroy()


def test_guard_judges_the_gradient_norm_and_leaves_fp16_to_the_loss_scaler() -> None:
    guard = NonFiniteGuard("raise", fp16=False)
    guard.observe([1.0, 2.0], first_microbatch=4, gas=2)
    assert not guard.force_skip()
    guard.conclude(7, StepResult(7, float("inf"), overflow=True))
    with pytest.raises(
        NonFiniteError, match=r"step 7: non-finite gradient norm \(every micro-batch"
    ):
        guard.raise_failed()
    guard.raise_failed()  # raised once
    assert not NonFiniteGuard("raise", fp16=True).active
    assert not NonFiniteGuard("ignore", fp16=False).active
    with pytest.raises(ValueError, match="on_nonfinite"):
        NonFiniteGuard("warn", fp16=False)


def test_on_nonfinite_config_key() -> None:
    base = config()
    assert load_config(base).roundpipe.on_nonfinite == "raise"
    with pytest.raises(ValueError, match=r"roundpipe.on_nonfinite.*raise.*skip.*ignore"):
        load_config({**base, "roundpipe": {"on_nonfinite": "warn"}})


# --------------------------------------------------------------------------- property tests
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 70000) | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=6,
)
_KEYS = [
    ("train_batch_size",),
    ("train_micro_batch_size_per_gpu",),
    ("gradient_accumulation_steps",),
    ("gradient_clipping",),
    ("steps_per_print",),
    ("optimizer", "type"),
    ("optimizer", "params", "lr"),
    ("scheduler",),
    ("fp16", "enabled"),
    ("fp16", "loss_scale"),
    ("bf16", "enabled"),
    ("zero_optimization", "stage"),
    ("roundpipe", "devices"),
    ("roundpipe", "on_nonfinite"),
    ("roundpipe", "head_chunk_tokens"),
    ("roundpipe", "fwd_cuts"),
    ("roundpipe", "round_size"),
    ("no_such_key",),
]


@settings(max_examples=150, deadline=None)
@given(
    edits=st.lists(
        st.tuples(st.sampled_from(_KEYS), _JSON | st.sampled_from(["raise", "skip", "cpu:2"])),
        min_size=1,
        max_size=3,
    )
)
def test_random_configs_parse_or_name_the_key(edits: list[tuple[tuple[str, ...], Any]]) -> None:
    cfg = json.loads(json.dumps(config()))
    for path, value in edits:
        node = cfg
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[path[-1]] = value
    try:
        load_config(cfg)
    except ValueError as exc:  # ConfigError is a ValueError
        names = {k for path, _ in edits for k in path} | {
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
        }
        assert any(n in str(exc) for n in names), str(exc)


_DTYPES = [torch.int64, torch.int32, torch.uint8, torch.float32, torch.bool]


@st.composite
def _tensors(draw: st.DrawFn, *, low: int, high: int) -> torch.Tensor:
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
    dtype = draw(st.sampled_from(_DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    t = torch.randint(low, high, tuple(shape), generator=gen)
    return t.to(dtype) if dtype != torch.uint8 else t.clamp(0, 255).to(dtype)


@st.composite
def _batches(draw: st.DrawFn) -> dict[str, Any]:
    b, t = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    good = random_batch(VOCAB, batch=b, seq=t, seed=draw(st.integers(0, 99)))
    batch: dict[str, Any] = dict(good)
    for key in draw(st.sets(st.sampled_from(["input_ids", "labels", "attention_mask"]))):
        batch[key] = draw(_tensors(low=-101, high=VOCAB + 3))
    if draw(st.booleans()):
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    return batch


@pytest.fixture(scope="module")
def tiny_seq() -> Any:
    return to_layers(tiny_qwen3(layers=1))


def _short_mask() -> dict[str, Any]:
    """Found by hypothesis: a (1, 1) mask over 2 tokens, which the model broadcasts."""
    batch = dict(random_batch(VOCAB, batch=1, seq=2, seed=0))
    batch["attention_mask"] = torch.ones(1, 1, dtype=torch.long)
    return batch


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=_batches())
@example(batch=_short_mask())
def test_random_batches_pass_and_run_or_are_refused_naming_the_tensor(
    tiny_seq: Any, batch: dict[str, Any]
) -> None:
    """The checks are exact: a batch they accept runs through the model (plain autograd, the
    same layers the engine runs), and one they refuse names the tensor and would have failed."""
    try:
        check_batch(batch, tiny_seq)
    except ValueError as exc:
        assert any(k in str(exc) for k in batch), str(exc)
        named = str(exc).split()[0]
        ids = batch.get("input_ids")
        if (
            named in ("labels", "attention_mask")
            and isinstance(ids, torch.Tensor)
            and tuple(batch[named].shape) != tuple(ids.shape)
        ):
            # a mask or labels not shaped like the tokens: torch may broadcast it (a (1, 1)
            # mask over 2 tokens runs), which masks the wrong positions: refused on purpose
            return
        try:
            loss = tiny_seq.run_reference(batch)
        except Exception:  # noqa: BLE001 - any failure shows the refusal was needed
            return
        # runs, but only to a meaningless NaN (an empty micro-batch): refusing it is right
        assert not torch.isfinite(loss), f"refused a batch the model runs: {exc}"
        return
    tiny_seq.run_reference(batch)  # accepted: must run (a NaN loss is on_nonfinite's job)


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(batch=_batches())
def test_random_batches_on_a_real_engine(engine: Any, batch: dict[str, Any]) -> None:
    try:
        loss = engine.train_batch(iter([_good(), batch]))
    except ValueError as exc:
        assert any(k in str(exc) for k in batch), str(exc)
    except NonFiniteError as exc:  # e.g. every label -100: step skipped, engine usable
        assert "step" in str(exc) and "micro-batch" in str(exc)
    else:
        assert loss.dim() == 0
