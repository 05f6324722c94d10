"""DeepSpeed's aio op is built on first use, not at install (issue 44): ``make train`` never
builds it, ``make test`` does before the suite; a run whose NVMe tier ("auto") finds the op
unbuilt uses the built-in engine and starts one detached background build; rp-train's default
job never asks for NVMe at all."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rp_engine.config.schema import AioConfig
from rp_engine.storage import io_engine
from rp_engine.storage.io_engine import ThreadEngine, make_io_engine

ROOT = Path(__file__).resolve().parents[2]
_AIO_COMMANDS = ("build_aio", "libaio", "apt-get")


def _dry_run(target: str, venv: Path) -> str:
    """What ``make <target>`` would run on a fresh clone (a venv that does not exist yet)."""
    if shutil.which("make") is None:
        pytest.skip("no make here")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    proc = subprocess.run(
        ["make", "-n", "--no-print-directory", "-C", str(ROOT), target, f"VENV={venv}"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_make_train_on_a_fresh_clone_does_not_build_the_aio_op(tmp_path) -> None:
    venv = tmp_path / ".venv"
    train = _dry_run("train", venv)
    assert f"{venv}/bin/rp-train" in train  # it is the plan of a fresh install and a run
    assert "pip install" in train
    assert not [line for line in train.splitlines() if any(w in line for w in _AIO_COMMANDS)]
    # what CI runs still builds it, before the tests that exercise it
    test = _dry_run("test", venv)
    build = test.index(f"{venv}/bin/python -m rp_engine.storage.build_aio")
    assert "apt-get install -y -q libaio-dev" in test
    assert build < test.index(f"{venv}/bin/pytest")
    assert not venv.exists()  # a dry run


@pytest.fixture
def first_use(monkeypatch, tmp_path) -> list[dict[str, Any]]:
    """The op reported unbuilt but buildable, a fresh cache in ``tmp_path``, the background
    build enabled, and the spawn recorded instead of run (its calls are returned)."""
    cache = tmp_path / "ext"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(cache))
    monkeypatch.setenv(io_engine.AIO_BUILD_ENV, "1")
    monkeypatch.setattr(io_engine, "aio_op_built", lambda: False)
    monkeypatch.setattr(io_engine, "aio_op_buildable", lambda: True)
    monkeypatch.setattr(io_engine, "_first_use_checked", False)
    spawned: list[dict[str, Any]] = []

    def spawn(command: list[str], *, log_path: str, env: dict[str, str], keep_fd: int) -> int:
        # the build must inherit the marker's descriptor while its flock is held
        with pytest.raises(BlockingIOError):
            other = os.open(os.path.join(cache, io_engine.BUILD_MARKER), os.O_RDONLY)
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(other)
        spawned.append({"command": command, "log_path": log_path, "env": env, "fd": keep_fd})
        return 4242

    monkeypatch.setattr(io_engine, "spawn_background_build", spawn)
    return spawned


def test_auto_without_the_op_runs_built_in_and_starts_one_background_build(
    first_use, tmp_path, caplog
) -> None:
    cache = tmp_path / "ext"
    with caplog.at_level(logging.INFO, logger="rp_engine.storage"):
        engines = [make_io_engine("auto", AioConfig()) for _ in range(2)]  # two tiers
    try:
        assert all(isinstance(e, ThreadEngine) for e in engines)
    finally:
        for e in engines:
            e.close()
    assert len(first_use) == 1
    (call,) = first_use
    assert call["command"] == [sys.executable, "-m", "rp_engine.storage.build_aio", "--background"]
    assert call["log_path"] == str(cache / "async_io_build.log")
    assert call["env"]["TORCH_EXTENSIONS_DIR"] == str(cache)
    assert (cache / io_engine.BUILD_MARKER).read_text().strip() == "4242"
    said = [r.getMessage() for r in caplog.records if "background" in r.getMessage()]
    assert len(said) == 1, said
    assert "process 4242" in said[0] and str(cache / "async_io_build.log") in said[0]
    assert "next run uses the aio op" in said[0]


def test_no_background_build_when_the_env_var_says_0(first_use, monkeypatch) -> None:
    monkeypatch.setenv(io_engine.AIO_BUILD_ENV, "0")
    engine = make_io_engine("auto", AioConfig())
    engine.close()
    assert isinstance(engine, ThreadEngine) and first_use == []


def test_no_second_background_build_while_one_runs(first_use, tmp_path, caplog) -> None:
    cache = tmp_path / "ext"
    cache.mkdir()
    marker = cache / io_engine.BUILD_MARKER
    marker.write_text("777\n")
    held = os.open(marker, os.O_RDWR)  # the running build's lock
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        with caplog.at_level(logging.INFO, logger="rp_engine.storage"):
            engine = make_io_engine("auto", AioConfig())
        engine.close()
    finally:
        os.close(held)
    assert isinstance(engine, ThreadEngine) and first_use == []
    assert any("process 777" in r.getMessage() for r in caplog.records)


def test_no_background_build_where_the_op_cannot_build_or_failed_before(
    first_use, monkeypatch, tmp_path, caplog
) -> None:
    monkeypatch.setattr(io_engine, "aio_op_buildable", lambda: False)
    with caplog.at_level(logging.INFO, logger="rp_engine.storage"):
        make_io_engine("auto", AioConfig()).close()
    assert first_use == [] and any("libaio" in r.getMessage() for r in caplog.records)

    monkeypatch.setattr(io_engine, "aio_op_buildable", lambda: True)
    monkeypatch.setattr(io_engine, "_first_use_checked", False)
    (tmp_path / "ext").mkdir()
    (tmp_path / "ext" / io_engine.BUILD_FAILED).write_text("compiler error\n")
    make_io_engine("auto", AioConfig()).close()
    assert first_use == []


def test_threads_and_a_built_op_start_no_build(first_use, monkeypatch) -> None:
    make_io_engine("threads", AioConfig()).close()
    monkeypatch.setattr(io_engine, "aio_op_built", lambda: True)
    monkeypatch.setattr(io_engine, "load_aio_op", lambda: _raise(RuntimeError("no op")))
    make_io_engine("auto", AioConfig()).close()  # the load fails: built-in, no build either
    assert first_use == []


def _raise(exc: Exception) -> Any:
    raise exc


def test_the_test_run_itself_never_starts_a_background_build() -> None:
    # tests/conftest.py, for every test and the child processes they start
    assert os.environ.get(io_engine.AIO_BUILD_ENV) == "0"
    assert not io_engine.background_build_enabled()


def test_rp_train_default_job_asks_for_no_nvme() -> None:
    """``make train`` runs ``rp-train`` without arguments: its config puts nothing on NVMe, so
    no I/O engine is made and no aio build can start."""
    from rp_engine.storage.build import wants_optimizer_tier, wants_param_tier
    from rp_engine.train import cli

    for argv in ([], ["--devices", "cpu:2"]):
        raw, cfg = cli._Job(cli._parser().parse_args(argv))._config(128, 1000)
        assert not wants_optimizer_tier(cfg) and not wants_param_tier(cfg), argv
        assert "nvme" not in str(raw).lower(), raw


def test_the_background_build_is_detached_and_holds_the_marker_while_it_runs(
    monkeypatch, tmp_path
) -> None:
    """The real spawn, with a stand-in for the build: its own session, its output in the log, the
    marker's flock held as long as it runs (no second build meanwhile) and released when it
    ends."""
    cache = tmp_path / "ext"
    script = (
        "import os, sys, time\n"
        "print('own session', os.getsid(0) == os.getpid(), flush=True)\n"
        "sys.stdin.read()\n"  # closed: returns at once
        "time.sleep(1.5)\n"
    )
    monkeypatch.setattr(io_engine, "BUILD_COMMAND", ("-c", script))
    before = len(io_engine._children)
    io_engine._spawn_once(str(cache), str(cache / io_engine.BUILD_LOG))
    (child,) = io_engine._children[before:]
    marker = cache / io_engine.BUILD_MARKER
    assert marker.read_text().strip() == str(child.pid)
    fd = os.open(marker, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):  # held by the build, not by this process
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert child.wait(timeout=30) == 0
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the build ended: free
    finally:
        os.close(fd)
    assert "own session True" in (cache / io_engine.BUILD_LOG).read_text()


def test_a_failed_background_build_is_remembered_until_a_build_succeeds(
    monkeypatch, tmp_path, capsys
) -> None:
    from rp_engine.storage import build_aio

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    niced: list[int] = []
    monkeypatch.setattr(build_aio.os, "nice", niced.append)  # not this test process
    monkeypatch.setattr(io_engine, "aio_op_built", lambda: False)
    monkeypatch.setattr(io_engine, "load_aio_op", lambda: _raise(RuntimeError("cc failed")))
    failed = tmp_path / io_engine.BUILD_FAILED
    assert build_aio.main([]) == 0 and not failed.exists()  # by hand: nothing remembered
    assert build_aio.main(["--background"]) == 0 and niced == [19]
    assert "cc failed" in failed.read_text()
    monkeypatch.setattr(io_engine, "load_aio_op", lambda: object())
    assert build_aio.main([]) == 0 and not failed.exists()
    assert "aio op built" in capsys.readouterr().out


def test_a_foreground_build_says_what_it_builds_and_how_long_it_has_run(
    monkeypatch, caplog
) -> None:
    """ "aio" asked explicitly with the op unbuilt builds it in the run: a line first, then one
    every BUILD_NOTICE_S (15 s; shortened here) with the time so far, so it never looks hung."""
    import time

    class Builder:
        def load(self, verbose: bool = False) -> str:
            time.sleep(0.5)
            return "op"

    monkeypatch.setattr(io_engine, "BUILD_NOTICE_S", 0.1)
    with caplog.at_level(logging.INFO, logger="rp_engine.storage"):
        assert io_engine._build_in_foreground(Builder(), "/cache/async_io") == "op"
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("building DeepSpeed's aio op") and "/cache/async_io" in said[0]
    progress = [m for m in said if m.startswith("still building")]
    assert len(progress) >= 2 and all("s so far" in m for m in progress)
    assert said[-1].startswith("built DeepSpeed's aio op in")
