"""Host-path benchmarks: gradient accumulation into the fp32 arena and the optimizer step tail.

    python benchmarks/studies/host_path_bench.py BENCH [options], BENCH one of:

    accumulate  bf16 -> fp32 GB/s: old add_ vs arena
    tail        sync step tail, old vs new, N-param store
    all         both, then the 1.7B projection
    gil         a Python thread's longest pause during CPU Adam: sliced vs one kernel call
    norm        the step's squared norm: host pass over the fp32 gradients vs device-side norms
    grad_alloc  host memory allocated per step for the gradient downloads: a baseline commit's
                code vs this tree's (engine runs)

Old and new run interleaved in one process (A B A B ...), so machine noise hits both alike;
"grad_alloc" counts bytes, not time: it runs the baseline commit's rp_engine (``git archive``)
and this tree's in two processes, same model, batches and steps. Allocated means fresh tensors
``to_host`` made itself plus the devices' ``host_buffer`` allocations (the staging pools), after
two warm-up steps; "grad_staging_bytes_after_warmup" is what the pools hold then.
"tail" is what a synchronous step does after the last gradient has landed: squared norms,
clip/unscale, CPU Adam over every parameter, fp32 -> bf16 publish (old: a separate clip pass, one
kernel call per tensor, then zeroing every gradient). Results are JSON lines; RESULTS.md quotes
them with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    os.path.join(os.path.expanduser("~"), ".cache", "rp_engine", "torch_extensions"),
)

from rp_engine.host.jit_cache import with_own_ninja  # noqa: E402

# DeepSpeed's own CPU Adam builds in the engine's cache with the engine's ninja (jit_cache.py)
os.environ["PATH"] = with_own_ninja(os.environ.get("PATH", ""))

from rp_engine.model.grad_buffers import GradBuffers  # noqa: E402
from rp_engine.model.host_store import HostStore  # noqa: E402
from rp_engine.optim.loss_scaler import LossScaler  # noqa: E402
from rp_engine.optim.optimizer import HostOptimizer, build_inner_optimizer, snapshot_groups  # noqa: E402
from rp_engine.optim.stepper import OptimizerStepper  # noqa: E402
from rp_engine.runtime.grad_norm import device_norms, sq_norms_by_owner  # noqa: E402

QWEN3_1_7B_PARAMS = 1.72e9  # shared/reference/gpu_measurements.md
QWEN3_1_7B_EMBED_PARAMS = 151_936 * 2048  # tied with the LM head: its norm stays on the host
GPU_COMPUTE_S = 0.80  # same file: compute per optimizer step (GAS 4) with recomputation, H200
H200_HOST_CONVERT_ADD_GELEM_S = 4.85  # same file: 16 threads, convert into a buffer then add
# Memory traffic per element. Convert-and-add: read bf16 (2) + read and write fp32 (8). Sync tail
# per parameter: squared norm (read g: 4), Adam (read p, g, m, v: 16; write p, m, v: 12),
# publish (read the fp32 master: 4, write the bf16 weight: 2).
ACCUMULATE_BYTES = 10
TAIL_BYTES = 38


def _interleaved(a: Callable[[], None], b: Callable[[], None], repeats: int) -> tuple[float, float]:
    """Median seconds of ``a`` and ``b`` run alternately (after one warm-up each)."""
    a(), b()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, out in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def bench_accumulate(elements: int, repeats: int) -> dict[str, Any]:
    """Add a bf16 gradient into an fp32 master gradient: ``fp32.add_(bf16)`` (a full fp32
    temporary per call) against the arena's chunked convert-then-add, and the first-contribution
    copy that replaces zeroing + add."""
    grad = torch.randn(elements).to(torch.bfloat16)
    old = torch.zeros(elements)
    bufs = GradBuffers([torch.empty(elements)])
    bufs.write(0, grad)  # later writes take the add path

    def old_add() -> None:
        old.add_(grad)

    def new_add() -> None:
        bufs.write(0, grad)

    def old_first() -> None:  # zeroing pass after the step, then an add
        old.zero_()
        old.add_(grad)

    def new_first() -> None:
        bufs.clear()
        bufs.write(0, grad)

    t_old, t_new = _interleaved(old_add, new_add, repeats)
    t_old_first, t_new_first = _interleaved(old_first, new_first, repeats)
    gb = elements * 2 / 1e9  # bf16 gradient bytes consumed per call
    return {
        "bench": "accumulate",
        "elements": elements,
        "threads": torch.get_num_threads(),
        "old_add_ms": round(t_old * 1e3, 2),
        "new_add_ms": round(t_new * 1e3, 2),
        "old_add_gbps": round(gb / t_old, 2),
        "new_add_gbps": round(gb / t_new, 2),
        "new_add_gelem_s": round(elements / t_new / 1e9, 3),
        "add_speedup": round(t_old / t_new, 2),
        "old_zero_then_add_ms": round(t_old_first * 1e3, 2),
        "new_first_copy_ms": round(t_new_first * 1e3, 2),
        "first_speedup": round(t_old_first / t_new_first, 2),
    }


def _store(params: int, layers: int) -> tuple[nn.ModuleList, HostStore]:
    width = int((params / layers) ** 0.5)
    model = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))
    model.to(torch.bfloat16)
    return model, HostStore(list(model), double_buffer=False)  # the old tail reads one buffer


def _optimizer(store: HostStore, slice_elems: int) -> HostOptimizer:
    masters = [hp.master for hp in store.owned_params()]
    inner, per_layer = build_inner_optimizer(
        "adamw", {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}, [{"params": masters}]
    )
    return HostOptimizer(inner, per_layer=per_layer, scaler=LossScaler(), slice_elems=slice_elems)


def bench_tail(params: int, layers: int, repeats: int) -> dict[str, Any]:
    """Sync step tail for a store of ``params`` bf16 parameters (fp32 masters, grads, Adam m, v)."""
    model, store = _store(params, layers)
    grads = [torch.randn_like(hp.param) * 10 for hp in store.owned_params()]  # norm >> clip
    new_opt = _optimizer(store, slice_elems=1 << 21)
    stepper = OptimizerStepper(store, new_opt, clip=1.0, async_mode=False, fp16=False)
    step = [0]

    def land() -> None:
        for hp, g in zip(store.owned_params(), grads, strict=True):
            store.accumulate(hp.param, g)

    def new_tail() -> None:  # the real stepper: norms as layers land, one Adam pass, publish
        step[0] += 1
        stepper.open_step(step[0])
        for layer in reversed(range(len(store.layers))):
            stepper.layer_ready(layer)
        stepper.close_step()  # sync: waits for every step and publish

    old_opt = _optimizer(store, slice_elems=1 << 40)  # one kernel call per tensor, as before

    def old_tail() -> None:  # what the step did before: clip pass, whole-tensor Adam, zeroing
        masters = [hp.master for hp in store.owned_params()]
        sq = sum(float(torch.linalg.vector_norm(m.grad)) ** 2 for m in masters)  # type: ignore[arg-type]
        norm = sq**0.5
        coef = 1.0 / (norm + 1e-6) if norm > 1.0 else 1.0
        for m in masters:
            m.grad.mul_(coef)  # type: ignore[union-attr]
        old_opt.step_params(masters, groups=snapshot_groups(old_opt.optimizer), grad_coef=1.0)
        for hp in store.owned_params():
            hp.master.grad.zero_()  # type: ignore[union-attr]
            hp.param.data.copy_(hp.master)

    times: dict[str, list[float]] = {"old": [], "new": []}
    try:
        for i in range(repeats + 1):
            for name, fn in (("old", old_tail), ("new", new_tail)):
                land()
                if name == "old":
                    store.attach_grads()
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                store.zero_grads()
                if i:  # the first round builds Adam state: not counted
                    times[name].append(dt)
    finally:
        stepper.close()
    n = sum(hp.master.numel() for hp in store.owned_params())
    t_old, t_new = statistics.median(times["old"]), statistics.median(times["new"])
    return {
        "bench": "tail",
        "params": n,
        "layers": layers,
        "threads": torch.get_num_threads(),
        "old_tail_s": round(t_old, 3),
        "new_tail_s": round(t_new, 3),
        "speedup": round(t_old / t_new, 2),
        "new_ns_per_param": round(t_new / n * 1e9, 3),
    }


def _longest_pause(opt: HostOptimizer, p: torch.Tensor, steps: int) -> tuple[float, float, int]:
    """A heartbeat thread beats every 0.5 ms while another thread runs ``steps`` Adam steps:
    the longest gap between beats inside the window (s), the window (s), beats inside it."""
    import threading

    beats: list[float] = []
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(0.0005):
            beats.append(time.perf_counter())

    window: list[float] = []

    def step() -> None:
        torch.set_num_threads(1)  # a core stays free for the heartbeat: the GIL is measured
        window.append(time.perf_counter())
        for _ in range(steps):
            opt.step_params([p], groups=snapshot_groups(opt.optimizer), grad_coef=1.0)
        window.append(time.perf_counter())

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    time.sleep(0.02)
    worker = threading.Thread(target=step)
    worker.start()
    worker.join()
    stop.set()
    beat.join()
    start, end = window
    marks = [start, *(t for t in beats if start < t < end), end]
    return max(b - a for a, b in zip(marks, marks[1:], strict=False)), end - start, len(marks) - 2


def bench_gil(elements: int, repeats: int) -> dict[str, Any]:
    """Longest pause of a plain Python thread while CPU Adam steps ``elements`` parameters, in
    2M-element slices (the engine's default) and in one kernel call (DeepSpeedCPUAdam.step),
    interleaved. The kernel binding holds the GIL for the whole call: the pause is one call."""
    import sys

    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from rp_engine.optim.optimizer import ADAM_SLICE

    p = torch.zeros(elements)
    p.grad = torch.full_like(p, 1e-3)
    inner = DeepSpeedCPUAdam([p], lr=1e-4)
    sliced = HostOptimizer(inner, per_layer=True, scaler=LossScaler(), slice_elems=ADAM_SLICE)
    whole = HostOptimizer(inner, per_layer=True, scaler=LossScaler(), slice_elems=elements)
    sliced.step_params([p], groups=snapshot_groups(inner), grad_coef=1.0)  # Adam state
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # a waiting thread asks for the GIL after 0.5 ms
    rows: dict[str, list[tuple[float, float, int]]] = {"sliced": [], "whole": []}
    try:
        for _ in range(repeats):
            rows["sliced"].append(_longest_pause(sliced, p, steps=2))
            rows["whole"].append(_longest_pause(whole, p, steps=2))
    finally:
        sys.setswitchinterval(interval)
    out: dict[str, Any] = {"bench": "gil", "elements": elements, "slice": ADAM_SLICE}
    for name, got in rows.items():
        out[f"{name}_max_pause_ms"] = round(statistics.median(g for g, _, _ in got) * 1e3, 1)
        out[f"{name}_step_ms"] = round(statistics.median(d for _, d, _ in got) * 1e3 / 2, 1)
        out[f"{name}_beats"] = statistics.median(n for _, _, n in got)
    return out


def bench_norm(params: int, layers: int, repeats: int) -> dict[str, Any]:
    """The step's squared gradient norm, interleaved: the host pass (``HostStore.grad_sq_norm``
    over every layer's fp32 gradient, 4 B read per parameter, on the gradient thread) against
    what replaces it when each layer's gradient comes down in one download: per-parameter fp32
    norms of the bf16 device gradients (on a CPU virtual device this runs on its D2H thread; on
    a GPU it is a kernel there) and, on the host, a sum over one float per parameter tensor."""
    model, store = _store(params, layers)
    grads = [torch.randn_like(hp.param) for hp in store.owned_params()]  # bf16, as downloaded
    for hp, g in zip(store.owned_params(), grads, strict=True):
        store.accumulate(hp.param, g)
    owners = [hp.layer for hp in store.owned_params()]
    got: dict[str, float] = {}

    def host_pass() -> None:
        got["host"] = sum(store.grad_sq_norm(layer) for layer in range(len(store.layers)))

    norms: list[list[float]] = []

    def device_side() -> None:  # the D2H stream's work, up to the host copy of the norms
        norms[:] = [device_norms(grads).tolist()]

    def host_after() -> None:  # what the host still does per step
        got["device"] = sum(sq_norms_by_owner(norms[0], owners).values())

    t_host, t_device = _interleaved(host_pass, device_side, repeats)
    t_after = min(_interleaved(host_after, host_after, repeats))
    exact = sum(float(torch.linalg.vector_norm(g.double())) ** 2 for g in grads)
    n = sum(hp.master.numel() for hp in store.owned_params())
    host_gbps = n * 4 / t_host / 1e9
    return {
        "bench": "norm",
        "params": n,
        "tensors": len(grads),
        "threads": torch.get_num_threads(),
        "host_pass_s": round(t_host, 4),
        "host_pass_gbps": round(host_gbps, 2),
        "device_side_cpu_s": round(t_device, 4),
        "host_after_device_norms_s": round(t_after, 6),
        # relative error of each squared norm against a float64 reduction: torch's CPU fp32
        # reduction (the host pass) drifts with the tensor size, the chunked one less
        "host_pass_rel_err": f"{abs(got['host'] - exact) / exact:.1e}",
        "device_rel_err": f"{abs(got['device'] - exact) / exact:.1e}",
        "qwen3_1_7b_host_gb_per_step": round(QWEN3_1_7B_PARAMS * 4 / 1e9, 2),
        "qwen3_1_7b_host_pass_s_here": round(QWEN3_1_7B_PARAMS * 4 / 1e9 / host_gbps, 2),
        "qwen3_1_7b_tied_embedding_left_s_here": round(
            QWEN3_1_7B_EMBED_PARAMS * 4 / 1e9 / host_gbps, 2
        ),
    }


def project(acc: dict[str, Any], tail: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-1.7B (1.72 B parameters) sync step tail and gradient accumulation time, next to the
    H200's 0.80 s of compute per step: from this machine's measured tail time per parameter, from
    its measured accumulation GB/s (bytes model above), and from the H200 host's measured
    convert-and-add rate (gpu_measurements.md) with the same bytes model."""
    p = QWEN3_1_7B_PARAMS
    here_gbps = acc["new_add_gelem_s"] * ACCUMULATE_BYTES
    h200_gbps = H200_HOST_CONVERT_ADD_GELEM_S * ACCUMULATE_BYTES
    return {
        "bench": "projection_qwen3_1_7b",
        "params": p,
        "threads_here": torch.get_num_threads(),
        "gpu_compute_s_per_step": GPU_COMPUTE_S,
        "here_tail_from_measured_ns_per_param_s": round(tail["new_ns_per_param"] * 1e-9 * p, 2),
        "here_accumulate_gbps": round(here_gbps, 1),
        "here_tail_from_gbps_s": round(p * TAIL_BYTES / here_gbps / 1e9, 2),
        "here_accumulate_once_s": round(p * ACCUMULATE_BYTES / here_gbps / 1e9, 2),
        "h200_host_accumulate_gbps": round(h200_gbps, 1),
        "h200_host_tail_from_gbps_s": round(p * TAIL_BYTES / h200_gbps / 1e9, 2),
        "h200_host_accumulate_once_s": round(p * ACCUMULATE_BYTES / h200_gbps / 1e9, 2),
        "h200_host_accumulate_gas4_s": round(4 * p * ACCUMULATE_BYTES / h200_gbps / 1e9, 2),
    }


# --- grad_alloc: host memory the gradient downloads allocate per step -----------------------
GRAD_ALLOC_BASELINE = "1b495d5"  # issue 24's base: every download made a fresh host tensor
# A Qwen3 small enough for 2 CPU cores, bf16 with tied embeddings like Qwen3-1.7B: the tied
# weight gets two contributions per round (head, then embedding), the others one.
GRAD_ALLOC_MODEL: dict[str, Any] = {
    "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "vocab_size": 2048, "tie_word_embeddings": True,
}  # fmt: skip
# name -> (gradient accumulation steps, roundpipe settings); 2 CPU virtual devices
GRAD_ALLOC_RUNS: dict[str, tuple[int, dict[str, Any]]] = {
    # one round of 4 micro-batches per step: fp32 device gradients, sync and async optimizer
    "sync": (4, {"async_optimizer": False}),
    "async": (4, {"async_optimizer": True}),
    # one micro-batch per step: bf16 device gradients
    "sync_gas1": (1, {"async_optimizer": False}),
    # two rounds per step: every gradient has a second contribution from the second round
    "async_2_rounds": (4, {"async_optimizer": True, "round_size": 2}),
}


class _FreshHostBytes:
    """Counts the bytes of the host tensors a device's ``to_host`` allocates itself (no ``out``),
    by the stream thread that called it: "d2h" (gradient downloads, with the per-parameter norm
    vector) or "d2h_act" (activations). Wraps the device class's method, so the same count runs
    on any version of rp_engine."""

    def __init__(self, device_cls: type) -> None:
        self.bytes: dict[str, int] = {"d2h": 0, "d2h_act": 0, "other": 0}
        self.calls: dict[str, int] = {"d2h": 0, "d2h_act": 0, "other": 0}
        self._lock = threading.Lock()
        self._cls = device_cls
        self._orig = device_cls.to_host
        counter = self

        def to_host(dev_self: Any, dev: torch.Tensor, out: torch.Tensor | None = None) -> Any:
            result = counter._orig(dev_self, dev, out)
            if out is None:
                name = threading.current_thread().name
                role = name.rsplit("-", 1)[-1] if name.startswith("rp-") else "other"
                role = role if role in counter.bytes else "other"
                with counter._lock:
                    counter.bytes[role] += result.numel() * result.element_size()
                    counter.calls[role] += 1
            return result

        device_cls.to_host = to_host  # type: ignore[attr-defined]

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.bytes), dict(self.calls)

    def close(self) -> None:
        self._cls.to_host = self._orig  # type: ignore[attr-defined]


