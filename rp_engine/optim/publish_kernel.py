"""Vectorized publish kernels: fp32 masters (and Adam's moments) into the compute weights.

Publishing writes the weights an iteration reads: a cast of the fp32 masters (bf16, fp16 or
fp32), or with weight prediction (``roundpipe.staleness_compensation: "predict"``) one Adam step
ahead of them, ``decay * w + coef * m / (sqrt(v) + eps)``; with delay compensation
(``"lookahead_dc"``) the gradient is first moved, in place, from the weights it was taken at to
the masters it is applied at (``compensate_delay``), reading the compute weights before the
publish overwrites them, and ``adam_step`` does that, the Adam update (DeepSpeed's formula) and
the look-ahead in one pass per cache-sized block. The stepper writes both right after
DeepSpeed's CPU Adam has stepped a cache-sized slice (optim/optimizer.py), so the slice is read
from cache, and the prediction must cost little more than the cast: torch would run it as five
elementwise calls with temporaries. ``csrc/publish.c`` does each in one vectorized loop.

The C file is compiled on first use with the system C compiler (``$CC``, else ``cc``) at
``-O3 -march=native``, into the same user cache as DeepSpeed's JIT-built CPU Adam
(``cpu_adam_cache_dir``), keyed by the source, the flags and the compiler, and loaded with
ctypes: no torch headers, well under a second to build. Where no compiler works the same
functions fall back to torch ops (same results for the casts; the prediction to fp32 rounding)
and a warning says so once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from rp_engine.host.jit_cache import cpu_adam_cache_dir

__all__ = [
    "write_copy",
    "write_prediction",
    "write_lookahead",
    "compensate_delay",
    "adam_step",
    "AdamTerms",
    "native",
    "build_library",
    "compiler",
]

log = logging.getLogger("rp_engine.optim")

_SOURCE = Path(__file__).with_name("csrc") / "publish.c"
# Approximate reciprocals (-mrecip with one Newton step: ~23 bits) for the sqrt and division of
# the prediction's step term. These flags are given to the compile only: linking with them
# would pull in crtfastmath.o, which turns on flush-to-zero for the whole process. The vector
# width is the widest the CPU has (DeepSpeed's kernel uses it too): -march=native alone takes
# the tuning's preference, which is 128 bits on a first-generation EPYC (family 23 model 1,
# gcc's znver1: it runs a 256-bit instruction as two halves). The 256-bit loops still run
# faster there (fewer instructions to issue): a fifth to a third less time for the fused step.
_CFLAGS = [
    "-O3", "-march=native", "-fPIC", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
    "-ffinite-math-only", "-fno-signed-zeros", "-funsafe-math-optimizations", "-mrecip=all",
    "-mprefer-vector-width=512",
]  # fmt: skip

_F32, _I64 = ctypes.c_float, ctypes.c_int64
_P = ctypes.c_void_p


def compiler() -> str | None:
    """The C compiler the kernels are built with: ``$CC``, else ``cc``, else ``gcc``; None
    when there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def build_library(source: Path, cc: str) -> Path:
    """Compile the C file ``source`` with ``cc`` and ``_CFLAGS`` into the cache (once per
    source, flags and compiler) and return the shared library's path; concurrent processes
    each build to a temporary name and rename it into place. Raises ``CalledProcessError``
    (with the compiler's stderr) when the build fails. benchmarks/studies/compensation_floor.py builds
    its kernels with it, so that they are compiled exactly as these are."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        source.read_bytes() + " ".join(_CFLAGS).encode() + version.encode()
    ).hexdigest()[:16]
    out = Path(cpu_adam_cache_dir()) / "rp_publish" / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, lib = Path(tmp) / f"{source.stem}.o", Path(tmp) / f"{source.stem}.so"
        subprocess.run([cc, *_CFLAGS, "-c", str(source), "-o", str(obj)], check=True,
                       capture_output=True)  # fmt: skip
        subprocess.run([cc, "-shared", "-fopenmp", str(obj), "-o", str(lib)], check=True,
                       capture_output=True)  # fmt: skip
        os.replace(lib, out)
    return out


@lru_cache(maxsize=1)
def native() -> ctypes.CDLL | None:
    """The compiled kernels, or None (no C compiler, or the build failed: torch fallback)."""
    cc = compiler()
    if cc is None:
        log.warning("no C compiler (cc, gcc or $CC): publishing compute weights with torch ops")
        return None
    try:
        lib = ctypes.CDLL(str(build_library(_SOURCE, cc)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning(
            "building %s failed (%s%s): publishing compute weights with torch ops",
            _SOURCE.name, exc, ": " + detail.decode(errors="replace")[:500] if detail else "",
        )  # fmt: skip
        return None
    for name in ("rp_copy_bf16", "rp_copy_f16"):
        getattr(lib, name).argtypes = [_P, _P, _I64]
    for name in ("rp_predict_bf16", "rp_predict_f16", "rp_predict_f32"):
        getattr(lib, name).argtypes = [_P, _P, _P, _P, _I64, _F32, _F32, _F32]
    for suffix in ("bf16", "f16", "f32"):
        getattr(lib, f"rp_lookahead_{suffix}").argtypes = [_P] * 5 + [_I64] + [_F32] * 6
    for suffix in ("bf16", "f16", "f32"):
        getattr(lib, f"rp_delay_{suffix}").argtypes = [_P] * 4 + [_I64] * 2 + [_F32] * 3 + [_P]
    for suffix in ("bf16", "f16", "f32"):
        getattr(lib, f"rp_adam_{suffix}").argtypes = (
            [_P] * 5
            + [_I64] * 2
            + [ctypes.c_int]
            + [_F32] * 10
            + [ctypes.c_int]
            + [_F32] * 4
            + [_P]
        )
        getattr(lib, f"rp_adam_{suffix}").restype = ctypes.c_int  # 0, or the scratch failed
    for name in ("copy_bf16", "copy_f16", "predict_bf16", "predict_f16", "predict_f32",
                 "lookahead_bf16", "lookahead_f16", "lookahead_f32", "delay_bf16", "delay_f16",
                 "delay_f32"):  # fmt: skip
        getattr(lib, f"rp_{name}").restype = None
    return lib


_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def _flat_ok(*tensors: torch.Tensor) -> bool:
    n = tensors[0].numel()
    return all(t.is_contiguous() and t.device.type == "cpu" and t.numel() == n for t in tensors)


@torch.no_grad()
def write_copy(master: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst.copy_(master)`` for an fp32 master: the cast rounds to nearest even, as torch's."""
    lib = native()
    suffix = _SUFFIX.get(dst.dtype)
    if (
        lib is None or suffix in (None, "f32") or master.dtype != torch.float32
        or not _flat_ok(master, dst)
    ):  # fmt: skip
        dst.copy_(master)
        return
    getattr(lib, f"rp_copy_{suffix}")(master.data_ptr(), dst.data_ptr(), master.numel())


