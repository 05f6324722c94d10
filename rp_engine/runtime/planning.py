"""Choosing cuts and issuing plans: config cuts, an estimate, then one re-plan from measurements.

The planner owns the rolling start device (RoundPipe never resets rounds between iterations)
and the cost profile of the first iterations. It calls the pure ``plan`` package for the
partition search and the schedule, and turns cuts into a :class:`StageMap` for the executor.

Contract: the search only considers cuts the executor accepts (``StageMap.min_bwd_stages``),
so the automatic path either yields a runnable plan or raises one ValueError about the memory
budget. Errors name ``roundpipe.fwd_cuts`` / ``roundpipe.bwd_cuts`` only when the user set them.
Given the same costs the search returns the same cuts; the plan in use is logged once (info).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rp_engine.plan import schedules
from rp_engine.plan.actions import Op, Plan, compute_groups, format_bytes, format_grid
from rp_engine.plan.partition import CutsError, LayerCosts, Partition, partition
from rp_engine.plan.shapes import (
    ALLOCATOR_SLACK,
    WORKSPACE_BYTES,
    MemoryTerms,
    Shape,
    memory_terms,
)
from rp_engine.runtime.stages import StageMap

if TYPE_CHECKING:
    from rp_engine.model.base import LayerSequence
    from rp_engine.model.host_store import HostStore

__all__ = ["Planner", "ModelShape"]

log = logging.getLogger("rp_engine.planning")


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about the model before any measurement."""

    num_blocks: int
    has_prefix: bool
    block_param_bytes: tuple[int, ...]
    head_param_bytes: int
    prefix_param_bytes: int
    # the head stage holds no block: a module model's head hands its outputs to the caller,
    # whose loss arrives only at engine.backward (model/module.py)
    head_alone: bool = False
    # a decoder's shape (a Hugging Face model's config), its compute dtype's element size,
    # attention implementation and LM-head chunk: what the memory rule's activation, attention
    # and head terms need (plan/shapes.py ``memory_terms``). None: only weights, gradients,
    # boundary states and the device's workspace and slack are counted
    arch: Shape | None = None
    dtype_bytes: int = 4
    attention: str = "sdpa"
    head_chunk_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError("a model needs at least one block for the planner to place")

    @classmethod
    def from_sequence(cls, seq: LayerSequence, store: HostStore) -> ModelShape:
        """The shape of a layer sequence whose host state ``store`` holds (bytes per layer)."""
        layers = store.layers
        p = 1 if seq.prefix is not None else 0
        return cls(
            num_blocks=seq.num_blocks,
            has_prefix=seq.prefix is not None,
            block_param_bytes=tuple(layers[p + i].param_bytes for i in range(seq.num_blocks)),
            head_param_bytes=layers[-1].param_bytes,
            prefix_param_bytes=layers[0].param_bytes if p else 0,
            head_alone=seq.returns_outputs,
            **_decoder_of(seq),
        )

    def memory_terms(self, micro_batch: int, seq_len: int, *, cuda: bool) -> MemoryTerms | None:
        """The memory rule's terms for micro-batches of ``micro_batch`` x ``seq_len`` tokens
        (``plan.shapes.memory_terms``); None without a decoder shape or for a dtype the rule
        has no coefficients for."""
        if self.arch is None or self.dtype_bytes not in (2, 4):
            return None
        return memory_terms(
            self.arch,
            micro_batch=micro_batch,
            seq_len=seq_len,
            dtype_bytes=self.dtype_bytes,
            attention="eager" if self.attention == "eager" else "sdpa",
            head_chunk_tokens=self.head_chunk_tokens,
            cuda=cuda,
        )


def _decoder_of(seq: LayerSequence) -> dict[str, Any]:
    """``ModelShape``'s decoder fields of a layer sequence: the blocks' element size, and for a
    Hugging Face causal LM its config's shape, attention implementation and the head's chunk
    (other models' activations are not modelled)."""
    param = next((p for b in seq.blocks for p in b.parameters()), None)
    out: dict[str, Any] = {"dtype_bytes": param.element_size()} if param is not None else {}
    config = getattr(seq.root, "config", None)
    if not seq.kind.startswith("hf:") or config is None:
        return out
    try:
        arch = Shape.from_hf_config(config.to_dict(), name=seq.kind)
    except (ValueError, TypeError, AttributeError):
        return out
    return {
        **out,
        "arch": arch,
        "attention": str(getattr(config, "_attn_implementation", None) or "sdpa"),
        "head_chunk_tokens": int(getattr(seq.head, "chunk_tokens", 1024)),
    }


