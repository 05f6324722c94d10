"""NVMe tiers: the disk's raw bandwidth, what the tiers achieve of it, and what they cost.

    python -m benchmarks.nvme_bench                       # CPU, ~6 min on 2 cores
    python -m benchmarks.nvme_bench --quick --out q.json  # tiny sizes (the smoke test's)
    python -m benchmarks.nvme_bench --io-engine threads   # the tier on the built-in engine
    python -m benchmarks.nvme_bench --ram-layers ""       # without (f)

One run measures, in this order of the report:

(a) **raw**: the disk's O_DIRECT bandwidth under ``--dir`` (default /tmp/rp_nvme_bench; /work
    here is a virtual disk), one stream, ``os.pwritev``/``os.preadv`` from one
    ``rp_engine.storage.aligned_empty`` buffer, 1, 2 and 4 MiB blocks, over a 256 MB file
    (8 MB with ``--quick``; filled once untimed first, so no timed pass allocates blocks). Each
    pass writes (one ``fsync`` at its end) then reads the whole file; MB/s is the median over 3
    passes (1 with ``--quick``).
(b) **tier**: the tier's bandwidth while training, from the differences of
    ``engine.nvme_tier.stats`` over the timed window: (read + write bytes) / ``busy_s`` (wall
    time with at least one tier I/O in flight), and read and write bytes each over the same
    ``busy_s``, each as a ratio to the raw figure at the tier's block size (``aio.block_size``,
    1 MiB by default): read/raw read, write/raw write, and together the *efficiency*, the
    fraction of the tier's busy time the raw single stream would need for the same bytes (the
    sum of the two ratios). Bytes read and written per optimizer step too (SSD wear).
(c) **tier vs host-resident**: tokens/s of rp_engine with the optimizer tier on NVMe
    (``offload_optimizer.device: "nvme"``) against the same engine with the state in RAM, the
    same model and config otherwise (``step_journal: "off"`` in both), driven by
    ``engine.train_batch`` with its default overlap, with ``async_optimizer`` true (the main
    figure) and false; the tier's I/O engine is ``--io-engine`` ("auto": DeepSpeed's aio op when
    it is built, else the built-in O_DIRECT threads). The model is chosen so that one step's minimum I/O (12 B read + 12 B
    written per trainable parameter at the raw bandwidth of (a)) is shorter than one
    iteration's compute (the host-resident step); the report prints that estimate.
    With the optimizer tier the fp32 gradients live in a bounded pool of layer-sized buffers
    spilling to a gradient file (storage/grad_tier.py; ``roundpipe.grad_buffers`` null, the
    default): "tier_async" and "tier_sync" are that, the bounded tier. "tier_arena_async" is the
    previous tier, ``grad_buffers: 0`` (a whole-model fp32 gradient arena in RAM), async; the
    report gives the bounded tier's tokens/s over the previous tier's, the gradient tier's own
    bytes per step over the window (``engine.grad_tier.stats``: its spills and read-backs; they
    are part of the tier's bytes in (b), which sum every tier's ``IOStats``, busy time included,
    so where two tiers' I/O overlaps (b)'s busy time counts it twice), and each variant's s/step
    and peak RSS.
(d) **DeepSpeed ZeRO-3** with the same NVMe offload config (``offload_optimizer`` nvme, its aio
    op, the same ``aio`` section) on the same model, CPU accelerator, one process: tokens/s
    ratio rp_engine (tier, async) / DeepSpeed. When DeepSpeed's NVMe path fails here, the
    error's first lines are reported in place of the number.

(e) **both tiers**: rp_engine with the compute weights on NVMe too (``offload_param.device:
    "nvme"``, ``max_in_cpu`` 0: storage/param_tier.py), async, against host-resident, and
    DeepSpeed ZeRO-3 with the same ``offload_param`` + ``offload_optimizer`` NVMe config. Three
    swap files: optimizer.swp, grads.swp, params.swp.
(f) **RAM against the state, at two sizes**: ``benchmarks.bounded_ram.run`` (a bf16 Qwen2,
    both tiers on NVMe under ``--dir``, cpu:2 with 0.06 GB each, 2 steps, its own process) at
    two depths (``--ram-layers``, default 48 and 96 layers of hidden 512, vocab 8192; with
    ``--quick`` 8 and 16 layers of hidden 128, vocab 1024), and the same model host-resident at
    the smaller depth. Per run: parameters, training state (18 B/param), peak RSS of the whole
    run (VmHWM, ``common.peak_rss``), the training peak, peak / state; and the growth of the peak between the
    two depths over the state added (the issue's bar: under 10 %).

Every training run is its own process (so VmHWM is that run's peak RSS); the variants
alternate (A B C D E F, ``--repeats`` times) so drift hits all alike; each warms up, then times
one window of ``--steps`` steps synchronised only at its two ends (``engine.synchronize()``,
which also waits for the tier's write-backs). Medians over repeats. Also reported per run: the
bytes the process read and wrote on storage (``/proc/self/io``) per step, DeepSpeed's included.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.common import machine_info, one_rank_env, peak_rss
from rp_engine.host.memory_limit import status_bytes

DEFAULT_JSON = Path(__file__).resolve().parent / "data" / "nvme_bench.json"
DEFAULT_DIR = "/tmp/rp_nvme_bench"
ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
RAW_BLOCKS_MIB = (1, 2, 4)

# variant: (optimizer state on NVMe, async optimizer, compute weights on NVMe too,
# roundpipe.grad_buffers: None the engine's default, the bounded gradient pool with the tier;
# 0 the whole-model gradient arena, the previous tier); the DeepSpeed systems follow:
# optimizer on NVMe, and both (offload_param too)
RP_VARIANTS: dict[str, tuple[bool, bool, bool, int | None]] = {
    "tier_async": (True, True, False, None),
    "tier_arena_async": (True, True, False, 0),
    "host_async": (False, True, False, None),
    "tier_sync": (True, False, False, None),
    "host_sync": (False, False, False, None),
    "both_async": (True, True, True, None),
}
DS_VARIANTS: dict[str, bool] = {"deepspeed": False, "deepspeed_both": True}  # offload_param?
SYSTEMS = (*RP_VARIANTS, *DS_VARIANTS)

# Qwen3-shaped models with random weights. "full": 15.3 M trainable parameters, 368 MB of tier
# I/O per step (0.2-0.6 s at the 0.65-2 GB/s this virtual disk has shown) against 2-3 s of
# compute per iteration on 2 cores: one step's I/O fits well inside one iteration, as it must for
# the async tier to hide it (the report prints the check). "quick": the smoke test's.
PRESETS: dict[str, dict[str, Any]] = {
    "full": {
        "hidden_size": 384, "intermediate_size": 1152, "num_hidden_layers": 8,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 4096, "tie_word_embeddings": True, "mbs": 2, "seq": 192, "gas": 2,
        "warmup": 2, "steps": 3, "repeats": 2, "raw_mb": 256, "raw_passes": 3,
    },
    "quick": {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "vocab_size": 128, "tie_word_embeddings": True, "mbs": 1, "seq": 16, "gas": 2,
        "warmup": 1, "steps": 2, "repeats": 1, "raw_mb": 8, "raw_passes": 1,
    },
}  # fmt: skip
_RUN_KEYS = ("mbs", "seq", "gas", "warmup", "steps", "repeats", "raw_mb", "raw_passes")

# (f): bounded_ram's model and run; --ram-layers gives the depths
RAM_SPECS: dict[str, dict[str, Any]] = {
    "full": {"layers": (48, 96), "hidden": 512, "vocab": 8192, "device_memory_gb": 0.06,
             "steps": 2},
    "quick": {"layers": (8, 16), "hidden": 128, "vocab": 1024, "device_memory_gb": 0.06,
              "steps": 2},
}  # fmt: skip

# the top-level "aio" section both systems read (DeepSpeed's defaults, written out)
AIO = {
    "block_size": MIB,
    "queue_depth": 8,
    "intra_op_parallelism": 1,
    "single_submit": False,
    "overlap_events": True,
}


# ---- (a) the disk's raw bandwidth -------------------------------------------------------------
def raw_bandwidth(
    folder: Path, file_bytes: int, blocks_mib: tuple[int, ...] = RAW_BLOCKS_MIB, passes: int = 3
) -> dict[str, Any]:
    """O_DIRECT single-stream write and read MB/s per block size on a ``file_bytes`` file in
    ``folder`` (removed afterwards). Returns ``{"file_bytes", "passes", "blocks": {"<MiB>":
    {"block_bytes", "write_MBps", "read_MBps", "write_MBps_passes", "read_MBps_passes"}}}``
    (MB = 1e6 bytes; the figures are medians over passes). Raises ``OSError`` where the
    filesystem refuses O_DIRECT (the report would not be the disk's)."""
    import torch

    from rp_engine.storage import aligned_empty

    biggest = max(blocks_mib) * MIB
    file_bytes = max(biggest, file_bytes - file_bytes % biggest)  # whole blocks of every size
    path = folder / "raw_bandwidth.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        buffers = {}
        gen = torch.Generator().manual_seed(0)
        for mib in blocks_mib:  # random bytes: nothing below can compress or dedupe them
            buf = aligned_empty(mib * MIB)
            buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8, generator=gen))
            buffers[mib] = memoryview(buf.numpy()).cast("B")
        _pass(fd, buffers[max(blocks_mib)], file_bytes, write=True)  # allocate, untimed
        os.fsync(fd)
        times: dict[int, dict[str, list[float]]] = {
            m: {"write": [], "read": []} for m in blocks_mib
        }
        for _ in range(passes):  # pass-major: a slow spell of the disk hits every block size
            for mib in blocks_mib:
                start = time.perf_counter()
                _pass(fd, buffers[mib], file_bytes, write=True)
                os.fsync(fd)  # O_DIRECT needs none for the data; the metadata is flushed once
                times[mib]["write"].append(time.perf_counter() - start)
                start = time.perf_counter()
                _pass(fd, buffers[mib], file_bytes, write=False)
                times[mib]["read"].append(time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    blocks = {}
    for mib, t in times.items():
        w = [file_bytes / s / 1e6 for s in t["write"]]
        r = [file_bytes / s / 1e6 for s in t["read"]]
        blocks[str(mib)] = {
            "block_bytes": mib * MIB,
            "write_MBps": statistics.median(w),
            "read_MBps": statistics.median(r),
            "write_MBps_passes": w,
            "read_MBps_passes": r,
        }
    return {"file_bytes": file_bytes, "passes": passes, "blocks": blocks}


def _pass(fd: int, view: memoryview, file_bytes: int, *, write: bool) -> None:
    """One sequential pass over the file in ``len(view)``-byte blocks."""
    block = len(view)
    for offset in range(0, file_bytes, block):
        if write:
            done = 0
            while done < block:  # a short write: continue where it stopped
                done += os.pwritev(fd, [view[done:]], offset + done)
        elif os.preadv(fd, [view], offset) != block:
            raise OSError(f"short read at {offset}")


# ---- the model, data and configs ------------------------------------------------------------
def build_model(preset: dict[str, Any]) -> Any:
    """The preset's Qwen3ForCausalLM, random weights from seed 0, fp32, SDPA attention."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    keys = {k: v for k, v in preset.items() if k not in _RUN_KEYS}
    config = Qwen3Config(**keys, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def batches(preset: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """``n`` micro-batches of random tokens (one seed: the same for every system)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, preset["vocab_size"], (preset["mbs"], preset["seq"]), generator=gen)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def ds_config(
    preset: dict[str, Any], *, nvme_path: str | None, params: bool = False, param_buffers: int = 5
) -> dict[str, Any]:
    """The DeepSpeed config both systems read: ZeRO-3, AdamW, clipping 1.0, fp32; the optimizer
    state on NVMe under ``nvme_path`` (4 buffers, the "aio" section above), or in host RAM when
    None; ``params``: the parameters on NVMe too (``offload_param``, nothing kept in RAM by
    ``max_in_cpu``) with ``param_buffers`` buffers (DeepSpeed's default 5; its own run needs
    more, see ``_deepspeed``). The caller adds rp_engine's "roundpipe" section."""
    offload: dict[str, Any] = {"device": "cpu"}
    zero: dict[str, Any] = {"stage": 3, "offload_optimizer": offload}
    if nvme_path is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 4}
        if params:
            zero["offload_param"] = {
                "device": "nvme", "nvme_path": nvme_path, "buffer_count": param_buffers,
                "buffer_size": 2_000_000, "max_in_cpu": 0,
            }  # fmt: skip
    return {
        "train_micro_batch_size_per_gpu": preset["mbs"],
        "gradient_accumulation_steps": preset["gas"],
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95]}},
        "zero_optimization": zero,
        "aio": dict(AIO),
    }


