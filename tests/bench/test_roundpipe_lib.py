"""The RoundPipe library as a head-to-head system (benchmarks/roundpipe_lib.py) runs on GPUs only;
what CPU can check is checked here: the arguments it is given (from the one ds_config), the
skipped row and notes on CPU, the loss comparison with rp_engine, the time budget, and, where
the carried wheel is present (.whl/, benchmarks/gpu_check.sh), that the library's signatures
take those arguments and that its Qwen3 preset, adapted to this transformers, computes the
model's own loss and gradients."""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from benchmarks import roundpipe_lib
from benchmarks.common import PRESETS, ds_config
from benchmarks.head_to_head import (
    _append_jsonl,
    aggregate,
    format_table,
    lib_loss_agreement,
    run_child,
    run_system,
)

ROOT = Path(__file__).resolve().parents[2]
WHEELS = sorted((ROOT / ".whl").glob("roundpipe-*.whl"))
BEARTYPE = sorted((ROOT / ".whl").glob("beartype-*.whl"))


def _args(**kw: object) -> argparse.Namespace:
    base = dict(model="tiny", warmup=1, steps=1, devices="cpu:2", pcie_gbps=None,
                calibrate=False, timeout=None, child_log=None)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_lib_config_takes_the_other_systems_settings_from_the_ds_config() -> None:
    preset = PRESETS["qwen3-1.7b"]
    ds = ds_config(preset, devices=None, pcie_gbps=None)
    cfg = roundpipe_lib.lib_config(preset, ds)
    json.dumps(cfg)  # it goes into the JSON row as is
    # micro-batch 4 x GAS 4: one forward_backward over 16 sequences in 4 micro-batches,
    # each micro-batch's mean scaled to the window's mean
    assert cfg["run_config"] == {"num_microbatch": 4}
    assert cfg["sequences_per_call"] == 16 and cfg["loss_scale"] == 0.25
    opt = cfg["optimizer"]
    assert opt["lr"] == ds["optimizer"]["params"]["lr"] == 1e-4
    assert opt["betas"] == list(ds["optimizer"]["params"]["betas"]) == [0.9, 0.95]
    # DeepSpeed's CPU Adam defaults for an AdamW section without them (rp_engine reads the same)
    assert opt["eps"] == 1e-8 and opt["weight_decay"] == 0.0 and opt["decoupled_weight_decay"]
    assert cfg["gradient_clipping"] == ds["gradient_clipping"] == 1.0
    assert cfg["param_dtype"] == "bfloat16" and cfg["wrap"]["optim_dtype"] == "float32"
    assert cfg["is_async"]  # compared with rp_engine async
    # the budget: the library's own 0.6 x card memory on a 24 GiB card, and a 24 GiB cap
    assert cfg["model_memory_limit_gib"] == pytest.approx(0.6 * 24) and cfg["memory_cap_gib"] == 24
    tiny_preset = PRESETS["tiny"]
    tiny_ds = ds_config(tiny_preset, devices=None, pcie_gbps=None)
    tiny = roundpipe_lib.lib_config(tiny_preset, tiny_ds)
    assert tiny["param_dtype"] == "float32" and tiny["model_memory_limit_gib"] is None
    assert any("model_memory_limit" in d for d in roundpipe_lib.differences(preset, ds))
    assert not any(
        "model_memory_limit" in d for d in roundpipe_lib.differences(tiny_preset, tiny_ds)
    )


def test_on_cpu_roundpipe_lib_is_a_skipped_row_with_its_reason_and_notes(tmp_path: Path) -> None:
    # explicit CPU devices: the parent skips it without starting a process
    row = run_child("roundpipe_lib", _args())
    assert row["skipped"] == roundpipe_lib.SKIP_REASON and row["differences"]
    # no devices named (the child decides): the child's run_system skips without CUDA
    got = run_system("roundpipe_lib", dict(PRESETS["tiny"]), _args(devices=None))
    assert got == row
    lines = tmp_path / "h2h.jsonl"
    _append_jsonl(str(lines), "tiny", 0, row)
    assert json.loads(lines.read_text())["skipped"].startswith("needs CUDA")
    systems = aggregate({"roundpipe_lib": [row]})
    assert systems["roundpipe_lib"] == {k: v for k, v in row.items() if k != "system"}
    table = format_table({"systems": systems, "ratios": {}})
    assert "| roundpipe_lib | skipped: needs CUDA" in table
    assert "Notes:\n- roundpipe_lib:\n  - one forward_backward per step" in table


def test_lib_losses_are_compared_with_rp_engine_async() -> None:
    systems = {"roundpipe": {"step_losses": [2.0, 1.0]},
               "roundpipe_lib": {"step_losses": [2.0, 1.005]}}  # fmt: skip
    fp32 = lib_loss_agreement(systems)
    assert fp32["checked"] and not fp32["ok"] and fp32["against"] == "roundpipe"
    bf16 = lib_loss_agreement(systems, fp32=False)  # a sanity bound: rounding differs
    assert bf16["ok"] and bf16["max_rel"] == pytest.approx(0.005)
    assert not lib_loss_agreement({"roundpipe": systems["roundpipe"]})["checked"]
    note = format_table({"systems": {}, "ratios": {}, "lib_loss_agreement": bf16})
    assert "roundpipe_lib vs roundpipe losses: max relative difference 5.00e-03" in note


