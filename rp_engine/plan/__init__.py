"""Pure-Python planning layer: plans as data (no torch anywhere in this package).

Submodules: ``actions`` (Action, Plan, text form), ``partition`` (layer costs -> asymmetric
cuts), ``schedules`` (RoundPipe, Mobius and the classic baselines; lowering; validate),
``simulate`` (discrete-event simulator and ``python -m rp_engine.plan.simulate``) and ``render``
(text grid, Chrome trace, PNG). The names below are resolved lazily (PEP 562) so importing the
package does no work and ``rp_engine.plan.partition`` / ``.simulate`` stay the submodules.
"""

from __future__ import annotations

import importlib

__all__ = [
    "HOST",
    "Action",
    "Op",
    "Plan",
    "PlanError",
    "parse_action",
    "LayerCosts",
    "Partition",
    "load_costs",
    "Machine",
    "SimResult",
    "load_machine",
]

_HOMES = {
    "HOST": "actions",
    "Action": "actions",
    "Op": "actions",
    "Plan": "actions",
    "PlanError": "actions",
    "parse_action": "actions",
    "LayerCosts": "partition",
    "Partition": "partition",
    "load_costs": "partition",
    "Machine": "simulate",
    "SimResult": "simulate",
    "load_machine": "simulate",
}


def __getattr__(name: str) -> object:
    if name in _HOMES:
        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    if name in ("actions", "partition", "schedules", "simulate", "render"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
