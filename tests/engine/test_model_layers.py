"""to_layers: prefix -> blocks -> head.forward_backward reproduces the model's own loss and
gradients, for every supported model shape."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import models  # tests/support is on pytest's pythonpath (pyproject.toml)
import pytest
import torch
from torch import nn

from rp_engine.model import LayerSequence, batch_to_dict, to_layers

F = nn.functional
TIGHT = {"rtol": 1e-5, "atol": 1e-6}
# peft 0.21 calls a transformers API that 5.24 deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

HF_FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "qwen3": models.tiny_qwen3,
    "llama": models.tiny_llama,
    "mistral": models.tiny_mistral,
    "qwen2_mixed_sliding": lambda: models.tiny_qwen2(sliding_window=4),
    "qwen3_moe": models.tiny_qwen3_moe,
    "gemma2": models.tiny_gemma2,
    "granite": models.tiny_granite,
    "lora_qwen3": models.lora_qwen3,
    "qwen3_tied": lambda: models.tiny_qwen3(tie=True, layers=2),
    **{name: (lambda n=name: models.tiny(n)) for name in models.LLAMA_STYLE},
}


# ---------------------------------------------------------------------------------------------
# helpers


def run_stages(seq: LayerSequence, batch: Any, *, grad_scale: float = 1.0) -> torch.Tensor:
    """Run the sequence as a pipeline would: every block is its own stage (input detached), the
    head runs forward_backward, then grad_hidden is backpropagated stage by stage."""
    state = batch_to_dict(batch)
    if seq.prefix is not None:
        state = seq.prefix(state)
    outputs, inputs = [state["hidden"]], []
    for block in seq.blocks:
        passengers = [k for k, v in state.items() if k != "hidden" and _needs_grad(v)]
        assert not passengers, f"{passengers} carry gradient across a stage boundary"
        x = state["hidden"].detach().requires_grad_(state["hidden"].is_floating_point())
        inputs.append(x)
        state = block({**state, "hidden": x})
        outputs.append(state["hidden"])
    head_in = {**state, "hidden": state["hidden"].detach()}
    loss, grad = seq.head.forward_backward(head_in, grad_scale=grad_scale)
    if isinstance(grad, dict):  # a head may return the gradient of each "hidden*" key
        grad = grad.get("hidden", torch.zeros_like(head_in["hidden"], dtype=torch.float32))
    assert not loss.requires_grad and grad.shape == head_in["hidden"].shape
    for out, x in zip(reversed(outputs[1:]), reversed(inputs), strict=True):
        if out.requires_grad:
            torch.autograd.backward(out, grad)
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
    if outputs[0].requires_grad:
        torch.autograd.backward(outputs[0], grad)
    return loss


def _needs_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def take_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def assert_grads_close(got: dict[str, Any], want: dict[str, Any], **tol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        if want[name] is None:
            assert got[name] is None, f"{name} got a gradient, the reference has none"
        else:
            assert got[name] is not None, f"{name} got no gradient"
            torch.testing.assert_close(
                got[name], want[name], msg=lambda m, n=name: f"{n}: {m}", **tol
            )


def hf_reference(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), take_grads(model)


# ---------------------------------------------------------------------------------------------
# Hugging Face causal LMs


@pytest.mark.parametrize("chunk", [5, 1024], ids=["chunked", "one_chunk"])
@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_hf_stages_match_model_loss_and_grads(family: str, chunk: int) -> None:
    model = HF_FAMILIES[family]()
    batch = models.random_batch(model.config.vocab_size, padded=True)
    want_loss, want = hf_reference(model, batch)

    seq = to_layers(model, head_chunk_tokens=chunk)
    assert seq.num_blocks == model.config.num_hidden_layers
    loss = run_stages(seq, batch)
    torch.testing.assert_close(loss, want_loss, **TIGHT)
    assert_grads_close(take_grads(model), want, **TIGHT)

    with torch.no_grad():  # the plain path agrees too
        torch.testing.assert_close(seq.run_reference(batch), want_loss, **TIGHT)


def test_hf_without_attention_mask_and_with_position_ids() -> None:
    model = models.tiny_llama(layers=2)
    batch = models.random_batch(128, seq=12)
    batch["position_ids"] = torch.arange(3, 15).unsqueeze(0)
    want_loss, want = hf_reference(model, batch)
    loss = run_stages(to_layers(model, head_chunk_tokens=7), batch)
    torch.testing.assert_close(loss, want_loss, **TIGHT)
    assert_grads_close(take_grads(model), want, **TIGHT)


@pytest.mark.parametrize("packed", [False, True], ids=["own_positions", "packed_positions"])
def test_hf_prefix_masks_read_no_device_value_unless_positions_are_given(
    packed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without position ids in the batch, the prefix makes its own arange for the rotary
    embedding but gives the mask functions None: transformers' packed-sequence check
    (find_packed_sequence_indices, whose ``if (...).all()`` syncs a GPU with the host) then never
    runs. Its two masks (full and sliding) are what HF makes with its own arange, and the loss and
    gradients match HF's. Position ids in the batch (two packed sequences) still reach the check,
    and the packed mask is HF's too."""
    import transformers.masking_utils as masking

    calls: list[torch.Tensor] = []
    real = masking.find_packed_sequence_indices

    def counting(position_ids: torch.Tensor) -> torch.Tensor | None:
        calls.append(position_ids)
        return real(position_ids)

    monkeypatch.setattr(masking, "find_packed_sequence_indices", counting)
    model = models.tiny_qwen2(sliding_window=4)
    batch: dict[str, Any] = models.random_batch(128)  # no attention_mask: the check's case
    if packed:
        batch["position_ids"] = torch.cat([torch.arange(10), torch.arange(6)]).unsqueeze(0)
    seq = to_layers(model, head_chunk_tokens=7)
    state = seq.prefix(batch)
    assert len(calls) == (2 if packed else 0)  # once per mask kind, only for given ids

    positions = batch.get("position_ids", torch.arange(16).unsqueeze(0))
    hf = {"config": model.config, "inputs_embeds": state["hidden"], "attention_mask": None}
    hf.update(cache=None, position_ids=positions)
    torch.testing.assert_close(state["mask_full"], masking.create_causal_mask(**hf), rtol=0, atol=0)
    torch.testing.assert_close(
        state["mask_sliding"], masking.create_sliding_window_causal_mask(**hf), rtol=0, atol=0
    )
    want_loss, want = hf_reference(model, batch)
    torch.testing.assert_close(run_stages(seq, batch), want_loss, **TIGHT)
    assert_grads_close(take_grads(model), want, **TIGHT)


