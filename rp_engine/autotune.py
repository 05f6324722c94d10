"""DeepSpeed's ``"autotuning"`` block, answered by the advisor instead of experiments.

DeepSpeed answers ``"autotuning": {"enabled": true, ...}`` by launching many short training runs
(micro-batch sizes x ZeRO stages) and keeping the fastest. rp_engine knows its schedule, so it
answers in two moves, in seconds:

1. **At initialize** (``advise_batch``): the advisor (``rp_engine.plan.advise``) searches
   micro-batch size and gradient accumulation (with round size, cuts and the optimizer tier)
   for the model's shape (its Hugging Face config) on the machine: ``roundpipe.machine`` (a
   preset or JSON), else the devices in use (``machine_for``). Its best fills the ``"auto"``
   values of ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps`` and
   ``train_batch_size`` (Hugging Face style); values the config sets are kept (they are fixed
   choices of the search). The sequence length is the run's, so it is asked for:
   ``roundpipe.seq_len``. The advisor's table is logged.
2. **After the first steps** (``ProfileCheck``): the planner's profile iterations measure every
   layer. Their compute per micro-batch is compared with the advisor's cost model; when they
   disagree by more than ``roundpipe.autotune_tolerance`` (default 25 %: the calibration error
   measured against CPU virtual devices was -13 % to +15 %, benchmarks/RESULTS.md), the planner
   re-plans round size and cuts on the measured costs (``Planner.replan_rounds``) and both
   figures are logged. The batch sizes stay: the data loader already serves them.

DeepSpeed's other autotuning keys (tuner type, trials, results and experiment folders, ...) drive
its experiments and have no meaning here: they are listed once in the log. ``metric`` must be
``"throughput"`` (rp_engine optimises tokens per second), and only when enabled.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from rp_engine.config.errors import ConfigError

log = logging.getLogger("rp_engine.autotune")

__all__ = ["AutotuneSettings", "ProfileCheck", "advise_batch", "cpu_adam_rate", "machine_for"]

# bf16 dense TFLOPS with fp32 accumulation by GPU name (public spec sheets); compute times of
# the advisor's model are the RTX 4090's scaled by 165 / this
_GPU_TFLOPS = {
    "4090": 165.0,
    "4080": 97.0,
    "3090": 71.0,
    "a6000": 155.0,
    "l40s": 362.0,
    "l40": 181.0,
    "a100": 312.0,
    "a800": 312.0,
    "h100": 990.0,
    "h800": 990.0,
    "h200": 990.0,
    "h20": 148.0,
}
_REF_TFLOPS = 165.0  # the RTX 4090 preset's
_BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


@dataclass(frozen=True)
class AutotuneSettings:
    """What the config asks of autotuning (``from_raw``)."""

    seq_len: int | None
    machine: str | None
    tolerance: float
    ignored: tuple[str, ...]

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any]) -> AutotuneSettings | None:
        """The settings of an enabled ``autotuning`` block, None when it is absent or off.
        Raises ConfigError naming the key for a non-boolean ``enabled`` or a metric other
        than throughput."""
        block = raw.get("autotuning")
        if block is None:
            return None
        if not isinstance(block, Mapping):
            raise ConfigError(
                f"autotuning = {block!r}: expected an object like {{'enabled': true}}"
            )
        enabled = block.get("enabled", False)
        if not isinstance(enabled, bool):
            raise ConfigError(f"autotuning.enabled = {enabled!r}: expected true or false")
        if not enabled:
            return None
        metric = block.get("metric", "throughput")
        if metric != "throughput":
            raise ConfigError(
                f"autotuning.metric = {metric!r}: rp_engine tunes for throughput (tokens per "
                "second); remove the key or set it to 'throughput'"
            )
        rp = raw.get("roundpipe") or {}
        tolerance = rp.get("autotune_tolerance", 0.25)
        return cls(
            seq_len=rp.get("seq_len"),
            machine=rp.get("machine"),
            tolerance=float(tolerance) if isinstance(tolerance, int | float) else 0.25,
            ignored=tuple(sorted(k for k in block if k not in ("enabled", "metric"))),
        )


@functools.lru_cache(maxsize=8)  # initialize and the engine's profile check ask for the same one
def machine_for(
    devices: str | None,
    *,
    preset: str | None = None,
    pcie_gbps: float | None = None,
    memory_gb: float | None = None,
) -> Any:
    """The advisor's ``Machine`` for ``roundpipe.devices``: ``preset`` (a preset name or JSON
    path) with the device count in use, else the visible GPUs (the RTX 4090 preset's links and
    host, their memory, compute scaled by their bf16 TFLOPS), else CPU virtual devices (compute
    scaled by a matmul timed here, shared by the devices; the emulated link; host Adam at the
    rate DeepSpeed's CPU Adam steps here, timed). Cached per arguments: the CPU timings run
    once per process."""
    import torch

    from rp_engine.device import parse_device_spec
    from rp_engine.plan.shapes import effective_flops_per_ms
    from rp_engine.plan.simulate import Machine, load_machine

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    kind, indices = parse_device_spec(
        devices or ("cuda" if num_gpus else "cpu:2"), num_gpus=num_gpus
    )
    n = len(indices)
    memory = int(memory_gb * 2**30) if memory_gb else None
    if preset:
        base = load_machine(preset)
        return replace(base, num_devices=n, memory_bytes=memory or base.memory_bytes)
    base = load_machine("rtx4090_pcie4_8x")
    if kind == "cuda":
        props = torch.cuda.get_device_properties(indices[0])
        name = props.name.lower()
        tflops = next((v for k, v in _GPU_TFLOPS.items() if k in name), None)
        if tflops is None:
            log.warning("autotuning: %s is not in the GPU table; planning it as an RTX 4090 "
                        "(set roundpipe.machine for a better model)", props.name)  # fmt: skip
            tflops = _REF_TFLOPS
        return replace(
            base, name=f"{n}x {props.name}", num_devices=n,
            memory_bytes=memory or int(props.total_memory), compute_scale=_REF_TFLOPS / tflops,
            device_order=None,
        )  # fmt: skip
    flops_per_ms = _matmul_flops_per_ms() / n  # the devices share this machine's cores
    gbps = pcie_gbps or 1e3
    return Machine(
        name=f"{n} CPU virtual devices", num_devices=n, h2d_gbps=gbps, d2h_gbps=gbps,
        host_link_gbps=None, memory_bytes=memory, cpu_adam_params_per_s=cpu_adam_rate(),
        bytes_per_param=4.0, compute_scale=effective_flops_per_ms() / flops_per_ms,
        host_cores=float(os.cpu_count() or 1),  # the devices and the optimizer share them
    )  # fmt: skip


def cpu_adam_rate(num_params: int = 1 << 20, reps: int = 3) -> float:
    """Parameters per second of DeepSpeed's CPU Adam (the kernel the engine steps with) on
    ``num_params`` fp32 parameters: the median of ``reps`` steps after one warm-up step."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from rp_engine.host.jit_cache import cpu_adam_cache_dir, extensions_dir, op_load_guard

    p = torch.nn.Parameter(torch.zeros(max(num_params, 1)))
    p.grad = torch.full_like(p, 1e-3)
    cache = cpu_adam_cache_dir()
    with extensions_dir(cache), op_load_guard("cpu_adam", cache):  # the engine's build
        opt = DeepSpeedCPUAdam([p], lr=1e-4)
    opt.step()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    times.sort()
    return p.numel() / max(times[len(times) // 2], 1e-9)


def _matmul_flops_per_ms(size: int = 512, reps: int = 5) -> float:
    """This machine's fp32 matmul rate, FLOPs per ms (median of ``reps``)."""
    import torch

    a = torch.randn(size, size)
    b = torch.randn(size, size)
    a @ b  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    times.sort()
    return 2 * size**3 / max(times[len(times) // 2] * 1e3, 1e-9)


def model_shape(model: Any) -> Any:
    """The advisor's ``Shape`` of a Hugging Face model (its ``config``), LoRA from a peft
    wrapper; None for a model without one."""
    from rp_engine.plan.shapes import Shape

    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        return None
    try:
        shape = Shape.from_hf_config(to_dict())
    except (KeyError, TypeError, ValueError) as e:
        log.info("autotuning: no decoder shape in the model's config (%s)", e)
        return None
    peft = getattr(model, "peft_config", None)
    if isinstance(peft, Mapping) and peft:
        rank = getattr(next(iter(peft.values())), "r", None)
        shape = replace(shape, lora=True, lora_rank=int(rank or shape.lora_rank))
    return shape


def advise_batch(raw: Mapping[str, Any], model: Any, world_size: int) -> dict[str, Any]:
    """Values for the config's ``"auto"`` batch sizes from the advisor (the module docstring,
    move 1); {} when autotuning is off or nothing is "auto" and there is nothing to advise.
    Raises ConfigError when an "auto" batch size cannot be filled: no ``roundpipe.seq_len``,
    or no Hugging Face config to size the model by."""
    settings = AutotuneSettings.from_raw(raw)
    if settings is None:
        return {}
    if settings.ignored:
        log.info("autotuning: answered by rp_engine's advisor, not experiments; these keys "
                 "only drive DeepSpeed's experiments and are ignored: %s",
                 ", ".join(settings.ignored))  # fmt: skip
    autos = [k for k in _BATCH_KEYS if raw.get(k) == "auto"]
    if settings.seq_len is None:
        if autos:
            raise ConfigError(
                f"autotuning fills {', '.join(autos)} from the advisor, which needs the "
                "sequence length the run trains with: set roundpipe.seq_len (tokens per "
                "sequence), or give the batch sizes"
            )
        log.info("autotuning: roundpipe.seq_len not set, so no batch-size advice; the first "
                 "steps' profile is still checked")  # fmt: skip
        return {}
    shape = model_shape(model)
    if shape is None:
        if autos:
            raise ConfigError(
                f"autotuning fills {', '.join(autos)} from the model's Hugging Face config, "
                "which this model does not have; give the batch sizes"
            )
        return {}
    from rp_engine.plan.advise import AdviceError, advise, format_table

    rp = raw.get("roundpipe") or {}
    machine = machine_for(
        rp.get("devices"), preset=settings.machine, pcie_gbps=rp.get("pcie_gbps"),
        memory_gb=rp.get("device_memory_gb"),
    )  # fmt: skip
    fixed = {k: raw[k] for k in _BATCH_KEYS if isinstance(raw.get(k), int)}
    tbs = fixed.get("train_batch_size")
    try:
        table = advise(
            shape, machine, seq_len=settings.seq_len,
            micro_batch=fixed.get("train_micro_batch_size_per_gpu"),
            grad_accum=fixed.get("gradient_accumulation_steps"),
            tokens_per_step=tbs // world_size * settings.seq_len if tbs else None,
            async_optimizer=rp.get("async_optimizer", True) is not False,
            clipping=bool(raw.get("gradient_clipping", 1.0)), top=3,
        )  # fmt: skip
    except AdviceError as e:
        raise ConfigError(f"autotuning: {e}") from None
    best = table[0]
    log.info("autotuning on %s (%d tokens per sequence):\n%s", machine.name, settings.seq_len,
             format_table(table))  # fmt: skip
    values = {
        "train_micro_batch_size_per_gpu": best.micro_batch,
        "gradient_accumulation_steps": best.grad_accum,
        "train_batch_size": best.micro_batch * best.grad_accum * world_size,
    }
    return {k: v for k, v in values.items() if k in autos}


@dataclass
class ProfileCheck:
    """Move 2 of the module docstring: the first steps' measured compute against the
    advisor's cost model (``predicted``: LayerCosts per micro-batch of the run's size)."""

    predicted: Any  # LayerCosts
    tolerance: float
    done: bool = False

    @classmethod
    def for_engine(
        cls, raw: Mapping[str, Any], model: Any, micro_batch: int
    ) -> ProfileCheck | None:
        """The check for an engine whose config enables autotuning (None otherwise, or when
        the advisor has no cost model of the model: no Hugging Face config or seq_len)."""
        settings = AutotuneSettings.from_raw(raw)
        if settings is None or settings.seq_len is None:
            return None
        shape = model_shape(model)
        if shape is None:
            return None
        from rp_engine.plan.shapes import layer_costs

        rp = raw.get("roundpipe") or {}
        machine = machine_for(
            rp.get("devices"), preset=settings.machine, pcie_gbps=rp.get("pcie_gbps"),
            memory_gb=rp.get("device_memory_gb"),
        )  # fmt: skip
        costs = layer_costs(shape, machine, micro_batch=micro_batch, seq_len=settings.seq_len)
        return cls(predicted=costs, tolerance=settings.tolerance)

    def check(self, planner: Any) -> bool:
        """Once, after the planner's profile: compare, log, and re-plan on a disagreement
        beyond the tolerance. True when the plan changed."""
        if self.done or planner.profile_left > 0:
            return False
        self.done = True
        measured = planner.measured_costs()
        if measured is None:
            return False
        want, got = _compute_ms(self.predicted), _compute_ms(measured)
        ratio = got / want if want > 0 else float("inf")
        figures = (f"measured {got:.4g} ms of compute per micro-batch, the advisor's model "
                   f"{want:.4g} ms ({ratio:.2f}x; tolerance {self.tolerance:.0%})")  # fmt: skip
        if abs(ratio - 1) <= self.tolerance:
            log.info("autotuning: the profile agrees with the advice: %s", figures)
            return False
        plan = (planner.round_size, tuple(planner.fwd_cuts), tuple(planner.bwd_cuts))
        before, after = planner.replan_rounds(measured)
        changed = plan != (planner.round_size, tuple(planner.fwd_cuts), tuple(planner.bwd_cuts))
        log.warning(
            "autotuning: the profile disagrees with the advice: %s; re-planned on the measured "
            "costs: %s (round size %d, cuts %s / %s: est. %.4g ms per step; the plan in use: "
            "%.4g ms)",
            figures, "a new plan" if changed else "the plan in use stays", planner.round_size,
            list(planner.fwd_cuts), list(planner.bwd_cuts), after, before,
        )  # fmt: skip
        return changed


def _compute_ms(costs: Any) -> float:
    """Forward, recompute and backward of every layer and the head, one micro-batch."""
    return (
        sum(costs.fwd_ms) + sum(costs.recompute_ms) + sum(costs.bwd_ms)
        + costs.head_fwd_ms + costs.head_bwd_ms
    )  # fmt: skip
