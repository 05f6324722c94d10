"""The user's model read through the engine while an optimizer step may be in flight.

With the asynchronous optimizer (or overlapping iterations) the last step is still running when
a training call returns, and the module's weights are published only when it is finished. A
script that reads a submodule or a plain attribute every step (``engine.module.model``,
``model.model``, ``model.config``) must not wait for that step: that would turn the overlap off.
What reads weights must see the newest ones. A :class:`ModuleView` stands for a module and
decides per access:

    a submodule          -> a view of it (no wait)
    a plain value        -> the value (config, dtype, training, ...: no wait)
    a call, a method, a tensor (``model(...)``, ``state_dict()``, ``weight``), an assignment
                         -> ``fresh()`` first (the engine finishes the step and publishes it),
                            then the module's own

A view passes ``isinstance`` checks as the module's class (``__class__``), iterates and indexes
like it (``ModuleList``, ``Sequential``), and :func:`unwrap` gives the module itself. It knows
nothing of the engine: ``fresh`` is a callable.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["ModuleView", "unwrap", "view_or_value"]


class ModuleView:
    """A module (``target``) whose weight reads call ``fresh()`` first (module docstring)."""

    __slots__ = ("_rp_target", "_rp_fresh")

    def __init__(self, target: nn.Module, fresh: Callable[[], None]) -> None:
        object.__setattr__(self, "_rp_target", target)
        object.__setattr__(self, "_rp_fresh", fresh)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(view, LlamaForCausalLM) as for the module
        return type(object.__getattribute__(self, "_rp_target"))

    def __getattr__(self, name: str) -> Any:
        target, fresh = _parts(self)
        return view_or_value(getattr(target, name), fresh, lambda: getattr(target, name))

    def __setattr__(self, name: str, value: Any) -> None:
        target, fresh = _parts(self)
        fresh()
        setattr(target, name, unwrap(value))

    def __delattr__(self, name: str) -> None:
        target, fresh = _parts(self)
        fresh()
        delattr(target, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        target, fresh = _parts(self)
        fresh()
        return target(*args, **kwargs)

    # containers (ModuleList, Sequential, ModuleDict): their items as views
    def __len__(self) -> int:
        return len(_parts(self)[0])  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        target, fresh = _parts(self)
        for item in target:  # type: ignore[attr-defined]
            yield view_or_value(item, fresh, functools.partial(_same, item))

    def __getitem__(self, key: Any) -> Any:
        target, fresh = _parts(self)
        item = target[key]  # type: ignore[index]
        return view_or_value(item, fresh, lambda: target[key])  # type: ignore[index]

    def __contains__(self, key: Any) -> bool:
        return key in _parts(self)[0]  # type: ignore[operator]

    def __dir__(self) -> list[str]:
        return dir(_parts(self)[0])

    def __repr__(self) -> str:
        return repr(_parts(self)[0])

    def __eq__(self, other: object) -> bool:
        return _parts(self)[0] is unwrap(other)

    def __hash__(self) -> int:
        return hash(_parts(self)[0])


def _same(value: Any) -> Any:
    return value


def _parts(view: ModuleView) -> tuple[nn.Module, Callable[[], None]]:
    return object.__getattribute__(view, "_rp_target"), object.__getattribute__(view, "_rp_fresh")


def view_or_value(value: Any, fresh: Callable[[], None], reread: Callable[[], Any]) -> Any:
    """What an attribute read through a view returns: a submodule's view, a plain value as it
    is, or (a call, a method, a tensor) ``reread()`` after ``fresh()``."""
    if isinstance(value, nn.Module):
        return ModuleView(value, fresh)
    if callable(value) or torch.is_tensor(value):
        fresh()
        return reread()
    return value


def unwrap(value: Any) -> Any:
    """The module a view stands for; anything else as it is."""
    if type(value) is ModuleView:  # (type(): a view's __class__ is its module's)
        return _parts(value)[0]
    return value
