"""What the configuration advisor (advise.py) answers: ``Advice``, one recommended
configuration with what the simulator predicts for it and the DeepSpeed-style config that runs
it (``Advice.ds_config``); ``Grid``, the candidates a search may visit; ``AdviceError``; and
``format_table``, the markdown table ``python -m rp_engine.plan advise`` and ``rp-train
--plan`` print. Apart from the search so that a reader of the answer, or of the printing, does
not walk through the search's passes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rp_engine.host.defaults import OPTIMIZER_BUFFERS

from .actions import format_bytes
from .simulate import SimResult

__all__ = ["Advice", "AdviceError", "Grid", "NVME_BUFFERS", "format_table"]

NVME_BUFFERS = OPTIMIZER_BUFFERS  # offload_optimizer.buffer_count


class AdviceError(ValueError):
    """Nothing fits (a layer, a micro-batch, the host state) or a fixed choice is impossible;
    the message names the input and the fix."""


@dataclass(frozen=True)
class Grid:
    """The candidates the search may visit (None: the default rules of the module docstring).
    The tests and benchmarks/studies/advise_grid.py pass a reduced grid to compare with exhaustion."""

    micro_batches: tuple[int, ...] | None = None
    grad_accums: tuple[int, ...] | None = None
    round_sizes: tuple[int, ...] | None = None  # only these (each must divide the accumulation)
    prune: bool = True  # stop growing micro-batch and accumulation when they stop gaining


@dataclass(frozen=True)
class Advice:
    """One recommended configuration and what the simulator predicts for it (per step: one
    optimizer step of ``grad_accum`` micro-batches of ``micro_batch`` x ``seq_len`` tokens)."""

    model: str
    machine: str
    num_devices: int
    seq_len: int
    micro_batch: int
    grad_accum: int
    round_size: int
    fwd_cuts: tuple[int, ...]
    bwd_cuts: tuple[int, ...]
    tier: str  # "host" | "nvme"
    async_optimizer: bool
    clipping: bool
    tokens_per_s: float
    iteration_ms: float
    bubble: float
    device_peak_bytes: int  # the busiest device, CUDA context included
    device_budget_bytes: int | None  # the machine's device memory
    host_ram_bytes: int
    pcie_bytes_per_step: int
    nvme_bytes_per_step: int
    binds: str  # "compute" | "pcie" | "host adam" | "disk"
    max_seq_len: int | None  # longest single sequence a device holds (micro-batch 1)
    step_ms: dict[str, float] = dataclasses.field(default_factory=dict, compare=False)
    # with the NVMe tier: where the host RAM goes (host_ram.py's lines), else empty
    host_ram_lines: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    sim: SimResult | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def fits_device(self) -> bool:
        """The simulated peak (with the CUDA context) fits the device memory."""
        return (
            self.device_budget_bytes is None or self.device_peak_bytes <= self.device_budget_bytes
        )

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.grad_accum * self.seq_len

    def why(self) -> str:
        """One sentence: what binds and what would move it."""
        t = self.step_ms
        parts = ", ".join(f"{k} {v:,.0f} ms" for k, v in t.items())
        fix = {
            "compute": "the GPUs are busy: only faster GPUs or a smaller model help",
            "pcie": "weights cross PCIe once per round: a larger micro-batch or round size "
            "(device memory permitting) amortises them",
            "host adam": "the CPU Adam step over every trainable parameter outlasts the "
            "iteration: more tokens per step (micro-batch or accumulation), LoRA, or a faster "
            "host help",
            "disk": "the NVMe tier reads and writes 24 B per trainable parameter per step: more "
            "host RAM (host tier), a faster drive, or more tokens per step help",
        }[self.binds]
        return f"{self.binds} binds (per step: {parts}): {fix}"

    def ds_config(self, *, nvme_path: str = "/local_nvme", lr: float = 2e-5) -> dict[str, Any]:
        """A DeepSpeed-style config for rp_engine (``rp_engine.initialize``, ``rp-train
        --deepspeed``): the batch triplet, bf16, AdamW, clipping, the cuts and round size; the
        NVMe optimizer tier under ``nvme_path`` when ``tier`` is "nvme"."""
        cfg: dict[str, Any] = {
            "train_batch_size": self.micro_batch * self.grad_accum,
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.grad_accum,
            "bf16": {"enabled": True},
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
            },
            "gradient_clipping": 1.0 if self.clipping else 0.0,
            "roundpipe": {
                "fwd_cuts": list(self.fwd_cuts),
                "bwd_cuts": list(self.bwd_cuts),
                "round_size": self.round_size,
                "async_optimizer": self.async_optimizer,
            },
        }
        if self.tier == "nvme":
            cfg["zero_optimization"] = {
                "stage": 3,
                "offload_optimizer": {
                    "device": "nvme",
                    "nvme_path": nvme_path,
                    "buffer_count": NVME_BUFFERS,
                },
            }
        return cfg

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sim"}
        out["fwd_cuts"], out["bwd_cuts"] = list(self.fwd_cuts), list(self.bwd_cuts)
        out["tokens_per_step"] = self.tokens_per_step
        out["why"] = self.why()
        return out


def format_table(advice: Sequence[Advice]) -> str:
    """The best few as a markdown table, best first, with what binds the best and why."""
    if not advice:
        return "no configuration fits"
    a0 = advice[0]
    lines = [
        f"**{a0.model}** on {a0.machine} ({a0.num_devices} devices), seq_len {a0.seq_len}, "
        f"{'async' if a0.async_optimizer else 'sync'} optimizer"
        f"{', gradient clipping' if a0.clipping else ''}",
        "",
        "| # | micro-batch x accum (round) | tokens/step | tier | tokens/s | bubble | "
        "device peak | host RAM | PCIe/step | NVMe/step | binds | longest seq |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for i, a in enumerate(advice, 1):
        longest = (
            "-" if not a.device_budget_bytes else f"{a.max_seq_len // 1024}K" if a.max_seq_len
            else "OOM"
        )  # fmt: skip
        lines.append(
            f"| {i} | {a.micro_batch} x {a.grad_accum} ({a.round_size}) | "
            f"{a.tokens_per_step:,} | {a.tier} | {a.tokens_per_s:,.0f} | {a.bubble:.1%} | "
            f"{format_bytes(a.device_peak_bytes)}{'' if a.fits_device else ' (over!)'} | "
            f"{format_bytes(a.host_ram_bytes)} | "
            f"{format_bytes(a.pcie_bytes_per_step)} | "
            f"{format_bytes(a.nvme_bytes_per_step) if a.nvme_bytes_per_step else '-'} | "
            f"{a.binds} | {longest} |"
        )
    over = [str(i) for i, a in enumerate(advice, 1) if not a.fits_device]
    tiered = next((i for i, a in enumerate(advice, 1) if a.host_ram_lines), None)
    if tiered is not None:  # where the host RAM goes: the tiers' pools, not the state
        lines += ["", f"host RAM of row {tiered} (NVMe optimizer tier, stashed activations "
                  "apart):", *advice[tiered - 1].host_ram_lines]  # fmt: skip
    lines += [
        "",
        f"best: {a0.why()}",
        *(
            [
                f"warning: rows {', '.join(over)}: the simulated device peak exceeds the "
                f"device memory ({format_bytes(a0.device_budget_bytes or 0)}) although the "
                "partitioner's memory check passed: expect an out-of-memory error or set "
                "smaller cuts"
            ]
            if over
            else []
        ),
        f"cuts: forward {list(a0.fwd_cuts)}, backward {list(a0.bwd_cuts)} (head stage first)",
        "Notes: RoundPipe always recomputes each backward stage's forward (no knob); "
        "device peak includes 1.5 GB of CUDA context on GPUs; host RAM counts bf16 weights, the "
        "optimizer state of its tier and the stashed activations; longest seq is one "
        "sequence per micro-batch.",
    ]
    return "\n".join(lines)
