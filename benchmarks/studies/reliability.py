"""Errors at the door, tried as a new user would: each bad input and what the user sees.

    python benchmarks/studies/reliability.py BENCH, BENCH one of:

    table    markdown rows: bad input -> error type and message
    guard    cost of on_nonfinite "raise" vs "ignore" (clip 0)
    journal  cost of the step journal, on vs off
    faults   markdown rows: each fault -> what the user sees

``table`` runs every bad input of issue 13 item 4 on a tiny Qwen3 (2 layers, vocab 128, cpu:2)
and prints what ``rp_engine`` raises, and whether the engine's weights stayed as they were.
``guard`` times training steps with the non-finite guard on and off, interleaved (A B A B ...):
with gradient clipping off, the guard makes each layer's update wait for the step's global norm.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    os.path.join(os.path.expanduser("~"), ".cache", "rp_engine", "torch_extensions"),
)

from tests.support.engine_helpers import config, engine_for  # noqa: E402
from tests.support.models import random_batch, tiny_qwen3  # noqa: E402


def _engine(model: Any = None, **kw: Any) -> Any:
    return engine_for(model or tiny_qwen3(layers=2), config(gas=2, mbs=2, **kw))


def _state(e: Any) -> list[torch.Tensor]:
    e.synchronize()
    return [hp.master.clone() for hp in e.store.owned_params()]


def _unchanged(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        torch.allclose(x, y, rtol=0, atol=0, equal_nan=True) for x, y in zip(a, b, strict=True)
    )


def _outcome(e: Any, fn: Callable[[], Any]) -> tuple[str, bool]:
    before = _state(e)
    try:
        fn()
        seen = "no error"
    except Exception as exc:  # noqa: BLE001 - what the user sees is the point
        seen = f"{type(exc).__name__}: {exc}"
    return seen, _unchanged(before, _state(e))


def table(_args: argparse.Namespace) -> list[dict[str, Any]]:
    good = random_batch(128)
    rows: list[dict[str, Any]] = []
    e = _engine()
    try:
        e.train_batch(iter([good, good]))
        batches = {
            "1-D input_ids": {"input_ids": good["input_ids"][0], "labels": good["labels"][0]},
            "token id outside the vocabulary": {**good, "input_ids": good["input_ids"] + 200},
            "labels of another shape": {**good, "labels": good["labels"][:, :8]},
            "float input_ids": {**good, "input_ids": good["input_ids"].float()},
            "int32 labels": {**good, "labels": good["labels"].int()},
            "attention_mask of another shape": {**good, "attention_mask": torch.ones(2, 15)},
        }
        for name, bad in batches.items():
            seen, same = _outcome(e, lambda bad=bad: e.train_batch(iter([good, bad])))
            rows.append({"input": name, "seen": seen, "weights_unchanged": same})
        with tempfile.TemporaryDirectory() as tmp:
            e.save_checkpoint(tmp, tag="t")
            cut = os.path.join(tmp + "_cut")
            shutil.copytree(tmp, cut)
            path = os.path.join(cut, "t", "mp_rank_00_model_states.pt")
            data = Path(path).read_bytes()
            Path(path).write_bytes(data[: len(data) // 2])
            seen, same = _outcome(e, lambda: e.load_checkpoint(cut))
            rows.append(
                {"input": "truncated checkpoint file", "seen": seen, "weights_unchanged": same}
            )
            shutil.rmtree(cut)
            other = _engine(tiny_qwen3(layers=2, vocab=256))
            try:
                seen, same = _outcome(other, lambda: other.load_checkpoint(tmp))
            finally:
                other.destroy()
            rows.append(
                {
                    "input": "checkpoint of another model shape",
                    "seen": seen,
                    "weights_unchanged": same,
                }
            )
    finally:
        e.destroy()
    nan_model = tiny_qwen3(layers=2)
    with torch.no_grad():
        nan_model.model.layers[1].mlp.down_proj.weight.fill_(float("nan"))
    e = _engine(nan_model)
    try:
        seen, same = _outcome(e, lambda: e.train_batch(iter([good, good])))
        rows.append({"input": "NaN weights, bf16/fp32 (default 'raise')", "seen": seen,
                     "weights_unchanged": same})  # fmt: skip
    finally:
        e.destroy()
    for row in rows:
        print(json.dumps(row))
    return rows


def guard(args: argparse.Namespace) -> dict[str, Any]:
    batches = [random_batch(128, batch=2, seq=64, seed=i) for i in range(2)]
    engines = {
        mode: engine_for(
            tiny_qwen3(layers=4, hidden=256),
            config(gas=2, mbs=2, clip=0.0, roundpipe={"on_nonfinite": mode}),
        )
        for mode in ("raise", "ignore")
    }
    times: dict[str, list[float]] = {m: [] for m in engines}
    try:
        for e in engines.values():
            e.train_batch(iter(batches))  # warm-up (and the profiled iterations)
            e.train_batch(iter(batches))
        for _ in range(args.repeats):
            for mode, e in engines.items():
                t = time.perf_counter()
                e.train_batch(iter(batches))
                e.synchronize()
                times[mode].append(time.perf_counter() - t)
    finally:
        for e in engines.values():
            e.destroy()
    med = {m: statistics.median(v) for m, v in times.items()}
    out = {
        "raise_s": med["raise"],
        "ignore_s": med["ignore"],
        "ratio": med["raise"] / med["ignore"],
    }
    print(json.dumps(out))
    return out


def journal(args: argparse.Namespace) -> dict[str, Any]:
    """Cost of the step journal (the undo log of a failed optimizer step), side by side.

    ``optimizer``: the host Adam step alone (DeepSpeed CPU Adam kernel, ``--layers`` layers of
    ``--mparams`` M parameters in all, journal record before each layer + commit vs none),
    interleaved, median. ``engine``: whole sync-optimizer training steps of a Qwen3 (4 layers,
    hidden 256, seq 64, cpu:2), where the optimizer is on the critical path, journal on vs off.
    """
    from rp_engine.optim.loss_scaler import LossScaler
    from rp_engine.optim.optimizer import HostOptimizer, build_inner_optimizer
    from rp_engine.optim.step_journal import StepJournal

    n = args.mparams * 1_000_000 // args.layers
    masters = [torch.randn(n) * 0.02 for _ in range(args.layers)]
    for m in masters:
        m.grad = torch.randn(n) * 1e-3
    groups = [{"params": masters}]
    inner, _ = build_inner_optimizer("adamw", {"lr": 1e-4, "weight_decay": 0.0}, groups)
    opt = HostOptimizer(inner, per_layer=True, scaler=LossScaler())
    book = StepJournal(opt)
    snap = opt.snapshot()
    times: dict[str, list[float]] = {"off": [], "on": []}
    step = 0
    for i in range(args.repeats + 1):
        for mode in ("off", "on"):
            step += 1
            t = time.perf_counter()
            for layer, m in enumerate(masters):
                if mode == "on":
                    book.record(step, layer, [m])
                opt.step_params([m], groups=snap, grad_coef=1.0)
            book.commit(step)
            if i:  # the first round allocates the moments and the journal's buffers
                times[mode].append(time.perf_counter() - t)
    med = {m: statistics.median(v) for m, v in times.items()}
    out: dict[str, Any] = {
        "optimizer_params_m": args.mparams,
        "optimizer_off_s": med["off"],
        "optimizer_on_s": med["on"],
        "optimizer_ratio": med["on"] / med["off"],
        "journal_bytes_per_param": book.nbytes / (n * args.layers),
    }
    batches = [random_batch(128, batch=2, seq=64, seed=i) for i in range(2)]
    engines = {
        mode: engine_for(
            tiny_qwen3(layers=4, hidden=256), config(gas=2, mbs=2, roundpipe={"step_journal": mode})
        )
        for mode in ("off", "on")
    }
    steps: dict[str, list[float]] = {m: [] for m in engines}
    try:
        for e in engines.values():
            e.train_batch(iter(batches))  # warm-up (and the profiled iterations)
            e.train_batch(iter(batches))
        for _ in range(args.repeats):
            for mode, e in engines.items():
                t = time.perf_counter()
                e.train_batch(iter(batches))
                steps[mode].append(time.perf_counter() - t)
    finally:
        for e in engines.values():
            e.destroy()
    emed = {m: statistics.median(v) for m, v in steps.items()}
    out.update(
        engine_off_s=emed["off"], engine_on_s=emed["on"], engine_ratio=emed["on"] / emed["off"]
    )
    print(json.dumps(out))
    return out


def _full_state(e: Any) -> list[torch.Tensor]:
    """Masters, optimizer moments/step counts and compute weights (copies)."""
    out = []
    for hp in e.store.owned_params():
        out += [hp.master.clone(), hp.param.detach().clone()]
        out += [torch.as_tensor(v).clone() for v in e.optimizer.state.get(hp.master, {}).values()]
    return out


def _half_way_fault(e: Any) -> None:
    real, half = e.optimizer.step_params, len(e.store.layers) // 2
    owner = {id(hp.master): hp.layer for hp in e.store.owned_params()}

    def failing(params: list[torch.Tensor], **kw: Any) -> None:
        if owner[id(params[0])] == half:
            real(params[:1], **kw)
            raise ValueError("injected optimizer fault")
        real(params, **kw)

    e.optimizer.step_params = failing


def faults(_args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each fault of issue 13 item 5 that runs in one process: what the user sees, and whether
    masters, moments and compute weights are those of the step before (the kill -9 and signal
    rows come from their tests, see RESULTS.md)."""
    good = [random_batch(128, seed=i) for i in range(2)]
    rows: list[dict[str, Any]] = []
    cases = [
        ("optimizer exception half-way through a step, sync", False, {}),
        ("optimizer exception half-way through a step, async", True, {}),
        ("same, step_journal off (the behaviour before)", False, {"step_journal": "off"}),
    ]
    for name, async_opt, rp in cases:
        e = _engine(async_optimizer=async_opt, roundpipe=rp)
        try:
            e.train_batch(iter(good))
            e.synchronize()
            before = _full_state(e)
            _half_way_fault(e)
            try:
                e.train_batch(iter(good))
                e.synchronize()
                seen = "no error"
            except Exception as exc:  # noqa: BLE001 - what the user sees is the point
                seen = f"{type(exc).__name__}: {exc}"
            same = _unchanged(before, _full_state(e))
            rows.append({"fault": name, "seen": seen, "nothing_lost": same})
        finally:
            e.destroy()
    e = _engine(roundpipe={"on_nonfinite": "ignore"}, clip=0.0)
    try:
        e.train_batch(iter(good))
        before = _full_state(e)
        ready, issued = e.stepper.layer_ready, []

        def fail_last(layer: int) -> None:
            if len(issued) == len(e.store.layers) - 1:
                e.stepper.wait_all()
                raise RuntimeError("injected device fault")
            issued.append(layer)
            ready(layer)

        e.stepper.layer_ready = fail_last
        seen, _ = _outcome(e, lambda: e.train_batch(iter(good)))
        rows.append({"fault": "device failure after layers stepped (per-layer stepping)",
                     "seen": seen, "nothing_lost": _unchanged(before, _full_state(e))})  # fmt: skip
    finally:
        e.destroy()
    from rp_engine import host_preflight

    real_available = host_preflight.available_bytes
    host_preflight.available_bytes = lambda: 1 << 20  # a 1 MiB host
    try:
        seen, _ = _outcome_no_engine(lambda: _engine().destroy())
    finally:
        host_preflight.available_bytes = real_available
    rows.append({"fault": "host too small (available memory patched to 1 MiB)", "seen": seen,
                 "nothing_lost": "n/a"})  # fmt: skip
    for row in rows:
        print(json.dumps(row))
    return rows


def _outcome_no_engine(fn: Callable[[], Any]) -> tuple[str, bool]:
    try:
        fn()
        return "no error", True
    except Exception as exc:  # noqa: BLE001 - what the user sees is the point
        return f"{type(exc).__name__}: {exc}", True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("table")
    g = sub.add_parser("guard")
    g.add_argument("--repeats", type=int, default=10)
    j = sub.add_parser("journal")
    j.add_argument("--repeats", type=int, default=10)
    j.add_argument("--mparams", type=int, default=64, help="optimizer benchmark size, M params")
    j.add_argument("--layers", type=int, default=8)
    sub.add_parser("faults")
    args = parser.parse_args()
    {"table": table, "guard": guard, "journal": journal, "faults": faults}[args.what](args)


if __name__ == "__main__":
    main()