@torch.no_grad()
def write_prediction(
    w: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    dst: torch.Tensor,
    *,
    decay: float,
    coef: float,
    eps: float,
) -> None:
    """``dst = decay * w + coef * m / (sqrt(v) + eps)`` (fp32 inputs of one shape; ``dst``
    bf16, fp16 or fp32), in one pass. The step term is computed with ~23-bit reciprocals: it
    is a small correction to ``w``, far finer than the bf16 rounding of the sum."""
    lib = native()
    suffix = _SUFFIX.get(dst.dtype)
    if lib is None or suffix is None or not _flat_ok(w, m, v, dst):
        den = torch.sqrt(v).add_(eps)
        base = w * decay if decay != 1.0 else w
        dst.copy_(torch.addcdiv(base, m, den, value=coef))
        return
    getattr(lib, f"rp_predict_{suffix}")(
        w.data_ptr(), m.data_ptr(), v.data_ptr(), dst.data_ptr(), w.numel(), decay, coef, eps
    )


@torch.no_grad()
def write_lookahead(
    w: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    dst: torch.Tensor,
    *,
    decay: float,
    b1: float,
    b2: float,
    coef: float,
    eps: float,
    l2: float,
) -> None:
    """The look-ahead prediction in one pass: with ``gg = g + l2 * w``, the next moments
    ``m' = b1 m + (1 - b1) gg`` and ``v' = b2 v + (1 - b2) gg^2``, then ``dst = decay * w +
    coef * m' / (sqrt(v') + eps)`` (fp32 inputs of one shape; ``dst`` bf16, fp16 or fp32).
    ``m`` and ``v`` are read, never written."""
    lib = native()
    suffix = _SUFFIX.get(dst.dtype)
    if lib is None or suffix is None or not _flat_ok(w, g, m, v, dst):
        gg = g + w * l2 if l2 else g
        m1 = torch.lerp(gg, m, b1)  # b1 m + (1 - b1) gg
        v1 = torch.lerp(gg * gg, v, b2)
        base = w * decay if decay != 1.0 else w
        dst.copy_(torch.addcdiv(base, m1, v1.sqrt_().add_(eps), value=coef))
        return
    getattr(lib, f"rp_lookahead_{suffix}")(
        w.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), dst.data_ptr(), w.numel(),
        decay, b1, b2, coef, eps, l2,
    )  # fmt: skip


