"""rp-train as a fine-tuning tool: HF model folder + jsonl + LoRA, prompt masking, resume,
Ctrl-C, preflight, --plan and the clear errors. Tiny models, a few steps each."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rp_engine.train import cli
from rp_engine.train import data as D

# Tiny and quick: 2 layers, hidden 32, sequences of 32 tokens, 2 CPU virtual devices.
TINY = ["--layers", "2", "--hidden", "32", "--seq-len", "32", "--devices", "cpu:2"]

WORDS = "zero one two three four five six seven eight nine plus is what ?".split()


def _pairs() -> list[dict[str, str]]:
    pairs = []
    for a in range(10):
        for b in range(10):
            if a + b < 10:
                prompt = f"what is {WORDS[a]} plus {WORDS[b]} ?"
                pairs.append({"prompt": prompt, "completion": f" {WORDS[a + b]}"})
    return pairs


def _save_hf_model(folder: Path) -> None:
    """A tiny Qwen3 + a word-level tokenizer, written with save_pretrained (no network)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
    )
    config = Qwen3Config(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=2, initializer_range=0.1,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    fast.save_pretrained(folder)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _summary(run: Path) -> dict[str, Any]:
    return json.loads((run / "summary.json").read_text())


# --- data -----------------------------------------------------------------------------------------
class _Chars:
    eos_token_id = 99
    pad_token_id = 98

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) - ord("a") for c in text]


def test_pack_masks_the_prompt_and_pads_the_tail() -> None:
    packed = D.pack([D.Example("ab", "cd"), D.Example("", "e")], _Chars(), seq_len=4)
    assert packed.input_ids.tolist() == [[0, 1, 2, 3], [99, 4, 99, 98]]
    assert packed.labels.tolist() == [[-100, -100, 2, 3], [99, 4, 99, -100]]


def test_micro_batches_resume_from_a_position() -> None:
    packed = D.pack([D.Example("", "abcdefghijklmnop" * 3)], _Chars(), seq_len=4)
    straight = D.MicroBatches(packed, 2, seed=3)
    seen = [next(straight)["input_ids"] for _ in range(7)]  # crosses an epoch boundary
    resumed = D.MicroBatches(packed, 2, seed=3, position=4)
    for expected in seen[4:]:
        assert torch.equal(next(resumed)["input_ids"], expected)


def test_embedded_corpus_does_not_depend_on_imports() -> None:
    """Submodules become attributes of their package once imported; their docstrings must not
    enter the corpus, or a resumed run in another process would see different data."""
    import json.tool
    import logging.handlers

    corpus = cli.stdlib_corpus().decode()
    assert logging.handlers.__doc__ and logging.handlers.__doc__ not in corpus
    assert json.tool.__doc__ and json.tool.__doc__ not in corpus


# --- the main acceptance test: HF folder + jsonl prompt/completion + LoRA ---------------------------
def _hand_loss(model: Any, batches: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
    """(masked, unmasked) mean over micro-batches of the token-mean next-token cross entropy,
    computed from the logits by hand: masked skips label -100 (the prompt)."""
    masked, unmasked = [], []
    with torch.no_grad():
        for b in batches:
            logits = model(input_ids=b["input_ids"]).logits[:, :-1].float()
            logp = torch.log_softmax(logits, dim=-1)
            ids, labels = b["input_ids"][:, 1:], b["labels"][:, 1:]
            nll_all = -logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
            keep = labels != -100
            masked.append(float(nll_all[keep].mean()))
            unmasked.append(float(nll_all.mean()))
    return sum(masked) / len(masked), sum(unmasked) / len(unmasked)


def test_finetune_hf_folder_jsonl_lora(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, run = tmp_path / "hf-model", tmp_path / "run"
    _save_hf_model(model_dir)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in _pairs()))
    argv = [
        "--model", str(model_dir), "--data", str(data), "--lora", "8,16,q_proj,v_proj,o_proj",
        "--steps", "12", "--eval-every", "6", "--eval-split", "0.2", "--lr", "1e-2",
        "--seq-len", "16", "--micro-batch", "2", "--grad-accum", "2", "--devices", "cpu:2",
        "--sync-optimizer", "--out", str(run), "--no-wandb",
    ]  # fmt: skip
    rc, out, _ = _run(argv, capsys)
    assert rc == 0, out
    s = _summary(run)
    assert s["steps"] == 12 and (run / "adapter" / "adapter_config.json").is_file()
    assert (run / "checkpoints" / "latest").is_file() and (run / "loss.png").is_file()

    # The same held-out micro-batches the run evaluated on.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    packed = D.pack(D.read_examples(data), tokenizer, 16)
    _, eval_set = D.split(packed, 0.2, seed=0)
    batches = D.eval_batches(eval_set, 2)[:4]
    assert any((b["labels"] == -100).any() for b in batches)  # prompts are there, masked

    # Step-0 eval loss == hand-computed loss over completion tokens only (LoRA B starts at 0).
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    masked, unmasked = _hand_loss(base, batches)
    initial = s["eval_losses"][0]
    assert initial[0] == 0
    assert initial[1] == pytest.approx(masked, abs=1e-4)
    assert abs(masked - unmasked) > 1e-2  # the mask matters for this data

    # The loss falls, and the saved adapter on a fresh base reproduces the engine's eval loss.
    assert s["final_eval_loss"] < initial[1] - 0.1
    fresh = AutoModelForCausalLM.from_pretrained(model_dir)
    tuned = PeftModel.from_pretrained(fresh, run / "adapter").eval()
    assert _hand_loss(tuned, batches)[0] == pytest.approx(s["final_eval_loss"], abs=1e-4)
    assert "run folder:" in out and str(run) in out


