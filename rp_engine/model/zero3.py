"""Taking over a model built under DeepSpeed's ``zero.Init`` (ZeRO-3 partitioned parameters).

A model built inside ``deepspeed.zero.Init`` (directly, or by Transformers when an
``HfDeepSpeedConfig`` with ZeRO stage 3 is alive at ``from_pretrained`` / ``from_config``) holds
no weights in its parameters: each ``.data`` is empty (numel 0) and the values are a flat,
possibly padded shard in ``param.ds_tensor`` (host memory, or a swap file on NVMe with
``remote_device="nvme"``), next to DeepSpeed's bookkeeping (``ds_id``, ``ds_shape``,
``ds_status``..., and methods such as ``all_gather`` and ``item`` bound on the parameter).
RoundPipe keeps whole weights in host memory, so :func:`take_over` turns such a model back into
a plain ``nn.Module`` before it is cut into layers:

- one *layer* at a time (:func:`layer_groups`: each element of a ``ModuleList`` / ``Sequential``
  of blocks, and each other module with parameters of its own), its parameters are gathered
  with DeepSpeed's own ``all_gather`` (it swaps NVMe partitions in and, with several ranks,
  collects every rank's shard; every rank walks the layers in the same order);
- each gathered weight becomes the parameter's ordinary ``.data`` in host memory (the same
  ``nn.Parameter`` object, so optimizer groups built from ``model.parameters()`` still hold it;
  shape, dtype and ``requires_grad`` kept), copied out of DeepSpeed's buffer only where that
  buffer is larger than the weight, is a reused NVMe swap buffer, or is on a GPU
  (``remote_device`` none);
- a *frozen* weight (``requires_grad=False``: a LoRA base) of a model loaded from a local
  ``save_pretrained`` folder (``from_pretrained(folder)``, its ``name_or_path``) becomes instead a
  view of the folder's safetensors file mapping (model/folder.py ``frozen_file_views``: clean,
  evictable page cache, no anonymous copy), but only where the file tensor is bitwise the
  gathered value (same dtype, shape and bytes): a weight changed after loading keeps its copy;
- DeepSpeed's partition is released as soon as the layer is done (swap buffer returned, swap
  file deleted, ``ds_tensor`` dropped) with every DeepSpeed attribute of the parameter, so at
  most one layer exists twice at any time and the whole model never does.

The per-layer order (:func:`layer_groups`) is shared with loading a model layer by layer from
its folder (model/folder.py): that loader fills one layer's parameters at a time, and this
module's check then applies unchanged; the takeover serves frozen weights from the same file
mappings, resolved by the same keys (``folder.FolderKeys``).

:func:`check_parameter_storage` is the guard behind it for every model: a parameter whose storage
is empty, on the meta device, or smaller than its shape is refused by name, instead of failing
at the first forward with a shape error.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger("rp_engine")

__all__ = [
    "EmptyParameterError",
    "is_partitioned",
    "layer_groups",
    "materialize_layer",
    "take_over",
    "has_partitions",
    "Taken",
    "check_parameter_storage",
]

# What DeepSpeed's zero.Init binds on a parameter besides its ``ds_*`` attributes
# (partition_parameters.py, _convert_to_deepspeed_param): ``item`` shadows Tensor.item.
_DS_PARAM_NAMES = frozenset(
    {
        "all_gather",
        "all_gather_coalesced",
        "partition",
        "reduce_gradients_at_owner",
        "partition_gradients",
        "aligned_size",
        "padding_size",
        "partition_numel",
        "item",
        "convert_to_zero_parameters",
        "nvme_swapper",
        "is_external_param",
    }
)


class EmptyParameterError(ValueError):
    """A parameter holds no (or too little) data for its shape; the message names it."""


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` is a ZeRO-3 partition made by ``deepspeed.zero.Init``."""
    return hasattr(param, "ds_id") and hasattr(param, "ds_tensor")


def layer_groups(model: nn.Module) -> Iterator[tuple[str, list[tuple[str, nn.Parameter]]]]:
    """``(layer name, [(parameter name, parameter)])`` in module order, one entry per layer.

    A layer is an element of a ``ModuleList`` / ``Sequential`` (a decoder block, one Linear of a
    stack) with all its parameters, or any other module with its own direct parameters (an
    embedding, a final norm, an LM head). A parameter shared by several layers (tied weights)
    comes once, with the first. Layers without parameters are skipped."""
    seen: set[int] = set()

    def fresh(named: Iterator[tuple[str, nn.Parameter]], prefix: str) -> list:
        out = []
        for name, p in named:
            if id(p) not in seen:
                seen.add(id(p))
                out.append((f"{prefix}{name}", p))
        return out

    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, list]]:
        own = fresh(module.named_parameters(recurse=False), prefix)
        if own:
            yield prefix.rstrip(".") or "(root)", own
        for child_name, child in module.named_children():
            path = f"{prefix}{child_name}."
            if isinstance(child, nn.ModuleList | nn.Sequential):
                for name, block in child.named_children():
                    group = fresh(block.named_parameters(), f"{path}{name}.")
                    if group:
                        yield f"{path}{name}", group
            else:
                yield from walk(child, path)

    yield from walk(model, "")


