"""``rp-train``: the main job. Fine-tunes a causal LM with rp_engine from a DeepSpeed config.

With no arguments it trains its embedded default, which needs nothing from the network: a small
Qwen3 built from a config, on byte-level tokens of text that ships with every Python (the
standard library's own documentation), on CPU virtual devices when no GPU is visible.

    rp-train                                        # embedded default, 30 steps
    rp-train --model ./my-hf-model --data train.jsonl --lora 8,16 --epochs 1
    rp-train --model qwen3-0.6b --plan              # cuts, memory, tokens/s; trains nothing
    rp-train --deepspeed ds_config.json --devices cpu:4 --steps 100 --resume latest

Every run writes a run folder (``./rp-runs/<time>-<model>/`` or ``--out``): the resolved
DeepSpeed config, checkpoints, the LoRA adapter, W&B files, loss.png, timeline.png/.json and
summary.json (see rp_engine/train/run_folder.py).

This module is the run (``main``, ``_Job``); the arguments are in train/args.py, the embedded
default job (its corpus, model and config) in train/default_job.py, both re-exported here.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rp_engine.train.args import _parser
from rp_engine.train.data import DataError
from rp_engine.train.default_job import (
    VOCAB,  # noqa: F401  (re-exported: it was defined here)
    batches,
    build_tiny_model,
    default_config,
    stdlib_corpus,
)
from rp_engine.train.preflight import PreflightError
from rp_engine.train.presets import ModelError

__all__ = ["main", "default_config", "stdlib_corpus", "build_tiny_model", "batches"]

log = logging.getLogger("rp_engine.cli")

_EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from rp_engine.config import ConfigError

    try:
        return _Job(args).run()
    except (DataError, ModelError, PreflightError, ConfigError) as e:
        print(f"rp-train: error: {e}", file=sys.stderr)
        return 2


class _Job:
    """One rp-train invocation: set up, (plan | train), write the run folder."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stop_signal: int | None = None
        self.train_losses: list[tuple[int, float]] = []
        self.eval_losses: list[tuple[int, float]] = []
        self.wandb_run: Any = None
        self._pending: dict[int, dict[str, float]] = {}  # W&B rows of steps still in flight

    # --- set-up ---------------------------------------------------------------------------------
    def run(self) -> int:
        from rp_engine.model.batches import compute_dtype
        from rp_engine.train import data as D
        from rp_engine.train import preflight
        from rp_engine.train.presets import apply_lora, load_model
        from rp_engine.train.run_folder import make_run_dir, write_json

        args = self.args
        if args.steps is not None and args.steps < 0:
            raise DataError(f"--steps {args.steps}: must be >= 0")
        # Shapes first (meta device: no memory), so the preflight runs before any allocation.
        shape = load_model(args.model, layers=args.layers, hidden=args.hidden, meta=True)
        if args.lora:
            shape.model = apply_lora(shape.model, args.lora)
        examples = (
            D.read_examples(args.data)
            if args.data
            else [D.Example("", stdlib_corpus().decode("utf-8"))]
        )
        packed = D.pack(examples, shape.tokenizer, args.seq_len)
        train_set, eval_set = D.split(packed, args.eval_split, seed=args.seed)
        raw, cfg = self._config(shape.hidden_size, len(train_set))
        mbs, gas = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
        self.run_dir = self._run_dir(shape.name, make_run_dir)
        if args.tensorboard:  # the engine's monitor writes it, as for a config's section
            tb = {"enabled": True, "output_path": str(self.run_dir), "job_name": "tensorboard"}
            raw = {**raw, "tensorboard": tb}
        write_json(self.run_dir / "ds_config.json", raw)
        counts = preflight.model_counts(shape.model)
        host = preflight.estimate_host(
            counts, dtype_bytes=2 if (cfg.bf16.enabled or cfg.fp16.enabled) else 4,
            seq_len=args.seq_len, micro_batch=mbs, grad_accum=gas,
            cpu_devices=_cpu_devices(cfg.roundpipe.devices),
        )  # fmt: skip
        if args.plan:
            return self._plan(counts, host, shape, raw, cfg)
        if not args.no_preflight:
            preflight.check_host(host, cfg=cfg)
            budget = _device_budget(cfg)
            if budget is not None:
                preflight.check_device(
                    counts, budget_bytes=budget, seq_len=args.seq_len, micro_batch=mbs,
                    dtype_bytes=2 if (cfg.bf16.enabled or cfg.fp16.enabled) else 4,
                )  # fmt: skip
        data = D.MicroBatches(train_set, mbs, seed=args.seed)
        self.eval_batches = D.eval_batches(eval_set, mbs)[: max(args.eval_batches, 0)]
        self.steps = self._total_steps(data.per_epoch, gas)
        loaded = load_model(
            args.model, layers=args.layers, hidden=args.hidden, seed=args.seed,
            dtype=compute_dtype(cfg),
        )  # fmt: skip
        model = apply_lora(loaded.model, args.lora) if args.lora else loaded.model
        self.model: Any = model
        self.tokenizer: Any = loaded.tokenizer
        return self._train(model, raw, data, shape.name)

    def _config(self, hidden: int | None, train_sequences: int) -> tuple[dict[str, Any], Any]:
        """The resolved DeepSpeed config (dict) and its parsed form; "auto" filled HF-style."""
        from rp_engine.config import hf_auto_values, load_config

        args = self.args
        lr = args.lr
        if lr is None:
            lr = 2e-4 if args.lora else (2e-3 if args.model in _SCRATCH else 2e-5)

        def auto(mbs: int, gas: int) -> dict[str, Any]:
            per_epoch = max(train_sequences // max(mbs, 1), 1)
            return hf_auto_values(
                hidden_size=hidden, micro_batch_size=mbs, gradient_accumulation_steps=gas,
                lr=lr, warmup_steps=args.warmup, total_steps=self._total_steps(per_epoch, gas),
            )  # fmt: skip

        if args.config:
            if not Path(args.config).is_file():
                raise DataError(f"--deepspeed {args.config}: no such file")
            first = load_config(args.config, auto_values=auto(args.micro_batch, args.grad_accum))
            mbs, gas = first.train_micro_batch_size_per_gpu, first.gradient_accumulation_steps
            # A config that fixes the batch sizes: the "auto" total steps follow its values.
            raw = load_config(args.config, auto_values=auto(mbs, gas)).to_dict()
        else:
            raw = default_config(
                args.devices, micro_batch=args.micro_batch, grad_accum=args.grad_accum, lr=lr,
                warmup=max(1, args.warmup),
            )  # fmt: skip
        rp = dict(raw.get("roundpipe", {}))
        if args.devices:
            rp["devices"] = args.devices
        if args.schedule:
            rp["schedule"] = args.schedule
        if args.sync_optimizer:
            rp["async_optimizer"] = False
        if args.no_preflight:
            rp["host_preflight"] = False  # initialize's own check too
        raw = {**raw, "roundpipe": rp}
        return raw, load_config(raw)

    def _total_steps(self, per_epoch: int, gas: int) -> int:
        args = self.args
        if args.steps is not None:
            return int(args.steps)
        if args.epochs is not None:
            return max(1, math.ceil(args.epochs * per_epoch / gas))
        return 30 if not args.data else max(1, math.ceil(per_epoch / gas))

    def _run_dir(self, name: str, make: Any) -> Path:
        args = self.args
        self.resume_from: Path | None = None
        if args.resume:
            self.resume_from = _find_checkpoint(args.resume, args.out, name, args.save_dir)
            if not args.out:  # continue in the run folder that holds the checkpoint
                folder = self.resume_from.parent
                if self.resume_from.name == "checkpoints":
                    return make(str(folder), name)
        return make(args.out, name)  # type: ignore[no-any-return]

    # --- plan preview -----------------------------------------------------------------------------
    def _plan(
        self, counts: Any, host: Any, shape: Any, raw: dict[str, Any], cfg: Any = None
    ) -> int:
        """The advisor's table for this model on --machine; the best configuration becomes
        <run folder>/ds_config.json (the job's optimizer and scheduler kept), plan.json and
        plan.png (its simulated Gantt)."""
        from rp_engine.plan import render
        from rp_engine.train import preflight
        from rp_engine.train.presets import parse_lora
        from rp_engine.train.run_folder import write_json

        args = self.args
        given: set[str] = getattr(args, "given", set())
        # a --deepspeed config's own batch sizes count as given
        fixed_mb = "micro_batch" in given or (
            args.config and raw.get("train_micro_batch_size_per_gpu") not in (None, "auto")
        )
        fixed_gas = "grad_accum" in given or (
            args.config and raw.get("gradient_accumulation_steps") not in (None, "auto")
        )
        summary, found = preflight.plan_preview(
            counts, machine_name=args.machine, num_devices=args.plan_devices,
            hf_config=preflight.decoder(shape.model).config.to_dict(), name=shape.name,
            seq_len=args.seq_len if "seq_len" in given else None,
            micro_batch=raw["train_micro_batch_size_per_gpu"] if fixed_mb else None,
            grad_accum=raw["gradient_accumulation_steps"] if fixed_gas else None,
            lora_rank=parse_lora(args.lora)[0] if args.lora else None,
            async_optimizer=raw.get("roundpipe", {}).get("async_optimizer", True),
            clipping=float(raw.get("gradient_clipping", 1.0) or 0) > 0,
        )  # fmt: skip
        memory = preflight.memory_for(cfg)  # the limit that binds (host_preflight.py)
        print(preflight.format_plan(summary, host, memory.available, found))
        print(f"  bound by {memory.source}")
        best = found[0].ds_config()
        for key in ("optimizer", "scheduler"):  # the job's own, "auto" values filled
            if key in raw:
                best[key] = raw[key]
        best["roundpipe"] = {**raw.get("roundpipe", {}), **best["roundpipe"]}
        write_json(self.run_dir / "ds_config.json", best)
        write_json(self.run_dir / "plan.json", {**summary, "host_bytes": host.total})
        render.write_png(found[0].sim, self.run_dir / "plan.png")
        print(
            f"best configuration: {self.run_dir / 'ds_config.json'} (rp-train --deepspeed ...)\n"
            f"plan: {self.run_dir / 'plan.json'}\nsimulated Gantt: {self.run_dir / 'plan.png'}"
        )
        return 0

    # --- training ---------------------------------------------------------------------------------
    def _train(self, model: Any, raw: dict[str, Any], data: Any, name: str) -> int:
        import rp_engine
        from rp_engine.config import load_config

        args = self.args
        parsed = load_config(raw)
        wandb_cfg = parsed.wandb
        tb = parsed.tensorboard  # written by the engine's monitor, where DeepSpeed puts it
        self._tensorboard_dir = os.path.join(tb.output_path, tb.job_name) if tb.enabled else None
        # The CLI owns the W&B run (its folder, its metrics); the engine's own monitor keeps the
        # config's csv_monitor but must not start a second W&B run.
        engine_raw = {**raw, "wandb": {"enabled": False}}
        engine, _, _, _ = rp_engine.initialize(model=model, config=engine_raw)
        self.engine = engine
        try:
            if self.resume_from is not None:
                _, client = engine.load_checkpoint(str(self.resume_from))
                client = client or {}
                data.position = int(client.get("data_position", engine.global_steps * _gas(engine)))
                self.train_losses = [tuple(x) for x in client.get("train_losses", [])]  # type: ignore[misc]
                self.eval_losses = [tuple(x) for x in client.get("eval_losses", [])]  # type: ignore[misc]
                log.info("resumed from %s at step %d", self.resume_from, engine.global_steps)
            if _wandb_wanted(args, raw):
                self.wandb_run = _start_wandb(self.run_dir, name, raw, wandb_cfg)
                self._wandb_dir = str(Path(self.wandb_run.dir).parent)
            status = self._loop(engine, data)
        except BaseException:
            self._finish_wandb(1)
            engine.destroy()
            raise
        return self._finish(engine, data, status)

    def _loop(self, engine: Any, data: Any) -> int:
        from tqdm import tqdm

        args = self.args
        previous = {s: signal.signal(s, self._on_signal) for s in _EXIT_CODES}
        try:
            start = engine.global_steps
            tokens_per_step = engine.train_batch_size() * args.seq_len
            if self.eval_batches and not self.eval_losses:
                self._evaluate(engine)
            self.t0 = time.perf_counter()
            bar = tqdm(
                total=self.steps, initial=start, desc="rp-train", unit="step", file=sys.stderr
            )
            for _ in range(start, self.steps):
                t = time.perf_counter()
                loss = float(engine.train_batch(data))
                dt = time.perf_counter() - t
                step = engine.global_steps
                self.train_losses.append((step, loss))
                tps = tokens_per_step / dt if dt > 0 else 0.0
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:.0f}")
                bar.update(1)
                self._log_step(engine, step, loss, tps)
                if args.eval_every and step % args.eval_every == 0 and step < self.steps:
                    self._evaluate(engine)
                if args.save_every and step % args.save_every == 0 and step < self.steps:
                    self._save(engine, data)
                if self.stop_signal is not None:
                    break
            bar.close()
            self.elapsed = time.perf_counter() - self.t0
            self.trained = engine.global_steps - start
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        if self.stop_signal is not None:
            log.warning(
                "interrupted by signal %d at step %d", self.stop_signal, engine.global_steps
            )
            return _EXIT_CODES[signal.Signals(self.stop_signal)]
        return 0

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.stop_signal is not None and signum == signal.SIGINT:
            os._exit(130)  # second Ctrl-C: now, no clean-up
        self.stop_signal = signum
        print(
            f"\nrp-train: signal {signum}: stopping after this step (Ctrl-C again to exit now)",
            file=sys.stderr,
        )

    def _log_step(self, engine: Any, step: int, loss: float, tps: float) -> None:
        from rp_engine.train.tracker import host_rss_gb

        if self.wandb_run is None:
            return
        self._pending[step] = {
            "train/loss": loss, "train/lr": engine.get_lr()[0], "train/tokens_per_s": tps,
            "train/loss_scale": float(getattr(engine.optimizer, "cur_scale", 1.0)),
            "host/rss_gb": host_rss_gb(),
        }  # fmt: skip
        self._flush_wandb(engine)

    def _flush_wandb(self, engine: Any) -> None:
        """Log the pending W&B rows, in step order, of the steps that have finished: with
        overlapping iterations a step finishes during the next call, and its row (gradient
        norm, transfer stats, timeline) goes out then, so nothing here waits for the device."""
        report = engine.step_report()
        while self.wandb_run is not None and self._pending and report is not None:
            step = min(self._pending)
            if step > report.step:
                break
            metrics = self._pending.pop(step)
            if step == report.step:
                metrics.update(_report_metrics(engine, report))
            self.wandb_run.log(metrics, step=step)

    def _evaluate(self, engine: Any) -> float:
        # On the newest weights (the async optimizer may still be applying the last step), so
        # an evaluation matches the checkpoint / adapter saved at the same step.
        engine.synchronize()
        self._flush_wandb(engine)  # the rows of the steps before this evaluation first
        loss = float(
            engine.eval_batch(iter(self.eval_batches), num_micro_batches=len(self.eval_batches))
        )
        step = engine.global_steps
        self.eval_losses.append((step, loss))
        log.info("eval at step %d: loss %.4f, perplexity %.2f", step, loss, _ppl(loss))
        if self.wandb_run is not None:
            self.wandb_run.log({"eval/loss": loss, "eval/perplexity": _ppl(loss)}, step=step)
        return loss

    def _ckpt_dir(self) -> Path:
        return Path(self.args.save_dir) if self.args.save_dir else self.run_dir / "checkpoints"

    def _save(self, engine: Any, data: Any) -> None:
        client = {
            "data_position": data.position,
            "train_losses": self.train_losses,
            "eval_losses": self.eval_losses,
        }
        engine.save_checkpoint(str(self._ckpt_dir()), client_state=client)
        if self.args.lora:  # the adapter next to the DeepSpeed checkpoint, loadable with peft
            engine.synchronize()
            self.model.save_pretrained(str(self.run_dir / "adapter"))

    def _export(self, engine: Any) -> None:
        """The trained model as a ``save_pretrained`` folder, ``<run>/model`` (weights, config,
        tokenizer), which ``rp-train --model <run>/model`` and ``from_pretrained`` load; a
        LoRA run saves its adapter instead (``_save``)."""
        engine.synchronize()  # the module holds the last step's weights
        folder = self.run_dir / "model"
        # with the parameter tier the compute weights live on NVMe: read them in for the save
        with engine.store.materialized(writable=False):
            self.model.save_pretrained(str(folder))
        self.tokenizer.save_pretrained(str(folder))
        log.info("model saved for from_pretrained / rp-train --model: %s", folder)

    # --- the end ----------------------------------------------------------------------------------
    def _finish(self, engine: Any, data: Any, status: int) -> int:
        from rp_engine.train.run_folder import write_json, write_loss_png, write_timeline

        args = self.args
        try:
            if status == 0 and self.eval_batches:
                self._evaluate(engine)
            if not args.no_save:
                self._save(engine, data)
                if not args.lora:
                    self._export(engine)
            timeline = write_timeline(self.run_dir, engine.last_timeline(), title=args.model)
            self._flush_wandb(engine)  # the last steps' rows (last_timeline() drained them)
            write_loss_png(self.run_dir / "loss.png", self.train_losses, self.eval_losses,
                           title=f"{args.model}: loss")  # fmt: skip
            summary = self._summary(engine, data, timeline, status)
            write_json(self.run_dir / "summary.json", summary)
        finally:
            engine.destroy()
            self._finish_wandb(status)
        self._print(summary)
        return status

    def _summary(self, engine: Any, data: Any, timeline: Any, status: int) -> dict[str, Any]:
        losses = [v for _, v in self.train_losses]
        trained = getattr(self, "trained", 0)
        elapsed = getattr(self, "elapsed", 0.0)
        tokens = engine.train_batch_size() * self.args.seq_len * trained
        return {
            "model": self.args.model,
            "lora": self.args.lora,
            "status": {0: "finished", 130: "interrupted (SIGINT)", 143: "terminated (SIGTERM)"}.get(
                status, str(status)
            ),
            "steps": engine.global_steps,
            "steps_this_run": trained,
            "data_position": data.position,
            "epoch": data.epoch,
            "first_loss": losses[0] if losses else math.nan,
            "final_loss": losses[-1] if losses else math.nan,
            # [step, loss] of every step, those before a resume included (the CSV monitor and
            # W&B have them too, but a script comparing runs should not need either)
            "train_losses": [[step, loss] for step, loss in self.train_losses],
            "eval_losses": self.eval_losses,
            "final_eval_loss": self.eval_losses[-1][1] if self.eval_losses else None,
            "final_eval_perplexity": _ppl(self.eval_losses[-1][1]) if self.eval_losses else None,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else math.nan,
            "devices": len(engine.pool),
            "fwd_cuts": list(engine.planner.fwd_cuts),
            "bwd_cuts": list(engine.planner.bwd_cuts),
            "timeline": timeline,
            "run_dir": str(self.run_dir),
            "checkpoints": str(self._ckpt_dir()) if self._ckpt_dir().exists() else None,
            "adapter": str(self.run_dir / "adapter") if self.args.lora else None,
            "wandb": self._wandb_dir,
            "tensorboard": self._tensorboard_dir,
            "nvme": _nvme_summary(engine, trained),
        }

    def _finish_wandb(self, status: int) -> None:
        run, self.wandb_run = self.wandb_run, None
        if run is not None:
            run.finish(exit_code=status)

    _wandb_dir: str | None = None
    _tensorboard_dir: str | None = None

    def _print(self, s: dict[str, Any]) -> None:
        if self.args.json:
            print(json.dumps(s, default=str))
            return
        print(
            f"trained {s['steps_this_run']} steps (step {s['steps']}) on {s['devices']} "
            f"device(s): loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}, "
            f"{s['tokens_per_s']:.0f} tokens/s"
            + (
                f", eval loss {s['final_eval_loss']:.3f}"
                if s["final_eval_loss"] is not None
                else ""
            )
        )
        print(f"run folder: {s['run_dir']}")
        for key in ("checkpoints", "adapter", "wandb", "tensorboard"):
            if s.get(key):
                print(f"  {key}: {s[key]}")
        for name in ("loss.png", "timeline.png", "timeline.json", "summary.json", "ds_config.json"):
            if (self.run_dir / name).exists():
                print(f"  {name}: {self.run_dir / name}")


