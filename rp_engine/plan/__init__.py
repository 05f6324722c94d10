"""Pure-Python planning layer: plans as data (no torch anywhere in this package).

Submodules, in import order (each imports only earlier ones; tests/plan/test_plan_imports.py
checks it): ``actions`` (Action, Plan, text form), ``costs`` (LayerCosts, StageCosts, what a
slot holds), ``memory`` (what a device holds over a plan), ``lower`` (transfers and optimizer
steps), ``validate``, ``schedules`` (RoundPipe, Mobius and the classic baselines; the registry
``SCHEDULES``), ``simulate`` (discrete-event simulator, a subpackage), ``estimate`` (what given
cuts cost: iteration time, link time, round size and prefetch fit), ``partition`` (costs ->
asymmetric cuts), ``shapes`` (a model's public-config shape -> analytic LayerCosts and memory),
``host_ram`` (host RAM of a run with the NVMe tiers, from its largest layers, pools and
devices), ``advice`` (what the advisor answers: Advice, its ds_config, the table), ``advise``
(the configuration advisor's search: micro-batch, accumulation, round size, cuts and optimizer
tier for a shape on a machine), ``render`` (text grid, Chrome trace, PNG) and ``cli`` (``python
-m rp_engine.plan.simulate``, which runs simulate/__main__.py). ``python -m rp_engine.plan
advise ...`` runs __main__.py (outside the chain, like a ``__main__`` guard). The names below
are resolved lazily (PEP 562) so importing the package does no work and
``rp_engine.plan.partition`` / ``.simulate`` stay the submodules.
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
    "LayerCosts": "costs",
    "Partition": "partition",
    "load_costs": "costs",
    "Machine": "simulate",
    "SimResult": "simulate",
    "load_machine": "simulate",
}


# the import order of the package (first imports nothing of the package, cli may import all)
_SUBMODULES = (
    "actions",
    "costs",
    "memory",
    "traffic",
    "lower",
    "validate",
    "schedules",
    "simulate",
    "estimate",
    "partition",
    "shapes",
    "host_ram",
    "advice",
    "advise",
    "render",
    "cli",
)


def __getattr__(name: str) -> object:
    if name in _HOMES:
        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
