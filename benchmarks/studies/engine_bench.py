"""Engine benchmarks on this machine (CPU virtual devices), measured side by side in one run.

    python benchmarks/studies/engine_bench.py BENCH [options], BENCH one of:

    overhead           rp_engine cpu:1 vs plain PyTorch + recompute
    async              async vs sync optimizer, emulated PCIe
    adam               DeepSpeedCPUAdam vs torch AdamW, params/s
    memory             host bytes per trainable parameter
    convergence        sync vs async (+compensation) loss (PNG)
    compensation_cost  layer step+publish, prediction on/off
    timeline           PNG of one 4-device iteration
    rounds             one upload per round vs per micro-batch
    residency          weights kept on the device across rounds
    overlap            overlapping iterations on vs off [--on-nonfinite raise|ignore|skip]
    gil                GIL wait per step (e.g. --hidden 512): CPU Adam's binding vs the GIL-free
                       call (release_gil)

Every figure is a ratio of runs interleaved in one process (A B A B ...), so machine noise
hits both sides alike. Results are printed as JSON lines; RESULTS.md quotes them with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file: benchmarks/studies/)
DATA = ROOT / "benchmarks" / "data"  # the figures it writes
sys.path.insert(0, str(ROOT / "tests" / "support"))
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    os.path.join(os.path.expanduser("~"), ".cache", "rp_engine", "torch_extensions"),
)
os.environ.setdefault("WANDB_MODE", "disabled")

import rp_engine  # noqa: E402
from rp_engine.host.affinity import (  # noqa: E402
    available_cores,
    pin_optimizer_thread,
    pin_thread,
    split_cores,
)
from rp_engine.host.jit_cache import with_own_ninja  # noqa: E402
from rp_engine.optim.loss_scaler import LossScaler  # noqa: E402
from rp_engine.optim.optimizer import HostOptimizer, build_inner_optimizer  # noqa: E402

# DeepSpeed's own CPU Adam builds in the engine's cache with the engine's ninja (jit_cache.py)
os.environ["PATH"] = with_own_ninja(os.environ.get("PATH", ""))
from rp_engine.train.cli import batches, build_tiny_model, stdlib_corpus  # noqa: E402


def _cfg(devices: str, *, gas: int = 4, mbs: int = 4, **rp: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "roundpipe": {"devices": devices, **rp},
    }


def _interleaved(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            out[name].append(fn())
    return out


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    """rp_engine on one CPU device vs plain PyTorch with per-layer recomputation (same model,
    same data, same AdamW), seconds per optimizer step."""
    seq, gas, mbs = args.seq_len, 4, 4
    data = list(_take(batches(stdlib_corpus(), seq_len=seq, micro_batch=mbs), gas * 64))
    plain = build_tiny_model(layers=args.layers, hidden=args.hidden)
    plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plain.train()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=False)
    engine, _, _, _ = rp_engine.initialize(
        model=build_tiny_model(layers=args.layers, hidden=args.hidden),
        config=_cfg("cpu:1", gas=gas, mbs=mbs, async_optimizer=False),
    )
    it_plain, it_rp = iter(data), iter(data)
    for _ in range(3):  # warm-up (and the engine's profiling re-plan)
        engine.train_batch(it_rp)

    def plain_step() -> float:
        start = time.perf_counter()
        for _ in range(gas):
            (plain(**next(it_plain)).loss / gas).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    def rp_step() -> float:
        start = time.perf_counter()
        engine.train_batch(it_rp)
        return time.perf_counter() - start

    plain_step()
    times = _interleaved({"plain": plain_step, "rp_engine": rp_step}, args.repeats)
    engine.destroy()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "bench": "overhead",
        "model": f"qwen3 L{args.layers} H{args.hidden} seq{seq} mbs{mbs} gas{gas} fp32",
        "plain_s_per_step": med["plain"],
        "rp_engine_s_per_step": med["rp_engine"],
        "rp_over_plain_time": med["rp_engine"] / med["plain"],
    }


def async_vs_sync(args: argparse.Namespace) -> dict[str, Any]:
    """Iteration time with the async optimizer vs the sync one, 2 CPU devices, emulated PCIe."""
    seq, gas, mbs = args.seq_len, 4, 2
    data = list(_take(batches(stdlib_corpus(), seq_len=seq, micro_batch=mbs), gas * 64))
    engines = {}
    for mode in ("sync", "async"):
        engines[mode], _, _, _ = rp_engine.initialize(
            model=build_tiny_model(layers=args.layers, hidden=args.hidden),
            # same fixed cuts for both: the partitioner picks different cuts per optimizer mode
            config=_cfg("cpu:2", gas=gas, mbs=mbs, async_optimizer=mode == "async",
                        pcie_gbps=args.pcie_gbps, fwd_cuts=[2] * (args.layers // 2),
                        bwd_cuts=[0] + [1] * args.layers),
        )  # fmt: skip
    iters = {k: iter(data) for k in engines}
    for k, e in engines.items():
        for _ in range(3):
            e.train_batch(iters[k])

    def step(mode: str) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            engines[mode].train_batch(iters[mode])
            return time.perf_counter() - start

        return run

    times = _interleaved({"sync": step("sync"), "async": step("async")}, args.repeats)
    for e in engines.values():
        e.destroy()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "bench": "async",
        "model": f"qwen3 L{args.layers} H{args.hidden} seq{seq} mbs{mbs} gas{gas} fp32, cpu:2, "
        f"pcie {args.pcie_gbps} GB/s",
        "sync_s_per_step": med["sync"],
        "async_s_per_step": med["async"],
        "sync_over_async_time": med["sync"] / med["async"],
    }


def adam(args: argparse.Namespace) -> dict[str, Any]:
    """Optimizer step throughput on one fp32 tensor of ``--adam-params`` elements."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    n = args.adam_params
    tensors = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    for name in ("deepspeed_cpu_adam", "torch_adamw", "torch_adamw_fused"):
        p = torch.zeros(n, requires_grad=True)
        p.grad = torch.randn(n)
        tensors[name] = p
    opts["deepspeed_cpu_adam"] = DeepSpeedCPUAdam([tensors["deepspeed_cpu_adam"]], lr=1e-3)
    opts["torch_adamw"] = torch.optim.AdamW([tensors["torch_adamw"]], lr=1e-3)
    opts["torch_adamw_fused"] = torch.optim.AdamW(
        [tensors["torch_adamw_fused"]], lr=1e-3, fused=True
    )

    def run(name: str) -> Callable[[], float]:
        def go() -> float:
            start = time.perf_counter()
            opts[name].step()
            return time.perf_counter() - start

        return go

    for name in opts:
        run(name)()
    times = _interleaved({k: run(k) for k in opts}, args.repeats)
    med = {k: statistics.median(v) for k, v in times.items()}
    out: dict[str, Any] = {"bench": "adam", "params": n, "threads": torch.get_num_threads()}
    for k, v in med.items():
        out[f"{k}_params_per_s"] = n / v
    out["cpu_adam_over_torch_adamw"] = med["torch_adamw"] / med["deepspeed_cpu_adam"]
    return out


