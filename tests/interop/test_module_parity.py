"""Plain nn.Module models against real DeepSpeed (issue 29): the shapes DeepSpeed's own tests use
(module_models.MODELS: Linear stacks of 1 and 4 layers, one with a layer that gets no gradient, a
model returning two losses, a small CNN with an external criterion, a weight tied across
non-adjacent modules).

For each model: the per-step losses, the per-step global gradient norms and the final weights
(elementwise) equal DeepSpeed ZeRO-3 with CPU offload (the same config file, loop and data;
ds_module_reference.py runs DeepSpeed in a subprocess) in sync mode, also clipped below the norm
and with SGD (Adam divides a constant factor of the gradient out: the norms, the clip
coefficient and SGD's steps do not); async equals the staleness-1 reference run with DeepSpeed's
CPU Adam (losses, norms and weights); a checkpoint round trip continues the run exactly, a
forward without backward changes nothing, and the layering strategy is (b) "traced" where the
model has a repeated block and (c) "whole_module" otherwise.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from ds_module_reference import reference_config, train_module
from engine_helpers import assert_close_named, assert_same_weights, reference_losses
from grad_scale import StepNorms
from module_models import MODELS, make_batches
from subprocess_helpers import run_json

import rp_engine

GAS, MICRO, MBS, LR = 2, 8, 8, 1e-2
STRATEGY = {
    "linear_1": "whole_module",
    "linear_4": "traced",
    "linear_4_unused": "traced",
    "two_losses": "traced",
    "small_cnn": "whole_module",
    "tied": "traced",
}
REL = 1e-4
# Elementwise against DeepSpeed's gathered weights: the same CPU Adam kernel on gradients equal
# to rounding. Measured within 2.4e-7 after four steps at lr 1e-2 (torch's AVX-512 kernels; it
# holds with the AVX2 ones too, tests/support/avx2_cpu_adam.py); a transposed or permuted update
# is off by about lr.
WEIGHT_RTOL, WEIGHT_ATOL = 1e-5, 1e-5
NORM_RTOL = 1e-5  # fp32 gradients summed in another order: ~1e-7 of the norm
# The gradient-scale variants: (model, what changes in DeepSpeed's config). CLIP is below every
# step's norm of the tied model (1.8-2.4 over these steps); SGD with momentum steps by the
# gradient's own size. DeepSpeed runs a torch optimizer under ZeRO-Offload only when told to.
CLIP, SGD = 0.3, {"lr": 0.05, "momentum": 0.9}
# reference_config sets no "gradient_clipping": DeepSpeed's default (1.0 since 0.19.3) clips the
# models whose norms exceed it (linear_1, small_cnn, tied), and so does rp_engine's
DEFAULT_CLIP = 1.0
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "tied/clipped": ("tied", {"gradient_clipping": CLIP}),
    "small_cnn/sgd": ("small_cnn", {
        "optimizer": {"type": "SGD", "params": SGD},
        "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
    }),
}  # fmt: skip


def ds_config(variant: str | None = None, *, lr: float = LR) -> dict[str, Any]:
    """The DeepSpeed config of a run: reference_config's, changed as ``variant`` says."""
    cfg = reference_config(gas=GAS, mbs=MBS, lr=lr)
    cfg.update(copy.deepcopy(VARIANTS[variant][1]) if variant else {})
    return cfg


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every model's DeepSpeed run and each variant's, in one subprocess (one DeepSpeed
    import), keyed by model name or variant; each saves its gathered weights."""
    folder = tmp_path_factory.mktemp("ds_module_weights")
    spec = {"micro_batches": MICRO, "gas": GAS, "mbs": MBS, "lr": LR}
    runs: list[dict[str, Any]] = [{**spec, "model": name, "label": name} for name in MODELS]
    runs += [
        {**spec, "model": model, "label": label, "config": ds_config(label)}
        for label, (model, _) in VARIANTS.items()
    ]
    for run in runs:
        run["weights_path"] = str(folder / f"{run['label'].replace('/', '-')}.pt")
    results = run_json("ds_module_reference.py", {"runs": runs})
    return {r["label"]: r for r in results}


def rp_config(
    *, async_optimizer: bool = False, lr: float = LR, variant: str | None = None
) -> dict[str, Any]:
    """DeepSpeed's config as is, plus where rp_engine runs it (two CPU virtual devices)."""
    cfg = ds_config(variant, lr=lr)
    cfg["roundpipe"] = {"devices": "cpu:2", "async_optimizer": async_optimizer}
    return cfg


def rp_train(
    name: str, *, async_optimizer: bool = False, lr: float = LR, variant: str | None = None,
    **kw: Any,
) -> tuple[Any, dict]:  # fmt: skip
    model = MODELS[name].build(0)
    engine, _, _, _ = rp_engine.initialize(
        model=model, model_parameters=model.parameters(),
        config=rp_config(async_optimizer=async_optimizer, lr=lr, variant=variant),
    )  # fmt: skip
    try:
        out = train_module(engine, name, make_batches(name, MICRO, batch_size=MBS), **kw)
        engine.synchronize()
        return engine, out
    finally:
        engine.destroy()


def assert_rel(got: list[float], want: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=REL, atol=1e-6)


def assert_norms(got: list[float], want: list[float]) -> None:
    """Each optimizer step's ``get_global_grad_norm()`` is the reference's."""
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
        rtol=NORM_RTOL, atol=0.0,
    )  # fmt: skip


