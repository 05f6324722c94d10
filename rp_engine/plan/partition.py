"""The asymmetric RoundPipe partitioner.

Owns ``Partition`` and ``partition()``: forward and
backward cuts chosen separately, the LM-head stage filled first, by the O(L^3) search of the
RoundPipe paper (section 4.4) followed by a small local refinement, every candidate scored by
the timing model of simulate/. ``balanced_stage_layers`` cuts bound (symmetric) stages.

Search, for L layers:
  1. candidate caps t = every contiguous sum of forward times, of backward (recompute + backward)
     times, and head + every suffix of backward times: O(L^2), deduplicated, t >= largest item;
  2. per cap, a greedy scan (O(L); bisection on prefix sums) packs forward stages left to right
     and backward stages from the head toward the input, each <= t and within the memory budget,
     filling the head stage first; each shape (S_f, head layers, S_b) is kept at its smallest
     cap, which orders the shapes from many small stages to few large ones;
  3. the shapes are scored by the estimated iteration time (``estimate_iteration_ms``: the
     simulator's fast pass, and with a link bandwidth at least the weight and activation
     traffic of the busiest link, ``transfer_ms``) on an evenly spaced sample, refined around the three best local
     minima; then neighbouring shapes (one stage more or fewer, one head layer less) with
     balanced cuts, where the remainders go (larger stages first, last, or spread), and
     one-layer moves of any cut while they help. A work budget (actions simulated) bounds it.

The objective and the other costs of given cuts (iteration time, link time, weight traffic,
round size and prefetch fit) are in estimate.py, re-exported here.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .actions import format_bytes
from .costs import LayerCosts, StageCosts, load_costs, slot_memory
from .estimate import (
    _ASYNC_WORK,
    estimate_iteration_ms,
    fitted_round_size,
    prefetch_fits,
    transfer_ms,
    weight_traffic,
)

__all__ = [
    "LayerCosts",
    "StageCosts",
    "Partition",
    "CutsError",
    "partition",
    "estimate_iteration_ms",
    "transfer_ms",
    "weight_traffic",
    "prefetch_fits",
    "fitted_round_size",
    "balanced_stage_layers",
    "rule_of_thumb_cuts",
    "rule_of_thumb_family",
    "load_costs",
]

_EPS = 1e-9


# ---- the search ------------------------------------------------------------------------------
class CutsError(ValueError):
    """Given cuts that cannot be used (coverage, stage count, memory). The message starts with
    the cuts' name, ``fwd_cuts`` or ``bwd_cuts``, so a caller whose cuts came from a config can
    prefix the config section; other ValueErrors of ``partition()`` are about the model and the
    budget, whoever chose the cuts."""


@dataclass(frozen=True)
class Partition:
    """Forward and backward cuts (RoundPipe numbering) and the estimated iteration time."""

    fwd_cuts: tuple[int, ...]
    bwd_cuts: tuple[int, ...]
    est_iteration_ms: float
    # why the cuts have fewer slots than there are devices, when they do ("" otherwise): every
    # device still gets work, since rounds roll on over all of them, but a reader of the plan
    # should not have to guess why a device has no slot of its own in a round
    note: str = ""

    @property
    def num_fwd_stages(self) -> int:
        return len(self.fwd_cuts)

    @property
    def num_bwd_stages(self) -> int:
        return len(self.bwd_cuts)


def partition(
    costs: LayerCosts,
    *,
    num_devices: int,
    num_microbatches: int,
    memory_budget_bytes: int | None = None,
    async_optimizer: bool = True,
    fwd_cuts: Sequence[int] | None = None,
    bwd_cuts: Sequence[int] | None = None,
    max_work: int = 150_000,
    min_bwd_stages: int = 1,
    link_gbps: float | None = None,
    round_size: int | None = None,
    prefetch_depth: int | None = None,
    weight_cap: int | None = None,
) -> Partition:
    """Choose RoundPipe forward and backward cuts for ``costs`` on ``num_devices`` devices.

    The objective is the estimated iteration time, with rounds of ``round_size`` micro-batches
    (None: the largest the budget leaves room for, ``fitted_round_size``; the engine's rule):
    the makespan of one iteration (``async_optimizer=False``) or the steady-state iteration of
    back-to-back iterations with the optimizer overlapped (``True``). Explicit ``fwd_cuts``
    and ``bwd_cuts`` are checked against the memory budget and estimated instead. Raises
    ValueError naming the layer and the budget when one layer cannot fit. ``max_work`` bounds
    the search: the number of actions the timing model may simulate over all candidates
    (about 1 s of pure Python at the default).

    ``min_bwd_stages`` (1 .. L + 1) is the fewest backward stages, the head stage included, that
    the caller's executor accepts: a model with an embedding prefix needs 2, because the prefix
    runs in a backward stage after the head stage. Every candidate the search scores satisfies
    it (with one layer and 2 stages: an empty head stage, then the layer), so the result does.

    ``link_gbps`` (GB/s of each device's host link, None: transfers are free) adds the transfers
    to the objective: an iteration takes at least ``transfer_ms``, the weights, gradients and
    activations the busiest link moves, with the same rounds (so the activation memory of the
    cuts' largest slot sets how often weights cross), plus the first upload. With a
    ``prefetch_depth`` as well (the depth the plan will be lowered with), each slot's round on
    a device also waits for its weights' upload as the lowered plan does (``WeightTraffic``):
    at depth 0, where the device memory holds one group's weights, the copies run between a
    device's groups and lengthen the iteration, which the link bound alone does not see.

    ``weight_cap``: no stage of more than one layer holds more weight bytes than this (the host
    memory a stage's upload and its gradients' download take: the NVMe pools fitted to a limit,
    host_preflight.py); None: no such bound.
    """
    search = _Search(
        costs, memory_budget_bytes, num_devices, num_microbatches, async_optimizer, min_bwd_stages,
        weight_cap=weight_cap,
    )  # fmt: skip
    search.link = (link_gbps, round_size)
    search.prefetch_depth = prefetch_depth
    if fwd_cuts is not None or bwd_cuts is not None:
        if fwd_cuts is None or bwd_cuts is None:
            raise ValueError("give both fwd_cuts and bwd_cuts, or neither")
        search.check_cuts(tuple(fwd_cuts), tuple(bwd_cuts))
        fwd, bwd = tuple(fwd_cuts), tuple(bwd_cuts)
        return Partition(fwd, bwd, est_iteration_ms=search.evaluate((fwd, bwd)))
    return search.run(max_work)


class _Search:
    """State of one partition search (prefix sums, memory reach, evaluated cuts)."""

    def __init__(
        self,
        costs: LayerCosts,
        budget: int | None,
        num_devices: int,
        num_microbatches: int,
        async_optimizer: bool,
        min_bwd_stages: int = 1,
        *,
        weight_cap: int | None = None,
    ) -> None:
        if not 1 <= min_bwd_stages <= costs.num_layers + 1:
            raise ValueError(
                f"min_bwd_stages must be in 1..{costs.num_layers + 1} for "
                f"{costs.num_layers} layers, got {min_bwd_stages}"
            )
        self.costs, self.budget = costs, budget
        self.weight_cap = weight_cap  # ``partition``'s: a stage's weight bytes at most
        self.min_bwd_stages = min_bwd_stages
        self.shape = (num_devices, num_microbatches, async_optimizer)
        self.L = L = costs.num_layers
        self.head_ms = costs.head_fwd_ms + costs.head_bwd_ms
        self.pf = _prefix(costs.fwd_ms)
        wb = [r + b for r, b in zip(costs.recompute_ms, costs.bwd_ms, strict=True)]
        self.pb = _prefix(wb)
        self.pb_rev = _prefix(reversed(wb))  # from the head toward the input
        self._check_single_layers()
        self.fwd_reach = [self._reach_fwd(i) for i in range(L)]  # max end of a stage from i
        self.bwd_reach = [self._reach_bwd(j) for j in range(L + 1)]  # min start of one ending j
        self.head_reach = min((i for i in range(L + 1) if self._fits_bwd(i, L, True)), default=L)
        self.scores: dict[tuple[tuple[int, ...], tuple[int, ...]], float] = {}
        self.work_left = 10**12
        self.link: tuple[float | None, int | None] = (None, None)  # (GB/s, round size)
        self.prefetch_depth: int | None = None  # with a link: model the copies at this depth

    # -- memory ------------------------------------------------------------------------------
    def _stage_bytes(self, i: int, j: int, *, backward: bool, head: bool) -> int:
        """Device bytes of a stage over layers i..j-1: the one memory rule (``slot_memory``,
        which StageCosts uses too); the embedding prefix rides with the stages holding layer 0
        (forward stage 0, the last backward stage, which is the head stage when it is the
        only one), so its bytes count there."""
        layers = range(i, j)
        return slot_memory(self.costs, layers, backward=backward, head=head, prefix=i == 0).total

    def _fits_fwd(self, i: int, j: int) -> bool:
        return self._within_cap(i, j) and (
            self.budget is None
            or self._stage_bytes(i, j, backward=False, head=False) <= self.budget
        )

    def _fits_bwd(self, i: int, j: int, head: bool = False) -> bool:
        return self._within_cap(i, j) and (
            self.budget is None or self._stage_bytes(i, j, backward=True, head=head) <= self.budget
        )

    def _within_cap(self, i: int, j: int) -> bool:
        """Layers i..j-1 hold at most ``weight_cap`` weight bytes (one layer always does)."""
        cap = self.weight_cap
        return cap is None or j - i <= 1 or sum(self.costs.param_bytes[i:j]) <= cap

    def _check_single_layers(self) -> None:
        if self.budget is None:
            return
        budget = format_bytes(self.budget)
        # every stage runs on one device: more devices do not help a layer that cannot fit
        where = f"on any of the {self.shape[0]} device(s)"
        for layer in range(self.L):
            need = self._stage_bytes(layer, layer + 1, backward=True, head=False)
            if need > self.budget:
                raise ValueError(
                    f"layer {layer} needs {format_bytes(need)} as a backward stage (weights, "
                    f"gradients, activations) but the device memory budget is {budget} {where}; "
                    "raise the budget (roundpipe.device_memory_gb) or shrink the micro-batch"
                )
        need = self._stage_bytes(self.L, self.L, backward=True, head=True)
        if need > self.budget:
            raise ValueError(
                f"the LM head needs {format_bytes(need)}, over the device memory "
                f"budget of {budget} {where}; raise the budget (roundpipe.device_memory_gb) "
                "or lower roundpipe.head_chunk_tokens or the micro-batch"
            )

    def _reach_fwd(self, i: int) -> int:
        j = i + 1
        while j < self.L and self._fits_fwd(i, j + 1):
            j += 1
        return j

    def _reach_bwd(self, j: int) -> int:
        i = max(j - 1, 0)
        while i > 0 and self._fits_bwd(i - 1, j):
            i -= 1
        return i

    def check_cuts(self, fwd_cuts: tuple[int, ...], bwd_cuts: tuple[int, ...]) -> None:
        """Raise CutsError when the cuts do not cover the layers, have too few backward stages,
        or a stage exceeds the memory budget."""
        if sum(fwd_cuts) != self.L or sum(bwd_cuts) != self.L or min(fwd_cuts + bwd_cuts) < 0:
            raise CutsError(
                f"fwd_cuts {list(fwd_cuts)} / bwd_cuts {list(bwd_cuts)} must be layer counts "
                f">= 0 each summing to L={self.L}"
            )
        if len(bwd_cuts) < self.min_bwd_stages:
            raise CutsError(
                f"bwd_cuts {list(bwd_cuts)} has {len(bwd_cuts)} stage(s); this model needs at "
                f"least {self.min_bwd_stages} (the head stage, then the stage running the "
                "embedding prefix)"
            )
        start = 0
        for s, n in enumerate(fwd_cuts):
            if n and not self._fits_fwd(start, start + n):
                raise CutsError(
                    f"fwd_cuts {list(fwd_cuts)}: forward stage {s} (layers {start}.."
                    f"{start + n - 1}) exceeds "
                    f"the memory budget of {format_bytes(self.budget or 0)}"
                )
            start += n
        end = self.L
        for j, n in enumerate(bwd_cuts):
            if not self._fits_bwd(end - n, end, j == 0):
                raise CutsError(
                    f"bwd_cuts {list(bwd_cuts)}: backward stage {j} (layers {end - n}.."
                    f"{end - 1}) exceeds "
                    f"the memory budget of {format_bytes(self.budget or 0)}"
                )
            end -= n

    # -- greedy scans --------------------------------------------------------------------------
    def greedy_fwd(self, cap: float) -> tuple[int, ...]:
        cuts, i = [], 0
        while i < self.L:
            j = bisect.bisect_right(self.pf, self.pf[i] + cap + _EPS) - 1
            j = max(min(j, self.fwd_reach[i]), i + 1)
            cuts.append(j - i)
            i = j
        return tuple(cuts)

    def greedy_bwd(self, cap: float) -> tuple[int, ...]:
        """The head stage first, filled with layers up to the cap (the paper's preference: that
        stage runs forward, loss and backward in one go), then stages toward the input."""
        L, pb = self.L, self.pb
        start = bisect.bisect_left(pb, pb[L] + self.head_ms - cap - _EPS)
        # leave at least one layer for each further stage the executor requires
        start = min(max(start, self.head_reach, self.min_bwd_stages - 1), L)
        cuts, j = [L - start], start
        while j > 0:
            i = bisect.bisect_left(pb, pb[j] - cap - _EPS)
            i = min(max(i, self.bwd_reach[j]), j - 1)
            cuts.append(j - i)
            j = i
        # still too few stages (a large cap): halve the largest non-head stage, which keeps
        # every stage within the memory budget
        while len(cuts) < self.min_bwd_stages:
            k = max(range(1, len(cuts)), key=cuts.__getitem__)
            cuts[k : k + 1] = [cuts[k] - cuts[k] // 2, cuts[k] // 2]
        return tuple(cuts)

    def split_fwd(self, k: int, mode: str) -> tuple[int, ...]:
        return tuple(_split(self.pf, 0, self.L, k, mode))

    def split_bwd(self, head_layers: int, k: int, mode: str) -> tuple[int, ...]:
        """Head stage, then k balanced stages from the head toward the input ("front" puts the
        larger ones next to the head)."""
        return (head_layers, *_split(self.pb_rev, head_layers, self.L, k, mode))

    def caps(self) -> list[float]:
        """Candidate caps: contiguous sums on both sides and head + backward suffixes."""
        L, pf, pb = self.L, self.pf, self.pb
        largest_bwd = max(pb[i + 1] - pb[i] for i in range(L))
        floor = max(max(self.costs.fwd_ms), largest_bwd, self.head_ms) - _EPS
        values = {
            round(p[j] - p[i], 9) for p in (pf, pb) for i in range(L) for j in range(i + 1, L + 1)
        }
        values.update(round(self.head_ms + pb[L] - pb[i], 9) for i in range(L + 1))
        return sorted(v for v in values if v >= floor)

    # -- scoring -------------------------------------------------------------------------------
    def evaluate(
        self, cuts: tuple[tuple[int, ...], tuple[int, ...]], *, charged: bool = True
    ) -> float:
        """The objective (``estimate_iteration_ms``), memoised; +inf for new cuts once the work
        budget (actions simulated) is spent, so the search time is bounded. ``charged=False``
        scores the cuts whatever is left and leaves the budget as it was (the seeds)."""
        if cuts not in self.scores:
            n, m, async_opt = self.shape
            work = (len(cuts[0]) + len(cuts[1])) * m * (_ASYNC_WORK if async_opt else 1)
            if charged:
                if work > self.work_left and self.scores:  # the first candidate is always scored
                    return math.inf
                self.work_left -= work
            # the cuts are timed with the rounds they will run in: how many micro-batches a
            # round holds decides how many rounds (and iterations, async) overlap on the
            # devices, so a shape timed at another M_R can win here and lose when run
            gbps, round_size = self.link
            size = round_size or fitted_round_size(self.costs, cuts[0], cuts[1], m, self.budget)
            weights = (
                weight_traffic(self.costs, cuts[0], cuts[1], gbps, self.prefetch_depth)
                if gbps and self.prefetch_depth is not None
                else None
            )
            score = estimate_iteration_ms(
                self.costs,
                cuts[0],
                cuts[1],
                num_devices=n,
                num_microbatches=m,
                async_optimizer=async_opt,
                round_size=size,
                weights=weights,
            )
            if gbps:
                moved = transfer_ms(self.costs, cuts[0], cuts[1], n, m, size, gbps)
                st = self.costs.stages(cuts[0], cuts[1])
                # the first upload: in the score already when the copies are modelled
                first = 0.0 if weights is not None else st.param_bytes[0] / (gbps * 1e6)
                score = max(score, moved) + first
            self.scores[cuts] = score
        return self.scores[cuts]

    def _valid(self, cuts: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
        """Cuts the executor accepts: forward stages and backward stages after the head stage
        non-empty, at least ``min_bwd_stages`` backward stages, every stage within the budget."""
        fwd, bwd = cuts
        if min(fwd) < 1 or min(bwd[1:], default=1) < 1 or sum(fwd) != self.L:
            return False
        try:
            self.check_cuts(fwd, bwd)
        except ValueError:
            return False
        return True

    def shapes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Greedy cuts of each shape (S_f, head layers, S_b) at its smallest cap, ordered by
        cap (many small stages first)."""
        seen: dict[tuple[int, int, int], tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for cap in self.caps():
            fwd, bwd = self.greedy_fwd(cap), self.greedy_bwd(cap)
            if self._valid((fwd, bwd)):  # always, by construction; the check keeps it so
                seen.setdefault((len(fwd), bwd[0], len(bwd)), (fwd, bwd))
        return list(seen.values())

    def run(self, max_work: int) -> Partition:
        self.work_left = max_work
        chain = self.shapes()
        if not chain:  # unreachable while single layers fit (checked in __init__)
            raise ValueError(
                f"no cuts of the {self.L} layers fit the device memory budget of "
                f"{format_bytes(self.budget or 0)}; raise the budget (roundpipe.device_memory_gb)"
            )
        # 0. the paper's rule of thumb (``rule_of_thumb_family``, about 2 sqrt(L) cuts), scored
        #    outside the budget: whatever the search finds is never worse than it
        for cuts in rule_of_thumb_family(self.L):
            if self._valid(cuts):
                self.evaluate(cuts, charged=False)
        # 1. coarse scan of the shape chain (a quarter of the budget), refined around its
        #    three best local minima (the objective is not unimodal along the chain)
        seeds = self._scan(chain, max_work // 4)
        # 2. neighbouring shapes of each seed: one stage more or fewer on either side, one
        #    layer less in the head stage; balanced cuts, larger stages first
        for fwd, bwd in seeds:
            kf, h, kb = len(fwd), bwd[0], len(bwd) - 1
            for dkf, dkb, dh in _NEIGHBOURS:
                self._try(self._balanced(kf + dkf, h + dh, kb + dkb, "front", "front"))
        # 3. where the remainders go: larger stages first, last, or spread, on each side
        for fwd, bwd in self._best(2):
            for fm in _MODES:
                for bm in _MODES:
                    self._try(self._balanced(len(fwd), bwd[0], len(bwd) - 1, fm, bm))
        # 4. one-layer moves of any cut, from the best, while they help and budget lasts
        best = self._best(1)[0]
        improved = True
        while improved:
            improved = False
            for cand in _one_layer_moves(best):
                if self._valid(cand) and self.evaluate(cand) < self.scores[best] - _EPS:
                    best, improved = cand, True
                    break
        return Partition(best[0], best[1], self.scores[best], note=self._note(best))

    def _note(self, best: tuple[tuple[int, ...], tuple[int, ...]]) -> str:
        """``Partition.note``: with fewer slots than devices, the best scored alternative with
        at least as many slots, or why there is none."""
        n, slots = self.shape[0], len(best[0]) + len(best[1])
        if slots >= n:
            return ""
        head = f"{slots} slots for {n} devices (rounds roll on over all of them)"
        wide = [c for c, v in self.scores.items() if len(c[0]) + len(c[1]) >= n and v < math.inf]
        if wide:
            alt = min(wide, key=self.scores.__getitem__)
            more = 100 * (self.scores[alt] / self.scores[best] - 1)
            return (
                f"{head}: fewer, larger stages cross fewer stage boundaries; the best cuts "
                f"found with >= {n} slots, {list(alt[0])} / {list(alt[1])}, are estimated "
                f"{more:.1f} % slower"
            )
        if 2 * self.L + 1 < n:
            return f"{head}: {self.L} layers make at most {2 * self.L + 1} slots"
        return f"{head}: no cuts with >= {n} slots were found within the memory budget"

    def _best(self, k: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return sorted(self.scores, key=self.scores.__getitem__)[:k]

    def _try(self, cuts: tuple[tuple[int, ...], tuple[int, ...]] | None) -> None:
        if cuts is not None and self._valid(cuts):
            self.evaluate(cuts)

    def _balanced(self, kf: int, h: int, kb: int, fmode: str, bmode: str) -> tuple | None:
        if not (1 <= kf <= self.L and 0 <= h and 1 <= kb <= self.L - h):
            return None
        return (self.split_fwd(kf, fmode), self.split_bwd(h, kb, bmode))

    def _scan(self, chain: list, work: int) -> list:
        """Evaluate evenly spaced shapes of the chain within ``work``, then halve the step
        around the three best local minima; returns those minima."""
        per_shape = max(1, sum(len(f) + len(b) for f, b in chain) // max(len(chain), 1))
        n, m, async_opt = self.shape
        affordable = max(4, work // (per_shape * m * (_ASYNC_WORK if async_opt else 1)))
        step = max(1, -(-len(chain) // affordable))
        score = lambda i: self.evaluate(chain[i])  # noqa: E731
        probed = list(range(0, len(chain), step))
        values = [score(i) for i in probed]
        minima = [
            probed[k] for k in range(len(probed)) if values[k] <= min(values[max(k - 1, 0) : k + 2])
        ]
        minima = sorted(minima, key=score)[:3]
        seeds = []
        for best in minima:
            s = step
            while s > 1:
                s = (s + 1) // 2
                window = [i for i in (best - s, best + s) if 0 <= i < len(chain)]
                best = min([best, *window], key=score)
            seeds.append(chain[best])
        return seeds


_MODES = ("front", "back", "nearest")
_NEIGHBOURS = [(dkf, dkb, dh) for dkf in (0, -1, 1) for dkb in (0, 1, -1, 2) for dh in (0, -1)]


def _prefix(values: Iterable[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _split(prefix: Sequence[float], lo: int, hi: int, k: int, mode: str) -> list[int]:
    """Split items lo..hi-1 (weights given by ``prefix``) into k non-empty contiguous groups,
    each aiming at (what is left) / (groups left): "front" rounds each group up (larger groups
    first), "back" rounds down (larger groups last), "nearest" to the nearest item."""
    sizes, i = [], lo
    for left in range(k, 0, -1):
        if left == 1:
            j = hi
        else:
            target = prefix[i] + (prefix[hi] - prefix[i]) / left
            up = bisect.bisect_left(prefix, target - _EPS, i + 1, hi + 1)
            down = bisect.bisect_right(prefix, target + _EPS, i + 1, hi + 1) - 1
            if mode == "front":
                j = up
            elif mode == "back":
                j = down
            else:
                j = up if up <= hi and prefix[up] - target < target - prefix[down] else down
            j = min(max(j, i + 1), hi - (left - 1))
        sizes.append(j - i)
        i = j
    return sizes


def _one_layer_moves(cuts: tuple[tuple[int, ...], tuple[int, ...]]) -> list[tuple]:
    """Every cut boundary moved by one layer (forward and backward sides)."""
    fwd, bwd = cuts
    out = []
    for side in (0, 1):
        sizes = list(cuts[side])
        for b in range(len(sizes) - 1):
            for delta in (1, -1):
                moved = sizes.copy()
                moved[b] += delta
                moved[b + 1] -= delta
                if min(moved[b], moved[b + 1]) >= 0:
                    out.append((tuple(moved), bwd) if side == 0 else (fwd, tuple(moved)))
    return out


def rule_of_thumb_cuts(num_layers: int, bwd_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The RoundPipe paper's asymmetric rule of thumb: backward stages of about ``bwd_layers``
    layers, forward stages of three times as many (a backward with recomputation costs about
    three forwards), the head stage holding the LM head alone, as in the published Qwen3-1.7B
    cuts (forward 7 x 4 / backward 0, 3 x 8, 2, 2). Stages are balanced by layer count."""
    if not 1 <= bwd_layers <= num_layers:
        raise ValueError(f"bwd_layers must be in 1..{num_layers}, got {bwd_layers}")
    counts = _prefix([1.0] * num_layers)
    kb = -(-num_layers // bwd_layers)
    kf = -(-num_layers // min(3 * bwd_layers, num_layers))
    fwd = tuple(_split(counts, 0, num_layers, kf, "front"))
    return fwd, (0, *_split(counts, 0, num_layers, kb, "front"))


def rule_of_thumb_family(num_layers: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``rule_of_thumb_cuts`` for every backward stage size, distinct cuts only."""
    seen: dict[tuple[tuple[int, ...], tuple[int, ...]], None] = {}
    for k in range(1, num_layers + 1):
        seen.setdefault(rule_of_thumb_cuts(num_layers, k))
    return list(seen)


def balanced_stage_layers(costs: LayerCosts, num_stages: int) -> tuple[int, ...]:
    """Layers per bound stage (head on the last stage) minimising the largest stage time
    (forward + recompute + backward, plus head forward and backward on the last stage).

    The last stage may hold 0 layers (head only). Exact min-max by bisection over the
    candidate caps with a greedy check, O(L^2 log L).
    """
    L = costs.num_layers
    if not 1 <= num_stages <= L + 1:
        raise ValueError(f"num_stages must be in 1..{L + 1} for {L} layers, got {num_stages}")
    w = [f + r + b for f, r, b in zip(costs.fwd_ms, costs.recompute_ms, costs.bwd_ms, strict=True)]
    head = costs.head_fwd_ms + costs.head_bwd_ms
    p = _prefix(w)
    caps = sorted(
        {p[j] - p[i] for i in range(L + 1) for j in range(i, L + 1)}
        | {head + p[L] - p[i] for i in range(L + 1)}
    )

    def cut(cap: float) -> list[int] | None:
        # from the head backwards: fill the last stage, then the others, each <= cap
        start = bisect.bisect_left(p, p[L] + head - cap - _EPS)
        if start > L:
            return None
        sizes, j = [L - start], start
        while j > 0:
            i = min(bisect.bisect_left(p, p[j] - cap - _EPS), j - 1)
            if p[j] - p[i] > cap + _EPS:
                return None
            sizes.append(j - i)
            j = i
        return sizes[::-1] if len(sizes) <= num_stages else None

    lo, hi = 0, len(caps) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if cut(caps[mid]) is not None else (mid + 1, hi)
    sizes = cut(caps[lo]) or [L]
    # too few stages: split the largest non-last stages until there are num_stages
    while len(sizes) < num_stages:  # fewer stages fit the best cap: split the largest
        k = max(range(len(sizes) - 1), key=sizes.__getitem__, default=-1)
        if k >= 0 and sizes[k] >= 2:
            sizes[k : k + 1] = [sizes[k] - sizes[k] // 2, sizes[k] // 2]
        else:  # the last stage hands its layers to a new stage and keeps the head alone
            sizes.append(0)
    return tuple(sizes)