def test_hf_inputs_embeds_and_num_items_in_batch() -> None:
    model = models.tiny_qwen3(layers=2)
    batch: dict[str, Any] = models.random_batch(128, padded=True)
    batch["num_items_in_batch"] = torch.tensor(50)  # HF's gradient-accumulation denominator
    want_loss, want = hf_reference(model, batch)
    torch.testing.assert_close(run_stages(to_layers(model), batch), want_loss, **TIGHT)
    assert_grads_close(take_grads(model), want, **TIGHT)

    embeds = model.model.embed_tokens(batch["input_ids"]).detach()
    by_embeds = {"inputs_embeds": embeds, "labels": batch["labels"]}
    with torch.no_grad():
        want_loss = model(**by_embeds).loss
        torch.testing.assert_close(to_layers(model).run_reference(by_embeds), want_loss, **TIGHT)


def test_hf_sdpa_mask_none_is_omitted_and_pair_batches_work() -> None:
    model = models.tiny_qwen3(layers=2)
    model.set_attn_implementation("sdpa")
    batch = models.random_batch(128)  # no padding: sdpa lets is_causal do the masking
    seq = to_layers(model, head_chunk_tokens=10)
    assert not any(k.startswith("mask") for k in seq.prefix(batch))
    want_loss, want = hf_reference(model, batch)
    pair = (batch["input_ids"], batch["labels"])  # the DeepSpeed (inputs, labels) convention
    torch.testing.assert_close(run_stages(seq, pair), want_loss, **TIGHT)
    assert_grads_close(take_grads(model), want, **TIGHT)