def rp_config(
    preset: dict[str, Any], *, tier: bool, async_optimizer: bool, folder: Path, devices: str,
    io_engine: str = "auto", params: bool = False, grad_buffers: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """rp_engine's config of one variant: ``ds_config`` plus its "roundpipe" section. The undo
    journal is off in every variant (it would cost the host-resident runs 12 B/param more).
    ``io_engine``: the tier's ``nvme_io_engine`` ("auto": the aio op when built);
    ``grad_buffers``: ``roundpipe.grad_buffers`` (None: left out, the engine's default)."""
    cfg = ds_config(preset, nvme_path=str(folder / "rp_swap") if tier else None, params=params)
    cfg["roundpipe"] = {
        "devices": devices,
        "async_optimizer": async_optimizer,
        "step_journal": "off",
    }
    # "auto" is the default and is left out: written out, rp_engine refuses it as an unfilled
    # Hugging Face placeholder (config/auto.py does not list roundpipe.nvme_io_engine as legit)
    if io_engine != "auto":
        cfg["roundpipe"]["nvme_io_engine"] = io_engine
    if grad_buffers is not None:
        cfg["roundpipe"]["grad_buffers"] = grad_buffers
    return cfg


def _rss_mb() -> dict[str, float]:
    """This process's resident set now and its peak so far (``/proc/self/status`` VmRSS,
    VmHWM), MB (2**20 bytes), or {} where there is none."""
    found = {key: status_bytes(key) for key in ("VmRSS", "VmHWM")}
    return {key: value / 2**20 for key, value in found.items() if value is not None}


def _proc_io() -> dict[str, int]:
    """This process's storage-level bytes (``/proc/self/io``: read_bytes, write_bytes; O_DIRECT
    included), or {} where there is none."""
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
    except OSError:
        return {}
    pairs = (ln.split(": ") for ln in lines)
    return {k: int(v) for k, v in pairs if k in ("read_bytes", "write_bytes")}


# ---- one training run -----------------------------------------------------------------------
def run_system(
    system: str, preset: dict[str, Any], folder: Path, devices: str, io_engine: str = "auto"
) -> dict[str, Any]:
    """Warm up, then time ``preset["steps"]`` optimizer steps between two synchronisations.
    Returns tokens/s, s/step, losses, trainable parameters, the window's storage bytes per
    step, and (rp_engine with the tier) the tiers' I/O over the window (see (b)): every
    tier's summed ("tier_io") and the gradient tier's alone ("grad_io")."""
    t0 = time.perf_counter()
    model = build_model(preset)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    warmup, steps, gas = preset["warmup"], preset["steps"], preset["gas"]
    data = batches(preset, (warmup + steps) * gas)
    setup = _deepspeed if system in DS_VARIANTS else _rp_engine
    step_fn, sync, tier_stats, extra, close = setup(
        system, model, preset, data, folder, devices, io_engine
    )
    try:
        after_init = _rss_mb()
        t1 = time.perf_counter()
        losses = [step_fn() for _ in range(warmup)]
        sync()
        t2 = time.perf_counter()
        io0, proc0 = tier_stats(), _proc_io()
        start = time.perf_counter()
        losses += [step_fn() for _ in range(steps)]  # no synchronisation inside the window
        sync()
        seconds = time.perf_counter() - start
        io1, proc1, at_end = tier_stats(), _proc_io(), _rss_mb()
        row: dict[str, Any] = {
            "system": system,
            "tokens_per_s": steps * gas * preset["mbs"] * preset["seq"] / seconds,
            "s_per_step": seconds / steps,
            "step_losses": [float(x) for x in losses],
            "final_loss": float(losses[-1]),
            "trainable_params": trainable,
            "seconds": {"setup": t1 - t0, "warmup": t2 - t1, "window": seconds},
        }
        if after_init and at_end:  # where the peak is reached, and what training holds
            row["rss_mb"] = {
                "peak_after_initialize": after_init["VmHWM"],
                "peak_after_window": at_end["VmHWM"],
                "after_window": at_end["VmRSS"],
            }
        if proc0 and proc1:
            row["storage_read_bytes_per_step"] = (proc1["read_bytes"] - proc0["read_bytes"]) / steps
            row["storage_write_bytes_per_step"] = (
                proc1["write_bytes"] - proc0["write_bytes"]
            ) / steps
        if io0 is not None and io1 is not None:
            for key, before in io0.items():  # "tier": every tier's, summed; "grad": its own
                row[f"{key}_io"] = _io_window(io1[key].minus(before), steps)
        row.update(extra())
        return row
    finally:
        close()


def _io_window(io: Any, steps: int) -> dict[str, Any]:
    """The tier's I/O over the window (an ``IOStats`` difference) as a dict, per step too."""
    return {
        "read_bytes": io.read_bytes,
        "write_bytes": io.write_bytes,
        "busy_s": io.busy_s,
        "reads": io.reads,
        "writes": io.writes,
        "read_bytes_per_step": io.read_bytes / steps,
        "write_bytes_per_step": io.write_bytes / steps,
        "busy_s_per_step": io.busy_s / steps,
    }


def _rp_engine(
    system: str, model: Any, preset: dict, data: list, folder: Path, devices: str, io_engine: str
) -> tuple:
    """rp_engine's variant ``system``: (step, synchronize, tier stats or None, extra, close);
    the stats: ``{"tier": every tier's IOStats summed, "grad": the gradient tier's}`` (the
    latter only with the gradient tier)."""
    import rp_engine

    tier, async_optimizer, params, grad_buffers = RP_VARIANTS[system]
    (folder / "rp_swap").mkdir(parents=True, exist_ok=True)  # nvme_path must exist
    cfg = rp_config(
        preset, tier=tier, async_optimizer=async_optimizer, folder=folder, devices=devices,
        io_engine=io_engine, params=params, grad_buffers=grad_buffers,
    )  # fmt: skip
    engine, _, _, _ = rp_engine.initialize(model=model, config=cfg)
    it = iter(data)

    def step() -> Any:
        return engine.train_batch(it)  # a tensor: no synchronisation

    def tier_stats() -> dict[str, Any] | None:
        if not engine.tiers:
            return None
        out = {"tier": engine.tiers.stats}  # every tier's I/O, summed
        if engine.grad_tier is not None:
            out["grad"] = engine.grad_tier.stats
        return out

    def extra() -> dict[str, Any]:
        out: dict[str, Any] = {"last_step": engine.last_step_stats(), "config": cfg}
        if engine.tiers:
            t = engine.tiers
            out["tier"] = {
                "io_engine": t.tiers[0].engine.describe(),
                "path": [str(x.path) for x in t.tiers],
                "disk_bytes": t.disk_bytes,
                "buffer_bytes": sum(x.buffer_bytes for x in t.tiers),
                "block_size": cfg["aio"]["block_size"],
            }
        g = engine.grad_tier
        if g is not None:
            out["grad_tier"] = {
                "buffer_count": g.buffer_count,
                "big_count": g.big_count,
                "buffer_bytes": g.buffer_bytes,
                "disk_bytes": g.disk_bytes,
                "path": str(g.path),
            }
        return out

    return step, engine.synchronize, tier_stats, extra, engine.destroy


def aio_op_path() -> Path | None:
    """DeepSpeed's built aio op in the shared extensions cache (where rp_engine's install
    builds it), or None: DeepSpeed would otherwise JIT-build it, ~14 min on 2 cores."""
    cache = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "rp_engine", "torch_extensions"
    )
    path = Path(cache) / "async_io" / "async_io.so"
    return path if path.exists() else None


