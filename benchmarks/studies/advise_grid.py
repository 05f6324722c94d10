"""The configuration advisor against exhaustion of its full grid, for the projection's four shapes
on both machine presets.

    python -m benchmarks.studies.advise_grid [--max-micro-batch 4] [--json out.json]

Exhaustion: every grid point (micro-batch 1, 2, 4, ... up to ``--max-micro-batch`` while one
micro-batch fits a device; accumulation 4 .. 64, powers of two; every round size dividing it
that fits) partitioned (20,000 work) and scored by pass 2 of the advisor (the partition's
estimate with transfers, the host Adam step); its best 3 then partitioned with the full work
and simulated, as the advisor's finalists are. Simulating every point of the full grid would
take hours for the 94-layer model, hence the two stages. Printed: the advisor's and the
exhaustive best simulated tokens/s, their ratio, the number of points scored and both run times.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rp_engine.plan.advise import Advice, advise, score_point
from rp_engine.plan.shapes import SHAPES, Shape, mem_bytes
from rp_engine.plan.simulate import Machine, load_machine

PRESETS = ("rtx4090_pcie4_8x", "a800_nvlink_8x")


def exhaustive(shape: Shape, machine: Machine, max_mb: int) -> tuple[Advice | None, int]:
    """(best simulated Advice of the full grid, points scored)."""
    points: list[tuple[float, tuple[int, int, int]]] = []
    mb = 1
    while mb <= max_mb:
        if machine.memory_bytes and (
            mem_bytes("roundpipe", shape, mb * 2048, machine.num_devices) > machine.memory_bytes
        ):
            break
        for gas in (4, 8, 16, 32, 64):
            for r in (d for d in range(1, gas + 1) if not gas % d):
                tps = score_point(
                    shape, machine, micro_batch=mb, grad_accum=gas, round_size=r,
                    work=20_000, simulated=False,
                )  # fmt: skip
                if isinstance(tps, float):
                    points.append((tps, (mb, gas, r)))
        mb *= 2
    points.sort(key=lambda t: -t[0])
    sims = []
    for _, (mb, gas, r) in points[:3]:
        a = score_point(shape, machine, micro_batch=mb, grad_accum=gas, round_size=r)
        if isinstance(a, Advice):
            sims.append(a)
    sims.sort(key=lambda a: (not a.fits_device, -a.tokens_per_s))
    return (sims[0] if sims else None), len(points)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--max-micro-batch", type=int, default=4)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    print("| machine | model | advisor tokens/s (config) | exhaustive tokens/s (config) | "
          "ratio | points | advisor s | exhaustive s |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for preset in PRESETS:
        machine = load_machine(preset)
        for key, shape in SHAPES.items():
            t0 = time.perf_counter()
            best = advise(shape, machine)[0]
            t1 = time.perf_counter()
            ex, n = exhaustive(shape, machine, args.max_micro_batch)
            t2 = time.perf_counter()
            ratio = best.tokens_per_s / ex.tokens_per_s if ex else float("nan")

            def cfg(a: Advice | None) -> str:
                if a is None:
                    return "-"
                return f"{a.micro_batch}x{a.grad_accum} ({a.round_size})"

            row = {
                "machine": preset, "model": key, "advisor_tps": best.tokens_per_s,
                "advisor_config": cfg(best), "exhaustive_tps": ex.tokens_per_s if ex else None,
                "exhaustive_config": cfg(ex), "ratio": ratio, "points": n,
                "advisor_s": t1 - t0, "exhaustive_s": t2 - t1,
            }  # fmt: skip
            rows.append(row)
            print(
                f"| {preset} | {shape.name} | {best.tokens_per_s:,.0f} ({cfg(best)}) | "
                f"{(ex.tokens_per_s if ex else 0):,.0f} ({cfg(ex)}) | {ratio:.3f} | {n} | "
                f"{t1 - t0:.1f} | {t2 - t1:.1f} |",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
