"""The lowering pass: a compute-only plan -> the plan the executor runs.

Owns ``lower``: every cross-device data edge gets a SEND; an offloaded plan (``plan.offloaded``,
or ``offload=True``) gets, per group of consecutive same-slot compute actions on a device (a
slot's round), ONE UPLOAD of its weights, a DOWNLOAD of the gradients the group accumulated on
the device (backward groups), a FREE, and an OPT per layer per iteration on the host. The
prefetch depth (how many groups' weights a device may hold ahead) is a property of the plan.

Residency (``resident``): a later group of the same slot and iteration on the same device gets
no UPLOAD of its own; the weights of the earlier group stay on the device (no FREE in between),
its gradients keep accumulating there, and one DOWNLOAD and one FREE follow the last of them
(``actions.weight_holdings``). Every group of one run reads one weight version, so reuse within
a plan is safe; a plan never reuses another plan's upload.

NVMe reads (``nvme_slots``): every UPLOAD of a slot whose weights live on NVMe gets a READ of
them into a host staging buffer. The READs share one NVMe link and ``nvme_read_ahead`` staging
buffers host-wide, so they are placed on the plan's UPLOADs of such slots (its *nvme uploads*)
as a whole, after the rest of the order is fixed: the READ of the k-th nvme upload in issue
order right after the (k - R)-th nvme upload (R = ``nvme_read_ahead``; its buffer is free once
that copy is done), the first R at the front of the plan:

    R0 R1 | ... U0 R2 ... U1 R3 ... U2 R4 ...        (R = 2; Uk the k-th nvme upload)
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence

from .actions import HOST, Action, Op, Plan, PlanError, compute_groups, format_grid

__all__ = ["lower"]


def lower(
    plan: Plan,
    *,
    offload: bool | None = None,
    optimizer: str = "async",
    prefetch_depth: int = 1,
    resident: bool | Collection[int] = False,
    nvme_slots: bool | Collection[int] = False,
    nvme_read_ahead: int = 2,
) -> Plan:
    """Add transfer and optimizer actions to a compute-only plan.

    Every cross-device data edge gets a SEND to the consumer's device. With ``offload`` (default:
    ``plan.offloaded``, set by RoundPipe and Mobius) every group of consecutive same-slot compute
    actions on a device (a slot's round) gets ONE UPLOAD of its weights, issued as soon as the
    FREE of the group
    ``prefetch_depth + 1`` back on that device allows (at most ``prefetch_depth + 1`` groups'
    weights resident), a DOWNLOAD of the gradients the group accumulated on the device (backward
    groups), a FREE after it, and each layer an OPT per iteration on the host (``optimizer``
    "sync" or "async", "" for none). This is the plan the executor runs; it is ``offloaded``
    exactly when it was lowered with ``offload``.

    ``resident``: True, or the slots, whose weights stay on a device between the groups of the
    slot there (see the module docstring); the memory this holds is ``validate``'s to check.

    ``nvme_slots``: True, or the slots, whose weights live on NVMe: each of their UPLOADs gets
    a READ (``Op.READ``, same slot, micro-batch, device and iteration) placed ``nvme_read_ahead``
    (>= 1) such uploads ahead of it in issue order (see the module docstring); the plan records
    both (``Plan.nvme_slots``, ``Plan.nvme_read_ahead``). Needs ``offload`` (only uploaded
    weights are read). Without it the plan is exactly what it was before READs existed.
    """
    if nvme_read_ahead < 1:
        raise ValueError(f"nvme_read_ahead must be >= 1, got {nvme_read_ahead}")
    # what the plan says about NVMe is what this lowering adds (a compute plan has no READs)
    plan = dataclasses.replace(
        plan, prefetch_depth=prefetch_depth, nvme_slots=(), nvme_read_ahead=2
    )
    if any(not a.is_compute for a in plan.actions):
        raise ValueError("lower() takes a compute-only plan (FWD/HEAD/BWD actions)")
    offload = plan.offloaded if offload is None else offload
    nvme = _slot_set(plan, nvme_slots, "nvme_slots")
    if nvme and not offload:
        raise ValueError(
            f"nvme_slots {sorted(nvme)} need an offloaded plan (lower(..., offload=True)): "
            f"only weights uploaded per slot are read from NVMe ({plan.schedule} keeps them "
            "on its devices)"
        )
    key = {a: float(i) for i, a in enumerate(plan.actions)}
    key.update(_send_keys(plan, key))
    if offload:
        slots = range(plan.num_slots) if resident is True else (resident or ())
        key.update(_weight_keys(plan, key, frozenset(slots)))
        key.update({o: float("inf") for o in _opt_actions(plan) if optimizer})
    draft = dataclasses.replace(
        plan,
        actions=tuple(sorted(key, key=key.__getitem__)),
        optimizer=optimizer if offload else "",
        offloaded=offload,
    )
    for o in (a for a in draft.actions if a.op is Op.OPT):
        key[o] = max(key[d] for d in draft.deps[o]) + 0.45
    actions = _stable_topological(draft, key)
    if not nvme:
        return dataclasses.replace(draft, actions=actions)
    return dataclasses.replace(
        draft,
        actions=_with_reads(actions, nvme, nvme_read_ahead),
        nvme_slots=tuple(sorted(nvme)),
        nvme_read_ahead=nvme_read_ahead,
    )


def _slot_set(plan: Plan, slots: bool | Collection[int], name: str) -> frozenset[int]:
    """``True`` -> every slot; a collection -> those (each a slot of ``plan``)."""
    if slots is True:
        return frozenset(range(plan.num_slots))
    out = frozenset(int(s) for s in (slots or ()))
    bad = sorted(s for s in out if not 0 <= s < plan.num_slots)
    if bad:
        raise ValueError(f"{name} {bad}: the plan's slots are 0..{plan.num_slots - 1}")
    return out


def _with_reads(
    actions: Sequence[Action], nvme: frozenset[int], read_ahead: int
) -> tuple[Action, ...]:
    """``actions`` with the READ of each nvme upload k right after nvme upload k - read_ahead
    (the first ``read_ahead`` at the front): the module docstring's placement."""
    uploads = [a for a in actions if a.op is Op.UPLOAD and a.stage in nvme]
    reads = [Action(Op.READ, u.stage, u.microbatch, u.device, u.iteration) for u in uploads]
    after = {uploads[k - read_ahead]: r for k, r in enumerate(reads) if k >= read_ahead}
    out = reads[:read_ahead]
    for a in actions:
        out.append(a)
        if a in after:
            out.append(after[a])
    return tuple(out)


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


def _weight_keys(
    plan: Plan, key: Mapping[Action, float], resident: frozenset[int]
) -> dict[Action, float]:
    out: dict[Action, float] = {}
    for d, groups in compute_groups(plan).items():
        holdings: list[list[list[Action]]] = []  # per holding, its groups
        starts: list[int] = []  # the group index each holding starts at
        live: dict[tuple[int, int], list[list[Action]]] = {}
        for gi, group in enumerate(groups):
            slot_it = (plan.slot(group[0]), group[0].iteration)
            held = live.get(slot_it) if slot_it[0] in resident else None
            if held is None:
                held = live[slot_it] = []
                holdings.append(held)
                starts.append(gi)
            held.append(group)
        back = plan.prefetch_depth
        for gi, held in zip(starts, holdings, strict=True):
            first, last = held[0][0], held[-1][-1]
            slot, m0, it = plan.slot(first), first.microbatch, first.iteration
            # issued when the device starts the group prefetch_depth back (its memory gate)
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
