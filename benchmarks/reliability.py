"""Errors at the door, tried as a new user would: each bad input and what the user sees.

    python benchmarks/reliability.py table    # markdown rows: bad input -> error type and message
    python benchmarks/reliability.py guard    # cost of on_nonfinite "raise" vs "ignore" (clip 0)

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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    os.path.join(os.path.expanduser("~"), ".cache", "rp_engine", "torch_extensions"),
)

from tests.engine_helpers import config, engine_for  # noqa: E402
from tests.models import random_batch, tiny_qwen3  # noqa: E402


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("table")
    g = sub.add_parser("guard")
    g.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    {"table": table, "guard": guard}[args.what](args)


if __name__ == "__main__":
    main()
