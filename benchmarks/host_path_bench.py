"""Host-path benchmarks: gradient accumulation into the fp32 arena and the optimizer step tail.

    python benchmarks/host_path_bench.py accumulate   # bf16 -> fp32 GB/s: old add_ vs arena
    python benchmarks/host_path_bench.py tail         # sync step tail, old vs new, N-param store
    python benchmarks/host_path_bench.py all          # both, then the 1.7B projection
    python benchmarks/host_path_bench.py gil          # a Python thread's longest pause during
                                                      # CPU Adam: sliced vs one kernel call
    python benchmarks/host_path_bench.py norm         # the step's squared norm: host pass over
                                                      # the fp32 gradients vs device-side norms

Old and new run interleaved in one process (A B A B ...), so machine noise hits both alike.
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
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    os.path.join(os.path.expanduser("~"), ".cache", "rp_engine", "torch_extensions"),
)

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", choices=["accumulate", "tail", "all", "gil", "norm"])
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