def _deepspeed(
    system: str, model: Any, preset: dict, data: list, folder: Path, devices: str, io_engine: str
) -> tuple:
    """DeepSpeed ZeRO-3, optimizer on NVMe, one rank on the CPU accelerator, its own loop
    (forward, backward, step per micro-batch): (step, synchronize, no tier stats, extra,
    close)."""
    if aio_op_path() is None:
        raise RuntimeError(
            "DeepSpeed's aio op is not built in the extensions cache (TORCH_EXTENSIONS_DIR); "
            "run `python -m rp_engine.storage.build_aio` first (a JIT build here takes ~14 min)"
        )
    one_rank_env()
    import deepspeed

    swap = folder / "ds_swap"
    swap.mkdir(parents=True, exist_ok=True)
    # DeepSpeed holds every parameter of the modules it gathers in one of its param buffers
    # at once: with 4 or 5 it stops ("Not enough buffers 0 for swapping 1"); each holds
    # buffer_size (2 M, this model's largest parameter) fp32 elements: 64 x 8 MB
    cfg = ds_config(preset, nvme_path=str(swap), params=DS_VARIANTS[system], param_buffers=64)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    it = iter(data)

    def step() -> Any:
        total = 0.0
        for _ in range(preset["gas"]):
            batch = next(it)
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach() / preset["gas"]
        return total

    def extra() -> dict[str, Any]:
        files = [p for p in swap.rglob("*") if p.is_file()]
        return {
            "config": cfg,
            "swap_files": len(files),
            "swap_bytes": sum(p.stat().st_size for p in files),
        }

    def close() -> None:
        engine.destroy()
        shutil.rmtree(swap, ignore_errors=True)

    return step, (lambda: None), (lambda: None), extra, close


