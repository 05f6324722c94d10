"""Loading a checkpoint never runs code from it (rp_engine/checkpoint/safe_load.py).

- A checkpoint whose file was re-saved with an object whose ``__reduce__`` calls ``os.mkdir``
  (harmless stand-in for ``os.system``) is refused before unpickling: the directory is not
  created, the error names the file, the global and the opt-in, and the engine is unchanged.
  With ``trust_checkpoint=True`` it loads and the payload runs (which shows the test's payload
  would have run without the guard).
- Real DeepSpeed 0.19.8 checkpoints (written in one subprocess: ZeRO-3 with CPU offload, ZeRO-2,
  fp16 with dynamic loss scaling, bf16) load without the opt-in, restore DeepSpeed's fp32
  weights, Adam moments, step and loss scale, and training continues as DeepSpeed's own
  continuation (issue 18's DeepSpeed -> rp_engine direction).
- rp_engine's own files hold no global beyond PyTorch's weights_only set, except DeepSpeed's
  loss-scaler class in the optim file (allowlisted; DeepSpeed's engine needs it to resume).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_close_named, config, engine_for
from models import random_batch, tiny_qwen3
from subprocess_helpers import run_json

from rp_engine.checkpoint import model_file_name, optim_file_name, safe_load
from rp_engine.checkpoint.safe_load import DEEPSPEED_GLOBALS, UntrustedCheckpointError

MKDIR = f"{os.mkdir.__module__}.{os.mkdir.__name__}"  # "posix.mkdir" on Linux
LAYERS, HIDDEN, VOCAB = 2, 32, 64


class Payload:
    """Unpickling this calls ``os.mkdir(marker)``: the stand-in for ``os.system(...)``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


def _engine(seed: int) -> Any:
    return engine_for(
        tiny_qwen3(seed, layers=LAYERS, hidden=HIDDEN, vocab=VOCAB),
        config(devices=1, gas=1, lr=1e-2, fwd_cuts=[LAYERS], bwd_cuts=[0, LAYERS]),
    )


def _batches(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return [random_batch(VOCAB, batch=2, seq=8, seed=seed + i) for i in range(n)]


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """An rp_engine checkpoint (ZeRO-0, fp32) after one step: ``tmp_path/ckpt/global_step1``."""
    engine = _engine(0)
    try:
        engine.train_batch(iter(_batches(1)))
        engine.save_checkpoint(str(tmp_path / "ckpt"), client_state={"epoch": 2})
    finally:
        engine.destroy()
    return tmp_path / "ckpt" / "global_step1"


def _inject(path: Path, marker: Path) -> None:
    """Re-save ``path`` with one extra top-level entry holding the payload."""
    state = safe_load.load(str(path))  # memory-mapped: write a new file, then replace
    state["payload"] = Payload(marker)
    torch.save(state, path.with_suffix(".new"))
    os.replace(path.with_suffix(".new"), path)


def test_own_checkpoint_holds_no_global_beyond_the_allowlist(saved: Path) -> None:
    # The model file is plain data; the optim file holds DeepSpeed's loss-scaler object, which
    # DeepSpeed's ZeRO optimizers need when they resume it (nothing else beyond torch's set).
    assert (
        torch.serialization.get_unsafe_globals_in_checkpoint(str(saved / model_file_name(0))) == []
    )
    optim = torch.serialization.get_unsafe_globals_in_checkpoint(
        str(saved / optim_file_name(bf16=False))
    )
    assert optim == ["deepspeed.runtime.fp16.loss_scaler.LossScaler"]
    assert set(optim) <= set(DEEPSPEED_GLOBALS)


@pytest.mark.parametrize("target", ["model", "optim"])
def test_crafted_checkpoint_is_refused_then_loads_with_opt_in(
    saved: Path, tmp_path: Path, target: str
) -> None:
    marker = tmp_path / "payload-ran"
    name = model_file_name(0) if target == "model" else optim_file_name(bf16=False)
    _inject(saved / name, marker)
    engine = _engine(1)
    try:
        before = {k: v.clone() for k, v in engine.module.state_dict().items()}
        with pytest.raises(UntrustedCheckpointError) as info:
            engine.load_checkpoint(str(saved.parent))
        assert not marker.exists(), "the payload ran"
        message = str(info.value)
        assert str(saved / name) in message and MKDIR in message
        assert "trust_checkpoint=True" in message
        # refused before anything was applied: weights and counters are the fresh engine's
        assert engine.global_steps == 0
        for key, value in engine.module.state_dict().items():
            assert torch.equal(value, before[key]), key

        path, client = engine.load_checkpoint(str(saved.parent), trust_checkpoint=True)
        assert marker.is_dir(), "with the opt-in the file is unpickled fully"
        assert path == str(saved / model_file_name(0)) and engine.global_steps == 1
        assert client is not None and client["epoch"] == 2
        engine.train_batch(iter(_batches(1, seed=50)))
        assert engine.global_steps == 2
    finally:
        engine.destroy()


def test_legacy_format_file_is_refused(tmp_path: Path) -> None:
    # The pre-1.6 (non-zip) format cannot be scanned statically; the weights_only unpickler
    # still refuses it, with the same error.
    marker = tmp_path / "payload-ran"
    path = tmp_path / "legacy.pt"
    torch.save(
        {"w": torch.ones(2), "x": Payload(marker)}, path, _use_new_zipfile_serialization=False
    )
    with pytest.raises(UntrustedCheckpointError, match=MKDIR) as info:
        safe_load.load(str(path))
    assert not marker.exists() and str(path) in str(info.value)
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2)}, plain, _use_new_zipfile_serialization=False)
    assert torch.equal(safe_load.load(str(plain))["w"], torch.ones(2))


