"""DeepSpeed config files the tests read: the repo's ds_configs/ and the shared fixtures
(../shared/fixtures/ds_configs next to the repo, or RP_SHARED_DIR)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DS_CONFIGS = REPO / "ds_configs"


def _fixtures_dir() -> Path | None:
    here = REPO.parent / "shared" / "fixtures" / "ds_configs"
    if here.is_dir():
        return here
    env = os.environ.get("RP_SHARED_DIR")
    if env and (Path(env) / "fixtures" / "ds_configs").is_dir():
        return Path(env) / "fixtures" / "ds_configs"
    return None


def _fixture(name: str) -> Path:
    root = _fixtures_dir()
    if root is None:
        pytest.skip(
            "shared fixtures not found: expected ../shared/fixtures/ds_configs next to the repo "
            "or RP_SHARED_DIR=<shared dir>"
        )
    return root / name
