"""What a given set of cuts costs, without searching: the iteration time the partitioner
(partition.py) scores candidates by (``estimate_iteration_ms``: the simulator's fast pass on a
compiled RoundPipe program cached per shape, and the per-device load bound), the host link's
time per iteration (``transfer_ms``) and weight copies (``weight_traffic``), and the memory
rules for the round size and prefetch (``fitted_round_size``, ``prefetch_fits``). Apart from
the search so that the advisor and the planner read the objective without the search's
machinery; partition.py re-exports every public name.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

from . import schedules, simulate
from .costs import LayerCosts

__all__ = [
    "estimate_iteration_ms",
    "fitted_round_size",
    "prefetch_fits",
    "transfer_ms",
    "weight_traffic",
]


def estimate_iteration_ms(
    costs: LayerCosts,
    fwd_cuts: Sequence[int],
    bwd_cuts: Sequence[int],
    *,
    num_devices: int,
    num_microbatches: int,
    async_optimizer: bool = True,
    round_size: int | None = None,
    weights: simulate.WeightTraffic | None = None,
) -> float:
    """Iteration time of RoundPipe with these cuts and rounds of ``round_size`` micro-batches
    (None: one round of the whole step, the engine's M_R without a memory budget; ``partition``
    passes the round size it times the cuts with) under the simulation conventions; with
    ``weights``, the groups wait for their weight copies (``QuickProgram.run``).

    Sync: the makespan of one iteration. Async: the steady state of back-to-back iterations
    (each on the weights of two steps before; ``simulate.async_steady_ms``), and at least the
    per-device load in the long run (see ``_load_bound``).
    """
    shape = (costs, fwd_cuts, bwd_cuts, num_devices, num_microbatches)
    size = num_microbatches if round_size is None else round_size
    if not async_optimizer:
        return _quick(*shape, 1, size, weights).makespan_ms
    load = _load_bound(costs, fwd_cuts, bwd_cuts, num_devices, num_microbatches)
    steady = simulate.async_steady_ms(lambda k: _quick(*shape, k, size, weights).iteration_ends)
    return max(steady, load)


_ASYNC_WORK = simulate.ASYNC_ITERATIONS  # iterations simulated per async estimate, mostly


def fitted_round_size(
    costs: LayerCosts,
    fwd_cuts: Sequence[int],
    bwd_cuts: Sequence[int],
    num_microbatches: int,
    memory_budget_bytes: int | None,
) -> int:
    """M_R the budget leaves room for with these cuts: the largest divisor of the micro-batch
    count whose 2 x M_R boundary states fit beside the largest slot (weights, gradients,
    working set; ``slot_memory``); 1 when none does, the whole count without a budget."""
    m = num_microbatches
    if memory_budget_bytes is None:
        return m
    st = costs.stages(fwd_cuts, bwd_cuts)
    largest = max(
        w + g + k for w, g, k in zip(st.param_bytes, st.grad_bytes, st.work_bytes, strict=True)
    )
    room = memory_budget_bytes - largest
    sizes = [d for d in range(m, 0, -1) if not m % d]
    return next((d for d in sizes if 2 * d * costs.boundary_bytes <= room), 1)


def prefetch_fits(
    costs: LayerCosts,
    fwd_cuts: Sequence[int],
    bwd_cuts: Sequence[int],
    round_size: int,
    memory_budget_bytes: int | None,
) -> bool:
    """Whether prefetch depth 1 fits the budget with these cuts: the largest slot while it
    computes (weights, gradients, working set; ``slot_memory``), the next slot's weights
    uploaded beside it (the largest other slot's, bounding it) and ``2 x round_size``
    boundary states, the rule of ``fitted_round_size`` with one more slot's weights. A bound
    of what ``validate`` measures on the lowered plan, in microseconds instead of seconds."""
    if memory_budget_bytes is None:
        return True
    st = costs.stages(fwd_cuts, bwd_cuts)
    totals = [
        w + g + k for w, g, k in zip(st.param_bytes, st.grad_bytes, st.work_bytes, strict=True)
    ]
    big = max(range(len(totals)), key=totals.__getitem__)
    ahead = max((w for j, w in enumerate(st.param_bytes) if j != big), default=0)
    need = totals[big] + ahead + 2 * round_size * costs.boundary_bytes
    return need <= memory_budget_bytes


def weight_traffic(
    costs: LayerCosts,
    fwd_cuts: Sequence[int],
    bwd_cuts: Sequence[int],
    link_gbps: float,
    prefetch_depth: int,
) -> simulate.WeightTraffic:
    """Each slot's weight upload and gradient download (ms) over a host link of ``link_gbps``
    GB/s, at this prefetch depth: the timing pass's ``WeightTraffic``."""
    st = costs.stages(fwd_cuts, bwd_cuts)
    per_ms = link_gbps * 1e6  # bytes per ms
    return simulate.WeightTraffic(
        upload_ms=tuple(b / per_ms for b in st.param_bytes),
        download_ms=tuple(b / per_ms for b in st.grad_bytes),
        prefetch_depth=prefetch_depth,
    )


def transfer_ms(
    costs: LayerCosts,
    fwd_cuts: Sequence[int],
    bwd_cuts: Sequence[int],
    num_devices: int,
    num_microbatches: int,
    round_size: int,
    link_gbps: float,
) -> float:
    """Time the busiest host link needs per iteration (ms): each slot uploads its weights once
    per round and a backward slot downloads its gradients once per round; each micro-batch's
    input comes up and its output goes down (a boundary state; the batch for forward stage 0;
    a backward stage also its upstream gradient). Slot i of a round runs on device (g0 + i) mod
    N, so a device only gets the slots i = c (mod gcd(S, N)); the heaviest class, shared by
    N / gcd devices, bounds the link time. Each direction has its own link: the larger counts.
    """
    st = costs.stages(fwd_cuts, bwd_cuts)
    num_fwd, num_slots = len(fwd_cuts), len(st.param_bytes)
    rounds = -(-num_microbatches // max(round_size, 1))
    state = costs.boundary_bytes
    grad = costs.boundary_grad_bytes or state
    up, down = [], []
    for slot in range(num_slots):
        act_in = costs.batch_bytes if slot == 0 else state + (grad if slot > num_fwd else 0)
        up.append(rounds * st.param_bytes[slot] + num_microbatches * act_in)
        out = state if slot < num_fwd else (grad if slot < num_slots - 1 else 0)
        down.append(rounds * st.grad_bytes[slot] + num_microbatches * out)
    g = math.gcd(num_slots, num_devices)
    heaviest = max(
        max(sum(side[i] for i in range(c, num_slots, g)) for c in range(g)) for side in (up, down)
    )
    return heaviest * g / num_devices / (link_gbps * 1e6)


def _quick(
    costs: LayerCosts,
    fwd_cuts: Sequence[int],
    bwd_cuts: Sequence[int],
    num_devices: int,
    num_microbatches: int,
    iterations: int,
    round_size: int,
    weights: simulate.WeightTraffic | None = None,
) -> simulate.QuickTimes:
    program = _program(
        tuple(fwd_cuts), tuple(bwd_cuts), num_devices, num_microbatches, iterations, round_size
    )
    return program.run(costs, fwd_cuts, bwd_cuts, optimizer="async", weights=weights)


def _program(
    fwd_cuts: tuple[int, ...],
    bwd_cuts: tuple[int, ...],
    num_devices: int,
    num_microbatches: int,
    iterations: int,
    round_size: int,
) -> simulate.QuickProgram:
    """The compiled RoundPipe plan of this shape: which action waits for which depends on the
    stage counts, not on the layers per stage, so candidates of one shape share it (most of a
    search's candidates: one-layer moves, where remainders go)."""
    key = (len(fwd_cuts), len(bwd_cuts), num_devices, num_microbatches, iterations, round_size)
    with _PROGRAMS_LOCK:  # the engine may plan from more than one thread
        program = _PROGRAMS.get(key)
    if program is None:
        # one iteration built and compiled, then repeated: the Plan's objects and dependency
        # derivation cost far more than the timing pass itself
        plan = schedules.build(
            "roundpipe",
            num_iterations=1,
            fwd_cuts=fwd_cuts,
            bwd_cuts=bwd_cuts,
            num_devices=num_devices,
            num_microbatches=num_microbatches,
            round_size=round_size,
        )
        program = simulate.QuickProgram.of(plan).repeated(iterations, plan.next_start_device)
        with _PROGRAMS_LOCK:
            if len(_PROGRAMS) >= 256:  # a bounded cache: drop the oldest
                del _PROGRAMS[next(iter(_PROGRAMS))]
            _PROGRAMS[key] = program
    return program


_PROGRAMS: dict[tuple[int, ...], simulate.QuickProgram] = {}
_PROGRAMS_LOCK = threading.Lock()


def _load_bound(
    costs: LayerCosts,
    fwd_cuts: Sequence[int],
    bwd_cuts: Sequence[int],
    num_devices: int,
    num_microbatches: int,
) -> float:
    """Long-run iteration time forced by per-device load. Slot i of round r runs on device
    (r * S + i) mod N, so a device only ever gets the slots i = d (mod gcd(S, N)); the
    heaviest such class, shared by N / gcd devices, bounds the steady state from below."""
    st = costs.stages(fwd_cuts, bwd_cuts)
    num_slots = len(st.pre_ms)
    g = math.gcd(num_slots, num_devices)
    heaviest = max(sum(st.busy_ms(i) for i in range(c, num_slots, g)) for c in range(g))
    return heaviest * num_microbatches * g / num_devices
