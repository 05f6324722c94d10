"""Head-to-head on one machine: rp_engine (async, sync) vs DeepSpeed ZeRO-Infinity vs plain PyTorch.

    python benchmarks/gpu_head_to_head.py                 # Qwen3-1.7B shape on the GPU
    python benchmarks/gpu_head_to_head.py --shape tiny    # a tiny Qwen3 on CPU (harness check)

Every system gets the same model (random weights from one config and seed), the same data, the
same optimizer (AdamW, lr 1e-4, betas 0.9/0.95, clipping 1.0) and, where it reads one, the same
ds_config (ZeRO-3 with params and optimizer offloaded to pinned CPU memory). Each system runs in
its own process (a clean device and process group), warms up, then times one window of steps
synchronised only at its two ends (per-step synchronisation would hide the async optimizer).
One JSON line per system on stdout: tokens_per_s, s_per_step, final_loss, peak_device_gb,
peak_host_gb, and for rp_engine the last step's bytes and device busy fraction.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3-1.7B (public config), random weights: 1.72 B parameters
    "qwen3-1.7b": {
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "tie_word_embeddings": True, "mbs": 4, "seq": 1024, "gas": 4,
        "dtype": "bf16", "device_memory_gb": 24,
    },
    "tiny": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 256, "tie_word_embeddings": True, "mbs": 2, "seq": 32, "gas": 4,
        "dtype": "fp32", "device_memory_gb": None,
    },
}  # fmt: skip
SYSTEMS = ("torch", "deepspeed", "roundpipe", "roundpipe_sync")


def ds_config(shape: dict[str, Any], *, devices: str | None) -> dict[str, Any]:
    """The one config every system reads (DeepSpeed ignores the "roundpipe" section)."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": shape["mbs"],
        "gradient_accumulation_steps": shape["gas"],
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95]}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "roundpipe": {"devices": devices},
    }
    if shape["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    if shape["device_memory_gb"]:
        cfg["roundpipe"]["device_memory_gb"] = shape["device_memory_gb"]
    return cfg


def build_model(shape: dict[str, Any]) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    keys = ("mbs", "seq", "gas", "dtype", "device_memory_gb")
    config = Qwen3Config(**{k: v for k, v in shape.items() if k not in keys}, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def batches(shape: dict[str, Any], n: int) -> list[dict[str, Any]]:
    import torch

    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, shape["vocab_size"], (shape["mbs"], shape["seq"]), generator=gen)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def run_system(system: str, shape: dict[str, Any], *, warmup: int, steps: int) -> dict[str, Any]:
    import psutil
    import torch

    cuda = torch.cuda.is_available()
    data = batches(shape, (warmup + steps) * shape["gas"])
    step_fn, sync, extra = _SETUP[system](shape, data, cuda)
    for _ in range(warmup):
        step_fn()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    loss = 0.0
    for _ in range(steps):
        loss = step_fn()
    sync()
    seconds = time.perf_counter() - start
    tokens = steps * shape["gas"] * shape["mbs"] * shape["seq"]
    row = {
        "system": system,
        "tokens_per_s": tokens / seconds,
        "s_per_step": seconds / steps,
        "final_loss": float(loss),
        "peak_device_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        "peak_host_gb": psutil.Process().memory_info().rss / 1e9,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }
    row.update(extra())
    return row


def _torch(shape: dict[str, Any], data: list[Any], cuda: bool) -> tuple[Any, Any, Any]:
    """The ceiling: everything on the device, AMP bf16 where configured, no recomputation."""
    import torch

    dev = torch.device("cuda" if cuda else "cpu")
    model = build_model(shape).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=cuda)
    it = iter(data)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=shape["dtype"] == "bf16")

    def step() -> float:
        total = 0.0
        for _ in range(shape["gas"]):
            batch = {k: v.to(dev, non_blocking=True) for k, v in next(it).items()}
            with amp:
                loss = model(**batch).loss / shape["gas"]
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total  # a device tensor: no synchronisation inside the window

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    return step, sync, dict


def _deepspeed(shape: dict[str, Any], data: list[Any], cuda: bool) -> tuple[Any, Any, Any]:
    import torch

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    import deepspeed

    model = build_model(shape)
    cfg = ds_config(shape, devices=None)
    cfg.pop("roundpipe")
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    it = iter(data)
    dev = engine.device

    def step() -> float:
        total = 0.0
        for _ in range(shape["gas"]):
            batch = {k: v.to(dev) for k, v in next(it).items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach() / shape["gas"]
        return total

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    return step, sync, dict


def _roundpipe(async_optimizer: bool) -> Any:
    def setup(shape: dict[str, Any], data: list[Any], cuda: bool) -> tuple[Any, Any, Any]:
        import rp_engine

        cfg = ds_config(shape, devices="cuda" if cuda else "cpu:2")
        cfg["roundpipe"]["async_optimizer"] = async_optimizer
        engine, _, _, _ = rp_engine.initialize(model=build_model(shape), config=cfg)
        it = iter(data)

        def extra() -> dict[str, Any]:
            stats = engine.last_step_stats()
            plan = engine.planner
            return {
                "last_step": stats,
                "cuts": [list(plan.fwd_cuts), list(plan.bwd_cuts)],
                "round_size": plan.round_size,
            }

        return (lambda: engine.train_batch(it)), engine.synchronize, extra

    return setup


_SETUP = {
    "torch": _torch,
    "deepspeed": _deepspeed,
    "roundpipe": _roundpipe(True),
    "roundpipe_sync": _roundpipe(False),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--system", help=argparse.SUPPRESS)  # the child process's one system
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    if args.system:
        row = run_system(args.system, shape, warmup=args.warmup, steps=args.steps)
        print("JSON:" + json.dumps({"shape": args.shape, **row}), flush=True)
        return 0
    rows = {}
    for system in args.systems.split(","):
        cmd = [sys.executable, __file__, "--shape", args.shape, "--system", system]
        cmd += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON:")]
        if proc.returncode or not lines:
            row = {"system": system, "error": proc.stderr.strip().splitlines()[-5:]}
        else:
            row = json.loads(lines[-1][5:])
        rows[system] = row
        print(json.dumps(row), flush=True)
    ds = rows.get("deepspeed", {}).get("tokens_per_s")
    if ds:
        ratios = {k: r["tokens_per_s"] / ds for k, r in rows.items() if "tokens_per_s" in r}
        print(json.dumps({"ratios_to_deepspeed": ratios}), flush=True)
    return 0 if all("error" not in r for r in rows.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