def memory(args: argparse.Namespace) -> dict[str, Any]:
    """Host bytes per trainable parameter after one step (weights, masters, grads, Adam m, v)."""
    out: dict[str, Any] = {"bench": "memory"}
    for dtype in ("fp32", "bf16"):
        cfg = _cfg("cpu:1", gas=1, mbs=1)
        if dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        model = build_tiny_model(layers=args.layers, hidden=args.hidden)
        engine, _, _, _ = rp_engine.initialize(model=model, config=cfg)
        engine.train_batch(_take(batches(stdlib_corpus(), seq_len=32, micro_batch=1), 1))
        engine.synchronize()
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        masters = sum(hp.master.numel() * 4 for hp in engine.store.owned_params())
        grads = sum(hp.master.numel() * 4 for hp in engine.store.owned_params())
        states = sum(
            t.numel() * t.element_size()
            for s in engine.optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )
        engine.destroy()
        out[f"{dtype}_bytes_per_param"] = (weights + masters + grads + states) / trainable
    return out


def convergence(args: argparse.Namespace) -> dict[str, Any]:
    """Loss curves on the rp-train default data, sync vs async optimizer, for a sweep of
    learning rates (same model, data and seed; the test suite checks the 2e-4 case)."""
    lrs = [float(x) for x in args.lrs.split(",")]
    curves: dict[float, dict[str, list[float]]] = {}
    out: dict[str, Any] = {"bench": "convergence", "steps": args.steps, "tail": 20}
    for lr in lrs:
        curves[lr] = {}
        modes = ["sync", "async", *(f"async+{c}" for c in args.compensations.split(",") if c)]
        for mode in modes:
            model = build_tiny_model(seed=0, layers=2, hidden=64)
            comp = mode.split("+")[1] if "+" in mode else "none"
            cfg = _cfg("cpu:1", gas=4, mbs=4, async_optimizer=mode != "sync", fwd_cuts=[2],
                       bwd_cuts=[0, 2], staleness_compensation=comp)  # fmt: skip
            cfg["optimizer"]["params"].update(lr=lr, weight_decay=0.0)
            engine, _, _, _ = rp_engine.initialize(model=model, config=cfg)
            data = batches(stdlib_corpus(), seq_len=32, micro_batch=4, seed=0)
            curves[lr][mode] = [float(engine.train_batch(data)) for _ in range(args.steps)]
            engine.destroy()
        final = {k: statistics.mean(v[-20:]) for k, v in curves[lr].items()}
        out[f"lr{lr:g}"] = {
            "final_sync": final["sync"],
            "final_async": final["async"],
            "relative_gap": (final["async"] - final["sync"]) / final["sync"],
            **{f"final_{m}": final[m] for m in modes if "+" in m},
            **{
                f"relative_gap_{m}": (final[m] - final["sync"]) / final["sync"]
                for m in modes
                if "+" in m
            },
        }
    png = DATA / "convergence_async_vs_sync.png"
    _plot_curves(curves, png)
    out["png"] = str(png.relative_to(ROOT))
    return out


