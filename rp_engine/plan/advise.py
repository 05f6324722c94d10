"""The configuration advisor: which micro-batch, accumulation, round size, cuts and optimizer tier
make a model train fastest with RoundPipe on a machine.

``advise(shape, machine, ...)`` returns the best few ``Advice`` (ranked by simulated tokens/s);
``Advice.ds_config()`` is a DeepSpeed-style config that ``rp_engine.initialize`` and ``rp-train
--deepspeed`` accept as is; ``format_table`` prints them (advice.py: the answer and its table,
re-exported here; this module is the search). ``python -m rp_engine.plan advise``
and ``rp-train --plan`` are its command lines.

What is searched (the user's fixed ``seq_len``, ``micro_batch`` and ``tokens_per_step`` are
kept):

- micro-batch size (sequences per micro-batch): 1, 2, 4, ... doubling while one micro-batch
  fits a device (shapes.mem_bytes) and the cuts can be placed (``partition`` raises when one
  layer does not fit), and while doubling still gains;
- gradient accumulation (micro-batches per step): powers of two up to ``MAX_GRAD_ACCUM``,
  growing only while the host's optimizer step (or the NVMe tier) still binds: past that a
  longer step buys almost nothing but a larger batch;
- round size M_R (micro-batches per weight upload): the divisors of the accumulation whose
  2 x M_R boundary states fit beside the cuts' largest slot (``fitted_round_size``'s rule);
- cuts: ``partition`` with the device budget (memory less ``CONTEXT_BYTES``) and the host link;
- optimizer tier: fp32 masters and Adam moments in host RAM ("host": 2 B/param of bf16 weights
  + 16 B/trainable param of masters, gradients and moments), or on NVMe ("nvme": the host keeps
  the weights and the tiers' buffers, a few layers' state and gradients: host_ram.py; 12
  B/trainable param read and 12 B written per step at
  ``machine.nvme_read_gbps``, writes assumed as fast as reads) when ``host_ram_bytes`` cannot
  hold the host tier (or ``nvme=True``).

Recomputation is not a knob: RoundPipe always recomputes a backward stage's forward from its
stashed input, and the cost model counts it.

Scoring, in three passes (so a 94-layer model takes seconds):

1. closed form, every grid point: per micro-batch size one ``partition`` (small work) gives
   cuts; then per (accumulation, round) the iteration is at least the busiest device class's
   compute, the busiest link's transfers (``transfer_ms``) and the host step (CPU Adam over the
   trainable parameters at ``cpu_adam_params_per_s``; with the NVMe tier at least the disk
   time); async: their maximum (the step overlaps the next iteration), sync: the pipeline's
   fill and drain and the host step are added;
2. the best ``finalists`` x 2 points: ``partition`` at their own accumulation and round (small
   work) and the same host terms;
3. the best ``finalists``: ``partition`` with the full work and ``simulate`` (4 iterations
   async, 2 sync; ``global_norm`` = clipping), with the CPU-Adam rate of the machine set so the
   simulated step takes the host step's time (LoRA: only the adapters step; NVMe: the disk
   time when it is longer), as benchmarks/projection.py does. Ranked by that.

``binds`` names the largest of four per-step times of the simulated best: compute (the cuts'
iteration estimate without transfers), pcie (``transfer_ms``), host adam and disk.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rp_engine.host.defaults import default_grad_buffers
from rp_engine.host.units import format_mib_gib

from . import schedules
from .actions import Plan, format_bytes
from .advice import NVME_BUFFERS, Advice, AdviceError, Grid, format_table
from .costs import LayerCosts
from .host_ram import HostRam, PoolCounts, tier_host_ram
from .lower import lower
from .partition import (
    Partition,
    estimate_iteration_ms,
    fitted_round_size,
    partition,
    prefetch_fits,
    transfer_ms,
)
from .shapes import CONTEXT_BYTES, Shape, layer_costs, max_seq, mem_bytes
from .simulate import Machine, SimResult, simulate
from .validate import validate

__all__ = [
    "Advice",
    "AdviceError",
    "Grid",
    "advise",
    "format_table",
    "DEFAULT_SEQ_LEN",
    "MAX_GRAD_ACCUM",
]

DEFAULT_SEQ_LEN = 2048  # the published per-layer measurement's sequence length
MAX_GRAD_ACCUM = 64
MAX_MICRO_BATCH = 256
GRID_WORK = 20_000  # partition work per grid point
FINAL_WORK = 150_000  # partition's default: the finalists
HOST_STATE_BYTES = 16  # per trainable parameter: fp32 master, fp32 gradient, Adam m and v
NVME_STATE_BYTES = 12  # per trainable parameter on the NVMe tier: master, m, v
SIM_BUDGET = 40_000  # compute actions simulated in pass 3 (a few seconds of simulator)
MIN_MICRO_BATCH_EXPLORED = 4  # the closed form undervalues bigger micro-batches: try up to 4
TIE = 1e-3  # ranks ties by compute + transfer time (0.1 % of it added): larger rounds first
GAIN = 1.01  # a bigger micro-batch or step must gain at least 1 % to be explored further


# ---- the search --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Point:
    micro_batch: int
    grad_accum: int
    round_size: int
    tier: str


@dataclass
class _Ctx:
    shape: Shape
    machine: Machine
    n: int
    seq_len: int
    budget: int | None
    link: float
    async_opt: bool
    clipping: bool
    host_ram: int | None
    nvme: bool | None
    nvme_gbps: float
    costs: dict[int, LayerCosts] = dataclasses.field(default_factory=dict)
    measured: Callable[[int], LayerCosts] | None = None  # micro-batch -> costs, else the model
    # (micro-batch, accumulation, round) points whose cuts only fit prefetch depth 0
    shallow: set[tuple[int, int, int]] = dataclasses.field(default_factory=set)

    def layer_costs(self, mb: int) -> LayerCosts:
        if mb not in self.costs:
            self.costs[mb] = (
                self.measured(mb)
                if self.measured is not None
                else layer_costs(self.shape, self.machine, micro_batch=mb, seq_len=self.seq_len)
            )
        return self.costs[mb]

    @property
    def adam_ms(self) -> float:
        return self.shape.trainable_params / self.machine.cpu_adam_params_per_s * 1e3

    def disk_ms(self, tier: str) -> float:
        if tier != "nvme":
            return 0.0
        return self.nvme_bytes(tier) / (self.nvme_gbps * 1e6)

    def nvme_bytes(self, tier: str) -> int:
        return 2 * NVME_STATE_BYTES * self.shape.trainable_params if tier == "nvme" else 0

    def host_ms(self, tier: str) -> float:
        # the tier streams a layer's state through its buffers while CPU Adam steps another
        return max(self.adam_ms, self.disk_ms(tier))

    def host_bytes(self, tier: str, acts: int, *, fewest: bool = False) -> int:
        """Host RAM of the run: bf16 weights of every parameter and the optimizer state of the
        trainable ones (host tier), or with the NVMe optimizer tier what host_ram.py counts
        (the weights, the tier's and the gradient pool's buffers of a few layers, staging;
        ``fewest``: every pool at its fewest buffers), and the stashed activations ``acts``."""
        s = self.shape
        if tier == "host":
            return 2 * s.total_params + HOST_STATE_BYTES * s.trainable_params + acts
        return self.tier_ram(fewest=fewest).peak + acts

    def tier_ram(self, *, fewest: bool = False) -> HostRam:
        """The host RAM with the NVMe optimizer tier, by part (host_ram.py); ``fewest``: with
        every pool at its fewest buffers, the least the run can work with (host_preflight.py
        shrinks the pools that far to fit a limit, and refuses below)."""
        s = self.shape
        counts = (
            PoolCounts.fewest(self.n, grad_tier=True)
            if fewest
            else PoolCounts(NVME_BUFFERS, default_grad_buffers(self.n), 0)
        )
        per_layer = s.trainable_params // max(s.layers, 1)
        head = 0 if s.lora else s.head_params
        embed = 0 if s.tied else head
        return tier_host_ram(
            layer_params=[s.head_params * (0 if s.tied else 1)]
            + [s.layer_params] * s.layers + [s.head_params],
            layer_trainable=[embed] + [per_layer] * s.layers + [head],
            dtype_bytes=2, devices=self.n, optimizer_tier=True, param_tier=False,
            grad_buffers=counts.grad, optimizer_buffers=counts.optimizer,
            # at the fewest: the optimizer state in its smallest slices, stages of one layer
            optimizer_slice=counts.optimizer_slice,
            stage_bytes=2 * s.layer_params if fewest else 0,
            weight_copies=2 if self.async_opt else 1, device_bytes=self.budget or 0,
        )  # fmt: skip

    def tiers(self) -> list[str]:
        if self.nvme is True:
            return ["nvme"]
        if self.nvme is False or self.host_ram is None:
            return ["host"]
        return ["host", "nvme"]

    def host_acts(self, mb: int, gas: int, num_bwd: int) -> int:
        # a backward stage's input is stashed on the host per micro-batch; the async optimizer
        # keeps two iterations in flight
        boundary = self.layer_costs(mb).boundary_bytes
        return num_bwd * gas * boundary * (2 if self.async_opt else 1)


def _tier_lines(ctx: _Ctx) -> tuple[str, ...]:
    """Where the host RAM goes with the NVMe tier, and the least the run can work with."""
    least = ctx.tier_ram(fewest=True).peak
    return (
        *ctx.tier_ram().lines(),
        f"  {'least that can work (fewest, sliced)':<38}{format_mib_gib(least)}",
    )


def _load_ms(costs: LayerCosts, part: Partition | tuple, n: int, m: int) -> float:
    """The busiest device class's compute per iteration (estimate._load_bound's rule)."""
    fwd, bwd = (part.fwd_cuts, part.bwd_cuts) if isinstance(part, Partition) else part
    st = costs.stages(fwd, bwd)
    slots = len(st.pre_ms)
    g = math.gcd(slots, n)
    heaviest = max(sum(st.busy_ms(i) for i in range(c, slots, g)) for c in range(g))
    return heaviest * m * g / n


def _serial_copies_ms(ctx: _Ctx, costs: LayerCosts, part: Partition, gas: int, r: int) -> float:
    """What the weight copies add to each device's compute per iteration when they cannot
    overlap it (prefetch depth 0: the memory holds one group's weights, ``prefetch_fits``):
    every round uploads each slot's weights and downloads each backward slot's gradients,
    spread over the devices; 0 at depth 1."""
    if not ctx.link or prefetch_fits(costs, part.fwd_cuts, part.bwd_cuts, r, ctx.budget):
        return 0.0
    st = costs.stages(part.fwd_cuts, part.bwd_cuts)
    moved = sum(st.param_bytes) + sum(st.grad_bytes)
    return -(-gas // r) * moved / ctx.n / (ctx.link * 1e6)


def _fill_ms(costs: LayerCosts, part: Partition, n: int) -> float:
    """Fill and drain of one synchronous iteration: about one micro-batch's path through every
    slot, less the share its own device would run anyway."""
    st = costs.stages(part.fwd_cuts, part.bwd_cuts)
    return sum(st.busy_ms(i) for i in range(len(st.pre_ms))) * (n - 1) / n


def _combine(ctx: _Ctx, pipe_ms: float, tier: str, fill_ms: float = 0.0) -> float:
    if ctx.async_opt:
        return max(pipe_ms, ctx.host_ms(tier))
    return pipe_ms + fill_ms + ctx.host_ms(tier)


def _divisors(m: int) -> list[int]:
    return [d for d in range(1, m + 1) if not m % d]


def _partition(
    ctx: _Ctx, mb: int, gas: int, r: int, work: int, *, exact: bool = False
) -> Partition | None:
    """Cuts for one point, scored for the prefetch depth they will run at. Depth 1 where the
    device memory holds it for the cuts found (``prefetch_fits``): the uploads hide behind
    the previous group's compute, and the link bound plus the first upload ranks the points
    (modelling each copy there too lowered the best found on two of the grid's pairs by
    3-3.5 %). Else the cuts are searched again with the copies modelled at depth 0, where
    they run between a device's groups: a 94-layer MoE on a 24 GiB card was estimated 41 %
    above its simulated run, and the advisor ranked the wrong micro-batch first. A point whose
    depth-1 cuts did not fit goes straight to depth 0 when it is partitioned again (pass 3).
    ``exact`` (the finalists): where the bound says depth 1 does not fit, the lowered plan's
    validated peak decides (the bound is conservative: a Llama-3.1-8B finalist's cuts fit at
    depth 1 although the bound said no, and searched again at depth 0 they ran 1 % slower)."""
    costs = ctx.layer_costs(mb)
    part = None
    for depth in (None, 0):
        if depth is None and (mb, gas, r) in ctx.shallow:
            continue
        try:
            part = partition(
                costs,
                num_devices=ctx.n,
                num_microbatches=gas,
                memory_budget_bytes=ctx.budget,
                async_optimizer=ctx.async_opt,
                max_work=work,
                link_gbps=ctx.link,
                round_size=r,
                prefetch_depth=depth,
            )
        except ValueError:  # one layer (or the head) does not fit at this micro-batch
            return None
        if depth == 0 or prefetch_fits(costs, part.fwd_cuts, part.bwd_cuts, r, ctx.budget):
            break
        if exact and _lowered(ctx, _plan(ctx, part, gas, r, 1), costs)[1] == 1:
            break
        ctx.shallow.add((mb, gas, r))
    return part


def _plan(ctx: _Ctx, part: Partition, gas: int, r: int, iterations: int) -> Plan:
    return schedules.build(
        "roundpipe",
        num_iterations=iterations,
        fwd_cuts=part.fwd_cuts,
        bwd_cuts=part.bwd_cuts,
        num_devices=ctx.n,
        num_microbatches=gas,
        round_size=r,
    )


def _lowered(ctx: _Ctx, plan: Plan, costs: LayerCosts, *, deep: bool = True) -> tuple[Plan, int]:
    """``plan`` lowered with the deepest prefetch (1 or 0) the device memory allows, as the
    engine's planner chooses it (runtime/planning.py), and that depth; ``deep=False`` does
    not try depth 1 (lowering and validating a 127-slot plan takes seconds)."""
    optimizer = "async" if ctx.async_opt else "sync"
    for depth in (1, 0) if deep else (0,):
        lowered = lower(plan, optimizer=optimizer, prefetch_depth=depth)
        peak = max(validate(lowered, costs=costs)) + _context_bytes(ctx.machine)
        if not ctx.machine.memory_bytes or peak <= ctx.machine.memory_bytes:
            break
    return lowered, depth


def _fits_host(ctx: _Ctx, p: _Point, part: Partition) -> bool:
    """The point's host bytes (its tier's state, the activations its cuts stash) fit the
    host RAM (always, without a limit)."""
    if ctx.host_ram is None:
        return True
    acts = ctx.host_acts(p.micro_batch, p.grad_accum, len(part.bwd_cuts))
    return ctx.host_bytes(p.tier, acts) <= ctx.host_ram


def _round_fits(ctx: _Ctx, mb: int, gas: int, r: int, part: Partition) -> bool:
    fitted = fitted_round_size(ctx.layer_costs(mb), part.fwd_cuts, part.bwd_cuts, gas, ctx.budget)
    return r <= fitted


def _closed_form(
    ctx: _Ctx, mb: int, part: Partition, gas_list: Sequence[int], grid: Grid, prune: bool
) -> list[tuple[float, _Point]]:
    """(tokens/s, point) of every (accumulation, round, tier) of one micro-batch size with the
    cuts ``part`` (pass 1)."""
    costs = ctx.layer_costs(mb)
    out: list[tuple[float, _Point]] = []
    fill = _fill_ms(costs, part, ctx.n) if not ctx.async_opt else 0.0
    for tier in ctx.tiers():
        best = 0.0
        for gas in gas_list:
            host = ctx.host_bytes(tier, ctx.host_acts(mb, gas, len(part.bwd_cuts)))
            if ctx.host_ram is not None and host > ctx.host_ram:
                continue
            load = _load_ms(costs, part, ctx.n, gas)
            rounds = [
                d for d in _divisors(gas) if grid.round_sizes is None or d in grid.round_sizes
            ]
            fitted = fitted_round_size(costs, part.fwd_cuts, part.bwd_cuts, gas, ctx.budget)
            top = 0.0
            bound = "pipe"
            for r in rounds:
                if r > fitted:
                    continue
                xfer = transfer_ms(costs, part.fwd_cuts, part.bwd_cuts, ctx.n, gas, r, ctx.link)
                busy = load + _serial_copies_ms(ctx, costs, part, gas, r)
                # ties (the host step binds several points) go to the least loaded pipeline
                it = _combine(ctx, max(busy, xfer), tier, fill) + TIE * (busy + xfer)
                tps = gas * mb * ctx.seq_len / (it / 1e3)
                out.append((tps, _Point(mb, gas, r, tier)))
                if tps > top:
                    top = tps
                    bound = "host" if ctx.host_ms(tier) >= max(busy, xfer) else "pipe"
            if prune and top and bound == "pipe" and top < best * GAIN:
                break  # the host step no longer binds and a longer step gains nothing
            best = max(best, top)
    return out


def _simulate(ctx: _Ctx, p: _Point, part: Partition) -> SimResult:
    costs = ctx.layer_costs(p.micro_batch)
    plan = _plan(ctx, part, p.grad_accum, p.round_size, 4 if ctx.async_opt else 2)
    # the simulator steps every layer's parameters at cpu_adam_params_per_s: set the rate so
    # that the whole step takes the host step's time (LoRA steps only the adapters; the NVMe
    # tier's disk time when it is longer)
    stepped = (
        sum(costs.param_bytes) + costs.head_param_bytes + costs.prefix_param_bytes
    ) / ctx.machine.bytes_per_param
    rate = stepped / (ctx.host_ms(p.tier) / 1e3)
    # compute_scale 1: the costs are this machine's already (shapes.layer_costs scales them);
    # the simulator would scale them a second time (an A800 ran 0.53^2 of the 4090's times)
    machine = dataclasses.replace(ctx.machine, cpu_adam_params_per_s=rate, compute_scale=1.0)
    # prefetch as deep as the device memory allows (a 94-layer MoE slot pair needs 31 GiB on
    # a 24 GiB card at depth 1); cuts searched at depth 0 (``_partition``) do not try 1 again
    deep = (p.micro_batch, p.grad_accum, p.round_size) not in ctx.shallow
    lowered, _ = _lowered(ctx, plan, costs, deep=deep)
    return simulate(
        lowered,
        costs,
        machine=machine,
        optimizer="async" if ctx.async_opt else "sync",
        global_norm=ctx.clipping,
    )


def _advice(ctx: _Ctx, p: _Point, part: Partition, sim: SimResult) -> Advice:
    costs = ctx.layer_costs(p.micro_batch)
    iters = sim.num_iterations
    pcie = sum(v for k, v in sim.bytes_moved.items() if k.endswith(("h2d", "d2h")))
    compute = estimate_iteration_ms(
        costs,
        part.fwd_cuts,
        part.bwd_cuts,
        num_devices=ctx.n,
        num_microbatches=p.grad_accum,
        async_optimizer=ctx.async_opt,
        round_size=p.round_size,
    )
    xfer = transfer_ms(
        costs, part.fwd_cuts, part.bwd_cuts, ctx.n, p.grad_accum, p.round_size, ctx.link
    )
    step = {
        "compute": compute,
        "pcie": xfer,
        "host adam": ctx.adam_ms,
        "disk": ctx.disk_ms(p.tier),
    }
    binds = max(step, key=lambda k: step[k])
    acts = ctx.host_acts(p.micro_batch, p.grad_accum, len(part.bwd_cuts))
    # The iteration is at least what the simulator says and at least the compute's long-run
    # steady state with the host terms: 4 simulated iterations (what a 94-layer model affords)
    # can read a settling async run short (a -1 % bubble for Qwen3-1.7B on the 4090 preset);
    # the estimate reads the long run (plan/simulate/quick.py). Its transfers are left to the
    # simulation, which knows the machine's links (NVLink peer copies; the estimate's
    # transfer_ms sends every activation through the host link)
    fill = 0.0 if ctx.async_opt else _fill_ms(costs, part, ctx.n)
    iteration = max(sim.iteration_ms, _combine(ctx, compute, p.tier, fill))
    return Advice(
        model=ctx.shape.name,
        machine=ctx.machine.name,
        num_devices=ctx.n,
        seq_len=ctx.seq_len,
        micro_batch=p.micro_batch,
        grad_accum=p.grad_accum,
        round_size=p.round_size,
        fwd_cuts=tuple(part.fwd_cuts),
        bwd_cuts=tuple(part.bwd_cuts),
        tier=p.tier,
        async_optimizer=ctx.async_opt,
        clipping=ctx.clipping,
        tokens_per_s=p.grad_accum * p.micro_batch * ctx.seq_len / (iteration / 1e3),
        iteration_ms=iteration,
        bubble=1.0 - sim.busy_ms / (ctx.n * iteration) if iteration > 0 else 0.0,
        device_peak_bytes=int(max(sim.peak_memory_bytes) + _context_bytes(ctx.machine)),
        device_budget_bytes=ctx.machine.memory_bytes,
        host_ram_bytes=ctx.host_bytes(p.tier, acts),
        host_ram_lines=_tier_lines(ctx) if p.tier == "nvme" else (),
        pcie_bytes_per_step=int(pcie / iters),
        nvme_bytes_per_step=ctx.nvme_bytes(p.tier),
        binds=binds,
        max_seq_len=(
            max_seq("roundpipe", ctx.shape, ctx.machine) if ctx.machine.memory_bytes else None
        ),
        step_ms={k: v for k, v in step.items() if v > 0},
        sim=sim,
    )


def _powers(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def _context(
    shape: Shape,
    machine: Machine,
    *,
    host_ram_bytes: int | None,
    nvme: bool | None,
    nvme_gbps: float | None,
    seq_len: int,
    async_optimizer: bool,
    clipping: bool,
    lora: int | None,
) -> _Ctx:
    if lora is not None:
        shape = dataclasses.replace(shape, lora=lora > 0, lora_rank=lora or shape.lora_rank)
    n = machine.num_devices
    link = min(machine.h2d_gbps, machine.d2h_gbps)
    if machine.host_link_gbps:
        link = min(link, machine.host_link_gbps / n)
    context = _context_bytes(machine)
    budget = int(machine.memory_bytes - context) if machine.memory_bytes else None
    return _Ctx(
        shape=shape,
        machine=machine,
        n=n,
        seq_len=seq_len,
        budget=budget,
        link=link,
        async_opt=async_optimizer,
        clipping=clipping,
        host_ram=host_ram_bytes,
        nvme=nvme,
        nvme_gbps=nvme_gbps or machine.nvme_read_gbps,
    )


def _context_bytes(machine: Machine) -> float:
    """What a device holds outside any plan: the CUDA context on a GPU (outside torch's
    caching allocator; the allocator's slack and kernel workspaces are the memory rule's
    terms now, ``shapes.memory_terms``); nothing on CPU virtual devices
    (``Machine.host_cores``: they compute on the host)."""
    return 0.0 if machine.host_cores else CONTEXT_BYTES


def _micro_batches(
    ctx: _Ctx, micro_batch: int | None, tokens_per_step: int | None, grid: Grid
) -> list[int]:
    if micro_batch is not None:
        return [micro_batch]
    seqs = tokens_per_step // ctx.seq_len if tokens_per_step else None
    cands = list(grid.micro_batches or _powers(MAX_MICRO_BATCH))
    if seqs:
        cands = [b for b in cands if not seqs % b]
    mem = ctx.machine.memory_bytes
    # one micro-batch must fit a device (the memory model of shapes.py)
    return [
        b
        for b in cands
        if not mem or mem_bytes("roundpipe", ctx.shape, b * ctx.seq_len, ctx.n) <= mem
    ]


def _grad_accums(
    ctx: _Ctx, mb: int, micro_batch_fixed: bool, tokens_per_step: int | None, grid: Grid
) -> list[int]:
    if tokens_per_step:
        seqs = tokens_per_step // ctx.seq_len
        return [seqs // mb] if seqs % mb == 0 and seqs >= mb else []
    return list(grid.grad_accums or _powers(MAX_GRAD_ACCUM))


def _check_fixed(seq_len: int, micro_batch: int | None, tokens_per_step: int | None) -> None:
    if seq_len < 1:
        raise AdviceError(f"seq_len {seq_len}: must be >= 1")
    if micro_batch is not None and micro_batch < 1:
        raise AdviceError(f"micro_batch {micro_batch}: must be >= 1")
    if tokens_per_step is not None:
        if tokens_per_step < seq_len or tokens_per_step % seq_len:
            raise AdviceError(
                f"tokens_per_step {tokens_per_step} is not a multiple of seq_len {seq_len}: "
                f"give a multiple, e.g. {max(1, round(tokens_per_step / seq_len)) * seq_len}"
            )
        seqs = tokens_per_step // seq_len
        if micro_batch is not None and seqs % micro_batch:
            raise AdviceError(
                f"tokens_per_step {tokens_per_step} = {seqs} sequences of {seq_len} tokens is "
                f"not a multiple of micro_batch {micro_batch}: change one of them"
            )


def advise(
    shape: Shape,
    machine: Machine,
    *,
    host_ram_bytes: int | None = None,
    nvme: bool | None = None,
    nvme_gbps: float | None = None,
    seq_len: int | None = None,
    micro_batch: int | None = None,
    tokens_per_step: int | None = None,
    grad_accum: int | None = None,
    async_optimizer: bool = True,
    clipping: bool = True,
    lora: int | None = None,
    top: int = 5,
    finalists: int | None = None,
    sim_budget: int = SIM_BUDGET,
    grid: Grid | None = None,
    grid_work: int = GRID_WORK,
    final_work: int = FINAL_WORK,
    costs: Callable[[int], LayerCosts] | None = None,
) -> list[Advice]:
    """The ``top`` best RoundPipe configurations of ``shape`` on ``machine`` (all of its
    devices), best first, by simulated tokens/s (the module docstring's search and scoring).

    Fixed choices: ``seq_len`` (None: ``DEFAULT_SEQ_LEN``), ``micro_batch`` (sequences per
    micro-batch), ``tokens_per_step`` (micro-batch x accumulation x seq_len), ``grad_accum``
    (micro-batches per step); the rest is searched. ``costs``: measured per-layer costs of a
    micro-batch of that many sequences (e.g. timed on the devices), instead of the FLOPs model
    of shapes.py. ``host_ram_bytes``: the host's RAM (None: unlimited, host tier); ``nvme``: None
    uses the NVMe tier only when the host tier does not fit, True always, False never;
    ``nvme_gbps`` overrides ``machine.nvme_read_gbps``. ``lora``: None keeps the shape's
    setting, 0 trains every parameter, r > 0 LoRA adapters of rank r. ``finalists`` (None:
    the smaller of ``top`` and 3): the most points simulated, best estimate first, while their compute actions
    (iterations x micro-batches x slots) stay within ``sim_budget`` (the first always is), so
    fewer than ``top`` may come back for a large model. Configurations whose simulated device
    peak exceeds the machine's memory rank last (``Advice.fits_device``). Raises AdviceError
    when nothing fits, naming what and the fix.
    """
    seq = DEFAULT_SEQ_LEN if seq_len is None else seq_len
    _check_fixed(seq, micro_batch, tokens_per_step)
    if grad_accum is not None and grad_accum < 1:
        raise AdviceError(f"grad_accum {grad_accum}: must be >= 1")
    grid = grid or Grid()
    ctx = _context(
        shape, machine, host_ram_bytes=host_ram_bytes, nvme=nvme, nvme_gbps=nvme_gbps,
        seq_len=seq, async_optimizer=async_optimizer, clipping=clipping, lora=lora,
    )  # fmt: skip
    ctx.measured = costs
    prune = grid.prune
    mbs = _micro_batches(ctx, micro_batch, tokens_per_step, grid)
    # pass 1: per micro-batch size one partition, then the closed form over the grid
    scored: list[tuple[float, _Point]] = []
    best_mb = 0.0
    for mb in mbs:
        gas_list = _grad_accums(ctx, mb, micro_batch is not None, tokens_per_step, grid)
        if grad_accum is not None:
            gas_list = [g for g in gas_list if g == grad_accum] if tokens_per_step else [grad_accum]
        if not gas_list:
            continue
        ref_gas = min((g for g in gas_list if g >= ctx.n), default=gas_list[-1])
        ref_round = max(d for d in _divisors(ref_gas) if d <= max(ctx.n, 1) or d == ref_gas)
        if grid.round_sizes:
            ref_round = max((d for d in _divisors(ref_gas) if d in grid.round_sizes), default=1)
        part = _partition(ctx, mb, ref_gas, ref_round, grid_work)
        if part is None:
            break  # a layer no longer fits at this micro-batch: larger ones fit even less
        rows = _closed_form(ctx, mb, part, gas_list, grid, prune)
        scored.extend(rows)
        here = max((t for t, _ in rows), default=0.0)
        if prune and micro_batch is None and here and here < best_mb * GAIN:
            break  # doubling the micro-batch no longer gains
        best_mb = max(best_mb, here)
    if not scored:
        raise AdviceError(_nothing_fits(ctx, micro_batch, tokens_per_step))
    scored.sort(key=lambda t: -t[0])
    # pass 2: the best points with their own cuts
    pool = _distinct(
        [p for _, p in scored], 2 * max(min(top, 3) if finalists is None else finalists, 1)
    )
    pool += [p for p in _whole_step_rounds(scored, grid) if p not in pool]
    second: list[tuple[float, _Point, Partition]] = []
    for p in pool:
        part = _partition(ctx, p.micro_batch, p.grad_accum, p.round_size, grid_work)
        if part is None or not _round_fits(ctx, p.micro_batch, p.grad_accum, p.round_size, part):
            continue
        if not _fits_host(ctx, p, part):  # its own cuts stash more or fewer activations
            continue
        pipe = part.est_iteration_ms
        fill = _fill_ms(ctx.layer_costs(p.micro_batch), part, ctx.n) if not ctx.async_opt else 0
        it = _combine(ctx, pipe, p.tier, fill) + TIE * pipe
        second.append((p.grad_accum * p.micro_batch * seq / (it / 1e3), p, part))
    if not second:
        raise AdviceError(_nothing_fits(ctx, micro_batch, tokens_per_step))
    second.sort(key=lambda t: -t[0])
    # pass 3: the finalists with the full search and the simulator, best estimate first, while
    # the simulated actions stay within sim_budget (the simulator dominates the run time)
    out: list[Advice] = []
    spent = 0
    for _, p, part in second:
        if len(out) >= max(min(top, 3) if finalists is None else finalists, 1):
            break
        cost = (
            (4 if async_optimizer else 2) * p.grad_accum * (len(part.fwd_cuts) + len(part.bwd_cuts))
        )
        if out and spent + cost > sim_budget:
            break
        spent += cost
        full = (
            _partition(ctx, p.micro_batch, p.grad_accum, p.round_size, final_work, exact=True)
            or part
        )
        if not _round_fits(ctx, p.micro_batch, p.grad_accum, p.round_size, full):
            full = part
        out.append(_advice(ctx, p, full, _simulate(ctx, p, full)))
    # what fits the device's memory (simulated peak) first, then by tokens/s
    out.sort(key=lambda a: (not a.fits_device, -a.tokens_per_s))
    return out[:top]


def score_point(
    shape: Shape,
    machine: Machine,
    *,
    micro_batch: int,
    grad_accum: int,
    round_size: int,
    tier: str = "host",
    seq_len: int = DEFAULT_SEQ_LEN,
    async_optimizer: bool = True,
    clipping: bool = True,
    work: int = FINAL_WORK,
    simulated: bool = True,
    host_ram_bytes: int | None = None,
    costs: Callable[[int], LayerCosts] | None = None,
) -> Advice | float | None:
    """One grid point scored the advisor's final way (``partition`` at ``work``, then
    ``simulate``): its Advice, or None when it does not fit. ``simulated=False``: the tokens/s
    of pass 2 (partition estimate and host terms) instead. For exhaustive comparisons, and
    for the prediction of a configuration the advisor did not choose. ``costs``: as
    ``advise``'s."""
    ctx = _context(
        shape, machine, host_ram_bytes=host_ram_bytes, nvme=tier == "nvme", nvme_gbps=None,
        seq_len=seq_len, async_optimizer=async_optimizer, clipping=clipping, lora=None,
    )  # fmt: skip
    ctx.measured = costs
    if machine.memory_bytes and (
        mem_bytes("roundpipe", shape, micro_batch * seq_len, ctx.n) > machine.memory_bytes
    ):
        return None
    part = _partition(ctx, micro_batch, grad_accum, round_size, work, exact=simulated)
    if part is None or not _round_fits(ctx, micro_batch, grad_accum, round_size, part):
        return None
    p = _Point(micro_batch, grad_accum, round_size, tier)
    if not _fits_host(ctx, p, part):
        return None
    if not simulated:
        fill = _fill_ms(ctx.layer_costs(micro_batch), part, ctx.n) if not async_optimizer else 0
        it = _combine(ctx, part.est_iteration_ms, tier, fill)
        return grad_accum * micro_batch * seq_len / (it / 1e3)
    return _advice(ctx, p, part, _simulate(ctx, p, part))