def test_hf_bf16() -> None:
    model = models.tiny_qwen3(layers=2).to(torch.bfloat16)
    batch = models.random_batch(128, padded=True)
    want_loss, want = hf_reference(model, batch)
    loss = run_stages(to_layers(model, head_chunk_tokens=6), batch)
    assert loss.dtype == torch.float32  # logits are upcast before the loss, as in HF
    torch.testing.assert_close(loss, want_loss, rtol=1e-3, atol=1e-3)
    assert_grads_close(take_grads(model), want, rtol=2e-2, atol=2e-3)


def test_grad_scale_scales_grads_not_loss() -> None:
    model = models.tiny_qwen3(layers=2)
    batch = models.random_batch(128, padded=True)
    seq = to_layers(model, head_chunk_tokens=8)
    loss1 = run_stages(seq, batch)
    grads1 = take_grads(model)
    loss4 = run_stages(seq, batch, grad_scale=4.0)
    grads4 = take_grads(model)
    torch.testing.assert_close(loss4, loss1)
    assert_grads_close(grads4, {n: 4.0 * g for n, g in grads1.items()}, **TIGHT)


def test_head_grads_accumulate_and_hidden_input_untouched() -> None:
    model = models.tiny_qwen3(layers=1)
    batch = models.random_batch(128)
    seq = to_layers(model, head_chunk_tokens=3)
    with torch.no_grad():
        state = seq.blocks[0](seq.prefix(batch))
    hidden = state["hidden"]
    _, grad1 = seq.head.forward_backward(state)
    first = model.lm_head.weight.grad.clone()
    _, grad2 = seq.head.forward_backward(state)
    torch.testing.assert_close(model.lm_head.weight.grad, 2 * first)  # accumulated, not reset
    torch.testing.assert_close(grad1, grad2)
    assert hidden.grad is None and not hidden.requires_grad
    assert model.model.layers[0].mlp.up_proj.weight.grad is None  # the head touched only itself


def test_lora_frozen_base_gets_no_grad() -> None:
    model = models.lora_qwen3(layers=2)
    run_stages(to_layers(model, head_chunk_tokens=4), models.random_batch(128, padded=True))
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert not p.requires_grad and p.grad is None, name


def test_tied_embedding_is_shared_by_prefix_and_head() -> None:
    model = models.tiny_qwen3(tie=True, layers=2)
    seq = to_layers(model)
    weight = model.model.embed_tokens.weight
    assert model.lm_head.weight is weight
    by_layer = seq.named_parameters_by_layer()
    assert [n for n, p in by_layer[0] if p is weight] == ["model.embed_tokens.weight"]
    assert [n for n, p in by_layer[-1] if p is weight] == ["model.embed_tokens.weight"]


def test_parameter_and_buffer_names_follow_the_model() -> None:
    model = models.lora_qwen3(layers=2)
    seq = to_layers(model)
    by_layer = seq.named_parameters_by_layer()
    assert len(by_layer) == seq.num_blocks + 2
    names = [n for layer in by_layer for n, _ in layer]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each exactly once
    params = dict(model.named_parameters())
    assert all(params[n] is p for layer in by_layer for n, p in layer)
    assert all(".layers.1." in n for n, _ in by_layer[2])
    assert {n for n, _ in by_layer[-1]} == {
        "base_model.model.model.norm.weight",
        "base_model.model.lm_head.weight",
    }
    buffers = seq.buffers_by_layer()
    assert "base_model.model.model.rotary_emb.inv_freq" in [n for n, _ in buffers[0]]
    assert sum(len(b) for b in buffers) == len(list(model.named_buffers()))
    assert list(seq.modules()) == [seq.prefix, *seq.blocks, seq.head]


