"""Head-to-head, in one command: rp_engine vs DeepSpeed ZeRO-Infinity vs Mobius vs plain PyTorch.

    python -m benchmarks.head_to_head --quick                    # CPU virtual devices, a few min
    python -m benchmarks.head_to_head --model qwen3-1.7b         # the GPU configuration
    python -m benchmarks.head_to_head --quick --json out.json --pcie-gbps 1

Five systems read the same model (random weights from one config and seed), data, optimizer
(AdamW lr 1e-4, betas 0.9/0.95, clipping 1.0) and one ds_config (ZeRO-3, params and optimizer
offloaded to CPU); DeepSpeed ignores its "roundpipe" section:

- ``deepspeed``: real DeepSpeed ZeRO-Infinity (stage 3, offload_param + offload_optimizer to
  CPU), ONE process (world size 1). On this 2-core machine gloo ranks (one per virtual device)
  would split the same two cores and the batch, so the single process is the faster and fairer
  DeepSpeed here. With ``--pcie-gbps`` on CPU its link traffic is charged by
  ``benchmarks.emulated_link`` (bytes per layer fetch and gradient offload, the ZeRO-Infinity
  rule); on a GPU it moves real bytes.
- ``roundpipe`` / ``roundpipe_sync``: rp_engine, asynchronous / synchronous CPU optimizer.
- ``roundpipe_auto``: ``roundpipe`` with ``"staleness_compensation": "auto"`` (rp-train's
  default), beside plain async for the compensation's cost end to end (issue 43).
- ``mobius``: rp_engine with ``"roundpipe": {"schedule": "mobius"}`` (blocks bound to devices).
- ``torch``: plain PyTorch, everything on the device (the ceiling; no recomputation).
- ``roundpipe_lib``: the RoundPipe library itself (PyPI ``roundpipe``), GPU only: its arguments
  come from the same ds_config, its differences are listed in its row and under the table
  (``benchmarks.roundpipe_lib``); on CPU it is a ``skipped`` row. Its per-step losses are
  compared with rp_engine async's (``lib_loss_agreement``).

Each system runs in its own process; the systems alternate (A B C D E, ``--repeats`` times) so
drift hits all alike; each process warms up, then times one window of steps synchronised only at
its two ends. Reported: tokens/s (median over repeats), the ratio to DeepSpeed, per-step losses
(DeepSpeed vs rp_engine sync must agree within 1e-3 relative in fp32), peak host RSS, peak device
memory, bytes moved per step, and for every rp_engine run the simulator's predicted iteration
time from each compute action timed through the executor's own path, the link model, the share
of the cores other processes left the run during its window and the per-action host overhead
measured on the same plan with a near-zero-compute model (``benchmarks.calibration``,
``executor_timing``, ``host_load``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import roundpipe_lib
from benchmarks.calibration_runs import in_engine_costs, overhead_run, plan_run
from benchmarks.common import (
    PRESETS,
    batches,
    build_model,
    child_json,
    chosen_systems,
    ds_config,
    loader_dataset,
    machine_info,
    one_rank_env,
    peak_rss,
)
from benchmarks.host_load import CoreShare

SYSTEMS = (
    "deepspeed", "roundpipe", "roundpipe_auto", "roundpipe_loop", "roundpipe_sync", "mobius",
    "torch",
    "hf_trainer", "hf_roundpipe_trainer", "roundpipe_lib",
)  # fmt: skip
RP_SYSTEMS = ("roundpipe", "roundpipe_auto", "roundpipe_loop", "roundpipe_sync", "mobius")
# transformers' Trainer with ``hf.enable()``: the plain Trainer, and RoundPipeTrainer
TRAINER_SYSTEMS = ("hf_trainer", "hf_roundpipe_trainer")
# systems that need CUDA, and why: a CPU run reports them as skipped rows, not failures
GPU_ONLY = {roundpipe_lib.SYSTEM: roundpipe_lib.SKIP_REASON}
LOSS_RTOL = 1e-3
# roundpipe_lib vs rp_engine async in bf16: two implementations round differently, so only a
# sanity bound (a mis-scaled loss or a wrong data order is off by far more)
LIB_LOSS_RTOL_BF16 = 2e-2
MIN_CHILD_S = 30.0  # with --time-budget: no system's process starts with less time left


# ---- one system, in its own process ----------------------------------------------------------
def run_system(
    system: str, preset: dict[str, Any], args: argparse.Namespace, setups: Any = None
) -> dict[str, Any]:
    """Warm up, then time ``args.steps`` steps between two synchronisations. Peak device
    memory is the window's: reset at its start, read at its end. ``setups``: the systems'
    setup functions by name (default: this module's; ``benchmarks.loss_reads`` has its own)."""
    import torch

    if system in TRAINER_SYSTEMS:
        return _run_trainer(system, preset, args)

    cuda = torch.cuda.is_available()
    if system in GPU_ONLY and not cuda:
        return skipped_row(system, GPU_ONLY[system], preset)
    data = batches(preset, (args.warmup + args.steps) * preset["gas"])
    step_fn, sync, extra, reset_peaks = (setups or SETUP)[system](preset, data, cuda, args)
    losses = []
    for _ in range(args.warmup):
        losses.append(step_fn())
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    reset_peaks()
    with CoreShare() as load:  # other processes' demand for the cores meanwhile
        start = time.perf_counter()
        for _ in range(args.steps):
            losses.append(step_fn())  # device tensors: no synchronisation inside the window
        sync()
        seconds = time.perf_counter() - start
    args.core_share = load  # the calibration's machine model takes it (extra())
    tokens = args.steps * preset["gas"] * preset["mbs"] * preset["seq"]
    row: dict[str, Any] = {
        "system": system,
        "tokens_per_s": tokens / seconds,
        "s_per_step": seconds / args.steps,
        "step_losses": [float(x) for x in losses],
        "final_loss": float(losses[-1]),
        "peak_host_gb": peak_rss() / 1e9,
        "peak_device_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "bytes_per_step": 0,
        "external_load": {"threads": load.mean_threads, "sessions": load.mean_sessions},
    }
    row.update(extra())
    return row


def _run_trainer(system: str, preset: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Hugging Face's Trainer on rp_engine (``hf.enable()``; async optimizer, the same
    ds_config and data): the plain ``Trainer`` (``hf_trainer``) or ``RoundPipeTrainer``
    (``hf_roundpipe_trainer``). A callback times the steps after the warm-up between two
    ``synchronize()`` calls, as ``run_system`` times the other systems; Trainer logs once, at
    the last step (its default logging is as rare)."""
    import tempfile

    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from rp_engine.integrations import hf

    hf.enable()
    cuda = torch.cuda.is_available()
    devices = args.devices or ("cuda" if cuda else "cpu:2")
    cfg = ds_config(preset, devices=devices, pcie_gbps=None if cuda else args.pcie_gbps)
    cfg["roundpipe"]["async_optimizer"] = True
    steps = args.warmup + args.steps
    rows = [
        {k: v[i] for k, v in b.items()}
        for b in batches(preset, steps * preset["gas"])
        for i in range(preset["mbs"])
    ]
    cls = hf.RoundPipeTrainer if system == "hf_roundpipe_trainer" else Trainer
    window: dict[str, float] = {}

    class Window(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, _args: Any, state: Any, control: Any, **_kw: Any) -> None:
            if state.global_step in (args.warmup, steps):
                engine = trainer.model_wrapped.roundpipe_engine
                engine.synchronize()
                window[str(state.global_step)] = time.perf_counter()
                if state.global_step == args.warmup:  # the window's peaks from here
                    if cuda:
                        torch.cuda.reset_peak_memory_stats()
                    for device in engine.pool.devices:
                        device.reset_peak()

    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out, deepspeed=cfg, per_device_train_batch_size=preset["mbs"],
            gradient_accumulation_steps=preset["gas"], max_steps=steps, learning_rate=1e-4,
            adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, lr_scheduler_type="constant",
            warmup_steps=0, logging_steps=steps, report_to=[], save_strategy="no",
            use_cpu=not cuda, disable_tqdm=True, bf16=preset["dtype"] == "bf16",
            train_sampling_strategy="sequential", seed=0,
        )  # fmt: skip
        trainer = cls(model=build_model(preset), args=targs, train_dataset=rows,
                      callbacks=[Window()])  # fmt: skip
        with CoreShare() as load:
            trainer.train()
    seconds = window[str(steps)] - window[str(args.warmup)]
    tokens = args.steps * preset["gas"] * preset["mbs"] * preset["seq"]
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    engine = trainer.model_wrapped.roundpipe_engine
    stats = engine.last_step_stats()
    pool_peak = max(d.memory_stats().get("peak", 0) for d in engine.pool.devices) / 1e9
    return {
        "system": system,
        "tokens_per_s": tokens / seconds,
        "s_per_step": seconds / args.steps,
        "step_losses": losses,
        "final_loss": losses[-1],
        "peak_host_gb": peak_rss() / 1e9,
        "peak_device_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else pool_peak,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "bytes_per_step": stats.get("h2d_bytes", 0) + stats.get("d2h_bytes", 0),
        "external_load": {"threads": load.mean_threads, "sessions": load.mean_sessions},
        "last_step": stats,
    }


def _nothing() -> None:
    """A system's window-start hook when torch's own peak reset covers it."""


def _torch(preset: dict, data: list, cuda: bool, args: argparse.Namespace) -> tuple:
    """The ceiling: everything on the device, AMP bf16 where configured, no recomputation."""
    import torch

    dev = torch.device("cuda" if cuda else "cpu")
    model = build_model(preset).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=cuda)
    it = iter(data)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=preset["dtype"] == "bf16")

    def step() -> Any:
        total = 0.0
        for _ in range(preset["gas"]):
            batch = {k: v.to(dev, non_blocking=True) for k, v in next(it).items()}
            with amp:
                loss = model(**batch).loss / preset["gas"]
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    return step, sync, dict, _nothing


def _deepspeed(preset: dict, data: list, cuda: bool, args: argparse.Namespace) -> tuple:
    import torch

    one_rank_env()
    import deepspeed

    from benchmarks.emulated_link import EmulatedZeroLink

    model = build_model(preset)
    link = None
    if args.pcie_gbps and not cuda:
        inner = model.model
        modules = [inner.embed_tokens, *inner.layers, model.lm_head]
        size = 2 if preset["dtype"] == "bf16" else 4
        link = EmulatedZeroLink.over(modules, size, args.pcie_gbps)
    cfg = ds_config(preset, devices=None, pcie_gbps=None)
    cfg.pop("roundpipe")
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    it = iter(data)
    dev = engine.device
    steps = 0

    def step() -> Any:
        nonlocal steps
        total = 0.0
        for _ in range(preset["gas"]):
            batch = {k: v.to(dev) for k, v in next(it).items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            if link is not None:
                link.wait_gradients()  # the step and the next micro-batch need the offload
            engine.step()
            total += loss.detach() / preset["gas"]
        steps += 1
        return total

    def extra() -> dict[str, Any]:
        if link is None:
            return {}
        per_step = (link.h2d_bytes + link.d2h_bytes) / max(steps, 1)
        return {"bytes_per_step": per_step, "bytes_modelled": True}

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    return step, sync, extra, _nothing


def roundpipe_setup(
    async_optimizer: bool,
    schedule: str,
    *,
    loop: bool = False,
    compensation: str | None = None,
    read: str | None = None,
    engine_loader: bool = False,
) -> Any:
    """rp_engine's setup: ``train_batch`` per step, or with ``loop`` DeepSpeed's own loop
    (``engine(batch); engine.backward(loss); engine.step()`` per micro-batch, the loss read
    only at the window's end, as the DeepSpeed system's). ``compensation``: the config's
    ``roundpipe.staleness_compensation`` (None: the default; such a run is not calibrated).
    ``read``: the loop also reads each loss (``loss.item()``) at one of ``READS``;
    ``engine_loader``: the loop takes its micro-batches from the loader ``initialize`` returns
    (``training_data=``, the same batches in the same order) instead of its own iterator."""

    def setup(preset: dict, data: list, cuda: bool, args: argparse.Namespace) -> tuple:
        import rp_engine

        devices = args.devices or ("cuda" if cuda else "cpu:2")
        cfg = ds_config(preset, devices=devices, pcie_gbps=None if cuda else args.pcie_gbps)
        cfg["roundpipe"]["async_optimizer"] = async_optimizer
        cfg["roundpipe"]["schedule"] = schedule
        if compensation is not None:
            cfg["roundpipe"]["staleness_compensation"] = compensation
        if getattr(args, "cuts", None) and schedule != "mobius":  # Mobius binds its own blocks
            fwd, bwd = (list(map(int, part.split(","))) for part in args.cuts.split("/"))
            cfg["roundpipe"].update(fwd_cuts=fwd, bwd_cuts=bwd)
        model = build_model(preset)
        if engine_loader:
            engine, _, loader, _ = rp_engine.initialize(
                model=model, config=cfg, training_data=loader_dataset(data)
            )
            it = iter(loader)
        else:
            engine, _, _, _ = rp_engine.initialize(model=model, config=cfg)
            it = iter(data)
        micro = 0
        by_step: dict[int, list[tuple[str, float]]] = {}  # per step: the compute spans it ran

        def note_finished() -> None:
            # the newest finished step (one call late with overlapping iterations); reading
            # last_timeline() here would finish the step in flight every call
            report = engine.step_report()
            if report is not None:
                by_step[report.step] = [
                    (r.action, r.end - r.start) for r in report.timeline if r.stream == "compute"
                ]

        def step() -> Any:
            nonlocal micro
            if loop:
                total = 0.0
                for _ in range(preset["gas"]):
                    loss = engine(**next(it)).loss
                    if read == "before_backward":
                        loss.item()
                    engine.backward(loss)
                    engine.step()
                    if read == "after_step" or (read == "every_10th" and micro % 10 == 9):
                        loss.item()
                    micro += 1
                    total += loss.detach() / preset["gas"]
            else:
                total = engine.train_batch(it)
            note_finished()
            return total

        def extra() -> dict[str, Any]:
            note_finished()  # after the window's synchronize: the last step too
            spans = [by_step[k] for k in sorted(by_step)]
            stats = engine.last_step_stats()
            plan = engine.planner
            peaks = [d.memory_stats().get("peak", 0) for d in engine.pool.devices]
            out = {
                "last_step": stats,
                "bytes_per_step": stats["h2d_bytes"] + stats["d2h_bytes"],
                "schedule": schedule,
                "fwd_cuts": list(plan.fwd_cuts),
                "bwd_cuts": list(plan.bwd_cuts),
                "round_size": plan.round_size,
                "num_devices": plan.num_devices,
            }
            if not cuda:  # CUDA: the allocator's own peak (torch) is the device figure
                out["peak_device_gb"] = max(peaks) / 1e9
            out["timeline"] = [[r.device, r.action, r.start, r.end] for r in engine.last_timeline()]
            # the link model and layer timing are CPU-only; they model train_batch's run
            if args.calibrate and not cuda and not loop and compensation is None:
                window = [x for step_spans in spans[-args.steps :] for x in step_spans]
                out["calibration"] = _calibrate(
                    engine, model, preset, args, async_optimizer, window
                )
            return out

        def reset_peaks() -> None:
            # the pool's peaks (the CPU figure; on CUDA torch's allocator peak, reset too):
            # the engine never resets them, so they span the window from here
            for device in engine.pool.devices:
                device.reset_peak()

        return step, engine.synchronize, extra, reset_peaks

    return setup


READS = ("after_step", "before_backward", "every_10th")


def _calibrate(
    engine: Any,
    model: Any,
    preset: dict,
    args: argparse.Namespace,
    async_optimizer: bool,
    window: list[tuple[str, float]],
) -> dict[str, Any]:
    """Predict this run's iteration (benchmarks/RESULTS.md, "Calibration") from:

    - compute: each compute action's body through the executor's own path, as CPU time. Timed
      in isolation, by part (``executor_timing.executor_costs``), then rescaled per kind of slot
      to the CPU time the same actions took inside the engine on the same plan, run again with
      this model and no emulated link (``plan_run``); never the measured run's own figures;
    - the link model, and the share of the cores other sessions left the run over its measured
      window (``host_load.CoreShare``);
    - the per-action host overhead, solved on the same plan run with a near-zero-compute model
      whose compute is taken the same way (``overhead_run``, ``calibration.solve_overhead``).

    For comparison: the isolated executor path alone, the plain layer timing
    (``calibration.layer_costs``), without the other sessions, without the overhead; as a
    diagnostic, the layer shape rescaled to the measured run's own compute spans (wall time:
    they include waits for a core or the GIL, so they overstate compute)."""
    from benchmarks import calibration as cal

    engine.synchronize()
    plan = engine.planner
    n = plan.num_devices
    shape = {
        "schedule": plan.schedule,
        "fwd_cuts": plan.fwd_cuts,
        "bwd_cuts": plan.bwd_cuts,
        "num_microbatches": plan.num_microbatches,
        "round_size": plan.round_size,
        "async_optimizer": async_optimizer,
        "global_norm": True,  # gradient_clipping 1.0 (ds_config): steps wait for the global norm
    }
    rate = cal.cpu_adam_rate(sum(p.numel() for p in model.parameters()))
    window_share = getattr(args, "core_share", None) or CoreShare()  # over this run's window
    cores, k_max = float(os.cpu_count() or 1), n + 2  # devices, host overhead, optimizer
    share = window_share.shares(cores, k_max)
    twin, _, _, spans = plan_run(preset, shape, n, warmup=2, steps=3)
    plain, timing, costs, engine_factors = in_engine_costs(twin, preset, shape, n, spans)
    tiny_costs, tiny_rate, tiny_ms, tiny_share = overhead_run(preset, shape, n)
    tiny_machine = cal.cpu_machine(n, None, tiny_rate, host_share=tiny_share.shares(cores, k_max))
    solved = cal.solve_overhead(tiny_costs, tiny_machine, tiny_ms, **shape)
    solved["host_share"] = list(tiny_machine.host_share)
    overhead = solved["overhead_ms"]
    machine = cal.cpu_machine(n, args.pcie_gbps, rate, overhead, host_share=share)

    def predict(c: Any, m: Any = machine) -> dict[str, Any]:
        return cal.predict_ms(c, m, **shape)

    pred = predict(costs)
    bare = predict(costs, cal.cpu_machine(n, args.pcie_gbps, rate, host_share=share))
    no_load = predict(costs, cal.cpu_machine(n, args.pcie_gbps, rate, overhead))
    in_run, factors = cal.in_run_costs(timing.costs, plan.fwd_cuts, plan.bwd_cuts, window)
    ex = timing.costs
    return {
        "predicted_ms": pred["iteration_ms"],
        "predicted_no_overhead_ms": bare["iteration_ms"],
        "predicted_no_load_ms": no_load["iteration_ms"],
        "predicted_isolated_ms": predict(ex)["iteration_ms"],
        "predicted_layer_timing_ms": predict(plain)["iteration_ms"],
        "action_overhead_ms": overhead,
        "host_share": list(share),
        "external_load": {
            "threads": window_share.mean_threads,
            "sessions": window_share.mean_sessions,
        },
        "overhead_run": solved,
        "executor_parts_ms": timing.parts_ms,
        "in_engine_factors": engine_factors,
        "predicted_in_run_ms": predict(in_run)["iteration_ms"],
        "boundary_bytes": plain.boundary_bytes,
        "batch_bytes": plain.batch_bytes,
        "in_run_factors": factors,
        "predicted_compute_ms": pred["compute_ms_per_iteration"],
        "predicted_bubble": pred["bubble_ratio"],
        "predicted_bytes": pred["bytes_moved_per_iteration"],
        "layer_fwd_ms": list(plain.fwd_ms),
        "layer_bwd_ms": list(plain.bwd_ms),
        "head_ms": [plain.head_fwd_ms, plain.head_bwd_ms],
        "executor_fwd_ms": list(ex.fwd_ms),
        "executor_recompute_ms": list(ex.recompute_ms),
        "executor_bwd_ms": list(ex.bwd_ms),
        "executor_head_ms": [ex.head_fwd_ms, ex.head_bwd_ms],
        "engine_fwd_ms": list(costs.fwd_ms),
        "engine_recompute_ms": list(costs.recompute_ms),
        "engine_bwd_ms": list(costs.bwd_ms),
        "engine_head_ms": [costs.head_fwd_ms, costs.head_bwd_ms],
        "cpu_adam_params_per_s": rate,
        "machine": machine.name,
    }


def _roundpipe_lib(preset: dict, data: list, cuda: bool, args: argparse.Namespace) -> tuple:
    """``roundpipe_lib``'s setup with this benchmark's ds_config and model (benchmarks/
    roundpipe_lib.py imports nothing of this module)."""
    ds = ds_config(preset, devices=None, pcie_gbps=None)
    return roundpipe_lib.setup(preset, data, cuda, args, ds=ds, build_model=build_model)


SETUP = {
    "torch": _torch,
    "deepspeed": _deepspeed,
    "roundpipe": roundpipe_setup(True, "roundpipe"),
    "roundpipe_auto": roundpipe_setup(True, "roundpipe", compensation="auto"),
    "roundpipe_loop": roundpipe_setup(True, "roundpipe", loop=True),
    "roundpipe_sync": roundpipe_setup(False, "roundpipe"),
    "mobius": roundpipe_setup(False, "mobius"),
    roundpipe_lib.SYSTEM: _roundpipe_lib,
}


def skipped_row(system: str, reason: str, preset: dict[str, Any]) -> dict[str, Any]:
    """A system that did not run, and why (no CUDA, no time left): reported, not a failure.
    ``roundpipe_lib``'s row still lists its differences (they come from the config alone)."""
    row: dict[str, Any] = {"system": system, "skipped": reason}
    if system == roundpipe_lib.SYSTEM:
        ds = ds_config(preset, devices=None, pcie_gbps=None)
        row["differences"] = roundpipe_lib.differences(preset, ds)
    return row


