"""How cheap can staleness compensation get on this CPU? (issue 28's cost target)

    python -m benchmarks.studies.compensation_floor [--elems 8388608] [--repeats 12] [--out F.json]

``engine_bench.py compensation_cost`` times the engine's layer step with compensation on and
off. This one asks what any implementation could reach here: hand-vectorized AVX2 + FMA variants
of the fused compensated step (``benchmarks/studies/csrc/compensation_floor.c``, compiled with the
engine's own kernel flags), timed interleaved with DeepSpeed's ``adam_update`` + cast ("off",
what the engine runs without compensation) and with what it runs with compensation, on one
tensor of ``--elems`` fp32 masters stepped in the engine's 2M-element slices on all cores. Each
row is seconds per step over the whole tensor, and its ratio to "off":

- ``engine_lookahead``: ``adam_update``, then each slice's look-ahead (``"lookahead"``);
- ``engine_lookahead_dc``: ``adam_step``, compensation, Adam and look-ahead in one pass
  (``"lookahead_dc"``); ``adam_step_plain`` / ``adam_step_lookahead``: the same pass without
  the compensation (without, and with, the look-ahead);

- ``stream``: the bytes the fused step moves, next to no arithmetic (the memory floor);
- ``hand_plain``: Adam + cast, one pass (no compensation);
- ``hand_lookahead`` / ``hand_dc`` / ``hand_lookahead_dc``: the engine's arithmetic, to ~23 bits;
- ``*_raw``: the look-ahead and the compensation's square root with the raw 12-bit
  ``rsqrt``/``rcp``, below the issue's "to fp32 rounding": a floor, not a candidate;
- ``hand_shared_*``: a cheaper method than the engine's, not validated for convergence: the
  look-ahead's m' over the denominator the update has just used (the csrc file says more).

Before timing, ``hand_lookahead_dc`` is checked against the engine's ``adam_step`` on the same
inputs (the largest differences are in the JSON), so the floor is the same computation.
Prints one JSON line; RESULTS.md quotes it with the command.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rp_engine.optim import publish_kernel
from rp_engine.optim.delay_compensation import BLOCK
from rp_engine.optim.loss_scaler import LossScaler
from rp_engine.optim.optimizer import ADAM_SLICE, HostOptimizer, build_inner_optimizer

SOURCE = Path(__file__).resolve().parent / "csrc" / "compensation_floor.c"
# name: (la, dc) of floor_step; la 4 is the memory stream
VARIANTS = {
    "stream": (4, 0),
    "hand_plain": (0, 0),
    "hand_lookahead": (1, 0),
    "hand_dc": (0, 1),
    "hand_lookahead_dc": (1, 1),
    "hand_lookahead_raw": (2, 0),
    "hand_dc_raw": (0, 2),
    "hand_lookahead_dc_raw": (2, 2),
    "hand_shared_lookahead": (3, 0),
    "hand_shared_lookahead_dc": (3, 1),
}
# the compensation's scalars of a mid-run step (vcoef ~ 1 / sqrt(1 - b2^s) early on, h = 1 /
# (rho rms(w)) for rms ~ 0.4): the arithmetic does not depend on them
DELAY = (31.6, 1e-8, 250.0)
STEP = 3


class Terms(ctypes.Structure):
    """``Terms`` of compensation_floor.c."""

    _fields_ = [
        (name, ctypes.c_float)
        for name in (
            "vcoef",
            "deps",
            "h",
            "b1",
            "b2",
            "step_size",
            "bc2",
            "eps",
            "w_decay",
            "pdecay",
            "pcoef",
            "peps",
            "pstep",
        )  # fmt: skip
    ]


def avx2_fma() -> bool:
    """Whether this CPU has AVX2 and FMA (the floor kernels' instruction set)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


def load() -> ctypes.CDLL:
    """The floor kernels, built with the engine's kernel flags (``publish_kernel``)."""
    cc = publish_kernel.compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC): the floor kernels cannot be built")
    lib = ctypes.CDLL(str(publish_kernel.build_library(SOURCE, cc)))
    lib.floor_step.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2 + [
        ctypes.POINTER(Terms), ctypes.c_void_p]  # fmt: skip
    lib.floor_step.restype = ctypes.c_int
    return lib


def _slices(n: int) -> list[slice]:
    return [slice(lo, min(lo + ADAM_SLICE, n)) for lo in range(0, n, ADAM_SLICE)]


