"""DeepSpeed's CPU Adam step, called without holding the GIL.

DeepSpeed 0.19.8 binds its CPU Adam step (``adam_update`` -> ``ds_adam_step``) through pybind11
without ``gil_scoped_release``: while one call runs, every other Python thread of the process
(the pipeline's compute, upload and download threads, which issue every kernel, copy and event
wait) is stalled. ``GilFreeAdam`` calls the *same* C++ function of the *same* loaded op through
ctypes, which drops the GIL for the length of a foreign call: the math, the SIMD path and the
results are DeepSpeed's, bit for bit, and the pipeline threads run beside it.

How: ``ds_adam_step(int, size_t, float x5, bool, at::Tensor& x4)`` is an exported symbol of the
op's shared object (its mangled name below). An ``at::Tensor`` is one intrusive pointer to its
``TensorImpl``, and ``torch.Tensor._cdata`` is that pointer, so a ``c_void_p`` cell holding it
is a valid ``at::Tensor&`` for a callee that only copies it (``.contiguous()``: reference count
up and down, atomically) and reads its data pointer. The Python tensors stay referenced for the
call, so nothing is freed under it. Only float32 contiguous tensors of one size are passed (the
function would otherwise throw a C++ exception, which must not cross ctypes): anything else goes
through DeepSpeed's binding.

DeepSpeed keeps its optimizers in a process-wide ``std::unordered_map`` that ``ds_adam_step``
reads and ``create_adam`` / ``destroy_adam`` (a ``DeepSpeedCPUAdam`` being built or collected,
on any thread) write. Under the GIL they could never overlap; without it they could. The op
module is one object per process (DeepSpeed's ``OpBuilder._loaded_ops``), so its
``create_adam`` and ``destroy_adam`` are wrapped once to take the writer side of a
readers-writer lock whose reader side each GIL-free step holds.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["GilFreeAdam", "gil_free_adam"]

log = logging.getLogger("rp_engine.optim")

# int ds_adam_step(int, size_t, float, float, float, float, float, bool, at::Tensor& x4)
_SYMBOL = "_Z12ds_adam_stepimfffffbRN2at6TensorES1_S1_S1_"
_ARGTYPES: list[type[Any]] = [ctypes.c_int, ctypes.c_size_t, *[ctypes.c_float] * 5, ctypes.c_bool]
_ARGTYPES += [ctypes.c_void_p] * 4


class _MapLock:
    """Readers-writer lock over DeepSpeed's optimizer map: many steps at once, or one create or
    destroy. A writer on a thread that itself holds a read (a garbage collection run inside the
    short Python part of a read section) does not wait for its own read, which cannot be inside
    the C call while this thread runs Python."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers: Counter[int] = Counter()

    @contextmanager
    def read(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            self._readers[me] += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers[me] -= 1
                if not self._readers[me]:
                    del self._readers[me]
                self._cond.notify_all()

    def write(self, fn: Callable[..., Any], *args: Any) -> Any:
        me = threading.get_ident()
        with self._cond:
            self._cond.wait_for(lambda: all(t == me for t in self._readers))
            return fn(*args)


_MAP_LOCK = _MapLock()


class GilFreeAdam:
    """``adam_update`` of one loaded DeepSpeed CPU Adam op, without the GIL (module docstring).

    ``update`` takes ``adam_update``'s arguments and returns what it returns."""

    def __init__(self, op: Any, fn: Any) -> None:
        self._op = op
        self._fn = fn

    def update(
        self,
        opt_id: int,
        step: int,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        bias_correction: bool,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
    ) -> int:
        tensors = (param, grad, exp_avg, exp_avg_sq)
        if not all(_passable(t, param.numel()) for t in tensors):
            # DeepSpeed's binding: its own checks (and C++ exceptions) apply
            return int(self._op.adam_update(
                opt_id, step, lr, beta1, beta2, eps, weight_decay, bias_correction, *tensors
            ))  # fmt: skip
        cells = [ctypes.c_void_p(t._cdata) for t in tensors]  # each an at::Tensor
        refs = [ctypes.addressof(c) for c in cells]
        with _MAP_LOCK.read():
            return int(self._fn(
                opt_id, step, lr, beta1, beta2, eps, weight_decay, bias_correction, *refs
            ))  # fmt: skip


def _passable(t: torch.Tensor, numel: int) -> bool:
    """What ``ds_adam_step`` takes without throwing: float32 CPU tensors of one size (it makes
    them contiguous itself, but a copy would not write back, so contiguous ones only)."""
    return (
        t.dtype == torch.float32
        and t.device.type == "cpu"
        and t.is_contiguous()
        and t.numel() == numel
        and not t.requires_grad
    )


_CACHE: dict[int, GilFreeAdam | None] = {}
_CACHE_LOCK = threading.Lock()


def gil_free_adam(op: Any) -> GilFreeAdam | None:
    """The GIL-free caller of DeepSpeed CPU Adam op module ``op`` (``DeepSpeedCPUAdam``'s
    ``ds_opt_adam``), or None where its shared object does not export ``ds_adam_step`` as
    expected (another DeepSpeed version): the caller then uses ``op.adam_update``.

    The first call wraps ``op.create_adam`` / ``op.destroy_adam`` with the map lock (module
    docstring); later calls return the same object."""
    with _CACHE_LOCK:
        key = id(op)
        if key not in _CACHE:
            _CACHE[key] = _resolve(op)
        return _CACHE[key]


def _resolve(op: Any) -> GilFreeAdam | None:
    path = getattr(op, "__file__", None)
    try:
        fn = getattr(ctypes.CDLL(path), _SYMBOL) if path else None
    except (OSError, AttributeError):
        fn = None
    if fn is None:
        log.warning(
            "DeepSpeed's CPU Adam op (%s) does not export ds_adam_step as DeepSpeed 0.19.8 does: "
            "each Adam slice runs through its pybind11 binding, holding the GIL",
            path,
        )
        return None
    fn.argtypes = _ARGTYPES
    fn.restype = ctypes.c_int
    for name in ("create_adam", "destroy_adam"):
        original = getattr(op, name)
        if not getattr(original, "_rp_map_locked", False):
            setattr(op, name, _locked(original))
    return GilFreeAdam(op, fn)


def _locked(original: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        return _MAP_LOCK.write(original, *args)

    call._rp_map_locked = True  # type: ignore[attr-defined]
    return call
