"""Tests for rp_engine.config: DeepSpeed config reading, defaults, inference and error messages."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from config_fixtures import DS_CONFIGS, _fixture

from rp_engine.config import (
    DSConfig,
    hf_auto_values,
    load_config,
    resolve_config_arg,
)


def cfg(**extra: Any) -> dict[str, Any]:
    """A minimal valid config plus `extra` top-level keys."""
    return {"train_micro_batch_size_per_gpu": 2, **extra}


def err(config: Any, **kwargs: Any) -> str:
    with pytest.raises(ValueError) as info:
        load_config(config, **kwargs)
    return str(info.value)


HF_AUTO = hf_auto_values(
    hidden_size=64, micro_batch_size=2, gradient_accumulation_steps=4, lr=1e-4, total_steps=100
)


# ------------------------------------------------------------------ batch triplet (reference 3)


@pytest.mark.parametrize(
    ("given", "world_size", "expected"),
    [
        ({"train_batch_size": 8}, 1, (8, 8, 1)),
        ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}, 1, (8, 2, 4)),
        ({"train_micro_batch_size_per_gpu": 2}, 1, (2, 2, 1)),
        ({"train_batch_size": 8, "gradient_accumulation_steps": 2}, 1, (8, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 1, (8, 2, 4)),
        ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 2, (16, 2, 4)),
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, 2, (16, 2, 4)),
        ({"train_batch_size": 8}, 2, (8, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 3}, 2, (6, 3, 1)),
        ({"train_batch_size": 1e1, "train_micro_batch_size_per_gpu": 5.0}, 1, (10, 5, 2)),
    ],
)
def test_batch_triplet_inference(given, world_size, expected):
    c = load_config(given, world_size=world_size)
    got = (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps)
    assert got == expected
    assert all(type(v) is int for v in got)
    assert c.world_size == world_size


def test_batch_gas_only_is_an_error():
    msg = err({"gradient_accumulation_steps": 4})
    assert "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided" in msg


def test_batch_none_given_is_an_error():
    assert "train_micro_batch_size_per_gpu" in err({})


def test_batch_mismatch_names_values_and_fix():
    msg = err({"train_batch_size": 9, "train_micro_batch_size_per_gpu": 2})
    assert "9 != 2 * 4 * 1" in msg
    assert "gradient_accumulation_steps = 9 // 2 // 1 = 4" in msg  # says what was inferred
    assert "train_batch_size = 8" in msg  # the fix


def test_batch_all_three_inconsistent_with_world_size():
    given = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
    given["gradient_accumulation_steps"] = 4
    assert load_config(given).train_batch_size == 8
    assert "8 != 2 * 4 * 2" in err(given, world_size=2)


@pytest.mark.parametrize(
    ("given", "key"),
    [
        ({"train_batch_size": 0}, "train_batch_size"),
        ({"train_micro_batch_size_per_gpu": -1}, "train_micro_batch_size_per_gpu"),
        ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 0}, "gradient"),
        ({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 4}, "gradient_accumulation"),
        ({"train_micro_batch_size_per_gpu": "2"}, "without quotes"),
        ({"train_micro_batch_size_per_gpu": 2.5}, "whole number"),
        ({"train_micro_batch_size_per_gpu": True}, "train_micro_batch_size_per_gpu"),
    ],
)
def test_batch_bad_values(given, key):
    assert key in err(given)


def test_world_size_must_be_positive():
    assert "world_size" in err(cfg(), world_size=0)


# ------------------------------------------------------------------ loading: path, base64, dict


def test_path_with_comments(tmp_path):
    p = tmp_path / "ds_config.json"
    p.write_text(
        "// a comment\n{\n  # hash comment\n  /* block */\n"
        '  "train_micro_batch_size_per_gpu": 2, // trailing\n'
        '  "gradient_accumulation_steps": 4,\n'
        '  "zero_optimization": {"stage": 2}\n}\n'
    )
    c = load_config(p)
    assert (c.train_batch_size, c.zero.stage) == (8, 2)
    assert load_config(str(p)) == c


def test_duplicate_keys_rejected(tmp_path):
    p = tmp_path / "dup.json"
    p.write_text(
        '{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", '
        '"params": {"lr": 1e-3, "lr": 1e-4}}}'
    )
    msg = err(p)
    assert msg.startswith("Duplicate keys")
    assert "'lr'" in msg and str(p) in msg


def test_duplicate_top_level_keys_rejected(tmp_path):
    p = tmp_path / "dup.json"
    p.write_text('{"train_micro_batch_size_per_gpu": 2, "train_micro_batch_size_per_gpu": 4}')
    assert "Duplicate keys" in err(p) and "train_micro_batch_size_per_gpu" in err(p)


def test_base64_config():
    text = json.dumps(cfg(gradient_accumulation_steps=3))
    encoded = base64.urlsafe_b64encode(text.encode()).decode()
    assert load_config(encoded).train_batch_size == 6
    # longer than any file name: must still be read as base64, not fail as a path
    big = cfg(gradient_accumulation_steps=3, wandb={"enabled": False, "project": "p" * 400})
    encoded = base64.urlsafe_b64encode(json.dumps(big).encode()).decode()
    assert load_config(encoded).wandb.project == "p" * 400


def test_dict_is_not_modified():
    d = cfg(optimizer={"type": "Adam", "params": {"lr": "auto"}})
    snapshot = json.dumps(d)
    c = load_config(d, auto_values={"optimizer.params.lr": 0.1})
    assert json.dumps(d) == snapshot
    assert c.raw["optimizer"]["params"]["lr"] == 0.1


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ("does/not/exist.json", "not an existing file"),
        ("missing.json", "not an existing file"),
        ("@@not-base64@@", "not an existing file"),
        ('{"train_batch_size": 8}', "inline JSON"),
        (base64.urlsafe_b64encode(b"[1, 2]").decode(), "not an existing file"),
        (None, "No DeepSpeed config given"),
        (42, "must be a dict"),
    ],
)
def test_bad_config_sources(config, needle):
    assert needle in err(config)


def test_directory_and_missing_pathlike(tmp_path):
    assert "is a directory" in err(tmp_path)
    assert "does not exist" in err(tmp_path / "nope.json")


def test_top_level_must_be_object(tmp_path):
    p = tmp_path / "list.json"
    p.write_text("[1, 2]")
    assert "JSON object" in err(p)


def test_unparsable_file_names_file(tmp_path):
    p = tmp_path / "broken.json"
    p.write_text('{"train_batch_size": 8,, }')
    msg = err(p)
    assert "Could not parse" in msg and str(p) in msg


# ------------------------------------------------------------------ resolve_config_arg


def test_resolve_config_arg_rules():
    assert resolve_config_arg(None, {"a": 1}, None) == {"a": 1}
    assert resolve_config_arg(None, None, {"b": 1}) == {"b": 1}  # config_params alias
    args = SimpleNamespace(deepspeed_config="ds.json")
    assert resolve_config_arg(args, None, None) == "ds.json"
    assert resolve_config_arg(SimpleNamespace(deepscale_config="old.json"), None, None) == (
        "old.json"
    )
    assert resolve_config_arg(SimpleNamespace(deepspeed_config=None), "x.json", None) == "x.json"


def test_resolve_config_arg_both_given():
    args = SimpleNamespace(deepspeed_config="ds.json")
    for exc in (ValueError, AssertionError):  # DeepSpeed asserts; ours is both
        with pytest.raises(exc, match="two DeepSpeed configs given"):
            resolve_config_arg(args, {"train_batch_size": 8}, None)
    with pytest.raises(ValueError, match="deepspeed_config"):
        resolve_config_arg(args, None, {"train_batch_size": 8})


def test_resolve_config_arg_none_given():
    for args in (None, SimpleNamespace(), SimpleNamespace(deepspeed_config=None)):
        with pytest.raises(ValueError, match="no DeepSpeed config given") as info:
            resolve_config_arg(args, None, None)
        assert isinstance(info.value, AssertionError)
        assert "--deepspeed_config" in str(info.value) and "config=" in str(info.value)


# ------------------------------------------------------------------ defaults (DeepSpeed 0.19.8)


def test_defaults():
    c = load_config(cfg())
    assert c.gradient_clipping == 1.0  # changed from 0.0 in 0.19.3
    assert c.steps_per_print is None
    assert c.optimizer is None and c.scheduler is None
    assert not c.fp16.enabled and not c.bf16.enabled
    assert (c.fp16.loss_scale, c.fp16.initial_scale_power, c.fp16.loss_scale_window) == (
        0,
        16,
        1000,
    )
    assert (c.fp16.hysteresis, c.fp16.min_loss_scale, c.fp16.consecutive_hysteresis) == (
        2,
        1,
        False,
    )
    assert c.zero.stage == 0 and c.zero.offload_param is None and c.zero.offload_optimizer is None
    assert c.zero.offload_param_device == "none" and not c.zero.overlap_comm
    assert c.wandb.project == "deepspeed" and c.wandb.group is None
    assert c.tensorboard.job_name == "DeepSpeedJobName" and c.csv_monitor.output_path == ""
    assert c.checkpoint.tag_validation == "WARN"
    assert not c.dataloader_drop_last and not c.wall_clock_breakdown
    assert c.aio.block_size == 1048576 and c.aio.queue_depth == 8
    assert c.roundpipe.devices is None and c.roundpipe.schedule == "roundpipe"
    assert c.roundpipe.async_optimizer and c.roundpipe.head_chunk_tokens == 1024
    assert (c.roundpipe.profile_iterations, c.roundpipe.seed) == (2, 42)
    assert c.offload_summary() is None


def test_offload_defaults_and_1e9_ints():
    zero = {
        "stage": 3,
        "offload_param": {"device": "cpu", "buffer_size": 1e8, "max_in_cpu": 1e9},
        "offload_optimizer": {"device": "cpu"},
        "stage3_max_live_parameters": 1e9,
        "sub_group_size": 1e14,
    }
    z = load_config(cfg(zero_optimization=zero)).zero
    assert z.offload_param is not None and z.offload_optimizer is not None
    assert z.offload_param.buffer_count == 5 and z.offload_optimizer.buffer_count == 4
    assert z.offload_param.max_in_cpu == 1_000_000_000 and type(z.offload_param.max_in_cpu) is int
    assert z.stage3_max_live_parameters == 10**9 and type(z.stage3_max_live_parameters) is int
    assert z.sub_group_size == 10**14
    assert z.offload_param.pin_memory and z.offload_optimizer.ratio == 1.0
    assert z.overlap_comm  # DeepSpeed's default is True for stage 3 only


def test_defaults_match_deepspeed_models():
    """Our defaults and accepted keys against DeepSpeed's own pydantic models (if importable)."""
    os.environ.setdefault(
        "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache/rp_engine/torch_extensions")
    )
    pytest.importorskip("deepspeed")
    from deepspeed.monitor.config import CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    c = load_config(
        cfg(zero_optimization={"offload_param": {}, "offload_optimizer": {}}),
    )
    pairs = [
        (DeepSpeedFP16Config(), c.fp16),
        (DeepSpeedBF16Config(), c.bf16),
        (DeepSpeedZeroConfig(), c.zero),
        (DeepSpeedZeroOffloadParamConfig(), c.zero.offload_param),
        (DeepSpeedZeroOffloadOptimizerConfig(), c.zero.offload_optimizer),
        (WandbConfig(), c.wandb),
        (TensorBoardConfig(), c.tensorboard),
        (CSVConfig(), c.csv_monitor),
    ]
    for ds_model, ours in pairs:
        for f in dataclasses.fields(ours):
            ds_name = f.name
            if ds_name not in type(ds_model).model_fields:
                ds_name = ds_name.removeprefix("stage3_")
            if ds_name in ("offload_param", "offload_optimizer"):
                continue
            ds_value = getattr(ds_model, ds_name)
            ds_value = getattr(ds_value, "value", ds_value)  # enums
            assert getattr(ours, f.name) == ds_value, (type(ours).__name__, f.name)
        # every key DeepSpeed accepts in this section is accepted by us (no false rejections)
        section = {
            DeepSpeedFP16Config: "fp16",
            DeepSpeedBF16Config: "bf16",
            WandbConfig: "wandb",
            TensorBoardConfig: "tensorboard",
            CSVConfig: "csv_monitor",
        }.get(type(ds_model))
        if section is None:
            continue
        for name in type(ds_model).model_fields:
            load_config(cfg(**{section: {name: getattr(ds_model, name)}}))
    accepted = 0
    for name, info in DeepSpeedZeroConfig.model_fields.items():
        for key in {name, info.alias} - {None, "stage"}:
            value = getattr(DeepSpeedZeroConfig(), name)
            if key in ("offload_param", "offload_optimizer", "leaf_module", "zenflow") or (
                value is None
            ):
                continue
            load_config(cfg(zero_optimization={"stage": 2, key: value}))
            accepted += 1
    assert accepted > 30