# ---- the parent: alternate systems, aggregate, report ----------------------------------------
def run_child(
    system: str, args: argparse.Namespace, module: str = "benchmarks.head_to_head"
) -> dict[str, Any]:
    """One system's process; a GPU-only system on explicit non-CUDA ``--devices`` is skipped
    here, without one. ``args.deadline`` (monotonic seconds, or None): no system starts with
    less than ``args.min_child_s`` (default ``MIN_CHILD_S``) left, and each is killed at the
    deadline at the latest."""
    preset = {**PRESETS[args.model], **({"gas": args.gas} if getattr(args, "gas", None) else {})}
    if system in GPU_ONLY and args.devices and not args.devices.startswith("cuda"):
        return skipped_row(system, GPU_ONLY[system], preset)
    timeout = args.timeout
    deadline = getattr(args, "deadline", None)
    if deadline is not None:
        left = deadline - time.monotonic()
        if left < getattr(args, "min_child_s", MIN_CHILD_S):
            why = f"no time left: {max(0.0, left):.0f} s of the time budget"
            return skipped_row(system, why, preset)
        timeout = left if timeout is None else min(timeout, left)
    cmd = [sys.executable, "-m", module, "--system", system]
    cmd += ["--model", args.model, "--warmup", str(args.warmup), "--steps", str(args.steps)]
    if getattr(args, "gas", None):
        cmd += ["--gas", str(args.gas)]
    if args.devices:
        cmd += ["--devices", args.devices]
    if args.pcie_gbps:
        cmd += ["--pcie-gbps", str(args.pcie_gbps)]
    if getattr(args, "cuts", None):
        cmd += ["--cuts", args.cuts]
    if not args.calibrate:
        cmd += ["--no-calibrate"]
    return child_json(cmd, system, timeout=timeout, child_log=args.child_log)


