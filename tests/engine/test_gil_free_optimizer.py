"""The host optimizer without the GIL, and the cores split between it and the pipeline.

``roundpipe.release_gil`` (default on) calls DeepSpeed's CPU Adam kernel through ctypes instead
of its GIL-holding binding (optim/nogil_adam.py): the same function, so the engine's losses and
weights equal the binding's bit for bit in every mode that steps with it (sync and async, fp32
and bf16, weight prediction, the NVMe tier, resume). ``roundpipe.optimizer_cores`` pins the
optimizer thread and its OpenMP team to their own cores (host/affinity.py).
"""

from __future__ import annotations

import copy
import os
import threading
from typing import Any

import pytest
import torch
from engine_helpers import config, engine_for
from models import tiny_qwen3
from nvme_helpers import assert_same, nvme_config, resume_from, run, save_after, save_and_go_on

from rp_engine.host.affinity import CoreSplit, available_cores, pin_process, split_cores

CASES = {
    # name: (async, bf16, staleness compensation, NVMe optimizer tier)
    "sync-fp32": (False, False, "none", False),
    "async-bf16-lookahead": (True, True, "lookahead", False),
    "async-fp32-nvme": (True, False, "none", True),
}


def _cfg(case: str, release_gil: bool, folder: str) -> dict[str, Any]:
    asyn, bf16, comp, nvme = CASES[case]
    rp = {"release_gil": release_gil, "staleness_compensation": comp}
    cfg = config(devices=2, async_optimizer=asyn, clip=1.0, lr=1e-2, roundpipe=rp)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return nvme_config(cfg, folder) if nvme else cfg


@pytest.mark.parametrize("case", list(CASES))
def test_gil_free_steps_equal_deepspeeds_binding_bit_for_bit(tmp_path, case: str) -> None:
    model = tiny_qwen3(0)
    held_losses, held = run(copy.deepcopy(model), _cfg(case, False, str(tmp_path)))
    free_losses, free = run(model, _cfg(case, True, str(tmp_path)))
    assert free_losses == held_losses
    assert_same(free["weights"], held["weights"])


def test_resume_across_the_two_bindings_is_bit_for_bit(tmp_path) -> None:
    # saved by the binding, resumed without the GIL: the run that saved and went on
    model = tiny_qwen3(0)
    folder = str(tmp_path / "ckpt")
    held = _cfg("async-bf16-lookahead", False, "")
    expect_losses, expect = save_and_go_on(copy.deepcopy(model), held, str(tmp_path / "ref"))
    save_after(copy.deepcopy(model), held, folder, 2)
    losses, weights = resume_from(model, _cfg("async-bf16-lookahead", True, ""), folder, 3)
    assert losses == expect_losses[2:]
    assert_same(weights, expect)


def test_the_engine_steps_without_the_gil_by_default() -> None:
    engine = engine_for(tiny_qwen3(0), config(devices=1))
    try:
        assert engine.host_optimizer.releases_gil
    finally:
        engine.destroy()
    engine = engine_for(tiny_qwen3(0), config(devices=1, roundpipe={"release_gil": False}))
    try:
        assert not engine.host_optimizer.releases_gil
    finally:
        engine.destroy()


# --- the core split -------------------------------------------------------------------------


def test_default_split_leaves_cpu_devices_all_cores_and_gives_adam_the_rest_on_gpus() -> None:
    sixteen = tuple(range(16))
    assert not split_cores(None, cores=sixteen, device_kind="cpu", num_devices=2).active
    one_gpu = split_cores(None, cores=sixteen, device_kind="cuda", num_devices=1)
    assert one_gpu == CoreSplit(optimizer=tuple(range(4, 16)), pipeline=(0, 1, 2, 3))
    eight = split_cores(None, cores=sixteen, device_kind="cuda", num_devices=8)
    assert len(eight.optimizer) == len(eight.pipeline) == 8  # the pipeline at most half
    assert not split_cores(None, cores=(3,), device_kind="cuda", num_devices=1).active
    ranks = split_cores(None, cores=sixteen, device_kind="cuda", num_devices=1, processes=2)
    assert not ranks.active, "data parallel ranks on one host would take the same cores"
    assert not split_cores(0, cores=sixteen, device_kind="cuda", num_devices=1).active
    assert split_cores(2, cores=(0, 2, 5), device_kind="cpu", num_devices=1) == CoreSplit(
        optimizer=(2, 5), pipeline=(0,)
    )
    assert one_gpu.describe() == "optimizer: 12 cores (4-15), pipeline threads: 4 cores (0-3)"


@pytest.mark.parametrize("wanted", [2, 5])
def test_a_split_that_leaves_the_pipeline_no_core_names_the_key(wanted: int) -> None:
    with pytest.raises(ValueError, match=r"roundpipe.optimizer_cores=.*1 to 1 "):
        split_cores(wanted, cores=(0, 1), device_kind="cpu", num_devices=1)


def _affinity(tid: int) -> set[int]:
    return set(os.sched_getaffinity(tid))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
def test_the_optimizer_thread_and_the_pipeline_run_on_their_own_cores() -> None:
    before = available_cores()
    engine = engine_for(tiny_qwen3(0), config(devices=1, roundpipe={"optimizer_cores": 1}))
    try:
        split = engine.cores
        assert split.optimizer == before[-1:] and split.pipeline == before[:-1]
        engine.train_batch(iter([_batch(), _batch()]))
        engine.synchronize()  # the optimizer thread has stepped: it took its cores first
        assert _affinity(engine.stepper.thread.native_id) == set(split.optimizer)
        assert _affinity(0) == set(split.pipeline), "the caller's thread runs the pipeline"
        for t in threading.enumerate():
            if t.name.startswith("rp-cpu"):  # the device and copy threads
                assert _affinity(t.native_id) == set(split.pipeline), t.name
        # every thread of the process (OpenMP teams included) is on one side of the split
        sides = {frozenset(split.optimizer), frozenset(split.pipeline)}
        for tid in os.listdir("/proc/self/task"):
            assert frozenset(_affinity(int(tid))) in sides, tid
    finally:
        try:
            engine.destroy()
            assert _affinity(0) == set(before), "destroy gives the cores back"
        finally:
            pin_process(before)


def _batch() -> dict[str, torch.Tensor]:
    from models import random_batch

    return random_batch(128, batch=2, seq=12, seed=1)