def test_mask_per_layer_type() -> None:
    batch = models.random_batch(128)
    mistral = to_layers(models.tiny_mistral(sliding_window=8))
    state = mistral.prefix(batch)
    assert "mask_full" not in state and {b.mask_key for b in mistral.blocks} == {"mask_sliding"}
    visible = state["mask_sliding"][0, 0] == 0  # eager masks are additive: 0 = attend
    assert visible[15].sum() == 8 and visible[3].sum() == 4  # window of 8, causal

    qwen2 = to_layers(models.tiny_qwen2(sliding_window=4))
    assert [b.mask_key for b in qwen2.blocks] == ["mask_full"] * 2 + ["mask_sliding"] * 2
    assert {"mask_full", "mask_sliding"} <= set(qwen2.prefix(batch))
    assert "mask_sliding" not in to_layers(models.tiny_qwen3()).prefix(batch)


def test_a_llama_shaped_family_nobody_listed_is_cut_through_its_own_forward(caplog) -> None:
    """OLMo (1), Llama-shaped but in no table: the generic path (hf_families.generic_family)
    with a warning and a first-batch check, the model's loss and gradients."""
    from transformers import AutoModelForCausalLM, OlmoConfig

    config = OlmoConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    batch = models.random_batch(128, padded=True)
    want_loss, want = hf_reference(model, batch)
    with caplog.at_level("WARNING", logger="rp_engine"):
        seq = to_layers(model, head_chunk_tokens=6)
    assert "'olmo' is not among the mapped ones" in caplog.text
    assert seq.first_batch_check is not None and seq.num_blocks == 2
    torch.testing.assert_close(run_stages(seq, batch), want_loss, **TIGHT)
    assert_grads_close(take_grads(model), want, **TIGHT)


def test_router_loss_refused() -> None:
    moe = models.tiny_qwen3_moe(layers=1)
    moe.config.output_router_logits = True
    with pytest.raises(NotImplementedError, match="output_router_logits = False"):
        to_layers(moe)


# ---------------------------------------------------------------------------------------------
# nn.Sequential, DeepSpeed LayerSpec lists and PipelineModule


@pytest.mark.parametrize("as_dict", [False, True])
def test_sequential_stages_match(as_dict: bool) -> None:
    model = models.tiny_mlp()
    x, y = models.mlp_batch()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    want = take_grads(model)

    seq = to_layers(model, loss_fn=F.cross_entropy)
    assert seq.num_blocks == 3 and seq.kind == "sequential"
    batch = {"input": x, "labels": y} if as_dict else (x, y)
    torch.testing.assert_close(run_stages(seq, batch), loss.detach(), **TIGHT)
    assert_grads_close(take_grads(model), want, **TIGHT)
    torch.testing.assert_close(seq.run_reference(batch), loss, **TIGHT)


