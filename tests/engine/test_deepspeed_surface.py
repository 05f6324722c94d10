"""DeepSpeed users' own scripts (issue 52, items 3, 5, 6, 7): the engine's DeepSpeed names, its
progress lines, a quiet save, and ``backward()`` in eval mode.

- Every public name of DeepSpeed 0.19.8's ``DeepSpeedEngine`` (its class, plus the instance
  attributes its ``__init__`` sets that scripts read, listed below as data) either works on
  ``RoundPipeEngine`` or raises ``DeepSpeedGap`` naming it (engine/ds_surface.py ``GAPS``): a
  name DeepSpeed adds shows up here as a failure. nn.Module's own names fall through to the
  user's module, as they did.
- The progress lines (``step=...``, the throughput line, the wall-clock breakdown) and the
  ZeRO-settings warning reach the terminal with the root logger untouched: checked in a child
  interpreter, because pytest's own logging plugin configures the root logger in this one.
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_same_weights, config, engine_for
from models import random_batch, tiny
from module_models import MODELS

from rp_engine.engine import RoundPipeEngine
from rp_engine.engine.ds_surface import CONFIG_ACCESSORS, GAPS, DeepSpeedGap

deepspeed_engine = pytest.importorskip("deepspeed.runtime.engine")
DeepSpeedEngine = deepspeed_engine.DeepSpeedEngine

# Instance attributes DeepSpeedEngine.__init__ sets that scripts read (by hand from
# deepspeed/runtime/engine.py 0.19.8); its internal plumbing (flatten, param_names, hooks...)
# is left out.
DEEPSPEED_INSTANCE_ATTRIBUTES = """
    module optimizer lr_scheduler client_optimizer client_lr_scheduler basic_optimizer
    training_dataloader training_data collate_fn config device monitor timers tput_timer
    engine_timers engine_timers_cache global_steps global_samples micro_steps skipped_steps
    local_rank global_rank world_size dp_world_size mp_world_size seq_dp_world_size
    sequence_parallel_size losses gradient_average enable_backward_allreduce has_moe_layers
    pipeline_parallelism inside_no_sync_ctxt dont_change_device warn_unscaled_loss
    loaded_checkpoint_dp_world_size loaded_checkpoint_mp_world_size flops_profiler
    checkpoint_engine mpu data_parallel_group dist_backend moe_layers gate_modules num_experts
    random_ltd_scheduler torch_autocast_z0_gradscaler seq_data_parallel_group
    expert_data_parallel_group all_to_all_group use_ds_comm