def compensation_cost(args: argparse.Namespace) -> dict[str, Any]:
    """Per-layer optimizer work with staleness compensation on vs off, side by side: one layer
    of ``--cost-elems`` trainable parameters (4 tensors, ``--cost-dtype`` compute weights, bf16 by
    default, double-buffered),
    stepped and published as the optimizer worker does at step end (optim/stepper.py): DeepSpeed
    CPU AdamW (``step_params``) writing each slice into ``HostStore.publishing``'s buffer right
    after stepping it, as a cast of the masters (off), the "lookahead" prediction, or
    "lookahead_dc" (each slice's gradient also delay-compensated from the buffer's old values
    before Adam steps it). Also the previous design, a whole-layer step and then a separate
    ``publish`` pass (plain or with ``predict_into``), for reference. Interleaved, median
    seconds per layer step."""
    from torch import nn

    from rp_engine.model.host_store import HostStore
    from rp_engine.optim.delay_compensation import DelayCompensation
    from rp_engine.optim.loss_scaler import LossScaler
    from rp_engine.optim.optimizer import HostOptimizer, build_inner_optimizer

    n = args.cost_elems // 4
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.cost_dtype]
    layer = nn.ParameterList(nn.Parameter(torch.randn(n, dtype=dtype)) for _ in range(4))
    store = HostStore([layer], double_buffer=False)
    store.double_buffer_weights(True)
    owned = {id(hp.master): hp for hp in store.owned_params()}
    masters = [hp.master for hp in store.owned_params()]
    inner, per_layer = build_inner_optimizer("adamw", {"lr": 1e-3}, [{"params": masters}])
    opt = HostOptimizer(inner, per_layer=per_layer, scaler=LossScaler(cur_scale=1.0))
    groups = opt.snapshot()
    for hp in store.owned_params():
        store.accumulate(hp.param, torch.randn(n))
    version = [0]
    delay = DelayCompensation()

    def fused(predict: str | None) -> Callable[[], float]:
        dc = delay if predict == "lookahead_dc" else None

        def go() -> float:
            start = time.perf_counter()
            store.attach_grads([0])
            version[0] += 1
            with store.publishing(0, version[0], predicted=bool(predict), keep=bool(dc)) as dst:
                assert dst is not None
                opt.step_params(
                    masters, groups=groups, grad_coef=1.0,
                    publish=lambda p: dst(owned[id(p)]), predict=predict, delay=dc,
                )  # fmt: skip
            return time.perf_counter() - start

        return go

    def separate(predict: bool) -> Callable[[], float]:
        def go() -> float:
            start = time.perf_counter()
            store.attach_grads([0])
            opt.step_params(masters, groups=groups, grad_coef=1.0)
            version[0] += 1
            extrapolate = (
                (lambda hp, dst: opt.predict_into(hp.master, dst, groups)) if predict else None
            )
            store.publish(0, version[0], predict=extrapolate)
            return time.perf_counter() - start

        return go

    for warm in (None, "lookahead", "lookahead_dc", "lookahead_dc"):  # state, kernels, rms
        fused(warm)()
    runs = {
        "off": fused(None), "lookahead": fused("lookahead"), "lookahead_dc": fused("lookahead_dc"),
        "separate_off": separate(False), "separate_on": separate(True),
    }  # fmt: skip
    times = _interleaved(runs, args.repeats)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "bench": "compensation_cost",
        "params": 4 * n,
        "dtype": args.cost_dtype,
        "step_publish_off_s": med["off"],
        "step_publish_lookahead_s": med["lookahead"],
        "step_publish_lookahead_dc_s": med["lookahead_dc"],
        "lookahead_over_off": med["lookahead"] / med["off"],
        "lookahead_dc_over_off": med["lookahead_dc"] / med["off"],
        "separate_off_s": med["separate_off"],
        "separate_on_s": med["separate_on"],
        "separate_on_over_off": med["separate_on"] / med["separate_off"],
        "fused_off_over_separate_off": med["off"] / med["separate_off"],
    }


