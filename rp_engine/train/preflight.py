"""Before anything is allocated: will the run fit in host memory? And ``--plan``: what would run.

Both work on a model built on the meta device (shapes only), so they cost no memory.

Host bytes (RoundPipe keeps all model state on the host, see model/host_store.py):
  every parameter      compute weight (2 B bf16/fp16, 4 B fp32)
  trainable parameter  + fp32 master (4) + fp32 gradient (4) + Adam m, v (8)
  activations          one hidden state per decoder layer per micro-batch of a step (stage
                       boundaries are a subset; this is the upper bound)
  CPU virtual devices  their "device memory" is host memory too: two stage copies of weights
                       (double buffer) per device, a stage being layers / devices
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

# the error and the two helpers initialize's own check uses too (host_preflight.py, one layer down)
from rp_engine.host.units import format_mib_gib
from rp_engine.host_preflight import PreflightError, limit_lines, memory_for

__all__ = [
    "PreflightError",
    "HostEstimate",
    "decoder",
    "model_counts",
    "estimate_host",
    "check_host",
    "plan_preview",
]


@dataclass(frozen=True)
class Counts:
    trainable: int
    frozen: int
    num_layers: int
    hidden: int
    block_params: tuple[int, ...]  # per decoder layer
    head_params: int  # final norm + lm_head
    prefix_params: int  # embeddings


def decoder(model: nn.Module) -> Any:
    """PeftModelForCausalLM -> the HF causal LM inside; an HF model as is."""
    from rp_engine.model.layers import _unwrap_peft

    return _unwrap_peft(model)


def model_counts(model: nn.Module) -> Counts:
    """Parameter counts of an HF causal LM (peft-wrapped or not), meta tensors allowed."""
    params = {id(p): p for p in model.parameters()}.values()
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    lm = decoder(model)
    base = getattr(lm, "model", None)
    layers = list(getattr(base, "layers", []) or [])
    blocks = tuple(sum(p.numel() for p in layer.parameters()) for layer in layers)
    head = sum(p.numel() for p in lm.lm_head.parameters()) + sum(
        p.numel() for p in base.norm.parameters()
    ) if base is not None and hasattr(lm, "lm_head") else 0  # fmt: skip
    prefix = sum(p.numel() for p in base.embed_tokens.parameters()) if base is not None else 0
    hidden = int(getattr(getattr(lm, "config", None), "hidden_size", 0) or 0)
    return Counts(trainable, frozen, len(layers), hidden, blocks, head, prefix)


@dataclass(frozen=True)
class HostEstimate:
    weights: int
    optimizer_state: int  # masters + gradients + Adam moments
    activations: int
    device_copies: int

    @property
    def total(self) -> int:
        return self.weights + self.optimizer_state + self.activations + self.device_copies

    def lines(self) -> list[str]:
        return [
            f"  compute weights        {format_mib_gib(self.weights)}",
            f"  masters+grads+Adam     {format_mib_gib(self.optimizer_state)}",
            f"  activations            {format_mib_gib(self.activations)}",
            f"  CPU device copies      {format_mib_gib(self.device_copies)}",
        ]


def estimate_host(
    counts: Counts, *, dtype_bytes: int, seq_len: int, micro_batch: int, grad_accum: int,
    cpu_devices: int,
) -> HostEstimate:  # fmt: skip
    total = counts.trainable + counts.frozen
    weights = total * dtype_bytes
    state = counts.trainable * (4 + 4 + 8)
    acts = counts.num_layers * grad_accum * micro_batch * seq_len * counts.hidden * dtype_bytes
    copies = 0
    if cpu_devices:
        stage = max(counts.block_params, default=0) * math.ceil(
            max(counts.num_layers, 1) / cpu_devices
        )
        stage = max(stage, counts.head_params, counts.prefix_params)
        copies = 2 * cpu_devices * stage * dtype_bytes
    return HostEstimate(weights, state, acts, copies)


def check_host(estimate: HostEstimate, available: int | None = None, cfg: Any = None) -> int:
    """Raise PreflightError when the estimate exceeds what the limit that binds leaves (the
    cgroup's, RLIMIT_AS, ``cfg``'s roundpipe.host_memory_gb or the host's free memory:
    host_preflight.memory_for; ``available``: that figure given instead); returns the
    available bytes."""
    memory = memory_for(cfg, available=available)
    if estimate.total > memory.available:
        raise PreflightError(
            f"this run needs about {format_mib_gib(estimate.total)} of host memory but "
            f"{format_mib_gib(memory.available)} is available:\n"
            + "\n".join(estimate.lines())
            + "\n"
            + limit_lines(memory)
            + "\nto fit: train a LoRA adapter (--lora 8,16: no optimizer state for the base "
            "weights), use bf16 (the config's bf16.enabled), a shorter --seq-len, fewer "
            "micro-batches (train_micro_batch_size_per_gpu / gradient_accumulation_steps), a "
            "smaller --model, a higher memory limit (the container's, the job's or "
            "roundpipe.host_memory_gb), or --no-preflight to try anyway"
        )
    return memory.available


def check_device(
    counts: Counts, *, budget_bytes: int, dtype_bytes: int, seq_len: int, micro_batch: int,
    trainable: bool = True,
) -> int:  # fmt: skip
    """The smallest stage RoundPipe can run is one layer: its weights twice (the next stage's
    upload overlaps), its gradients, and one micro-batch's activations. Raise PreflightError
    when even that exceeds a device's budget; returns the bytes needed."""
    largest = max((*counts.block_params, counts.head_params, counts.prefix_params), default=0)
    weights = 2 * largest * dtype_bytes
    grads = largest * dtype_bytes if trainable else 0
    # hidden states of a layer's forward (attention + MLP intermediates ~ 16 x hidden)
    acts = 16 * micro_batch * seq_len * max(counts.hidden, 1) * dtype_bytes
    needed = weights + grads + acts
    if needed > budget_bytes:
        raise PreflightError(
            f"the largest layer needs about {format_mib_gib(needed)} on a device (weights double-buffered "
            f"{format_mib_gib(weights)}, gradients {format_mib_gib(grads)}, activations {format_mib_gib(acts)}) but a device has "
            f"{format_mib_gib(budget_bytes)}:\nto fit: a shorter --seq-len, a smaller "
            "train_micro_batch_size_per_gpu, bf16 (the config's bf16.enabled), or devices with "
            "more memory (roundpipe.device_memory_gb)"
        )
    return needed


