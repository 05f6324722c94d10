"""Step time of sliced optimizer pools against whole-layer pools, at one budget and at half of
its pools' share (issue 49).

    python -m benchmarks.sliced_pools [--repeats 5] [--quick] [--json out.json]

The model is ``bounded_ram.build``'s bf16 Qwen2 with a few wide layers (hidden 1,024, 6 layers,
vocabulary 1,024: a layer's fp32 masters + Adam moments are a 108 MiB record), both NVMe tiers
in a fresh temporary folder, 2 CPU virtual devices of 0.15 GB each (``device_memory_gb``: without
it their compute's memory is neither bounded nor predicted), asynchronous CPU Adam. Each run is its own
process (``bounded_ram``-style: one ``JSON:`` line), the timed variants interleaved repeat by
repeat, their order rotating:

0. *probe* (once, not timed): whole-layer pools, no budget; its ``engine.host_ram.peak`` (plus a
   margin for the runtime measured again in each process) is the budget **B**, its
   ``runtime + model`` the part of it no pool can give back (``held``);
1. ``layer``: whole-layer records (``optimizer_slice_mb`` null) at ``host_memory_gb`` B: the
   configured pools (asserted: no buffer fewer, no slice);
2. ``sliced``: ``optimizer_slice_mb`` a quarter of a layer's record, at B;
2b. ``sliced_deep``: the same slices at B, with as many buffers as 4 layers have slices
   (``buffer_count`` 20 here: a 108.05 MiB record is 5 slices of 27.0 MiB): as much read
   ahead as the layer pool's 4 whole layers, still under B;
3. ``sliced_half``: the same ``optimizer_slice_mb`` at ``held + (B - held) / 2``: half of what
   B gives beyond the runtime and the model (B / 2 itself is below them here; where half is
   below the sliced run's least, that least instead); the preflight fits the pools to it
   (fewer buffers, smaller slices) and logs what it chose;
4. ``auto_half`` (once, initialize only): no ``optimizer_slice_mb`` at the half budget: what
   the preflight slices to on its own (the default since issue 49);
5. ``layer_half`` (once, not timed): whole layers only at the half budget (slicing ruled out by
   ``staleness_compensation: "lookahead_dc"``, which needs whole tensors): the preflight must
   refuse it; its "least this run can work with" is recorded.

A timed run trains ``warmup`` steps, then ``windows`` windows of ``window`` steps, each window
timed between two ``engine.synchronize()`` calls (the asynchronous optimizer's last step
included); a variant's step time is the median over all its windows of every repeat (and,
less moved by other jobs on a shared machine, which only ever add time: its fastest window). Each row
also has the pools chosen (``engine.tier_fit.counts``), the predicted peak
(``engine.host_ram.peak``) and the measured ones: ``peak_rss`` (VmHWM: anonymous memory and
the file pages mapped into the process), and the highest ``RssAnon`` and ``RssFile`` sampled
every 10 ms. Every timed run's losses must be equal bit for bit (asserted:
slicing and fewer buffers change speed, never a result).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from benchmarks.common import machine_info, peak_rss
from rp_engine.host.memory_limit import status_bytes

MIB = 2**20
GIB = 2**30
MARGIN = 64 * MIB  # B above the probe's prediction: each process measures its runtime again
# the CPU devices get a budget: it bounds (and the prediction counts) what their compute holds
SPEC: dict[str, Any] = {"layers": 6, "hidden": 1024, "vocab": 1024, "seq": 32, "gas": 2,
                        "device_memory_gb": 0.15}  # fmt: skip
QUICK: dict[str, Any] = {"layers": 4, "hidden": 512, "vocab": 1024, "seq": 32, "gas": 2,
                         "device_memory_gb": 0.06}  # fmt: skip
TIMED = ("layer", "sliced", "sliced_deep", "sliced_half")
BUFFERS = 4  # bounded_ram's offload_optimizer.buffer_count


# ---- one run (the child process) ---------------------------------------------------------------
def _config(spec: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import bounded_ram

    cfg = bounded_ram.config({**spec, "tiers": True})
    cfg["roundpipe"]["on_nonfinite"] = "ignore"
    if spec.get("slice_mb"):
        cfg["roundpipe"]["optimizer_slice_mb"] = spec["slice_mb"]
    if spec.get("optimizer_buffers"):  # offload_optimizer.buffer_count (bounded_ram's: 4)
        cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = spec["optimizer_buffers"]
    if spec.get("whole_only"):  # delay compensation needs whole tensors: no slicing at all
        cfg["roundpipe"]["staleness_compensation"] = "lookahead_dc"
    return cfg


def _batches(spec: dict[str, Any], steps: int, gas: int) -> list[list[dict[str, Any]]]:
    import torch

    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(gas):
            ids = torch.randint(0, spec["vocab"], (2, spec["seq"]), generator=gen)
            step.append({"input_ids": ids, "labels": ids.clone()})
        out.append(step)
    return out


def _gib_of(text: str) -> float | None:
    """'1.23 GiB' or '456.7 MiB' (format_mib_gib) as GiB."""
    m = re.match(r"([\d.]+) (GiB|MiB)", text)
    if not m:
        return None
    return float(m.group(1)) / (1 if m.group(2) == "GiB" else 1024)


class _RssPeaks:
    """The highest ``RssAnon`` and ``RssFile`` (/proc/self/status) sampled every 10 ms while
    running: VmHWM alone does not say how much of a peak is anonymous memory (what the pools
    and the runtime hold) and how much file pages mapped into the process."""

    def __init__(self) -> None:
        self.anon = self.file = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while True:
            self.anon = max(self.anon, status_bytes("RssAnon") or 0)
            self.file = max(self.file, status_bytes("RssFile") or 0)
            if self._done.wait(0.01):
                return

    def stop(self) -> dict[str, int]:
        self._done.set()
        self._thread.join()
        return {"peak_anon": self.anon, "peak_file": self.file}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Initialize (and, unless ``windows`` is 0, train and time) one variant; its result row."""
    import rp_engine
    from benchmarks import bounded_ram
    from rp_engine.host_preflight import PreflightError

    model = bounded_ram.build(spec)
    peaks = _RssPeaks()
    row: dict[str, Any] = {"variant": spec["variant"], "budget_gib": spec.get("host_memory_gb")}
    try:
        engine, _, _, _ = rp_engine.initialize(model=model, config=_config(spec))
    except PreflightError as exc:
        text = str(exc)
        least = re.search(r"least this run can work with: ([\d.]+ \w+)", text)
        needs = re.search(r"this run needs about ([\d.]+ \w+)", text)
        row.update(
            refused=True,
            least_gib=_gib_of(least.group(1)) if least else None,
            needs_gib=_gib_of(needs.group(1)) if needs else None,
            message=text.splitlines()[0],
        )
        return row
    fit, ram = engine.tier_fit, engine.host_ram
    assert fit is not None and ram is not None, "the NVMe tiers are on: the preflight ran"
    row.update(
        refused=False,
        counts=dataclasses.asdict(fit.counts),
        predicted_peak=ram.peak,
        least_peak=fit.least.peak,
        held=ram.runtime + ram.model,  # what the pools cannot give back
        parts=dict(ram.parts),
        layer_record=12 * max(
            sum(hp.master.numel() for hp in layer.owned) for layer in engine.store.layers
        ),
    )  # fmt: skip
    warmup, window, windows = spec["warmup"], spec["window"], spec["windows"]
    data = _batches(spec, warmup + window * windows, engine.gradient_accumulation_steps())
    losses: list[Any] = []
    times: list[float] = []
    for step in data[:warmup]:
        losses.append(engine.train_batch(iter(step)))
    for w in range(windows):
        engine.synchronize()
        start = time.perf_counter()
        for step in data[warmup + w * window : warmup + (w + 1) * window]:
            losses.append(engine.train_batch(iter(step)))
        engine.synchronize()
        times.append((time.perf_counter() - start) / window)
    engine.destroy()
    row.update(losses=[float(x) for x in losses], step_s=times, peak_rss=peak_rss())
    row.update(peaks.stop())
    return row