# --- resume -----------------------------------------------------------------------------------------
def test_resume_continues_steps_lr_and_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    common = [*TINY, "--no-wandb", "--sync-optimizer", "--eval-split", "0"]
    rc, _, _ = _run([*common, "--steps", "4", "--out", str(tmp_path / "straight")], capsys)
    assert rc == 0
    rc, _, _ = _run([*common, "--steps", "2", "--out", str(tmp_path / "split")], capsys)
    assert rc == 0
    argv = [*common, "--steps", "4", "--out", str(tmp_path / "split"), "--resume", "latest"]
    rc, out, _ = _run(argv, capsys)
    assert rc == 0, out
    straight, resumed = _summary(tmp_path / "straight"), _summary(tmp_path / "split")
    assert resumed["steps"] == 4 and resumed["steps_this_run"] == 2
    assert resumed["data_position"] == straight["data_position"] == 4 * 4
    # Same weights, LR and data at steps 3 and 4 -> the same losses; summary.json lists every
    # step's loss, the ones before the resume included.
    assert resumed["final_loss"] == pytest.approx(straight["final_loss"], abs=1e-5)
    assert [s for s, _ in resumed["train_losses"]] == [1, 2, 3, 4]
    for (_, a), (_, b) in zip(resumed["train_losses"], straight["train_losses"], strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    assert resumed["train_losses"][-1][1] == resumed["final_loss"]
    ckpt = torch.load(
        tmp_path / "split" / "checkpoints" / "global_step4" / "mp_rank_00_model_states.pt",
        weights_only=False,
    )
    ref = torch.load(
        tmp_path / "straight" / "checkpoints" / "global_step4" / "mp_rank_00_model_states.pt",
        weights_only=False,
    )
    assert ckpt["lr_scheduler"] == ref["lr_scheduler"]
    losses = [v for _, v in ckpt["train_losses"]]
    assert losses == pytest.approx([v for _, v in ref["train_losses"]], abs=1e-5)


# --- Ctrl-C -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_saves_a_checkpoint_and_finishes_wandb(tmp_path: Path, sig: int) -> None:
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "WANDB_API_KEY")}
    root = Path(__file__).resolve().parents[2]
    # tests/support only for its sitecustomize: the CPU probe this process made (conftest.py)
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests" / "support")])
    env["HOME"] = str(tmp_path)  # no ~/.netrc W&B key: the default (offline) path is what runs
    log = (tmp_path / "stderr.txt").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rp_engine.train.cli", *TINY, "--steps", "100000", "--out", str(run)],
        stdout=subprocess.PIPE, stderr=log, env=env, cwd=tmp_path, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while " 2/100000" not in (tmp_path / "stderr.txt").read_text():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    code = {signal.SIGINT: 130, signal.SIGTERM: 143}[sig]
    assert proc.returncode == code, (tmp_path / "stderr.txt").read_text()[-2000:]
    s = _summary(run)
    assert s["status"].startswith(("interrupted", "terminated")) and 2 <= s["steps"] < 100000

    # The checkpoint loads into a fresh engine at the interrupted step.
    import rp_engine

    model = cli.build_tiny_model(layers=2, hidden=32)
    config = json.loads((run / "ds_config.json").read_text())
    engine, *_ = rp_engine.initialize(model=model, config={**config, "wandb": {"enabled": False}})
    try:
        path, client = engine.load_checkpoint(str(run / "checkpoints"))
        assert path is not None and engine.global_steps == s["steps"]
        assert client is not None and client["data_position"] == s["data_position"]
    finally:
        engine.destroy()

    # An offline W&B run in the run folder, finished with the exit code.
    (wandb_run,) = (run / "wandb").glob("offline-run-*")
    assert list(wandb_run.glob("run-*.wandb"))
    debug = (wandb_run / "logs" / "debug.log").read_text()
    assert "finishing run" in debug and f"got exitcode: {code}" in debug