_SCRATCH = ("tiny-qwen3", "tiny-llama")  # presets trained from scratch: the default's high LR


def _report_metrics(engine: Any, report: Any) -> dict[str, float]:
    """W&B metrics of one finished step (``engine.step_report()``): norm, device peaks (each
    since the previous row: read, then reset here; the engine never resets them), transfer
    stats, and the measured timeline's bubble ratio and busy fractions."""
    metrics: dict[str, float] = {}
    if report.grad_norm is not None:
        metrics["train/grad_norm"] = float(report.grad_norm)
    for i, device in enumerate(engine.pool):
        if device.torch_device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device.torch_device)
            metrics[f"device/{i}/peak_memory_gb"] = peak / 2**30
            device.reset_peak()
    nvme = {k: v for k, v in report.stats.items() if k.startswith("nvme_")}
    transfer = {k: v for k, v in report.stats.items() if k not in nvme}
    metrics.update(_flatten("transfer", transfer))  # bytes, busy per device
    metrics.update({f"nvme/{k[5:]}": float(v) for k, v in nvme.items()})  # SSD wear: bytes
    if report.timeline:
        from rp_engine.plan.render import measured_result

        measured = measured_result(report.timeline)
        metrics["timeline/bubble_ratio"] = measured.bubble_ratio
        span = measured.makespan_ms or 1.0
        for d in range(measured.num_devices):  # busy fraction of the measured iteration
            busy = sum(i.end_ms - i.start_ms for i in measured.timeline(d) if i.busy)
            metrics[f"timeline/busy_fraction/{d}"] = busy / span
    return metrics


