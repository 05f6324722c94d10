"""Pipeline schedules as pure functions returning Plans, and the one registry of them.

Owns: ``roundpipe`` (stages dispatched round-robin to a stateless device pool), ``mobius``
(stages bound to GPUs with cross mapping, GPipe clock order), ``gpipe``, ``one_f_one_b``,
``interleaved_1f1b``, ``looped_bfs``; ``SCHEDULES`` (name -> ``ScheduleSpec``: builder, where the
weights live, optimizer, cut layout), read by the config, the planner, the engine, the command
lines and ``build`` (several iterations back to back). Each schedule is written once, here; the
runtime and the simulator only consume its Plan and key behaviour on the plan's properties
(``Plan.offloaded``, ``Plan.bound``). ``lower`` and ``validate`` live in lower.py and
validate.py and are re-exported here.

RoundPipe, 4 devices, S_f = 2 forward and S_b = 3 backward stages, rounds of 4 micro-batches
(slot i of a round on device (g0 + i) mod N; g0 rolls on by S every round, never reset):

    d0: F0 F0 F0 F0 | B2 B2 B2 B2 | ...          round 0 starts on d0 (slots 0 and 4)
    d1: F1 F1 F1 F1 | (round 1, slot 0: F0 ...)  round 1 starts on d1 = (0 + 5) mod 4
    d2: H0 H0 H0 H0 | ...
    d3: B1 B1 B1 B1 | ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from .actions import Action, Op, Plan, PlanError, format_grid
from .lower import lower
from .validate import validate

__all__ = [
    "ScheduleSpec",
    "SCHEDULES",
    "ENGINE_SCHEDULES",
    "BOUND_SCHEDULES",
    "OFFLOADED_SCHEDULES",
    "get_schedule",
    "roundpipe",
    "mobius",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "looped_bfs",
    "cross_mapping",
    "build",
    "chain",
    "lower",
    "validate",
]

_BoundOrder = Callable[[int, int, int, int], list[tuple[str, int, int]]]


# ---- RoundPipe -------------------------------------------------------------------------------
def roundpipe(
    *,
    fwd_cuts: Sequence[int],
    bwd_cuts: Sequence[int],
    num_devices: int,
    num_microbatches: int,
    start_device: int = 0,
    iteration: int = 0,
    round_size: int | None = None,
) -> Plan:
    """RoundPipe: rounds of ``round_size`` micro-batches (M_R, default ``num_devices``); slot i of
    a round (forward stages, then HEAD, then backward stages) runs all M_R micro-batches of the
    round on device (g0 + i) mod N, so each slot uploads its weights once per round and
    accumulates its gradients on the device across the round (see ``lower``).

    The dispatch order is the global issue order; ``next_start_device`` is where the next round
    (of the next iteration) starts, so rounds roll across iterations.
    """
    _check_shape(fwd_cuts, bwd_cuts, num_devices, num_microbatches)
    size = num_devices if round_size is None else round_size
    if size < 1:
        raise ValueError(f"round_size must be >= 1, got {round_size}")
    num_fwd, num_slots = len(fwd_cuts), len(fwd_cuts) + len(bwd_cuts)
    g0 = start_device % num_devices
    actions: list[Action] = []
    for first in range(0, num_microbatches, size):
        round_mbs = range(first, min(num_microbatches, first + size))
        for slot in range(num_slots):
            device = (g0 + slot) % num_devices
            actions += [_slot_action(slot, num_fwd, m, device, iteration) for m in round_mbs]
        g0 = (g0 + num_slots) % num_devices
    return Plan(
        actions=tuple(actions),
        num_devices=num_devices,
        num_microbatches=num_microbatches,
        fwd_cuts=tuple(fwd_cuts),
        bwd_cuts=tuple(bwd_cuts),
        schedule="roundpipe",
        next_start_device=g0,
        offloaded=True,
    )


def _slot_action(slot: int, num_fwd: int, mb: int, device: int, iteration: int) -> Action:
    if slot < num_fwd:
        return Action(Op.FWD, slot, mb, device, iteration)
    if slot == num_fwd:
        return Action(Op.HEAD, 0, mb, device, iteration)
    return Action(Op.BWD, slot - num_fwd, mb, device, iteration)


# ---- bound schedules ---------------------------------------------------------------------------
# A bound schedule is an op order per device over K stages ("F"/"B", stage k, micro-batch m);
# stage k lives on device_order[k mod N]. _bound_plan turns it into a Plan.


def _gpipe_order(
    rank: int, num_stages: int, num_devices: int, m: int
) -> list[tuple[str, int, int]]:
    local = list(range(rank, num_stages, num_devices))
    fwd = [("F", k, mb) for k in local for mb in range(m)]
    return fwd + [("B", k, mb) for k in reversed(local) for mb in range(m)]


def _one_f_one_b_order(
    rank: int, num_stages: int, num_devices: int, m: int
) -> list[tuple[str, int, int]]:
    """PyTorch Schedule1F1B: ``N - rank`` warm-up forwards, then one backward / one forward."""
    warmup = min(m, num_stages - rank)
    ops = [("F", rank, mb) for mb in range(warmup)]
    for mb in range(m - warmup):
        ops += [("B", rank, mb), ("F", rank, warmup + mb)]
    return ops + [("B", rank, mb) for mb in range(m - warmup, m)]


def _interleaved_order(
    rank: int, num_stages: int, num_devices: int, m: int
) -> list[tuple[str, int, int]]:
    """PyTorch ScheduleInterleaved1F1B (depth first), generalised to any M.

    Micro-batches go in ``rounds = max(1, M // N)`` chunks (sizes differ by at most one, where
    PyTorch requires M % rounds == 0); forwards walk local stages ascending chunk by chunk,
    backwards descending; warm-up = (v - 1) * chunk + 2 * (N - 1 - rank) forwards, then 1F1B.
    """
    v = num_stages // num_devices
    rounds = max(1, m // num_devices)
    sizes = [m // rounds + (1 if c < m % rounds else 0) for c in range(rounds)]
    chunks = [range(sum(sizes[:c]), sum(sizes[: c + 1])) for c in range(rounds)]
    local = [rank + i * num_devices for i in range(v)]
    fwd = [("F", k, mb) for chunk in chunks for k in local for mb in chunk]
    bwd = [("B", k, mb) for chunk in chunks for k in reversed(local) for mb in chunk]
    warmup = min((v - 1) * sizes[0] + 2 * (num_devices - 1 - rank), v * m)
    ops = fwd[:warmup]
    for i in range(len(fwd) - warmup):
        ops += [fwd[warmup + i], bwd[i]]
    return ops + bwd[len(fwd) - warmup :]


def _looped_bfs_order(
    rank: int, num_stages: int, num_devices: int, m: int
) -> list[tuple[str, int, int]]:
    """Looped BFS: local stages ascending, forwards of all micro-batches; then local stages
    descending, backwards of all micro-batches."""
    return _gpipe_order(rank, num_stages, num_devices, m)


def gpipe(
    *,
    stage_layers: Sequence[int],
    num_devices: int,
    num_microbatches: int,
    iteration: int = 0,
    device_order: Sequence[int] | None = None,
) -> Plan:
    """GPipe: all forwards, then all backwards; stage k on device k mod N (LM head on the last)."""
    return _bound_plan(
        "gpipe",
        _gpipe_order,
        stage_layers,
        num_devices,
        num_microbatches,
        iteration=iteration,
        device_order=device_order,
    )


def one_f_one_b(
    *,
    stage_layers: Sequence[int],
    num_devices: int,
    num_microbatches: int,
    iteration: int = 0,
    device_order: Sequence[int] | None = None,
) -> Plan:
    """1F1B (PyTorch Schedule1F1B) over exactly one stage per device."""
    if len(stage_layers) != num_devices:
        raise ValueError(
            f"1f1b needs one stage per device ({num_devices}), got {len(stage_layers)} stages; "
            "use interleaved-1f1b or looped-bfs for virtual stages"
        )
    return _bound_plan(
        "1f1b",
        _one_f_one_b_order,
        stage_layers,
        num_devices,
        num_microbatches,
        iteration=iteration,
        device_order=device_order,
    )


def interleaved_1f1b(
    *,
    stage_layers: Sequence[int],
    num_devices: int,
    num_microbatches: int,
    iteration: int = 0,
    device_order: Sequence[int] | None = None,
) -> Plan:
    """Interleaved 1F1B: v = K / N virtual stages per device (stage k on device k mod N)."""
    if len(stage_layers) % num_devices:
        raise ValueError(
            f"interleaved-1f1b needs a multiple of {num_devices} stages, got {len(stage_layers)}"
        )
    return _bound_plan(
        "interleaved-1f1b",
        _interleaved_order,
        stage_layers,
        num_devices,
        num_microbatches,
        iteration=iteration,
        device_order=device_order,
    )


def looped_bfs(
    *,
    stage_layers: Sequence[int],
    num_devices: int,
    num_microbatches: int,
    iteration: int = 0,
    device_order: Sequence[int] | None = None,
) -> Plan:
    """Looped BFS over K virtual stages (stage k on device k mod N)."""
    return _bound_plan(
        "looped-bfs",
        _looped_bfs_order,
        stage_layers,
        num_devices,
        num_microbatches,
        iteration=iteration,
        device_order=device_order,
    )


def mobius(
    *,
    fwd_cuts: Sequence[int],
    bwd_cuts: Sequence[int] | None = None,
    num_devices: int,
    num_microbatches: int,
    start_device: int = 0,
    iteration: int = 0,
    device_order: Sequence[int] | None = None,
) -> Plan:
    """Mobius: K = len(fwd_cuts) blocks bound to GPUs, block k on ``device_order[k mod N]``
    (default: cross mapping over two PCIe switches), GPipe clock order, full recomputation.

    Expressed in RoundPipe numbering so the runtime can run it: forward stage k is block k, HEAD
    is the last block's backward (head fused), backward stage j is block K-1-j, so ``bwd_cuts``
    must be ``reversed(fwd_cuts)`` (the default). Weights are uploaded per block (``lower``).
    """
    blocks = list(fwd_cuts)
    if bwd_cuts is not None and list(bwd_cuts) != blocks[::-1]:
        raise ValueError(
            f"mobius binds each block's forward and backward to one GPU, so bwd_cuts must be "
            f"reversed(fwd_cuts) = {blocks[::-1]}, got {list(bwd_cuts)}"
        )
    order = list(device_order) if device_order is not None else cross_mapping(num_devices)
    order = order[start_device % num_devices :] + order[: start_device % num_devices]
    plan = _bound_plan(
        "mobius",
        _gpipe_order,
        blocks,
        num_devices,
        num_microbatches,
        iteration=iteration,
        device_order=order,
        fused_head=True,
    )
    # bound to GPUs, but the weights live on the host and are uploaded per block
    return dataclasses.replace(plan, next_start_device=start_device % num_devices, offloaded=True)


def cross_mapping(num_devices: int, *, groups: int = 2) -> list[int]:
    """Device order interleaving PCIe switch groups: 8 devices, 2 switches -> 0,4,1,5,2,6,3,7."""
    if num_devices % groups or num_devices < 2 * groups:
        return list(range(num_devices))
    per = num_devices // groups
    return [g * per + i for i in range(per) for g in range(groups)]


def _bound_plan(
    name: str,
    order_fn: _BoundOrder,
    stage_layers: Sequence[int],
    num_devices: int,
    num_microbatches: int,
    *,
    iteration: int,
    device_order: Sequence[int] | None,
    fused_head: bool = False,
) -> Plan:
    num_stages = len(stage_layers)
    _check_shape(stage_layers, stage_layers, num_devices, num_microbatches)
    order = list(device_order) if device_order is not None else list(range(num_devices))
    if sorted(order) != list(range(num_devices)):
        raise ValueError(f"device_order must be a permutation of 0..{num_devices - 1}: {order}")

    def to_action(kind: str, k: int, mb: int) -> Action:
        device = order[k % num_devices]
        if kind == "F":
            return Action(Op.FWD, k, mb, device, iteration)
        j = num_stages - 1 - k  # bound stage k is backward stage K-1-k
        op = Op.HEAD if fused_head and j == 0 else Op.BWD
        return Action(op, j, mb, device, iteration)

    rows = [
        [to_action(*step) for step in order_fn(rank, num_stages, num_devices, num_microbatches)]
        for rank in range(num_devices)
    ]
    draft = Plan(
        actions=tuple(a for row in rows for a in row),
        num_devices=num_devices,
        num_microbatches=num_microbatches,
        fwd_cuts=tuple(stage_layers),
        bwd_cuts=tuple(reversed(stage_layers)),
        schedule=name,
        bound=True,
    )
    return dataclasses.replace(draft, actions=_merge_rows(rows, draft))


def _merge_rows(rows: Sequence[Sequence[Action]], draft: Plan) -> tuple[Action, ...]:
    """Interleave per-device rows into a global issue order, one step per device per sweep."""
    deps, done, out = draft.deps, set[Action](), list[Action]()
    cursor = [0] * len(rows)
    total = sum(len(row) for row in rows)
    while len(out) < total:
        ready = [
            r
            for r, row in enumerate(rows)
            if cursor[r] < len(row) and all(x in done for x in deps[row[cursor[r]]])
        ]
        if not ready:
            heads = [row[cursor[r]] for r, row in enumerate(rows) if cursor[r] < len(row)]
            raise PlanError(
                f"{draft.schedule}: deadlock, no device can issue its next action "
                f"(heads: {', '.join(map(str, heads))})\n"
                + format_grid(draft, mark=heads[0], limit=24)
            )
        issued = [rows[r][cursor[r]] for r in ready]
        for r in ready:
            cursor[r] += 1
        out += issued
        done.update(issued)
    return tuple(out)


# ---- the registry ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule: its builder and the properties everything else reads instead of its name.

    ``offloaded``: the weights live on the host and are uploaded per slot; the engine's executor
    runs exactly these (``ENGINE_SCHEDULES``), and iterations roll on from the previous one's
    ``next_start_device``. ``bound``: stage k stays on one device (the builder's plans set
    ``Plan.bound``; the simulator then runs a recompute after its gradient arrives, as the
    published conventions do). ``sync_only``: the optimizer steps before the next iteration
    starts (Mobius), whatever ``roundpipe.async_optimizer`` says. ``cuts``: the builder's
    keywords: ``"fwd_bwd"`` separate forward and backward cuts (``fwd_cuts``, ``bwd_cuts``;
    the partitioner searches them; ``round_size``), ``"blocks"`` one cut for both directions
    (``fwd_cuts``; the backward is its reverse), ``"stage_layers"`` bound stages.
    ``stages_per_device``: how many (virtual) stages per device a command line cuts by default.
    """

    name: str
    builder: Callable[..., Plan]
    offloaded: bool
    bound: bool
    sync_only: bool = False
    cuts: Literal["fwd_bwd", "blocks", "stage_layers"] = "stage_layers"
    stages_per_device: int = 1