# ---------------------------------------------------------------------------------------------
# checkpoints written by DeepSpeed itself
DS_CONFIGS = ("zero3_offload", "zero2", "fp16_dynamic", "bf16")
# Three continuation steps, all with a nonzero learning rate (ds_checkpoints' warmup_min_lr > 0):
# the later losses depend on the loaded Adam moments.
CONTINUE_SEEDS = [60, 61, 62]
# Loss agreement of the resumed run with DeepSpeed's own continuation. fp16 and bf16 met 1e-4
# too on this CPU (issue 18 asks it of fp16); bf16 keeps a margin for rounding elsewhere.
LOSS_RTOL = {"zero3_offload": 1e-5, "zero2": 1e-5, "fp16_dynamic": 1e-4, "bf16": 1e-3}


@pytest.fixture(scope="module")
def deepspeed_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One subprocess writes all four (DeepSpeed's import and process group cost most)."""
    out = tmp_path_factory.mktemp("ds_ckpts")
    spec = {"out": str(out), "configs": list(DS_CONFIGS), "layers": LAYERS, "hidden": HIDDEN,
            "vocab": VOCAB, "continue_seeds": CONTINUE_SEEDS}  # fmt: skip
    return out, run_json("ds_checkpoints.py", spec)


@pytest.mark.parametrize("name", DS_CONFIGS)
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_deepspeed_checkpoint_loads_without_opt_in(
    deepspeed_checkpoints: tuple[Path, dict], name: str
) -> None:
    import ds_checkpoints
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out, report = deepspeed_checkpoints
    found = {g for globs in report[name]["files"].values() for g in globs}
    # The allowlist is exercised (DeepSpeed pickles its classes) and covers what DeepSpeed wrote.
    assert found and found <= set(DEEPSPEED_GLOBALS), found

    cfg = {
        **ds_checkpoints.config(name),
        # synchronous optimizer: DeepSpeed's step-for-step semantics (no stale weights)
        "roundpipe": {"devices": "cpu:1", "fwd_cuts": [LAYERS], "bwd_cuts": [0, LAYERS],
                      "async_optimizer": False},
    }  # fmt: skip
    engine = engine_for(tiny_qwen3(1, layers=LAYERS, hidden=HIDDEN, vocab=VOCAB), cfg)
    try:
        path, client = engine.load_checkpoint(str(out / name))
        # the loss scale (fp16: DeepSpeed's DynamicLossScaler after one step) carries over
        ds_scaler = _deepspeed_osd(out / name / "global_step1")["loss_scaler"]
        ours = engine.optimizer.loss_scaler
        for key in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"):
            if hasattr(ds_scaler, key):
                assert getattr(ours, key) == getattr(ds_scaler, key), key
        assert ours.dynamic == ds_scaler.dynamic == (name == "fp16_dynamic")
        assert path is not None and client == {"epoch": 3}
        assert engine.global_steps == report[name]["global_steps"] == 1
        # fp32 weights and Adam moments are DeepSpeed's, split per parameter
        tag = out / name / "global_step1"
        fp32 = get_fp32_state_dict_from_zero_checkpoint(str(out / name))
        flat = _deepspeed_flat_state(tag)
        names = {id(p): n for n, p in engine.module.named_parameters()}
        offset = 0
        for hp in engine.store.owned_params():  # DeepSpeed flattens in parameter order
            pname, n = names[id(hp.param)], hp.master.numel()
            assert_close_named(hp.master, fp32[pname], pname, rtol=0, atol=0)
            state = engine.optimizer.state[hp.master]
            for key in ("exp_avg", "exp_avg_sq"):
                expected = flat[key][offset : offset + n].view_as(hp.master)
                assert_close_named(state[key], expected, pname, rtol=0, atol=0)
            assert int(state["step"]) == 1, pname
            offset += n
        assert offset == flat["exp_avg"].numel()

        batches = [random_batch(VOCAB, batch=2, seq=8, seed=s) for s in CONTINUE_SEEDS]
        losses = [float(engine.train_batch(iter([b]))) for b in batches]
        engine.synchronize()
        assert engine.global_steps == 1 + len(CONTINUE_SEEDS)
        torch.testing.assert_close(losses, report[name]["losses"], rtol=LOSS_RTOL[name], atol=0)
        torch.testing.assert_close(engine.get_lr(), report[name]["lr"], rtol=1e-12, atol=0)
    finally:
        engine.destroy()


def _deepspeed_osd(tag: Path) -> dict[str, Any]:
    (optim,) = tag.glob("*optim_states.pt")
    return safe_load.load(str(optim))["optimizer_state_dict"]


def _deepspeed_flat_state(tag: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's Adam moments of the one flat fp32 group, read directly."""
    osd = _deepspeed_osd(tag)
    inner = osd.get("base_optimizer_state") or osd["optimizer_state_dict"]
    (group,) = inner["param_groups"]
    return inner["state"][group["params"][0]]


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_deepspeed_zero3_module_only_reads_weights_from_the_optim_file(
    deepspeed_checkpoints: tuple[Path, dict],
) -> None:
    # DeepSpeed's ZeRO-3 model file holds empty placeholders; its weights are in the optim file,
    # which a module-only load reads for them (DeepSpeed: zero_to_fp32), leaving the counters.
    import ds_checkpoints
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out, _ = deepspeed_checkpoints
    cfg = {
        **ds_checkpoints.config("zero3_offload"),
        "roundpipe": {"devices": "cpu:1", "fwd_cuts": [LAYERS], "bwd_cuts": [0, LAYERS]},
    }
    engine = engine_for(tiny_qwen3(1, layers=LAYERS, hidden=HIDDEN, vocab=VOCAB), cfg)
    try:
        path, _ = engine.load_checkpoint(str(out / "zero3_offload"), load_module_only=True)
        assert path is not None and engine.global_steps == 0
        fp32 = get_fp32_state_dict_from_zero_checkpoint(str(out / "zero3_offload"))
        for pname, p in engine.module.named_parameters():
            assert_close_named(p.detach(), fp32[pname], pname, rtol=0, atol=0)
        assert all(not st for st in engine.optimizer.state.values())  # no moments loaded
    finally:
        engine.destroy()