def _append_jsonl(path: str, model: str, repeat: int, row: dict[str, Any]) -> None:
    """One finished run as one JSON line, written and flushed as soon as its process ends, so
    a run cut short keeps every system that finished (the timeline is left to ``--json``)."""
    line = {"model": model, "repeat": repeat, **{k: v for k, v in row.items() if k != "timeline"}}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


_PREDICTIONS = (
    "predicted_ms",
    "predicted_in_run_ms",
    "predicted_no_overhead_ms",
    "predicted_no_load_ms",
    "predicted_isolated_ms",
    "predicted_layer_timing_ms",
)


def aggregate(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per system: the median tokens/s over repeats, every repeat's figure, peaks (max), the
    last repeat's losses and bytes; calibration: the median of each prediction over repeats
    against the median step, each repeat's own error, the last repeat's other figures. A
    system with no finished run: its last row's ``error`` or ``skipped`` (and differences)."""
    systems: dict[str, Any] = {}
    for name, rows in runs.items():
        ok = [r for r in rows if "error" not in r and "skipped" not in r]
        if not ok:
            keep = ("error", "skipped", "differences")
            systems[name] = {k: v for k, v in rows[-1].items() if k in keep}
            continue
        last = dict(ok[-1])
        last.pop("timeline", None)
        tps = [r["tokens_per_s"] for r in ok]
        last.update(
            tokens_per_s=statistics.median(tps),
            tokens_per_s_runs=tps,
            s_per_step=statistics.median(r["s_per_step"] for r in ok),
            peak_host_gb=max(r["peak_host_gb"] for r in ok),
        )
        devs = [r["peak_device_gb"] for r in ok if r.get("peak_device_gb") is not None]
        last["peak_device_gb"] = max(devs) if devs else None
        cal = [(r["calibration"], r["s_per_step"] * 1e3) for r in ok if "calibration" in r]
        if cal:
            meas = last["s_per_step"] * 1e3
            out = {**cal[-1][0], "measured_ms": meas}
            for key in _PREDICTIONS:  # the median over repeats, as the measured step
                got = [c[key] for c, _ in cal if key in c]
                if got:
                    out[key] = statistics.median(got)
            pred, run = out["predicted_ms"], out["predicted_in_run_ms"]
            out.update(error=(pred - meas) / meas, error_in_run=(run - meas) / meas)
            # each repeat against its own measured step (its core share was measured during it)
            out["repeats"] = [
                {"predicted_ms": c["predicted_ms"], "measured_ms": m,
                 "error": (c["predicted_ms"] - m) / m,
                 "host_share": c.get("host_share")}
                for c, m in cal
            ]  # fmt: skip
            last["calibration"] = out
        systems[name] = last
    return systems


def loss_agreement(systems: dict[str, Any], *, fp32: bool = True) -> dict[str, Any]:
    """Per-step relative difference of DeepSpeed and rp_engine sync losses. The 1e-3 criterion
    is fp32's: in bf16 the two systems round differently (DeepSpeed's bf16 optimizer against
    fp32 masters on the host), so the difference is reported with ``ok`` None, not judged."""
    a = systems.get("deepspeed", {}).get("step_losses")
    b = systems.get("roundpipe_sync", {}).get("step_losses")
    if not a or not b:
        return {"checked": False}
    rel = [abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=True)]
    if not fp32:
        return {"checked": False, "max_rel": max(rel), "rtol": None, "ok": None}
    return {"checked": True, "max_rel": max(rel), "rtol": LOSS_RTOL, "ok": max(rel) <= LOSS_RTOL}