# ------------------------------------------------------------------ optimizer


@pytest.mark.parametrize(
    ("given", "expected"),
    [("AdamW", "adamw"), ("Adam", "adam"), ("LAMB", "lamb"), ("Lion", "lion"), ("SGD", "SGD")],
)
def test_optimizer_type_normalised(given, expected):
    c = load_config(cfg(optimizer={"type": given, "params": {"lr": 0.1}}))
    assert c.optimizer is not None and c.optimizer.type == expected


def test_optimizer_keeps_adam_mode_params():
    params = {"lr": 1e-3, "adam_w_mode": False, "torch_adam": True, "betas": [0.9, 0.95]}
    c = load_config(cfg(optimizer={"type": "Adam", "params": params}))
    assert c.optimizer is not None and dict(c.optimizer.params) == params


def test_optimizer_unknown_type():
    msg = err(cfg(optimizer={"type": "FancyAdam", "params": {}}))
    assert "optimizer.type" in msg and "is not a supported DeepSpeed Optimizer" in msg
    assert "adamw" in msg and "SGD" in msg  # lists the valid ones


def test_optimizer_torch_names_are_case_sensitive():
    msg = err(cfg(optimizer={"type": "sgd"}))
    assert "optimizer.type" in msg and "did you mean 'SGD'?" in msg


