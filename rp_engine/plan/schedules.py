"""Pipeline schedules as pure functions returning Plans, the lowering pass, and validate().

Owns: ``roundpipe`` (stages dispatched round-robin to a stateless device pool), ``mobius``
(stages bound to GPUs with cross mapping, GPipe clock order), ``gpipe``, ``one_f_one_b``,
``interleaved_1f1b``, ``looped_bfs``; ``build`` (several iterations back to back), ``lower`` (adds
UPLOAD / FREE / DOWNLOAD / SEND / OPT actions for the simulator and validator) and ``validate``.
Each schedule is written once, here; the runtime and the simulator only consume its Plan.

RoundPipe, 4 devices, S_f = 2 forward and S_b = 3 backward stages, rounds of 4 micro-batches
(slot i of a round on device (g0 + i) mod N; g0 rolls on by S every round, never reset):

    d0: F0 F0 F0 F0 | B2 B2 B2 B2 | ...          round 0 starts on d0 (slots 0 and 4)
    d1: F1 F1 F1 F1 | (round 1, slot 0: F0 ...)  round 1 starts on d1 = (0 + 5) mod 4
    d2: H0 H0 H0 H0 | ...
    d3: B1 B1 B1 B1 | ...
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from .actions import HOST, Action, Op, Plan, PlanError, format_bytes, format_grid

if TYPE_CHECKING:
    from .partition import LayerCosts, StageCosts

__all__ = [
    "SCHEDULES",
    "BOUND_SCHEDULES",
    "OFFLOADED_SCHEDULES",
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

BOUND_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "mobius")
OFFLOADED_SCHEDULES = ("roundpipe", "mobius")  # weights live on the host, uploaded per stage

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
    return dataclasses.replace(plan, next_start_device=start_device % num_devices)


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


# ---- several iterations ----------------------------------------------------------------------
SCHEDULES: Mapping[str, Callable[..., Plan]] = {
    "roundpipe": roundpipe,
    "mobius": mobius,
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "looped-bfs": looped_bfs,
}


def build(schedule: str, *, num_iterations: int = 1, **kwargs: object) -> Plan:
    """``num_iterations`` iterations of ``schedule`` back to back (one Plan).

    RoundPipe and Mobius iterations start where the previous one left off (``start_device``).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {sorted(SCHEDULES)}")
    fn = SCHEDULES[schedule]
    plans: list[Plan] = []
    for it in range(num_iterations):
        extra = (
            {"start_device": plans[-1].next_start_device}
            if plans and (schedule in OFFLOADED_SCHEDULES)
            else {}
        )
        plans.append(fn(**{**kwargs, **extra, "iteration": it}))
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


# ---- lowering: transfers and optimizer steps ---------------------------------------------------
def lower(
    plan: Plan, *, offload: bool | None = None, optimizer: str = "async", prefetch_depth: int = 1
) -> Plan:
    """Add transfer and optimizer actions to a compute-only plan.

    Every cross-device data edge gets a SEND to the consumer's device. With ``offload`` (default:
    RoundPipe and Mobius) every group of consecutive same-slot compute actions on a device (a
    slot's round) gets ONE UPLOAD of its weights, issued as soon as the FREE of the group
    ``prefetch_depth + 1`` back on that device allows (at most ``prefetch_depth + 1`` groups'
    weights resident), a DOWNLOAD of the gradients the group accumulated on the device (backward
    groups), a FREE after it, and each layer an OPT per iteration on the host (``optimizer``
    "sync" or "async", "" for none). This is the plan the executor runs.
    """
    plan = dataclasses.replace(plan, prefetch_depth=prefetch_depth)
    if any(not a.is_compute for a in plan.actions):
        raise ValueError("lower() takes a compute-only plan (FWD/HEAD/BWD actions)")
    offload = plan.schedule in OFFLOADED_SCHEDULES if offload is None else offload
    key = {a: float(i) for i, a in enumerate(plan.actions)}
    key.update(_send_keys(plan, key))
    if offload:
        key.update(_weight_keys(plan, key))
        key.update({o: float("inf") for o in _opt_actions(plan) if optimizer})
    draft = dataclasses.replace(
        plan,
        actions=tuple(sorted(key, key=key.__getitem__)),
        optimizer=optimizer if offload else "",
    )
    for o in (a for a in draft.actions if a.op is Op.OPT):
        key[o] = max(key[d] for d in draft.deps[o]) + 0.45
    return dataclasses.replace(draft, actions=_stable_topological(draft, key))


def _send_keys(plan: Plan, key: Mapping[Action, float]) -> dict[Action, float]:
    rows = {d: plan.per_device(d) for d in range(plan.num_devices)}
    pos = {a: i for row in rows.values() for i, a in enumerate(row)}
    sends: dict[Action, float] = {}
    for consumer in plan.actions:
        for src in plan.deps[consumer]:
            if src.device == consumer.device:
                continue
            send = Action(Op.SEND, plan.slot(src), src.microbatch, consumer.device, src.iteration)
            before = rows[consumer.device][pos[consumer] - 2] if pos[consumer] >= 2 else src
            k = max(key[src], key[before]) + 0.5
            sends[send] = min(k, sends.get(send, k))
    return sends