def test_a_spent_time_budget_skips_a_system_without_starting_it() -> None:
    start = time.monotonic()
    row = run_child("torch", _args(deadline=time.monotonic() + 5))
    assert row["skipped"].startswith("no time left") and time.monotonic() - start < 1


def _signatures(wheel: Path) -> dict[str, set[str]]:
    """Parameter names of the library's functions ``Class.method`` / ``function``, read from
    the wheel's source (importing roundpipe needs a GPU)."""
    out: dict[str, set[str]] = {}
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if not name.startswith("roundpipe/") or not name.endswith(".py"):
                continue
            tree = ast.parse(zf.read(name))
            for node in ast.walk(tree):
                owners = [(node.name, node.body)] if isinstance(node, ast.ClassDef) else []
                for owner, body in owners or [("", tree.body)]:
                    for fn in body:
                        if isinstance(fn, ast.FunctionDef):
                            a = fn.args
                            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                            key = f"{owner}.{fn.name}" if owner else fn.name
                            out.setdefault(key, set()).update(names)
    return out


@pytest.mark.skipif(not WHEELS, reason="the roundpipe wheel is not carried in .whl/")
def test_the_libraries_signatures_take_the_arguments_we_pass() -> None:
    sig = _signatures(WHEELS[-1])
    preset = PRESETS["qwen3-1.7b"]
    cfg = roundpipe_lib.lib_config(preset, ds_config(preset, devices=None, pcie_gbps=None))
    # wrap_model_to_roundpipe forwards the rest to RoundPipe(...) through the preset
    assert {"use_sequential_preset", "model_run_config", "name"} <= sig["wrap_model_to_roundpipe"]
    assert {"optim_dtype", "pin_model", "name", "model_run_config"} <= sig["RoundPipe.__init__"]
    assert set(cfg["run_config"]) | {"execute_plan"} <= sig["RoundPipeRunConfig.__init__"]
    assert set(cfg["optimizer"]) <= sig["Adam.__init__"]
    assert {"input_kwargs", "loss_fn", "run_config"} <= sig["RoundPipe.forward_backward"]
    assert {"step_fn", "is_async"} <= sig["RoundPipeBase.step"]
    assert {"model_memory_limit"} <= sig["ModelExecutePlan.auto"]
    assert "optim_parameters" in {k.split(".")[-1] for k in sig}


_PRESET_CHECK = r"""
import os, sys, types, zipfile
os.environ["RPP_DISABLE_TORCH_COMPILE"] = "1"  # CPU: its compiled loss in eager mode
site = sys.argv[1]
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(site)
sys.path.insert(0, site)
# roundpipe's __init__ and scheduler read GPU memory at import: load its modules under a
# stand-in package, with the planner's default memory patched in first
pkg = types.ModuleType("roundpipe")
pkg.__path__ = [os.path.join(site, "roundpipe")]
sys.modules["roundpipe"] = pkg
import roundpipe.device as device
device.get_min_gpu_memory = lambda: 24.0
import torch
from roundpipe.models import qwen3
from benchmarks.common import PRESETS, batches, build_model
from benchmarks.roundpipe_lib import adapt_qwen3_preset

preset = PRESETS["tiny"]
batch = batches(preset, 1)[0]
ref = build_model(preset)
ref_loss = ref(**batch).loss
ref_loss.backward()
model = build_model(preset)
changed = adapt_qwen3_preset(qwen3, model)
assert changed and adapt_qwen3_preset(qwen3, model) == [], changed  # idempotent
model.loss_function = qwen3.CompileForCausalLMLoss  # what the preset's wrap_model sets
stages = [qwen3.Qwen3ForCausalLMPrefix(model)]
stages += [qwen3.Qwen3ForCausalLMWrappedLayer(layer) for layer in model.model.layers]
stages.append(qwen3.Qwen3ForCausalLMPostfix(model))
x = stages[0](**batch)
for stage in stages[1:]:
    x = stage(x)
x.loss.backward()
torch.testing.assert_close(x.loss.detach(), ref_loss.detach())
for (name, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
    torch.testing.assert_close(b.grad, a.grad, msg=name)
print("OK", changed)
"""


@pytest.mark.skipif(not (WHEELS and BEARTYPE), reason="the roundpipe wheel is not in .whl/")
def test_the_adapted_qwen3_preset_computes_the_models_loss_and_gradients(tmp_path: Path) -> None:
    """roundpipe 0.1.1's preset was written for transformers 4.x; adapted, its stages run as
    one model on this transformers and give the model's loss and every gradient (CPU, fp32,
    without the library's runtime, which needs a GPU)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-c", _PRESET_CHECK, str(tmp_path), str(WHEELS[-1])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
