"""Deferred values: the loss ``engine(batch)`` returns before its accumulation window has run.

DeepSpeed's loop (``loss = engine(batch); engine.backward(loss); engine.step()``) runs fastest
when the whole accumulation window runs as one RoundPipe schedule (loop.py). So the forward of a
training micro-batch only queues it and returns a :class:`DeferredValue`: a 0-dim tensor whose
value is computed when the window runs. It behaves as the loss would:

- arithmetic and tensor methods (``loss / 4``, ``loss.detach()``, ``loss.float()``,
  ``torch.isnan(loss)``, in-place ``loss *= 2``) are recorded, not run: the result is another
  deferred value;
- anything that needs the number (``loss.item()``, ``float(loss)``, ``print(loss)``,
  ``f"{loss:.3f}"``, ``bool(loss > 0)``, ``.numpy()``, an in-place op on an ordinary tensor such
  as ``total += loss``) first runs what the engine has queued (``Leaf``'s resolver), so a read can
  never see a placeholder; from then on every operation on it is an ordinary one;
- metadata (``shape``, ``dtype``, ``device``, ``requires_grad``, ``dim()``) is answered at once.

``engine.backward(value)`` needs d(value)/d(the engine's loss) before the window runs. Recorded
expressions made only of operations that are affine in the deferred loss (sums, scaling by a
constant, division by a constant, dtype and view changes, detach) have a derivative that does not
depend on the loss's value: :func:`derivative` replays the expression on a stand-in and returns
it, exactly as autograd would at the real value. Anything else (``loss ** 2``, ``loss.clamp()``,
``log(loss)``) returns None: the engine then computes that micro-batch's loss first, as without
deferral (loop.py's fallback).

Pure torch: this module knows nothing of the engine (a leaf's resolver is a callable).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._C import DisableTorchFunctionSubclass

__all__ = ["DeferredValue", "Leaf", "derivative", "is_deferred", "resolve", "leaf_of"]

# Operations affine in their deferred operands, whose derivative is independent of the value.
# Checked by name: ``torch.add``, ``Tensor.add`` and ``Tensor.__add__`` all qualify.
_SUMS = frozenset(
    "add sub rsub __add__ __radd__ __sub__ __rsub__ add_ sub_ __iadd__ __isub__".split()
)
_PRODUCTS = frozenset("mul multiply __mul__ __rmul__ mul_ __imul__".split())  # one factor deferred
_QUOTIENTS = frozenset("div divide true_divide __truediv__ div_ __itruediv__".split())  # numerator
_UNARY = frozenset(
    (
        "neg negative __neg__ __pos__ positive clone detach detach_ to float double half "
        "bfloat16 type_as reshape view view_as squeeze unsqueeze flatten contiguous sum mean "
        "cpu cuda expand expand_as"
    ).split()
)
# Answered from the placeholder's metadata, without the value (``shape`` etc. are getters).
_METADATA = frozenset(
    (
        "__get__ size dim ndimension numel nelement element_size is_floating_point is_complex "
        "is_signed get_device stride is_contiguous is_pinned data_ptr __hash__ __len__"
    ).split()
)
_OBJECT_ITSELF = frozenset("requires_grad_ retain_grad register_hook".split())
# Reads of the value: run what it waits for at once (no probe on the placeholder).
_READS = frozenset(
    (
        "__float__ __int__ __bool__ __index__ __complex__ item tolist numpy __array__ "
        "__format__ __repr__ __str__"
    ).split()
)
_NOT_INPLACE_DUNDERS = frozenset("__init__ __iter__ __index__ __int__ __invert__".split())


class _Thunk:
    """A node of a recorded expression: a leaf (the engine's loss) or an operation."""

    linear = True

    def value(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def resolved(self) -> bool:
        raise NotImplementedError

    def replay(self, env: dict[int, torch.Tensor]) -> torch.Tensor:
        """The expression with each leaf ``id(leaf)`` in ``env`` replaced (others: 0)."""
        raise NotImplementedError

    def leaves(self) -> Iterator[Leaf]:
        raise NotImplementedError


class Leaf(_Thunk):
    """The engine's loss of one micro-batch. ``resolve()`` runs the engine's queued work, which
    ends with :meth:`set`; ``placeholder`` gives the metadata (never a value anyone reads)."""

    def __init__(self, resolve: Callable[[], None], placeholder: torch.Tensor) -> None:
        self._resolve: Callable[[], None] | None = resolve
        self.placeholder = placeholder
        self._value: torch.Tensor | None = None
        self._error: BaseException | None = None

    def set(self, value: torch.Tensor) -> None:
        self._value = value.detach().to(self.placeholder.dtype)
        self._resolve = None  # the engine (and its batch) need not stay alive for it

    def fail(self, error: BaseException) -> None:
        """The work this value waited for is gone: reading it raises (never a placeholder)."""
        self._error = error
        self._resolve = None

    @property
    def resolved(self) -> bool:
        return self._value is not None

    def value(self) -> torch.Tensor:
        if self._value is None:
            if self._error is not None or self._resolve is None:
                raise RuntimeError(
                    "this loss was never computed: the accumulation window it belonged to was "
                    f"discarded ({self._error!r})"
                ) from self._error
            self._resolve()
            if self._value is None:  # pragma: no cover - the resolver's contract
                raise RuntimeError("rp_engine: the engine did not compute a deferred loss")
        return self._value

    def replay(self, env: dict[int, torch.Tensor]) -> torch.Tensor:
        if id(self) in env:
            return env[id(self)]
        return torch.zeros_like(self.placeholder)

    def leaves(self) -> Iterator[Leaf]:
        yield self


class _Ref:
    """Marks where a deferred operand sat in a recorded call's arguments."""

    __slots__ = ("thunk",)

    def __init__(self, thunk: _Thunk) -> None:
        self.thunk = thunk


class _Op(_Thunk):
    """``func(*args, **kwargs)`` with deferred operands, evaluated when its value is needed."""

    def __init__(self, func: Callable[..., Any], args: tuple, kwargs: dict, *, clone: bool) -> None:
        self.func = func
        self.clone = clone  # an in-place op recorded on a copy of its target
        # the operands' thunks are captured now: a later in-place op rebinds the tensor object
        self.args, self.kwargs = pytree.tree_map_only(
            DeferredValue, lambda d: _Ref(d._thunk), (args, kwargs)
        )
        self._value: torch.Tensor | None = None
        self.linear = _affine(func, self.args, self.kwargs) and all(
            t.linear for t in self._operands()
        )

    def _operands(self) -> list[_Thunk]:
        refs = pytree.tree_leaves((self.args, self.kwargs), is_leaf=lambda x: isinstance(x, _Ref))
        return [r.thunk for r in refs if isinstance(r, _Ref)]

    @property
    def resolved(self) -> bool:
        return self._value is not None or all(t.resolved for t in self._operands())

    def _call(self, get: Callable[[_Thunk], torch.Tensor]) -> torch.Tensor:
        args, kwargs = pytree.tree_map_only(_Ref, lambda r: get(r.thunk), (self.args, self.kwargs))
        if self.clone:
            args = (args[0].clone(), *args[1:])
        with DisableTorchFunctionSubclass():
            return self.func(*args, **kwargs)  # type: ignore[no-any-return]

    def value(self) -> torch.Tensor:
        if self._value is None:
            with torch.no_grad():
                self._value = self._call(lambda t: t.value())
        return self._value

    def replay(self, env: dict[int, torch.Tensor]) -> torch.Tensor:
        return self._call(lambda t: t.replay(env))

    def leaves(self) -> Iterator[Leaf]:
        for t in self._operands():
            yield from t.leaves()


def _affine(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether ``func`` is affine in its deferred operands (``_Ref``s) with a constant slope."""
    name = getattr(func, "__name__", "")
    if name == "__get__":  # ``.data``: detached, slope 0
        return getattr(getattr(func, "__self__", None), "__name__", "") == "data"
    if name in _SUMS or name in _UNARY:
        return True
    operands = [isinstance(a, _Ref) for a in (*args, *kwargs.values())]
    if name in _PRODUCTS:
        return sum(operands) == 1
    if name in _QUOTIENTS:
        return kwargs.get("rounding_mode") is None and sum(operands) == 1 and operands[0]
    return False


class DeferredValue(torch.Tensor):
    """A 0-dim tensor whose value the engine computes later (module docstring)."""

    _thunk: _Thunk
    _like: torch.Tensor

    @staticmethod
    def __new__(cls, thunk: _Thunk, like: torch.Tensor) -> DeferredValue:
        # the tensor's own data is a placeholder: its metadata (shape, dtype, device,
        # requires_grad) is the value's; nothing reads its numbers (they are NaN)
        out = torch.Tensor._make_subclass(cls, like.detach(), like.requires_grad)
        out._thunk = thunk
        out._like = like  # answers ``is_leaf`` / ``grad_fn`` as the computed value would
        return out

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        deferred = [d for d in pytree.tree_leaves((args, kwargs)) if isinstance(d, DeferredValue)]
        name = getattr(func, "__name__", "")
        if name in _OBJECT_ITSELF:  # flags and hooks on the object itself
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name in _READS or all(d._thunk.resolved for d in deferred):  # an ordinary op
            return _call_resolved(func, args, kwargs)
        if _in_place(name, kwargs):
            target = kwargs.get("out", args[0] if args else None)
            if isinstance(target, DeferredValue) and "out" not in kwargs:
                with DisableTorchFunctionSubclass():
                    probe = func(args[0].clone(), *args[1:], **kwargs)
                target._thunk = _Op(func, args, kwargs, clone=True)
                target._like = probe
                target.requires_grad_(probe.requires_grad)
                return target
            return _call_resolved(func, args, kwargs)  # an ordinary tensor changed: needs values
        try:
            with DisableTorchFunctionSubclass():
                probe = func(*args, **kwargs)  # on the placeholders: what kind of result?
        except Exception:  # noqa: BLE001 - the real call below raises what is real
            return _call_resolved(func, args, kwargs)
        if isinstance(probe, torch.Tensor):
            return DeferredValue(_Op(func, args, kwargs, clone=False), probe)
        if name == "__get__" and args and isinstance(args[0], DeferredValue):
            with DisableTorchFunctionSubclass():  # e.g. is_leaf, grad_fn: of the value's graph
                return func(args[0]._like, *args[1:], **kwargs)
        if name in _METADATA:
            return probe
        return _call_resolved(func, args, kwargs)  # a number, a string, a bool: the value


def _in_place(name: str, kwargs: dict) -> bool:
    if "out" in kwargs or name == "__setitem__":
        return True
    if name.startswith("__"):
        return name.startswith("__i") and name not in _NOT_INPLACE_DUNDERS
    return name.endswith("_")


def _call_resolved(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on the real values (running the engine's queued work first if needed)."""
    args, kwargs = pytree.tree_map_only(DeferredValue, resolve, (args, kwargs))
    with DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def is_deferred(value: Any) -> bool:
    """Whether ``value`` is a deferred value whose engine work has not run yet."""
    return isinstance(value, DeferredValue) and not value._thunk.resolved


def resolve(value: Any) -> Any:
    """The ordinary tensor behind a deferred value (running what it waits for); other values
    are returned as they are."""
    if isinstance(value, DeferredValue):
        return value._thunk.value()
    return value


def leaf_of(value: DeferredValue) -> Leaf:
    """The engine loss a deferred value was made from (the first, if several)."""
    return next(value._thunk.leaves())


def derivative(
    value: Any, leaf: Leaf, *, divide_by: int | None = None, at: torch.Tensor | None = None
) -> float | None:
    """d(value / divide_by)/d(leaf) when it does not depend on the leaf's value, else None (the
    caller must compute the leaf's value first and differentiate ``at`` it: then any recorded
    expression is differentiated there, as autograd would).

    ``divide_by``: GAS when ``engine.backward`` scales the loss by it (``scale_wrt_gas``), as
    DeepSpeed divides. A value that is not deferred, or does not involve ``leaf``, gives 0.0:
    the caller's loss does not depend on the engine's (DeepSpeed would add no gradient to the
    model either)."""
    if not isinstance(value, DeferredValue):
        return 0.0
    thunk = value._thunk
    if not any(lf is leaf for lf in thunk.leaves()):
        return 0.0
    if at is not None:  # the leaf's own dtype: as autograd at the real value
        stand_in = at.detach().to(leaf.placeholder.dtype).clone().requires_grad_(True)
    elif thunk.linear:  # float64: the slope of an affine expression, without fp32 rounding
        stand_in = torch.ones_like(leaf.placeholder, dtype=torch.float64).requires_grad_(True)
    else:
        return None
    with torch.enable_grad():
        out = thunk.replay({id(leaf): stand_in})
        if divide_by is not None:
            out = out / divide_by
        if not out.requires_grad:
            return 0.0
        (grad,) = torch.autograd.grad(out, stand_in, allow_unused=True)
    return 0.0 if grad is None else float(grad)
