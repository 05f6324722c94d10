"""Choosing cuts and issuing plans: config cuts, an estimate, then one re-plan from measurements.

The planner owns the rolling start device (RoundPipe never resets rounds between iterations)
and the cost profile of the first iterations. It calls the pure ``plan`` package for the
partition search and the schedule, and turns cuts into a :class:`StageMap` for the executor.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from rp_engine.plan import schedules
from rp_engine.plan.actions import Op, Plan
from rp_engine.plan.partition import LayerCosts, partition
from rp_engine.runtime.stages import StageMap

__all__ = ["Planner", "ModelShape"]

log = logging.getLogger("rp_engine.planning")


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about the model before any measurement."""

    num_blocks: int
    has_prefix: bool
    block_param_bytes: tuple[int, ...]
    head_param_bytes: int
    prefix_param_bytes: int


class Planner:
    """Cuts, stage map and plans for one engine; see the module docstring."""

    def __init__(
        self,
        shape: ModelShape,
        *,
        num_devices: int,
        num_microbatches: int,
        schedule: str = "roundpipe",
        fwd_cuts: Sequence[int] | None = None,
        bwd_cuts: Sequence[int] | None = None,
        memory_budget_bytes: int | None = None,
        profile_iterations: int = 2,
        async_optimizer: bool = True,
        round_size: int | None = None,
    ) -> None:
        self.shape = shape
        self.round_size = _round_size(round_size, num_microbatches)
        self.num_devices = num_devices
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.memory_budget_bytes = memory_budget_bytes
        self.async_optimizer = async_optimizer  # the two modes want different cuts
        self.fixed = fwd_cuts is not None and bwd_cuts is not None
        self.profile_left = 0 if self.fixed else profile_iterations
        self._fwd_samples: dict[int, list[float]] = {}
        self._bwd_samples: dict[int, list[float]] = {}
        self.start_device = 0
        self.replanned = False
        self.last_plan: Plan | None = None  # the last whole iteration issued
        if self.fixed:
            fixed = (tuple(fwd_cuts or ()), tuple(bwd_cuts or ()))
            self.set_cuts(*fixed)  # shape errors first: they name the roundpipe keys
            if memory_budget_bytes is not None:  # and a stage that cannot fit fails now
                self._search(self._estimate(), cuts=fixed)
        elif schedule == "mobius":
            # Mobius binds one block of layers per GPU, forward and backward alike.
            blocks = _even_split(shape.num_blocks, min(num_devices, shape.num_blocks))
            self.fixed, self.profile_left = True, 0
            self.set_cuts(blocks, blocks[::-1])
        else:
            self.set_cuts(*self._search(self._estimate()))

    # --- cuts ---------------------------------------------------------------------------------
    def set_cuts(self, fwd_cuts: tuple[int, ...], bwd_cuts: tuple[int, ...]) -> None:
        self.fwd_cuts, self.bwd_cuts = fwd_cuts, bwd_cuts
        self.stages = StageMap.from_cuts(
            num_blocks=self.shape.num_blocks,
            has_prefix=self.shape.has_prefix,
            fwd_cuts=fwd_cuts,
            bwd_cuts=bwd_cuts,
        )

    def _estimate(self) -> LayerCosts:
        """Costs before any measurement: time proportional to parameter bytes (a dense layer's
        FLOPs per token are ~2x its parameters), backward = 2x forward, recompute = forward."""
        unit = 1e-6
        fwd = [max(b, 1) * unit for b in self.shape.block_param_bytes]
        return _costs(self.shape, fwd, [2 * f for f in fwd], self.shape.head_param_bytes * unit)

    def _search(
        self, costs: LayerCosts, *, cuts: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The partition search (or, with ``cuts``, only its memory check of those cuts)."""
        part = partition(
            costs,
            num_devices=self.num_devices,
            num_microbatches=self.num_microbatches,
            memory_budget_bytes=self.memory_budget_bytes,
            async_optimizer=self.async_optimizer,
            fwd_cuts=cuts[0] if cuts else None,
            bwd_cuts=cuts[1] if cuts else None,
        )
        return tuple(part.fwd_cuts), tuple(part.bwd_cuts)

    # --- plans --------------------------------------------------------------------------------
    def plan(self, num_microbatches: int, *, ops: frozenset[Op] | None = None) -> Plan:
        """The lowered plan of one iteration (or of its ``ops`` part: the imperative loop runs
        the forward and the backward of one micro-batch separately), starting on the rolling
        start device: what the executor runs and what the simulator counts."""
        if self.schedule == "mobius":
            plan = schedules.mobius(
                fwd_cuts=self.fwd_cuts,
                bwd_cuts=self.bwd_cuts,
                num_devices=self.num_devices,
                num_microbatches=num_microbatches,
                start_device=self.start_device,
            )
        else:
            plan = schedules.roundpipe(
                fwd_cuts=self.fwd_cuts,
                bwd_cuts=self.bwd_cuts,
                num_devices=self.num_devices,
                num_microbatches=num_microbatches,
                start_device=self.start_device,
                round_size=min(self.round_size, num_microbatches),
            )
        if ops is None or Op.BWD in ops:  # the iteration (or its backward half) is issued
            self.start_device = plan.next_start_device
        if ops is not None:
            plan = dataclasses.replace(plan, actions=tuple(a for a in plan.actions if a.op in ops))
        lowered = schedules.lower(plan, offload=True, optimizer="")
        if ops is None:
            self.last_plan = lowered
        return lowered

    def byte_costs(self) -> LayerCosts:
        """Layer costs with the model's real byte sizes (times are the estimate): what the
        simulator needs to count the bytes a plan moves."""
        return self._estimate()

    # --- profiling ----------------------------------------------------------------------------
    def observe(self, fwd_ms: dict[int, list[float]], bwd_ms: dict[int, list[float]]) -> bool:
        """Feed one profiled iteration; re-plans once after ``profile_iterations``.

        ``fwd_ms``: layer index -> forward times; ``bwd_ms``: backward stage -> stage times.
        Returns True when the cuts changed.
        """
        if self.profile_left <= 0:
            return False
        for layer, times in fwd_ms.items():
            self._fwd_samples.setdefault(layer, []).extend(times)
        for stage, times in bwd_ms.items():
            self._bwd_samples.setdefault(stage, []).extend(times)
        self.profile_left -= 1
        if self.profile_left > 0:
            return False
        costs = self._measured()
        if costs is None:
            return False
        old = (self.fwd_cuts, self.bwd_cuts)
        self.set_cuts(*self._search(costs))
        self.replanned = (self.fwd_cuts, self.bwd_cuts) != old
        log.info(
            "re-planned from measurements: fwd_cuts %s bwd_cuts %s", self.fwd_cuts, self.bwd_cuts
        )
        return self.replanned

    def _measured(self) -> LayerCosts | None:
        p = 1 if self.shape.has_prefix else 0
        n = self.shape.num_blocks
        med = {k: statistics.median(v) for k, v in self._fwd_samples.items() if v}
        if any(p + i not in med for i in range(n)):
            return None
        fwd = [med[p + i] for i in range(n)]
        # Backward stage time = recompute + backward of its layers; split the backward part
        # over the stage's layers in proportion to their forward times.
        bwd = [2 * f for f in fwd]
        for j, times in self._bwd_samples.items():
            layers = [i - p for i in self.stages.bwd[j] if p <= i < p + n]
            if j == 0 or not layers:
                continue
            stage_f = sum(fwd[i] for i in layers)
            back = max(statistics.median(times) - stage_f, 0.0)
            for i in layers:
                bwd[i] = back * fwd[i] / stage_f if stage_f > 0 else back / len(layers)
        head = med.get(self.stages.head_index, 0.0)
        head_stage = self._bwd_samples.get(0)
        head_total = statistics.median(head_stage) if head_stage else 3 * head
        return _costs(self.shape, fwd, bwd, head_total / 3)


def _round_size(requested: int | None, gas: int) -> int:
    """M_R: micro-batches a slot serves per weight upload. Default: the whole step (GAS), so
    each slot uploads its weights once per optimizer step; a given value must divide GAS."""
    if requested is None:
        return gas
    if requested < 1 or gas % requested:
        raise ValueError(
            f"roundpipe.round_size {requested} must be a positive divisor of "
            f"gradient_accumulation_steps ({gas}); e.g. {gas} (one round per step) or 1"
        )
    return requested


def _even_split(n: int, parts: int) -> tuple[int, ...]:
    """``n`` items in ``parts`` contiguous groups, sizes differing by at most one."""
    return tuple(n // parts + (1 if i < n % parts else 0) for i in range(parts))


def _costs(shape: ModelShape, fwd: list[float], bwd: list[float], head_fwd: float) -> LayerCosts:
    return LayerCosts(
        fwd_ms=tuple(fwd),
        bwd_ms=tuple(bwd),
        recompute_ms=tuple(fwd),
        param_bytes=shape.block_param_bytes,
        act_bytes=tuple(0 for _ in fwd),
        head_fwd_ms=head_fwd,
        head_bwd_ms=2 * head_fwd,
        head_param_bytes=shape.head_param_bytes,
        prefix_param_bytes=shape.prefix_param_bytes,
    )
