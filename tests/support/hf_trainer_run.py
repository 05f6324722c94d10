"""Train a tiny model with transformers' Trainer (DeepSpeed config) in this process; print JSON.

``python hf_trainer_run.py SPEC_JSON``; SPEC["backend"] is "deepspeed" (real DeepSpeed) or
"rp_engine" (``rp_engine.integrations.hf.enable()``). Each side runs in its own subprocess, so
neither process group nor patched module leaks into the test process. Prints the Trainer's
per-step log (loss, grad_norm, learning_rate), the eval loss and the files ``save_model`` wrote.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch


class TokenData(torch.utils.data.Dataset):
    """Deterministic random token sequences, labels = input_ids (causal LM)."""

    def __init__(self, n: int, seq: int, vocab: int, offset: int = 0) -> None:
        self.n, self.seq, self.vocab, self.offset = n, seq, vocab, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + self.offset + i)
        ids = torch.randint(1, self.vocab, (self.seq,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from subprocess_helpers import count_training_runs, select_backend

    select_backend(spec)
    from models import tiny_qwen3
    from transformers import Trainer, TrainingArguments

    # DeepSpeed's side builds the model before TrainingArguments, so both sides start from the
    # same weights (built after, it would be initialised inside zero.Init); rp_engine's side
    # builds it after, where enable() must keep zero.Init away.
    shape = {"layers": spec.get("layers", 2), "hidden": spec.get("hidden", 64)}
    model = tiny_qwen3(0, **shape) if spec["backend"] == "deepspeed" else None
    out = spec["output_dir"]
    args = TrainingArguments(
        output_dir=out,
        deepspeed=spec["config"],
        per_device_train_batch_size=spec.get("mbs", 2),
        per_device_eval_batch_size=spec.get("mbs", 2),
        gradient_accumulation_steps=spec.get("gas", 2),
        max_steps=spec["steps"],
        learning_rate=spec.get("lr", 3e-3),
        warmup_steps=spec.get("warmup", 2),
        weight_decay=spec.get("weight_decay", 0.01),
        max_grad_norm=spec.get("max_grad_norm", 1.0),
        logging_steps=spec.get("logging_steps", 1),
        save_strategy="steps" if spec.get("save_steps") else "no",
        save_steps=spec.get("save_steps") or 500,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        train_sampling_strategy=spec.get("sampling", "random"),
        lr_scheduler_type=spec.get("lr_scheduler_type", "linear"),
    )
    if model is None:
        model = tiny_qwen3(0, **shape)
    partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
    trainer_cls = Trainer
    in_flight_at_start: list[bool] = []  # per optimizer step: was the previous one in flight?
    if spec.get("fast_path"):
        from rp_engine.integrations.hf import RoundPipeTrainer

        class ObservedTrainer(RoundPipeTrainer):  # type: ignore[misc, valid-type]
            def training_step(self, model: Any, inputs: Any, num_items: Any = None) -> Any:
                pending = self._rp_pending
                engine = getattr(model, "roundpipe_engine", None)
                if engine is not None and pending is not None and inputs is pending[0][0]:
                    in_flight_at_start.append(engine._inflight is not None)
                return super().training_step(model, inputs, num_items)

        trainer_cls = ObservedTrainer
    # the step of every training run the engine issued
    training_runs = count_training_runs() if spec["backend"] == "rp_engine" else []
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=TokenData(64, spec.get("seq", 16), 128),
        eval_dataset=TokenData(4, spec.get("seq", 16), 128, offset=10_000),
    )
    trainer.train(resume_from_checkpoint=spec.get("resume_from"))
    result: dict[str, Any] = {
        "log": [
            {k: row[k] for k in ("step", "loss", "grad_norm", "learning_rate") if k in row}
            for row in trainer.state.log_history
            if "loss" in row
        ],
        "partitioned_at_load": partitioned,
        "fast_path_steps": getattr(trainer, "fast_path_steps", None),
        "in_flight_at_start": in_flight_at_start,
        "training_runs": training_runs,
        "train_runtime": trainer.state.log_history[-1].get("train_runtime"),
    }
    if spec.get("evaluate"):
        engine = getattr(trainer.model_wrapped, "roundpipe_engine", None)
        calls: list[int] = []
        host_calls: list[int] = []
        if engine is not None:  # count evaluation forwards: through the engine vs the host module
            eval_run = engine._eval_run
            engine._eval_run = lambda b, **kw: calls.append(1) or eval_run(b, **kw)
            host_forward = model.forward
            model.forward = lambda *a, **kw: host_calls.append(1) or host_forward(*a, **kw)
        result["eval_loss"] = trainer.evaluate()["eval_loss"]
        result["eval_through_engine"] = len(calls)
        result["eval_host_forwards"] = len(host_calls)
        # predict() wants logits (prediction_loss_only False): the host module answers
        predicted = trainer.predict(trainer.eval_dataset)
        result["predict_loss"] = predicted.metrics["test_loss"]
        result["predict_logits_shape"] = list(predicted.predictions.shape)
        result["predict_host_forwards"] = len(host_calls) - result["eval_host_forwards"]
    if spec.get("save_model"):
        trainer.save_model(spec["save_model"])
        result["saved"] = sorted(os.listdir(spec["save_model"]))
    print("JSON:" + json.dumps(result), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