def _weight_keys(plan: Plan, key: Mapping[Action, float]) -> dict[Action, float]:
    from .actions import _compute_groups  # same package: the grouping rule lives with the deps

    out: dict[Action, float] = {}
    for d, groups in _compute_groups(plan).items():
        for gi, group in enumerate(groups):
            first, last = group[0], group[-1]
            slot, m0, it = plan.slot(first), first.microbatch, first.iteration
            # issued when the device starts the group prefetch_depth back (its memory gate)
            back = plan.prefetch_depth
            out[Action(Op.UPLOAD, slot, m0, d, it)] = (
                key[groups[gi - back][0]] + 0.25 if back and gi >= back else key[first] - 0.5
            )
            if slot >= plan.num_fwd_stages:
                out[Action(Op.DOWNLOAD, slot, m0, d, it)] = key[last] + 0.3
            out[Action(Op.FREE, slot, m0, d, it)] = key[last] + 0.4
    return out


def _opt_actions(plan: Plan) -> list[Action]:
    layers = range(plan.num_layers + 1)  # layer L is the head
    return [Action(Op.OPT, layer, 0, HOST, it) for it in plan.iterations for layer in layers]


def _stable_topological(draft: Plan, key: Mapping[Action, float]) -> tuple[Action, ...]:
    """Topological order of deps + each device's compute order, smallest key first."""
    preds: dict[Action, set[Action]] = {a: set(draft.deps[a]) for a in draft.actions}
    for d in range(draft.num_devices):
        row = [a for a in draft.per_device(d) if a.is_compute]
        for prev, nxt in zip(row, row[1:], strict=False):
            preds[nxt].add(prev)
    succs: dict[Action, list[Action]] = defaultdict(list)
    for a, ps in preds.items():
        for p in ps:
            succs[p].append(a)
    seq = {a: i for i, a in enumerate(draft.actions)}
    waiting = {a: len(ps) for a, ps in preds.items()}
    heap = [(key[a], seq[a], a) for a, n in waiting.items() if n == 0]
    heapq.heapify(heap)
    out: list[Action] = []
    while heap:
        _, _, a = heapq.heappop(heap)
        out.append(a)
        for s in succs[a]:
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(heap, (key[s], seq[s], s))
    if len(out) != len(draft.actions):
        stuck = next(a for a in draft.actions if waiting[a] > 0)
        raise PlanError(
            f"lowering made a cycle at {stuck}\n" + format_grid(draft, mark=stuck, limit=24)
        )
    return tuple(out)


# ---- validation --------------------------------------------------------------------------------
def validate(
    plan: Plan,
    *,
    costs: LayerCosts | None = None,
    memory_budget_bytes: int | None = None,
) -> tuple[int, ...]:
    """Check a plan; raise PlanError (with the device x step grid, failing step marked) if
    actions are missing or duplicated, on bad devices, issued before what they depend on,
    an upload is never released, or (given costs and a budget) a device exceeds its memory.

    Returns the estimated peak memory per device in bytes (zeros without costs).
    """
    _check_complete(plan)
    _check_order(plan)
    _check_uploads(plan)
    if costs is None:
        return (0,) * plan.num_devices
    stages = costs.stages(plan.fwd_cuts, plan.bwd_cuts, fused_head=plan.fused_head)
    peaks = []
    for d in range(plan.num_devices):
        peak, where = _memory_walk(plan, stages, d)
        if memory_budget_bytes is not None and peak > memory_budget_bytes:
            _fail(
                plan,
                where,
                f"device {d} needs {format_bytes(peak)} at {where}, over the "
                f"budget of {format_bytes(memory_budget_bytes)}",
            )
        peaks.append(peak)
    return tuple(peaks)


def _fail(plan: Plan, action: Action | None, message: str) -> None:
    raise PlanError(f"{plan.schedule}: {message}\n" + format_grid(plan, mark=action, limit=24))


def _expected_compute(plan: Plan) -> set[Action]:
    """Compute actions a complete iteration must contain (devices ignored: set to 0)."""
    head_op = Op.HEAD if plan.fused_head else Op.BWD
    out: set[Action] = set()
    for it in plan.iterations:
        for m in range(plan.num_microbatches):
            out.update(Action(Op.FWD, s, m, 0, it) for s in range(plan.num_fwd_stages))
            out.add(Action(head_op, 0, m, 0, it))
            out.update(Action(Op.BWD, j, m, 0, it) for j in range(1, plan.num_bwd_stages))
    return out


