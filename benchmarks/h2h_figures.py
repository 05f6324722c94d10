"""Figures of a head-to-head JSON: tokens/s per system (bar chart) and rp_engine's measured
timelines (the last step of each rp_engine run).

    python -m benchmarks.h2h_figures RESULT.json OUT_PREFIX
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rp_engine.plan import render

__all__ = ["bar_chart", "timelines", "main"]


def bar_chart(result: dict[str, Any], path: str | Path, title: str) -> None:
    """Tokens/s per system, each bar labelled with its ratio to DeepSpeed."""
    from matplotlib.figure import Figure

    names = [n for n, s in result["systems"].items() if "tokens_per_s" in s]
    values = [result["systems"][n]["tokens_per_s"] for n in names]
    fig = Figure(figsize=(7, 3.6))
    ax = fig.subplots()
    bars = ax.bar(
        names, values, color=["#888", "#1f77b4", "#6baed6", "#ff7f0e", "#2ca02c"][: len(names)]
    )
    for bar, name in zip(bars, names, strict=True):
        ratio = result["ratios"].get(name)
        if ratio is not None:
            ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)  # fmt: skip
    ax.set_ylabel("tokens/s")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def timelines(result: dict[str, Any], prefix: str) -> list[str]:
    """One Gantt PNG per rp_engine system with a recorded timeline; returns the paths."""
    out = []
    for name, records in result.get("timelines", {}).items():
        recs = [SimpleNamespace(device=d, action=a, start=s, end=e) for d, a, s, e in records]
        measured = render.measured_result(recs, schedule=f"{name} (measured)")
        path = f"{prefix}_timeline_{name}.png"
        render.write_png(measured, path)
        out.append(path)
    return out


def simulated(result: dict[str, Any], prefix: str) -> list[str]:
    """The simulator's Gantt of each calibrated rp_engine run, beside the measured one: the
    compute times, overhead and core share recorded by the run (its last repeat), byte sizes from the
    preset's model, the run's plan."""
    from benchmarks import calibration as cal
    from benchmarks.common import PRESETS, build_model
    from rp_engine.plan.partition import LayerCosts

    preset = PRESETS[result["config"]["model"]]
    model = build_model(preset)
    inner = model.model
    nbytes = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in inner.layers]
    head = sum(p.numel() * p.element_size() for p in model.lm_head.parameters())
    prefix_b = sum(p.numel() * p.element_size() for p in inner.embed_tokens.parameters())
    hidden = preset["mbs"] * preset["seq"] * preset["hidden_size"] * 4
    out = []
    for name, row in result["systems"].items():
        c = row.get("calibration")
        if not c:
            continue
        # the prediction's compute: in-engine CPU cost of the executor path (newer runs)
        ex = "engine_fwd_ms" in c
        costs = LayerCosts(
            fwd_ms=tuple(c["engine_fwd_ms" if ex else "layer_fwd_ms"]),
            bwd_ms=tuple(c["engine_bwd_ms" if ex else "layer_bwd_ms"]),
            recompute_ms=tuple(c["engine_recompute_ms"]) if ex else (),
            param_bytes=tuple(nbytes),
            head_fwd_ms=c["engine_head_ms" if ex else "head_ms"][0],
            head_bwd_ms=c["engine_head_ms" if ex else "head_ms"][1],
            head_param_bytes=head,
            boundary_bytes=c.get("boundary_bytes", hidden),
            boundary_grad_bytes=hidden,
            batch_bytes=c.get("batch_bytes", 0),
            prefix_param_bytes=prefix_b,
        )
        machine = cal.cpu_machine(
            row["num_devices"],
            result["config"]["pcie_gbps"],
            c["cpu_adam_params_per_s"],
            c.get("action_overhead_ms", 0.0),
            host_share=tuple(c.get("host_share", ())),
        )
        pred = cal.predict_ms(
            costs,
            machine,
            schedule=row["schedule"],
            fwd_cuts=row["fwd_cuts"],
            bwd_cuts=row["bwd_cuts"],
            num_microbatches=preset["gas"],
            round_size=row["round_size"],
            async_optimizer=name == "roundpipe",
            global_norm=ex,  # clipping 1.0: modelled in runs from this version on
        )
        path = f"{prefix}_simulated_{name}.png"
        render.write_png(pred["result"], path, title=f"{name} (simulated, 4 iterations)")
        out.append(path)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    result = json.loads(Path(args[0]).read_text())
    cfg = result["config"]
    title = (f"{cfg['model']}, {cfg.get('devices')} devices, link {cfg.get('pcie_gbps')} GB/s, "
             f"{result['machine'].get('gpu') or str(result['machine']['cpu_count']) + ' CPU cores'}")  # fmt: skip
    bar_chart(result, f"{args[1]}_tokens.png", title)
    paths = [f"{args[1]}_tokens.png", *timelines(result, args[1]), *simulated(result, args[1])]
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
