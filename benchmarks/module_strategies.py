"""Any nn.Module (issue 29): strategy (b) traced vs (c) whole module vs DeepSpeed ZeRO-Infinity.

    python -m benchmarks.module_strategies                      # CPU, emulated link, ~2 min
    python -m benchmarks.module_strategies --pcie-gbps 1 --json out.json

The model is a plain ``nn.Module`` that is not a Hugging Face model: a residual MLP stack
(``embed`` Linear, ``--blocks`` pre-norm residual MLP blocks in an ``nn.ModuleList``, a final
LayerNorm and ``out`` Linear; ``forward(x, y)`` returns the cross-entropy). Three systems train
it with DeepSpeed's own loop (``loss = engine(x, y); engine.backward(loss); engine.step()``),
from the same weights (one seed), data, optimizer and ds_config (``common.ds_config``:
ZeRO-3, params and optimizer offloaded to CPU, AdamW, clipping 1.0):

- ``traced``: rp_engine, its default for this model, strategy (b): torch.fx traces the model and
  cuts it before each block after the first (one stage per block);
- ``whole_module``: rp_engine, strategy (c), the whole model as one layer. rp_engine has no
  switch that asks for (c); the run names a split point that is not a module of the model
  (``FORCE_WHOLE``), so the trace is refused and (c) is the documented fallback (its
  ``engine.layering.reason`` says so, and the JSON keeps it);
- ``traced_train_batch`` / ``whole_module_train_batch``: the same two strategies driven by
  ``engine.train_batch(data_iter)`` (rp_engine's fast path, PipelineEngine's API; the model
  returns one scalar loss, so it can): all GAS micro-batches in one schedule, one weight upload
  per slot and step with the gradients accumulated on the device;
- ``deepspeed``: real DeepSpeed ZeRO-Infinity (CPU form), one process.

"On the emulated link": rp_engine's CPU virtual devices charge ``roundpipe.pcie_gbps`` on every
host<->device copy; DeepSpeed's fetches and gradient offloads are charged on the same link by
``benchmarks.emulated_link`` (as in ``benchmarks.head_to_head``). Each system runs in its own
process, the systems alternate (``--repeats``), each warms up and then times one window of
``--steps`` optimizer steps synchronised only at its two ends. Reported: samples/s (median over
repeats), the ratios (b)/DeepSpeed, (c)/DeepSpeed and (b)/(c), the bytes moved per step
(rp_engine: measured by its devices, ``engine.last_step_stats()``; DeepSpeed: the link model),
the first step's loss (the same weights and data: it must agree) and the last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import child_json, chosen_systems, ds_config, machine_info, one_rank_env
from benchmarks.host_load import CoreShare

SYSTEMS = ("traced", "whole_module", "traced_train_batch", "whole_module_train_batch", "deepspeed")
RP_SYSTEMS = ("traced", "whole_module", "traced_train_batch", "whole_module_train_batch")
# a split point no model has: rp_engine refuses the trace and runs strategy (c) (module.py)
FORCE_WHOLE = "__whole_module__"
DEFAULT_JSON = Path(__file__).resolve().parent / "data" / "module_strategies.json"


class Block(nn.Module):
    """Pre-norm residual MLP: ``h + W2 gelu(W1 norm(h))``."""

    def __init__(self, hidden: int, expand: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, expand * hidden)
        self.down = nn.Linear(expand * hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class ResidualMLP(nn.Module):
    """A plain module with repeated blocks: ``forward(x, y)`` -> mean cross-entropy of the
    per-token class logits. ``x``: (batch, tokens, features) float, ``y``: (batch, tokens)."""

    def __init__(self, features: int, hidden: int, blocks: int, classes: int, expand: int) -> None:
        super().__init__()
        self.embed = nn.Linear(features, hidden)
        self.blocks = nn.ModuleList(Block(hidden, expand) for _ in range(blocks))
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        logits = self.out(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def build_model(args: argparse.Namespace) -> ResidualMLP:
    torch.manual_seed(0)
    return ResidualMLP(args.features, args.hidden, args.blocks, args.classes, args.expand)


def make_batches(args: argparse.Namespace, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` micro-batches, the same for every system (one generator seed)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randn(args.mbs, args.tokens, args.features, generator=gen)
        y = torch.randint(0, args.classes, (args.mbs, args.tokens), generator=gen)
        out.append((x, y))
    return out


def config(args: argparse.Namespace, system: str) -> dict[str, Any]:
    """The ds_config every system reads; rp_engine's section says where and how it runs."""
    run = {"mbs": args.mbs, "gas": args.gas, "dtype": "fp32", "device_memory_gb": None}
    if system == "deepspeed":
        cfg = ds_config(run, devices=None, pcie_gbps=None)
        cfg.pop("roundpipe")
        return cfg
    cfg = ds_config(run, devices=args.devices, pcie_gbps=args.pcie_gbps)
    if system.startswith("whole_module"):
        cfg["roundpipe"]["split_points"] = [FORCE_WHOLE]
    return cfg