def run(elems: int, repeats: int) -> dict[str, Any]:
    """The measurement (see the module's docstring); ``elems`` a multiple of 8."""
    if elems % 8 or elems <= 0:
        raise ValueError(f"--elems {elems}: expected a positive multiple of 8")
    if not avx2_fma():
        raise RuntimeError("this CPU has no AVX2 + FMA: the floor kernels are written for them")
    lib = load()
    gen = torch.Generator().manual_seed(0)
    w, g = torch.randn(elems, generator=gen), torch.randn(elems, generator=gen) * 1e-2
    m, v = torch.randn(elems, generator=gen) * 1e-3, torch.rand(elems, generator=gen) * 1e-5
    out = (w + torch.randn(elems, generator=gen) * 1e-3).to(torch.bfloat16)
    inner, _ = build_inner_optimizer("adamw", {"lr": 1e-3}, [{"params": [torch.zeros(1)]}])
    opt = HostOptimizer(inner, per_layer=True, scaler=LossScaler(cur_scale=1.0))
    group = opt.snapshot()[0]
    adam = opt._adam_terms(group, STEP)
    look = {**opt._step_terms(group, STEP + 1), "b1": adam.b1, "b2": adam.b2, "l2": 0.0}
    terms = Terms(*DELAY, adam.b1, adam.b2, adam.step_size, adam.bc2, adam.eps, adam.w_decay,
                  look["decay"], look["coef"], look["eps"],
                  opt._adam_terms(group, STEP + 1).step_size)  # fmt: skip
    sums = (ctypes.c_double * 3)()
    parts = _slices(elems)

    def floor(la: int, dc: int) -> Callable[[], None]:
        def go() -> None:
            for s in parts:
                failed = lib.floor_step(
                    g[s].data_ptr(), w[s].data_ptr(), m[s].data_ptr(), v[s].data_ptr(),
                    out[s].data_ptr(), s.stop - s.start, BLOCK, la, dc, ctypes.byref(terms),
                    ctypes.addressof(sums),
                )  # fmt: skip
                if failed:
                    raise MemoryError("the floor kernel could not allocate its scratch block")

        return go

    def deepspeed(lookahead: bool) -> Callable[[], None]:
        """The engine without compensation (DeepSpeed's kernel, then the cast), or with
        "lookahead" (the look-ahead written right after each slice's ``adam_update``)."""

        def go() -> None:
            for s in parts:
                inner.ds_opt_adam.adam_update(
                    inner.opt_id, STEP, group["lr"], adam.b1, adam.b2, adam.eps,
                    group["weight_decay"], True, w[s], g[s], m[s], v[s],
                )  # fmt: skip
                if lookahead:
                    publish_kernel.write_lookahead(w[s], g[s], m[s], v[s], out[s], **look)
                else:
                    publish_kernel.write_copy(w[s], out[s])

        return go

    def fused(delay: tuple[float, float, float] | None, publish: str | None) -> Callable[[], None]:
        def go() -> None:
            for s in parts:
                publish_kernel.adam_step(
                    g[s], w[s], m[s], v[s], out[s], adam=adam, block=BLOCK, delay=delay,
                    publish=publish, terms=look if publish else None,
                )  # fmt: skip

        return go

    agreement = _agreement(lib, terms, adam, look, elems)
    runs: dict[str, Callable[[], None]] = {
        "off": deepspeed(False),
        "engine_lookahead": deepspeed(True),
        "engine_lookahead_dc": fused(DELAY, "lookahead"),
        "adam_step_plain": fused(None, None),
        "adam_step_lookahead": fused(None, "lookahead"),
        **{name: floor(*lv) for name, lv in VARIANTS.items()},
    }
    for fn in runs.values():  # warm: pages, kernels, the OpenMP team
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(t) for k, t in times.items()}
    return {
        "bench": "compensation_floor",
        "elems": elems,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu": _cpu(),
        "seconds": med,
        "vs_off": {k: t / med["off"] for k, t in med.items()},
        "ns_per_elem": {k: t / elems * 1e9 for k, t in med.items()},
        "agreement_with_adam_step": agreement,
    }


def _agreement(lib: ctypes.CDLL, terms: Terms, adam: Any, look: dict[str, float], n: int) -> dict:
    """``hand_lookahead_dc`` against the engine's ``adam_step`` on four blocks of fresh inputs,
    as ratios to the bounds of tests/unit/test_publish_kernel.py's fused-step test (at most 1:
    the same computation to fp32 rounding): the masters within 2 roundings of w plus 1e-5 of the
    update, the moments within 1e-5 of their two terms, and the compute weights in bf16 ulps."""
    n = min(n, 4 * BLOCK)
    gen = torch.Generator().manual_seed(1)
    w, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    m, v = torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-5
    out = (w + torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16)
    mine = [t.clone() for t in (g, w, m, v, out)]
    theirs = [t.clone() for t in (g, w, m, v, out)]
    sums = (ctypes.c_double * 3)()
    lib.floor_step(*(t.data_ptr() for t in mine), n, BLOCK, 1, 1, ctypes.byref(terms),
                   ctypes.addressof(sums))  # fmt: skip
    publish_kernel.adam_step(*theirs, adam=adam, block=BLOCK, delay=DELAY, publish="lookahead",
                             terms=look)  # fmt: skip
    update = (theirs[1] - w).abs()
    w_bound = 2 * theirs[1].abs() * 2**-24 + update * 1e-5 + 1e-30
    gmax = g.abs().max() * 4  # the compensated gradient stays near the raw one's scale
    m_bound = 1e-5 * (adam.b1 * m.abs() + (1 - adam.b1) * gmax) + 1e-30
    v_bound = 1e-5 * (adam.b2 * v.abs() + (1 - adam.b2) * gmax**2) + 1e-30
    ulp = theirs[4].float().abs() * torch.finfo(torch.bfloat16).eps
    return {
        "w_err_over_bound": float(((mine[1] - theirs[1]).abs() / w_bound).max()),
        "m_err_over_bound": float(((mine[2] - theirs[2]).abs() / m_bound).max()),
        "v_err_over_bound": float(((mine[3] - theirs[3]).abs() / v_bound).max()),
        "out_err_ulps": float(((mine[4].float() - theirs[4].float()).abs() / ulp).max()),
    }


def _cpu() -> dict[str, Any]:
    flags = set()
    model = platform.processor()
    try:
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {
        "model": model,
        "cores": os.cpu_count(),
        "avx512f": "avx512f" in flags,
        "avx2": "avx2" in flags,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elems", type=int, default=1 << 23, help="fp32 masters stepped per step")
    p.add_argument("--repeats", type=int, default=12, help="interleaved repeats (median)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    result = run(args.elems, args.repeats)
    line = json.dumps(result)
    print(line)
    if args.out is not None:
        args.out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