# --- preflight and plan -------------------------------------------------------------------------------
def test_preflight_rejects_an_impossible_run(tmp_path: Path, capsys) -> None:
    argv = ["--model", "llama-3.1-8b", "--out", str(tmp_path), "--no-wandb", "--seq-len", "64"]
    rc, _, err = _run(argv, capsys)
    assert rc == 2
    assert "needs about" in err and "is available" in err and "--lora" in err
    needed, available = (float(x) for x in _gib_numbers(err)[:2])
    assert needed > available and needed > 100  # 8 B params x 20 B each


def test_preflight_rejects_a_layer_larger_than_a_device(tmp_path: Path, capsys) -> None:
    ds = {"train_micro_batch_size_per_gpu": 4, "roundpipe": {"device_memory_gb": 0.001}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    argv = ["--deepspeed", str(tmp_path / "ds.json"), "--no-wandb", "--seq-len", "64",
            "--out", str(tmp_path), "--devices", "cpu:2"]  # fmt: skip
    rc, _, err = _run(argv, capsys)
    assert rc == 2 and "largest layer needs about" in err and "a device has 1.0 MiB" in err


def _gib_numbers(text: str) -> list[str]:
    import re

    return re.findall(r"([0-9.]+) GiB", text)


def test_plan_prints_cuts_memory_and_throughput_without_training(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rp_engine
    from rp_engine.config import load_config

    def no_engine(*a: Any, **k: Any) -> Any:
        raise AssertionError("--plan must not build an engine")

    monkeypatch.setattr(rp_engine, "initialize", no_engine)
    # --seq-len and --micro-batch given: kept; the accumulation, rounds and cuts are searched
    argv = ["--model", "qwen3-0.6b", "--plan", "--out", str(tmp_path), "--seq-len", "512",
            "--micro-batch", "2"]  # fmt: skip
    rc, out, _ = _run(argv, capsys)
    assert rc == 0, out
    assert "| # | micro-batch x accum (round)" in out and "binds" in out
    assert "forward cuts" in out and "backward cuts" in out
    assert "device memory peak per device" in out and "tokens/s" in out and "bubble" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert sum(plan["fwd_cuts"]) == 28 and plan["tokens_per_s"] > 0
    assert (plan["seq_len"], plan["micro_batch"]) == (512, 2)
    assert plan["binds"] in ("compute", "pcie", "host adam", "disk") and plan["binds"] in out
    assert (tmp_path / "plan.png").is_file()
    assert plan["host_bytes"] > 0.6e9 * 16  # full fine-tune state of 0.6 B params
    # the best configuration is the run folder's ds_config.json, and it parses
    cfg = load_config(json.loads((tmp_path / "ds_config.json").read_text()))
    assert list(cfg.roundpipe.fwd_cuts or ()) == plan["fwd_cuts"]
    assert cfg.train_micro_batch_size_per_gpu == 2
    assert cfg.gradient_accumulation_steps == plan["micro_batches_per_step"]


# --- clear errors ---------------------------------------------------------------------------------------
def test_clear_errors(tmp_path: Path, capsys) -> None:
    rc, _, err = _run(["--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)], capsys)
    assert rc == 2 and "missing.jsonl" in err and "no such file" in err

    rc, _, err = _run(["--model", "tiny-qwen4", "--out", str(tmp_path)], capsys)
    assert rc == 2 and "tiny-qwen4" in err and "tiny-qwen3" in err  # lists the presets

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"prompt": "a", "completion": "b"}\n{"text": oops}\n')
    rc, _, err = _run(["--data", str(bad), "--out", str(tmp_path)], capsys)
    assert rc == 2 and f"{bad}:3" in err and "not valid JSON" in err

    bad.write_text('{"text": "fine"}\n{"question": "a"}\n')
    rc, _, err = _run(["--data", str(bad), "--out", str(tmp_path)], capsys)
    assert rc == 2 and f"{bad}:2" in err and "'prompt' + 'completion'" in err

    rc, _, err = _run(["--lora", "eight", "--out", str(tmp_path)], capsys)
    assert rc == 2 and "r,alpha" in err


def test_deepspeed_config_auto_values_are_filled_and_written(tmp_path: Path, capsys) -> None:
    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    }
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    argv = [*TINY, "--deepspeed", str(tmp_path / "ds.json"), "--steps", "1", "--no-wandb",
            "--micro-batch", "2", "--grad-accum", "3", "--lr", "1e-3", "--out", str(tmp_path / "r"),
            "--tensorboard"]  # fmt: skip
    rc, out, _ = _run(argv, capsys)
    assert rc == 0, out
    resolved = json.loads((tmp_path / "r" / "ds_config.json").read_text())
    assert resolved["train_micro_batch_size_per_gpu"] == 2
    assert resolved["gradient_accumulation_steps"] == 3
    assert resolved["optimizer"]["params"]["lr"] == 1e-3
    assert resolved["scheduler"]["params"]["warmup_max_lr"] == 1e-3
    assert _summary(tmp_path / "r")["data_position"] == 3
    # --tensorboard: the engine's monitor writes events into the run folder
    assert resolved["tensorboard"]["output_path"] == str(tmp_path / "r")
    assert _summary(tmp_path / "r")["tensorboard"] == str(tmp_path / "r" / "tensorboard")
    assert list((tmp_path / "r" / "tensorboard").glob("events.out.tfevents.*"))


def test_wandb_rows_go_out_in_step_order_when_their_step_has_finished() -> None:
    """With overlapping iterations a step finishes during the next call: its W&B row (with its
    own gradient norm and transfer stats) is logged then, labelled with its own step, and the
    logging never finishes a step in flight (only ``step_report()`` is read)."""
    from rp_engine.engine import StepReport

    class Run:
        def __init__(self) -> None:
            self.rows: list[tuple[int, dict[str, float]]] = []

        def log(self, metrics: dict[str, float], step: int) -> None:
            self.rows.append((step, metrics))

    class Engine:  # what _log_step reads; the draining readers raise
        pool: list[Any] = []
        optimizer = None
        finished = 0

        def get_lr(self) -> list[float]:
            return [0.1]

        def step_report(self) -> StepReport | None:
            if not self.finished:
                return None
            stats = {"h2d_bytes": 10 * self.finished}
            return StepReport(self.finished, float(self.finished), stats, [])

        def get_global_grad_norm(self) -> float:
            raise AssertionError("logging must not finish the step in flight")

        last_step_stats = last_timeline = get_global_grad_norm

    job = cli._Job(cli._parser().parse_args([]))
    job.wandb_run = run = Run()
    engine = Engine()
    for step in (1, 2, 3):  # train_batch `step` returned; step - 1 has finished meanwhile
        engine.finished = step - 1
        job._log_step(engine, step, loss=float(step), tps=1.0)
    assert [s for s, _ in run.rows] == [1, 2]
    engine.finished = 3  # the end drains: the last row goes out
    job._flush_wandb(engine)
    assert [s for s, _ in run.rows] == [1, 2, 3]
    for step, metrics in run.rows:
        assert metrics["train/loss"] == step
        assert metrics["train/grad_norm"] == step  # that step's own norm
        assert metrics["transfer/h2d_bytes"] == 10 * step


def _nvme_summary(tmp_path: Path, capsys: Any, **offload: dict[str, Any]) -> dict[str, Any]:
    """rp-train for 3 steps with ``zero_optimization`` stage 3 and ``offload`` (each with
    ``nvme_path`` set to ``tmp_path/nvme``): summary.json's "nvme" block."""
    (tmp_path / "nvme").mkdir()
    zero: dict[str, Any] = {"stage": 3}
    for key, value in offload.items():
        zero[key] = {**value, "nvme_path": str(tmp_path / "nvme")}
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
    }
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    argv = [*TINY, "--deepspeed", str(tmp_path / "ds.json"), "--steps", "3", "--no-wandb",
            "--out", str(tmp_path / "r")]  # fmt: skip
    rc, out, _ = _run(argv, capsys)
    assert rc == 0, out
    return _summary(tmp_path / "r")["nvme"]


def test_nvme_tier_bytes_are_in_the_summary(tmp_path: Path, capsys) -> None:
    """With ``offload_optimizer.device: "nvme"`` the summary says what the tier wrote (SSD
    wear: per step and in total) and the swap file is gone after the run."""
    nvme = _nvme_summary(tmp_path, capsys, offload_optimizer={"device": "nvme"})
    assert sorted(Path(p).name for p in nvme["swap_files"]) == ["grads.swp", "optimizer.swp"]
    disk = nvme["disk_bytes_by_file"]["optimizer.swp"]
    # every layer's optimizer record is written at initialize and once per step; the gradient
    # tier writes only what it evicts (counted apart, included in the totals)
    spilled = nvme["gradient_write_bytes_total"]
    assert disk > 0 and nvme["write_bytes_total"] == 4 * disk + spilled
    assert nvme["write_bytes_per_step"] == disk + spilled / 3
    assert not list((tmp_path / "nvme").rglob("*.swp"))


def test_both_nvme_tiers_are_in_the_summary(tmp_path: Path, capsys) -> None:
    """With ``offload_param.device: "nvme"`` too, the summary lists both swap files and counts
    both tiers' bytes; both files are gone after the run."""
    nvme = _nvme_summary(
        tmp_path, capsys, offload_optimizer={"device": "nvme"},
        offload_param={"device": "nvme", "max_in_cpu": 0},
    )  # fmt: skip
    names = sorted(Path(p).name for p in nvme["swap_files"])
    assert names == ["grads.swp", "optimizer.swp", "params.swp"]
    assert nvme["write_bytes_total"] > nvme["disk_bytes"] > 0
    assert nvme["read_bytes_total"] > 0
    assert not list((tmp_path / "nvme").rglob("*.swp"))


def test_a_preset_run_saves_a_model_that_rp_train_loads(tmp_path: Path, capsys) -> None:
    """A full run writes <run>/model (weights, config and the byte tokenizer as Hugging Face
    files). Fine-tuning it with ``--model <run>/model`` sees the same tokens and the same
    weights: its step-0 evaluation equals the first run's final one (same held-out split)."""
    from rp_engine.train.presets import ByteTokenizer, load_model

    first, second = tmp_path / "first", tmp_path / "second"
    common = [
        "--steps", "3", "--seq-len", "16", "--micro-batch", "2", "--grad-accum", "2",
        "--devices", "cpu:2", "--sync-optimizer", "--no-wandb", "--eval-every", "0",
        "--lr", "1e-2", "--warmup", "0",
    ]  # fmt: skip
    rc, out, _ = _run(["--model", "tiny-qwen3", "--out", str(first), *common], capsys)
    assert rc == 0, out
    folder = first / "model"
    assert (folder / "config.json").is_file()
    loaded = load_model(str(folder))
    sample = "naïve “bytes” 😀\n\t"
    ref = ByteTokenizer()
    assert loaded.tokenizer.encode(sample, add_special_tokens=False) == ref.encode(sample)
    assert (loaded.tokenizer.eos_token_id, loaded.tokenizer.pad_token_id) == (
        ref.eos_token_id,
        ref.pad_token_id,
    )
    rc, out, _ = _run(["--model", str(folder), "--out", str(second), *common], capsys)
    assert rc == 0, out
    before, after = _summary(first)["eval_losses"], _summary(second)["eval_losses"]
    assert after[0][0] == 0
    assert after[0][1] == pytest.approx(before[-1][1], rel=1e-5)
    assert after[0][1] != pytest.approx(before[0][1], rel=1e-3)  # the first run did train
