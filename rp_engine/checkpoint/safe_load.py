"""Loading ``torch.save`` files without running code from them.

Owns the one rule every reader of checkpoint files in rp_engine follows: ``torch.load`` with
``weights_only=True``. A pickle may name any Python callable ("global") and unpickling calls it,
so a shared checkpoint could run code on the machine that loads it; PyTorch's weights_only
unpickler only builds tensors, containers and an allowlist of types. Files DeepSpeed 0.19.8 writes
also hold a few DeepSpeed objects (its loss scaler, the ZeRO stage enum, fragment addresses); those
exact classes form :data:`DEEPSPEED_GLOBALS` and are allowed through
``torch.serialization.safe_globals`` (found by writing real DeepSpeed checkpoints: fp32 ZeRO 0-3,
fp16 with dynamic loss scaling and bf16 at ZeRO 1-3, CPU offload; see tests/support/ds_checkpoints.py).

Before anything is unpickled, the file's pickle is disassembled (``torch.serialization.
get_unsafe_globals_in_checkpoint``): any other global makes :func:`load` raise
:class:`UntrustedCheckpointError` naming the file, the globals and the opt-in. The opt-in
(``trust=True``; ``engine.load_checkpoint(..., trust_checkpoint=True)``) unpickles fully, as
DeepSpeed always does, for a file the user trusts. It is never the default and no environment
variable turns it on.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["DEEPSPEED_GLOBALS", "UntrustedCheckpointError", "load"]

log = logging.getLogger("rp_engine.safe_load")

# "module.qualname" of every non-torch global found in checkpoints written by DeepSpeed 0.19.8.
# Each is a plain data holder whose construction runs no user-controlled code.
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)

_OPT_IN = "trust_checkpoint=True to engine.load_checkpoint(...)"


class UntrustedCheckpointError(pickle.UnpicklingError):
    """A file holds Python globals outside the allowlist; it was not unpickled."""


def load(path: str, *, trust: bool = False) -> Any:
    """``torch.load(path)`` onto the CPU without running code from the file (memory-mapped when
    it is in torch's zip format, as every file torch.save has written since PyTorch 1.6).

    Allowed: what PyTorch's weights_only unpickler builds, plus :data:`DEEPSPEED_GLOBALS`.
    Anything else raises :class:`UntrustedCheckpointError` before unpickling, unless ``trust``,
    which loads with ``weights_only=False`` (a warning names the globals).
    """
    unsafe = _unsafe_globals(path)
    mmap = unsafe is not None  # mmap needs the zip format, which the scan read
    refused = sorted(unsafe - set(DEEPSPEED_GLOBALS)) if unsafe is not None else []
    if trust:
        if refused:
            log.warning(
                "%s: unpickling fully as the caller trusts it; it holds globals outside the "
                "allowlist: %s",
                path,
                ", ".join(refused),
            )
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    if refused:
        raise UntrustedCheckpointError(_refusal(path, ", ".join(refused)))
    # Legacy (non-zip) files cannot be scanned; the weights_only unpickler still guards them.
    allowed = _resolve(DEEPSPEED_GLOBALS if unsafe is None else sorted(unsafe))
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        # A global the static scan could not see (pushed dynamically), or a legacy-format file.
        raise UntrustedCheckpointError(_refusal(path, _reason(exc))) from exc


def _unsafe_globals(path: str) -> set[str] | None:
    """Globals in the file's pickle beyond PyTorch's weights_only set (static disassembly, nothing
    is executed); None for a legacy non-zip file, which cannot be scanned this way."""
    try:
        return set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except ValueError:
        return None


def _resolve(names: Iterable[str]) -> list[Any]:
    out = []
    for name in names:
        module, _, attr = name.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            # DeepSpeed missing or renamed: the load then refuses the file, naming the global.
            log.debug("allowlisted global %s is not importable", name)
    return out


def _refusal(path: str, what: str) -> str:
    return (
        f"refusing to load {os.fspath(path)!r}: it holds Python globals that rp_engine does not "
        f"allow ({what}); unpickling them could run code from the file. Only tensors, plain "
        "containers and the DeepSpeed classes in "
        "rp_engine.checkpoint.safe_load.DEEPSPEED_GLOBALS are loaded by default. "
        f"If you trust this file, pass {_OPT_IN} (it is then unpickled fully, as DeepSpeed does)."
    )


def _reason(exc: BaseException) -> str:
    """The line of torch's weights_only error that names the global (its other lines advise
    ``weights_only=False``, which is not what a user should do here)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in lines:
        if "GLOBAL" in ln:
            return ln
    return lines[0] if lines else type(exc).__name__
