"""Faults of the NVMe optimizer tier (rp_engine/storage/): nothing is lost, nothing is damaged.

- kill -9 while a step's state is written back to the swap file (the record half old, half
  new), and kill -9 inside ``save_checkpoint``: a fresh process on the same ``nvme_path`` reuses
  the swap file the killed run left (its lock died with it), resumes from the last complete
  checkpoint and trains on with the losses of a run that was never interrupted, bit for bit
  (the child process is tests/support/nvme_fault_child.py).
- A bad ``nvme_path`` (missing, a file, unwritable) and a full disk (too little free space at
  ``initialize``; ``posix_fallocate`` failing with ENOSPC) are refused at ``initialize`` with an
  ``NvmeSpaceError`` naming the config key or path and the bytes, and leave the folder exactly
  as it was: no swap file, no folder created, a checkpoint already there byte for byte intact.
  Unwritable also where the access check passes (root, a read-only mount): the swap file's
  open or reservation refused with EACCES, simulated so that it runs as root too.
- A second live engine on the same ``nvme_path`` is refused while the first runs (the swap file
  is locked), without disturbing it; once the first is destroyed (which removes the swap file)
  the second starts.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import config, engine_for
from models import random_batch, tiny_qwen3

import rp_engine
from rp_engine.storage import NvmeSpaceError, swap_file

KEY = "zero_optimization.offload_optimizer.nvme_path"
SUPPORT = Path(__file__).resolve().parents[1] / "support"  # nvme_fault_child.py
SWAP = os.path.join("rp_engine", "rank0", "optimizer.swp")  # under nvme_path
STEPS = 6  # the uninterrupted run's length; the checkpoint every resume starts from: step 2


# --- the kill -9 tests -----------------------------------------------------------------------------
def _child_env() -> dict[str, str]:
    paths = [str(SUPPORT), str(SUPPORT.parents[1]), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _child(spec: dict[str, Any]) -> list[str]:
    return [sys.executable, str(SUPPORT / "nvme_fault_child.py"), json.dumps(spec)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The uninterrupted run's losses (in this process: the same engine as the child's)."""
    import nvme_fault_child

    folder = tmp_path_factory.mktemp("reference")
    (folder / "nvme").mkdir()
    return nvme_fault_child.reference(str(folder), STEPS)


