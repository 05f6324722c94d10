"""What the benchmarks share: the model presets, the one ds_config, the model and its data, and
the plumbing of a system run in its own process.

Imported by ``head_to_head`` and the benchmarks built on it (``loss_reads``, ``longest_seq``,
``module_strategies``, ``nvme_bench``, ``h2h_figures``, studies/) and by the tests. Every
system of a comparison builds its model with ``build_model`` from one ``PRESETS`` entry, reads
``batches`` of it and one ``ds_config``, so the systems differ only in the engine; each runs in a
child process started by ``child_json``, which hands back the child's last ``JSON:`` line.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rp_engine.host.jit_cache import with_own_ninja
from rp_engine.host.memory_limit import status_bytes

PRESETS: dict[str, dict[str, Any]] = {
    # Qwen3-1.7B (public config), random weights: 1.72 B parameters; the GPU configuration
    "qwen3-1.7b": {
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "tie_word_embeddings": True, "mbs": 4, "seq": 1024, "gas": 4,
        "dtype": "bf16", "device_memory_gb": 24,
    },
    # Qwen3-8B shape: 16 GB of bf16 weights, does not train in 24 GB without offload
    "qwen3-8b": {
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "tie_word_embeddings": False, "mbs": 4, "seq": 1024, "gas": 4,
        "dtype": "bf16", "device_memory_gb": 24,
    },
    # the --quick CPU model: big enough that weights cost link time, small enough for 2 cores
    "cpu-small": {
        "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 1024, "tie_word_embeddings": True, "mbs": 2, "seq": 128, "gas": 4,
        "dtype": "fp32", "device_memory_gb": None,
    },
    # the test's model
    "tiny": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 256, "tie_word_embeddings": True, "mbs": 2, "seq": 32, "gas": 4,
        "dtype": "fp32", "device_memory_gb": None,
    },
}  # fmt: skip
_RUN_KEYS = ("mbs", "seq", "gas", "dtype", "device_memory_gb")


def peak_rss() -> int:
    """This process's own peak resident memory, bytes: ``/proc/self/status`` VmHWM, the
    high-water mark of its address space since its ``exec``.

    Not ``getrusage(RUSAGE_SELF).ru_maxrss``: Linux folds the high-water RSS of the address
    space a process ``exec``s from into its ``ru_maxrss``, and a child started by Python's
    ``subprocess`` (vfork/fork, then exec) ``exec``s from its parent's. Under a test runner
    holding 2.85 GB, two children that peaked at 2.4 and 2.1 GB on their own both reported
    2.85 GB (issue 51's fresh-clone run). Falls back to ``ru_maxrss`` where there is no /proc."""
    hwm = status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def ds_config(preset: dict[str, Any], *, devices: str | None, pcie_gbps: float | None) -> dict:
    """The one config every system reads (DeepSpeed ignores the "roundpipe" section)."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": preset["mbs"],
        "gradient_accumulation_steps": preset["gas"],
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
        # DeepSpeed trains on through a NaN in bf16/fp32; "ignore" is the same behaviour, and
        # it lets rp_engine overlap consecutive iterations (README "Overlapping iterations")
        "roundpipe": {"devices": devices, "on_nonfinite": "ignore"},
    }
    if preset["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    if preset["device_memory_gb"]:
        cfg["roundpipe"]["device_memory_gb"] = preset["device_memory_gb"]
    if pcie_gbps:
        cfg["roundpipe"]["pcie_gbps"] = pcie_gbps
    return cfg


def build_model(preset: dict[str, Any]) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{k: v for k, v in preset.items() if k not in _RUN_KEYS}, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def batches(preset: dict[str, Any], n: int) -> list[dict[str, Any]]:
    import torch

    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, preset["vocab_size"], (preset["mbs"], preset["seq"]), generator=gen)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def loader_dataset(data: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The samples of ``data`` (micro-batches of dicts) as a map-style data set that the loader
    ``initialize(training_data=)`` builds (DeepSpeed's: a ``DistributedSampler``, shuffled with
    seed 0) hands out as exactly ``data``, in order: sample j sits at the sampler's j-th index."""
    from torch.utils.data import DistributedSampler

    rows = [{k: v[i] for k, v in b.items()} for b in data for i in range(len(b["input_ids"]))]
    order = list(DistributedSampler(rows, num_replicas=1, rank=0))
    items: list[dict[str, Any]] = [{} for _ in rows]
    for j, index in enumerate(order):
        items[index] = rows[j]
    return items


def chosen_systems(parser: Any, given: str, known: Sequence[str]) -> list[str]:
    """The ``--systems`` list (comma-separated), in order; an unknown name is the parser's
    error, naming the choices."""
    names = [s for s in given.split(",") if s]
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"--systems: unknown {unknown}; choose from {list(known)}")
    return names


def one_rank_env() -> None:
    """The launcher variables of a one-process DeepSpeed run (world size 1), where unset."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))


def machine_info() -> dict[str, Any]:
    import torch

    info = {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "processor": platform.processor() or platform.machine(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


# ---- one system in its own process -------------------------------------------------------------
def child_json(
    cmd: list[str], system: str, *, timeout: float | None, child_log: str | None
) -> dict[str, Any]:
    """Run one system's process (``cmd``, from the repository root) and return the dict of its
    last ``JSON:`` line, or ``{"system", "error"}`` when it failed or ran past ``timeout``."""
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        # DeepSpeed's JIT ops are built by this environment's ninja, as make builds them:
        # another ninja first on PATH would rebuild every op in the shared cache
        "PATH": with_own_ninja(os.environ.get("PATH", "")),
    }
    # OpenMP threads that spin at barriers are preempted on a shared, oversubscribed machine
    # (DeepSpeed's step went from 0.3 s to 6-10 s here); sleeping waits treat every system alike
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, cwd=root, env=env, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:  # killed: the next system still gets its turn
        _log_child(child_log, system, _text(exc.stderr))
        # a row printed before the process hung (in a library's exit handlers, say) stands
        done = [ln for ln in _text(exc.stdout).splitlines() if ln.startswith("JSON:")]
        if done:
            return {**json.loads(done[-1][5:]), "killed_after_row": f"{timeout:g} s"}
        return {"system": system, "error": [f"timed out after {timeout:g} s"]}
    _log_child(child_log, system, proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON:")]
    if proc.returncode or not lines:
        return {"system": system, "error": proc.stderr.strip().splitlines()[-8:]}
    return json.loads(lines[-1][5:])


def _text(out: str | bytes | None) -> str:
    """A timed-out child's captured output (bytes or None, whatever ``text`` asked)."""
    if isinstance(out, bytes):
        return out.decode(errors="replace")
    return out or ""


def _log_child(child_log: str | None, system: str, stderr: str) -> None:
    """Append a child's whole stderr to ``--child-log`` (DeepSpeed's set-up logs, tracebacks)."""
    if child_log:
        with open(child_log, "a") as f:
            f.write(f"---- {system} ----\n{stderr}\n")
