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
says where they go.

Not counted: activations and the CPU virtual devices' stage copies (host memory too), which
depend on the plan; so passing the preflight is necessary, not sufficient.
``roundpipe.host_preflight: false`` skips the check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["PreflightError", "HostNeed", "host_need", "check_initialize", "available_bytes"]


class PreflightError(RuntimeError):
    """The run cannot fit; the message has the needed and available bytes and what to change."""


def format_bytes(n: float) -> str:
    """``n`` bytes as GiB (from 1 GiB on) or MiB, for preflight messages."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def available_bytes() -> int:
    """Host memory the OS can give without swapping (psutil's ``available``)."""
    import psutil

    return int(psutil.virtual_memory().available)


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
        lines = [f"  {name:<32}{format_bytes(n)}" for name, n in parts if n]
        if self.on_nvme:
            lines.append(
                f"  (on NVMe, not in RAM: fp32 masters + Adam moments, {format_bytes(self.on_nvme)})"
            )
        if self.weights_on_nvme:
            lines.append(
                "  (leaving RAM for NVMe after initialize: compute weights, "
                f"{format_bytes(self.weights_on_nvme)})"
            )
        return lines


def host_need(
    model: nn.Module, *, dtype: torch.dtype, journal: str, nvme_optimizer: bool = False,
    nvme_params: bool = False,
) -> HostNeed:  # fmt: skip
    """What the engine will allocate in RAM for ``model`` trained in ``dtype`` (see the module
    doc); ``nvme_optimizer``: masters and moments live on NVMe instead; ``nvme_params``: the
    compute weights move to NVMe (reported, not subtracted: they exist during ``initialize``)."""
    params = list({id(p): p for p in model.parameters()}.values())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    size = torch.empty(0, dtype=dtype).element_size()
    cast = sum(p.numel() * max(0, size - p.element_size()) for p in params if p.is_floating_point())
    in_ram = 0 if nvme_optimizer else 1
    return HostNeed(
        trainable=trainable,
        cast=cast,
        masters=4 * trainable * in_ram,
        gradients=4 * trainable,
        moments=8 * trainable * in_ram,
        journal=12 * trainable if journal == "on" and in_ram else 0,
        on_nvme=12 * trainable * (1 - in_ram),
        weights_on_nvme=sum(p.numel() * size for p in params) if nvme_params else 0,
    )


def check_initialize(model: nn.Module, cfg: Any, *, available: int | None = None) -> HostNeed:
    """Raise ``PreflightError`` when ``model`` trained with ``cfg`` (a DSConfig) needs more host
    memory than is available; returns the need otherwise (also when the check is switched off
    by ``roundpipe.host_preflight: false``)."""
    from rp_engine.model.batches import compute_dtype

    rp = cfg.roundpipe
    need = host_need(
        model, dtype=compute_dtype(cfg), journal=rp.step_journal,
        nvme_optimizer=cfg.zero.offload_optimizer_device == "nvme",
        nvme_params=cfg.zero.offload_param_device == "nvme",
    )  # fmt: skip
    if not rp.host_preflight:
        return need
    free = available_bytes() if available is None else available
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
        fixes.append("a host with more memory, or roundpipe.host_preflight false to try anyway")
        raise PreflightError(
            f"rp_engine.initialize: training this model needs about {format_bytes(need.total)} more host "
            f"memory ({need.trainable:,} trainable parameters) but {format_bytes(free)} is available, so "
            "the run would be killed by the OOM killer:\n"
            + "\n".join(need.lines())
            + "\nto fit: "
            + "; ".join(fixes)
        )
    return need