# ---- one system --------------------------------------------------------------------------------
def run_system(system: str, args: argparse.Namespace) -> dict[str, Any]:
    """Warm up ``args.warmup`` steps, then time ``args.steps`` steps between two
    synchronisations. One step is ``args.gas`` micro-batches of DeepSpeed's loop."""
    model = build_model(args)
    parameters = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them
    data = make_batches(args, (args.warmup + args.steps) * args.gas)
    setup = _deepspeed if system == "deepspeed" else _rp_engine
    engine, sync, extra, link = setup(system, model, args)
    it = iter(data)

    def step() -> torch.Tensor:
        if system.endswith("_train_batch"):  # all GAS micro-batches in one schedule
            batches = [tuple(t.to(engine.device) for t in next(it)) for _ in range(args.gas)]
            return engine.train_batch(iter(batches)).detach().cpu()
        total = torch.zeros(())
        for _ in range(args.gas):
            x, y = (t.to(engine.device) for t in next(it))
            loss = engine(x, y)
            engine.backward(loss)
            if link is not None:
                link.wait_gradients()  # the step and the next micro-batch need the offload
            engine.step()
            total = total + loss.detach().cpu() / args.gas
        return total

    try:
        losses = [step() for _ in range(args.warmup)]
        sync()
        with CoreShare() as load:  # other processes' demand for the cores meanwhile
            start = time.perf_counter()
            losses += [step() for _ in range(args.steps)]  # no synchronisation in the window
            sync()
            seconds = time.perf_counter() - start
        row = {
            "system": system,
            "samples_per_s": args.steps * args.gas * args.mbs / seconds,
            "s_per_step": seconds / args.steps,
            "step_losses": [float(x) for x in losses],
            "first_loss": float(losses[0]),
            "final_loss": float(losses[-1]),
            "parameters": parameters,
            "external_load": {"threads": load.mean_threads, "sessions": load.mean_sessions},
        }
        row.update(extra())
        return row
    finally:
        if link is not None:
            link.close()
        engine.destroy()


def _rp_engine(system: str, model: nn.Module, args: argparse.Namespace) -> tuple:
    """rp_engine on ``args.devices``: (engine, synchronize, extra figures, no modelled link)."""
    import rp_engine

    engine, _, _, _ = rp_engine.initialize(
        model=model, model_parameters=model.parameters(), config=config(args, system)
    )

    def extra() -> dict[str, Any]:
        stats = engine.last_step_stats()  # the window's last step, measured by the devices
        lay = engine.layering
        return {
            "strategy": lay.strategy,
            "reason": lay.reason,
            "split_points": list(lay.split_points),
            "fwd_cuts": list(engine.planner.fwd_cuts),
            "bwd_cuts": list(engine.planner.bwd_cuts),
            "bytes_per_step": stats["h2d_bytes"] + stats["d2h_bytes"],
            "h2d_bytes_per_step": stats["h2d_bytes"],
            "weight_h2d_bytes_per_step": stats["weight_h2d_bytes"],
            "uploads_per_step": stats["uploads"],
            "bytes_modelled": False,
        }

    return engine, engine.synchronize, extra, None