def timeline(args: argparse.Namespace) -> dict[str, Any]:
    """One 4-device train_batch of the default model, rendered as a Gantt chart."""
    from rp_engine.plan.render import measured_result, write_png

    engine, _, _, _ = rp_engine.initialize(
        model=build_tiny_model(layers=8, hidden=args.hidden),
        config=_cfg("cpu:4", gas=8, mbs=2, fwd_cuts=[4, 4], bwd_cuts=[0, 2, 2, 2, 2]),
    )
    data = batches(stdlib_corpus(), seq_len=args.seq_len, micro_batch=2)
    for _ in range(2):
        engine.train_batch(data)
    records = engine.last_timeline()
    engine.destroy()
    png = DATA / "timeline_cpu4.png"
    result = measured_result(records, schedule="rp_engine cpu:4")
    write_png(result, png, title="rp_engine: one measured iteration on 4 CPU virtual devices")
    return {
        "bench": "timeline",
        "png": str(png.relative_to(ROOT)),
        "actions": len(records),
        "measured_bubble": result.bubble_ratio,
    }


def _plot_curves(curves: dict[float, dict[str, list[float]]], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * len(curves), 3.6))
    axes = fig.subplots(1, len(curves), squeeze=False)[0]
    for ax, (lr, modes) in zip(axes, curves.items(), strict=True):
        for name, ys in modes.items():
            ax.plot(range(1, len(ys) + 1), ys, label=name, linewidth=1)
        ax.set_title(f"lr {lr:g}")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss")
        ax.legend()
    fig.suptitle("rp-train default data: sync vs async (staleness 1) CPU Adam, +compensation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _engine_windows(
    engines: dict[str, Any],
    data: list[Any],
    *,
    window: int,
    tokens: int,
    repeats: int,
    warmup: int = 1,
) -> dict[str, list[float]]:
    """Tokens/s of each engine over windows of ``window`` steps (``tokens`` per step) timed
    between two synchronisations (never per step: that would hide the async optimizer and the
    overlap), engines interleaved (A B A B ...), after ``warmup`` steps each."""
    iters = {k: iter(data) for k in engines}
    for k, e in engines.items():
        for _ in range(warmup):
            e.train_batch(iters[k])
        e.synchronize()

    def run_window(name: str) -> Callable[[], float]:
        def run() -> float:
            engine = engines[name]
            engine.synchronize()
            start = time.perf_counter()
            for _ in range(window):
                engine.train_batch(iters[name])
            engine.synchronize()
            return window * tokens / (time.perf_counter() - start)

        return run

    return _interleaved({k: run_window(k) for k in engines}, repeats)