def test_optimizer_max_grad_norm():
    msg = err(cfg(optimizer={"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}))
    assert "optimizer.params.max_grad_norm" in msg and "gradient_clipping" in msg


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"lr": "1e-3"}, "optimizer.params.lr"),
        ({"betas": 0.9}, "optimizer.params.betas"),
        ({"adam_w_mode": "false"}, "optimizer.params.adam_w_mode"),
    ],
)
def test_optimizer_bad_params(params, needle):
    assert needle in err(cfg(optimizer={"type": "AdamW", "params": params}))


def test_optimizer_torch_class_params_checked():
    with pytest.raises(TypeError, match=r"optimizer\.params\.momentun.*did you mean 'momentum'"):
        load_config(cfg(optimizer={"type": "SGD", "params": {"lr": 0.1, "momentun": 0.9}}))


def test_optimizer_missing_type():
    assert "optimizer.type is missing" in err(cfg(optimizer={"params": {"lr": 1}}))


# ------------------------------------------------------------------ scheduler


def test_scheduler_deepspeed_and_torch():
    c = load_config(cfg(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 1e3}}))
    assert c.scheduler is not None and c.scheduler.source == "deepspeed"
    assert c.scheduler.params["warmup_num_steps"] == 1000
    assert type(c.scheduler.params["warmup_num_steps"]) is int
    c = load_config(cfg(scheduler={"type": "StepLR", "params": {"step_size": 10}}))
    assert c.scheduler is not None and (c.scheduler.type, c.scheduler.source) == ("StepLR", "torch")