def _deepspeed(system: str, model: nn.Module, args: argparse.Namespace) -> tuple:
    """DeepSpeed ZeRO-3 offloading to CPU, one rank: (engine, synchronize (CPU: nothing to
    wait for), extra figures, the modelled link or None)."""
    one_rank_env()
    import deepspeed

    from benchmarks.emulated_link import EmulatedZeroLink

    # fetched and offloaded per module in execution order, as ZeRO-3 gathers them
    modules = [model.embed, *model.blocks, model.norm, model.out]
    link = EmulatedZeroLink.over(modules, 4, args.pcie_gbps) if args.pcie_gbps else None
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config(args, system)
    )

    def extra() -> dict[str, Any]:
        if link is None:
            return {"strategy": "deepspeed", "bytes_per_step": None}
        total = args.warmup + args.steps
        return {
            "strategy": "deepspeed",
            "bytes_per_step": (link.h2d_bytes + link.d2h_bytes) / total,
            "h2d_bytes_per_step": link.h2d_bytes / total,
            "bytes_modelled": True,
        }

    return engine, (lambda: None), extra, link


# ---- the parent: alternate, aggregate, report --------------------------------------------------
def _argv(args: argparse.Namespace) -> list[str]:
    """The options a system's process needs to run the same configuration."""
    out = []
    for key in ("features", "hidden", "blocks", "classes", "expand", "mbs", "tokens", "gas",
                "warmup", "steps", "devices", "pcie_gbps"):  # fmt: skip
        value = getattr(args, key)
        if value is not None:
            out += [f"--{key.replace('_', '-')}", str(value)]
    return out


