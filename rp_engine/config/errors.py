"""The config's errors and the messages that name the key path, the bad value and the fix."""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from typing import Any

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A user error in the DeepSpeed config; the message names the key path and the fix."""


class _ConfigTypeError(ConfigError, TypeError):
    """Raised where DeepSpeed raises TypeError (bad optimizer/scheduler params), so code written
    against DeepSpeed that catches TypeError keeps working."""


class _ConfigArgError(ConfigError, AssertionError):
    """Raised where deepspeed.initialize asserts about its config arguments."""


class _ConfigAssertError(ConfigError, AssertionError):
    """Raised where DeepSpeed 0.19.8 asserts while reading the config (batch sizes, precision
    modes, optimizer name: deepspeed/runtime/config.py and engine.py): code written against
    DeepSpeed that catches AssertionError keeps working, and the message is still ours."""


class _InitArgError(ValueError, AssertionError):
    """Raised where deepspeed.initialize asserts about its other arguments (``model`` given)."""


class _InitArgTypeError(TypeError, AssertionError):
    """Raised where DeepSpeed asserts an argument's type (the client optimizer)."""


class _NoOptimizerError(RuntimeError, AssertionError):
    """Raised where DeepSpeed asserts "must provide optimizer during init in order to use
    backward" (or step): a forward-only engine (``initialize`` without an optimizer) asked to
    train. Code written against DeepSpeed that catches AssertionError keeps working."""


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _nearest(word: str, candidates: Iterable[str]) -> str | None:
    cands = list(candidates)
    lowered = {c.lower(): c for c in cands}
    hits = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    if hits:
        return lowered[hits[0]]
    # A truncated key ("job" for "job_name") scores low on similarity but is an obvious match.
    prefixed = sorted(
        (c for c in lowered if len(word) >= 3 and c.startswith(word.lower())), key=len
    )
    return lowered[prefixed[0]] if prefixed else None


def _did_you_mean(word: str, candidates: Iterable[str]) -> str:
    hit = _nearest(word, candidates)
    return f" (did you mean {hit!r}?)" if hit else ""


def _unknown_key_error(path: str, key: str, valid: Iterable[str]) -> ConfigError:
    valid = sorted(valid)
    where = path or "the top level"
    return ConfigError(
        f"{_join(path, key)}: unknown key {key!r} in {where}{_did_you_mean(key, valid)}. "
        f"Valid keys: {', '.join(valid)}. DeepSpeed rejects unknown keys here too "
        "('extra fields not permitted')."
    )


def _type_error(key: str, value: Any, expected: str, hint: str = "") -> ConfigError:
    return ConfigError(f"{key} = {_show(value)} is not valid: expected {expected}{hint}")


def _quote_hint(value: Any, kind: type) -> str:
    if isinstance(value, str):
        low = value.strip().lower()
        if kind is bool and low in {"true", "false", "yes", "no", "on", "off", "1", "0"}:
            return " (write true or false, without quotes)"
        if kind in (int, float):
            try:
                float(value)
            except ValueError:
                return ""
            return " (write the number without quotes)"
    return ""
