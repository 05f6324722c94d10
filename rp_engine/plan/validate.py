"""Checks of a plan before it runs: ``validate``.

Complete (every compute action once, on a real device), topologically ordered, every UPLOAD
released by a FREE and every compute action on an uploading device fed by an UPLOAD, every
UPLOAD of an NVMe slot (``Plan.nvme_slots``) fed by exactly one READ issued before it and every
READ feeding exactly one later UPLOAD, and, given costs and a budget, each device's peak memory
(the rule of memory.py) within the budget; with ``then`` (the run issued next, which may
overlap this one's tail), the peak over both runs back to back (``memory.consecutive``: what a
device holds with iterations overlapping).
"""

from __future__ import annotations

from .actions import HOST, Action, Op, Plan, PlanError, format_bytes, format_grid
from .costs import LayerCosts
from .memory import consecutive, memory_events, walk_peak

__all__ = ["validate"]


def validate(
    plan: Plan,
    *,
    costs: LayerCosts | None = None,
    memory_budget_bytes: int | None = None,
    then: Plan | None = None,
) -> tuple[int, ...]:
    """Check a plan; raise PlanError (with the device x step grid, failing step marked) if
    actions are missing or duplicated, on bad devices, issued before what they depend on,
    an upload is never released, an UPLOAD of an NVMe slot has no READ before it (or a READ
    feeds no later UPLOAD), or (given costs and a budget) a device exceeds its memory.
    ``then``: the run issued right after this one (checked alike), overlapping its tail; the
    memory peak is then over both runs back to back (its actions are marked "#1" and up).

    Returns the estimated peak memory per device in bytes (zeros without costs).
    """
    for p in (plan,) if then is None else (plan, then):
        _check_complete(p)
        _check_reads(p)  # before the order: a READ after its UPLOAD is named as such
        _check_order(p)
        _check_uploads(p)
    if costs is None:
        return (0,) * plan.num_devices
    walked = plan if then is None else consecutive(plan, then)
    stages = costs.stages(plan.fwd_cuts, plan.bwd_cuts, fused_head=plan.fused_head)
    events = memory_events(walked, stages)
    peaks = []
    for d in range(plan.num_devices):
        peak, where = walk_peak(walked, stages, d, events)
        if memory_budget_bytes is not None and peak > memory_budget_bytes:
            seam = "" if then is None else " (two runs in flight: iterations overlap)"
            _fail(
                walked,
                where,
                f"device {d} needs {format_bytes(peak)} at {where}{seam}, over the "
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


def _check_reads(plan: Plan) -> None:
    """Each UPLOAD of an NVMe slot is fed by one READ (same slot, micro-batch, device,
    iteration) issued before it; each READ, of an NVMe slot, feeds one later UPLOAD."""
    nvme = set(plan.nvme_slots)
    pending: dict[tuple[int, int, int, int], Action] = {}  # READs not yet consumed
    for a in plan.actions:
        k = (a.stage, a.microbatch, a.device, a.iteration)
        if a.op is Op.READ:
            if a.stage not in nvme:
                _fail(
                    plan,
                    a,
                    f"{a} reads slot {a.stage} from NVMe, which is not an NVMe slot "
                    f"(nvme_slots {sorted(nvme)})",
                )
            pending[k] = a
        elif a.op is Op.UPLOAD and a.stage in nvme and pending.pop(k, None) is None:
            _fail(
                plan,
                a,
                f"{a} uploads NVMe slot {a.stage} with no READ R{a.stage}.{a.microbatch} "
                "issued before it",
            )
    if pending:
        r = next(iter(pending.values()))
        _fail(plan, r, f"{r} feeds no later UPLOAD (no matching U{r.stage}.{r.microbatch})")