@torch.no_grad()
def compensate_delay(
    g: torch.Tensor,
    w: torch.Tensor,
    v: torch.Tensor,
    read: torch.Tensor,
    *,
    block: int,
    vcoef: float,
    eps: float,
    h: float,
) -> tuple[float, float, float]:
    """Delay compensation of one slice, in place on the gradient ``g`` (fp32, unscaled and
    clipped), taken at the compute weights ``read`` (bf16, fp16 or fp32) and applied at the
    masters ``w``: with ``f = (sqrt(v) * vcoef + eps) * h * (w - read)`` (``v`` Adam's second
    moment, ``vcoef`` its bias correction 1 / sqrt(1 - b2^s)), each ``block`` elements of ``g``
    become ``(g + f) * |g| / |g + f|`` over the block (h = 0: unchanged). Returns the slice's
    sums of ``g^2``, ``(g + f)^2`` and ``w^2`` (before the update): the last gives the tensor's
    scale for its next step (optim/delay_compensation.py). Reads ``w``, ``v`` and ``read`` and
    writes nothing else."""
    lib = native()
    suffix = _SUFFIX.get(read.dtype)
    if lib is None or suffix is None or not _flat_ok(g, w, v, read):
        flat = g.view(-1)
        fix = v.sqrt().mul_(vcoef).add_(eps).mul_(w - read.float()).mul_(h).view(-1)
        sg = sc = 0.0
        for lo in range(0, flat.numel(), block):
            gb, cb = flat[lo : lo + block], flat[lo : lo + block] + fix[lo : lo + block]
            bg, bc = float(gb.double().square().sum()), float(cb.double().square().sum())
            gb.copy_(cb * (math.sqrt(bg / bc) if bc > 0 else 1.0))
            sg, sc = sg + bg, sc + bc
        return sg, sc, float(w.double().square().sum())
    out = (ctypes.c_double * 3)()
    getattr(lib, f"rp_delay_{suffix}")(
        g.data_ptr(), w.data_ptr(), v.data_ptr(), read.data_ptr(), g.numel(), block,
        vcoef, eps, h, ctypes.addressof(out),
    )  # fmt: skip
    return out[0], out[1], out[2]


@dataclass(frozen=True)
class AdamTerms:
    """One Adam/AdamW step's scalars as DeepSpeed's CPU Adam folds them (cpu_adam.h): ``w +=
    w_decay * w`` (AdamW's decay, -lr wd), then ``w += step_size * m / (sqrt(v) * bc2 + eps)``
    with ``step_size`` = -lr / (1 - b1^t) and ``bc2`` = 1 / sqrt(1 - b2^t), after ``l2 * w``
    (Adam's L2 decay) is added to the gradient."""

    b1: float
    b2: float
    step_size: float
    bc2: float
    eps: float
    w_decay: float
    l2: float


