"""Field specs and generic section reading: a dataclass of schema.py is the spec of its section.

A field's type annotation gives its kind, its default is DeepSpeed's default, and metadata
(``_m``) adds choices, bounds and aliases; ``_read`` validates a section against the specs
(unknown keys, aliases given twice, types, choices, bounds), ``_build`` makes the dataclass.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin, get_type_hints

from rp_engine.config.errors import (
    ConfigError,
    _did_you_mean,
    _join,
    _quote_hint,
    _show,
    _type_error,
    _unknown_key_error,
)


def _m(
    *,
    choices: tuple[Any, ...] = (),
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    aliases: tuple[str, ...] = (),
    custom: bool = False,
    nullable: bool = False,
) -> dict[str, Any]:
    """Field metadata: custom=True means the section parser handles the value itself."""
    return {
        "choices": choices,
        "ge": ge,
        "gt": gt,
        "le": le,
        "aliases": aliases,
        "custom": custom,
        "nullable": nullable,
    }


@dataclass(frozen=True)
class _Spec:
    kind: type  # bool | int | float | str | dict | list | object (= pass through)
    default: Any = None
    optional: bool = False  # null accepted
    required: bool = False
    choices: tuple[Any, ...] = ()
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    aliases: tuple[str, ...] = ()
    per_group: bool = False  # a number, or a list of numbers (one per param group)


def _specs_of(cls: type, *, only: Iterable[str] | None = None) -> dict[str, _Spec]:
    hints = get_type_hints(cls)
    wanted = set(only) if only is not None else None
    specs: dict[str, _Spec] = {}
    for f in dataclasses.fields(cls):
        if wanted is not None and f.name not in wanted:
            continue
        meta: Mapping[str, Any] = f.metadata or {}
        kind, optional = _kind_of(hints[f.name])
        if meta.get("custom"):
            kind = object
        if meta.get("nullable"):
            default = None  # resolved by the section parser (e.g. overlap_comm: stage == 3)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        specs[f.name] = _Spec(
            kind=kind,
            default=default,
            optional=optional or bool(meta.get("nullable")),
            choices=tuple(meta.get("choices", ())),
            ge=meta.get("ge"),
            gt=meta.get("gt"),
            le=meta.get("le"),
            aliases=tuple(meta.get("aliases", ())),
        )
    return specs


def _kind_of(hint: Any) -> tuple[type, bool]:
    origin = get_origin(hint)
    if origin is Union or origin is types.UnionType:
        args = [a for a in get_args(hint) if a is not type(None)]
        kind, _ = _kind_of(args[0]) if len(args) == 1 else (object, False)
        return kind, True
    if hint in (bool, int, float, str):
        return hint, False
    return object, False


def _expected(spec: _Spec) -> str:
    if spec.choices:
        text = "one of " + ", ".join(_show(c) for c in spec.choices)
        if spec.kind is int:
            text = "an integer, " + text
    else:
        text = {
            bool: "true or false",
            int: "an integer",
            float: "a number",
            str: "a string",
            dict: "an object {...}",
            list: "a list [...]",
        }.get(spec.kind, "a value")
        if spec.per_group:
            text += " or a list of numbers (one per param group)"
    return text + (" or null" if spec.optional else "")


# --------------------------------------------------------------------------------------------
# Generic section reading
# --------------------------------------------------------------------------------------------


def _coerce(value: Any, key: str, spec: _Spec) -> Any:
    if value is None:
        if spec.optional or spec.kind is object:
            return None
        raise _type_error(key, value, _expected(spec))
    if spec.kind is object:
        return value
    if spec.per_group and isinstance(value, list):
        item = dataclasses.replace(spec, per_group=False, optional=False)
        return [_coerce(v, f"{key}[{i}]", item) for i, v in enumerate(value)]
    v: Any
    if spec.kind is bool:
        if not isinstance(value, bool):
            raise _type_error(key, value, _expected(spec), _quote_hint(value, bool))
        v = value
    elif spec.kind is int:
        ok = isinstance(value, int) or (
            isinstance(value, float) and math.isfinite(value) and value.is_integer()
        )
        if isinstance(value, bool) or not ok:
            hint = _quote_hint(value, int)
            if isinstance(value, float) and not isinstance(value, bool):
                hint = " (it must be a whole number)"
            raise _type_error(key, value, _expected(spec), hint)
        v = int(value)
    elif spec.kind is float:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(float(value))
        ):
            raise _type_error(key, value, _expected(spec), _quote_hint(value, float))
        v = float(value)
    elif spec.kind in (str, dict, list):
        if not isinstance(value, spec.kind):
            raise _type_error(key, value, _expected(spec))
        v = value
    else:  # pragma: no cover - every kind is handled above
        raise AssertionError(spec.kind)
    if spec.choices and v not in spec.choices:
        hint = _did_you_mean(v, [str(c) for c in spec.choices]) if isinstance(v, str) else ""
        raise _type_error(key, value, _expected(spec), hint)
    if spec.ge is not None and v < spec.ge:
        raise _type_error(key, value, f"a value >= {spec.ge:g}")
    if spec.gt is not None and v <= spec.gt:
        raise _type_error(key, value, f"a value > {spec.gt:g}")
    if spec.le is not None and v > spec.le:
        raise _type_error(key, value, f"a value <= {spec.le:g}")
    return v


def _as_section(section: Any, path: str) -> Mapping[str, Any]:
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ConfigError(
            f"{path} = {_show(section)} is not valid: expected an object {{...}} of settings"
        )
    return section


def _read(
    section: Any,
    path: str,
    specs: Mapping[str, _Spec],
    *,
    strict: bool,
    fill_defaults: bool = True,
) -> dict[str, Any]:
    """Validate `section` against `specs`; returns canonical name -> coerced value.

    strict: unknown keys raise (DeepSpeed's pydantic sections); otherwise they are ignored.
    """
    section = _as_section(section, path)
    alias_of = {a: name for name, s in specs.items() for a in s.aliases}
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in section.items():
        name = alias_of.get(key, key)
        if name not in specs:
            if strict:
                raise _unknown_key_error(path, key, [*specs, *alias_of])
            continue
        if name in given_as:
            raise ConfigError(
                f"{_join(path, key)} and {_join(path, given_as[name])} are the same setting "
                "(one is an alias of the other): keep only one"
            )
        given_as[name] = key
        out[name] = _coerce(value, _join(path, key), specs[name])
    for name, spec in specs.items():
        if name not in out:
            if spec.required:
                raise _type_error(_join(path, name), None, _expected(spec))
            if fill_defaults:
                out[name] = copy.copy(spec.default)
    return out


def _build(cls: type, values: Mapping[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})
