"""``initialize``'s host-memory preflight: refuse a run that would run out of host memory.

RoundPipe keeps every byte of model state in host memory (model/host_store.py), and most of it
is allocated after ``initialize`` returns: the fp32 masters and the gradient arena when the
engine is built, the Adam moments on the first step. A host that is too small would be killed
by the OOM killer minutes into the run, with no message. So ``initialize`` adds up what the
engine will allocate for the model it was given, before allocating any of it, and raises
``PreflightError`` naming each part, the total, the available memory and what to change.

Counted (bytes per parameter; the model's own weights already exist and are not counted again):

  cast to the compute dtype  growth only: an fp16/bf16 model cast to fp32 takes 2 more bytes
  trainable                  fp32 master (4) + fp32 gradient (4) + Adam moments (8)
  step journal               12 more per trainable parameter when ``roundpipe.step_journal``
                             is "on" ("if_memory_allows" takes it only then, as the second
                             gradient arena: neither is counted then)

With the NVMe optimizer tier (``offload_optimizer.device: "nvme"``) the masters and moments
(12 B per trainable parameter) live on NVMe, not in RAM: they are not counted here (the tier
checks its disk at ``initialize``, storage/swap_file.py) and the message says where they are.
With the parameter tier (``offload_param.device: "nvme"``) the compute weights leave RAM once
``initialize`` wrote them to NVMe: they were never counted (they exist already), and the message
says where they go. Frozen weights served from a model folder's file mapping (model/folder.py's
``served_from_files``: a LoRA base loaded from its ``save_pretrained`` folder) are clean page
cache, not anonymous memory: neither here nor in ``check_tiers`` are they counted as RAM (nor as
held by the process), and the parameter tier leaves them in their files.

Not counted: activations and the CPU virtual devices' stage copies (host memory too), which
depend on the plan; so passing the preflight is necessary, not sufficient.
``roundpipe.host_preflight: false`` skips the check.

"Available" is what the limit that binds leaves (host/memory_limit.py): the smallest of the
process's cgroup limits (v2 ``memory.max`` / ``memory.high`` up the hierarchy, v1
``memory.limit_in_bytes``) less the group's working set, ``RLIMIT_AS`` less the address space,
``roundpipe.host_memory_gb`` less the resident memory, and the host's ``MemAvailable``
(``available_bytes``, the seam tests patch). A refusal names that limit and where it comes from.
Both checks run before the engine writes anything: ``check_initialize`` first thing in
``initialize``, ``check_tiers`` before any NVMe tier creates its swap files.

With the tiers, ``check_tiers`` (called by the engine once the model is cut into layers, before
any tier allocates) predicts the run's whole host RAM from its largest layers, its pools and its
devices (plan/host_ram.py), logs it, and refuses a run whose need beyond what the process holds
already (the runtime and the user's model) exceeds the available memory, with both numbers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from rp_engine.host.defaults import OPTIMIZER_BUFFERS, PARAM_BUFFERS
from rp_engine.host.memory_limit import BUDGET_KEY, HostMemory, Limit, host_memory
from rp_engine.host.units import format_mib_gib
from rp_engine.model.folder import FileMappings, resident_file_bytes, served_from_files
from rp_engine.plan.host_ram import (
    RUNTIME_BYTES,
    HostRam,
    PoolCounts,
    default_stage,
    fit_pools,
    size_classes,
    slice_bytes,
    tier_host_ram,
)

log = logging.getLogger("rp_engine")

__all__ = [
    "TierFit",
    "PreflightError",
    "HostNeed",
    "host_need",
    "check_initialize",
    "check_tiers",
    "available_bytes",
    "memory_for",
    "limit_lines",
]


class PreflightError(RuntimeError):
    """The run cannot fit; the message has the needed and available bytes and what to change."""


def available_bytes() -> int:
    """Host memory the OS can give without swapping (psutil's ``available``), before any
    cgroup, rlimit or budget (``memory_for`` applies those)."""
    import psutil

    return int(psutil.virtual_memory().available)


def memory_for(cfg: Any = None, *, available: int | None = None) -> HostMemory:
    """The limit that binds a run of ``cfg`` (a DSConfig; None: no budget): host/memory_limit.py
    with ``roundpipe.host_memory_gb`` as the budget. ``available``: the caller's figure instead
    of every limit (tests)."""
    if available is not None:
        return HostMemory((Limit("the available memory given to the check", available, 0),))
    gb = cfg.roundpipe.host_memory_gb if cfg is not None else None
    budget = None if gb is None else int(gb * 2**30)
    return host_memory(budget_bytes=budget, host_available=available_bytes())


def limit_lines(memory: HostMemory) -> str:
    """The limit that binds, and how to change it, for a refusal."""
    lines = [f"the limit that binds: {memory.describe(format_mib_gib)}"]
    others = [lim for lim in memory.limits if lim is not memory.binding]
    if others:
        lines.append(
            "other limits: "
            + "; ".join(f"{lim.source}: {format_mib_gib(lim.available)} left" for lim in others)
        )
    source = memory.source
    if source.startswith("cgroup"):
        lines.append(
            "(a container's or job's memory limit: Docker --memory, a Kubernetes "
            "resources.limits.memory, Slurm --mem; past it the kernel kills the run without a "
            "message)"
        )
    elif source == BUDGET_KEY:
        lines.append(f"(your budget: raise {BUDGET_KEY} if the machine has more)")
    return "\n".join(lines)


@dataclass(frozen=True)
class HostNeed:
    """Host bytes ``initialize`` and the first step will allocate, by part."""

    trainable: int  # parameters
    cast: int
    masters: int
    gradients: int
    moments: int
    journal: int
    on_nvme: int = 0  # masters + moments kept on NVMe by the optimizer tier (not in RAM)
    weights_on_nvme: int = 0  # compute weights (one buffer) moved to NVMe by the parameter tier

    @property
    def total(self) -> int:
        return self.cast + self.masters + self.gradients + self.moments + self.journal

    def lines(self) -> list[str]:
        parts = [
            ("fp32 masters", self.masters),
            ("fp32 gradients", self.gradients),
            ("Adam moments (first step)", self.moments),
            ("step journal (step_journal on)", self.journal),
            ("cast to the compute dtype", self.cast),
        ]
        lines = [f"  {name:<32}{format_mib_gib(n)}" for name, n in parts if n]
        if self.on_nvme:
            lines.append(
                f"  (on NVMe, not in RAM: fp32 masters + Adam moments, {format_mib_gib(self.on_nvme)})"
            )
        if self.weights_on_nvme:
            lines.append(
                "  (leaving RAM for NVMe after initialize: compute weights, "
                f"{format_mib_gib(self.weights_on_nvme)})"
            )
        return lines


def host_need(
    model: nn.Module, *, dtype: torch.dtype, journal: str, nvme_optimizer: bool = False,
    nvme_params: bool = False, pooled_grads: bool = False,
) -> HostNeed:  # fmt: skip
    """What the engine will allocate in RAM for ``model`` trained in ``dtype`` (see the module
    doc); ``nvme_optimizer``: masters and moments live on NVMe instead; ``nvme_params``: the
    compute weights move to NVMe (reported, not subtracted: they exist during ``initialize``);
    ``pooled_grads``: the fp32 gradients live in the gradient tier's bounded pool (counted by
    ``check_tiers`` with the other pools), not in a whole-model arena."""
    params = list({id(p): p for p in model.parameters()}.values())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    in_files = served_from_files(params) if nvme_params else set()  # stay in their files
    size = torch.empty(0, dtype=dtype).element_size()
    cast = sum(p.numel() * max(0, size - p.element_size()) for p in params if p.is_floating_point())
    in_ram = 0 if nvme_optimizer else 1
    return HostNeed(
        trainable=trainable,
        cast=cast,
        masters=4 * trainable * in_ram,
        gradients=0 if pooled_grads else 4 * trainable,
        moments=8 * trainable * in_ram,
        journal=12 * trainable if journal == "on" and in_ram else 0,
        on_nvme=12 * trainable * (1 - in_ram),
        weights_on_nvme=(
            sum(p.numel() * size for p in params if id(p) not in in_files) if nvme_params else 0
        ),
    )


def check_initialize(model: nn.Module, cfg: Any, *, available: int | None = None) -> HostNeed:
    """Raise ``PreflightError`` when ``model`` trained with ``cfg`` (a DSConfig) needs more host
    memory than is available; returns the need otherwise (also when the check is switched off
    by ``roundpipe.host_preflight: false``)."""
    from rp_engine.model.batches import compute_dtype

    rp = cfg.roundpipe
    nvme = cfg.zero.offload_optimizer_device == "nvme"
    need = host_need(
        model, dtype=compute_dtype(cfg), journal=rp.step_journal, nvme_optimizer=nvme,
        nvme_params=cfg.zero.offload_param_device == "nvme",
        pooled_grads=nvme and rp.grad_buffers != 0,
    )  # fmt: skip
    if not rp.host_preflight:
        return need
    memory = memory_for(cfg, available=available)
    free = memory.available
    if need.total > free:
        fixes = [
            "train a LoRA adapter (peft: only the adapters get masters, gradients and moments)",
            "freeze part of the model (requires_grad=False)",
        ]
        if not need.on_nvme:
            fixes.insert(0, 'zero_optimization.offload_optimizer {"device": "nvme", "nvme_path": '
                            '...}: fp32 masters and Adam moments on NVMe, not in RAM')  # fmt: skip
        if need.journal:
            fixes.append('roundpipe.step_journal "if_memory_allows" or "off" (a failed step is then undone '
                         "only if memory allows)")  # fmt: skip
        if need.cast:
            fixes.append("bf16.enabled (the model is cast to a wider dtype)")
        fixes.append(
            "a higher memory limit (the container's, the job's or roundpipe.host_memory_gb), a "
            "host with more memory, or roundpipe.host_preflight false to try anyway"
        )
        raise PreflightError(
            f"rp_engine.initialize: training this model needs about {format_mib_gib(need.total)} more host "
            f"memory ({need.trainable:,} trainable parameters) but {format_mib_gib(free)} is available, so "
            "the run would be killed by the OOM killer:\n"
            + "\n".join(need.lines())
            + "\n"
            + limit_lines(memory)
            + "\nto fit: "
            + "; ".join(fixes)
        )
    return need


def _wanted_counts(cfg: Any, grad_buffers: int) -> PoolCounts:
    """The pools' buffers ``cfg`` asks for (its buffer counts, DeepSpeed's defaults)."""
    zero = cfg.zero
    return PoolCounts(
        optimizer=(
            zero.offload_optimizer.buffer_count if zero.offload_optimizer else OPTIMIZER_BUFFERS
        ),
        grad=grad_buffers,
        param=zero.offload_param.buffer_count if zero.offload_param else PARAM_BUFFERS,
        optimizer_slice=slice_bytes(cfg.roundpipe.optimizer_slice_mb),
    )


def can_slice(cfg: Any) -> bool:
    """Whether the optimizer tier may slice layers below their size (delay compensation,
    ``staleness_compensation`` "lookahead_dc", needs each tensor whole)."""
    return bool(cfg.zero.offload_optimizer_device == "nvme") and (
        cfg.roundpipe.staleness_compensation != "lookahead_dc"
    )


def _need_of(
    store: Any, cfg: Any, *, devices: int, weight_copies: int, device_bytes: int,
    cpu_devices: bool,
) -> Callable[[PoolCounts], HostRam]:  # fmt: skip
    """counts -> the run's host RAM: the store's layers read once, the pools left to vary."""
    from rp_engine.model.batches import compute_dtype

    users = store.param_users()
    own = [sum(p.numel() for _, p in layer.params if users[id(p)] == 1) for layer in store.layers]
    params = {id(p): p for layer in store.layers for _, p in layer.params}
    shared = sum(p.numel() for key, p in params.items() if users[key] > 1)
    # frozen weights served from their files: page cache, not RAM the run holds or needs
    maps = FileMappings.read()
    in_files = served_from_files(params.values(), maps)
    own_files = [
        sum(p.numel() for _, p in layer.params if users[id(p)] == 1 and id(p) in in_files)
        for layer in store.layers
    ]
    shared_files = sum(params[key].numel() for key in in_files if users[key] > 1)
    zero = cfg.zero
    # what the process holds now besides the model's weights (each storage once): the runtime.
    # Weights in a folder's file mapping (model/folder.py) are page cache the kernel evicts
    # under pressure, not memory the run holds: neither the model's nor the runtime's (RSS
    # holds their touched pages only, subtracted as such)
    storages, files = {}, set()
    for p in params.values():
        path = maps.path_of(p)
        if path is None:
            storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
        else:
            files.add(path)
    anon_model = sum(storages.values())
    runtime = max(RUNTIME_BYTES, process_rss() - anon_model - resident_file_bytes(files))
    layer_params = [n + (shared if i == 0 else 0) for i, n in enumerate(own)]
    layer_files = [n + (shared_files if i == 0 else 0) for i, n in enumerate(own_files)]
    layer_tensors = [[hp.master.numel() for hp in layer.owned] for layer in store.layers]
    layer_trainable = [sum(sizes) for sizes in layer_tensors]
    dtype_bytes = torch.empty(0, dtype=compute_dtype(cfg)).element_size()

    def need(counts: PoolCounts) -> HostRam:
        return tier_host_ram(
            layer_params=layer_params,
            layer_trainable=layer_trainable,
            dtype_bytes=dtype_bytes,
            devices=devices,
            optimizer_tier=zero.offload_optimizer_device == "nvme",
            param_tier=zero.offload_param_device == "nvme",
            grad_buffers=counts.grad,
            optimizer_buffers=counts.optimizer,
            optimizer_slice=counts.optimizer_slice,
            layer_tensors=layer_tensors,
            param_buffers=counts.param,
            weight_copies=weight_copies,
            shared_params=shared - shared_files,
            device_bytes=device_bytes,
            cpu_devices=cpu_devices,
            runtime_bytes=runtime,
            model_bytes=anon_model,
            layer_files=layer_files,
            stage_bytes=counts.stage,
        )

    return need


def process_rss() -> int:
    """This process's resident memory."""
    import psutil

    return int(psutil.Process().memory_info().rss)