class Planner:
    """Cuts, stage map and plans for one engine; see the module docstring."""

    def __init__(
        self,
        shape: ModelShape,
        *,
        num_devices: int,
        num_microbatches: int,
        schedule: str = "roundpipe",
        fwd_cuts: Sequence[int] | None = None,
        bwd_cuts: Sequence[int] | None = None,
        memory_budget_bytes: int | None = None,
        profile_iterations: int = 2,
        async_optimizer: bool = True,
        round_size: int | None = None,
        link_gbps: float | None = None,
        overlap_iterations: bool = False,
        nvme_slots: bool | Collection[int] = False,
        nvme_read_ahead: int = 2,
        cuda: bool = False,
        stage_weight_bytes: int | None = None,
    ) -> None:
        """``nvme_slots``: True, or the slots (of the cuts in use), whose weights the parameter
        tier keeps on NVMe: the lowered plans read them into host staging buffers before each
        UPLOAD (``Op.READ``, ``nvme_read_ahead`` uploads ahead; ``schedules.lower``). Default
        none: the plans are as without the tier. ``cuda``: the devices are GPUs, so the memory
        rule counts kernel workspaces and the caching allocator's slack (plan/shapes.py).
        ``stage_weight_bytes``: no stage of more than one layer holds more weights (the host
        memory the NVMe pools were fitted to, host_preflight.py; ``partition``'s
        ``weight_cap``)."""
        self.stage_weight_bytes = stage_weight_bytes
        self.shape = shape
        self.cuda = cuda
        # the micro-batch's (sequences, tokens per sequence), once ``fit_tokens`` saw a batch:
        # the memory rule's activation terms need it
        self.tokens: tuple[int, int] | None = None
        # the parameter tier: set before the first lowering (set_cuts validates a plan)
        self.nvme_slots: bool | tuple[int, ...] = (
            True if nvme_slots is True else tuple(sorted(nvme_slots or ()))
        )
        self.nvme_read_ahead = nvme_read_ahead
        # train_batch may issue the next run before this one's tail is done: every memory peak
        # is then validated over two runs back to back (plan/memory.py, ``consecutive``)
        self.overlap_iterations = overlap_iterations
        # With a budget and no round size given, start safe (rounds of one micro-batch) and fit
        # the round to the budget once the first step has measured a boundary state.
        given = round_size if round_size is not None or memory_budget_bytes is None else 1
        self.round_size = _round_size(given, num_microbatches)
        self._round_size_given = round_size is not None
        self._round_fitted = False
        self.residency = True  # weights may stay on a device between groups of a slot
        self.resident: tuple[int, ...] = ()  # slots the plans in use keep (chosen with the cuts)
        self._keeps_forward: dict[Any, bool] = {}  # keeps_forward_weights() by plan
        self.boundary_bytes = 0  # one boundary state, once measured
        self.num_devices = num_devices
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.spec = _engine_schedule(schedule)
        self.memory_budget_bytes = memory_budget_bytes
        self.async_optimizer = async_optimizer  # the two modes want different cuts
        self.link_gbps = link_gbps  # each device's host link: transfers enter the objective
        self.fixed = fwd_cuts is not None and bwd_cuts is not None
        self.user_cuts = self.fixed  # errors about cuts name the roundpipe keys only then
        self.profile_left = 0 if self.fixed else profile_iterations
        self._fwd_samples: dict[int, list[float]] = {}
        self._bwd_samples: dict[int, list[float]] = {}
        self.start_device = 0
        self.replanned = False
        self.last_plan: Plan | None = None  # the last whole iteration issued
        self.est_iteration_ms: float | None = None
        self._profiled: LayerCosts | None = None  # what the finished profile measured
        if self.fixed:
            fixed = (tuple(fwd_cuts or ()), tuple(bwd_cuts or ()))
            self.set_cuts(*fixed)  # shape errors first: they name the roundpipe keys
            if memory_budget_bytes is not None:  # and a stage that cannot fit fails now
                try:
                    self._search(self._estimate(), cuts=fixed)
                except CutsError as e:  # a stage too large: the user's cuts are to blame
                    raise ValueError(
                        f"roundpipe.{e}; choose smaller stages, raise roundpipe.device_memory_gb, "
                        "or remove roundpipe.fwd_cuts and roundpipe.bwd_cuts to let the planner "
                        "choose"
                    ) from None
        elif self.spec.cuts == "blocks":  # one cut, bound per device: nothing to search
            self.fixed, self.profile_left = True, 0
            blocks = self._blocks()
            self.set_cuts(blocks, blocks[::-1])
        else:
            self.set_cuts(*self._search(self._estimate()))
        self._log_plan("plan")

    # --- cuts ---------------------------------------------------------------------------------
    def set_cuts(self, fwd_cuts: tuple[int, ...], bwd_cuts: tuple[int, ...]) -> None:
        """Use these cuts. Cuts the executor rejects raise ValueError naming the roundpipe key
        when the user wrote them, else RuntimeError (a planner bug: the search never offers
        such cuts). A head that must stand alone (``ModelShape.head_alone``) gets the blocks
        the search gave its stage as a backward stage of their own."""
        if self.shape.head_alone and bwd_cuts and bwd_cuts[0] != 0:
            if self.user_cuts:
                raise ValueError(
                    f"roundpipe.bwd_cuts {list(bwd_cuts)} must start with 0 for this model: its "
                    "loss is computed by the caller from its outputs, so the head stage holds "
                    f"no block (e.g. {[0, *bwd_cuts]})"
                )
            bwd_cuts = (0, *bwd_cuts)
        try:
            stages = StageMap.from_cuts(
                num_blocks=self.shape.num_blocks,
                has_prefix=self.shape.has_prefix,
                fwd_cuts=fwd_cuts,
                bwd_cuts=bwd_cuts,
            )
        except CutsError as e:
            if self.user_cuts:  # every CutsError message starts with "fwd_cuts" or "bwd_cuts"
                raise ValueError(f"roundpipe.{e}") from None
            raise RuntimeError(
                f"rp_engine's planner chose cuts the executor rejects ({e}); this is a bug, "
                "please report it (explicit roundpipe.fwd_cuts and roundpipe.bwd_cuts avoid the "
                "automatic planner)"
            ) from e
        self.fwd_cuts, self.bwd_cuts, self.stages = fwd_cuts, bwd_cuts, stages
        self.prefetch_depth, self.resident = self._choose_lowering()

    def set_residency(self, on: bool) -> None:
        """Allow (the default) or forbid weights staying on a device between a slot's groups
        there; the lowering is chosen again within the budget."""
        self.residency = on
        self.prefetch_depth, self.resident = self._choose_lowering()

    def _choose_lowering(self, round_size: int | None = None) -> tuple[int, tuple[int, ...]]:
        """Validate the lowered plan of these cuts (issue order, every upload freed, no compute
        without its upload) and choose how it holds weights: the prefetch depth and the slots
        kept resident (``self.residency``: only slots that come back to a device within the
        step). Without a budget (the device's size unknown): depth 1, nothing resident, as few
        weights as overlap allows. With one, the first that fits of: every such slot resident
        at depth 2, 1; the most of them (smallest first, found by bisection) at depth 1; none
        at depth 2, 1; else none at depth 0 (a stage that cannot fit at all is reported by the
        partitioner's check, which names the layer or the user's cut key). The budget left is
        the budget less the 2 x M_R boundary states a slot holds, once one has been measured."""
        budget = self.memory_budget_bytes

        def peak(depth: int, resident: tuple[int, ...]) -> int:
            return self.validated_peak(
                prefetch_depth=depth, resident=resident, round_size=round_size
            )

        if budget is None:
            peak(1, ())
            return 1, ()
        left = budget - 2 * (round_size or self.round_size) * self.boundary_bytes
        slots = self._returning_slots(round_size) if self.residency else ()
        if slots:
            for depth in (2, 1):
                if peak(depth, slots) <= left:
                    return depth, slots
            lo, hi = 0, len(slots) - 1  # the longest prefix that fits: slots[:lo]
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if peak(1, slots[:mid]) <= left else (lo, mid - 1)
            if lo:
                return 1, slots[:lo]
        for depth in (2, 1):
            if peak(depth, ()) <= left:
                return depth, ()
        peak(0, ())
        return 0, ()

    def _returning_slots(self, round_size: int | None) -> tuple[int, ...]:
        """Slots with more than one group on some device in a step (residency saves their
        later uploads), smallest weights first."""
        compute = self._schedule(self.num_microbatches, 0, round_size=round_size)
        seen: set[tuple[int, int]] = set()
        back: set[int] = set()
        for d, groups in compute_groups(compute).items():
            for group in groups:
                key = (d, compute.slot(group[0]))
                if key in seen:
                    back.add(key[1])
                seen.add(key)
        size = self._estimate().stages(self.fwd_cuts, self.bwd_cuts).param_bytes
        return tuple(sorted(back, key=lambda s: (size[s], s)))

    def validated_peak(
        self,
        *,
        round_size: int | None = None,
        prefetch_depth: int | None = None,
        resident: tuple[int, ...] | None = None,
        nvme_slots: bool | Collection[int] | None = None,
    ) -> int:
        """Validate the lowered plan of one iteration with these cuts (issue order, every
        upload freed, no compute without its upload; PlanError otherwise) and return its
        largest per-device memory peak: weights and gradients, byte sizes of the model. With
        ``overlap_iterations``, the peak of that run and the next one (from the next start
        device) back to back: what a device holds with two runs in flight. Defaults: the
        planner's round size, prefetch depth, resident slots and NVMe slots (their READs are
        validated too; they hold host, not device, memory)."""
        depth = self.prefetch_depth if prefetch_depth is None else prefetch_depth
        kept = self.resident if resident is None else resident
        nvme = self.nvme_slots if nvme_slots is None else nvme_slots

        def lowered(start: int) -> Plan:
            compute = self._schedule(self.num_microbatches, start, round_size=round_size)
            return schedules.lower(
                compute,
                offload=True,
                optimizer="",
                prefetch_depth=depth,
                resident=kept,
                nvme_slots=nvme,
                nvme_read_ahead=self.nvme_read_ahead,
            )

        plan = lowered(0)
        then = lowered(plan.next_start_device) if self.overlap_iterations else None
        return max(schedules.validate(plan, costs=self._estimate(), then=then))

    def _blocks(self) -> tuple[int, ...]:
        """A block schedule (Mobius) binds one block of layers per GPU, forward and backward
        alike; a model with an embedding prefix needs two blocks at least (the prefix's backward
        follows the head's)."""
        n, least = self.shape.num_blocks, StageMap.min_bwd_stages(self.shape.has_prefix)
        if n < least:
            raise ValueError(
                f"roundpipe.schedule {self.schedule!r} needs at least {least} decoder layers for "
                f"a model with an embedding prefix (this one has {n}); use schedule 'roundpipe'"
            )
        return _even_split(n, max(min(self.num_devices, n), least))

    def _estimate(self) -> LayerCosts:
        """Costs before any measurement: time proportional to parameter bytes (a dense layer's
        FLOPs per token are ~2x its parameters), backward = 2x forward, recompute = forward;
        bytes by the memory rule (``_memory``)."""
        unit = 1e-6
        fwd = [max(b, 1) * unit for b in self.shape.block_param_bytes]
        head = self.shape.head_param_bytes * unit
        return _costs(self.shape, fwd, [2 * f for f in fwd], head, self._memory())

    def _memory(self) -> dict[str, Any]:
        """The memory rule's ``LayerCosts`` fields beyond weights: with a decoder shape and a
        batch seen (``fit_tokens``), every term of ``plan.shapes.memory_terms``; before that,
        or for other models, what needs no activation sizes: the gradient accumulators' fp32
        size for a half-precision model, the micro-batch's gradients before they are folded
        in, and on GPUs the kernel workspaces and the allocator's slack."""
        mem = None
        if self.tokens is not None:
            mem = self.shape.memory_terms(*self.tokens, cuda=self.cuda)
        if mem is not None:
            n = self.shape.num_blocks
            return {
                "act_bytes": (mem.act_bytes,) * n,
                "attn_bytes": (mem.attn_bytes,) * n,
                **mem.layer_costs_fields(),
            }
        return {
            "workspace_bytes": WORKSPACE_BYTES if self.cuda else 0,
            "allocator_slack": ALLOCATOR_SLACK if self.cuda else 0.0,
            "grad_dtype_ratio": 2.0 if self.shape.dtype_bytes < 4 else 1.0,
            "fold_grads": True,
        }

    def fit_tokens(self, micro_batch: int, seq_len: int) -> bool:
        """Count the memory rule's activation, attention and head terms for micro-batches of
        ``micro_batch`` sequences of ``seq_len`` tokens (the engine calls it with its first
        batch, before the first plan is issued). With a memory budget and a decoder shape,
        the cuts are checked again: automatic ones searched again when they no longer fit
        (returns True when they changed: the executor must be rebuilt), given ones
        (``roundpipe.fwd_cuts``/``bwd_cuts``) that do not fit raise ValueError naming them;
        then the prefetch depth and residency are chosen again. Only the first call counts:
        a later batch of more tokens is not planned for (on a GPU the allocator's cap then
        fails it with an out-of-memory error)."""
        if self.tokens is not None:
            return False
        self.tokens = (micro_batch, seq_len)
        if (
            self.memory_budget_bytes is None
            or self.shape.memory_terms(micro_batch, seq_len, cuda=self.cuda) is None
        ):
            return False
        cuts = (tuple(self.fwd_cuts), tuple(self.bwd_cuts))
        if self.fixed:
            try:
                self._search(self._estimate(), cuts=cuts)
            except CutsError as e:
                if not self.user_cuts:
                    raise ValueError(
                        f"roundpipe.schedule {self.schedule!r}: {e}; raise "
                        "roundpipe.device_memory_gb or shrink the micro-batch"
                    ) from None
                raise ValueError(
                    f"roundpipe.{e} (micro-batches of {micro_batch} x {seq_len} tokens); choose "
                    "smaller stages, raise roundpipe.device_memory_gb, or remove "
                    "roundpipe.fwd_cuts and roundpipe.bwd_cuts to let the planner choose"
                ) from None
            changed = False
        else:
            best = self._search(self._estimate())
            changed = best != cuts
            if changed:
                self.set_cuts(*best)
        if not changed:
            self.prefetch_depth, self.resident = self._choose_lowering()
        peak = self.validated_peak()
        log.info(
            "memory rule: micro-batches of %d x %d tokens, largest device peak %s of the "
            "budget's %s", micro_batch, seq_len, format_bytes(peak),
            format_bytes(self.memory_budget_bytes),
        )  # fmt: skip
        if changed:
            self._log_plan(f"re-planned for micro-batches of {micro_batch} x {seq_len} tokens")
        return changed

    def _search(
        self, costs: LayerCosts, *, cuts: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The partition search over cuts the executor accepts (or, with ``cuts``, only the
        memory check and estimate of those cuts); sets ``est_iteration_ms``."""
        part = self._partition(costs, cuts)
        self.est_iteration_ms = part.est_iteration_ms
        if part.note:
            log.info("plan: %s", part.note)
        return tuple(part.fwd_cuts), tuple(part.bwd_cuts)

    def _partition(
        self,
        costs: LayerCosts,
        cuts: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
        round_size: int | None = None,
    ) -> Partition:
        """``partition()`` for this engine; deterministic: the same costs give the same cuts.
        ``round_size``: time the cuts at that M_R (default: the given one, else the budget's)."""
        return partition(
            costs,
            num_devices=self.num_devices,
            num_microbatches=self.num_microbatches,
            memory_budget_bytes=self.memory_budget_bytes,
            async_optimizer=self.async_optimizer,
            fwd_cuts=cuts[0] if cuts else None,
            bwd_cuts=cuts[1] if cuts else None,
            min_bwd_stages=StageMap.min_bwd_stages(self.shape.has_prefix),
            link_gbps=self.link_gbps,
            round_size=round_size or (self.round_size if self._round_size_given else None),
            weight_cap=self.stage_weight_bytes,
        )

    def compute_plan(self, start_device: int = 0) -> Plan:
        """The compute plan of one iteration of ``num_microbatches`` with the current cuts
        (not lowered; does not move the rolling start device)."""
        return self._schedule(self.num_microbatches, start_device)

    def _schedule(
        self, num_microbatches: int, start_device: int, *, round_size: int | None = None
    ) -> Plan:
        rounds = (
            {"round_size": min(round_size or self.round_size, num_microbatches)}
            if self.spec.cuts == "fwd_bwd"  # separate cuts: RoundPipe's rounds of M_R
            else {}
        )
        return self.spec.builder(
            fwd_cuts=self.fwd_cuts,
            bwd_cuts=self.bwd_cuts,
            num_devices=self.num_devices,
            num_microbatches=num_microbatches,
            start_device=start_device,
            **rounds,
        )

    def summary(self) -> str:
        """The plan in use in one line: schedule, devices, micro-batches, cuts, estimate."""
        est = "" if self.est_iteration_ms is None else f", est. {self.est_iteration_ms:.3g} ms"
        return (
            f"schedule={self.schedule} devices={self.num_devices} microbatches="
            f"{self.num_microbatches} fwd_cuts={list(self.fwd_cuts)} "
            f"bwd_cuts={list(self.bwd_cuts)}{est}"
        )

    def _log_plan(self, what: str) -> None:
        """Log the plan in use once: its cuts, estimate and the start of its device grid."""
        log.info("%s: %s\n%s", what, self.summary(), format_grid(self.compute_plan(), limit=12))

    # --- plans --------------------------------------------------------------------------------
    def plan(
        self,
        num_microbatches: int,
        *,
        ops: frozenset[Op] | None = None,
        resumed: int = 0,
        rerun_head: bool = False,
        nvme_slots: bool | Collection[int] | None = None,
    ) -> Plan:
        """The lowered plan of one iteration (or of its ``ops`` part: the imperative loop runs
        the forward and the backward of one micro-batch separately), starting on the rolling
        start device: what the executor runs and what the simulator counts. ``resumed``: the
        first ``resumed`` micro-batches have no forward or head actions (their forwards ran
        before, alone: the imperative loop's window resumes them from their carries while the
        others run whole, in the same schedule); with ``rerun_head`` they keep their head actions
        (their forward runs computed the loss only). ``nvme_slots``: the slots read from NVMe
        before their UPLOADs (default: the planner's)."""
        plan = self._schedule(num_microbatches, self.start_device)
        if ops is None or Op.BWD in ops:  # the iteration (or its backward half) is issued
            self.start_device = plan.next_start_device
        if ops is not None or resumed:
            keep = ops if ops is not None else frozenset({Op.FWD, Op.HEAD, Op.BWD})
            plan = dataclasses.replace(
                plan,
                actions=tuple(
                    a for a in plan.actions
                    if a.op in keep
                    and (a.op is Op.BWD or a.microbatch >= resumed or (rerun_head and a.op is Op.HEAD))
                ),
            )  # fmt: skip
        lowered = schedules.lower(
            plan,
            offload=True,
            optimizer="",
            prefetch_depth=self.prefetch_depth,
            resident=self.resident,
            nvme_slots=self.nvme_slots if nvme_slots is None else nvme_slots,
            nvme_read_ahead=self.nvme_read_ahead,
        )
        if ops is None and not resumed:
            self.last_plan = lowered
        return lowered

    def keeps_forward_weights(self) -> bool:
        """Whether a window's forward runs (the imperative loop's loss reads) may keep their
        slots' weights on their devices for the window's next runs (the executor's module
        docstring): always without a device budget; with one, when every weight fits beside the
        plan's validated peak (one device may end up holding them all)."""
        budget = self.memory_budget_bytes
        if budget is None:
            return True
        key = (self.fwd_cuts, self.bwd_cuts, self.round_size, self.prefetch_depth, self.resident)
        if self._keeps_forward.get(key) is None:
            costs = self._estimate()
            weights = sum(costs.param_bytes) + costs.prefix_param_bytes + costs.head_param_bytes
            self._keeps_forward[key] = self.validated_peak() + weights <= budget
        return self._keeps_forward[key]

    def byte_costs(self) -> LayerCosts:
        """Layer costs with the model's real byte sizes (times are the estimate): what the
        simulator needs to count the bytes a plan moves."""
        return self._estimate()

    # --- profiling ----------------------------------------------------------------------------
    def fit_round_size(self, boundary_bytes: int) -> None:
        """Choose M_R from the device budget once a boundary state's size is measured: a slot
        holds up to M_R micro-batches' inputs and outputs (2 x M_R states) besides the weights
        and gradients its plan validates; the largest divisor of GAS whose leanest plan (no
        residency, no prefetch) fits wins, then residency and the prefetch depth are chosen
        again in what is left. A given ``roundpipe.round_size`` that does not fit is an error
        naming it."""
        budget = self.memory_budget_bytes
        if budget is None or boundary_bytes <= 0 or self._round_fitted:
            return
        self._round_fitted = True
        self.boundary_bytes = boundary_bytes
        gas = self.num_microbatches

        def need(size: int) -> int:  # the plan's groups change with M_R: validate each size
            lean = self.validated_peak(round_size=size, prefetch_depth=0, resident=())
            return lean + 2 * size * boundary_bytes

        sizes = [d for d in range(gas, 0, -1) if not gas % d]
        fits = [d for d in sizes if need(d) <= budget] or [1]
        if self._round_size_given:
            if self.round_size not in fits and self.round_size > 1:
                raise ValueError(
                    f"roundpipe.round_size {self.round_size} does not fit the device budget of "
                    f"{budget} bytes: it needs {need(self.round_size)} (weights, gradients and "
                    f"2 x {self.round_size} activation states of {boundary_bytes} bytes); use "
                    f"{fits[0]} (or leave it out to let the planner choose)"
                )
        elif fits[0] != self.round_size:
            log.info(
                "round size %d micro-batches (activations %d bytes per state, budget %d bytes)",
                fits[0], boundary_bytes, budget,
            )  # fmt: skip
            self.round_size = fits[0]
        self.prefetch_depth, self.resident = self._choose_lowering()

    def observe(self, fwd_ms: dict[int, list[float]], bwd_ms: dict[int, list[float]]) -> bool:
        """Feed one profiled iteration; re-plans once after ``profile_iterations``.

        ``fwd_ms``: layer index -> forward times; ``bwd_ms``: backward stage -> stage times.
        Returns True when the cuts changed: only when the search finds cuts estimated faster
        than the current ones under the measured costs (ties keep the current plan).
        """
        if self.profile_left <= 0:
            return False
        for layer, times in fwd_ms.items():
            self._fwd_samples.setdefault(layer, []).extend(times)
        for stage, times in bwd_ms.items():
            self._bwd_samples.setdefault(stage, []).extend(times)
        self.profile_left -= 1
        if self.profile_left > 0:
            return False
        # read now: the backward samples are per stage of the cuts in use, which may change
        costs = self._profiled = self._measured()
        if costs is None:
            return False
        current = self._partition(costs, (self.fwd_cuts, self.bwd_cuts))
        best = self._partition(costs)
        if best.est_iteration_ms >= current.est_iteration_ms * (1 - 1e-9):
            self.est_iteration_ms = current.est_iteration_ms
            log.info("measured costs keep the plan (est. %.3g ms)", current.est_iteration_ms)
            return False
        self.set_cuts(best.fwd_cuts, best.bwd_cuts)
        self.est_iteration_ms = best.est_iteration_ms
        self.replanned = True
        self._log_plan("re-planned from measurements")
        return True

    def measured_costs(self) -> LayerCosts | None:
        """The per-layer costs the finished profile measured (medians), as ``observe`` read
        them with the cuts they were measured under; None before the profile ends."""
        return self._profiled

    def replan_rounds(self, costs: LayerCosts) -> tuple[float, float]:
        """Autotuning's re-plan (autotune.py): the round size and the cuts chosen together for
        ``costs``, over every M_R dividing the step's micro-batches that fits the budget (the
        given ``roundpipe.round_size`` only, when set; the given cuts only, when set). The plan
        changes only when the best is estimated faster than the plan in use at its own round
        size. Returns (estimate of the plan in use, estimate of the plan chosen), ms."""
        m = self.num_microbatches
        if self._round_size_given:
            sizes = [self.round_size]
        else:
            sizes = [d for d in range(m, 0, -1) if not m % d]
            if self.memory_budget_bytes is not None and self.boundary_bytes > 0:
                sizes = [d for d in sizes if d <= self.round_size]  # fit_round_size's largest

        current = (tuple(self.fwd_cuts), tuple(self.bwd_cuts))
        before = self._partition(costs, current, self.round_size).est_iteration_ms
        best_ms, best_size, best = before, self.round_size, current
        for size in sizes:
            part = self._partition(costs, current if self.fixed else None, size)
            if part.est_iteration_ms < best_ms * (1 - 1e-9):
                best_ms, best_size = part.est_iteration_ms, size
                best = (tuple(part.fwd_cuts), tuple(part.bwd_cuts))
        self.est_iteration_ms = best_ms
        if (best_size, best) != (self.round_size, current):
            self.round_size = best_size
            self.set_cuts(*best)
            self.replanned = True
            self._log_plan(f"autotuning re-planned (round size {best_size})")
        return before, best_ms

    def _measured(self) -> LayerCosts | None:
        p = 1 if self.shape.has_prefix else 0
        n = self.shape.num_blocks
        med = {k: statistics.median(v) for k, v in self._fwd_samples.items() if v}
        if any(p + i not in med for i in range(n)):
            return None
        fwd = [med[p + i] for i in range(n)]
        # Backward stage time = recompute + backward of its layers; split the backward part
        # over the stage's layers in proportion to their forward times.
        bwd = [2 * f for f in fwd]
        for j, times in self._bwd_samples.items():
            layers = [i - p for i in self.stages.bwd[j] if p <= i < p + n]
            if j == 0 or not layers:
                continue
            stage_f = sum(fwd[i] for i in layers)
            back = max(statistics.median(times) - stage_f, 0.0)
            for i in layers:
                bwd[i] = back * fwd[i] / stage_f if stage_f > 0 else back / len(layers)
        head = med.get(self.stages.head_index, 0.0)
        head_stage = self._bwd_samples.get(0)
        if head_stage:
            # the HEAD slot also runs its stage's blocks (forward + backward, no recompute):
            # only the rest is the LM head's own cost
            blocks = [i - p for i in self.stages.bwd[0] if p <= i < p + n]
            own = sum(fwd[i] + bwd[i] for i in blocks)
            head_total = max(statistics.median(head_stage) - own, 0.0)
        else:
            head_total = 3 * head
        return _costs(self.shape, fwd, bwd, head_total / 3, self._memory())


def _engine_schedule(name: str) -> schedules.ScheduleSpec:
    """The registry entry of ``roundpipe.schedule``: one the executor runs (weights offloaded)."""
    spec = schedules.SCHEDULES.get(name)
    if spec is None or not spec.offloaded:
        raise ValueError(
            f"roundpipe.schedule {name!r} is not a schedule the engine runs; choose one of "
            f"{list(schedules.ENGINE_SCHEDULES)}"
        )
    return spec


def _round_size(requested: int | None, gas: int) -> int:
    """M_R: micro-batches a slot serves per weight upload. Default: the whole step (GAS), so
    each slot uploads its weights once per optimizer step; a given value must divide GAS."""
    if requested is None:
        return gas
    if requested < 1 or gas % requested:
        raise ValueError(
            f"roundpipe.round_size {requested} must be a positive divisor of "
            f"gradient_accumulation_steps ({gas}); e.g. {gas} (one round per step) or 1"
        )
    return requested


def _even_split(n: int, parts: int) -> tuple[int, ...]:
    """``n`` items in ``parts`` contiguous groups, sizes differing by at most one."""
    return tuple(n // parts + (1 if i < n % parts else 0) for i in range(parts))


def _costs(
    shape: ModelShape,
    fwd: list[float],
    bwd: list[float],
    head_fwd: float,
    memory: dict[str, Any],
) -> LayerCosts:
    # The prefix always shares stages with block 0 (forward stage 0, the last backward stage;
    # never the head stage), so its weights count there, for the memory checks and the bytes
    # a plan uploads alike.
    params = list(shape.block_param_bytes)
    params[0] += shape.prefix_param_bytes
    return LayerCosts(
        fwd_ms=tuple(fwd),
        bwd_ms=tuple(bwd),
        recompute_ms=tuple(fwd),
        param_bytes=tuple(params),
        head_fwd_ms=head_fwd,
        head_bwd_ms=2 * head_fwd,
        head_param_bytes=shape.head_param_bytes,
        **memory,
    )
