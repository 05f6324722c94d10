"""Child of tests/engine/test_folder_load_limited.py: LoRA on a ``save_pretrained`` folder,
2 steps, then the adapter saved; prints one JSON line ``{"losses", "peak_rss", "adapter",
"rssanon", "rssfile"}`` (the last two: resident anonymous and file-backed bytes at the end).

    python folder_lora_child.py FOLDER OUT --load folder|whole --compute bf16|fp32

``--load folder``: rp_engine's layer-by-layer loader (model/folder.py: frozen weights served from
the files); ``--load whole``: ``from_pretrained`` (the reference, run without a limit); ``--copy-base``: the
frozen base cloned into ordinary memory first (the control that a limit must kill). The
engine runs on 2 CPU virtual devices of ``--device-gb`` (0.15 GB) each, one micro-batch of 16 tokens per
step, synchronous AdamW on the adapter.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.common import peak_rss
from rp_engine.host.memory_limit import status_bytes


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("out")
    ap.add_argument("--load", choices=("folder", "whole"), required=True)
    ap.add_argument("--compute", choices=("bf16", "fp32"), required=True)
    ap.add_argument("--device-gb", type=float, default=0.15)
    ap.add_argument("--vocab", type=int, default=128)
    # the control: the frozen base copied into ordinary memory (what a cast, clone or pin on
    # the way would do)
    ap.add_argument("--copy-base", action="store_true")
    args = ap.parse_args(argv)

    from peft import LoraConfig, get_peft_model

    import rp_engine
    from rp_engine.model.folder import from_folder

    dtype = torch.bfloat16 if args.compute == "bf16" else torch.float32
    if args.load == "folder":
        model = from_folder(args.folder, dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.folder)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
        lora_dropout=0.0, task_type="CAUSAL_LM",
    )  # fmt: skip
    if args.copy_base:
        for p in model.parameters():
            p.data = p.data.clone()
    torch.manual_seed(1)
    model = get_peft_model(model, lora)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "roundpipe": {
            "devices": "cpu:2", "device_memory_gb": args.device_gb, "async_optimizer": False,
        },
        **({"bf16": {"enabled": True}} if dtype == torch.bfloat16 else {}),
    }  # fmt: skip
    engine, _, _, _ = rp_engine.initialize(model=model, config=cfg)
    gen = torch.Generator().manual_seed(0)
    batches = [
        {"input_ids": (ids := torch.randint(1, args.vocab, (1, 16), generator=gen)), "labels": ids}
        for _ in range(2)
    ]
    it = iter(batches)
    losses = [float(engine.train_batch(it)) for _ in range(2)]
    engine.synchronize()
    model.save_pretrained(args.out)  # the adapter only (peft)
    engine.destroy()
    peak = peak_rss()
    print(json.dumps({"losses": losses, "peak_rss": peak, "adapter": args.out, **_rss()}))
    return 0


def _rss() -> dict[str, int]:
    """This process's resident memory now, anonymous and file-backed (/proc/self/status)."""
    found = {key.lower(): status_bytes(key) for key in ("RssAnon", "RssFile")}
    return {key: value for key, value in found.items() if value is not None}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