def test_scheduler_unknown_type_suggests():
    msg = err(cfg(scheduler={"type": "WarmupLr", "params": {}}))
    assert "scheduler.type" in msg and "did you mean 'WarmupLR'?" in msg


def test_scheduler_warmup_decay_needs_total_num_steps():
    msg = err(cfg(scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}))
    assert "scheduler.params.total_num_steps" in msg


@pytest.mark.parametrize(
    ("sched", "needle"),
    [
        ({"type": "WarmupLR", "params": {"warmup_steps": 10}}, "did you mean 'warmup_num_steps'"),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, "warmup_num_steps"),
        ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, "warmup_type"),
        ({"type": "StepLR", "params": {}}, "scheduler.params.step_size"),
        ({"type": "StepLR", "params": {"step_size": 1, "gama": 0.5}}, "did you mean 'gamma'"),
    ],
)
def test_scheduler_bad_params(sched, needle):
    assert needle in err(cfg(scheduler=sched))


# ------------------------------------------------------------------ strict sections: unknown keys


@pytest.mark.parametrize(
    ("extra", "path", "suggestion"),
    [
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"devcie": "cpu"}}},
            "zero_optimization.offload_param.devcie",
            "device",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"pin_memroy": True}}},
            "zero_optimization.offload_optimizer.pin_memroy",
            "pin_memory",
        ),
        ({"zero_optimization": {"stgae": 2}}, "zero_optimization.stgae", "stage"),
        ({"fp16": {"enable": True}}, "fp16.enable", "enabled"),
        ({"bf16": {"enabeld": True}}, "bf16.enabeld", "enabled"),
        ({"bfloat16": {"enabeld": True}}, "bfloat16.enabeld", "enabled"),
        ({"wandb": {"projcet": "x"}}, "wandb.projcet", "project"),
        ({"tensorboard": {"output": "x"}}, "tensorboard.output", "output_path"),
        ({"csv_monitor": {"job": "x"}}, "csv_monitor.job", "job_name"),
        ({"comms_logger": {"verbos": True}}, "comms_logger.verbos", "verbose"),
        ({"roundpipe": {"device": "cpu:2"}}, "roundpipe.device", "devices"),
    ],
)
def test_unknown_key_in_strict_section(extra, path, suggestion):
    msg = err(cfg(**extra))
    assert path in msg
    assert repr(path.rsplit(".", 1)[1]) in msg  # the bad key itself
    assert f"did you mean {suggestion!r}?" in msg