def rounds(args: argparse.Namespace) -> dict[str, Any]:
    """Tokens/s with one weight upload per slot and round (M_R = GAS, on-device gradient
    accumulation) vs one per micro-batch (M_R = 1: what the landed executor did), cpu:2 with an
    emulated link slow enough that uploads dominate. Windows of steps synchronised at both ends
    (never per step), interleaved."""
    seq, gas, mbs, window = 16, 8, 1, 2
    data = list(_take(batches(stdlib_corpus(), seq_len=seq, micro_batch=mbs), gas * 200))
    engines = {}
    for name, size in (("per_microbatch", 1), ("per_round", gas)):
        engines[name], _, _, _ = rp_engine.initialize(
            model=build_tiny_model(layers=args.layers, hidden=args.hidden),
            config=_cfg("cpu:2", gas=gas, mbs=mbs, pcie_gbps=args.pcie_gbps, round_size=size,
                        fwd_cuts=[2] * (args.layers // 2), bwd_cuts=[0] + [2] * (args.layers // 2)),
        )  # fmt: skip
    tps = _engine_windows(
        engines, data, window=window, tokens=gas * mbs * seq, repeats=args.repeats
    )
    stats = {k: e.last_step_stats() for k, e in engines.items()}
    for e in engines.values():
        e.destroy()
    med = {k: statistics.median(v) for k, v in tps.items()}
    return {
        "bench": "rounds",
        "model": f"qwen3 L{args.layers} H{args.hidden} seq{seq} mbs{mbs} gas{gas} fp32, cpu:2, "
        f"pcie {args.pcie_gbps} GB/s",
        "tokens_per_s": med,
        "speedup_per_round_over_per_microbatch": med["per_round"] / med["per_microbatch"],
        "weight_h2d_bytes_per_step": {k: v["weight_h2d_bytes"] for k, v in stats.items()},
        "uploads_per_step": {k: v["uploads"] for k, v in stats.items()},
    }


def residency(args: argparse.Namespace) -> dict[str, Any]:
    """Tokens/s with weights kept on the device across rounds (residency: each slot uploads
    once per step) vs uploaded for every round, cpu:1 with an emulated link, rounds of one
    micro-batch (as a budget that holds the weights but not GAS activation states would force).
    Windows of steps synchronised at both ends (never per step), interleaved."""
    seq, gas, mbs, window = 16, 8, 1, 2
    data = list(_take(batches(stdlib_corpus(), seq_len=seq, micro_batch=mbs), gas * 200))
    engines = {}
    for name, on in (("per_round", False), ("resident", True)):
        engine, _, _, _ = rp_engine.initialize(
            model=build_tiny_model(layers=args.layers, hidden=args.hidden),
            config=_cfg("cpu:1", gas=gas, mbs=mbs, pcie_gbps=args.pcie_gbps, round_size=1,
                        device_memory_gb=1.0, fwd_cuts=[2] * (args.layers // 2),
                        bwd_cuts=[0] + [2] * (args.layers // 2)),
        )  # fmt: skip
        engine.planner.set_residency(on)
        engines[name] = engine
    tps = _engine_windows(
        engines, data, window=window, tokens=gas * mbs * seq, repeats=args.repeats
    )
    stats = {k: e.last_step_stats() for k, e in engines.items()}
    resident = {k: list(e.planner.resident) for k, e in engines.items()}
    for e in engines.values():
        e.destroy()
    med = {k: statistics.median(v) for k, v in tps.items()}
    return {
        "bench": "residency",
        "model": f"qwen3 L{args.layers} H{args.hidden} seq{seq} mbs{mbs} gas{gas} round 1 fp32, "
        f"cpu:1, pcie {args.pcie_gbps} GB/s",
        "resident": resident,
        "tokens_per_s": med,
        "speedup_resident_over_per_round": med["resident"] / med["per_round"],
        "weight_h2d_bytes_per_step": {k: v["weight_h2d_bytes"] for k, v in stats.items()},
        "grad_d2h_bytes_per_step": {k: v["grad_d2h_bytes"] for k, v in stats.items()},
        "uploads_per_step": {k: v["uploads"] for k, v in stats.items()},
    }


def overlap(args: argparse.Namespace) -> dict[str, Any]:
    """Tokens/s with overlapping iterations (train_batch t+1 issued while iteration t's backward
    tail and optimizer run) vs drained ones (``overlap_iterations: false``), async optimizer,
    cpu:2 with emulated PCIe, gradient clipping 1.0. Both engines use the same fixed cuts and
    the same ``on_nonfinite`` (``--on-nonfinite``; default "raise", the engine's default, which
    overlaps too and guards each step's global norm: a step found non-finite when it closes is
    undone; "ignore" was the only mode that overlapped before 2026-12-01). Windows of steps
    synchronised at both ends (never per step), interleaved; the spread is the min..max over
    windows."""
    seq, gas, mbs, window = args.seq_len, 4, 1, 4
    data = list(_take(batches(stdlib_corpus(), seq_len=seq, micro_batch=mbs), gas * 400))
    engines = {}
    for name, on in (("drained", False), ("overlapped", True)):
        engines[name], _, _, _ = rp_engine.initialize(
            model=build_tiny_model(layers=args.layers, hidden=args.hidden),
            config=_cfg("cpu:2", gas=gas, mbs=mbs, pcie_gbps=args.pcie_gbps,
                        on_nonfinite=args.on_nonfinite, overlap_iterations=on,
                        fwd_cuts=[2] * (args.layers // 2), bwd_cuts=[0] + [2] * (args.layers // 2)),
        )  # fmt: skip
    # whether each engine's train_batch may leave a run in flight (the engine's decision; no
    # public accessor): the figure is only meaningful if "overlapped" really overlaps
    active = {k: bool(e._overlap) for k, e in engines.items()}
    tps = _engine_windows(
        engines, data, window=window, tokens=gas * mbs * seq, repeats=args.repeats, warmup=2
    )
    for e in engines.values():
        e.destroy()
    med = {k: statistics.median(v) for k, v in tps.items()}
    ratios = [o / d for o, d in zip(tps["overlapped"], tps["drained"], strict=True)]
    return {
        "bench": "overlap",
        "model": f"qwen3 L{args.layers} H{args.hidden} seq{seq} mbs{mbs} gas{gas} fp32, cpu:2, "
        f"pcie {args.pcie_gbps} GB/s, async, windows of {window} steps",
        "on_nonfinite": args.on_nonfinite,
        "overlap_active": active,
        "tokens_per_s": med,
        "tokens_per_s_range": {k: [min(v), max(v)] for k, v in tps.items()},
        "speedup_overlapped_over_drained": med["overlapped"] / med["drained"],
        "speedup_per_window_pair": [min(ratios), statistics.median(ratios), max(ratios)],
    }


def _issue_proxy(release_gil: bool, *, params: int, layers: int, repeats: int) -> dict[str, Any]:
    """Kernel issue while the host optimizer steps, measured on CPU.

    On a GPU machine a device thread issues kernels and copies: tiny Python calls that need the
    GIL and a core, not the core's arithmetic. Here an "issuer" thread makes such calls (an
    in-place add on 16 floats: Python plus torch's dispatcher, microseconds) on its own core
    while the optimizer thread steps ``layers`` layers of ``params`` fp32 parameters through the
    engine's per-layer CPU Adam on the other core(s) (the split of host/affinity.py). Reported:
    the issuer's calls per second during the step over its rate alone, and its longest gap
    between two calls (the longest time it could not issue)."""
    cores = available_cores()
    split = split_cores(max(1, len(cores) - 1), cores=cores, device_kind="cpu", num_devices=1)
    masters = [torch.nn.Parameter(torch.zeros(params)) for _ in range(layers)]
    inner, _ = build_inner_optimizer("adamw", {"lr": 1e-3}, [{"params": masters}])
    host = HostOptimizer(inner, per_layer=True, scaler=LossScaler(),
                         release_gil=release_gil)  # fmt: skip
    assert host.releases_gil == release_gil
    for p in masters:
        p.grad = torch.randn(params)
    groups = host.snapshot()

    def issue(stop: threading.Event, gaps: list[float], count: list[int]) -> None:
        if split.active:
            pin_thread(split.pipeline)
        x = torch.zeros(16)
        last = time.perf_counter()
        worst = 0.0
        while not stop.is_set():
            x.add_(1.0)
            now = time.perf_counter()
            worst = max(worst, now - last)
            last = now
            count[0] += 1
        gaps.append(worst)

    def measured(work: Callable[[], None]) -> tuple[float, float]:
        stop, gaps, count = threading.Event(), [], [0]
        issuer = threading.Thread(target=issue, args=(stop, gaps, count))
        issuer.start()
        start = time.perf_counter()
        work()
        elapsed = time.perf_counter() - start
        stop.set()
        issuer.join()
        return count[0] / elapsed, gaps[0]

    def step() -> None:
        for p in masters:  # layer by layer, as the stepper does
            host.step_params([p], groups=groups, grad_coef=1.0)

    def on_optimizer_thread() -> tuple[float, float]:
        """``measured(step)`` on a thread pinned as the stepper's worker pins itself."""
        box: list[tuple[float, float]] = []

        def run() -> None:
            pin_optimizer_thread(split)
            box.append(measured(step))

        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
        return box[0]

    result: dict[str, list[float]] = {"rate_share": [], "longest_gap_ms": []}
    for _ in range(repeats):
        alone, _ = measured(lambda: time.sleep(0.2))
        rate, gap = on_optimizer_thread()
        result["rate_share"].append(rate / alone)
        result["longest_gap_ms"].append(1e3 * gap)
    return {
        "issue_rate_during_step_over_alone": statistics.median(result["rate_share"]),
        "longest_issue_gap_ms": statistics.median(result["longest_gap_ms"]),
    }


def gil(args: argparse.Namespace) -> dict[str, Any]:
    """The host optimizer and the GIL: DeepSpeed's GIL-holding CPU Adam binding against the
    GIL-free call (``roundpipe.release_gil``), side by side in one run.

    1. ``issue``: the CPU proxy for kernel issue (``_issue_proxy``): how much of its rate an
       issuing thread keeps while the optimizer steps, and its longest stall.
    2. ``engine``: two engines interleaved (the same cores, data and fixed cuts), 2 CPU devices,
       emulated PCIe, async optimizer: tokens/s. CPU devices compute on the host cores, so a
       stall there idles no accelerator: this checks the change costs nothing end to end."""
    out: dict[str, Any] = {"bench": "gil"}
    proxy_params = args.gil_params
    for mode in ("holds_gil", "releases_gil"):
        out[f"issue_{mode}"] = _issue_proxy(
            mode == "releases_gil", params=proxy_params, layers=4, repeats=args.repeats
        )
    out["issue_model"] = f"4 layers x {proxy_params / 1e6:.0f}M fp32 params, AdamW"
    out["longest_gap_ratio_hold_over_release"] = (
        out["issue_holds_gil"]["longest_issue_gap_ms"]
        / out["issue_releases_gil"]["longest_issue_gap_ms"]
    )
    seq, gas, mbs, window = args.seq_len, 4, 2, 3
    data = list(_take(batches(stdlib_corpus(), seq_len=seq, micro_batch=mbs), gas * 400))
    engines = {}
    for mode in ("holds_gil", "releases_gil"):
        engines[mode], _, _, _ = rp_engine.initialize(
            model=build_tiny_model(layers=args.layers, hidden=args.hidden),
            config=_cfg("cpu:2", gas=gas, mbs=mbs, async_optimizer=True,
                        pcie_gbps=args.pcie_gbps, fwd_cuts=[2] * (args.layers // 2),
                        bwd_cuts=[0] + [1] * args.layers,
                        release_gil=mode == "releases_gil"),
        )  # fmt: skip
        assert engines[mode].host_optimizer.releases_gil == (mode == "releases_gil")
    tokens = _engine_windows(
        engines, data, window=window, tokens=gas * mbs * seq, repeats=args.repeats
    )
    for e in engines.values():
        e.destroy()
    med = {k: statistics.median(v) for k, v in tokens.items()}
    out["engine_model"] = (
        f"qwen3 L{args.layers} H{args.hidden} seq{seq} mbs{mbs} gas{gas} fp32, cpu:2, "
        f"pcie {args.pcie_gbps} GB/s, async optimizer"
    )
    out["engine_tokens_per_s"] = med
    out["engine_tokens_ratio_release_over_hold"] = med["releases_gil"] / med["holds_gil"]
    return out


def _take(it: Any, n: int) -> Any:
    for _ in range(n):
        yield next(it)


BENCHES = {
    "overhead": overhead,
    "async": async_vs_sync,
    "adam": adam,
    "memory": memory,
    "convergence": convergence,
    "compensation_cost": compensation_cost,
    "timeline": timeline,
    "rounds": rounds,
    "residency": residency,
    "overlap": overlap,
    "gil": gil,
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench", choices=[*BENCHES, "all"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lrs", default="2e-4,5e-4,2e-3", help="convergence: learning rates")
    p.add_argument(
        "--compensations",
        default="predict",
        help="convergence: roundpipe.staleness_compensation methods run async besides plain "
        "async (comma-separated; empty: none)",
    )
    p.add_argument("--cost-elems", type=int, default=8_000_000, help="compensation_cost: params")
    p.add_argument("--cost-dtype", choices=("bf16", "fp16"), default="bf16",
                   help="compensation_cost: the compute weights' dtype")  # fmt: skip
    p.add_argument("--pcie-gbps", type=float, default=1.0)
    p.add_argument("--adam-params", type=int, default=50_000_000)
    p.add_argument("--gil-params", type=int, default=8_000_000, help="gil: params per layer")
    p.add_argument(
        "--on-nonfinite",
        choices=("raise", "ignore", "skip"),
        default="raise",
        help="overlap: roundpipe.on_nonfinite of both engines (default: the engine's, raise)",
    )
    args = p.parse_args(argv)
    names = list(BENCHES) if args.bench == "all" else [args.bench]
    for name in names:
        print(json.dumps(BENCHES[name](args)), flush=True)


if __name__ == "__main__":
    main()