# A parameter -> the tensor its folder's file holds for it (a view of the file's mapping), or
# None: model/folder.py's frozen_file_views
FileViews = Callable[[nn.Parameter], torch.Tensor | None]


@dataclass
class Taken:
    """Bytes a takeover put in place: ``gathered`` in all, ``from_files`` of them served by
    views of the model's folder files instead of copies."""

    gathered: int = 0
    from_files: int = 0


def materialize_layer(
    params: list[tuple[str, nn.Parameter]], files: FileViews | None = None
) -> Taken:
    """Gather one layer's ZeRO-3 partitions into ordinary ``.data`` and free DeepSpeed's copy.
    A parameter for which ``files`` gives a tensor with bitwise the gathered value (same dtype,
    shape and bytes) gets that tensor (a view of its file) instead of a copy. Parameters not
    partitioned are left as they are."""
    todo = [p for _, p in params if is_partitioned(p)]
    taken = Taken()
    for chunk in _swap_chunks(todo):
        _materialize(chunk, files, taken)
    return taken


def _swap_chunks(params: list[nn.Parameter]) -> Iterator[list[nn.Parameter]]:
    """``params`` in gathers DeepSpeed can serve: each swaps at most as many NVMe partitions in
    as its swapper has buffers free (``offload_param.buffer_count``, 5 by default; a decoder block
    has more weights), since the takeover hands each buffer back before the next gather."""
    chunk: list[nn.Parameter] = []
    swapped = 0
    for param in params:
        on_nvme = getattr(param.ds_tensor, "final_location", None) is not None  # type: ignore[attr-defined]
        swapper = getattr(param, "nvme_swapper", None)
        room = max(1, swapper.available_swap_in_buffers()) if swapper is not None else 0
        if on_nvme and chunk and swapped >= room:
            yield chunk
            chunk, swapped = [], 0
        chunk.append(param)
        swapped += on_nvme
    if chunk:
        yield chunk


def _materialize(todo: list[nn.Parameter], files: FileViews | None, taken: Taken) -> None:
    # DeepSpeed's gather (what GatheredParameters does on entry), without its re-partition on
    # exit: NVMe partitions are swapped in, every rank's shard collected, ``.data`` is the weight
    todo[0].all_gather(param_list=todo)  # type: ignore[attr-defined]
    for param in todo:
        shape = tuple(param.ds_shape)  # type: ignore[attr-defined]
        data = param.data
        if tuple(data.shape) != shape:  # pragma: no cover - DeepSpeed's contract
            raise RuntimeError(f"ZeRO-3 gather gave shape {tuple(data.shape)}, expected {shape}")
        partition = param.ds_tensor  # type: ignore[attr-defined]
        in_swap_buffer = getattr(partition, "final_location", None) is not None  # NVMe
        size = data.numel() * data.element_size()
        if data.device.type != "cpu":
            # remote_device none on a GPU (or a persisted small parameter): the weights live in
            # host memory under rp_engine
            data = data.to("cpu")
        on_file = files(param) if files is not None else None
        if on_file is not None and _same_bits(on_file, data):
            # the folder's file holds this very value: its clean, evictable page-cache pages
            # serve it instead of an anonymous copy (a weight changed since loading is not)
            data = on_file
            taken.from_files += size
        elif in_swap_buffer or data.untyped_storage().nbytes() != size:
            # the swap buffer is reused for the next layer; a padded shard keeps its padding
            data = data.clone(memory_format=torch.contiguous_format)
        _release(param)
        param.data = data
        taken.gathered += size


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (bitwise: ``-0.0`` differs from ``0.0``, a NaN equals
    itself)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _release(param: nn.Parameter) -> None:
    """Give DeepSpeed's partition of ``param`` back (swap buffer and file on NVMe) and strip
    its attributes: afterwards the parameter is a plain ``nn.Parameter``."""
    swapper = getattr(param, "nvme_swapper", None)
    partition = getattr(param, "ds_tensor", None)
    if swapper is not None and getattr(partition, "final_location", None) is not None:
        path = swapper.get_path(param)
        swapper.remove_partition_and_release_buffers([param])
        swapper.id_to_path.pop(param.ds_id, None)  # type: ignore[attr-defined]
        if path and os.path.exists(path):
            os.remove(path)  # the partition on NVMe: never read again
    for name in [k for k in vars(param) if k.startswith("ds_") or k in _DS_PARAM_NAMES]:
        delattr(param, name)