def child_main(spec: dict[str, Any]) -> dict[str, Any]:
    """A run's process: the row of ``run_system`` plus its peak RSS, or ``{"system", "error":
    [first lines of the exception], "traceback": [its last lines]}``."""
    system = spec["system"]
    try:
        row = run_system(
            system,
            spec["preset"],
            Path(spec["dir"]),
            spec["devices"],
            spec.get("io_engine", "auto"),
        )
    except Exception as exc:  # reported in the table instead of a number
        text = f"{type(exc).__name__}: {exc}".strip().splitlines()
        return {
            "system": system,
            "error": text[:6],
            "traceback": traceback.format_exc().splitlines()[-12:],
        }
    row["peak_rss_mb"] = peak_rss() / 2**20
    return row


def run_child(spec: dict[str, Any], timeout: float, child_log: str | None) -> dict[str, Any]:
    """Run one system in its own interpreter; its row, or an error row with the first lines of
    its stderr's traceback when it died without one (a crash, a timeout)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    # sleeping OpenMP waits on a shared 2-core machine (benchmarks/common.py, child_json)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault(
        "TORCH_EXTENSIONS_DIR",
        os.path.join(os.path.expanduser("~"), ".cache", "rp_engine", "torch_extensions"),
    )
    # DeepSpeed's own aio op loads from that cache with the engine's ninja (jit_cache.py):
    # another one rebuilds it (minutes), and the engine's next load rebuilds it again
    from rp_engine.host.jit_cache import with_own_ninja

    env["PATH"] = with_own_ninja(env.get("PATH", ""))
    cmd = [sys.executable, "-m", "benchmarks.nvme_bench", "--child", json.dumps(spec)]
    system = spec["system"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:  # killed: the next run still gets its turn
        _log(child_log, system, exc.stderr)
        return {"system": system, "error": [f"timed out after {timeout:g} s"]}
    process_s = time.perf_counter() - start
    _log(child_log, system, proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON:")]
    if lines:
        row = json.loads(lines[-1][5:])
        row.setdefault("seconds", {})["process"] = process_s  # imports and teardown included
        return row
    err = proc.stderr.strip().splitlines()
    first = next((i for i, ln in enumerate(err) if ln.startswith("Traceback")), 0)
    return {"system": system, "error": (err[first:][-6:] or [f"exit status {proc.returncode}"])}


def _log(child_log: str | None, system: str, stderr: str | bytes | None) -> None:
    """Append a run's whole stderr to ``--child-log`` (set-up logs, tracebacks)."""
    if child_log:
        text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr or ""
        with open(child_log, "a") as f:
            f.write(f"---- {system} ----\n{text}\n")