def lib_loss_agreement(systems: dict[str, Any], *, fp32: bool = True) -> dict[str, Any]:
    """Per-step relative difference of the RoundPipe library's losses (``roundpipe_lib``) and
    rp_engine async's (``roundpipe``): the same model, data, micro-batches and AdamW, both
    asynchronous with staleness 1. Judged at ``LOSS_RTOL`` in fp32, at the sanity bound
    ``LIB_LOSS_RTOL_BF16`` in bf16 (two implementations' rounding differ)."""
    a = systems.get("roundpipe", {}).get("step_losses")
    b = systems.get(roundpipe_lib.SYSTEM, {}).get("step_losses")
    if not a or not b:
        return {"checked": False, "against": "roundpipe"}
    rel = [abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=True)]
    rtol = LOSS_RTOL if fp32 else LIB_LOSS_RTOL_BF16
    return {"checked": True, "against": "roundpipe", "rel": rel, "max_rel": max(rel),
            "rtol": rtol, "ok": max(rel) <= rtol}  # fmt: skip


def format_table(result: dict[str, Any]) -> str:
    """The report as a Markdown table."""
    head = "| system | tokens/s | vs DeepSpeed | s/step | final loss | peak host GB | "
    head += "peak device GB | MB moved/step | predicted ms | error | error from in-run spans |\n"
    head += "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    rows = []
    for name in SYSTEMS:
        s = result["systems"].get(name)
        if s is None:
            continue
        if "error" in s:
            rows.append(f"| {name} | failed: {' / '.join(s['error'] or [])[-200:]} |")
            continue
        if "skipped" in s:
            rows.append(f"| {name} | skipped: {s['skipped']} |")
            continue
        ratio = result["ratios"].get(name)
        dev = s.get("peak_device_gb")
        cal = s.get("calibration")
        moved = s.get("bytes_per_step", 0)
        mb_text = "n/a" if moved is None else f"{moved / 1e6:,.1f}"  # None: not counted
        mb_text += " (model)" if s.get("bytes_modelled") else ""
        pred_text = f"{cal['predicted_ms']:.0f}" if cal else ""
        err_text = f"{100 * cal['error']:+.0f} %" if cal else ""
        iso_text = f"{100 * cal['error_in_run']:+.0f} %" if cal else ""
        rows.append(
            f"| {name} | {s['tokens_per_s']:,.0f} | "
            f"{'' if ratio is None else f'{ratio:.2f}x'} | {s['s_per_step']:.3f} | "
            f"{s['final_loss']:.4f} | {s['peak_host_gb']:.2f} | "
            f"{'(host)' if dev is None else f'{dev:.3f}'} | {mb_text} | "
            f"{pred_text} | {err_text} | {iso_text} |"
        )
    notes = [  # one bullet per system, one sub-bullet per difference
        f"- {name}:\n" + "\n".join(f"  - {d}" for d in s["differences"])
        for name in SYSTEMS
        if (s := result["systems"].get(name)) and s.get("differences")
    ]
    auto, plain = (result["systems"].get(k) or {} for k in ("roundpipe_auto", "roundpipe"))
    if auto.get("s_per_step") and plain.get("s_per_step"):  # issue 43: the cost end to end
        notes.append(
            f'- roundpipe_auto vs roundpipe (async + staleness_compensation "auto" vs plain '
            f"async): {auto['s_per_step'] / plain['s_per_step']:.3f}x the time per step"
        )
    lib = result.get("lib_loss_agreement") or {}
    if lib.get("checked"):
        notes.append(
            f"- roundpipe_lib vs roundpipe losses: max relative difference {lib['max_rel']:.2e} "
            f"(bound {lib['rtol']:g}: {'ok' if lib['ok'] else 'EXCEEDED'})"
        )
    return head + "\n".join(rows) + "\n" + ("\nNotes:\n" + "\n".join(notes) + "\n" if notes else "")