def run_child(system: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.module_strategies", "--system", system, *_argv(args)]
    return child_json(cmd, system, timeout=args.timeout, child_log=args.child_log)


def aggregate(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per system: the median samples/s and s/step over repeats, every repeat's figure, the
    last repeat's other fields."""
    systems: dict[str, Any] = {}
    for name, rows in runs.items():
        ok = [r for r in rows if "error" not in r]
        if not ok:
            systems[name] = {"error": rows[-1].get("error")}
            continue
        sps = [r["samples_per_s"] for r in ok]
        systems[name] = {
            **ok[-1],
            "samples_per_s": statistics.median(sps),
            "samples_per_s_runs": sps,
            "s_per_step": statistics.median(r["s_per_step"] for r in ok),
        }
    return systems


def ratios(systems: dict[str, Any]) -> dict[str, float]:
    """(b)/DeepSpeed, (c)/DeepSpeed and (b)/(c) in samples/s, for the systems that ran."""
    sps = {k: s["samples_per_s"] for k, s in systems.items() if "samples_per_s" in s}
    pairs = {
        "traced/deepspeed": ("traced", "deepspeed"),
        "whole_module/deepspeed": ("whole_module", "deepspeed"),
        "traced/whole_module": ("traced", "whole_module"),
        "traced_train_batch/deepspeed": ("traced_train_batch", "deepspeed"),
        "whole_module_train_batch/deepspeed": ("whole_module_train_batch", "deepspeed"),
    }
    return {k: sps[a] / sps[b] for k, (a, b) in pairs.items() if a in sps and b in sps}


def result_of(
    runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, machine: dict[str, Any]
) -> dict[str, Any]:
    systems = aggregate(runs)
    keys = ("features", "hidden", "blocks", "classes", "expand", "mbs", "tokens", "gas",
            "warmup", "steps", "repeats", "devices", "pcie_gbps")  # fmt: skip
    cfg = {k: getattr(args, k) for k in keys}
    cfg["ds_config"] = config(args, "deepspeed")
    cfg["force_whole_split_point"] = FORCE_WHOLE
    return {"systems": systems, "ratios": ratios(systems), "config": cfg, "machine": machine}


def format_table(result: dict[str, Any]) -> str:
    """The report as a Markdown table (then the ratios)."""
    label = {
        "traced": "rp_engine (b) traced",
        "whole_module": "rp_engine (c) whole module",
        "traced_train_batch": "rp_engine (b) traced, train_batch",
        "whole_module_train_batch": "rp_engine (c) whole module, train_batch",
        "deepspeed": "DeepSpeed ZeRO-Infinity (CPU)",
    }
    lines = [
        "| system | layering | samples/s | s/step | MB moved/step | weight MB up/step | "
        "first loss | final loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in SYSTEMS:
        s = result["systems"].get(name)
        if s is None:
            continue
        if "error" in s:
            lines.append(f"| {label[name]} | failed: {' / '.join(s['error'] or [])[-200:]} |")
            continue
        layering = s["strategy"]
        if name != "deepspeed":
            layering += f", {sum(s['fwd_cuts'])} layer(s)"
        moved = s.get("bytes_per_step")
        moved_text = "" if moved is None else f"{moved / 1e6:,.1f}"
        if s.get("bytes_modelled"):
            moved_text += " (model)"
        weights = s.get("weight_h2d_bytes_per_step")
        lines.append(
            f"| {label[name]} | {layering} | {s['samples_per_s']:,.1f} | {s['s_per_step']:.3f} | "
            f"{moved_text} | {'' if weights is None else f'{weights / 1e6:,.1f}'} | "
            f"{s['first_loss']:.4f} | {s['final_loss']:.4f} |"
        )
    table = "\n".join(lines) + "\n"
    if result["ratios"]:
        table += "\n" + ", ".join(f"{k} = **{v:.2f}x**" for k, v in result["ratios"].items())
        table += "\n"
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--features", type=int, default=256, help="input features per token")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--classes", type=int, default=256)
    p.add_argument("--expand", type=int, default=4, help="MLP width / hidden")
    p.add_argument("--mbs", type=int, default=16, help="micro-batch size (samples)")
    p.add_argument("--tokens", type=int, default=16, help="tokens per sample")
    p.add_argument("--gas", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run")
    p.add_argument("--repeats", type=int, default=2, help="rounds of the three systems")
    p.add_argument("--devices", default="cpu:2", help="rp_engine's devices")
    p.add_argument("--pcie-gbps", type=float, default=0.25, help="emulated link (0: none)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--inline", action="store_true",
                   help="run rp_engine's systems in this process (tests); DeepSpeed never is")  # fmt: skip
    p.add_argument("--json", default=str(DEFAULT_JSON), help="write the result here")
    p.add_argument("--timeout", type=float, default=600, help="seconds per system's process")
    p.add_argument("--child-log", help="append every system process's stderr here")
    p.add_argument("--system", help=argparse.SUPPRESS)  # a child process's one system
    args = p.parse_args(argv)
    args.pcie_gbps = args.pcie_gbps or None
    if args.system:
        print("JSON:" + json.dumps(run_system(args.system, args)), flush=True)
        return 0
    names = chosen_systems(p, args.systems, SYSTEMS)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in names}
    for rep in range(args.repeats):  # A B C, A B C: drift hits every system alike
        for system in names:
            inline = args.inline and system in RP_SYSTEMS
            row = run_system(system, args) if inline else run_child(system, args)
            runs[system].append(row)
            brief = {k: row.get(k) for k in ("samples_per_s", "s_per_step", "strategy", "error")}
            print(f"[{rep + 1}/{args.repeats}] {system}: {json.dumps(brief)}", file=sys.stderr)
    result = result_of(runs, args, machine_info())
    table = format_table(result)
    print(table)
    result["table"] = table
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 1 if any("error" in s for s in result["systems"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
