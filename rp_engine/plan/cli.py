"""The command line of the plan package: ``python -m rp_engine.plan.simulate``.

Simulates one schedule of the registry (``schedules.SCHEDULES``) on per-layer costs and prints one
JSON object; a schedule whose optimizer is a choice is named ``<name>-sync`` / ``<name>-async``
(``roundpipe-sync``). Cuts not given on the command line come from the partitioner (forward and
backward cuts) or ``balanced_stage_layers`` (bound stages). The last module of the package: it
may import every other.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from . import render, schedules
from .actions import Plan
from .costs import LayerCosts, load_costs
from .partition import balanced_stage_layers, partition
from .schedules import SCHEDULES, ScheduleSpec
from .simulate import ASYNC_ITERATIONS, Machine, load_machine, preset_names, simulate

__all__ = ["main", "schedule_choices"]


def schedule_choices() -> list[str]:
    """Every registry schedule by command-line name: ``<name>-sync`` and ``<name>-async`` where
    the optimizer is a choice (offloaded, not sync-only), else the name."""
    names: list[str] = []
    for spec in SCHEDULES.values():
        if spec.offloaded and not spec.sync_only:
            names += [f"{spec.name}-sync", f"{spec.name}-async"]
        else:
            names.append(spec.name)
    return names


def _resolve(choice: str) -> tuple[ScheduleSpec, str]:
    """(registry entry, optimizer) of a command-line schedule name."""
    for optimizer in ("sync", "async"):
        base = choice.removesuffix(f"-{optimizer}")
        if base != choice and base in SCHEDULES:
            return SCHEDULES[base], optimizer
    return SCHEDULES[choice], "sync"


def _parse_ints(text: str | None) -> tuple[int, ...] | None:
    return None if text is None else tuple(int(v) for v in text.split(",") if v.strip())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rp_engine.plan.simulate",
        description="Simulate a pipeline schedule on per-layer costs; print one JSON object.",
    )
    p.add_argument("--costs", required=True, help="COSTS.json (see costs.LayerCosts)")
    p.add_argument(
        "--schedule",
        required=True,
        choices=schedule_choices(),
    )
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--stage-layers", help="layers per (virtual) stage of a bound schedule")
    p.add_argument("--fwd-cuts", help="RoundPipe forward stages (layers each)")
    p.add_argument("--bwd-cuts", help="RoundPipe backward stages, head stage first")
    p.add_argument(
        "--machine",
        help=f"machine preset ({', '.join(preset_names())}) or JSON; "
        "default: the simulation conventions (compute + comm_ms)",
    )
    p.add_argument(
        "--iterations",
        type=int,
        default=None,
        help=f"iterations back to back (default {ASYNC_ITERATIONS} with an async optimizer: "
        "the steady state is read from the last 6; else 1)",
    )
    p.add_argument(
        "--round-size",
        type=int,
        default=None,
        help="micro-batches per round, M_R (default: --devices, the published convention); "
        "the partitioner times its cuts at it",
    )
    p.add_argument("--memory-gb", type=float, default=None, help="partitioner memory budget")
    p.add_argument("--trace", help="write a Chrome trace JSON here")
    p.add_argument("--png", help="write a Gantt chart PNG here")
    p.add_argument("--text", action="store_true", help="print the text grid to stderr")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def _cli_plan(
    args: argparse.Namespace,
    costs: LayerCosts,
    machine: Machine | None,
    iterations: int,
    spec: ScheduleSpec,
    optimizer: str,
) -> tuple[Plan, dict[str, object]]:
    n, m = args.devices, args.microbatches
    extra: dict[str, object] = {}
    if spec.cuts == "fwd_bwd":
        fwd, bwd = _parse_ints(args.fwd_cuts), _parse_ints(args.bwd_cuts)
        if fwd is None or bwd is None:
            budget = (
                int(args.memory_gb * 2**30)
                if args.memory_gb
                else (machine.memory_bytes if machine else None)
            )
            part = partition(
                costs,
                num_devices=n,
                num_microbatches=m,
                memory_budget_bytes=budget,
                async_optimizer=optimizer == "async",
                round_size=args.round_size or n,  # timed at the rounds the plan runs
            )
            fwd, bwd = part.fwd_cuts, part.bwd_cuts
            extra["partitioner"] = True
            if part.note:
                extra["note"] = part.note
        plan = schedules.build(
            spec.name,
            num_iterations=iterations,
            fwd_cuts=fwd,
            bwd_cuts=bwd,
            num_devices=n,
            num_microbatches=m,
            round_size=args.round_size or n,
        )
        return plan, extra
    stage_layers = _parse_ints(args.stage_layers)
    if stage_layers is None:
        num_stages = min(spec.stages_per_device * n, costs.num_layers + 1)
        stage_layers = balanced_stage_layers(costs, num_stages)
    kwargs: dict[str, object] = {"num_devices": n, "num_microbatches": m}
    if spec.cuts == "blocks":
        kwargs["fwd_cuts"] = stage_layers
        if machine is not None and machine.device_order is not None:
            kwargs["device_order"] = machine.device_order
    else:
        kwargs["stage_layers"] = stage_layers
    return schedules.build(spec.name, num_iterations=iterations, **kwargs), extra


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    args = _parser().parse_args(argv)
    spec, optimizer = _resolve(args.schedule)
    costs = load_costs(args.costs)
    raw = json.loads(Path(args.costs).read_text())
    machine = load_machine(args.machine) if args.machine else None
    if raw.get("pcie_gbps"):
        base = machine or load_machine("rtx4090_pcie4_8x")
        machine = dataclasses.replace(
            base, h2d_gbps=float(raw["pcie_gbps"]), d2h_gbps=float(raw["pcie_gbps"])
        )
    is_async = optimizer == "async"
    iterations = args.iterations or (ASYNC_ITERATIONS if is_async else 1)
    plan, extra = _cli_plan(args, costs, machine, iterations, spec, optimizer)
    result = simulate(plan, costs, machine=machine, optimizer=optimizer)
    out = result.to_json()
    out.update(
        schedule=args.schedule,
        fwd_cuts=list(plan.fwd_cuts),
        bwd_cuts=list(plan.bwd_cuts),
        machine=machine.name if machine else "conventions",
        **extra,
    )
    if is_async and iterations > 1:  # the published estimate, from one iteration
        single = schedules.build(
            spec.name,
            fwd_cuts=plan.fwd_cuts,
            bwd_cuts=plan.bwd_cuts,
            num_devices=args.devices,
            num_microbatches=args.microbatches,
            round_size=args.round_size or args.devices,
        )
        one = simulate(single, costs, machine=machine, optimizer="async")
        out["bubble_ratio_fill_drain"] = round(one.bubble_ratio_fill_drain or 0.0, 6)
    if args.trace:
        render.write_chrome_trace(result, args.trace)
    if args.png:
        render.write_png(result, args.png)
    if args.text:
        print(render.text_grid(result), file=sys.stderr)
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
