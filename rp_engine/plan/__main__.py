"""``python -m rp_engine.plan SUBCOMMAND``: the plan package's command lines.

    python -m rp_engine.plan advise --model qwen3-1.7b [--machine rtx4090_pcie4_8x]
        [--devices N] [--seq-len S] [--micro-batch B] [--tokens-per-step T] [--host-ram-gb G|here]
        [--nvme-gbps X] [--sync] [--no-clipping] [--lora R] [--top K]
        [--write ds_config.json] [--json]
    python -m rp_engine.plan simulate ...   # the same as python -m rp_engine.plan.simulate

``--model``: a preset name (``MODEL_PRESETS``: the projection's four shapes and rp-train's
presets), a Hugging Face model folder (its config.json) or a config.json path.
``--host-ram-gb here``: the memory this host leaves a run now, under the limit that binds
(rp_engine/host/memory_limit.py: the cgroup's ``memory.max`` / ``memory.high`` /
``memory.limit_in_bytes``, ``RLIMIT_AS`` or ``MemAvailable``), printed with its source. Exit
status 2 with a message naming the bad input and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from rp_engine.plan import cli as simulate_cli
from rp_engine.plan.advise import DEFAULT_SEQ_LEN, AdviceError, advise, format_table
from rp_engine.plan.shapes import SHAPES, Shape
from rp_engine.plan.simulate import load_machine, preset_names

# rp-train's presets (rp_engine/train/presets.py) as shapes, without torch; aliases of SHAPES
MODEL_PRESETS: dict[str, Shape] = {
    **SHAPES,
    "qwen3-0.6b": Shape("Qwen3-0.6B", 1024, 28, 3072, 16, 8, 128, 151936, True),
    "llama-3.1-8b": SHAPES["llama3.1-8b"],
    "tiny-qwen3": Shape("tiny-qwen3", 128, 4, 384, 4, 2, 32, 260, False),
    "tiny-llama": Shape("tiny-llama", 128, 4, 384, 4, 2, 32, 260, False),
}


def load_shape(model: str) -> Shape:
    """``--model``: a preset name, a model folder with config.json, or a config.json path.
    Raises ValueError naming the input and the choices."""
    if model in MODEL_PRESETS:
        return MODEL_PRESETS[model]
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"--model {model}: the folder has no config.json")
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--model {model}: cannot read {path} as JSON ({e})") from e
        if not isinstance(cfg, dict):
            raise ValueError(f"--model {model}: {path} is not a JSON object")
        name = path.parent.name if path.name == "config.json" else path.stem
        try:
            return Shape.from_hf_config(cfg, name=name or None)
        except ValueError as e:
            raise ValueError(f"--model {model}: {e}") from e
    raise ValueError(
        f"--model {model!r}: not a preset ({', '.join(MODEL_PRESETS)}), nor a model folder "
        "with a config.json, nor a config.json file: give one of those"
    )


def host_ram_bytes(value: str | None) -> tuple[int | None, str]:
    """``--host-ram-gb``: (bytes or None for unlimited, a line naming the limit that binds when
    read from this host, else ""). Raises ValueError naming the input."""
    if value is None:
        return None, ""
    if value == "here":
        from rp_engine.host.memory_limit import host_memory
        from rp_engine.host.units import format_mib_gib

        memory = host_memory()
        return memory.available, f"host RAM: {memory.describe(format_mib_gib)}"
    try:
        gb = float(value)
    except ValueError:
        gb = float("nan")
    if not gb > 0:
        raise ValueError(f"--host-ram-gb {value}: give a positive number of GiB, or 'here'")
    return int(gb * 2**30), ""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rp_engine.plan advise",
        description="The fastest RoundPipe configurations of a model on a machine (simulated).",
    )
    a = p.add_argument
    a("--model", required=True, help="preset, HF model folder or config.json")
    a("--machine", default="rtx4090_pcie4_8x", help=f"preset ({', '.join(preset_names())}) or JSON")
    a("--devices", type=int, help="devices (default: the machine's)")
    a("--seq-len", type=int, help=f"tokens per sequence (default {DEFAULT_SEQ_LEN})")
    a("--micro-batch", type=int, help="sequences per micro-batch (default: searched)")
    a("--tokens-per-step", type=int, help="tokens per optimizer step (default: searched)")
    a(
        "--host-ram-gb",
        help="host RAM in GiB, or 'here': what this host's binding limit (cgroup, "
        "RLIMIT_AS, free memory) leaves (default: unlimited; the NVMe tier when short)",
    )
    a("--nvme-gbps", type=float, help="NVMe bandwidth (default: the machine's nvme_read_gbps)")
    a("--nvme", action="store_true", help="always use the NVMe optimizer tier")
    a("--nvme-path", default="/local_nvme", help="nvme_path written in the config")
    a("--sync", action="store_true", help="synchronous optimizer (default: async)")
    a("--no-clipping", action="store_true", help="no gradient clipping (default: 1.0)")
    a("--lora", type=int, help="LoRA rank (0: full fine-tune; default: the preset's)")
    a("--top", type=int, default=3, help="rows of the table (each is simulated; default 3)")
    a("--write", metavar="DS_CONFIG.json", help="write the best as a DeepSpeed config here")
    a("--json", action="store_true", help="print the advice as JSON instead of the table")
    return p


def advise_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    bound = ""  # the limit that binds, with --host-ram-gb here
    try:
        shape = load_shape(args.model)
        machine = load_machine(args.machine)
        if args.devices is not None:
            if args.devices < 1:
                raise ValueError(f"--devices {args.devices}: must be >= 1")
            machine = dataclasses.replace(machine, num_devices=args.devices)
        if args.top < 1:
            raise ValueError(f"--top {args.top}: must be >= 1")
        host_ram, bound = host_ram_bytes(args.host_ram_gb)
        found = advise(
            shape, machine, host_ram_bytes=host_ram, nvme=True if args.nvme else None,
            nvme_gbps=args.nvme_gbps, seq_len=args.seq_len, micro_batch=args.micro_batch,
            tokens_per_step=args.tokens_per_step, async_optimizer=not args.sync,
            clipping=not args.no_clipping, lora=args.lora, top=args.top, finalists=args.top,
        )  # fmt: skip
    except (AdviceError, ValueError) as e:
        where = f" ({bound})" if bound else ""
        print(f"python -m rp_engine.plan advise: error: {e}{where}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([a.to_json() for a in found], indent=1))
    else:
        print(format_table(found))
        if bound:
            print(bound)
    if args.write:
        Path(args.write).write_text(
            json.dumps(found[0].ds_config(nvme_path=args.nvme_path), indent=2) + "\n"
        )
        if not args.json:
            print(f"wrote the best configuration to {args.write}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"advise": advise_main, "simulate": simulate_cli.main}
    if not argv or argv[0] not in commands:
        print(
            "usage: python -m rp_engine.plan {advise,simulate} ...\n"
            "  advise    the fastest RoundPipe configurations of a model on a machine\n"
            "  simulate  simulate a schedule (python -m rp_engine.plan.simulate)",
            file=sys.stderr,
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return int(commands[argv[0]](argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