def _check_complete(plan: Plan) -> None:
    seen: dict[Action, Action] = {}
    for a in plan.actions:
        on_host = a.op is Op.OPT
        if (a.device == HOST) != on_host or not (on_host or 0 <= a.device < plan.num_devices):
            _fail(
                plan, a, f"{a} is on a device outside 0..{plan.num_devices - 1} (or OPT off host)"
            )
        if a in seen:
            _fail(plan, a, f"{a} appears twice")
        seen[a] = a
        if a.is_compute and a.microbatch >= plan.num_microbatches:
            _fail(plan, a, f"{a} names micro-batch {a.microbatch} of {plan.num_microbatches}")
    placed = {Action(a.op, a.stage, a.microbatch, 0, a.iteration) for a in seen if a.is_compute}
    expected = _expected_compute(plan)
    if placed != expected:
        missing = sorted(map(str, expected - placed))[:8]
        extra = sorted(map(str, placed - expected))[:8]
        _fail(
            plan,
            None,
            f"compute actions missing {missing} / unexpected {extra} (devices shown as @0)",
        )


def _check_order(plan: Plan) -> None:
    index = {a: i for i, a in enumerate(plan.actions)}
    for i, a in enumerate(plan.actions):
        for dep in plan.deps[a]:
            if index[dep] > i:
                _fail(
                    plan,
                    a,
                    f"{a} (issue step {i}) waits for {dep}, issued later (step "
                    f"{index[dep]}): the order is not topological and could deadlock",
                )


def _check_uploads(plan: Plan) -> None:
    open_uploads: dict[tuple[int, int, int, int], Action] = {}
    for a in plan.actions:
        k = (a.stage, a.microbatch, a.device, a.iteration)
        if a.op is Op.UPLOAD:
            open_uploads[k] = a
        elif a.op is Op.FREE and open_uploads.pop(k, None) is None:
            _fail(plan, a, f"{a} frees weights that were never uploaded")
    if open_uploads:
        u = next(iter(open_uploads.values()))
        _fail(plan, u, f"{u} is never released (no matching FREE X{u.stage}.{u.microbatch})")
    uploaded = {a.device for a in plan.actions if a.op is Op.UPLOAD}
    for a in plan.actions:
        if (
            a.is_compute
            and a.device in uploaded
            and not any(d.op is Op.UPLOAD for d in plan.deps[a])
        ):
            _fail(plan, a, f"{a} runs on a device with uploaded weights but has no UPLOAD")


def _memory_walk(plan: Plan, st: StageCosts, device: int) -> tuple[int, Action | None]:
    """Peak bytes on one device walking its actions in order; returns (peak, action at peak).

    Weights: as uploaded/freed (lowered plans), just in time per group (compute-only offloaded
    plans), or all of the device's stages resident (bound schedules). Backward groups also hold
    weight gradients. Bound schedules stash one boundary activation per forward until its
    backward. Each compute action adds its working set while it runs.
    """
    from .actions import _compute_groups

    row = plan.per_device(device)
    lowered = any(a.op is Op.UPLOAD for a in plan.actions)
    offloaded = lowered or plan.schedule in OFFLOADED_SCHEDULES
    groups = _compute_groups(plan).get(device, [])
    firsts = {g[0] for g in groups}
    lasts = {g[-1] for g in groups}
    resident = 0 if offloaded else _static_bytes(plan, st, row)
    grads: dict[tuple[int, int, int], int] = {}
    peak, where, stash = 0, None, 0
    for a in row:
        if a.op is Op.UPLOAD:
            resident += st.param_bytes[a.stage]
        elif a.op is Op.FREE:
            resident -= st.param_bytes[a.stage] + grads.pop((a.stage, a.microbatch, a.iteration), 0)
        elif a.is_compute:
            slot = plan.slot(a)
            if offloaded and a in firsts:
                held = st.grad_bytes[slot] + (0 if lowered else st.param_bytes[slot])
                resident += held
                grads[(slot, a.microbatch, a.iteration)] = held
            if not offloaded:
                stash += st.boundary_bytes if a.op is Op.FWD else -st.boundary_bytes
            usage = resident + max(stash, 0) + st.work_bytes[slot]
            if usage > peak:
                peak, where = usage, a
            if offloaded and not lowered and a in lasts:
                resident -= grads.pop((slot, _group_first(groups, a).microbatch, a.iteration), 0)
    return peak, where


def _group_first(groups: Sequence[Sequence[Action]], a: Action) -> Action:
    return next(g[0] for g in groups if a in g)


def _static_bytes(plan: Plan, st: StageCosts, row: Sequence[Action]) -> int:
    """Bound stages keep their weights (forward slot) and gradients (backward slot) resident."""
    slots = {plan.slot(a) for a in row if a.is_compute}
    return sum(st.param_bytes[s] if s < plan.num_fwd_stages else st.grad_bytes[s] for s in slots)