def plan_preview(
    counts: Counts, *, machine_name: str, num_devices: int | None, hf_config: dict[str, Any],
    name: str, seq_len: int | None, micro_batch: int | None, grad_accum: int | None,
    lora_rank: int | None = None, async_optimizer: bool = True, clipping: bool = True,
) -> tuple[dict[str, Any], Any]:  # fmt: skip
    """The configuration advisor (rp_engine/plan/advise.py) for this model on a machine preset:
    the model's shape from its Hugging Face config, ``seq_len`` / ``micro_batch`` /
    ``grad_accum`` kept when given (None: searched; the sequence length then defaults to the
    published measurement's 2,048), cuts, round size and optimizer tier searched, each finalist
    simulated. Returns (summary dict of the best, with every row under "advice"; the list of
    Advice: ``[0].sim`` is the best's SimResult for the Gantt, ``[0].ds_config()`` its config).
    Raises PreflightError when nothing fits, naming what and the fix."""
    import dataclasses

    from rp_engine.plan.advise import AdviceError, advise
    from rp_engine.plan.shapes import Shape
    from rp_engine.plan.simulate import load_machine

    machine = load_machine(machine_name)
    if num_devices:
        machine = dataclasses.replace(machine, num_devices=num_devices)
    shape = Shape.from_hf_config(hf_config, name=name)
    if counts.frozen and lora_rank:  # LoRA: only the adapters train
        shape = dataclasses.replace(shape, lora=True, lora_rank=lora_rank)
    try:
        found = advise(
            shape, machine, seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum,
            async_optimizer=async_optimizer, clipping=clipping, top=3,
        )  # fmt: skip
    except AdviceError as e:
        raise PreflightError(f"--plan: {e}") from e
    best = found[0]
    summary = {
        "machine": machine.name,
        "devices": best.num_devices,
        "seq_len": best.seq_len,
        "micro_batch": best.micro_batch,
        "fwd_cuts": list(best.fwd_cuts),
        "bwd_cuts": list(best.bwd_cuts),
        "micro_batches_per_step": best.grad_accum,
        "round_size": best.round_size,
        "tier": best.tier,
        "device_peak_bytes": list(best.sim.peak_memory_bytes) if best.sim else [],
        "device_budget_bytes": machine.memory_bytes,
        "iteration_ms": best.iteration_ms,
        "tokens_per_s": best.tokens_per_s,
        "bubble_ratio": best.bubble,
        "binds": best.binds,
        "why": best.why(),
        "advice": [a.to_json() for a in found],
        "assumptions": "per-layer costs scaled by FLOPs from the published Qwen3-1.7B layer on "
        "an RTX 4090 (rp_engine/plan/shapes.py); simulator transfers and CPU Adam",
    }
    return summary, found


def format_plan(
    summary: dict[str, Any], host: HostEstimate, available: int, found: Sequence[Any] = ()
) -> str:
    """The advisor's table, then the best configuration, what binds it and why, and this
    host's memory for the run as configured."""
    from rp_engine.plan.advise import format_table

    peaks = ", ".join(format_mib_gib(b) for b in summary["device_peak_bytes"])
    budget = summary["device_budget_bytes"]
    return "\n".join(
        [
            *([format_table(found), ""] if found else []),
            f"plan on {summary['machine']} ({summary['devices']} devices): the best above",
            f"  forward cuts  {summary['fwd_cuts']}",
            f"  backward cuts {summary['bwd_cuts']} (head stage first)",
            f"  micro-batch {summary['micro_batch']} x {summary['seq_len']} tokens, "
            f"micro-batches per step {summary['micro_batches_per_step']}, round size "
            f"{summary['round_size']}, optimizer state on the {summary['tier']}",
            f"  device memory peak per device: {peaks}"
            + (f" (budget {format_mib_gib(budget)})" if budget else ""),
            f"  predicted {summary['tokens_per_s']:.0f} tokens/s, iteration "
            f"{summary['iteration_ms']:.1f} ms, bubble {100 * summary['bubble_ratio']:.1f} %",
            f"  {summary['why']}",
            f"  ({summary['assumptions']})",
            f"host memory (this host, the run as configured): {format_mib_gib(host.total)} "
            f"needed, {format_mib_gib(available)} available",
            *host.lines(),
        ]
    )
