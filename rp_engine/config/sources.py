"""Where a config comes from: a dict, an hjson/JSON file (comments allowed, duplicate keys
rejected) or a urlsafe-base64 JSON string, and which of ``initialize``'s arguments names it."""

from __future__ import annotations

import base64
import binascii
import copy
import logging
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rp_engine.config.errors import ConfigError, _ConfigArgError, _show

# every config module logs as "rp_engine.config" (one logger for the config reader)
logger = logging.getLogger("rp_engine.config")

__all__ = ["resolve_config_arg"]


def _no_duplicates(source: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        dups: list[str] = []
        for k, v in pairs:
            if k in out and k not in dups:
                dups.append(k)
            out[k] = v
        if dups:
            raise ConfigError(
                f"Duplicate keys in DeepSpeed config {source}: {dups}. A key may appear only "
                "once per object (JSON would silently keep the last one): remove the extra one"
            )
        return out

    return hook


def _parse_text(text: str, source: str) -> Any:
    import hjson  # installed with deepspeed; imported here to keep import of this module cheap

    try:
        return hjson.loads(text, object_pairs_hook=_no_duplicates(source))
    except ConfigError:
        raise
    except ValueError as e:  # HjsonDecodeError is a ValueError
        raise ConfigError(f"Could not parse DeepSpeed config {source}: {e}") from e


def _load_raw(config: Any) -> dict[str, Any]:
    if config is None:
        raise ConfigError(
            "No DeepSpeed config given: pass config= a dict, a path to a ds_config.json, or a "
            "base64 JSON string (or --deepspeed_config on the command line)"
        )
    if isinstance(config, Mapping):
        parsed: Any = copy.deepcopy(dict(config))
        source = "dict"
    elif isinstance(config, str | os.PathLike):
        text = os.fspath(config)
        # os.path (not Path) checks: they return False instead of raising for names too long
        # to be paths, such as a large base64 config.
        if isinstance(config, str) and not os.path.exists(text):
            parsed, source = _decode_base64(text), "(base64 string)"
        elif os.path.isfile(text):
            source = text
            parsed = _parse_text(Path(text).read_text(encoding="utf-8"), source)
        else:
            what = "is a directory" if os.path.isdir(text) else "does not exist"
            raise ConfigError(f"DeepSpeed config file {text!r} {what}: give the path of a file")
    else:
        raise ConfigError(
            f"DeepSpeed config must be a dict, a path or a base64 JSON string, got "
            f"{type(config).__name__}"
        )
    if not isinstance(parsed, dict):
        raise ConfigError(
            f"DeepSpeed config {source} must be a JSON object {{...}} at the top level, "
            f"got {_show(parsed)[:80]}"
        )
    return parsed


def _decode_base64(text: str) -> Any:
    short = text if len(text) <= 80 else text[:77] + "..."
    looks_like_path = "/" in text or os.sep in text or re.search(r"\.h?json$", text) is not None
    not_found = ConfigError(
        f"DeepSpeed config {short!r} is not an existing file (cwd: {os.getcwd()}) nor a "
        "urlsafe-base64 JSON string: check the path"
    )
    if looks_like_path:
        raise not_found
    if text.lstrip().startswith("{"):
        raise ConfigError(
            "DeepSpeed config looks like inline JSON text; pass a dict (json.loads(text)), a "
            "path, or base64.urlsafe_b64encode(text) as DeepSpeed accepts"
        )
    try:
        decoded = base64.urlsafe_b64decode(text).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise not_found from None
    try:
        parsed = _parse_text(decoded, "(base64 string)")
    except ConfigError as e:
        if "Duplicate keys" in str(e):
            raise
        raise not_found from e
    if not isinstance(parsed, dict):
        raise not_found
    return parsed


def resolve_config_arg(args: Any, config: Any, config_params: Any) -> Any:
    """Pick the config source as deepspeed.initialize does: `config_params` is an alias of
    `config`; `args.deepspeed_config` (or the deprecated `args.deepscale_config`) is used when no
    config is passed. `args` is not modified. Raises ConfigError (also an AssertionError, as
    DeepSpeed asserts) when both or neither are given."""
    if config is None:
        config = config_params
    elif config_params is not None and config_params is not config:
        logger.warning(
            "both config and config_params given; using config "
            "(config_params is its deprecated alias)"
        )
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    deepscale = getattr(args, "deepscale_config", None) if args is not None else None
    if deepscale is not None:
        if from_args is not None:
            raise _ConfigArgError(
                "both --deepscale_config and --deepspeed_config given: --deepscale_config is "
                "the deprecated name of --deepspeed_config; keep only --deepspeed_config"
            )
        logger.warning("--deepscale_config is deprecated; use --deepspeed_config")
        from_args = deepscale
    if from_args is not None:
        if config is not None:
            raise _ConfigArgError(
                f"two DeepSpeed configs given: args.deepspeed_config = {from_args!r} and the "
                "config= argument of initialize(); pass only one (drop --deepspeed_config or "
                "the config argument)"
            )
        config = from_args
    if config is None:
        raise _ConfigArgError(
            "no DeepSpeed config given: pass initialize(..., config=ds_config) (a dict, a path to "
            "a ds_config.json or a base64 JSON string) or --deepspeed_config ds_config.json on "
            "the command line"
        )
    return config