# ---- (f) RAM against the state ---------------------------------------------------------------
def ram_vs_state(
    folder: Path, layers: tuple[int, ...], spec: dict[str, Any], io_engine: str = "auto",
    timeout: float = 1800,
) -> dict[str, Any]:  # fmt: skip
    """``bounded_ram.run`` of ``spec``'s model at each depth of ``layers`` with both tiers on
    NVMe under ``folder`` (a subfolder per run, removed after it), and host-resident at the
    smallest depth. Returns ``{"spec", "runs": {"tiers_<L>" | "host_<L>": {"layers", "tiers",
    "params", "state", "peak_rss", "init_peak", "train_peak", "model_rss", "import_rss",
    "peak_over_state", "final_loss"} or {"layers", "tiers", "error"}}, "growth"}``; ``growth``
    (the two smallest depths with both tiers): ``{"from", "to", "added_state", "peak_grew",
    "fraction"}``, the peak's growth over the state added."""
    from benchmarks import bounded_ram

    base = {k: v for k, v in spec.items() if k != "layers"}
    if io_engine != "auto":  # written out, "auto" is refused (see rp_config); bounded_ram's own
        base["io"] = io_engine  # default is the built-in threads engine
    plan = [(n, True) for n in layers] + ([(min(layers), False)] if layers else [])
    runs: dict[str, Any] = {}
    for n, tiers in plan:
        name = f"{'tiers' if tiers else 'host'}_{n}"
        run_dir = folder / f"ram_{name}"
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            out = bounded_ram.run(
                {**base, "layers": n, "tiers": tiers, "dir": str(run_dir)}, timeout=timeout
            )
        except Exception as exc:  # reported in the table instead of the numbers
            runs[name] = {"layers": n, "tiers": tiers,
                          "error": f"{type(exc).__name__}: {exc}".strip().splitlines()[-6:]}  # fmt: skip
        else:
            keys = ("params", "state", "peak_rss", "init_peak", "train_peak", "model_rss",
                    "import_rss")  # fmt: skip
            runs[name] = {"layers": n, "tiers": tiers, **{k: out[k] for k in keys}}
            runs[name]["peak_over_state"] = out["peak_rss"] / out["state"]
            runs[name]["final_loss"] = out["losses"][-1]
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
        brief = {k: runs[name].get(k) for k in ("params", "peak_rss", "state", "error")}
        print(f"(f) {name}: {json.dumps(brief)}", file=sys.stderr)
    result: dict[str, Any] = {"spec": spec, "runs": runs}
    depths = sorted(layers)
    if len(depths) >= 2:
        a, b = runs[f"tiers_{depths[0]}"], runs[f"tiers_{depths[1]}"]
        if "error" not in a and "error" not in b:
            added, grew = b["state"] - a["state"], b["peak_rss"] - a["peak_rss"]
            result["growth"] = {
                "from": depths[0], "to": depths[1], "added_state": added, "peak_grew": grew,
                "fraction": grew / added,
            }  # fmt: skip
    return result


