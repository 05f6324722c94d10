"""What a Hugging Face ``save_pretrained`` folder is, for the loaders that read one.

Shared by the layer-by-layer loader (model/folder.py) and the hub-id resolver (model/hub.py),
which each need to recognise a loadable folder and raise the same error, without importing each
other's module (folder.py resolves hub ids through hub.py).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["INDEX_FILE", "SINGLE_FILE", "FolderError", "is_model_folder"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class FolderError(ValueError):
    """A folder (or a key in it) that cannot be loaded this way; the message names it and the
    fix."""


def is_model_folder(path: str | os.PathLike[str]) -> bool:
    """A folder with a ``config.json`` and safetensors weights (one file or an index)."""
    p = Path(path)
    return (p / "config.json").is_file() and (
        (p / SINGLE_FILE).is_file() or (p / INDEX_FILE).is_file()
    )