def _release_module(module: nn.Module) -> None:
    """DeepSpeed's marks on a module: ``ds_*`` attributes, external parameters and any hook
    whose function comes from DeepSpeed (zero.Init adds none; a ZeRO-3 engine would)."""
    for name in [k for k in vars(module) if k.startswith("ds_") or k == "_external_params"]:
        delattr(module, name)
    for hooks in (
        module._forward_pre_hooks,
        module._forward_hooks,
        module._backward_pre_hooks,
        module._backward_hooks,
    ):
        for key in [k for k, fn in hooks.items() if _from_deepspeed(fn)]:
            del hooks[key]


def _from_deepspeed(fn: object) -> bool:
    owner = getattr(fn, "__module__", None) or getattr(type(fn), "__module__", "")
    return str(owner).startswith("deepspeed")


def _restore_linear() -> None:
    """zero.Init leaves ``torch.nn.functional.linear`` replaced by its memory-efficient ZeRO-3
    version ("This will persist unless manually reset"); the plain one computes the same
    product, as the model loaded normally would (same rounding)."""
    zero = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    original = getattr(
        getattr(zero, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None
    )
    if original is not None and torch.nn.functional.linear is not original:
        wrap = getattr(zero, "zero3_linear_wrap", None)
        if torch.nn.functional.linear is wrap:
            torch.nn.functional.linear = original


def has_partitions(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ZeRO-3 partition (``take_over`` has work)."""
    return any(is_partitioned(p) for p in model.parameters())


def take_over(model: nn.Module, files: FileViews | None = None) -> int:
    """Turn a model built under ``deepspeed.zero.Init`` into a plain module, layer by layer (see
    the module doc); returns the number of parameters taken over (0: nothing was partitioned,
    and nothing was touched). ``files``: the tensors the model's folder holds for its frozen
    parameters (model/folder.py ``frozen_file_views``), served where bitwise equal to the
    gathered value. Must run in the process (and, with several ranks, on every rank) that built
    the model, before anything reads its weights."""
    if not has_partitions(model):
        return 0
    count, taken = 0, Taken()
    for _, params in layer_groups(model):
        count += sum(is_partitioned(p) for _, p in params)
        layer = materialize_layer(params, files)
        taken.gathered += layer.gathered
        taken.from_files += layer.from_files
    for module in model.modules():
        _release_module(module)
    _restore_linear()
    served = (
        f", {taken.from_files} bytes of frozen weights of them served from the model folder's files"
        if files is not None
        else ""
    )
    log.info(
        "rp_engine: took over a ZeRO-3 (zero.Init) model: %d parameters gathered layer by layer "
        "(%.1f MiB) from DeepSpeed's partitions%s", count, taken.gathered / 2**20, served,
    )  # fmt: skip
    return count


def check_parameter_storage(model: nn.Module) -> None:
    """Raise :class:`EmptyParameterError` naming the first parameter that holds no data for its
    shape: empty (numel 0), on the meta device, or backed by a storage smaller than its shape and
    strides need (a freed buffer: FSDP / ZeRO-style ``storage().resize_(0)``)."""
    for name, p in model.named_parameters():
        problem = _storage_problem(p)
        if problem is None:
            continue
        shape = tuple(getattr(p, "ds_shape", p.shape))
        raise EmptyParameterError(
            f"parameter {name!r} holds no weights: {problem} (shape {shape}). rp_engine "
            "trains whole weights kept in host memory; pass a model whose parameters hold their "
            "values: load it normally (without deepspeed.zero.Init / HfDeepSpeedConfig, which "
            "rp_engine.initialize otherwise takes over itself), or fill meta / freed parameters "
            "first (model.to_empty(device='cpu') and load_state_dict)"
        )


def _storage_problem(p: torch.Tensor) -> str | None:
    if is_partitioned(p):
        return "it is still a DeepSpeed ZeRO-3 partition"
    if p.is_meta:
        return "it is on the meta device"
    if p.numel() == 0:
        return "it has no elements (empty .data)"
    span = 1 + sum((size - 1) * stride for size, stride in zip(p.shape, p.stride(), strict=True))
    need = (p.storage_offset() + span) * p.element_size()
    have = p.untyped_storage().nbytes()
    if have < need:
        return f"its storage holds {have} bytes where its shape needs {need}"
    return None
