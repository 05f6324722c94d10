"""Every Hugging Face family pipelined (issue 50): the families whose forward is not Llama's are
cut through their own code (rp_engine/model/hf_capture.py, hf_families.py) into one stage per
block, and train through the engine as plain PyTorch trains them.

Per family (and the Llama-style families issue 50's probe added to hf.py's table): the layer
sequence has one block per layer; its stages (each block its own autograd
graph, as the pipeline runs them) give the model's own loss and gradients; and three steps
through ``initialize`` (2 CPU devices, 2 micro-batches a step, AdamW) give plain PyTorch's
losses and global gradient norms (Adam divides a gradient's scale out, the norm does not). LoRA
(peft) trains on one family of each structure: a causal LM cut through its forward (GPT-2, whose
attention is one Conv1D) and a masked LM (BERT).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import models
import pytest
import torch
from engine_helpers import config, engine_for, reference_losses
from grad_scale import StepNorms
from test_model_layers import TIGHT, hf_reference, run_stages, take_grads
from torch import nn

from rp_engine.model import to_layers

# peft 0.21 calls a transformers API that 5.24 deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

GAS, STEPS, LR = 2, 3, 1e-3
LOSS_RTOL, NORM_RTOL = 1e-4, 1e-4  # fp32 sums in another order


def _batches(model: nn.Module, n: int) -> list[dict[str, torch.Tensor]]:
    vocab = model.config.vocab_size
    return [models.random_batch(vocab, seq=12, seed=100 + i, padded=True) for i in range(n)]


@pytest.mark.parametrize("family", models.HF_CAPTURED)
def test_stages_give_the_models_loss_and_gradients(family: str) -> None:
    """One block per layer, every block its own stage: the model's own loss and gradients
    (chunked head), and the plain path agrees."""
    model = models.tiny_hf(family)
    batch = models.random_batch(model.config.vocab_size, padded=True)
    want_loss, want = hf_reference(model, batch)
    seq = to_layers(model, head_chunk_tokens=5)
    assert seq.kind == f"hf:{model.config.model_type}"
    assert seq.num_blocks == model.config.num_hidden_layers
    loss = run_stages(seq, batch)
    torch.testing.assert_close(loss, want_loss, **TIGHT)
    got = take_grads(model)
    assert got.keys() == want.keys()
    for name, g in want.items():
        if g is None:
            assert got[name] is None, name
        else:
            assert got[name] is not None, name
            torch.testing.assert_close(got[name], g, msg=lambda m, n=name: f"{n}: {m}", **TIGHT)
    with torch.no_grad():
        torch.testing.assert_close(seq.run_reference(batch), want_loss, **TIGHT)


def _train(
    make: Callable[[], nn.Module], *, dtype: torch.dtype = torch.float32
) -> tuple[list[float], list[float], list[float], list[float], nn.Module, nn.Module]:
    """Engine and plain-PyTorch runs of STEPS steps from the same model: (engine losses,
    engine norms, reference losses, reference norms, engine's model, reference model)."""
    model = make().to(dtype)
    ref = copy.deepcopy(model)
    batches = _batches(model, STEPS * GAS)
    cfg = config(devices=2, gas=GAS, lr=LR, fwd_cuts=[2, 2], bwd_cuts=[0, 2, 2])
    if dtype == torch.bfloat16:
        cfg["bf16"] = {"enabled": True}
    engine = engine_for(model, cfg)
    try:
        assert engine.seq.num_blocks == model.config.num_hidden_layers
        it = iter(batches)
        losses, norms = [], []
        for _ in range(STEPS):
            losses.append(float(engine.train_batch(it)))
            norms.append(float(engine.get_global_grad_norm()))
        engine.synchronize()
    finally:
        engine.destroy()
    norm_of = StepNorms(lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.0))
    want = reference_losses(
        ref.float(), batches, steps=STEPS, gas=GAS, lr=LR, make_optimizer=norm_of
    )
    return losses, norms, want, norm_of.norms, model, ref


def _tiny(family: str) -> nn.Module:
    return models.tiny(family) if family in models.LLAMA_STYLE else models.tiny_hf(family)


@pytest.mark.parametrize("family", models.HF_CAPTURED + models.LLAMA_STYLE)
def test_trains_as_plain_pytorch(family: str) -> None:
    """Three steps through the engine: plain PyTorch's losses and gradient norms. (Not the
    weights element by element: an attention's key bias has a gradient that is zero but for
    rounding, softmax being blind to it, so Adam steps it by noise: engine_helpers.AdamSlack.)"""
    losses, norms, want, want_norms, model, ref = _train(lambda: _tiny(family))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(
        torch.tensor(norms), torch.tensor(want_norms), rtol=NORM_RTOL, atol=0
    )


@pytest.mark.parametrize("family", ["gpt2", "gemma3_text", "bert"])
def test_bf16_within_bf16_rounding(family: str) -> None:
    """bf16 weights and compute against the fp32 reference: losses within bf16's rounding
    (8 bits of mantissa: 1-2 % over a few layers), norms likewise."""
    losses, norms, want, want_norms, _, _ = _train(
        lambda: models.tiny_hf(family), dtype=torch.bfloat16
    )
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=2e-2, atol=0)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(want_norms), rtol=5e-2, atol=0)


