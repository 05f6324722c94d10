"""RoundPipeEngine in parts: DeepSpeed's engine API over the RoundPipe runtime.

The engine (core.py) builds its parts, holds them as attributes and delegates DeepSpeed's
methods to them; it holds no algorithm. Each part is an object given the parts it calls, and
calls run one way, top to bottom (a part never calls the one above it, except through a hook it
was handed)::

    RoundPipeEngine (core.py; DeepSpeed's accessors and checkpoint doors: api.py)
      |-- engine.loop = WindowRunner(pipeline, planner, stepper, ...)            loop.py
      |     the imperative loop (engine(batch) / backward / step): owns the open accumulation
      |     window (window.py), the prefetched window and the gate that holds its gradients
      |     (prefetch.py), the deferred losses (deferred.py, fused_lm_head.py)
      |-- engine.pipeline = Pipeline(make_executor, stepper, planner, boundary, record, ...)
      |     the runs on the executor (pipeline.py): drained (run, eval_run) or overlapping
      |     (issue: step t issued, step t-1 finished; train_step is train_batch's), the run in
      |     flight (InFlightBox, which the exit finaliser holds), the executor itself
      |-- engine.pipeline.record = StepRecord(...)                                 record.py
      |     the last closed step: its result, its runs' stats, its timeline (api.py reads it)
      '-- engine.boundary = Boundary(optimizer, scheduler, stepper, counters, ...) boundary.py
            the optimizer boundary (loss scale, LR schedule, the step's fate), drained or in
            flight, and its repair when a step in flight closes skipped

    loop --> pipeline --> boundary, record;  loop --> pipeline.boundary (step() applies it)

The pipeline reaches the loop only through two hooks it is given: ``Pipeline.on_abort`` (the
loop's open window is lost with the steps in flight) and a provisional run's callback (a drain
of a prefetched window's run, not yet confirmed, discards it instead of closing its step).
The imports follow the same order: core -> api -> loop -> pipeline -> boundary, record,
prefetch, window (no module imports one above it).

Other modules: ``progress.py`` (DeepSpeed's timers and progress line), ``ds_surface.py``
(DeepSpeed's config getters answered by DeepSpeed; the refused gaps), ``module_view.py`` (the
module as ``engine.module`` shows it while a step is in flight).

Importing ``rp_engine`` does not import this package; ``rp_engine.initialize`` and
``rp_engine.RoundPipeEngine`` do, on first use.
"""

from __future__ import annotations

from rp_engine.engine.api import StepReport
from rp_engine.engine.core import RoundPipeEngine

__all__ = ["RoundPipeEngine", "StepReport"]
