"""The RoundPipe library itself (PyPI ``roundpipe`` 0.1.1) as a head-to-head system, ``roundpipe_lib``.

Owns what ``benchmarks.head_to_head`` needs to run the published implementation beside
rp_engine on the same model, data and optimizer settings:

- ``lib_config(preset, ds)``: the library's arguments, derived from the one ds_config every other
  system reads (pure: no import of ``roundpipe``, so CPU tests check it);
- ``differences(preset, ds)``: where the library's run differs from rp_engine's, for the JSON row
  and the table's notes;
- ``adapt_qwen3_preset``: roundpipe 0.1.1's Qwen3 preset was written for transformers 4.x; on
  5.x it calls ``create_causal_mask`` with renamed arguments and reads a decoder layer attribute
  5.x dropped. The adapter renames, and nothing else (tests compare its loss with the model's);
- ``setup``: the head-to-head setup (``step``, ``sync``, ``extra``, ``reset_peaks``).

The library runs on GPUs only: ``import roundpipe`` reads every GPU's free memory at import
(its planner's defaults) and raises without one, so on CPU the system is reported skipped with
``SKIP_REASON``. Its wheel and beartype (its one dependency missing from the device image) are
carried in ``.whl`` (benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import Any

__all__ = [
    "SYSTEM",
    "SKIP_REASON",
    "lib_config",
    "differences",
    "adapt_qwen3_preset",
    "setup",
]

SYSTEM = "roundpipe_lib"
SKIP_REASON = (
    "needs CUDA: the roundpipe library runs on GPUs only (`import roundpipe` reads every GPU's "
    "free memory and fails without one)"
)
# The library's own default model_memory_limit is 0.6 x the smallest GPU's memory (GiB, read
# once at import); on the 24 GiB card the budget emulates it is this fraction of the budget
MODEL_MEMORY_SHARE = 0.6
# DeepSpeed's CPU Adam defaults, which DeepSpeed and rp_engine apply to an "AdamW" section
# that leaves them out (the ds_config does)
DS_ADAM_EPS, DS_ADAM_WEIGHT_DECAY = 1e-8, 0.0


def lib_config(preset: dict[str, Any], ds: dict[str, Any]) -> dict[str, Any]:
    """The library's arguments for ``preset``, read from ``ds``, the ds_config every other
    system runs with (``common.ds_config(preset, devices=None, pcie_gbps=None)``), so
    they cannot drift from the other systems': micro-batch, accumulation, dtype, AdamW
    hyper-parameters, clipping, the device budget. JSON-able (it goes into the row).

    Mapping: one ``forward_backward`` per optimizer step over ``mbs x gas`` sequences that the
    library splits into ``num_microbatch = gas`` micro-batches of ``mbs`` (contiguous chunks:
    the other systems' micro-batches, in their order); each micro-batch's mean loss is scaled
    by ``1 / gas`` so the summed loss and the gradients are the accumulation window's mean, as
    DeepSpeed's. The weights are cast to the compute dtype before wrapping (the library computes
    in the parameters' dtype; rp_engine's ``initialize`` casts likewise) and the optimizer keeps
    fp32 copies (``optim_dtype``)."""
    params = ds["optimizer"]["params"]
    gas, mbs = ds["gradient_accumulation_steps"], ds["train_micro_batch_size_per_gpu"]
    budget_gib = preset.get("device_memory_gb")  # rp_engine reads it as GiB (2**30 bytes)
    return {
        "wrap": {"use_sequential_preset": True, "optim_dtype": "float32", "pin_model": "alloc"},
        "run_config": {"num_microbatch": gas},
        "sequences_per_call": mbs * gas,
        "loss_scale": 1.0 / gas,
        "param_dtype": "bfloat16" if ds.get("bf16", {}).get("enabled") else "float32",
        "optimizer": {
            "lr": params["lr"],
            "betas": list(params["betas"]),
            "eps": params.get("eps", DS_ADAM_EPS),
            "weight_decay": params.get("weight_decay", DS_ADAM_WEIGHT_DECAY),
            "decoupled_weight_decay": ds["optimizer"]["type"].lower() == "adamw",
        },
        "gradient_clipping": ds["gradient_clipping"],
        "is_async": True,  # the library's default and recommendation; compared with async rp
        "model_memory_limit_gib": MODEL_MEMORY_SHARE * budget_gib if budget_gib else None,
        "memory_cap_gib": budget_gib,
    }


def differences(preset: dict[str, Any], ds: dict[str, Any]) -> list[str]:
    """Where ``roundpipe_lib``'s run differs from rp_engine's (``roundpipe``, async): short
    sentences for the JSON row and the table's notes (``ds``: as for ``lib_config``)."""
    cfg = lib_config(preset, ds)
    gas = cfg["run_config"]["num_microbatch"]
    out = [
        f"one forward_backward per step: {cfg['sequences_per_call']} sequences split by the "
        f"library into {gas} micro-batches (the same micro-batches as the other systems)",
        "its own CPU Adam (roundpipe.optim.Adam, decoupled decay = AdamW, wd "
        f"{cfg['optimizer']['weight_decay']:g}, eps {cfg['optimizer']['eps']:g}), stepped with "
        "clip_grad_norm_ on fp32 copies on its optimizer thread, asynchronous (staleness 1, as "
        "rp_engine async; losses compared with 'roundpipe')",
        "stage cuts by its own planner from its per-layer timings",
        "loss: its Qwen3 preset's torch.compile'd cross-entropy (logits materialised)",
        "forward_backward waits for the loss: every timed step synchronises on it",
        "transformers 5.x: its Qwen3 preset (written for 4.x) runs through "
        "benchmarks.roundpipe_lib.adapt_qwen3_preset (argument names only)",
        "bytes moved per step not measured (the library counts none)",
    ]
    if cfg["model_memory_limit_gib"]:
        out.insert(
            3,
            f"model_memory_limit {cfg['model_memory_limit_gib']:.1f} GiB (its own default on a "
            f"{cfg['memory_cap_gib']:g} GiB card), the process capped at "
            f"{cfg['memory_cap_gib']:g} GiB (set_per_process_memory_fraction)",
        )
    return out


