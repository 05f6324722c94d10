"""DeepSpeed's progress output: ``engine.timers``, ``engine.tput_timer`` and the lines rank 0
prints every ``steps_per_print`` steps, seen without the user configuring logging.

DeepSpeed 0.19.8 prints, on rank 0 (``[Rank 0]`` prefix, as its ``log_dist``):

- at every ``steps_per_print``-th optimizer step of the imperative loop, ``step=N, skipped=S,
  lr=[...], mom=[...]`` (engine ``_report_progress``) and the throughput line ``epoch=E/
  micro_step=M/global_step=N, RunningAvgSamplesPerSec=..., CurrSamplesPerSec=..., MemAllocated=
  ...GB, MaxMemAllocated=...GB`` (``ThroughputTimer.stop``). Those go through DeepSpeed's own
  logger; here they go to stdout (``print``, as its ``print_dist``), so a user sees them with the
  root logger untouched. rp_engine adds ``loss=`` to the step line when the step's losses are
  already known (the runs report them; reading one never runs anything);
- for ``train_batch`` (its PipelineEngine), ``steps: N loss: L iter time (s): T samples/sec: X``;
- with ``wall_clock_breakdown``, ``time (ms) | fwd_microstep: ... | bwd_microstep: ... |
  step_microstep: ...`` at every ``step()`` and ``time (ms) | fwd: ... | bwd: ... | step: ...``
  at every boundary (``train_batch``: ``time (ms) | train_batch: ...`` at its progress steps).

What the timers measure here: the wall time spent *inside* ``engine(batch)``, ``backward`` and
``step``. The loop queues micro-batches and runs the whole accumulation window as one schedule at
the boundary's ``backward`` (engine/loop.py), so ``fwd`` is mostly queueing and ``bwd`` at the
boundary holds the window's forward *and* backward: whole-window figures, not per-pass ones. The
throughput timer counts as DeepSpeed's (from a forward's start to its ``step()``'s end, the first
``start_step`` global steps not counted), so samples/s compare.

Nothing here reads a loss tensor: the losses are the floats the runs already returned.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Progress", "ThroughputTimer", "WallClockTimers", "TimerFlags"]

# DeepSpeed's timer names (deepspeed/utils/timer.py), the ones rp_engine measures
FORWARD_MICRO, FORWARD_GLOBAL = "fwd_microstep", "fwd"
BACKWARD_MICRO, BACKWARD_GLOBAL = "bwd_microstep", "bwd"
STEP_MICRO, STEP_GLOBAL = "step_microstep", "step"
TRAIN_BATCH = "train_batch"
MICRO_TIMERS = (FORWARD_MICRO, BACKWARD_MICRO, STEP_MICRO)
GLOBAL_TIMERS = (FORWARD_GLOBAL, BACKWARD_GLOBAL, STEP_GLOBAL)
_EPSILON = 1e-6  # DeepSpeed's TIME_EPSILON


class _Timer:
    """One named timer of :class:`WallClockTimers` (DeepSpeed's ``SynchronizedWallClockTimer
    .Timer``: start/stop/elapsed in ms/reset/mean), timed on the host clock."""

    def __init__(self, name: str) -> None:
        self.name_ = name
        self.started_ = False
        self.start_time = 0.0
        self.records: list[float] = []  # seconds of each start..stop

    def start(self) -> None:
        if self.started_:
            raise RuntimeError(f"{self.name_} timer has already been started (as DeepSpeed)")
        self.start_time = time.perf_counter()
        self.started_ = True

    def stop(self, reset: bool = False, record: bool = False) -> None:
        if not self.started_:
            raise RuntimeError(f"{self.name_} timer is not started (as DeepSpeed)")
        self.records.append(time.perf_counter() - self.start_time)
        self.started_ = False

    def reset(self) -> None:
        self.started_ = False
        self.records.clear()

    def elapsed(self, reset: bool = True) -> float:
        """Milliseconds of the recorded intervals (a running one is included, as DeepSpeed's)."""
        running = self.started_
        if running:
            self.stop()
        ms = sum(self.records) * 1000.0
        if reset:
            self.reset()
        if running:
            self.start()
        return ms

    def mean(self) -> float:
        """Mean seconds of the recorded intervals (DeepSpeed trims 10 %; few records here)."""
        return sum(self.records) / len(self.records) if self.records else 0.0


class WallClockTimers:
    """``engine.timers``: DeepSpeed's ``SynchronizedWallClockTimer`` interface (``timers(name)
    .start()/.stop()/.elapsed()``, ``get_timers()``, ``log(names)``, ``get_mean``) on the host
    clock. Scripts use it for their own timers too (Megatron-DeepSpeed's ``timers('x')``)."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.timers: dict[str, _Timer] = {}
        self._emit = emit

    def __call__(self, name: str) -> _Timer:
        if name not in self.timers:
            self.timers[name] = _Timer(name)
        return self.timers[name]

    def get_timers(self) -> dict[str, _Timer]:
        return self.timers

    def log(
        self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True,
        memory_breakdown: bool = False, ranks: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        """Print ``time (ms) | name: ms | ...`` for the named timers that exist (rank 0)."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer = {normalizer}: must be > 0 (as DeepSpeed)")
        text = "time (ms)"
        for name in names:
            if name in self.timers:
                text += f" | {name}: {self.timers[name].elapsed(reset=reset) / normalizer:.2f}"
        self._emit(text)

    def get_mean(
        self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True
    ) -> dict[str, float]:
        """Mean milliseconds per interval of the named timers that exist."""
        return {n: self.timers[n].mean() * 1000.0 / normalizer for n in names if n in self.timers}