def _kill_when_blocked(folder: Path, mode: str, params: bool = False) -> dict[str, Any]:
    """Start the child in ``mode`` (``params``: with the parameter tier too), wait for its
    marker, SIGKILL it; the marker's facts."""
    (folder / "nvme").mkdir()
    with open(folder / "stderr.txt", "w") as err:  # a file: a full pipe would stall the child
        proc = subprocess.Popen(
            _child({"mode": mode, "dir": str(folder), "params": params}),
            env=_child_env(), cwd=SUPPORT, stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    marker = folder / "blocked"
    try:
        deadline = time.monotonic() + 300  # a hang guard, not a timing check
        while not marker.exists():
            if proc.poll() is not None:
                pytest.fail(f"the child exited ({proc.returncode}) before the kill point:\n"
                            + (folder / "stderr.txt").read_text()[-4000:])  # fmt: skip
            assert time.monotonic() < deadline, "the child never reached the kill point"
            time.sleep(0.1)
        facts = json.loads(marker.read_text())
        assert facts["pid"] == proc.pid
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    marker.unlink()
    return facts


def _resume_in_a_fresh_process(folder: Path, steps: int, params: bool = False) -> dict[str, Any]:
    """A fresh process resumes from ``folder/ckpt`` with the tier(s) on ``folder/nvme``; its
    report (nvme_fault_child.resume). Its engine must start on the swap file a killed run left."""
    proc = subprocess.run(
        _child({"mode": "resume", "dir": str(folder), "steps": steps, "params": params}),
        env=_child_env(), cwd=SUPPORT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = proc.stdout.splitlines()
    started = [json.loads(ln[7:]) for ln in lines if ln.startswith("ENGINE:")]
    assert started, f"the resumed engine did not start:\n{proc.stderr[-6000:]}"
    assert started[0]["swap"] == str(folder / "nvme" / SWAP)  # reused, not refused
    died = f" (killed by {signal.Signals(-proc.returncode).name})" if proc.returncode < 0 else ""
    done = [json.loads(ln[5:]) for ln in lines if ln.startswith("JSON:")]
    assert proc.returncode == 0 and done, (
        f"resume exited {proc.returncode}{died}:\n" + (proc.stderr[-6000:])
    )
    return done[-1]


def _assert_resumed_exactly(got: dict[str, Any], reference: list[float], swap: Path) -> None:
    assert got["global_steps_loaded"] == 2
    assert got["losses"] == reference[2:]  # exactly: the same bytes through the same kernel
    assert got["swap"] == str(swap)
    assert not got["swap_left"] and got["nvme_files"] == [], "destroy removes the swap file"


def test_kill_9_during_a_write_back_then_resume(tmp_path: Path, reference: list[float]) -> None:
    """SIGKILL while step 4's first record is half written to the swap file: the swap file
    stays (half old, half new state) and is unlocked; a fresh process on the same nvme_path
    reuses it, loads the step-2 checkpoint and trains steps 3-6 as the uninterrupted run."""
    facts = _kill_when_blocked(tmp_path, "writeback")
    swap = tmp_path / "nvme" / SWAP
    assert facts["swap"] == str(swap) and facts["step"] == 4
    assert 0 < facts["written"] < facts["nbytes"], facts  # killed half-way through a record
    assert swap.is_file() and swap.stat().st_size == facts["disk"]  # left by the killed run
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"

    got = _resume_in_a_fresh_process(tmp_path, STEPS - 2)
    _assert_resumed_exactly(got, reference, swap)


def test_kill_9_during_a_weight_write_back_then_resume(
    tmp_path: Path, reference: list[float]
) -> None:
    """With the parameter tier too: SIGKILL while step 4's new compute weights are half written
    to ``params.swp``. Both swap files stay, unlocked; a fresh process with both tiers takes
    them over, loads the step-2 checkpoint and trains steps 3-6 as the uninterrupted run (the
    tiers change where state lives, never a result: the reference ran with the optimizer tier
    alone), and its destroy removes both files."""
    facts = _kill_when_blocked(tmp_path, "writeback", params=True)
    params = tmp_path / "nvme" / "rp_engine" / "rank0" / "params.swp"
    assert facts["swap"] == str(params)
    assert 0 < facts["written"] < facts["nbytes"], facts  # killed half-way through a record
    assert params.is_file() and (tmp_path / "nvme" / SWAP).is_file()

    got = _resume_in_a_fresh_process(tmp_path, STEPS - 2, params=True)
    _assert_resumed_exactly(got, reference, tmp_path / "nvme" / SWAP)


def test_kill_9_during_save_checkpoint_then_resume(tmp_path: Path, reference: list[float]) -> None:
    """SIGKILL inside save_checkpoint (the step-4 model file written, the optimizer's not): the
    previous checkpoint stays ``latest``; a fresh process resumes from it with the tier on the
    same nvme_path and trains steps 3-6 as the uninterrupted run."""
    import nvme_fault_child

    facts = _kill_when_blocked(tmp_path, "save")
    swap = tmp_path / "nvme" / SWAP
    assert facts["swap"] == str(swap) and swap.is_file()
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == "global_step2"
    assert not (ckpt / "global_step4").exists()  # the killed save never reached its commit:
    assert (ckpt / f".global_step4.tmp-{facts['pid']}").is_dir()  # its files are set aside

    # a new engine in this process (the fresh-process resume is the test above; this saves an
    # interpreter start): the swap file's lock died with the killed process
    got = nvme_fault_child.resume(str(tmp_path), STEPS - 2)
    _assert_resumed_exactly(got, reference, swap)


# --- refusals at initialize -----------------------------------------------------------------------
def _nvme_cfg(path: str | os.PathLike[str]) -> dict[str, Any]:
    return config(
        devices=2, gas=2, lr=1e-2, roundpipe={"nvme_io_engine": "threads"},
        zero_optimization={
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(path), "buffer_count": 2},
        },
    )  # fmt: skip


def _model() -> torch.nn.Module:
    return tiny_qwen3(0, layers=2)


def _batches(step: int) -> list[dict[str, torch.Tensor]]:
    return [random_batch(128, batch=2, seq=12, seed=100 * step + i) for i in range(2)]


def _tree(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder``: files by content, folders as None."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirs, files in os.walk(folder):
        for name in dirs:
            out[os.path.relpath(os.path.join(dirpath, name), folder)] = None
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


def _refuse_in(folder: Path, monkeypatch: Any, call: str) -> list[str]:
    """Make ``os.<call>`` ("open" or "posix_fallocate") fail with EACCES for the tier's swap
    file under ``folder``, as the kernel answers a user without write permission (or a
    read-only mount, a root-squashed NFS export: root too); other calls pass through. The
    refused paths, in order."""
    real, refused = getattr(os, call), []

    def refuse(first: Any, *args: Any, **kw: Any) -> Any:
        path = os.readlink(f"/proc/self/fd/{first}") if call == "posix_fallocate" else first
        if str(path).startswith(str(folder)) and str(path).endswith(".swp"):
            refused.append(str(path))
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(first, *args, **kw)

    monkeypatch.setattr(swap_file.os, call, refuse)  # swap_file.os is os: the file's own calls
    return refused


@pytest.mark.parametrize("kind", ["missing", "a-file", "unwritable", "allocation-refused"])
def test_a_bad_nvme_path_is_refused_and_nothing_is_created(
    tmp_path: Path, kind: str, monkeypatch: Any
) -> None:
    """A missing path or a file is refused by the checks at ``initialize``. An unwritable
    folder too, for a user the mode bits bind; root passes that check (os.access says every
    folder is writable), so the swap file's open is made to fail with EACCES as the kernel
    would (for any user: the case runs as root too). A refused reservation likewise. Each is
    an ``NvmeSpaceError`` naming the key and the path, and leaves the folder as it was."""
    bad = tmp_path / "nvme"
    refused: list[str] = []
    if kind == "a-file":
        bad.write_bytes(b"not a folder\n")
    elif kind == "unwritable":
        bad.mkdir()
        bad.chmod(0o500)
        refused = _refuse_in(bad, monkeypatch, "open")
    elif kind == "allocation-refused":
        bad.mkdir()
        refused = _refuse_in(bad, monkeypatch, "posix_fallocate")
    before = _tree(tmp_path)
    try:
        with pytest.raises(NvmeSpaceError) as err:
            rp_engine.initialize(model=_model(), config=_nvme_cfg(bad))
    finally:
        if kind == "unwritable":
            bad.chmod(0o700)
    text = str(err.value)
    assert KEY in text and str(bad) in text, text
    assert err.value.errno == (errno.ENOENT if kind in ("missing", "a-file") else errno.EACCES)
    assert _tree(tmp_path) == before
    if kind == "allocation-refused" or (kind == "unwritable" and os.geteuid() == 0):
        assert refused == [str(bad / SWAP)]  # refused there (a user's access check is earlier)


@pytest.fixture
def ckpt_beside_the_tier(tmp_path: Path) -> tuple[int, dict[str, bytes | None]]:
    """A checkpoint saved by an engine with the tier under ``tmp_path`` (which it leaves as
    ``tmp_path/ckpt`` only); the tier's disk bytes and the folder's contents."""
    engine = engine_for(_model(), _nvme_cfg(tmp_path))
    try:
        disk = engine.nvme_tier.disk_bytes
        engine.train_batch(iter(_batches(1)))
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    finally:
        engine.destroy()
    tree = _tree(tmp_path)
    assert {k.split(os.sep)[0] for k in tree} == {"ckpt"}, sorted(tree)
    return disk, tree


def test_too_little_free_space_is_refused_at_initialize(
    tmp_path: Path, ckpt_beside_the_tier: tuple[int, dict[str, bytes | None]], monkeypatch: Any
) -> None:
    disk, before = ckpt_beside_the_tier
    real = swap_file.shutil.disk_usage
    free = {"bytes": disk - 1}

    def disk_usage(path: Any) -> Any:
        return real(path)._replace(free=free["bytes"])

    # only the tier's own view of the disk: shutil itself stays as it is
    monkeypatch.setattr(swap_file, "shutil", types.SimpleNamespace(disk_usage=disk_usage))
    with pytest.raises(NvmeSpaceError) as err:
        rp_engine.initialize(model=_model(), config=_nvme_cfg(tmp_path))
    text = str(err.value)
    assert err.value.errno == errno.ENOSPC
    assert KEY in text and str(tmp_path) in text, text
    assert f"({disk} bytes)" in text and f"({disk - 1} bytes) are free" in text, text
    assert _tree(tmp_path) == before  # nothing created, the checkpoint byte for byte intact

    free["bytes"] = disk  # exactly enough: it starts
    engine_for(_model(), _nvme_cfg(tmp_path)).destroy()
    assert _tree(tmp_path) == before


def test_a_disk_full_at_the_reservation_leaves_nothing_behind(
    tmp_path: Path, ckpt_beside_the_tier: tuple[int, dict[str, bytes | None]], monkeypatch: Any
) -> None:
    """The disk fills up between the free-space check and the reservation (another writer)."""
    disk, before = ckpt_beside_the_tier
    reserved = []

    def posix_fallocate(fd: int, offset: int, length: int) -> None:
        reserved.append(length)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(swap_file.os, "posix_fallocate", posix_fallocate)
    with pytest.raises(NvmeSpaceError) as err:
        rp_engine.initialize(model=_model(), config=_nvme_cfg(tmp_path))
    text = str(err.value)
    assert reserved == [disk]
    assert err.value.errno == errno.ENOSPC
    assert str(tmp_path / SWAP) in text and f"({disk} bytes)" in text, text
    assert os.strerror(errno.ENOSPC) in text, text
    assert _tree(tmp_path) == before  # no swap file, no rp_engine/ folder; checkpoint intact


# --- one live engine per nvme_path ----------------------------------------------------------------
def test_a_second_engine_on_the_same_nvme_path_is_refused_while_the_first_runs(
    tmp_path: Path,
) -> None:
    """Refused with EBUSY naming the swap file, leaving the first engine's file and training
    as they were (its losses equal those of an engine that never had a neighbour); started once
    the first is destroyed, which removes its swap file and the folders it made."""
    first = engine_for(_model(), _nvme_cfg(tmp_path))
    try:
        swap = Path(first.nvme_tier.path)
        assert swap == tmp_path / SWAP
        losses = [float(first.train_batch(iter(_batches(1))))]
        before = swap.stat()
        with pytest.raises(NvmeSpaceError) as err:
            rp_engine.initialize(model=_model(), config=_nvme_cfg(tmp_path))
        text = str(err.value)
        assert err.value.errno == errno.EBUSY
        assert str(swap) in text and "in use" in text, text
        after = swap.stat()  # neither removed nor truncated by the refused engine
        assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
        # step 2 reads the state back from the file; step 3's loss shows what it read
        losses += [float(first.train_batch(iter(_batches(step)))) for step in (2, 3)]
        first.synchronize()
    finally:
        first.destroy()
    assert not swap.exists(), "destroy removes the swap file"
    assert _tree(tmp_path) == {}, "and the folders it created"

    second = engine_for(_model(), _nvme_cfg(tmp_path))
    try:
        assert Path(second.nvme_tier.path) == swap and swap.is_file()
        alone = [float(second.train_batch(iter(_batches(step)))) for step in (1, 2, 3)]
    finally:
        second.destroy()
    assert losses == alone
    assert _tree(tmp_path) == {}
