"""tests/support/prebuild.py: a test that needs a native op built in the background by `make
test` waits for that build to end (it would otherwise find the op half-built and skip)."""

from __future__ import annotations

import threading

import prebuild
import pytest


def test_without_the_folder_nothing_is_waited_for(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(prebuild.ENV, raising=False)
    assert prebuild.wait("aio") is None
    monkeypatch.setenv(prebuild.ENV, str(tmp_path))  # a folder, but no such build started
    assert prebuild.wait("aio") is None


def test_waits_until_the_build_ends_and_returns_its_status(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(prebuild.ENV, str(tmp_path))
    (tmp_path / "aio.log").write_text("building\n")
    timer = threading.Timer(0.3, lambda: (tmp_path / "aio.done").write_text("0\n"))
    timer.start()
    try:
        assert prebuild.wait("aio") == 0
        assert (tmp_path / "aio.done").exists()  # it did wait for the end
    finally:
        timer.cancel()
    (tmp_path / "avx2.log").write_text("error\n")
    (tmp_path / "avx2.done").write_text("2\n")
    assert prebuild.main(["wait", "aio", "avx2"]) == 2


def test_a_build_that_never_ends_times_out(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(prebuild.ENV, str(tmp_path))
    (tmp_path / "aio.log").write_text("building\n")
    with pytest.raises(TimeoutError, match="'aio'"):
        prebuild.wait("aio", timeout_s=0.2)
