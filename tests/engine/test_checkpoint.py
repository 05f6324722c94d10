"""rp_engine/checkpoint/: DeepSpeed's ZeRO checkpoint layout, zero_to_fp32 compatibility,
bit-exact resume, atomic writes, 16-bit export; and data.py's training data loader helpers.

The engine here is a small stand-in exposing exactly what the checkpoint package reads (module, a real
HostStore, a real HostOptimizer over torch AdamW, a DeepSpeed LR scheduler, a real synchronous
OptimizerStepper, counters, a parsed DSConfig), so the tests stay fast and independent of the
runtime. The real engine's save, zero_to_fp32 and resume are in test_resume.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from rp_engine import checkpoint as ckpt
from rp_engine import data as data_mod
from rp_engine.checkpoint import safe_load
from rp_engine.config import load_config
from rp_engine.model.host_store import HostStore
from rp_engine.optim.loss_scaler import LossScaler
from rp_engine.optim.optimizer import HostOptimizer
from rp_engine.optim.stepper import OptimizerStepper

F = nn.functional
VOCAB, DIM, RANK = 16, 8, 2


# ---------------------------------------------------------------------------------------------
# a tiny LM (embedding -> block -> norm + head) and a stand-in engine
class Block(nn.Module):
    def __init__(self, *, lora: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.register_buffer("scale", torch.full((DIM,), 0.5))  # persistent
        self.register_buffer("cache", torch.zeros(1), persistent=False)
        self.lora = lora
        if lora:  # LoRA-like: the base weight is frozen, a low-rank pair trains
            self.linear.requires_grad_(False)
            self.lora_a = nn.Parameter(torch.randn(RANK, DIM) * 0.1)
            self.lora_b = nn.Parameter(torch.randn(DIM, RANK) * 0.1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.linear(h)
        if self.lora:
            out = out + h @ self.lora_a.t() @ self.lora_b.t()
        return torch.tanh(out) * self.scale


class TinyLM(nn.Module):
    def __init__(self, *, seed: int = 0, tied: bool = False, lora: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = Block(lora=lora)
        self.out = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False))
        if tied:
            self.out[1].weight = self.embed.weight

    def layers(self) -> list[nn.Module]:
        return [self.embed, self.block, self.out]

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.block(self.embed(ids)))
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


class FakeEngine:
    """What the checkpoint package reads from a RoundPipeEngine, built from the real parts."""

    def __init__(
        self,
        *,
        stage: int = 2,
        bf16: bool = False,
        seed: int = 0,
        tied: bool = False,
        lora: bool = False,
        two_groups: bool = False,
        zero: dict[str, Any] | None = None,
    ) -> None:
        from deepspeed.runtime.lr_schedules import WarmupLR

        self._config = load_config(
            {
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": stage, **(zero or {})},
                "bf16": {"enabled": bf16},
                "gradient_clipping": 0.0,
            }
        )
        model = TinyLM(seed=seed, tied=tied, lora=lora)
        if bf16:
            model.to(torch.bfloat16)
        self.module = model
        self.store = HostStore(model.layers())
        masters = [
            (n, self.store.master_of(p)) for n, p in model.named_parameters() if p.requires_grad
        ]
        if two_groups:  # weight decay on matrices only: group order differs from module order
            groups = [
                {"params": [m for n, m in masters if m.dim() >= 2], "weight_decay": 0.1},
                {"params": [m for n, m in masters if m.dim() < 2], "weight_decay": 0.0},
            ]
        else:
            groups = [{"params": [m for _, m in masters]}]
        inner = torch.optim.AdamW(groups, lr=1e-2)
        self.host_optimizer = HostOptimizer(inner, per_layer=False, scaler=LossScaler())
        self.optimizer = self.host_optimizer  # what DeepSpeed calls engine.optimizer
        self.lr_scheduler = WarmupLR(self.optimizer, warmup_max_lr=1e-2, warmup_num_steps=5)
        self.stepper = OptimizerStepper(
            self.store, self.optimizer, clip=0.0, async_mode=False, fp16=False
        )
        self.global_steps = self.global_samples = self.skipped_steps = self.micro_steps = 0

    def synchronize(self) -> None:
        self.stepper.synchronize()

    def train_step(self, ids: torch.Tensor, labels: torch.Tensor) -> None:
        self.module.zero_grad(set_to_none=True)
        self.module(ids, labels).backward()
        self.stepper.open_step(self.global_steps + 1)
        for hp in self.store.owned_params():
            if hp.param.grad is not None:
                self.store.accumulate(hp.param, hp.param.grad)
        for layer in range(len(self.store.layers)):
            self.stepper.layer_ready(layer)
        self.stepper.close_step()
        self.lr_scheduler.step()
        self.global_steps += 1
        self.global_samples += 2
        self.micro_steps += 1

    def masters(self) -> dict[str, torch.Tensor]:
        names = {id(p): n for n, p in self.module.named_parameters()}
        return {names[id(hp.param)]: hp.master.clone() for hp in self.store.owned_params()}

    def save(self, path: Any, **kw: Any) -> None:
        self.synchronize()
        kw.setdefault("tag", None)
        kw.setdefault("client_state", {})
        kw.setdefault("save_latest", True)
        ckpt.save(self, path, **kw)

    def load(self, path: Any, **kw: Any) -> tuple[str | None, dict[str, Any] | None]:
        self.synchronize()
        for key in ("strict", "optimizer_states", "scheduler_states"):
            kw.setdefault(key, True)
        kw.setdefault("tag", None)
        return ckpt.load(self, path, **kw)


def batches(n: int, seed: int = 123) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (2, 5), generator=g), torch.randint(0, VOCAB, (2, 5), generator=g))
        for _ in range(n)
    ]


@pytest.fixture
def make_engine() -> Iterator[Any]:
    made: list[FakeEngine] = []

    def make(**kw: Any) -> FakeEngine:
        engine = FakeEngine(**kw)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.stepper.close()


def trained(make_engine: Any, steps: int = 3, **kw: Any) -> FakeEngine:
    engine = make_engine(**kw)
    for ids, labels in batches(steps):
        engine.train_step(ids, labels)
    return engine


def _load(path: str) -> Any:
    # weights_only, plus the DeepSpeed loss-scaler classes that DeepSpeed's loaders need
    return safe_load.load(str(path))


# ---------------------------------------------------------------------------------------------
# layout
@pytest.mark.parametrize(
    ("stage", "bf16", "model_file", "optim_file"),
    [
        (0, False, "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        (1, True, "mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        (2, False, "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        (2, True, "mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        (
            3,
            False,
            "zero_pp_rank_0_mp_rank_00_model_states.pt",
            "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        ),
        (
            3,
            True,
            "zero_pp_rank_0_mp_rank_00_model_states.pt",
            "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        ),
    ],
)
def test_layout_and_file_names(
    tmp_path: Any, make_engine: Any, stage: int, bf16: bool, model_file: str, optim_file: str
) -> None:
    engine = trained(make_engine, stage=stage, bf16=bf16)
    engine.save(tmp_path)
    assert (tmp_path / "latest").read_text() == "global_step3"
    assert (tmp_path / "zero_to_fp32.py").is_file()
    assert os.access(tmp_path / "zero_to_fp32.py", os.X_OK)
    assert sorted(os.listdir(tmp_path / "global_step3")) == sorted([model_file, optim_file])
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temp leftovers

    # Both files are plain data: weights_only loading works.
    model_state = _load(tmp_path / "global_step3" / model_file)
    optim_state = _load(tmp_path / "global_step3" / optim_file)
    for key in (
        "module buffer_names optimizer param_shapes frozen_param_shapes frozen_param_fragments "
        "shared_params lr_scheduler skipped_steps global_steps global_samples dp_world_size "
        "mp_world_size ds_config ds_version"
    ).split():
        assert key in model_state, key
    if stage == 0 and not bf16:  # DeepSpeed's stage-0 fp32 place for the optimizer state
        assert set(model_state["optimizer"]) == {"state", "param_groups"}
        assert not optim_state["optimizer_state_dict"]["base_optimizer_state"]["state"]
    else:
        assert model_state["optimizer"] is None
    assert model_state["global_steps"] == 3 and model_state["global_samples"] == 6
    assert model_state["dp_world_size"] == model_state["mp_world_size"] == 1
    assert model_state["buffer_names"] == ["block.scale"]
    assert model_state["lr_scheduler"] == {"last_batch_iteration": 2}
    assert model_state["ds_config"]["zero_optimization"]["stage"] == stage
    dtype = torch.bfloat16 if bf16 else torch.float32
    assert model_state["module"]["embed.weight"].dtype == dtype

    osd = optim_state["optimizer_state_dict"]
    assert osd["zero_stage"] == stage
    assert osd["loss_scaler"].cur_scale == 1.0 and osd["overflow"] is False
    assert osd["rp_loss_scaler"]["cur_scale"] == 1.0
    if stage == 3:
        assert osd["partition_count"] == 1
        assert "optimizer_state_dict" in osd and "fp32_flat_groups" in osd
    else:
        assert osd["partition_count"] == [1]
        assert "base_optimizer_state" in osd and "single_partition_of_fp32_groups" in osd
    (shapes,) = model_state["param_shapes"]
    assert list(shapes) == [n for n, p in engine.module.named_parameters()]


def test_param_shapes_follow_the_flat_group_order(tmp_path: Any, make_engine: Any) -> None:
    engine = trained(make_engine, two_groups=True)
    engine.save(tmp_path, tag="t")
    state = _load(tmp_path / "t" / "mp_rank_00_model_states.pt")
    osd = _load(tmp_path / "t" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")[
        "optimizer_state_dict"
    ]
    masters = engine.masters()
    assert [list(s) for s in state["param_shapes"]] == [
        ["embed.weight", "block.linear.weight", "out.1.weight"],
        ["block.linear.bias", "out.0.weight", "out.0.bias"],
    ]
    for shapes, flat in zip(
        state["param_shapes"], osd["single_partition_of_fp32_groups"], strict=True
    ):
        expected = torch.cat([masters[n].reshape(-1) for n in shapes])
        assert torch.equal(flat, expected)
    assert osd["partition_count"] == [1, 1]


def test_tied_and_frozen_metadata(tmp_path: Any, make_engine: Any) -> None:
    engine = trained(make_engine, tied=True, lora=True, stage=3)
    engine.save(tmp_path, tag="t")
    state = _load(tmp_path / "t" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert state["shared_params"] == {"out.1.weight": "embed.weight"}
    assert list(state["frozen_param_shapes"]) == ["block.linear.weight", "block.linear.bias"]
    # ZeRO-3 fragments are flat partitions (zero_to_fp32 concatenates them along dim 0).
    assert state["frozen_param_fragments"]["block.linear.weight"].shape == (DIM * DIM,)
    # DeepSpeed ZeRO-3's placeholders (0 elements) for every parameter, aliases included
    assert state["module"]["out.1.weight"].shape == (0,)
    assert state["module"]["block.linear.weight"].shape == (0,)


# ---------------------------------------------------------------------------------------------
# zero_to_fp32
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize(
    "variant",
    [
        {"two_groups": True},
        {"lora": True, "bf16": True},
        {"tied": True, "bf16": True},
        {"tied": True, "lora": True, "two_groups": True},
    ],
    ids=["two_groups", "frozen_bf16", "tied_bf16", "tied_frozen_groups"],
)
def test_zero_to_fp32_reads_our_checkpoints(
    tmp_path: Any, make_engine: Any, stage: int, variant: dict[str, Any]
) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    engine = trained(make_engine, stage=stage, **variant)
    engine.save(tmp_path)
    sd = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))

    module = engine.module
    assert set(sd) == set(module.state_dict())
    masters = engine.masters()
    for name, p in module.named_parameters(remove_duplicate=False):
        primary = "embed.weight" if name == "out.1.weight" and variant.get("tied") else name
        if p.requires_grad:
            assert sd[name].dtype == torch.float32
            assert torch.equal(sd[name], masters[primary]), name
        else:  # frozen parameters come back in the compute dtype, as DeepSpeed's
            assert torch.equal(sd[name], p.detach()), name
    assert torch.equal(sd["block.scale"], module.block.scale.float())
    if variant.get("bf16"):  # the masters are more precise than the weights: really fp32
        assert not torch.equal(masters["embed.weight"], module.embed.weight.float())


# ---------------------------------------------------------------------------------------------
# resume
@pytest.mark.parametrize(
    ("stage", "bf16", "zero"),
    [(0, False, {}), (2, True, {}), (3, False, {}), (3, True, {"sub_group_size": 100})],
    ids=["stage0", "stage2-bf16", "stage3", "stage3-bf16-subgroups"],
)
def test_resume_is_bit_exact(
    tmp_path: Any, make_engine: Any, stage: int, bf16: bool, zero: dict[str, Any]
) -> None:
    data = batches(5)
    first = make_engine(stage=stage, bf16=bf16, two_groups=True, zero=zero)
    for b in data[:3]:
        first.train_step(*b)
    first.optimizer.loss_scaler.cur_iter = 7  # something to restore
    first.skipped_steps = 1
    first.save(tmp_path, client_state={"epoch": 4, "rng": torch.arange(3)})
    saved_masters = first.masters()
    saved_weights = {k: v.clone() for k, v in first.module.state_dict().items()}
    for b in data[3:]:
        first.train_step(*b)

    if zero:  # DeepSpeed's ZeRO-3 sub-groups: several flat fp32 partitions per param group
        osd = _load(tmp_path / "global_step3" / ckpt.optim_file_name(bf16=bf16))
        assert len(osd["optimizer_state_dict"]["fp32_flat_groups"]) > 2
    second = make_engine(stage=stage, bf16=bf16, two_groups=True, seed=1, zero=zero)
    path, client = second.load(tmp_path)
    assert path == str(tmp_path / "global_step3" / ckpt.model_file_name(stage))
    assert (
        client is not None and client["epoch"] == 4 and torch.equal(client["rng"], torch.arange(3))
    )
    assert not set(client) & {"module", "global_steps", "ds_config", "param_shapes"}
    assert (second.global_steps, second.global_samples, second.skipped_steps) == (3, 6, 1)
    assert second.optimizer.loss_scaler.cur_iter == 7
    assert second.lr_scheduler.state_dict() == {"last_batch_iteration": 2}
    assert [second.store.version(i) for i in range(3)] == [3, 3, 3]  # stepper.set_step(3)
    for name, master in second.masters().items():
        assert torch.equal(master, saved_masters[name]), name
    for name, w in second.module.state_dict().items():
        assert torch.equal(w, saved_weights[name]), name

    for b in data[3:]:
        second.train_step(*b)
    for name, master in second.masters().items():
        assert torch.equal(master, first.masters()[name]), name
    s1, s2 = first.optimizer.state_dict(), second.optimizer.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for idx, st in s1["state"].items():
        for key, value in st.items():
            assert torch.equal(value, s2["state"][idx][key]), (idx, key)
    assert [g["lr"] for g in first.optimizer.param_groups] == [
        g["lr"] for g in second.optimizer.param_groups
    ]


def test_load_without_optimizer_or_scheduler_states(tmp_path: Any, make_engine: Any) -> None:
    engine = trained(make_engine, bf16=True, steps=3)
    engine.save(tmp_path)
    fresh = make_engine(bf16=True, seed=1)
    fresh.load(tmp_path, optimizer_states=False, scheduler_states=False)
    # Masters come from the loaded 16-bit weights (DeepSpeed's _restore_from_bit16_weights).
    for hp in fresh.store.owned_params():
        assert torch.equal(hp.master, hp.param.detach().float())
    assert len(fresh.optimizer.state) == 0
    assert fresh.lr_scheduler.state_dict() == {"last_batch_iteration": -1}  # untouched
    assert fresh.global_steps == 3  # counters are restored unless module_only

    other = make_engine(bf16=True, seed=1)
    other.load(tmp_path, optimizer_states=False, scheduler_states=False, module_only=True)
    assert other.global_steps == 0
    assert torch.equal(other.module.embed.weight, engine.module.embed.weight)


def test_load_explicit_tag_and_missing_tag(tmp_path: Any, make_engine: Any) -> None:
    engine = trained(make_engine, steps=1)
    engine.save(tmp_path, tag="first")
    engine.train_step(*batches(1, seed=9)[0])
    engine.save(tmp_path, tag="second", save_latest=False)
    assert (tmp_path / "latest").read_text() == "first"

    fresh = make_engine(seed=1)
    fresh.load(tmp_path, tag="second")
    assert fresh.global_steps == 2
    with pytest.raises(FileNotFoundError, match=r"nope.*\['first', 'second'\]"):
        fresh.load(tmp_path, tag="nope")


def test_nothing_to_load_warns_and_returns_none(
    tmp_path: Any, make_engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine()
    with caplog.at_level(logging.WARNING, logger="rp_engine.checkpoint"):
        assert engine.load(tmp_path) == (None, None)
    assert "Unable to find latest file" in caplog.text


def test_strict_module_loading(tmp_path: Any, make_engine: Any) -> None:
    trained(make_engine, lora=True).save(tmp_path)
    plain = make_engine()  # no LoRA parameters: unexpected keys in the checkpoint
    with pytest.raises(RuntimeError, match="lora_a"):
        plain.load(tmp_path)
    other = make_engine()
    other.load(tmp_path, strict=False, optimizer_states=False)


def test_exclude_frozen_parameters(tmp_path: Any, make_engine: Any) -> None:
    engine = trained(make_engine, lora=True, bf16=True)
    engine.save(tmp_path, exclude_frozen=True)
    state = _load(tmp_path / "global_step3" / "mp_rank_00_model_states.pt")
    assert "block.linear.weight" not in state["module"] and "block.lora_a" in state["module"]
    assert state["frozen_param_shapes"] is None and state["frozen_param_fragments"] is None

    fresh = make_engine(lora=True, bf16=True, seed=1)
    base = fresh.module.block.linear.weight.detach().clone()
    with pytest.raises(RuntimeError, match="Missing key"):
        fresh.load(tmp_path)
    fresh.load(tmp_path, strict=False)
    assert torch.equal(fresh.module.block.linear.weight, base)  # frozen weights kept
    masters = engine.masters()
    for name, master in fresh.masters().items():
        assert torch.equal(master, masters[name]), name


def test_client_state_cannot_overwrite_deepspeed_keys(tmp_path: Any, make_engine: Any) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="global_steps"):
        engine.save(tmp_path, client_state={"global_steps": 5})
    with pytest.raises(ValueError, match="plain folder name"):
        engine.save(tmp_path, tag="a/b")


# ---------------------------------------------------------------------------------------------
# atomicity
def _fail_on_call(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    real = torch.save
    calls = {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == n:
            raise OSError("disk full (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "save", flaky)


@pytest.mark.parametrize("same_tag", [False, True])
def test_crash_mid_save_keeps_previous_checkpoint(
    tmp_path: Any, make_engine: Any, monkeypatch: pytest.MonkeyPatch, same_tag: bool
) -> None:
    engine = trained(make_engine, steps=1)
    engine.save(tmp_path, tag="good")
    before = {n: (tmp_path / "good" / n).read_bytes() for n in os.listdir(tmp_path / "good")}
    engine.train_step(*batches(1, seed=5)[0])

    _fail_on_call(monkeypatch, 2)
    with pytest.raises(OSError, match="simulated"):
        engine.save(tmp_path, tag="good" if same_tag else "next")
    monkeypatch.undo()

    assert (tmp_path / "latest").read_text() == "good"
    assert sorted(os.listdir(tmp_path)) == ["good", "latest", "zero_to_fp32.py", "zero_to_torch.py"]
    after = {n: (tmp_path / "good" / n).read_bytes() for n in os.listdir(tmp_path / "good")}
    assert after == before
    fresh = make_engine(seed=1)
    assert fresh.load(tmp_path)[0] is not None and fresh.global_steps == 1


def test_overwriting_a_tag_replaces_it(tmp_path: Any, make_engine: Any) -> None:
    engine = trained(make_engine, steps=1)
    engine.save(tmp_path, tag="t")
    engine.train_step(*batches(1, seed=5)[0])
    engine.save(tmp_path, tag="t")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    assert _load(tmp_path / "t" / "mp_rank_00_model_states.pt")["global_steps"] == 2


# ---------------------------------------------------------------------------------------------
# 16-bit export
@pytest.mark.parametrize("stage", [2, 3])
def test_save_16bit_loads_into_a_fresh_model(tmp_path: Any, make_engine: Any, stage: int) -> None:
    engine = trained(make_engine, stage=stage, bf16=True, lora=True, tied=True)
    engine.synchronize()
    assert ckpt.save_16bit(engine, tmp_path, "pytorch_model.bin", exclude_frozen=False)
    state = _load(tmp_path / "pytorch_model.bin")
    fresh = TinyLM(seed=3, lora=True, tied=True).to(torch.bfloat16)
    fresh.load_state_dict(state)
    for (name, a), b in zip(
        fresh.state_dict().items(), engine.module.state_dict().values(), strict=True
    ):
        assert a.dtype == b.dtype and torch.equal(a, b), name

    assert ckpt.save_16bit(engine, tmp_path, "adapter.bin", exclude_frozen=True)
    trainable = _load(tmp_path / "adapter.bin")
    assert "block.linear.weight" not in trainable and "block.lora_a" in trainable
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


# ---------------------------------------------------------------------------------------------
# data loading
def test_build_dataloader_matches_deepspeed_order() -> None:
    from deepspeed.runtime.dataloader import DeepSpeedDataLoader

    data = [torch.tensor([i]) for i in range(10)]
    cfg = load_config({"train_micro_batch_size_per_gpu": 3, "dataloader_drop_last": True})
    loader = data_mod.build_dataloader(data, cfg, None)
    ours = [b.flatten().tolist() for b in loader]
    theirs_loader = DeepSpeedDataLoader(
        data, batch_size=3, pin_memory=False, local_rank=0, tput_timer=None,
        num_local_io_workers=0, data_parallel_world_size=1, data_parallel_rank=0,
        dataloader_drop_last=True,
    )  # fmt: skip
    theirs = [b.flatten().tolist() for b in theirs_loader]
    assert ours == theirs and len(ours) == 3 and all(len(b) == 3 for b in ours)
    assert sorted(sum(ours, [])) != list(range(9))  # shuffled

    keep = data_mod.build_dataloader(data, load_config({"train_micro_batch_size_per_gpu": 3}), None)
    assert [len(b) for b in keep] == [3, 3, 3, 1]
    collated = data_mod.build_dataloader(data, cfg, lambda items: len(items))
    assert list(collated) == [3, 3, 3]


def test_repeat_cycles_epochs() -> None:
    it = data_mod.repeat([1, 2, 3])
    assert [next(it) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    assert iter(it) is it
    with pytest.raises(ValueError, match="no batch"):
        next(data_mod.repeat([]))


def test_interrupted_swap_is_recovered(tmp_path: Any, make_engine: Any) -> None:
    engine = trained(make_engine, steps=1)
    engine.save(tmp_path, tag="t")
    engine.save(tmp_path, tag="u")
    # A process killed between "rename <tag> aside" and "rename the new folder in" leaves the
    # old folder aside (and maybe its half-written temp folder): load and save put it back.
    os.rename(tmp_path / "t", tmp_path / ".t.old-999999999")
    os.makedirs(tmp_path / ".u.tmp-999999999")
    fresh = make_engine(seed=1)
    assert fresh.load(tmp_path, tag="t")[0] is not None
    assert (tmp_path / "t").is_dir()
    os.rename(tmp_path / "t", tmp_path / ".t.old-999999999")
    engine.save(tmp_path, tag="v")
    assert sorted(n for n in os.listdir(tmp_path) if not n.endswith(".py")) == [
        "latest", "t", "u", "v",
    ]  # fmt: skip