@dataclass(frozen=True)
class TimerFlags:
    """DeepSpeed's ``timers.throughput`` config block (``enabled``, ``synchronized``)."""

    enabled: bool = True
    synchronized: bool = True

    @classmethod
    def from_raw(cls, raw: Any) -> TimerFlags:
        block = (raw.get("timers") or {}).get("throughput") or {} if isinstance(raw, dict) else {}
        return cls(bool(block.get("enabled", True)), bool(block.get("synchronized", True)))


class ThroughputTimer:
    """``engine.tput_timer``: DeepSpeed's ``ThroughputTimer`` names and arithmetic (``start``,
    ``stop(global_step, report_speed)``, ``update_epoch_count``, ``avg_samples_per_sec``, the
    counters), its report line printed through ``emit``."""

    def __init__(
        self, config: TimerFlags, batch_size: int, *, start_step: int = 2,
        steps_per_output: int | None = None, emit: Callable[[str], None],
        memory: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ) -> None:  # fmt: skip
        self.config = config
        self.batch_size = batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False
        self.initialized = False
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self._emit = emit
        self._memory = memory  # (allocated, max allocated) bytes of the compute devices

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        if not self.config.enabled:
            return
        self.initialized = self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.config.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time <= 0:
            return  # the first start_step steps are not timed (as DeepSpeed)
        self.end_time = time.time()
        duration = self.end_time - self.start_time
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if not global_step:
            return
        if report_speed and self._is_report_boundary():
            alloc, peak = self._memory()
            self._emit(
                f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/global_step="
                f"{self.global_step_count}, RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
                f"CurrSamplesPerSec={self.batch_size / (self.step_elapsed_time + _EPSILON)}, "
                f"MemAllocated={round(alloc / 2**30, 2)}GB, MaxMemAllocated={round(peak / 2**30, 2)}GB"
            )
        self.step_elapsed_time = 0.0

    def _is_report_boundary(self) -> bool:
        every = self.steps_per_output
        return every is not None and every > 0 and self.global_step_count % every == 0

    def avg_samples_per_sec(self) -> float:
        if self.global_step_count > 0:
            timed = self.global_step_count - self.start_step
            if timed <= 0 or self.total_elapsed_time <= 0:
                return float("-inf")  # nothing timed yet (DeepSpeed divides by zero here)
            return self.batch_size / (self.total_elapsed_time / timed)
        return float("-inf")