# ---- the comparison (the parent) ---------------------------------------------------------------
def run(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """``spec`` in a fresh process with its own NVMe folder; raises with its stderr when it
    fails."""
    from benchmarks.bounded_ram import ROOT

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    # sleeping OpenMP waits on a shared machine (common.child_json says why)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    with tempfile.TemporaryDirectory(prefix="rp_sliced_") as folder:
        cmd = [sys.executable, "-m", "benchmarks.sliced_pools", "--child",
               json.dumps({**spec, "dir": folder})]  # fmt: skip
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON:")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{spec['variant']} failed:\n{proc.stderr[-4000:]}")
    out = dict(json.loads(lines[-1][5:]))
    fitted = [ln for ln in proc.stderr.splitlines() if "NVMe pools shrink" in ln]
    out["preflight_log"] = fitted[-1].split("rp_engine", 1)[-1] if fitted else None
    return out


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:,.0f} MiB"


def _median_step(runs: list[dict[str, Any]]) -> float:
    return statistics.median(t for r in runs for t in r["step_s"])


def table(rows: dict[str, list[dict[str, Any]]], refusal: dict[str, Any]) -> str:
    """The markdown table of the timed variants (and the refused one)."""
    base = _median_step(rows["layer"])
    fastest = min(t for r in rows["layer"] for t in r["step_s"])
    out = [
        "| variant | budget | step (median) | / layer @ B | fastest window | / layer's fastest "
        "| per-repeat ratios | pools: opt / grad / param buffers, slice | predicted peak | VmHWM "
        "| RssAnon peak | RssFile peak |",
        "|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for name, runs in rows.items():
        ratios = [
            statistics.median(r["step_s"]) / statistics.median(b["step_s"])
            for r, b in zip(runs, rows["layer"], strict=True)
        ]
        low = min(t for r in runs for t in r["step_s"])
        c = runs[0]["counts"]
        pools = f"{c['optimizer']} / {c['grad']} / {c['param']}, " + (
            f"{c['optimizer_slice'] / MIB:.1f} MiB" if c["optimizer_slice"] else "whole layers"
        )
        med = {k: statistics.median(r[k] for r in runs) for k in
               ("predicted_peak", "peak_rss", "peak_anon", "peak_file")}  # fmt: skip
        out.append(
            f"| {name} | {_mib(runs[0]['budget_gib'] * GIB)} | {_median_step(runs):.3f} s | "
            f"{_median_step(runs) / base:.2f}x | {low:.3f} s | {low / fastest:.2f}x | "
            f"{', '.join(f'{x:.2f}' for x in ratios)} | "
            f"{pools} | {_mib(med['predicted_peak'])} | {_mib(med['peak_rss'])} | "
            f"{_mib(med['peak_anon'])} | {_mib(med['peak_file'])} |"
        )
    least = refusal.get("least_gib")
    out.append(
        f"| layer_half (whole layers only) | {_mib(refusal['budget_gib'] * GIB)} | refused | - | "
        f"- | - | - | least it can work with: {'-' if least is None else _mib(least * GIB)} | - | - | - "
        "| - |"
    )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a small model, one repeat")
    parser.add_argument("--json", help="write every run's row here")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    if args.child:
        print("JSON:" + json.dumps(child(json.loads(args.child))), flush=True)
        return
    model = QUICK if args.quick else SPEC
    timing = {"warmup": 2, "window": 2, "windows": 1} if args.quick else {
        "warmup": 2, "window": 3, "windows": 3}  # fmt: skip
    untimed = {"warmup": 0, "window": 0, "windows": 0}  # initialize only
    repeats = 1 if args.quick else args.repeats

    probe = run({**model, **untimed, "variant": "probe"}, args.timeout)
    budget = probe["predicted_peak"] + MARGIN
    held = probe["held"] + MARGIN
    half = held + (budget - held) // 2
    if half < probe["least_peak"] + MARGIN:  # the largest cut the sliced pools still fit
        print(f"half of the pools' share ({_mib(half)}) is below the least the sliced run can "
              f"work with: {_mib(probe['least_peak'] + MARGIN)} instead", flush=True)  # fmt: skip
        half = probe["least_peak"] + MARGIN
    slice_mb = round(probe["layer_record"] / 4 / MIB, 1)
    print(f"probe: B = {_mib(budget)} (predicted {_mib(probe['predicted_peak'])} + margin), "
          f"held {_mib(held)}, half of the pools' share: {_mib(half)}; a layer's record "
          f"{_mib(probe['layer_record'])}, slices of {slice_mb} MiB", flush=True)  # fmt: skip
    specs = {
        "layer": {"host_memory_gb": budget / GIB},
        "sliced": {"host_memory_gb": budget / GIB, "slice_mb": slice_mb},
        # as many slices as the layer pool's buffers hold layers: the same bytes read ahead
        "sliced_deep": {
            "host_memory_gb": budget / GIB,
            "slice_mb": slice_mb,
            "optimizer_buffers": BUFFERS * math.ceil(probe["layer_record"] / (slice_mb * MIB)),
        },
        "sliced_half": {"host_memory_gb": half / GIB, "slice_mb": slice_mb},
    }
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in TIMED}
    for repeat in range(repeats):
        for i in range(len(TIMED)):  # the order rotates: no variant always runs first
            name = TIMED[(i + repeat) % len(TIMED)]
            r = run({**model, **timing, **specs[name], "variant": name}, args.timeout)
            assert not r["refused"], r
            rows[name].append(r)
            print(json.dumps({"repeat": repeat, **{k: v for k, v in r.items() if k != "losses"}}),
                  flush=True)  # fmt: skip
    # the default (no optimizer_slice_mb) at the half budget: what the preflight slices to
    auto = run({**model, **untimed, "host_memory_gb": half / GIB, "variant": "auto_half"},
               args.timeout)  # fmt: skip
    print(json.dumps(auto), flush=True)
    refusal = run({**model, **untimed, "host_memory_gb": half / GIB, "whole_only": True,
                   "variant": "layer_half"}, args.timeout)  # fmt: skip
    print(json.dumps(refusal), flush=True)

    # the claims the table rests on
    first = rows["layer"][0]["losses"]
    for name, runs in rows.items():
        for r in runs:
            assert r["losses"] == first, (name, r["losses"], first)
    for r in rows["layer"]:
        assert r["counts"] == probe["counts"], ("layer pools shrank at B", r["counts"])
    for r in rows.get("sliced_deep", []):  # its buffers fit B: none was given back
        assert r["counts"]["optimizer"] == specs["sliced_deep"]["optimizer_buffers"], r["counts"]
    assert not auto["refused"] and auto["counts"]["optimizer_slice"], auto
    assert refusal["refused"], "whole-layer pools ran at half the budget"
    print(f"losses bit-identical across {sum(map(len, rows.values()))} runs: {first}")
    print(table(rows, refusal))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "probe": probe, "rows": rows, "auto": auto,
                       "refusal": refusal}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