_KINDS = {None: 0, "predict": 1, "lookahead": 2}


@torch.no_grad()
def adam_step(
    g: torch.Tensor,
    w: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    *,
    adam: AdamTerms,
    block: int,
    delay: tuple[float, float, float] | None = None,
    publish: str | None = None,
    terms: dict[str, float] | None = None,
) -> tuple[float, float, float]:
    """One Adam step of a slice fused with what is around it, block by block while each block
    is in cache: the delay compensation of ``g`` from ``out``'s old values (``delay`` =
    ``compensate_delay``'s vcoef, eps and h; None: none), the update of ``w``, ``m`` and ``v``
    (``adam``, DeepSpeed's formula and order of operations) with the compensated gradient, and
    the publish of the new ``w`` into ``out``: the cast (``publish`` None),
    ``write_prediction``'s or ``write_lookahead``'s (with ``terms``; the look-ahead repeats the
    compensated gradient). The same values as those calls one after the other, to fp32 rounding
    (~23-bit reciprocals for sqrt and division), in one pass over memory instead of three. ``g``
    is read, never written (the compensated block lives in a per-thread scratch block: writing
    the gradient back would cost memory bandwidth). Returns ``compensate_delay``'s sums (zeros
    without ``delay``). Raises MemoryError when the scratch cannot be allocated."""
    kind = _KINDS[publish]
    lib = native()
    suffix = _SUFFIX.get(out.dtype)
    if lib is None or suffix is None or not _flat_ok(g, w, m, v, out):
        sums = (0.0, 0.0, 0.0)
        if delay is not None:
            vcoef, eps, h = delay
            g = g.clone()  # compensated in a copy: the gradient itself is left as it is
            sums = compensate_delay(g, w, v, out, block=block, vcoef=vcoef, eps=eps, h=h)
        gd = g + w * adam.l2 if adam.l2 else g
        # 1 - beta as DeepSpeed computes it, from the fp32 beta (exact: Sterbenz)
        nb1, nb2 = (1.0 - struct.unpack("f", struct.pack("f", b))[0] for b in (adam.b1, adam.b2))
        m.mul_(adam.b1).add_(gd, alpha=nb1)
        v.mul_(adam.b2).addcmul_(gd, gd, value=nb2)
        if adam.w_decay:
            w.add_(w * adam.w_decay)
        w.addcdiv_(m, v.sqrt().mul_(adam.bc2).add_(adam.eps), value=adam.step_size)
        if kind == 0:
            write_copy(w, out)
        elif kind == 1:
            assert terms is not None
            write_prediction(w, m, v, out, **terms)
        else:
            assert terms is not None
            write_lookahead(w, g, m, v, out, **terms)
        return sums
    dv, de, dh = delay if delay is not None else (1.0, 0.0, 0.0)
    t = terms or {}
    result = (ctypes.c_double * 3)()
    failed = getattr(lib, f"rp_adam_{suffix}")(
        g.data_ptr(), w.data_ptr(), m.data_ptr(), v.data_ptr(), out.data_ptr(), g.numel(), block,
        int(delay is not None), dv, de, dh,
        adam.b1, adam.b2, adam.step_size, adam.bc2, adam.eps, adam.w_decay, adam.l2,
        kind, t.get("decay", 1.0), t.get("coef", 0.0), t.get("eps", 0.0), t.get("l2", 0.0),
        ctypes.addressof(result),
    )  # fmt: skip
    if failed:
        raise MemoryError(
            f"the compensated Adam step could not allocate its {block * 4} B scratch block per "
            + ("thread (nothing was stepped)" if failed == -1 else "thread, part-way through")
        )
    return result[0], result[1], result[2]