def _result(
    runs: dict[str, list[dict[str, Any]]],
    args: argparse.Namespace,
    preset: dict[str, Any],
    machine: dict[str, Any],
) -> dict[str, Any]:
    """The report of the runs so far: per-system aggregates, ratios to DeepSpeed, the loss
    agreement, the configuration and ``machine``."""
    systems = aggregate(runs)
    ds = systems.get("deepspeed", {}).get("tokens_per_s")
    ratios = {k: s["tokens_per_s"] / ds for k, s in systems.items() if ds and "tokens_per_s" in s}
    config = {
        "model": args.model, **preset, "warmup": args.warmup, "steps": args.steps,
        "repeats": args.repeats, "devices": args.devices or "default", "pcie_gbps": args.pcie_gbps,
        "deepspeed_processes": 1, "ds_config": ds_config(preset, devices=args.devices,
                                                         pcie_gbps=args.pcie_gbps),
    }  # fmt: skip
    return {
        "systems": systems,
        "ratios": ratios,
        "loss_agreement": loss_agreement(systems, fp32=preset["dtype"] == "fp32"),
        "lib_loss_agreement": lib_loss_agreement(systems, fp32=preset["dtype"] == "fp32"),
        "config": config,
        "machine": machine,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the CPU configuration, a few minutes")
    p.add_argument(
        "--model", choices=sorted(PRESETS), help="default: qwen3-1.7b (cpu-small with --quick)"
    )
    p.add_argument("--devices", help="rp_engine devices, e.g. cpu:2 or cuda (default: all/cpu:2)")
    p.add_argument("--pcie-gbps", type=float, help="emulated link, CPU only (--quick: 0.1)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--repeats", type=int, help="rounds of A B C D E (default 2, --quick 2)")
    p.add_argument("--gas", type=int, help="gradient accumulation steps (default: the model's)")
    p.add_argument(
        "--cuts", help="rp_engine's plan fixed, FWD/BWD (e.g. 6/3,3: roundpipe.fwd_cuts and "
        "bwd_cuts): systems that differ in one setting then run the same plan",
    )  # fmt: skip
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, help="timed steps per run (default 5, --quick 6)")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--jsonl", help="append one JSON line per finished system run here")
    p.add_argument("--table", help="rewrite the Markdown table here after every system")
    p.add_argument("--timeout", type=float, help="seconds per system's process, then killed")
    p.add_argument(
        "--time-budget", type=float,
        help="seconds for the whole run: later systems are skipped rows once it is spent",
    )  # fmt: skip
    p.add_argument("--min-child-s", type=float, default=MIN_CHILD_S,
                   help="with --time-budget: no system starts with less time left")  # fmt: skip
    p.add_argument("--child-log", help="append every system process's stderr here")
    p.add_argument("--system", help=argparse.SUPPRESS)  # the child process's one system
    args = p.parse_args(argv)
    args.deadline = None if args.time_budget is None else time.monotonic() + args.time_budget
    args.model = args.model or ("cpu-small" if args.quick else "qwen3-1.7b")
    # --quick: 6 steps, not 4: on a shared 2-core machine a 4-step window of one repeat moved
    # by 15 % against the other; a longer window averages the neighbours' load
    args.steps = args.steps or (6 if args.quick else 5)
    args.repeats = args.repeats or 2
    if args.quick and args.pcie_gbps is None:
        # Two CPU cores against 0.1 GB/s is still ~20x more link per FLOP than an RTX 4090 on
        # PCIe 4.0 (165 TFLOPS / 24 GB/s): conservative towards the offloading baselines
        args.pcie_gbps = 0.1
    preset = dict(PRESETS[args.model])
    if args.gas:
        preset["gas"] = args.gas
    if args.system:
        row = run_system(args.system, preset, args)
        print("JSON:" + json.dumps(row), flush=True)
        return 0
    names = chosen_systems(p, args.systems, SYSTEMS)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in names}
    timelines: dict[str, Any] = {}
    for rep in range(args.repeats):  # A B C D E, A B C D E: drift hits every system alike
        for system in names:
            row = run_child(system, args)
            runs[system].append(row)
            if args.jsonl:
                _append_jsonl(args.jsonl, args.model, rep, row)
            if "timeline" in row:
                timelines[system] = row["timeline"]
            keys = ("tokens_per_s", "s_per_step", "final_loss", "error", "skipped")
            brief = {k: row[k] for k in keys if k in row}
            print(f"[{rep + 1}/{args.repeats}] {system}: {json.dumps(brief)}", file=sys.stderr)
            if args.table:  # what ran so far, should the run be cut short (no machine_info:
                # it would open a CUDA context in this process while the next system runs)
                ran = {k: v for k, v in runs.items() if v}
                Path(args.table).write_text(format_table(_result(ran, args, preset, {})))
    result = _result(runs, args, preset, machine_info())
    print(format_table(result))
    agreement, lib = result["loss_agreement"], result["lib_loss_agreement"]
    print(json.dumps({"ratios_to_deepspeed": result["ratios"], "loss_agreement": agreement,
                      "lib_loss_agreement": lib}))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "timelines": timelines}, indent=1))
    failed = any("error" in s for s in result["systems"].values())
    disagree = agreement.get("ok") is False or lib.get("ok") is False
    return 1 if failed or disagree else 0


if __name__ == "__main__":
    raise SystemExit(main())
