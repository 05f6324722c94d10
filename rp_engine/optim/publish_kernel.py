"""Vectorized publish kernels: fp32 masters (and Adam's moments) into the compute weights.

Publishing writes the weights an iteration reads: a cast of the fp32 masters (bf16, fp16 or
fp32), or with weight prediction (``roundpipe.staleness_compensation: "predict"``) one Adam step
ahead of them, ``decay * w + coef * m / (sqrt(v) + eps)``. The stepper writes both right after
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
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from rp_engine.optim.jit_cache import cpu_adam_cache_dir

__all__ = ["write_copy", "write_prediction", "write_lookahead", "native"]

log = logging.getLogger("rp_engine.optim")

_SOURCE = Path(__file__).with_name("csrc") / "publish.c"
# Approximate reciprocals (-mrecip with one Newton step: ~23 bits) for the sqrt and division of
# the prediction's step term. These flags are given to the compile only: linking with them
# would pull in crtfastmath.o, which turns on flush-to-zero for the whole process.
_CFLAGS = [
    "-O3", "-march=native", "-fPIC", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
    "-ffinite-math-only", "-fno-signed-zeros", "-funsafe-math-optimizations", "-mrecip=all",
]  # fmt: skip

_F32, _I64 = ctypes.c_float, ctypes.c_int64
_P = ctypes.c_void_p


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _build(cc: str) -> Path:
    """Compile ``csrc/publish.c`` into the cache (once per source, flags and compiler) and
    return the shared library's path; concurrent processes each build to a temporary name and
    rename it into place."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        _SOURCE.read_bytes() + " ".join(_CFLAGS).encode() + version.encode()
    ).hexdigest()[:16]
    out = Path(cpu_adam_cache_dir()) / "rp_publish" / f"publish-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, lib = Path(tmp) / "publish.o", Path(tmp) / "publish.so"
        subprocess.run([cc, *_CFLAGS, "-c", str(_SOURCE), "-o", str(obj)], check=True,
                       capture_output=True)  # fmt: skip
        subprocess.run([cc, "-shared", "-fopenmp", str(obj), "-o", str(lib)], check=True,
                       capture_output=True)  # fmt: skip
        os.replace(lib, out)
    return out


@lru_cache(maxsize=1)
def native() -> ctypes.CDLL | None:
    """The compiled kernels, or None (no C compiler, or the build failed: torch fallback)."""
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler (cc, gcc or $CC): publishing compute weights with torch ops")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
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
    for name in ("copy_bf16", "copy_f16", "predict_bf16", "predict_f16", "predict_f32",
                 "lookahead_bf16", "lookahead_f16", "lookahead_f32"):  # fmt: skip
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
