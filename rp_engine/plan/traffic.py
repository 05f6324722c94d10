"""The activation traffic an offloaded plan makes the runtime move, counted from the plan.

Weight and gradient traffic are plan actions (UPLOAD, DOWNLOAD: ``simulate`` counts their bytes).
Activations follow the runtime's rules for each micro-batch, which this module states once:

- forward stage 0 reads the micro-batch from the host (H2D, ``batch_bytes``);
- a forward stage (or the HEAD) whose producer ran on another device receives its input through
  the host (D2H there, H2D here; consumer GPUs have no peer-to-peer): ``boundary_bytes`` each way;
- a backward stage's input is stashed on the host after the forward and uploaded again for its
  recompute, even on the same device (device memory holds no activations between the two):
  ``boundary_bytes`` each way; the stage that recomputes the prefix reads the micro-batch from
  the host instead (``batch_bytes`` H2D);
- the gradient flowing into a backward stage from another device crosses through the host:
  ``boundary_grad_bytes`` (default ``boundary_bytes``) each way.

``tests/engine/test_plan_executed.py`` checks these counts against the bytes the devices measure.
"""

from __future__ import annotations

from collections.abc import Mapping

from .actions import Action, Op, Plan
from .costs import LayerCosts

__all__ = ["activation_traffic"]


def activation_traffic(plan: Plan, costs: LayerCosts, *, prefix: bool = True) -> dict[str, int]:
    """``{"act_h2d": bytes, "act_d2h": bytes}`` of ``plan``'s compute actions. ``prefix``: the
    model has an embedding prefix, recomputed by the backward stage that holds layer 0."""
    state = costs.boundary_bytes
    grad = costs.boundary_grad_bytes or state
    compute = {(a.op, a.stage, a.microbatch, a.iteration): a for a in plan.actions if a.is_compute}
    first_layer = {
        j: plan.slot_layers(plan.num_fwd_stages + j).start for j in range(len(plan.bwd_cuts))
    }
    h2d = d2h = 0
    for a in compute.values():
        if a.op is Op.FWD and a.stage == 0:
            h2d += costs.batch_bytes
        elif a.op is Op.FWD or a.op is Op.HEAD:
            src = _get(compute, Op.FWD, (a.stage if a.op is Op.FWD else plan.num_fwd_stages) - 1, a)
            moved = state if src is not None and src.device != a.device else 0
            h2d, d2h = h2d + moved, d2h + moved
        elif a.op is Op.BWD and a.stage >= 1:
            if prefix and first_layer[a.stage] == 0:
                h2d += costs.batch_bytes
            else:
                h2d, d2h = h2d + state, d2h + state
            upstream = _get(compute, Op.HEAD if a.stage == 1 else Op.BWD, a.stage - 1, a)
            moved = grad if upstream is not None and upstream.device != a.device else 0
            h2d, d2h = h2d + moved, d2h + moved
    return {"act_h2d": h2d, "act_d2h": d2h}


def _get(
    compute: Mapping[tuple[Op, int, int, int], Action], op: Op, stage: int, a: Action
) -> Action | None:
    """The compute action ``op`` of ``stage`` for ``a``'s micro-batch and iteration."""
    return compute.get((op, stage, a.microbatch, a.iteration))
