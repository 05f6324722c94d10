"""Running a side of a comparison in its own interpreter (real DeepSpeed needs a process group,
which must not leak into the test process), and the environment such a process needs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def run_json(script: str, spec: Any, *, timeout: float = 1200) -> Any:
    """Run ``tests/support/<script> '<spec as JSON>'``; return its last ``JSON:`` line, parsed.
    Fails the test with the child's stderr when it exits non-zero or prints no result."""
    # the caller's PYTHONPATH stays after ours (tests/support/avx2_cpu_adam.py loads its build
    # through it)
    paths = [str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    proc = subprocess.run(
        [sys.executable, str(HERE / script), json.dumps(spec)],
        capture_output=True, text=True, env=env, timeout=timeout, cwd=HERE,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON:")]
    assert proc.returncode == 0 and lines, proc.stderr[-6000:]
    return json.loads(lines[-1][5:])


def single_process_group_env() -> None:
    """In the child: the launcher variables of a one-rank process group, on a free port (so
    concurrent runs on one machine never collide)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))


def select_backend(spec: dict[str, Any]) -> None:
    """In a Hugging Face child (``spec["backend"]``): real DeepSpeed gets a one-rank process
    group environment; rp_engine is routed in with ``hf.enable(**spec["roundpipe"])``."""
    if spec["backend"] == "deepspeed":
        single_process_group_env()
    else:
        from rp_engine.integrations import hf

        hf.enable(**spec.get("roundpipe", {}))


def count_training_runs() -> list[int]:
    """From now on in this process, every training run rp_engine's executor issues appends its
    optimizer step to the returned list (a Trainer child shows one schedule per step)."""
    from rp_engine.runtime.executor import Executor

    runs: list[int] = []
    start = Executor.start

    def counted(self: Any, run_spec: Any) -> Any:
        if run_spec.train:
            runs.append(run_spec.step)
        return start(self, run_spec)

    Executor.start = counted  # type: ignore[method-assign]
    return runs