def test_unknown_keys_ignored_in_lenient_sections(caplog):
    extra = {
        "activation_checkpointing": {"partition_activations": True, "whatever": 1},
        "flops_profiler": {"enabled": False, "foo": 1},
        "aio": {"block_size": 262144, "thread_count": 1},
        "pipeline": {"stages": "auto", "bar": 2},
        "checkpoint": {"tag_validation": "fail", "other": 1},
        "prescale_gradients": False,
    }
    with caplog.at_level(logging.WARNING, logger="rp_engine.config"):
        c = load_config(cfg(**extra))
    assert c.activation_checkpointing.partition_activations
    assert c.aio.block_size == 262144 and c.checkpoint.tag_validation == "FAIL"
    assert not caplog.records


def test_unknown_top_level_key_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="rp_engine.config"):
        c = load_config(cfg(gradient_cliping=0.5, my_extra={"x": "auto"}))
    assert c.gradient_clipping == 1.0
    text = " ".join(r.getMessage() for r in caplog.records)
    assert all(r.name == "rp_engine.config" for r in caplog.records)
    assert "gradient_cliping" in text and "did you mean 'gradient_clipping'?" in text
    assert "my_extra" in text


def test_removed_deepspeed_feature_rejected():
    assert "amp" in err(cfg(amp={"enabled": True}))
    assert "zero_optimization.mics_shard_size" in err(cfg(zero_optimization={"mics_shard_size": 2}))


# ------------------------------------------------------------------ strict sections: types, enums


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        ({"zero_optimization": {"stage": "three"}}, ["zero_optimization.stage", '"three"', "0, 1"]),
        ({"zero_optimization": {"stage": 4}}, ["zero_optimization.stage", "4", "0, 1, 2, 3"]),
        ({"fp16": {"enabled": "yes"}}, ["fp16.enabled", '"yes"', "true or false"]),
        ({"bf16": {"enabled": "true"}}, ["bf16.enabled", "without quotes"]),
        (
            {"zero_optimization": {"offload_param": {"device": "gpu"}}},
            ["zero_optimization.offload_param.device", '"gpu"', '"none", "cpu", "nvme"'],
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "CPU"}}},
            ["offload_optimizer.device", "did you mean 'cpu'?"],
        ),
        (
            {"zero_optimization": {"reduce_bucket_size": 1.5e3 + 0.5}},
            ["zero_optimization.reduce_bucket_size", "integer"],
        ),
        ({"zero_optimization": {"reduce_bucket_size": 0}}, ["reduce_bucket_size", "> 0"]),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 1.5}}},
            ["offload_optimizer.ratio", "<= 1"],
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"ratio": 0.5}}},
            ["offload_optimizer.ratio", "stage 3"],
        ),
        ({"zero_optimization": {"offload_param": "cpu"}}, ["zero_optimization.offload_param"]),
        ({"zero_optimization": 3}, ["zero_optimization", "object"]),
        ({"fp16": {"loss_scale": -1}}, ["fp16.loss_scale", ">= 0"]),
        ({"fp16": {"enabled": True, "loss_scale_window": 0}}, ["fp16.loss_scale_window"]),
        ({"wandb": {"enabled": True, "project": 3}}, ["wandb.project", "string"]),
        ({"gradient_clipping": "1.0"}, ["gradient_clipping", "without quotes"]),
        ({"gradient_clipping": -1}, ["gradient_clipping", ">= 0"]),
        ({"steps_per_print": 0}, ["steps_per_print", "> 0"]),
        ({"checkpoint": {"tag_validation": "loud"}}, ["checkpoint.tag_validation", "Fail"]),
        ({"communication_data_type": "int8"}, ["communication_data_type", "fp16"]),
        ({"aio": {"block_size": "big"}}, ["aio.block_size"]),
        ({"activation_checkpointing": {"profile": 1}}, ["activation_checkpointing.profile"]),
    ],
)
def test_wrong_types_and_enums(extra, needles):
    msg = err(cfg(**extra))
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_fp16_and_bf16_both_enabled():
    msg = err(cfg(fp16={"enabled": True}, bf16={"enabled": True}))
    assert "fp16.enabled" in msg and "bf16.enabled" in msg
    msg = err(cfg(fp16={"enabled": True}, bfloat16={"enabled": True}))
    assert "fp16.enabled" in msg and "bfloat16.enabled" in msg


def test_bfloat16_alias():
    assert load_config(cfg(bfloat16={"enabled": True})).bf16.enabled
    assert "keep only bf16" in err(cfg(bfloat16={"enabled": True}, bf16={"enabled": True}))