def _nvme_summary(engine: Any, steps: int) -> dict[str, Any] | None:
    """What the NVMe tiers wrote (SSD wear is what their users watch) and read; None without."""
    tiers = getattr(engine, "tiers", None)
    if not tiers:
        return None
    io = tiers.stats
    grads = getattr(engine, "grad_tier", None)
    return {
        "swap_files": [t.path for t in tiers.tiers],
        "disk_bytes": tiers.disk_bytes,
        "disk_bytes_by_file": {os.path.basename(t.path): t.disk_bytes for t in tiers.tiers},
        "io_engine": tiers.tiers[0].engine.describe(),
        "write_bytes_total": io.write_bytes,  # the initial write included
        "read_bytes_total": io.read_bytes,
        "write_bytes_per_step": (io.write_bytes - tiers.initial_bytes) / steps if steps else None,
        # the gradient tier's evictions (included above): gradients alive beyond its pool
        "gradient_write_bytes_total": grads.stats.write_bytes if grads is not None else 0,
    }


def _gas(engine: Any) -> int:
    return int(engine.gradient_accumulation_steps())


def _ppl(loss: float) -> float:
    return math.exp(loss) if loss < 50 else math.inf


def _flatten(prefix: str, stats: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(stats, dict):
        for k, v in stats.items():
            out.update(_flatten(f"{prefix}/{k}", v))
    elif isinstance(stats, list | tuple):
        for i, v in enumerate(stats):
            out.update(_flatten(f"{prefix}/{i}", v))
    elif isinstance(stats, int | float):
        out[prefix] = float(stats)
    return out


def _cpu_devices(devices: str | None) -> int:
    """How many CPU virtual devices the run will use (their memory is host memory)."""
    if devices is None:
        return 0 if torch.cuda.is_available() else 2
    if devices.startswith("cpu"):
        _, _, n = devices.partition(":")
        return int(n) if n.isdigit() else 1
    return 0


def _wandb_wanted(args: argparse.Namespace, raw: dict[str, Any]) -> bool:
    """On by default; off with --no-wandb or when the config's wandb section says
    ``"enabled": false`` (the config wins when it has the section)."""
    section = raw.get("wandb")
    if isinstance(section, dict) and section.get("enabled") is False:
        return False
    return not args.no_wandb


def _device_budget(cfg: Any) -> int | None:
    """Bytes one device may use: roundpipe.device_memory_gb, else the smallest visible GPU's
    memory when the run uses GPUs; None for CPU virtual devices without a budget."""
    if cfg.roundpipe.device_memory_gb:
        return int(cfg.roundpipe.device_memory_gb * 2**30)
    if _cpu_devices(cfg.roundpipe.devices) or not torch.cuda.is_available():
        return None
    sizes = [
        torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())
    ]
    return min(sizes) if sizes else None