def _lora(family: str, targets: list[str]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from peft import LoraConfig, get_peft_model

        base = models.tiny_hf(family)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        torch.manual_seed(1)
        return get_peft_model(base, lora).train()

    return make


@pytest.mark.parametrize(
    ("family", "targets"), [("gpt2", ["c_attn"]), ("bert", ["query", "value"])]
)
def test_lora(family: str, targets: list[str]) -> None:
    """peft's LoRA on a captured causal LM and on a masked LM: only the adapters train, with
    plain PyTorch's losses and norms."""
    losses, norms, want, want_norms, model, ref = _train(_lora(family, targets))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(
        torch.tensor(norms), torch.tensor(want_norms), rtol=NORM_RTOL, atol=0
    )
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    frozen = {n: p for n, p in ref.named_parameters() if not p.requires_grad}
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name


# --- the generic path: a family nobody listed ----------------------------------------------


class _Config:
    """The least a model needs to look like a Hugging Face one here."""

    model_type = "tiny_custom"
    num_hidden_layers = 3
    vocab_size = 64


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Linear(width, width)
        self.strength = 1.0  # the side-channel model sets it per batch

    def forward(self, hidden: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return hidden + self.strength * torch.tanh(self.mlp(self.norm(hidden))) * gate


class _Body(nn.Module):
    def __init__(self, width: int, *, side_channel: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(_Config.vocab_size, width)
        self.pos = nn.Embedding(32, width)
        self.layers = nn.ModuleList(_Block(width) for _ in range(_Config.num_hidden_layers))
        self.norm = nn.LayerNorm(width)
        self.side_channel = side_channel

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1])
        hidden = self.embed(input_ids) + self.pos(positions)
        gate = torch.sigmoid(positions.float() / 4)[None, :, None]  # computed once, passed on
        if self.side_channel:  # a prefix computation handed to the blocks outside their call
            for layer in self.layers:
                layer.strength = float(input_ids.shape[1])
        for layer in self.layers:
            hidden = layer(hidden, gate)
        return self.norm(hidden)


class _Output:
    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


class TinyCustomForCausalLM(nn.Module):
    """A decoder family in no table: positions and a gate computed before its blocks. ``hide``
    adds a computation the generic path cannot see: "prefix" hands the blocks a value through
    an attribute, "head" scales the logits in the model's own forward."""

    def __init__(self, *, hide: str | None = None, width: int = 32) -> None:
        super().__init__()
        self.config = _Config()
        self.model = _Body(width, side_channel=hide == "prefix")
        self.lm_head = nn.Linear(width, _Config.vocab_size, bias=False)
        self.logit_scale = 0.5 if hide == "head" else 1.0

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **_: Any) -> Any:
        logits = self.lm_head(self.model(input_ids)).float() * self.logit_scale
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
            )
        return _Output(loss)


def _custom_batches(n: int) -> list[dict[str, torch.Tensor]]:
    return [models.random_batch(_Config.vocab_size, seq=10, seed=i) for i in range(n)]


def test_a_family_nobody_listed_pipelines_and_is_checked(caplog: Any) -> None:
    """Blocks found as its repeated list, head as its final norm and output embeddings; the
    first batch is checked against its own loss; then it trains as plain PyTorch."""
    torch.manual_seed(0)
    model = TinyCustomForCausalLM()
    ref = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="rp_engine"):
        seq = to_layers(model)
    assert seq.kind == "hf:tiny_custom" and seq.num_blocks == 3
    assert seq.first_batch_check is not None
    assert "not among the mapped ones" in caplog.text
    batches = _custom_batches(STEPS * GAS)
    engine = engine_for(model, config(devices=2, gas=GAS, lr=LR))
    try:
        losses = [float(engine.train_batch(iter(batches[i * GAS :]))) for i in range(STEPS)]
        engine.synchronize()
    finally:
        engine.destroy()
    assert engine.seq.first_batch_check.done
    want = reference_losses(ref, batches, steps=STEPS, gas=GAS, lr=LR)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=LOSS_RTOL, atol=0)


@pytest.mark.parametrize("hide", ["prefix", "head"])
def test_a_hidden_computation_is_caught_on_the_first_batch(hide: str) -> None:
    """A computation the generic path cannot see (a value handed to the blocks through an
    attribute; a logit scaling in the model's forward): the first batch refuses with both
    losses before anything trains."""
    torch.manual_seed(0)
    model = TinyCustomForCausalLM(hide=hide)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = engine_for(model, config(devices=2, gas=GAS, lr=LR))
    try:
        with pytest.raises(RuntimeError, match=r"does not compute the model's loss.*against"):
            engine.train_batch(iter(_custom_batches(GAS)))
    finally:
        engine.destroy()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_deepspeeds_loop_as_in_its_tutorials(family: str) -> None:
    """``out = engine(**batch); engine.backward(out.loss); engine.step()`` (DeepSpeed's BERT and
    GPT-2 tutorials' loop): the model's own output type, plain PyTorch's losses."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MaskedLMOutput

    model = models.tiny_hf(family)
    ref = copy.deepcopy(model)
    batches = _batches(model, STEPS * GAS)
    engine = engine_for(model, config(devices=2, gas=GAS, lr=LR))
    try:
        losses = []
        for batch in batches:
            out = engine(**batch)
            engine.backward(out.loss)
            engine.step()
            losses.append(float(out.loss))
    finally:
        engine.destroy()
    kind = MaskedLMOutput if family == "bert" else CausalLMOutputWithPast
    assert type(out) is kind
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    want = []
    for i, batch in enumerate(batches):
        loss = ref(**batch).loss
        (loss / GAS).backward()
        want.append(float(loss.detach()))
        if i % GAS == GAS - 1:
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=LOSS_RTOL, atol=0)