def test_zero_optimization_bool_means_stage_1():
    assert load_config(cfg(zero_optimization=True)).zero.stage == 1
    assert load_config(cfg(zero_optimization=False)).zero.stage == 0


def test_zero_aliases():
    old = {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}
    assert load_config(cfg(zero_optimization=old)).zero.stage3_gather_16bit_weights_on_model_save
    both = {**old, "stage3_gather_16bit_weights_on_model_save": False}
    msg = err(cfg(zero_optimization=both))
    assert "stage3_gather_fp16_weights_on_model_save" in msg and "keep only one" in msg
    z = load_config(cfg(zero_optimization={"prefetch_bucket_size": 123})).zero
    assert z.stage3_prefetch_bucket_size == 123


def test_zero_deprecated_cpu_offload():
    z = load_config(cfg(zero_optimization={"stage": 2, "cpu_offload": True})).zero
    assert z.offload_optimizer_device == "cpu" and z.offload_param_device == "none"
    both = {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}
    assert "keep only offload_optimizer" in err(cfg(zero_optimization=both))


def test_aio_nested_in_zero_is_rejected_clearly():
    zero = {"stage": 3, "aio": {"block_size": 262144}}
    msg = err(cfg(zero_optimization=zero))
    assert "zero_optimization.aio" in msg
    assert "top level" in msg and "DeepSpeed rejects it" in msg


# ------------------------------------------------------------------ "auto"


def test_auto_left_unfilled_names_every_key():
    config = cfg(
        gradient_clipping="auto",
        optimizer={"type": "AdamW", "params": {"lr": "auto", "betas": ["auto", 0.999]}},
        zero_optimization={"stage": 3, "reduce_bucket_size": "auto"},
    )
    msg = err(config)
    for path in (
        "gradient_clipping",
        "optimizer.params.lr",
        "optimizer.params.betas[0]",
        "zero_optimization.reduce_bucket_size",
    ):
        assert path in msg
    assert "auto_values" in msg and "rp-train" in msg and "Hugging Face" in msg


def test_auto_values_fill_and_none_removes():
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "fp16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.1}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
    }
    values = {
        "train_micro_batch_size_per_gpu": 4,
        "train_batch_size": None,  # None: drop the key, let it be inferred
        "optimizer.params.lr": 1e-4,
        "optimizer.params.weight_decay": 0.0,  # not "auto" in the config: config wins
        "fp16.enabled": False,
        "zero_optimization.reduce_bucket_size": 65536,
        "scheduler.params.total_num_steps": 10,  # absent from the config: ignored
    }
    c = load_config(config, auto_values=values)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu) == (4, 4)
    assert c.optimizer is not None and c.optimizer.params == {"lr": 1e-4, "weight_decay": 0.1}
    assert c.zero.reduce_bucket_size == 65536 and not c.fp16.enabled
    assert c.scheduler is None and "train_batch_size" not in c.raw


def test_auto_in_ignored_places_is_fine():
    c = load_config(cfg(pipeline={"stages": "auto"}, hybrid_engine={"max_out_tokens": "auto"}))
    assert c.raw["pipeline"]["stages"] == "auto"


def test_auto_bfloat16_alias_filled():
    c = load_config(cfg(bfloat16={"enabled": "auto"}), auto_values={"bf16.enabled": True})
    assert c.bf16.enabled


def test_hf_auto_values_match_hugging_face():
    v = hf_auto_values(
        hidden_size=100,
        micro_batch_size=2,
        gradient_accumulation_steps=3,
        lr=5e-5,
        betas=(0.9, 0.98),
        warmup_steps=0,
        total_steps=500,
        bf16=True,
        world_size=4,
    )
    assert v["train_batch_size"] == 24
    assert v["zero_optimization.reduce_bucket_size"] == 10000
    assert v["zero_optimization.stage3_prefetch_bucket_size"] == 9000
    assert v["zero_optimization.stage3_param_persistence_threshold"] == 1000
    assert v["optimizer.params.betas"] == [0.9, 0.98]
    assert v["scheduler.params.warmup_num_steps"] == 1  # HF keeps it positive
    assert v["scheduler.params.warmup_max_lr"] == 5e-5 and v["scheduler.params.warmup_min_lr"] == 0
    assert v["scheduler.params.total_num_steps"] == 500
    assert v["bf16.enabled"] and not v["fp16.enabled"] and v["gradient_clipping"] == 1.0
    no_h = hf_auto_values(hidden_size=None, micro_batch_size=1, gradient_accumulation_steps=1, lr=1)
    assert not any(k.startswith("zero_optimization") for k in no_h)
    assert "scheduler.params.total_num_steps" not in no_h


# ------------------------------------------------------------------ offload summary