def assert_deepspeeds_weights(engine: Any, run: dict[str, Any]) -> None:
    """The engine's final weights equal DeepSpeed's gathered ones element by element (both
    step with DeepSpeed's CPU Adam kernel on gradients equal to rounding; DeepSpeed lists a
    tied weight once)."""
    want = torch.load(run["weights_path"], weights_only=True)
    got = dict(engine.module.named_parameters())
    assert want and set(want) <= set(got), (sorted(want), sorted(got))
    for n, w in want.items():
        assert_close_named(
            got[n].detach(), w, f"parameter {n!r}", rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL
        )


@pytest.mark.parametrize("name", list(MODELS))
def test_sync_losses_equal_deepspeed(name: str, deepspeed_runs: dict[str, Any]) -> None:
    engine, out = rp_train(name)
    assert engine.layering.strategy == STRATEGY[name], engine.layering
    ds = deepspeed_runs[name]
    assert_rel(out["losses"], ds["losses"])
    assert out["global_steps"] == ds["global_steps"]
    assert len(ds["grad_norms"]) == MICRO // GAS
    assert_norms(out["grad_norms"], ds["grad_norms"])
    assert_deepspeeds_weights(engine, ds)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gradient_scale_equals_deepspeed(variant: str, deepspeed_runs: dict[str, Any]) -> None:
    """Clipped below the norm (the clip coefficient) and SGD (steps the gradient's own size):
    DeepSpeed's losses, norms and weights."""
    name = VARIANTS[variant][0]
    engine, out = rp_train(name, variant=variant)
    ds = deepspeed_runs[variant]
    if variant.endswith("clipped"):
        assert min(ds["grad_norms"]) > CLIP, ds["grad_norms"]
    assert_rel(out["losses"], ds["losses"])
    assert_norms(out["grad_norms"], ds["grad_norms"])
    assert_deepspeeds_weights(engine, ds)


def deepspeed_cpu_adam(lr: float) -> Any:
    """A ``make_optimizer`` building DeepSpeed's CPU Adam as DeepSpeed does for the reference
    config's "Adam" with an offloaded optimizer (AdamW mode, no weight decay)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return lambda params: DeepSpeedCPUAdam(params, lr=lr, adamw_mode=True)


@pytest.mark.parametrize("name", list(MODELS))
def test_async_equals_the_staleness_one_reference(name: str) -> None:
    """Each step's gradients at the weights of two steps before (staleness 1), against plain
    PyTorch run so with DeepSpeed's CPU Adam (the engine's kernel) and DeepSpeed's default
    clipping: the losses, each step's gradient norm and the final weights (each element within
    what gradient rounding can move Adam's steps by, engine_helpers.AdamSlack), and clearly not
    the synchronous run's losses."""
    engine, out = rp_train(name, async_optimizer=True)
    case = MODELS[name]
    want, norms, refs = {}, {}, {}
    for s in (0, 1):
        norms[s] = StepNorms(deepspeed_cpu_adam(LR), clip=DEFAULT_CLIP)
        refs[s] = case.build(0)
        want[s] = reference_losses(
            refs[s], make_batches(name, MICRO, batch_size=MBS), steps=MICRO // GAS, gas=GAS,
            staleness=s, loss_of=lambda m, b: case.loss(m(*case.inputs(b)), b),
            make_optimizer=norms[s],
        )  # fmt: skip
    got = [sum(out["losses"][i : i + GAS]) / GAS for i in range(0, MICRO, GAS)]
    assert_rel(got, want[1])
    assert_norms(out["grad_norms"], norms[1].norms)
    assert_same_weights(engine.module, refs[1])
    sync_gap = max(abs(g / w - 1) for g, w in zip(got[2:], want[0][2:], strict=True))
    assert sync_gap > 5 * REL, f"async losses are the sync run's (gap {sync_gap:.1e})"


@pytest.mark.parametrize("name", ["linear_4", "small_cnn", "tied"])
def test_forward_without_backward_gives_deepspeeds_losses(
    name: str, deepspeed_runs: dict[str, Any]
) -> None:
    _, out = rp_train(name, forward_without_backward_at=3)
    assert_rel(out["losses"], deepspeed_runs[name]["losses"])
    assert_norms(out["grad_norms"], deepspeed_runs[name]["grad_norms"])
    assert out["discarded_loss"] == pytest.approx(out["losses"][3], rel=1e-6)


@pytest.mark.parametrize("name", list(MODELS))
def test_checkpoint_round_trip_continues_the_run(
    name: str, deepspeed_runs: dict[str, Any], tmp_path: Path
) -> None:
    """Train half, save, load into a fresh engine over a differently initialised model, train
    the rest: DeepSpeed's uninterrupted losses."""
    batches = make_batches(name, MICRO, batch_size=MBS)
    half = MICRO // 2
    model = MODELS[name].build(0)
    engine, _, _, _ = rp_engine.initialize(model=model, config=rp_config())
    try:
        first = train_module(engine, name, batches[:half])
        engine.save_checkpoint(str(tmp_path))
    finally:
        engine.destroy()
    fresh = MODELS[name].build(7)
    engine, _, _, _ = rp_engine.initialize(model=fresh, config=rp_config())
    try:
        engine.load_checkpoint(str(tmp_path))
        assert engine.global_steps == half // GAS
        second = train_module(engine, name, batches[half:])
    finally:
        engine.destroy()
    assert_rel(first["losses"] + second["losses"], deepspeed_runs[name]["losses"])
    assert_norms(first["grad_norms"] + second["grad_norms"], deepspeed_runs[name]["grad_norms"])


def test_the_reference_models_are_what_the_strategies_say() -> None:
    """(b) exactly where there is a repeated block: guards STRATEGY against a model edit."""
    from rp_engine.model.module import repeated_container

    for name, strategy in STRATEGY.items():
        model = copy.deepcopy(MODELS[name].build(0))
        assert (repeated_container(model) is not None) == (strategy == "traced"), name