def _start_wandb(run_dir: Path, name: str, raw: dict[str, Any], cfg: Any) -> Any:
    from rp_engine.train.tracker import start_wandb

    return start_wandb(
        run_dir=run_dir, name=run_dir.name or name, config=raw,
        project=cfg.project if cfg.enabled else None,  # the config's section, when it has one
        team=cfg.team, group=cfg.group,
    )  # fmt: skip


def _find_checkpoint(spec: str, out: str | None, model: str, save_dir: str | None) -> Path:
    """The checkpoint folder (holding ``latest``) that --resume names."""
    if spec != "latest":
        p = Path(spec)
        for cand in (p, p / "checkpoints"):
            if (cand / "latest").is_file():
                return cand
        raise DataError(
            f"--resume {spec}: no DeepSpeed checkpoint there (expected a 'latest' file in it or "
            "in its checkpoints/ folder)"
        )
    roots = [Path(save_dir)] if save_dir else []
    if out:
        roots.append(Path(out) / "checkpoints")
    else:
        runs = sorted(Path("rp-runs").glob("*"), key=lambda q: q.stat().st_mtime, reverse=True)
        roots += [r / "checkpoints" for r in runs if r.name.endswith(model)]
    for r in roots:
        if (r / "latest").is_file():
            return r
    raise DataError(
        "--resume latest: no checkpoint found"
        + (f" in {out}/checkpoints" if out else f" in ./rp-runs/*-{model}/checkpoints")
        + "; pass the checkpoint folder explicitly"
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
