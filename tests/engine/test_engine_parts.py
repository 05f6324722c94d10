"""The engine is built of named parts that call one way (rp_engine/engine/__init__.py).

``engine.loop`` (the imperative loop's window) runs on ``engine.pipeline`` (the runs on the
executor), which applies ``engine.boundary``; no class in rp_engine/engine declares members
under ``TYPE_CHECKING`` that another class would provide (the loop, pipeline and boundary
mixins this replaced did).
"""

from __future__ import annotations

import ast
from pathlib import Path

from engine_helpers import config, engine_for
from models import random_batch, tiny_qwen3

from rp_engine.engine.api import EngineParts
from rp_engine.engine.boundary import Boundary
from rp_engine.engine.loop import WindowRunner
from rp_engine.engine.pipeline import Pipeline
from rp_engine.engine.record import StepRecord

ENGINE = Path(__file__).resolve().parents[2] / "rp_engine" / "engine"


def _classes_with_declared_members() -> list[str]:
    """Classes whose body holds an ``if TYPE_CHECKING:`` block (members another provides)."""
    found = []
    for path in sorted(ENGINE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for stmt in node.body:
                if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
                    found.append(f"{path.name}:{node.name}")
    return found


def test_no_engine_class_declares_members_under_type_checking() -> None:
    assert _classes_with_declared_members() == []


def test_the_engine_holds_its_parts_and_they_share_its_state() -> None:
    cfg = config(devices=2, gas=2, lr=1e-2, fwd_cuts=[2, 2], bwd_cuts=[0, 2, 2])
    engine = engine_for(tiny_qwen3(0, layers=4), cfg)
    try:
        loop, pipeline, boundary = engine.loop, engine.pipeline, engine.boundary
        assert isinstance(loop, WindowRunner) and isinstance(pipeline, Pipeline)
        assert isinstance(boundary, Boundary) and isinstance(pipeline.record, StepRecord)
        assert loop.pipeline is pipeline and pipeline.boundary is boundary
        assert pipeline.stepper is loop.stepper is boundary.stepper is engine.stepper
        assert engine.lr_scheduler is boundary.scheduler
        assert engine._executor is pipeline.executor
        # the accessors read the parts: a step's record, the run in flight
        engine.train_batch(iter([random_batch(128, batch=2, seq=8, seed=i) for i in range(2)]))
        report = engine.step_report()
        assert engine._inflight is pipeline.inflight
        engine.synchronize()
        assert pipeline.inflight is None and pipeline.record.last is not None
        assert engine.get_global_grad_norm() == pipeline.record.last.grad_norm
        assert report is None or report.step <= engine.global_steps == 1
    finally:
        engine.destroy()


def test_the_deepspeed_accessors_are_given_the_engines_parts() -> None:
    """api.py's accessors read one typed object, ``EngineParts``, made of the engine's own
    parts (no member of theirs is left for the engine class to provide)."""
    engine = engine_for(tiny_qwen3(0, layers=2), config(devices=1, gas=1, lr=1e-2))
    try:
        parts = engine._parts
        assert isinstance(parts, EngineParts)
        assert parts.config is engine._config and parts.module is engine._module
        assert parts.counters is engine._counters and parts.progress is engine._progress
        assert parts.store is engine.store and parts.host_optimizer is engine.host_optimizer
        assert parts.stepper is engine.stepper and parts.pipeline is engine.pipeline
        assert parts.tiers is engine.tiers and parts.nvme_tier is engine.nvme_tier is None
        assert parts.client_optimizer is engine.client_optimizer is None
        assert parts.finalizer is engine._finalizer and parts.finalizer.alive
        engine.train_batch(iter([random_batch(128, batch=2, seq=8, seed=0)]))
        assert engine.global_steps == parts.counters.global_steps == 1
        engine.global_steps = 5  # checkpoint loading sets the counters through the accessors
        assert parts.counters.global_steps == 5
    finally:
        engine.destroy()
    assert not parts.finalizer.alive