SCHEDULES: Mapping[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", gpipe, offloaded=False, bound=True),
        ScheduleSpec("1f1b", one_f_one_b, offloaded=False, bound=True),
        ScheduleSpec(
            "interleaved-1f1b", interleaved_1f1b, offloaded=False, bound=True, stages_per_device=3
        ),
        ScheduleSpec("looped-bfs", looped_bfs, offloaded=False, bound=True, stages_per_device=3),
        ScheduleSpec("mobius", mobius, offloaded=True, bound=True, sync_only=True, cuts="blocks"),
        ScheduleSpec("roundpipe", roundpipe, offloaded=True, bound=False, cuts="fwd_bwd"),
    )
}
# views of the registry, for callers that want names (the config's choices, error messages)
ENGINE_SCHEDULES: tuple[str, ...] = tuple(n for n, s in SCHEDULES.items() if s.offloaded)
BOUND_SCHEDULES: tuple[str, ...] = tuple(n for n, s in SCHEDULES.items() if s.bound)
OFFLOADED_SCHEDULES: tuple[str, ...] = ENGINE_SCHEDULES


def get_schedule(name: str) -> ScheduleSpec:
    """The registry entry of ``name``; ValueError listing the names when there is none."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose from {sorted(SCHEDULES)}")
    return SCHEDULES[name]


# ---- several iterations ----------------------------------------------------------------------
def build(schedule: str, *, num_iterations: int = 1, **kwargs: object) -> Plan:
    """``num_iterations`` iterations of ``schedule`` back to back (one Plan).

    Offloaded schedules (RoundPipe, Mobius) start each iteration where the previous one left
    off (``start_device``).
    """
    spec = get_schedule(schedule)
    plans: list[Plan] = []
    for it in range(num_iterations):
        extra = {"start_device": plans[-1].next_start_device} if plans and spec.offloaded else {}
        plans.append(spec.builder(**{**kwargs, **extra, "iteration": it}))
    return chain(plans)


def chain(plans: Sequence[Plan]) -> Plan:
    """Concatenate single-iteration plans (distinct iterations, same shape) into one Plan."""
    first = plans[0]
    for p in plans[1:]:
        same = (p.fwd_cuts, p.bwd_cuts, p.num_devices) == (
            first.fwd_cuts,
            first.bwd_cuts,
            first.num_devices,
        )
        if not same:
            raise ValueError("chain: every plan must have the same cuts and devices")
    if len({it for p in plans for it in p.iterations}) != sum(len(p.iterations) for p in plans):
        raise ValueError("chain: plans must cover distinct iterations")
    return dataclasses.replace(
        first,
        actions=tuple(a for p in plans for a in p.actions),
        next_start_device=plans[-1].next_start_device,
    )


def _check_shape(
    fwd_cuts: Sequence[int], bwd_cuts: Sequence[int], num_devices: int, num_microbatches: int
) -> None:
    if num_devices < 1 or num_microbatches < 1:
        raise ValueError(
            f"need num_devices >= 1 and num_microbatches >= 1, got {num_devices}, "
            f"{num_microbatches}"
        )
    if not fwd_cuts or not bwd_cuts or min(*fwd_cuts, *bwd_cuts) < 0:
        raise ValueError(
            f"cuts must be non-empty lists of layer counts >= 0: "
            f"{list(fwd_cuts)} / {list(bwd_cuts)}"
        )
    if sum(fwd_cuts) != sum(bwd_cuts):
        raise ValueError(
            f"fwd_cuts {list(fwd_cuts)} sum to {sum(fwd_cuts)} but bwd_cuts {list(bwd_cuts)} "
            f"sum to {sum(bwd_cuts)}; both must cover all L layers"
        )
