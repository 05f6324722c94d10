"""initialize's optimizer and its misuse errors, next to real DeepSpeed's for the same arguments.

One DeepSpeed subprocess (tests/support/ds_client_optimizer.py, a one-rank process group on
CPU) records, per case, whether the optimizer ``deepspeed.initialize`` returns is the client's
object (or what its callable built), whether its ``.optimizer`` is, and whether it is a torch
AdamW; and, per misuse, the classes of the error raised. rp_engine's facts come from the same
code in this process.
"""

from __future__ import annotations

from typing import Any

import pytest
from ds_client_optimizer import CASES, MISUSES, facts, raised
from engine_helpers import config
from subprocess_helpers import run_json

import rp_engine

# DeepSpeed and rp_engine agree on these
SAME = [
    "instance_stage0_fp32",
    "callable_stage0_fp32",
    "instance_bf16",
    "instance_zero2",
    "instance_zero3_cpu_offload",
]


def _base() -> dict[str, Any]:
    """Read by both: DeepSpeed ignores the "roundpipe" section (an unknown top-level key)."""
    cfg = config(devices=1, gas=1, fwd_cuts=[2], bwd_cuts=[0, 2])
    del cfg["optimizer"]
    return cfg


@pytest.fixture(scope="module")
def deepspeed_facts() -> dict[str, Any]:
    spec = {"base": _base(), "cases": list(CASES), "misuses": list(MISUSES)}
    return run_json("ds_client_optimizer.py", spec, timeout=600)  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", SAME)
def test_returned_optimizer_is_deepspeeds(deepspeed_facts: dict[str, Any], case: str) -> None:
    """Stage 0 fp32: the client's object (or its callable's) itself; ZeRO or bf16: a wrapper
    whose ``.optimizer`` is the client's object."""
    assert facts(rp_engine.initialize, case, _base()) == deepspeed_facts["facts"][case]


def test_known_differences(deepspeed_facts: dict[str, Any]) -> None:
    """Where rp_engine deliberately differs (pinned so a change in either side is noticed):

    - a torch optimizer with ZeRO-Offload under DeepSpeed's default
      ``zero_force_ds_cpu_optimizer`` is refused by DeepSpeed (ZeRORuntimeException: "poor
      performance"); rp_engine steps every optimizer on the host anyway and accepts it, wrapped;
    - with the config's optimizer only, DeepSpeed returns its basic optimizer (FusedAdam, a
      torch optimizer) at stage 0 fp32; rp_engine returns its HostOptimizer wrapper (whose
      ``.optimizer`` is DeepSpeedCPUAdam)."""
    ds = deepspeed_facts["facts"]
    assert ds["instance_zero3_cpu_offload_forced"] == {"error": "ZeRORuntimeException"}
    ours = facts(rp_engine.initialize, "instance_zero3_cpu_offload_forced", _base())
    assert ours["error"] is None and ours["inner_is_client"]
    assert ds["config_only"]["error"] is None and ds["config_only"]["is_torch_optimizer"]
    ours = facts(rp_engine.initialize, "config_only", _base())
    assert ours["error"] is None and not ours["is_torch_optimizer"]


@pytest.mark.parametrize("misuse", list(MISUSES))
def test_misuse_error_subclasses_deepspeeds(deepspeed_facts: dict[str, Any], misuse: str) -> None:
    """``except AssertionError`` written for DeepSpeed still catches rp_engine's error, which
    also stays a ValueError/TypeError (its own class and message)."""
    theirs = deepspeed_facts["raised"][misuse]
    ours = raised(rp_engine.initialize, misuse, _base())
    assert theirs is not None and ours is not None, (theirs, ours)
    assert theirs[0] in ours, (theirs, ours)
    assert "ValueError" in ours or "TypeError" in ours