def adapt_qwen3_preset(preset_module: Any, model: Any) -> list[str]:
    """Let roundpipe 0.1.1's Qwen3 preset (``roundpipe.models.qwen3``) run on the installed
    transformers; returns what it changed (empty on a transformers the preset was written for).

    - the preset calls ``create_causal_mask`` / ``create_sliding_window_causal_mask`` with
      ``input_embeds``, ``past_key_values`` and ``cache_position``; transformers 5.x takes
      ``inputs_embeds`` and ``cache`` (5.24; ``past_key_values`` in 5.17) and no
      ``cache_position``: the module's two names are rebound to a wrapper that renames, and
      drops what the installed function does not take;
    - the preset reads ``decoder_layer.attention_type``, which 5.x no longer sets (the model
      reads ``config.layer_types[i]``): each of ``model``'s layers gets it from the config.

    Idempotent; call it before ``wrap_model_to_roundpipe``."""
    changed: list[str] = []
    for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
        fn = getattr(preset_module, name, None)
        if fn is None or getattr(fn, "_rp_adapted", False):
            continue
        takes = set(inspect.signature(fn).parameters)  # follows the deprecation decorator
        if "input_embeds" in takes:
            continue  # the transformers the preset was written for
        preset_module.__dict__[name] = _renaming(fn, takes)
        changed.append(f"{name}: input_embeds -> inputs_embeds, past_key_values -> cache")
    types = getattr(model.config, "layer_types", None)
    missing = [layer for layer in model.model.layers if not hasattr(layer, "attention_type")]
    for i, layer in enumerate(model.model.layers):
        if layer in missing:
            layer.attention_type = types[i] if types else "full_attention"
    if missing:
        changed.append(f"attention_type set on {len(missing)} decoder layers from layer_types")
    return changed


def _renaming(fn: Callable[..., Any], takes: set[str]) -> Callable[..., Any]:
    """``fn`` called with the preset's keyword names mapped onto the ones it ``takes``."""
    renames = {"input_embeds": "inputs_embeds", "past_key_values": "cache"}

    def call(**kwargs: Any) -> Any:
        out = {}
        for key, value in kwargs.items():
            if key not in takes and renames.get(key) in takes:
                key = renames[key]
            if key in takes:  # cache_position: 5.x derives positions itself
                out[key] = value
        return fn(**out)

    call._rp_adapted = True  # type: ignore[attr-defined]
    return call