def test_offload_summary_cpu():
    zero = {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    s = load_config(cfg(zero_optimization=zero)).offload_summary()
    assert s is not None
    assert s.startswith("zero_optimization stage 3 with offload_param=cpu, offload_optimizer=cpu")
    assert "host memory" in s and "NVMe" not in s


def test_offload_summary_nvme_and_stage_only():
    zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}
    s = load_config(cfg(zero_optimization=zero)).offload_summary()
    assert s is not None and "offload_param=nvme" in s
    assert "/local_nvme" in s and "compute weights live on NVMe" in s and "max_in_cpu" in s
    assert "optimizer state stays in host memory" in s
    zero = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}
    s = load_config(cfg(zero_optimization=zero)).offload_summary()
    assert s is not None and "Adam moments live on NVMe (/local_nvme" in s
    s = load_config(cfg(zero_optimization={"stage": 2})).offload_summary()
    assert s is not None and s.startswith("zero_optimization stage 2:")


# ------------------------------------------------------------------ roundpipe section


@pytest.mark.parametrize("devices", ["cpu:1", "cpu:4", "cuda", "cuda:0", "cuda:0,1,3", None])
def test_roundpipe_devices_ok(devices):
    assert load_config(cfg(roundpipe={"devices": devices})).roundpipe.devices == devices


@pytest.mark.parametrize("devices", ["cpu", "cpu:0", "gpu", "cuda:", "cuda:0,0", "cuda:a", 2])
def test_roundpipe_devices_bad(devices):
    msg = err(cfg(roundpipe={"devices": devices}))
    assert "roundpipe.devices" in msg and "cpu:N" in msg


def test_roundpipe_fields():
    section = {
        "schedule": "mobius",
        "async_optimizer": False,
        "fwd_cuts": [2, 2],
        "bwd_cuts": [0, 4],
        "device_memory_gb": 1,
        "pcie_gbps": 16.0,
        "head_chunk_tokens": 256,
        "profile_iterations": 0,
        "seed": 7,
    }
    rp = load_config(cfg(roundpipe=section)).roundpipe
    assert rp.fwd_cuts == (2, 2) and rp.bwd_cuts == (0, 4) and rp.schedule == "mobius"
    assert rp.device_memory_gb == 1.0 and isinstance(rp.device_memory_gb, float)
    assert (rp.head_chunk_tokens, rp.profile_iterations, rp.seed) == (256, 0, 7)


@pytest.mark.parametrize(
    ("section", "needles"),
    [
        ({"schedule": "roundpip"}, ["roundpipe.schedule", "did you mean 'roundpipe'?"]),
        ({"fwd_cuts": [2, 0]}, ["roundpipe.fwd_cuts", "positive integers"]),
        ({"fwd_cuts": []}, ["roundpipe.fwd_cuts"]),
        ({"bwd_cuts": [1, 0]}, ["roundpipe.bwd_cuts"]),
        ({"fwd_cuts": [2, 2], "bwd_cuts": [1, 2]}, ["fwd_cuts (sum 4)", "bwd_cuts (sum 3)"]),
        ({"head_chunk_tokens": 0}, ["roundpipe.head_chunk_tokens", "> 0"]),
        ({"device_memory_gb": -1}, ["roundpipe.device_memory_gb"]),
        ({"host_memory_gb": 0}, ["roundpipe.host_memory_gb", "> 0"]),
        ({"host_memory_gb": "8G"}, ["roundpipe.host_memory_gb", "a number"]),
        ({"async_optimizer": "no"}, ["roundpipe.async_optimizer"]),
    ],
)
def test_roundpipe_bad(section, needles):
    msg = err(cfg(roundpipe=section))
    for needle in needles:
        assert needle in msg


# ------------------------------------------------------------------ raw / to_dict


def test_to_dict_round_trips_and_is_a_copy():
    c = load_config(DS_CONFIGS / "zero_infinity_cpu_bf16.json")
    d = c.to_dict()
    d["optimizer"]["params"]["lr"] = 123.0
    assert c.raw["optimizer"]["params"]["lr"] == 2e-5
    again = load_config(c.to_dict())
    assert again == c
    assert json.loads(json.dumps(c.to_dict())) == c.to_dict()


def test_config_is_frozen():
    c = load_config(cfg())
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.gradient_clipping = 0.5  # type: ignore[misc]
    assert isinstance(c, DSConfig)


# ------------------------------------------------------------------ shared fixtures