""".split()

LR = 1e-3


def _model(dropout: float = 0.0) -> torch.nn.Module:
    return tiny("qwen3", 0, layers=2, hidden=32, dropout=dropout)


def _batches(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return [random_batch(128, batch=2, seq=8, seed=seed + i) for i in range(n)]


@pytest.fixture(scope="module")
def engine() -> Any:
    eng = engine_for(_model(), config(devices=2, gas=2, zero_optimization={"stage": 2}))
    yield eng
    eng.destroy()


# --- item 3: the names ----------------------------------------------------------------------------
def _deepspeed_public_names() -> list[str]:
    module_names = set(dir(torch.nn.Module))
    own = [n for n in dir(DeepSpeedEngine) if not n.startswith("_") and n not in module_names]
    return sorted(set(own) | set(DEEPSPEED_INSTANCE_ATTRIBUTES))


def test_every_deepspeed_engine_name_is_answered_or_refused(engine: Any) -> None:
    answered, refused, unknown = [], [], []
    for name in _deepspeed_public_names():
        try:
            getattr(engine, name)
        except DeepSpeedGap as gap:
            assert name in GAPS and name in str(gap) and GAPS[name] in str(gap)
            refused.append(name)
            continue
        except AttributeError as exc:
            unknown.append(f"{name} ({exc})")
            continue
        assert name not in GAPS, f"{name} is in GAPS but answered"
        answered.append(name)
    assert not unknown, (
        "DeepSpeedEngine names rp_engine neither answers nor lists in ds_surface.GAPS: "
        + ", ".join(unknown)
    )
    # the table lists only names DeepSpeed has (a stale entry would hide nothing, but misleads)
    assert set(GAPS) <= set(_deepspeed_public_names())
    assert {"tput_timer", "timers", "monitor", "steps_per_print", "get_global_grad_norm"} <= set(
        answered
    )
    # DeepSpeed's names never fall through to the module (the AttributeError)
    assert "offload_states" in refused and not hasattr(engine, "offload_states")


def test_config_accessors_are_deepspeeds_own(engine: Any) -> None:
    """CONFIG_ACCESSORS holds only getters whose DeepSpeed source reads the config (and each
    other); through the engine they return what DeepSpeed computes for this config."""
    for name in sorted(CONFIG_ACCESSORS):
        src = textwrap.dedent(inspect.getsource(getattr(DeepSpeedEngine, name)))
        used = set(re.findall(r"self\.(\w+)", src)) - {"_config"}
        assert used <= CONFIG_ACCESSORS, (name, used - CONFIG_ACCESSORS)
    # stage 2: gradients partitioned, weights not; DeepSpeed's defaults otherwise
    assert engine.zero_optimization_partition_gradients() is True
    assert engine.zero_optimization_partition_weights() is False
    assert engine.zero_reduce_bucket_size() == 500_000_000
    assert engine.checkpoint_tag_validation_enabled() is True
    assert engine.flops_profiler_enabled() is False
    assert engine.get_data_types() == (torch.float32, torch.float32)
    # the ones rp_engine answers itself agree with DeepSpeed's parsing
    for name in ("steps_per_print", "wall_clock_breakdown", "dynamic_loss_scale",
                 "train_batch_size", "gradient_clipping", "zero_optimization_stage"):  # fmt: skip
        assert getattr(engine, name)() == engine._ds_view.accessor(name)(), name


def test_a_gap_names_itself_and_the_fix(engine: Any) -> None:
    with pytest.raises(AttributeError, match=r"engine\.scale: .*engine\.backward\(loss\)"):
        engine.scale(torch.tensor(1.0))
    with pytest.raises(DeepSpeedGap, match="set_train_batch_size"):
        engine.set_train_batch_size(8)


def test_tput_timer_and_timers_as_deepspeeds(engine: Any) -> None:
    """The issue's script: ``model.tput_timer.update_epoch_count()`` at the end of an epoch;
    Megatron-style ``timers(name)``; the counters DeepSpeed keeps."""
    for b in _batches(4):
        engine.backward(engine(**b))
        engine.step()
    tput = engine.tput_timer
    assert (tput.micro_step_count, tput.global_step_count) == (4, 2)
    tput.update_epoch_count()
    assert (tput.epoch_count, tput.micro_step_count) == (1, 0)
    assert tput.avg_samples_per_sec() == float("-inf")  # DeepSpeed skips the first 2 steps
    t = engine.timers("my_timer")
    t.start()
    t.stop()
    assert engine.timers("my_timer") is t and t.elapsed(reset=False) >= 0.0
    assert "my_timer" in engine.timers.get_timers()
    assert engine.get_mom() == [(0.9, 0.999)] and engine.optimizer_name() == "adamw"
    assert engine.global_samples == 8 and engine.dp_world_size == 1


# --- item 5: the progress lines, and the ZeRO warning, with logging untouched -------------------
CHILD = """
import torch
from engine_helpers import config, engine_for
from models import random_batch, tiny
from module_models import MODELS
cfg = config(devices=2, gas=2, steps_per_print=2, wall_clock_breakdown=True,
             zero_optimization={"stage": 2})
engine = engine_for(tiny("qwen3", 0, layers=2, hidden=32), cfg)
batches = [random_batch(128, batch=2, seq=8, seed=i) for i in range(12)]
losses = []
for b in batches[:8]:  # DeepSpeed's loop: 4 steps
    loss = engine(**b).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss)
