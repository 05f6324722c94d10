"""Checkpoint files checked before anything is loaded: which file, and what differs.

Without these checks a truncated file fails inside ``torch.load`` (``PytorchStreamReader failed
reading zip archive`` or ``mmap can only be used with files saved with torch.save``), and a
checkpoint of another model shape fails inside ``load_state_dict`` after it has already copied
the tensors that did fit, leaving the engine half-loaded. Both raise :class:`CheckpointError`
here (a RuntimeError, the type ``load_checkpoint`` always raised for a checkpoint that does not
fit), naming the file, and nothing in the engine has changed yet.

Precision: a checkpoint saved in another floating precision loads (the tensors are cast, and the
fp32 masters of its optim-states file are exact whatever the compute precision), with a warning
naming the file and both dtypes. A floating tensor that would receive integer data (or the
reverse, e.g. a quantised checkpoint) is refused.
"""

from __future__ import annotations

import logging
import os
import zipfile
from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["CheckpointError", "check_file", "check_module_state"]

log = logging.getLogger("rp_engine.checkpoint")

_PICKLE_PROTO = 0x80  # legacy (pre-zip) torch.save files start with a pickle PROTO opcode
_SHOWN = 5


class CheckpointError(RuntimeError):
    """A checkpoint file is unreadable or does not fit the engine's model; nothing was loaded."""


def check_file(path: str) -> None:
    """Raise :class:`CheckpointError` unless ``path`` is a complete ``torch.save`` file: a zip
    archive whose central directory (written last, so missing when a save or a copy was cut
    short) is intact and whose every member lies inside the file, or a legacy pickle file."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    if size == 0:
        raise CheckpointError(f"checkpoint file {path!r} is empty (0 bytes): {_cut_short()}")
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as zf:
                end = max((i.header_offset + i.compress_size for i in zf.infolist()), default=0)
        except (zipfile.BadZipFile, OSError, ValueError) as exc:
            raise CheckpointError(
                f"checkpoint file {path!r} ({size} bytes) is a damaged zip archive ({exc}): "
                f"{_cut_short()}"
            ) from exc
        if end > size:
            raise CheckpointError(
                f"checkpoint file {path!r} is truncated: its members need at least {end} bytes, "
                f"the file has {size}: {_cut_short()}"
            )
        return
    with open(path, "rb") as f:
        first = f.read(1)
    if first and first[0] == _PICKLE_PROTO:
        return  # a legacy torch.save file: torch.load and the weights_only unpickler judge it
    raise CheckpointError(
        f"checkpoint file {path!r} ({size} bytes) is not a complete torch.save file (its "
        f"zip directory, written last, is missing): {_cut_short()}"
    )


def _cut_short() -> str:
    return (
        "the save was interrupted or the copy is incomplete. Load another tag "
        "(engine.load_checkpoint(dir, tag=...)) or copy the checkpoint again"
    )


def check_module_state(
    path: str, saved: Mapping[str, torch.Tensor], module: nn.Module, *, strict: bool
) -> None:
    """Compare the checkpoint's module state (from file ``path``) with ``module`` before any
    tensor is copied. Raises :class:`CheckpointError` naming the file and the tensors whose
    shape differs, whose kind (floating vs integer) differs, or (``strict``) which are missing
    or unexpected; warns once when floating precisions differ (the load casts)."""
    current = module.state_dict()
    shapes, kinds, casts = [], [], []
    for name, value in saved.items():
        mine = current.get(name)
        if mine is None or not isinstance(value, torch.Tensor):
            continue
        if tuple(value.shape) != tuple(mine.shape):
            shapes.append(f"{name}: checkpoint {tuple(value.shape)}, model {tuple(mine.shape)}")
        elif value.is_floating_point() != mine.is_floating_point():
            kinds.append(f"{name}: checkpoint {value.dtype}, model {mine.dtype}")
        elif value.dtype != mine.dtype:
            casts.append((value.dtype, mine.dtype))
    problems = []
    if shapes:
        problems.append(f"{len(shapes)} tensor(s) of another shape ({_list(shapes)})")
    if kinds:
        problems.append(f"{len(kinds)} tensor(s) of another kind of dtype ({_list(kinds)})")
    keys = False
    if strict:
        missing = sorted(set(current) - set(saved))
        unexpected = sorted(set(saved) - set(current))
        if missing:
            problems.append(f"Missing key(s) in the checkpoint: {_list(missing)}")
        if unexpected:
            problems.append(f"unexpected key(s) in the checkpoint: {_list(unexpected)}")
        keys = bool(missing or unexpected)
    if problems:
        raise CheckpointError(
            f"checkpoint file {os.fspath(path)!r} does not fit this {type(module).__name__}: "
            + "; ".join(problems)
            + ". It was saved from another model (configuration, layer count or adapter); build "
            "the same model before loading"
            + (" (load_module_strict=False tolerates missing/unexpected keys)" if keys else "")
        )
    if casts:
        pairs = sorted({f"{a} -> {b}" for a, b in casts})
        log.warning(
            "checkpoint file %s holds %d tensor(s) in another precision (%s); they are cast",
            os.fspath(path),
            len(casts),
            ", ".join(pairs),
        )


def _list(items: list[str]) -> str:
    return ", ".join(items[:_SHOWN]) + (
        f" ... ({len(items) - _SHOWN} more)" * (len(items) > _SHOWN)
    )
