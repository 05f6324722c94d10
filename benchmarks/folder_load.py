"""Loading a model from its ``save_pretrained`` folder: rp_engine's layer-by-layer loader
(rp_engine/model/folder.py) against transformers' ``from_pretrained``, each as a ratio to the
disk's raw sequential read of the same files measured in the same run (issue 49).

    .venv/bin/python -m benchmarks.folder_load [--hidden 1024 --layers 24 --repeats 3]

The folder (a bf16 Qwen2-shaped causal LM in 200 MB shards) is written once under ``--dir``.
Every measurement runs in a fresh process with the shards dropped from the page cache first
(``posix_fadvise(DONTNEED)``), so each reads the disk; the systems alternate within a repeat.
Timed in the child, from the call to the last byte in memory (the family's modeling code
imported before, for every system):

- ``raw``: the shards read sequentially with O_DIRECT in 8 MiB blocks (the disk's figure);
- ``folder, full fine-tune``: ``from_folder`` + ``own_trainable`` (what ``initialize`` does:
  every trainable weight copied out of the file mapping, layer by layer);
- ``folder, frozen (LoRA base)``: ``from_folder`` with every weight frozen, then one pass that
  reads every weight (the mapping is lazy: the pass is where the disk is read);
- ``from_pretrained``: ``AutoModelForCausalLM.from_pretrained(dtype=bf16)``, then the same
  pass (transformers may map the files lazily too).

Reported: seconds (median), GB/s, and GB/s as a ratio to raw's (1.0: as fast as the disk).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("raw", "folder_full", "folder_frozen", "from_pretrained")
LABELS = {
    "raw": "raw O_DIRECT read",
    "folder_full": "folder, full fine-tune",
    "folder_frozen": "folder, frozen (LoRA base)",
    "from_pretrained": "from_pretrained",
}
BLOCK = 8 << 20


def write_folder(folder: Path, hidden: int, layers: int) -> None:
    """A bf16 Qwen2-shaped causal LM saved in 200 MB shards (skipped when already there)."""
    if (folder / "config.json").is_file():
        return
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=32768, hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 256), tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, max_shard_size="200MB")


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def drop_cache(files: list[Path]) -> None:
    """The files' pages out of the page cache, so the next read comes from the disk."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw(files: list[Path]) -> int:
    """Read the files with O_DIRECT, 8 MiB at a time; the bytes read."""
    import mmap

    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
    total = 0
    for path in files:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            while True:
                n = os.readv(fd, [buf])
                total += n
                if n < BLOCK:
                    break
        finally:
            os.close(fd)
    return total


def _touch(model: Any) -> float:
    """One pass reading every weight (a mapped one is read from the disk here)."""
    import torch

    with torch.no_grad():
        return float(sum(p.float().sum() for p in model.parameters()))


def child(system: str, folder: Path) -> dict[str, Any]:
    """One timed load in this process (the parent dropped the page cache)."""
    import torch

    files = shards(folder)
    if not files:
        raise FileNotFoundError(f"{folder}: no safetensors shards")
    nbytes = sum(f.stat().st_size for f in files)
    if system == "raw":
        start = time.perf_counter()
        _raw(files)
        return {"seconds": time.perf_counter() - start, "bytes": nbytes}
    import transformers

    from rp_engine.model.folder import from_folder, own_trainable

    # imported before the clock starts, for every system alike: transformers imports a family's
    # modeling code on first use (1.6 s here, 30x building the model itself)
    _ = transformers.Qwen2ForCausalLM
    start = time.perf_counter()
    if system == "from_pretrained":
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        _touch(model)
    elif system == "folder_full":
        model = from_folder(folder, dtype=torch.bfloat16)
        own_trainable(model)
    else:
        model = from_folder(folder, dtype=torch.bfloat16)
        model.requires_grad_(False)
        _touch(model)
    return {"seconds": time.perf_counter() - start, "bytes": nbytes}


def measure(system: str, folder: Path) -> dict[str, Any]:
    drop_cache(shards(folder))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.folder_load", "--child", system, "--dir", str(folder)],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{system} failed: {proc.stderr[-3000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON:")][-1]
    return dict(json.loads(line[5:]))


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    def gbps(system: str) -> float:
        r = runs[system]
        return r[0]["bytes"] / statistics.median(x["seconds"] for x in r) / 1e9

    raw = gbps("raw")
    out = ["| load | seconds (median) | GB/s | / raw read |", "|---|---:|---:|---:|"]
    for system in SYSTEMS:
        secs = statistics.median(x["seconds"] for x in runs[system])
        out.append(
            f"| {LABELS[system]} | {secs:.2f} | {gbps(system):.2f} | {gbps(system) / raw:.2f}x |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/rp_folder_bench"))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=SYSTEMS)
    args = parser.parse_args(argv)
    if args.child:  # ``--dir`` is the model folder itself
        print("JSON:" + json.dumps(child(args.child, args.dir)), flush=True)
        return 0
    folder = args.dir / f"qwen2_h{args.hidden}_l{args.layers}"
    write_folder(folder, args.hidden, args.layers)
    nbytes = sum(f.stat().st_size for f in shards(folder))
    print(f"folder {folder}: {len(shards(folder))} shards, {nbytes / 1e9:.2f} GB", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    for rep in range(args.repeats):
        order = SYSTEMS if rep % 2 == 0 else tuple(reversed(SYSTEMS))
        for system in order:
            runs[system].append(measure(system, folder))
            print(f"repeat {rep + 1}: {system} {runs[system][-1]['seconds']:.2f} s", flush=True)
    print(table(runs))
    print("JSON:" + json.dumps(runs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