class Progress:
    """The engine's progress part: its timers, the losses its runs reported since the last
    boundary, and the lines rank 0 prints (module docstring). ``rank0`` False: nothing printed."""

    def __init__(
        self, *, steps_per_print: int | None, wall_clock_breakdown: bool, batch_size: int,
        flags: TimerFlags, rank0: bool, memory: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ) -> None:  # fmt: skip
        self.every = steps_per_print
        self.breakdown = wall_clock_breakdown
        self.rank0 = rank0
        self.timers = WallClockTimers(self._print)
        self.tput_timer = ThroughputTimer(
            flags, batch_size, steps_per_output=steps_per_print, emit=self._print, memory=memory
        )
        self.wall_clock_cache: dict[str, float] = {}  # get_wall_clock_timers()
        self._losses: list[float] = []  # the open step's micro-batch losses, as the runs gave them

    def _print(self, text: str, *, prefix: str = "[Rank 0] ") -> None:
        if self.rank0:  # stdout, as DeepSpeed's print_dist: no logging configuration needed
            print(prefix + text, flush=True)

    def note(self, text: str) -> None:
        """A line the user must see once (the plan at initialize), on rank 0's stdout."""
        self._print(text)

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` is a progress step."""
        return self.every is not None and self.every > 0 and step % self.every == 0

    # --- what the engine tells it ---------------------------------------------------------------
    def observe_losses(self, losses: Sequence[float]) -> None:
        """A training run's per-micro-batch losses (already floats: nothing is forced)."""
        self._losses.extend(losses)

    def start(self, *names: str) -> None:
        if self.breakdown:
            for name in names:
                self.timers(name).start()

    def stop(self, *names: str) -> None:
        if self.breakdown:
            for name in names:
                timer = self.timers(name)
                if timer.started_:
                    timer.stop()

    def boundary(self, step: int, *, skipped: int, lr: list[float], mom: list[Any]) -> None:
        """An optimizer step's boundary: DeepSpeed's ``step=...`` line at progress steps, with
        the mean of the step's known losses; the step's losses are forgotten either way."""
        losses, self._losses = self._losses, []
        if not self.due(step):
            return
        text = f"step={step}, skipped={skipped}, lr={lr}, mom={mom}"
        if losses:
            text += f", loss={sum(losses) / len(losses):.6g}"
        self._print(text)

    def after_step(self, *, boundary: bool) -> None:
        """The end of ``step()``: the throughput timer and, with the breakdown, the timers
        DeepSpeed prints there (micro timers every call, global ones at the boundary)."""
        self.tput_timer.stop(global_step=boundary, report_speed=boundary)
        if not self.breakdown:
            return
        names = [*MICRO_TIMERS, *GLOBAL_TIMERS]
        self.wall_clock_cache = {
            n: self.timers(n).elapsed(reset=False) for n in names if n in self.timers.timers
        }
        self.timers.log(MICRO_TIMERS)
        if boundary:
            self.timers.log(GLOBAL_TIMERS)

    def start_train_batch(self) -> None:
        """``train_batch`` begins (its PipelineEngine times every call, breakdown or not)."""
        self.tput_timer.start()
        timer = self.timers(TRAIN_BATCH)
        if not timer.started_:
            timer.start()

    def after_train_batch(self, step: int, loss: float, *, batch_size: int) -> None:
        """The end of ``train_batch``: its PipelineEngine's line at progress steps (printed
        without the rank prefix, as its ``print``)."""
        self.tput_timer.stop(global_step=True, report_speed=False)
        timer = self.timers(TRAIN_BATCH)
        if timer.started_:
            timer.stop()
        if not self.due(step):
            return
        assert self.every is not None
        elapsed_s = timer.elapsed(reset=not self.breakdown) / 1000.0
        iter_time = elapsed_s / self.every
        tput = batch_size / iter_time if iter_time > 0 else float("inf")
        self._print(
            f"steps: {step} loss: {loss:0.4f} iter time (s): {iter_time:0.3f} "
            f"samples/sec: {tput:0.3f}",
            prefix="",
        )
        if self.breakdown:
            self.wall_clock_cache = {TRAIN_BATCH: timer.elapsed(reset=False)}
            self.timers.log([TRAIN_BATCH])