it = iter(batches[8:])
engine.train_batch(it)
engine.train_batch(it)  # step 6
print("LOSSES", [float(x) for x in losses])
engine.destroy()
"""


def test_progress_lines_reach_the_terminal_with_logging_untouched() -> None:
    here = Path(__file__).resolve().parents[1] / "support"
    paths = [str(here), str(here.parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    steps = re.findall(r"^\[Rank 0\] step=(\d+), skipped=0, lr=\[0\.001\], mom=\[\(0\.9, 0\.999\)\], "
                       r"loss=([\d.]+)$", out, re.M)  # fmt: skip
    assert [int(s) for s, _ in steps] == [2, 4, 6], out
    # the step line's loss is the mean of that step's micro-batch losses (already known)
    losses = eval(re.search(r"^LOSSES (.*)$", out, re.M).group(1))  # noqa: S307
    assert float(steps[0][1]) == pytest.approx(sum(losses[2:4]) / 2, rel=1e-5)
    assert float(steps[1][1]) == pytest.approx(sum(losses[6:8]) / 2, rel=1e-5)
    # the throughput line at step 4 (DeepSpeed times from its third step on)
    assert re.search(r"^\[Rank 0\] epoch=0/micro_step=8/global_step=4, RunningAvgSamplesPerSec="
                     r"[\d.]+, CurrSamplesPerSec=[\d.]+, MemAllocated=0\.0GB", out, re.M), out  # fmt: skip
    # wall_clock_breakdown: micro timers at every step(), global ones at each boundary
    assert len(re.findall(r"^\[Rank 0\] time \(ms\) \| fwd_microstep: ", out, re.M)) == 8
    assert len(re.findall(r"^\[Rank 0\] time \(ms\) \| fwd: [\d.]+ \| bwd: ", out, re.M)) == 4
    # train_batch: PipelineEngine's line at its progress step
    assert re.search(r"^steps: 6 loss: [\d.]+ iter time \(s\): [\d.]+ samples/sec: ", out, re.M)
    # item 7: what a user must know reaches the terminal, no logging configured: the ignored
    # ZeRO settings as a WARNING on stderr, the plan as the first progress line
    assert "ZeRO partitioning settings are not used" in proc.stderr
    plan = re.search(r"^\[Rank 0\] rp_engine plan \(hf:qwen3, \d+ layers\): schedule=", out, re.M)
    assert plan is not None and plan.start() < out.index("step=2"), out


# --- item 6: no warning at save for parameters that never receive a gradient --------------------
def test_save_gives_no_warning_for_parameters_without_gradient(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    case = MODELS["linear_4_unused"]  # a Linear forward never calls: never a gradient
    eng = engine_for(case.build(0), config(devices=2, gas=1, zero_optimization={"stage": 1}))
    try:
        for i in range(2):
            batch = case.batch(i, 4)
            eng.backward(case.loss(eng(*case.inputs(batch)), batch))
            eng.step()
        caplog.clear()  # (the build may log, e.g. a wait for the CPU Adam op's build)
        with caplog.at_level(logging.WARNING, logger="rp_engine"):
            eng.save_checkpoint(str(tmp_path))
    finally:
        eng.destroy()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


# --- item 7: backward() in eval mode trains, as DeepSpeed's (dropout off) -------------------------
def test_eval_mode_backward_equals_pytorch() -> None:
    """engine.eval(); loss = engine(b); engine.backward(loss); engine.step(): DeepSpeed runs
    autograd whatever the mode, so the step is plain PyTorch's with model.eval() (dropout off:
    the dropout is large, so a step with dropout on differs far beyond the tolerance)."""
    gas, steps = 2, 2
    batches = _batches(gas * steps, seed=7)
    model, ref = _model(dropout=0.5), _model(dropout=0.5)
    engine = engine_for(model, config(devices=2, gas=gas, lr=LR))
    engine.eval()
    losses = []
    try:
        for b in batches:
            loss = engine(**b).loss
            losses.append(loss.item())  # read first, as a logging loop does
            engine.backward(loss)
            engine.step()
        with torch.no_grad():  # an eval-mode forward under no_grad stays an evaluation
            assert not engine(**batches[0]).loss.requires_grad
        assert engine.global_steps == steps
        engine.synchronize()
    finally:
        engine.destroy()
    ref.eval()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    ref_losses = []
    for i, b in enumerate(batches):
        loss = ref(**b).loss
        ref_losses.append(float(loss))
        (loss / gas).backward()
        if (i + 1) % gas == 0:
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_same_weights(model, ref)
    assert copy.deepcopy(losses) == losses  # (plain floats)


def test_eval_batch_runs_without_dropout() -> None:
    """The layers run in the module's mode: eval_batch / an eval forward of a dropout model
    equals PyTorch's eval-mode loss (the layer wrappers' own flag once stayed in training)."""
    model, ref = _model(dropout=0.5), _model(dropout=0.5).eval()
    b = _batches(1, seed=3)[0]
    engine = engine_for(model, config(devices=2, gas=1, lr=LR))
    try:
        engine.eval()
        with torch.no_grad():
            got = float(engine(**b).loss)
            want = float(ref(**b).loss)
    finally:
        engine.destroy()
    assert got == pytest.approx(want, rel=1e-5)


def test_roundpipe_engine_keeps_its_own_names() -> None:
    """The data table never shadows a name the engine defines itself."""
    own = {n for n in dir(RoundPipeEngine) if not n.startswith("_")}
    assert not own & set(GAPS), own & set(GAPS)


class _TwoLinears(torch.nn.Module):
    """Nothing repeated to split at: rp_engine falls back to the whole module as one layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), y)


def test_the_whole_module_fallback_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    from rp_engine.model.layers import to_layers

    with caplog.at_level(logging.WARNING, logger="rp_engine"):
        seq = to_layers(_TwoLinears())
    assert seq.layering is not None and seq.layering.strategy == "whole_module"
    (record,) = [r for r in caplog.records if "whole_module" in r.getMessage()]
    assert record.levelno == logging.WARNING