def test_modules_without_loss_fn_are_module_models_and_odd_inputs_are_refused() -> None:
    # an nn.Sequential without loss_fn, or any other module, returns its outputs to the caller
    assert to_layers(models.tiny_mlp()).kind == "module:traced"
    assert to_layers(nn.Linear(2, 2)).kind == "module:whole_module"
    with pytest.raises(ValueError, match="expected an nn.Module"):
        to_layers(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loss_fn is not supported for Hugging Face"):
        to_layers(models.tiny_llama(layers=1), loss_fn=F.cross_entropy)
    with pytest.raises(ValueError, match="head_chunk_tokens"):
        to_layers(models.tiny_llama(layers=1), head_chunk_tokens=0)
    bare = models.tiny_llama(layers=1)
    bare.extra = nn.Linear(2, 2)  # a module the forward would have to know about
    with pytest.raises(ValueError, match="belong to no layer \\(extra.weight, extra.bias\\)"):
        to_layers(bare)


class _Masked(nn.Module):
    """Takes and returns (x, mask): a tuple passing between layers, as in DeepSpeed pipelines."""

    def __init__(self, width: int, *, leak: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.leak = leak

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        x, mask = inputs
        x = torch.tanh(self.linear(x)) * mask
        return (x, x * 2) if self.leak else (x, mask)


class _Last(nn.Module):
    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return inputs[0] * inputs[1]


def test_tuple_activations() -> None:
    model = nn.Sequential(_Masked(8), _Masked(8), _Last())
    x, mask, y = torch.randn(4, 8), (torch.rand(4, 8) > 0.3).float(), torch.randint(0, 8, (4,))
    loss = F.cross_entropy(model((x, mask)), y)
    loss.backward()
    want = take_grads(model)
    seq = to_layers(model, loss_fn=F.cross_entropy)
    torch.testing.assert_close(run_stages(seq, ((x, mask), y)), loss.detach(), **TIGHT)
    assert_grads_close(take_grads(model), want, **TIGHT)

    # a second tuple element that carries gradient is a "hidden.1" key: the runtime carries its
    # gradient too (tests/engine/test_module_models.py runs it through the engine)
    leaky_model = nn.Sequential(_Masked(8, leak=True), _Last())
    leaky = to_layers(leaky_model, loss_fn=F.cross_entropy)
    want_loss = F.cross_entropy(leaky_model((x, mask)), y)
    torch.testing.assert_close(leaky.run_reference(((x, mask), y)), want_loss, **TIGHT)


def test_layer_spec_list_with_tied_layers() -> None:
    torch.manual_seed(0)
    specs, loss_fn = models.tied_lm_layer_specs(vocab=32, hidden=16)
    seq = to_layers(specs, loss_fn=loss_fn)
    assert seq.kind == "layer_specs" and seq.num_blocks == 3
    root = seq.root
    embed = root.tied_modules["embed"]
    tokens, labels = torch.randint(0, 32, (2, 6)), torch.randint(0, 32, (2, 6))
    # reference: the forward a PipelineModule would run
    logits = models.tied_projection(embed, torch.tanh(root.get_submodule("1")(embed(tokens))))
    loss = loss_fn(logits, labels)
    loss.backward()
    want = take_grads(root)

    torch.testing.assert_close(run_stages(seq, (tokens, labels)), loss.detach(), **TIGHT)
    assert_grads_close(take_grads(root), want, **TIGHT)
    by_layer = seq.named_parameters_by_layer()
    assert [n for n, _ in by_layer[1]] == ["tied_modules.embed.weight"]
    assert [n for n, _ in by_layer[-1]] == ["tied_modules.embed.weight"]
    assert [n for n, _ in by_layer[2]] == ["1.weight", "1.bias"]


_PIPELINE_SCRIPT = """
import torch, torch.nn.functional as F
from subprocess_helpers import single_process_group_env
single_process_group_env()
import deepspeed
from deepspeed.pipe import PipelineModule
from models import tied_lm_layer_specs
from rp_engine.model import to_layers
from test_model_layers import run_stages, take_grads
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
specs, loss_fn = tied_lm_layer_specs(vocab=32, hidden=16)
pm = PipelineModule(specs, num_stages=1, loss_fn=loss_fn, partition_method="uniform")
tokens, labels = torch.randint(0, 32, (2, 6)), torch.randint(0, 32, (2, 6))
loss = loss_fn(pm(tokens), labels)
loss.backward()
want = take_grads(pm)
seq = to_layers(pm)
assert seq.kind == "pipeline" and seq.num_blocks == 3
got = run_stages(seq, (tokens, labels))
torch.testing.assert_close(got, loss.detach(), rtol=1e-5, atol=1e-6)
for name, g in take_grads(pm).items():
    torch.testing.assert_close(g, want[name], rtol=1e-5, atol=1e-6)
print("PIPELINE-OK", sorted(want))
"""


@pytest.mark.slow  # the first DeepSpeed init_distributed on a machine compiles its shm op (~60 s)
def test_pipeline_module_in_one_gloo_process() -> None:
    # A subprocess, so the process group and DeepSpeed's comm globals do not leak into other tests.
    root = Path(__file__).resolve().parents[2]
    here = Path(__file__).resolve().parent  # the script imports this module's helpers
    paths = [root, root / "tests" / "support", here]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in paths))
    env.setdefault(
        "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "rp_engine" / "torch_extensions")
    )
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_PIPELINE_SCRIPT)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "PIPELINE-OK ['1.bias', '1.weight', 'tied_modules.embed.weight']" in result.stdout