@dataclass(frozen=True)
class _Stages:
    default: int  # the weight bytes of a stage the model assumes unbounded (``default_stage``)
    one_layer: int  # the least a stage can be held to: the largest ordinary layer's weights


def _stages(store: Any, cfg: Any, device_bytes: int) -> _Stages:
    from rp_engine.model.batches import compute_dtype

    dtype_bytes = torch.empty(0, dtype=compute_dtype(cfg)).element_size()
    layer_params = [sum(p.numel() for _, p in layer.params) for layer in store.layers]
    one = size_classes(layer_params).ordinary * dtype_bytes
    return _Stages(default_stage(layer_params, dtype_bytes, device_bytes), one)


@dataclass(frozen=True)
class TierFit:
    """What ``check_tiers`` found: the pools the run gets (``counts``, the config's or fewer
    to fit the limit that binds), their predicted host RAM (``need``) and the least host RAM
    the run can work with, every pool at its fewest buffers (``least``)."""

    counts: PoolCounts
    need: HostRam
    least: HostRam


def check_tiers(
    store: Any, cfg: Any, *, devices: int, grad_buffers: int, weight_copies: int,
    device_bytes: int = 0, cpu_devices: bool = False, available: int | None = None,
) -> TierFit:  # fmt: skip
    """With a tier on NVMe: fit the pools to the limit that binds (``fit_pools``: fewer
    buffers, a warning saying so), log the run's predicted host RAM, and raise
    ``PreflightError`` when even the fewest buffers need more beyond the runtime and the model
    (which exist already) than the limit leaves (unless ``roundpipe.host_preflight`` is
    false: then the config's pools, unchecked)."""
    need_of = _need_of(
        store, cfg, devices=devices, weight_copies=weight_copies, device_bytes=device_bytes,
        cpu_devices=cpu_devices,
    )  # fmt: skip
    wanted = _wanted_counts(cfg, grad_buffers)
    slicing = can_slice(cfg)
    fewest = PoolCounts.fewest(devices, grad_tier=grad_buffers > 0, slicing=slicing)
    if wanted.optimizer_slice:  # asked for: never larger than that
        fewest = replace(
            fewest,
            optimizer_slice=min(
                wanted.optimizer_slice, fewest.optimizer_slice or wanted.optimizer_slice
            ),
        )
    stages = _stages(store, cfg, device_bytes)
    fewest = replace(fewest, stage=stages.one_layer)
    least = need_of(fewest)
    if not cfg.roundpipe.host_preflight:
        need = need_of(wanted)
        log.info("host RAM with the NVMe tiers (predicted):\n%s", "\n".join(need.lines()))
        return TierFit(wanted, need, least)
    memory = memory_for(cfg, available=available)
    free = memory.available
    held = least.runtime + least.model
    largest = 12 * max(
        (sum(hp.master.numel() for hp in layer.owned) for layer in store.layers), default=0
    )
    counts, need = fit_pools(
        held + free, wanted, fewest, need_of, largest_record=largest, stage=stages.default
    )
    if counts != wanted:
        log.warning(
            "host RAM: the NVMe pools shrink to fit %s: %s (fewer reads ahead and more waits "
            "for write-backs: speed, never results)",
            memory.describe(format_mib_gib),
            ", ".join(
                [
                    f"{name} {getattr(wanted, name)} -> {getattr(counts, name)} buffers"
                    for name in ("optimizer", "grad", "param")
                    if getattr(wanted, name) != getattr(counts, name)
                ]
                + (
                    [f"optimizer state in slices of {format_mib_gib(counts.optimizer_slice)}"]
                    if counts.optimizer_slice != wanted.optimizer_slice
                    else []
                )
                + (
                    [f"stages of at most {format_mib_gib(counts.stage)} of weights"]
                    if counts.stage != wanted.stage
                    else []
                )
            ),
        )
    log.info("host RAM with the NVMe tiers (predicted):\n%s", "\n".join(need.lines()))
    more = need.peak - held
    if more > free:
        raise PreflightError(
            f"rp_engine.initialize: with the NVMe tiers this run needs about "
            f"{format_mib_gib(need.peak)} of host RAM, {format_mib_gib(held)} of it in use already "
            f"(the runtime and your model): {format_mib_gib(more)} more, but "
            f"{format_mib_gib(free)} is available, with every pool at its fewest buffers (the "
            f"least this run can work with: {format_mib_gib(least.peak)}):\n"
            + "\n".join(need.lines())
            + "\n"
            + limit_lines(memory)
            + "\nto fit: "
            + (
                ""
                if cfg.zero.offload_param_device == "nvme"
                else 'offload_param {"device": "nvme"} for the compute weights, '
            )
            + "fewer or smaller CPU devices "
            "(roundpipe.devices, roundpipe.device_memory_gb), a LoRA adapter (peft), a higher "
            "memory limit (the container's, the job's or roundpipe.host_memory_gb), a host with "
            "more memory, or roundpipe.host_preflight false to try anyway"
        )
    return TierFit(counts, need, least)
