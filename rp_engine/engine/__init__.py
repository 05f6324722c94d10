"""RoundPipeEngine in parts: DeepSpeed's engine API over the RoundPipe runtime.

The class is composed of mixins, one job each; the engine wires the parts and holds no algorithm:

- ``core.py``: :class:`RoundPipeEngine` itself: builds and wires the parts (layers, host store,
  optimizer and stepper, planner, executor, monitor, data feed), ``eval_batch``, the run helpers
  the mixins share (one plan run on the executor, an aborted step) and ``destroy``.
- ``api.py``: the DeepSpeed accessors that are bookkeeping over the engine's state (counters,
  config getters, ``get_lr``, ``module``, ``synchronize``, train/eval modes, data-parallel
  rank and size, ``last_step_stats`` / ``step_report``) and the checkpoint doors
  (``save_checkpoint`` / ``load_checkpoint`` / ``save_16bit_model`` call
  :mod:`rp_engine.checkpoint`).
- ``boundary.py``: the optimizer boundary (loss scale, LR schedule, the step's fate), applied
  drained or in flight, and undone for a step skipped late.
- ``loop.py``: DeepSpeed's imperative loop (``engine(batch)``, ``backward``, ``step``), each
  accumulation window run as one schedule: ``window.py`` holds the window's micro-batches and
  their states, ``deferred.py`` the deferred losses ``engine(batch)`` returns (pure torch);
  ``fused_lm_head.py`` builds TRL's fused-LM-head output for it.
- ``pipeline.py``: ``train_batch`` with overlapping iterations (issue step t, finish step t-1)
  and the in-flight box that ``destroy()`` and the exit finaliser drain.

Importing ``rp_engine`` does not import this package; ``rp_engine.initialize`` and
``rp_engine.RoundPipeEngine`` do, on first use.
"""

from __future__ import annotations

from rp_engine.engine.api import StepReport
from rp_engine.engine.core import RoundPipeEngine

__all__ = ["RoundPipeEngine", "StepReport"]