def setup(
    preset: dict[str, Any],
    data: list[dict[str, Any]],
    cuda: bool,
    args: argparse.Namespace,
    *,
    ds: dict[str, Any],
    build_model: Callable[[dict[str, Any]], Any],
) -> tuple[Callable[[], Any], Callable[[], None], Callable[[], dict], Callable[[], None]]:
    """The head-to-head setup of ``roundpipe_lib`` (``head_to_head._SETUP``'s contract, with
    the head-to-head's ds_config ``ds`` and model builder passed in): the model wrapped with
    the library's sequential preset, its CPU Adam, one ``forward_backward`` and one ``step``
    per optimizer step. ``data``: the micro-batches in order (``gas`` per step). CUDA only
    (``run_system`` reports the skip on CPU)."""
    import torch

    if not cuda:
        raise RuntimeError(SKIP_REASON)
    from benchmarks.cuda_budget import cap_cuda_memory

    cfg = lib_config(preset, ds)
    cap = cap_cuda_memory(cfg["memory_cap_gib"]) if cfg["memory_cap_gib"] else None
    import roundpipe
    from roundpipe import ModelExecutePlan, RoundPipeRunConfig
    from roundpipe.models import qwen3 as qwen3_preset

    model = build_model(preset).to(getattr(torch, cfg["param_dtype"]))
    adapted = adapt_qwen3_preset(qwen3_preset, model)
    wrap = cfg["wrap"]
    wrapped = roundpipe.wrap_model_to_roundpipe(
        model,
        use_sequential_preset=wrap["use_sequential_preset"],
        model_run_config=RoundPipeRunConfig(**cfg["run_config"]),
        name="qwen3",
        optim_dtype=getattr(torch, wrap["optim_dtype"]),
        pin_model=wrap["pin_model"],
    )
    params = list(wrapped.optim_parameters())
    opt_cfg = cfg["optimizer"]
    optimizer = roundpipe.optim.Adam(
        params, lr=opt_cfg["lr"], betas=tuple(opt_cfg["betas"]), eps=opt_cfg["eps"],
        weight_decay=opt_cfg["weight_decay"],
        decoupled_weight_decay=opt_cfg["decoupled_weight_decay"],
    )  # fmt: skip
    clip, scale = cfg["gradient_clipping"], cfg["loss_scale"]
    gas = cfg["run_config"]["num_microbatch"]
    limit = cfg["model_memory_limit_gib"]

    def optimizer_step() -> None:  # on the library's optimizer thread, over the fp32 copies
        torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad()  # None: the next step's gradients are copied, not added

    def loss_fn(outputs: Any, _label: Any) -> Any:
        return outputs.loss * scale  # the preset computed each micro-batch's mean

    it = iter(data)
    plans: list[str] = []

    def step() -> Any:
        chunk = [next(it) for _ in range(gas)]
        inputs = {k: torch.cat([b[k] for b in chunk]) for k in chunk[0]}
        run = RoundPipeRunConfig()
        if limit:  # the library's own per-call auto plan, with the budget's memory limit
            wrapped.model_timer.update_times()
            plan = ModelExecutePlan.auto("fused", wrapped, model_memory_limit=limit)
            plans.append(repr(plan))
            run = RoundPipeRunConfig(execute_plan=plan)
        loss = wrapped.forward_backward(input_kwargs=inputs, loss_fn=loss_fn, run_config=run)
        wrapped.step(optimizer_step, is_async=cfg["is_async"])
        return loss

    def sync() -> None:
        wrapped.synchronize()  # the optimizer thread's last step and its copy-back
        torch.cuda.synchronize()

    def extra() -> dict[str, Any]:
        import importlib.metadata as md

        versions: dict[str, str | None] = {}
        for pkg in ("roundpipe", "beartype", "transformers", "torch"):
            try:
                versions[pkg] = md.version(pkg)
            except md.PackageNotFoundError:
                versions[pkg] = None
        return {
            "bytes_per_step": None,  # the library counts no transfers
            "roundpipe_config": cfg,
            "differences": differences(preset, ds),
            "adapted": adapted,
            "execute_plan": plans[-1] if plans else None,
            "versions": versions,
            "memory_cap": cap,
        }

    def no_peaks() -> None:
        """torch's own peak reset (run_system) is the device figure."""

    return step, sync, extra, no_peaks