# ---- aggregate and report -------------------------------------------------------------------
def aggregate(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per system: median tokens/s and s/step over repeats (and every repeat's), the maximum
    peak RSS, the median tier I/O figures, the last repeat's other fields."""
    systems: dict[str, Any] = {}
    for name, rows in runs.items():
        ok = [r for r in rows if "error" not in r]
        if not ok:
            systems[name] = {k: rows[-1][k] for k in ("error", "traceback") if k in rows[-1]}
            continue
        out = dict(ok[-1])
        tps = [r["tokens_per_s"] for r in ok]
        out.update(
            tokens_per_s=statistics.median(tps),
            tokens_per_s_runs=tps,
            s_per_step=statistics.median(r["s_per_step"] for r in ok),
        )
        rss = [r["peak_rss_mb"] for r in ok if r.get("peak_rss_mb") is not None]
        out["peak_rss_mb"] = max(rss) if rss else None
        for key in ("tier_io", "grad_io"):
            ios = [r[key] for r in ok if key in r]
            if ios:
                out[key] = {k: statistics.median(io[k] for io in ios) for k in ios[0]}
        systems[name] = out
    return systems


def tier_bandwidth(io: dict[str, Any], raw: dict[str, Any], block: int) -> dict[str, Any]:
    """(b) for one variant's window ``io``: MB/s over the tier's busy time and the ratios to the
    raw figures at ``block`` bytes. ``efficiency`` = read ratio + write ratio: the share of the
    busy time the raw single stream would need for the same bytes."""
    ref = raw["blocks"][str(block // MIB)]
    busy = io["busy_s"]
    if busy <= 0:
        return {"error": "no tier I/O in the window"}
    read, write = io["read_bytes"] / busy / 1e6, io["write_bytes"] / busy / 1e6
    return {
        "block_bytes": block,
        "MBps": read + write,
        "read_MBps": read,
        "write_MBps": write,
        "raw_read_MBps": ref["read_MBps"],
        "raw_write_MBps": ref["write_MBps"],
        "read_ratio": read / ref["read_MBps"],
        "write_ratio": write / ref["write_MBps"],
        "efficiency": read / ref["read_MBps"] + write / ref["write_MBps"],
        "read_bytes_per_step": io["read_bytes_per_step"],
        "write_bytes_per_step": io["write_bytes_per_step"],
        "busy_s_per_step": io["busy_s_per_step"],
    }


def io_vs_compute(systems: dict[str, Any], raw: dict[str, Any], block: int) -> dict[str, Any]:
    """The sizing check of (c): one step's minimum tier I/O (12 B read + 12 B written per
    trainable parameter) at the raw bandwidth, and the tier's measured bytes per step at the
    same bandwidth, against one host-resident iteration (async; sync when async failed)."""
    host = systems.get("host_async", {})
    if "s_per_step" not in host:
        host = systems.get("host_sync", {})
    ref = raw["blocks"][str(block // MIB)]
    out: dict[str, Any] = {}
    params = next((s["trainable_params"] for s in systems.values() if "trainable_params" in s), 0)
    if params:
        out["trainable_params"] = params
        out["min_io_s"] = (
            12 * params / 1e6 / ref["read_MBps"] + 12 * params / 1e6 / ref["write_MBps"]
        )
    tier = systems.get("tier_async", {}).get("tier_io")
    if tier:
        out["measured_io_s"] = (
            tier["read_bytes_per_step"] / 1e6 / ref["read_MBps"]
            + tier["write_bytes_per_step"] / 1e6 / ref["write_MBps"]
        )
    if "s_per_step" in host:
        out["compute_s"] = host["s_per_step"]
        if "min_io_s" in out:
            out["io_fits"] = out["min_io_s"] < out["compute_s"]
            out["io_over_compute"] = out["min_io_s"] / out["compute_s"]
    return out


def ratios(systems: dict[str, Any]) -> dict[str, float]:
    """tokens/s ratios of the systems that ran: tier/host (async, sync), the bounded tier over
    the previous one (the gradient arena), tier/DeepSpeed, both tiers'."""
    tps = {k: s["tokens_per_s"] for k, s in systems.items() if "tokens_per_s" in s}
    pairs = {
        "tier/host async": ("tier_async", "host_async"),
        "bounded tier/previous tier async": ("tier_async", "tier_arena_async"),
        "previous tier/host async": ("tier_arena_async", "host_async"),
        "tier/host sync": ("tier_sync", "host_sync"),
        "tier async/deepspeed": ("tier_async", "deepspeed"),
        "tier sync/deepspeed": ("tier_sync", "deepspeed"),
        "both tiers/host async": ("both_async", "host_async"),
        "both tiers/deepspeed both": ("both_async", "deepspeed_both"),
    }
    return {k: tps[a] / tps[b] for k, (a, b) in pairs.items() if a in tps and b in tps}


def result_of(
    runs: dict[str, list[dict[str, Any]]], raw: dict[str, Any], args: argparse.Namespace,
    preset: dict[str, Any], ram: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The JSON document: raw, systems, tier bandwidth per tier variant, the sizing check,
    ratios, (f) RAM against the state ("ram", when run), config, machine."""
    systems = aggregate(runs)
    block = AIO["block_size"]
    tier_bw = {
        name: tier_bandwidth(systems[name]["tier_io"], raw, block)
        for name in ("tier_async", "tier_arena_async", "tier_sync", "both_async")
        if "tier_io" in systems.get(name, {})
    }
    return {
        "raw": raw,
        "systems": systems,
        "tier_bandwidth": tier_bw,
        "io_vs_compute": io_vs_compute(systems, raw, block),
        "ratios": ratios(systems),
        **({"ram": ram} if ram is not None else {}),
        "config": {
            "preset": preset,
            "dir": str(args.dir),
            "devices": args.devices,
            "io_engine": args.io_engine,
            "aio": AIO,
            "ds_config_nvme": ds_config(preset, nvme_path=str(Path(args.dir) / "<system>")),
        },
        "machine": machine_info(),
    }


_LABEL = {
    "tier_async": "rp_engine, tier on NVMe, bounded gradients, async",
    "tier_arena_async": "rp_engine, tier on NVMe, gradient arena (previous tier), async",
    "host_async": "rp_engine, host-resident, async",
    "tier_sync": "rp_engine, tier on NVMe, bounded gradients, sync",
    "host_sync": "rp_engine, host-resident, sync",
    "both_async": "rp_engine, optimizer + weights on NVMe, async",
    "deepspeed": "DeepSpeed ZeRO-3, optimizer on NVMe",
    "deepspeed_both": "DeepSpeed ZeRO-3, optimizer + params on NVMe",
}


def _mb(x: float | None) -> str:
    return "" if x is None else f"{x / 1e6:,.1f}"


def format_table(result: dict[str, Any]) -> str:
    """The report in Markdown: (a) raw bandwidth, (b) the tier's, the sizing check, (c)/(d)
    the systems and the ratios, the gradient tier's bytes, (f) RAM against the state."""
    out = ["**(a) raw O_DIRECT bandwidth, one stream** (MB/s)", ""]
    out += ["| block | write | read |", "|---:|---:|---:|"]
    for mib, b in result["raw"]["blocks"].items():
        out.append(f"| {mib} MiB | {b['write_MBps']:,.0f} | {b['read_MBps']:,.0f} |")
    out += ["", "**(b) the tier's bandwidth while training** (over its busy time)", ""]
    out += [
        "| variant | MB/s | read MB/s (x raw) | write MB/s (x raw) | efficiency | "
        "MB read/step | MB written/step | busy s/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, bw in result["tier_bandwidth"].items():
        if "error" in bw:
            out.append(f"| {_LABEL[name]} | {bw['error']} |")
            continue
        out.append(
            f"| {_LABEL[name]} | {bw['MBps']:,.0f} | {bw['read_MBps']:,.0f} "
            f"({bw['read_ratio']:.2f}x) | {bw['write_MBps']:,.0f} ({bw['write_ratio']:.2f}x) | "
            f"{bw['efficiency']:.2f} | {_mb(bw['read_bytes_per_step'])} | "
            f"{_mb(bw['write_bytes_per_step'])} | {bw['busy_s_per_step']:.3f} |"
        )
    fit = result["io_vs_compute"]
    if "min_io_s" in fit and "compute_s" in fit:
        out += [
            "",
            f"Sizing: {fit['trainable_params'] / 1e6:,.2f} M trainable parameters; one step's "
            f"minimum I/O (24 B/param at the raw bandwidth) {fit['min_io_s']:.3f} s"
            + (
                f" (the tier's measured bytes: {fit['measured_io_s']:.3f} s)"
                if "measured_io_s" in fit
                else ""
            )
            + f" vs one host-resident iteration {fit['compute_s']:.3f} s: "
            f"I/O / compute = {fit['io_over_compute']:.2f}"
            + (" (fits)" if fit["io_fits"] else " (does NOT fit)"),
        ]
    out += ["", "**(c, d) training throughput** (median over repeats)", ""]
    out += [
        "| system | tokens/s | s/step | peak RSS MB (at initialize) | RSS MB after window | "
        "storage MB read/step | storage MB written/step | final loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in SYSTEMS:
        s = result["systems"].get(name)
        if s is None:
            continue
        if "error" in s:
            text = " / ".join(s["error"] or [])[:400].replace("|", "\\|")
            out.append(f"| {_LABEL[name]} | failed: {text} |")
            continue
        rss, mem = s.get("peak_rss_mb"), s.get("rss_mb") or {}
        peak = "" if rss is None else f"{rss:,.0f}"
        if rss is not None and "peak_after_initialize" in mem:
            peak += f" ({mem['peak_after_initialize']:,.0f})"
        end = "" if rss is None or "after_window" not in mem else f"{mem['after_window']:,.0f}"
        out.append(
            f"| {_LABEL[name]} | {s['tokens_per_s']:,.1f} | {s['s_per_step']:.3f} | {peak} | "
            f"{end} | "
            f"{_mb(s.get('storage_read_bytes_per_step'))} | "
            f"{_mb(s.get('storage_write_bytes_per_step'))} | {s['final_loss']:.4f} |"
        )
    if result["ratios"]:
        out += ["", ", ".join(f"{k} = **{v:.2f}x**" for k, v in result["ratios"].items())]
    grads = {n: s for n, s in result["systems"].items() if "grad_io" in s}
    if grads:
        out += ["", "**The gradient tier** (bounded gradients: its spills over the window)", ""]
        out += [
            "| variant | buffers (+ big) | MB in buffers | MB written/step | MB read/step |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, s in grads.items():
            g, io = s.get("grad_tier", {}), s["grad_io"]
            count = f"{g['buffer_count']} (+ {g['big_count']})" if g else ""
            out.append(
                f"| {_LABEL[name]} | {count} | {_mb(g.get('buffer_bytes'))} | "
                f"{_mb(io['write_bytes_per_step'])} | {_mb(io['read_bytes_per_step'])} |"
            )
    if "ram" in result:
        out += ["", format_ram(result["ram"])]
    return "\n".join(out) + "\n"


def format_ram(ram: dict[str, Any]) -> str:
    """(f) in Markdown: per run, parameters, state, peaks and peak / state; the growth."""
    spec = ram["spec"]
    out = [
        f"**(f) RAM against the state** (bf16 Qwen2, hidden {spec['hidden']}, vocab "
        f"{spec['vocab']}, cpu:2 x {spec['device_memory_gb']} GB, {spec['steps']} steps; "
        "MB = 2**20 bytes)",
        "",
        "| run | layers | params (M) | state MB (18 B/param) | peak RSS MB (whole run) | "
        "init peak MB | train peak MB | peak / state |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in ram["runs"].values():
        kind = "both tiers on NVMe" if r["tiers"] else "host-resident"
        if "error" in r:
            text = " / ".join(r["error"])[:400].replace("|", "\\|")
            out.append(f"| {kind} | {r['layers']} | failed: {text} |")
            continue
        out.append(
            f"| {kind} | {r['layers']} | {r['params'] / 1e6:,.1f} | {r['state'] / MIB:,.0f} | "
            f"{r['peak_rss'] / MIB:,.0f} | {r['init_peak'] / MIB:,.0f} | "
            f"{r['train_peak'] / MIB:,.0f} | {r['peak_over_state']:.2f} |"
        )
    g = ram.get("growth")
    if g:
        out += [
            "",
            f"From {g['from']} to {g['to']} layers (both tiers) the peak RSS grew by "
            f"{g['peak_grew'] / MIB:,.0f} MB for {g['added_state'] / MIB:,.0f} MB more state: "
            f"**{100 * g['fraction']:.1f} %** of it (the bar: under 10 %)",
        ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--dir", default=DEFAULT_DIR, help="folder on the disk under test")
    p.add_argument("--out", default=str(DEFAULT_JSON), help="write the JSON result here")
    p.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test)")
    p.add_argument("--devices", default="cpu:2", help="rp_engine's devices")
    p.add_argument("--io-engine", default="auto", choices=("auto", "aio", "threads"),
                   help="the tier's roundpipe.nvme_io_engine (auto: the aio op when built)")  # fmt: skip
    p.add_argument("--repeats", type=int, help="rounds of the systems (default: the preset's)")
    p.add_argument("--steps", type=int, help="timed steps per run (default: the preset's)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="which systems to run")
    p.add_argument("--inline", action="store_true",
                   help="run rp_engine's variants in this process (tests: no RSS per run); "
                        "DeepSpeed never is")  # fmt: skip
    p.add_argument("--ram-layers",
                   help='(f): the depths, e.g. "48,96" (default: the preset\'s); "" skips (f)')  # fmt: skip
    p.add_argument("--timeout", type=float, default=300, help="seconds per run's process")
    p.add_argument("--child-log", help="append every run's stderr here")
    p.add_argument("--child", help=argparse.SUPPRESS)  # a run's process: its spec as JSON
    args = p.parse_args(argv)
    if args.child:
        print("JSON:" + json.dumps(child_main(json.loads(args.child))), flush=True)
        return 0
    names = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(names) - set(SYSTEMS))
    if unknown:
        p.error(f"--systems: unknown {unknown}; choose from {list(SYSTEMS)}")
    preset = dict(PRESETS["quick" if args.quick else "full"])
    for key in ("repeats", "steps"):
        if getattr(args, key) is not None:
            preset[key] = getattr(args, key)
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)

    blocks = tuple(sorted({*RAW_BLOCKS_MIB, AIO["block_size"] // MIB}))
    raw = raw_bandwidth(folder, preset["raw_mb"] * 1_000_000, blocks, preset["raw_passes"])
    print(f"raw: {json.dumps({k: (b['write_MBps'], b['read_MBps']) for k, b in raw['blocks'].items()})}",
          file=sys.stderr)  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in names}
    for rep in range(preset["repeats"]):  # A B C D E, A B C D E: drift hits every system alike
        for system in names:
            spec = {"system": system, "preset": preset, "dir": str(folder),
                    "devices": args.devices, "io_engine": args.io_engine}  # fmt: skip
            if args.inline and system in RP_VARIANTS:
                row = child_main(spec)
                row["peak_rss_mb"] = row["rss_mb"] = None  # the test process's, not the run's
            else:
                row = run_child(spec, args.timeout, args.child_log)
            runs[system].append(row)
            brief = {k: row.get(k) for k in ("tokens_per_s", "s_per_step", "peak_rss_mb", "error")}
            print(f"[{rep + 1}/{preset['repeats']}] {system}: {json.dumps(brief)}", file=sys.stderr)
    ram_spec = dict(RAM_SPECS["quick" if args.quick else "full"])
    if args.ram_layers is not None:
        ram_spec["layers"] = tuple(int(x) for x in args.ram_layers.split(",") if x.strip())
    ram = None
    if ram_spec["layers"]:
        layers = ram_spec.pop("layers")
        ram = ram_vs_state(folder, layers, ram_spec, args.io_engine)
        ram["spec"]["layers"] = list(layers)
    result = result_of(runs, raw, args, preset, ram)
    table = format_table(result)
    print(table)
    result["table"] = table
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    failed = [n for n, s in result["systems"].items() if "error" in s and n not in DS_VARIANTS]
    failed += [n for n, r in (ram or {}).get("runs", {}).items() if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