def _whole_step_rounds(scored: Sequence[tuple[float, _Point]], grid: Grid) -> list[_Point]:
    """Per micro-batch size scored in pass 1, its largest accumulation in one round (the
    largest the grid allows), on the tier of its best point. Pass 1 drops rounds that the
    reference cuts (partitioned at a small accumulation) leave no room for, but a point's own
    cuts may fit them, and one round per step uploads each slot's weights once: the Qwen3-235B
    LoRA on the 4090 preset runs 22 % faster at 2 x 64 (64) than at pass 1's best, which
    never reached pass 2."""
    out: list[_Point] = []
    for mb in sorted({p.micro_batch for _, p in scored}):
        mine = [(t, p) for t, p in scored if p.micro_batch == mb]
        tier = max(mine, key=lambda t: t[0])[1].tier
        gas = max(p.grad_accum for _, p in mine)
        rounds = [d for d in _divisors(gas) if grid.round_sizes is None or d in grid.round_sizes]
        out.append(_Point(mb, gas, max(rounds, default=1), tier))
    return out


def _distinct(points: Sequence[_Point], k: int) -> list[_Point]:
    out: list[_Point] = []
    for p in points:
        if p not in out:
            out.append(p)
        if len(out) == k:
            break
    return out


def _nothing_fits(ctx: _Ctx, micro_batch: int | None, tokens_per_step: int | None) -> str:
    s = ctx.shape
    one = mem_bytes("roundpipe", s, (micro_batch or 1) * ctx.seq_len, ctx.n)
    mem = ctx.machine.memory_bytes
    if mem and one > mem:
        longest = max_seq("roundpipe", s, ctx.machine)
        return (
            f"{s.name}: one micro-batch of {micro_batch or 1} x {ctx.seq_len} tokens needs about "
            f"{format_bytes(int(one))} on a device, {ctx.machine.name} has {format_bytes(mem)}: "
            f"use a shorter seq_len (longest that fits: {longest or 'none'}) or a smaller "
            "micro_batch"
        )
    if ctx.host_ram is not None:
        need = min(ctx.host_bytes(t, 0, fewest=True) for t in ("host", "nvme"))
        if need > ctx.host_ram:
            return (
                f"{s.name}: the host needs at least {format_bytes(need)} of RAM even with the "
                f"NVMe optimizer tier, host_ram is {format_bytes(ctx.host_ram)}: train LoRA "
                "adapters, or give more host RAM"
            )
    if tokens_per_step:
        return (
            f"{s.name}: no configuration with tokens_per_step {tokens_per_step} fits "
            f"(micro_batch {micro_batch}): try another tokens_per_step or leave it free"
        )
    return (
        f"{s.name}: no layer fits a device of {ctx.machine.name} "
        f"({format_bytes(ctx.budget or 0)} after the CUDA context): use a machine with more "
        "device memory, or LoRA"
    )