def test_fixture_zero_infinity_cpu():
    c = load_config(_fixture("zero_infinity_cpu.json"))
    assert (c.train_batch_size, c.gradient_accumulation_steps) == (8, 8)
    assert c.bf16.enabled and c.wandb.enabled and c.wandb.project == "rp-engine"
    assert c.zero.stage == 3 and c.zero.offload_param_device == "cpu"
    assert c.zero.offload_optimizer_device == "cpu"
    assert c.scheduler is not None and c.scheduler.type == "WarmupDecayLR"
    assert c.optimizer is not None and c.optimizer.type == "adamw"
    summary = c.offload_summary()
    assert summary is not None and "offload_param=cpu, offload_optimizer=cpu" in summary


def test_fixture_hf_auto_needs_values():
    path = _fixture("hf_zero3_offload_auto.json")
    msg = err(path)
    for key in (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "optimizer.params.lr",
        "optimizer.params.betas",
        "scheduler.params.warmup_num_steps",
        "fp16.enabled",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
    ):
        assert key in msg
    c = load_config(path, auto_values=HF_AUTO)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu) == (8, 2)
    assert c.zero.reduce_bucket_size == 64 * 64
    assert c.zero.stage3_prefetch_bucket_size == int(0.9 * 64 * 64)
    assert c.zero.stage3_param_persistence_threshold == 640
    assert c.zero.stage3_gather_16bit_weights_on_model_save  # the old fp16 name
    assert c.optimizer is not None and c.optimizer.params["betas"] == [0.9, 0.999]
    assert c.steps_per_print == 2000


def test_aio_thread_count_is_the_old_name_of_intra_op_parallelism():
    assert load_config(cfg(aio={"thread_count": 3})).aio.intra_op_parallelism == 3
    assert load_config(cfg(aio={"intra_op_parallelism": 2})).aio.intra_op_parallelism == 2


def test_nvme_io_engine_choices():
    assert load_config(cfg()).roundpipe.nvme_io_engine == "auto"
    # "auto" written out is the choice itself, not a placeholder left for the HF Trainer
    assert load_config(cfg(roundpipe={"nvme_io_engine": "auto"})).roundpipe.nvme_io_engine == "auto"
    assert (
        load_config(cfg(roundpipe={"nvme_io_engine": "threads"})).roundpipe.nvme_io_engine
        == "threads"
    )
    assert "roundpipe.nvme_io_engine" in err(cfg(roundpipe={"nvme_io_engine": "dma"}))


def test_fixture_bad_aio():
    msg = err(_fixture("zero_infinity_nvme_bad_aio.json"))
    assert "zero_optimization.aio" in msg and "top level" in msg


def test_fixture_bad_aio_fixed_is_accepted():
    raw = json.loads(_fixture("zero_infinity_nvme_bad_aio.json").read_text())
    raw["aio"] = raw["zero_optimization"].pop("aio")
    c = load_config(raw)
    assert c.fp16.enabled and c.zero.offload_param_device == "nvme"
    assert c.aio.block_size == 262144 and c.aio.queue_depth == 32
    summary = c.offload_summary()
    assert summary is not None and "moments live on NVMe" in summary


# ------------------------------------------------------------------ repo ds_configs/


@pytest.mark.parametrize("path", sorted(DS_CONFIGS.glob("*.json")), ids=lambda p: p.name)
def test_repo_ds_configs_load(path):
    json.loads(path.read_text())  # plain JSON, usable by any tool
    c = load_config(path, auto_values=HF_AUTO)
    assert c.train_micro_batch_size_per_gpu > 0


def test_repo_ds_configs_present():
    names = {p.name for p in DS_CONFIGS.glob("*.json")}
    assert {"tiny_cpu_fp32.json", "roundpipe_cpu4.json", "zero_infinity_cpu_bf16.json"} <= names


def test_tiny_cpu_fp32():
    c = load_config(DS_CONFIGS / "tiny_cpu_fp32.json")
    assert (c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (2, 4)
    assert c.optimizer is not None and c.optimizer.type == "adamw"
    assert c.optimizer.params["lr"] == 1e-3
    assert c.scheduler is not None and c.scheduler.type == "WarmupLR"
    assert c.gradient_clipping == 1.0 and c.roundpipe.devices == "cpu:2"
    assert not c.fp16.enabled and not c.bf16.enabled and c.offload_summary() is None
    assert load_config(DS_CONFIGS / "tiny_cpu_fp32.json", world_size=2).train_batch_size == 16


def test_loaded_config_passes_through():
    c = load_config(cfg(gradient_accumulation_steps=4))
    assert load_config(c) is c
    assert load_config(c, world_size=2).train_batch_size == 16


def test_stage_message_says_integer():
    msg = err(cfg(zero_optimization={"stage": "3"}))
    assert "an integer" in msg and "without quotes" in msg
