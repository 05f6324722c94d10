"""Train a tiny model with TRL's SFTTrainer (DeepSpeed config) in this process; print JSON.

``python hf_trl_run.py SPEC_JSON``; SPEC["backend"] is "deepspeed" (real DeepSpeed) or
"rp_engine" (``rp_engine.integrations.hf.enable()``). A prompt/completion dataset of short
arithmetic strings, a character-level tokenizer built here (no download), the completion-only
loss, ``loss_type="chunked_nll"`` (TRL's fused LM head). Prints the per-step log (loss,
grad_norm, learning_rate and TRL's entropy, mean_token_accuracy, num_tokens) and the eval metrics.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

CHARS = "0123456789+=: abcdefghijklmnopqrstuvwxyz"


def char_tokenizer() -> Any:
    """A PreTrainedTokenizerFast with one token per character (ids < 64), <pad> and <eos>."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def arithmetic(n: int, offset: int = 0) -> Any:
    from datasets import Dataset

    g = torch.Generator().manual_seed(7 + offset)
    rows = torch.randint(0, 50, (n, 2), generator=g).tolist()
    return Dataset.from_dict(
        {
            "prompt": [f"what is {a}+{b}:" if a % 2 else f"{a}+{b}=" for a, b in rows],
            "completion": [f" {a + b}" for a, b in rows],
        }
    )


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from subprocess_helpers import count_training_runs, select_backend

    select_backend(spec)
    from models import tiny_qwen3
    from trl import SFTConfig, SFTTrainer

    # As in hf_trainer_run.py: DeepSpeed's side builds the model before the arguments (outside
    # zero.Init), so both sides start from the same weights.
    shape = {"layers": spec.get("layers", 2), "hidden": spec.get("hidden", 64)}
    model = tiny_qwen3(0, **shape) if spec["backend"] == "deepspeed" else None
    args = SFTConfig(
        output_dir=spec["output_dir"],
        deepspeed=spec["config"],
        loss_type="chunked_nll",
        per_device_train_batch_size=spec.get("mbs", 2),
        per_device_eval_batch_size=spec.get("mbs", 2),
        gradient_accumulation_steps=spec.get("gas", 2),
        max_steps=spec["steps"],
        learning_rate=3e-3,
        warmup_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
        max_length=32,
    )
    if model is None:
        model = tiny_qwen3(0, **shape)
    # the step of every training run the engine issued
    training_runs = count_training_runs() if spec["backend"] == "rp_engine" else []
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=arithmetic(spec.get("train_rows", 32)),
        eval_dataset=arithmetic(spec.get("eval_rows", 4), offset=1),
        processing_class=char_tokenizer(),
    )
    trainer.train()
    keys = ("step", "loss", "grad_norm", "learning_rate", "entropy", "mean_token_accuracy")
    result: dict[str, Any] = {
        "log": [
            {k: row[k] for k in (*keys, "num_tokens") if k in row}
            for row in trainer.state.log_history
            if "loss" in row
        ],
        "train_runtime": trainer.state.log_history[-1].get("train_runtime"),
        "training_runs": training_runs,
    }
    engine = getattr(trainer.model_wrapped, "roundpipe_engine", None)
    engine_calls: list[int] = []
    host_calls: list[int] = []
    if engine is not None:  # count evaluation forwards: through the engine vs the host module
        eval_run = engine._eval_run
        engine._eval_run = lambda b, **kw: engine_calls.append(1) or eval_run(b, **kw)
        host_forward = model.forward  # TRL's fused forward, patched onto the instance
        model.forward = lambda *a, **kw: host_calls.append(1) or host_forward(*a, **kw)
    metrics = trainer.evaluate()
    timing = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")
    result["eval"] = {k: v for k, v in metrics.items() if k not in timing}
    result["eval_runtime"] = metrics["eval_runtime"]
    result["eval_through_engine"] = len(engine_calls)
    result["eval_host_forwards"] = len(host_calls)
    # predict() wants logits: the loss from the engine's fused head, the logits from the host
    predicted = trainer.predict(trainer.eval_dataset)
    result["predict_loss"] = predicted.metrics["test_loss"]
    result["predict_logits_shape"] = list(predicted.predictions.shape)
    result["predict_host_forwards"] = len(host_calls) - result["eval_host_forwards"]
    print("JSON:" + json.dumps(result), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