def _host_memory_stats() -> dict[str, Any] | None:
    """torch's caching host (pinned) allocator counters, where this torch has them and CUDA
    is available; None otherwise (CPU virtual devices never pin)."""
    fn = getattr(torch.cuda, "host_memory_stats", None)
    if fn is None or not torch.cuda.is_available():
        return None
    try:
        stats = fn()
    except Exception:  # noqa: BLE001 - an optional report, never a failure
        return None
    keep = ("allocations", "allocated_bytes", "reserved_bytes", "num_host_alloc")
    return {k: v for k, v in stats.items() if any(k.startswith(p) for p in keep)}


def grad_alloc_child(run: str, steps: int, warmup: int, devices: str) -> dict[str, Any]:
    """One engine in this process (whatever rp_engine PYTHONPATH gives): ``warmup`` steps, then
    ``steps`` measured ones; bytes of fresh host tensors per step, by download stream."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import rp_engine

    config = Qwen3Config(**GRAD_ALLOC_MODEL, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    mbs, seq = 2, 64
    gas, settings = GRAD_ALLOC_RUNS[run]
    cfg = {
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "roundpipe": {
            "devices": devices,
            "on_nonfinite": "ignore",
            # fixed cuts: the profile-driven planner could pick other ones for each process
            "fwd_cuts": [2, 2],
            "bwd_cuts": [0, 2, 2],
            **settings,
        },
    }
    engine, _, _, _ = rp_engine.initialize(model=model, config=cfg)
    gen = torch.Generator().manual_seed(1)

    def batch() -> dict[str, torch.Tensor]:
        ids = torch.randint(0, GRAD_ALLOC_MODEL["vocab_size"], (mbs, seq), generator=gen)
        return {"input_ids": ids, "labels": ids.clone()}

    counter = _FreshHostBytes(type(engine.pool[0]))
    try:
        for _ in range(warmup):
            engine.train_batch(iter([batch() for _ in range(gas)]))
        engine.synchronize()
        b0, c0 = counter.snapshot()
        h0 = _host_memory_stats()
        d0 = sum(d.memory_stats()["d2h_bytes"] for d in engine.pool)
        s0 = _staging_bytes(engine)
        for _ in range(steps):
            engine.train_batch(iter([batch() for _ in range(gas)]))
        engine.synchronize()
        b1, c1 = counter.snapshot()
        h1 = _host_memory_stats()
        d1 = sum(d.memory_stats()["d2h_bytes"] for d in engine.pool)
        s1 = _staging_bytes(engine)
    finally:
        counter.close()
        engine.destroy()
    fresh = (b1["d2h"] - b0["d2h"]) // steps
    staged = (s1 - s0) // steps
    out: dict[str, Any] = {
        "run": run,
        "steps": steps,
        # fresh to_host tensors plus staging buffers allocated (Device.host_buffer)
        "grad_fresh_host_bytes_per_step": fresh + staged,
        "grad_to_host_fresh_bytes_per_step": fresh,
        "grad_staging_alloc_bytes_per_step": staged,
        "grad_staging_bytes_after_warmup": s0,  # the pool's size: what is in flight at most
        "grad_fresh_host_tensors_per_step": (c1["d2h"] - c0["d2h"]) / steps,
        "act_fresh_host_bytes_per_step": (b1["d2h_act"] - b0["d2h_act"]) // steps,
        "d2h_bytes_per_step": (d1 - d0) // steps,
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    if h0 is not None and h1 is not None:  # the pinned caching allocator, per measured step
        out["cuda_host_memory_stats_after_warmup"] = h0
        out["cuda_host_memory_stats_delta_per_step"] = {
            k: (h1[k] - h0[k]) / steps for k in h1 if isinstance(h1[k], int | float) and k in h0
        }
    return out


def _staging_bytes(engine: Any) -> int:
    """Bytes the devices allocated for host buffers (``Device.host_buffer``: the gradient
    staging pools); 0 for a version of rp_engine without them."""
    return sum(d.memory_stats().get("host_alloc_bytes", 0) for d in engine.pool)


def _baseline_tree(ref: str, into: str) -> str:
    """``rp_engine`` of commit ``ref`` extracted under ``into`` (for PYTHONPATH)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    archive = subprocess.run(
        ["git", "-C", root, "archive", ref, "rp_engine"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def bench_grad_alloc(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per run configuration: the baseline commit's code and this tree's, each in its own
    process (same model, batches and steps), side by side."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": _baseline_tree(args.baseline, tmp), "after": here}
        for run in args.runs.split(","):
            row: dict[str, Any] = {"bench": "grad_alloc", "run": run, "baseline": args.baseline}
            for label, tree in trees.items():
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, here]))
                cmd = [
                    sys.executable, os.path.abspath(__file__), "grad_alloc", "--child", run,
                    "--steps", str(args.steps), "--devices", args.devices,
                    "--threads", str(args.threads),
                ]  # fmt: skip
                done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
                row[label] = json.loads(done.stdout.strip().splitlines()[-1])
            b, a = row["before"], row["after"]
            row["grad_fresh_bytes_per_step"] = {
                "before": b["grad_fresh_host_bytes_per_step"],
                "after": a["grad_fresh_host_bytes_per_step"],
            }
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", choices=["accumulate", "tail", "all", "gil", "norm", "grad_alloc"])
    ap.add_argument("--steps", type=int, default=3, help="grad_alloc: measured steps per run")
    ap.add_argument("--devices", default="cpu:2", help="grad_alloc: the engine's devices")
    ap.add_argument("--runs", default=",".join(GRAD_ALLOC_RUNS), help="grad_alloc: which runs")
    ap.add_argument(
        "--baseline", default=GRAD_ALLOC_BASELINE, help="grad_alloc: the 'before' commit"
    )
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)  # one grad_alloc measurement
    ap.add_argument(
        "--elements", type=int, default=12_582_912, help="accumulate: 12.6M (6144x2048)"
    )
    ap.add_argument("--params", type=int, default=200_000_000, help="tail: store size")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch/OpenMP threads (0: torch's default). On an oversubscribed host every "
        "multi-threaded op waits for a descheduled thread: measure with 1 there",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    acc = tail = None
    if args.what == "gil":
        print(json.dumps(bench_gil(args.params, args.repeats)), flush=True)
        return
    if args.what == "grad_alloc":
        if args.child:
            print(json.dumps(grad_alloc_child(args.child, args.steps, 2, args.devices)))
            return
        for row in bench_grad_alloc(args):
            print(json.dumps(row), flush=True)
        return
    if args.what == "norm":
        print(json.dumps(bench_norm(args.params, args.layers, args.repeats)), flush=True)
        return
    if args.what in ("accumulate", "all"):
        acc = bench_accumulate(args.elements, args.repeats)
        print(json.dumps(acc), flush=True)
    if args.what in ("tail", "all"):
        tail = bench_tail(args.params, args.layers, max(2, args.repeats // 2))
        print(json.dumps(tail), flush=True)
    if acc and tail:
        print(json.dumps(project(acc, tail)), flush=True)


if __name__ == "__main__":
    main()
