"""Loading a Hugging Face model folder layer by layer, frozen weights served from the files.

The contract (issue 49, part 3): a model whose weights are bigger than the memory the process may
use trains from its ``save_pretrained`` folder when most of it is frozen (a LoRA base), and the
frozen part costs no anonymous memory at all:

- :func:`build_empty` builds the model from ``config.json`` with every *parameter* on the meta
  device (no memory); buffers are built for real, so the ones a checkpoint does not hold
  (rotary ``inv_freq``, computed in ``__init__``) keep their values.
- :func:`load_weights` fills the parameters one layer at a time (``zero3.layer_groups`` order)
  from the folder's safetensors files (one ``model.safetensors`` or shards listed in
  ``model.safetensors.index.json``). Before anything is read, every parameter is resolved to a
  key of the files: the shard index, tied parameters (one object, read once under any of its
  names), transformers' own checkpoint key renames for the model's class
  (``get_model_conversion_mapping``: legacy names, ``model.`` base prefix missing or extra); a
  key that needs one of transformers' tensor conversions (merging, splitting) and a parameter no
  file holds are refused by name.
- Each tensor whose file dtype is the one asked for is a *view of a private file mapping*
  (``torch.UntypedStorage.from_file(path, shared=False)``, mmap ``MAP_PRIVATE``: one per file,
  at the tensor's byte offset from the header this module parses itself): nothing is read or
  copied, the pages come from the page cache when touched and stay clean, so the kernel evicts
  them under pressure instead of killing the process. A tensor in another dtype is cast while
  its layer is read, into ordinary (anonymous, counted) memory, one layer at a time.
- The parameter objects are kept (``torch.utils.swap_tensors``: the meta parameter becomes the
  loaded one in place), so ties and references to them hold.
- :func:`own_trainable` (called by ``rp_engine.initialize`` for every model) copies each
  *trainable* parameter still backed by a file into ordinary memory, layer by layer: the
  optimizer writes them, and writing a private mapping would turn its pages into anonymous ones
  behind the accounting's back. Frozen parameters (``requires_grad=False``) stay file-backed:
  the engine casts nothing (``model.to`` of an equal dtype is a no-op), pins nothing file
  backed (host_store.py) and copies none of them into the NVMe parameter tier's swap file
  (storage/param_tier.py, ``served_from_files``), so a LoRA base keeps costing page cache only.

What is counted then: trainable weights (and their fp32 masters, moments, gradients), frozen
weights whose file dtype differs from the run's (cast per layer), buffers and the runtime. What
is not: the frozen weights of a folder in the run's dtype.

:func:`from_folder` is the whole path for ``rp_engine.initialize(model="<folder>")`` and
``rp-train --model <folder>``; a folder holding a peft adapter (``adapter_config.json``) loads its
base folder this way and the adapter with peft, trainable. :func:`file_backing` tells whether a
tensor lies in a file mapping (read from ``/proc/self/maps``).

A model built under DeepSpeed's ``zero.Init`` by ``from_pretrained(<folder>)`` (an
``HfDeepSpeedConfig`` alive) takes the same path for its frozen weights: :func:`frozen_file_views`
resolves its parameters to the folder's tensors with the same keys (:class:`FolderKeys`, through
a peft wrapper too) and ``zero3.take_over`` serves each frozen weight from its file mapping
where it is bitwise the gathered value.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import json
import logging
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rp_engine.model.folder_layout import INDEX_FILE, SINGLE_FILE, FolderError, is_model_folder
from rp_engine.model.zero3 import layer_groups

log = logging.getLogger("rp_engine")

__all__ = [
    "FolderError",
    "TensorEntry",
    "FileMappings",
    "read_header",
    "folder_entries",
    "is_model_folder",
    "build_empty",
    "load_weights",
    "from_folder",
    "own_trainable",
    "frozen_file_views",
    "FolderKeys",
    "file_backing",
    "resident_file_bytes",
    "served_from_files",
]


# safetensors' dtype names (the format's spec) -> torch
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32,
    "U64": torch.uint64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are (``start``/``end``: absolute byte
    offsets in ``path``), its dtype and shape."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, from its header (8-byte little-endian length, then
    JSON of ``{name: {dtype, shape, data_offsets}}``, offsets relative to the data after it)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise FolderError(f"{path}: not a safetensors file (shorter than its 8-byte header)")
        (size,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(size))
        except ValueError as e:
            raise FolderError(f"{path}: not a safetensors file (header unreadable: {e})") from e
    base, entries = 8 + size, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise FolderError(f"{path}: tensor {name!r} has dtype {info['dtype']}, unknown here")
        begin, end = info["data_offsets"]
        entries[name] = TensorEntry(
            path, _DTYPES[info["dtype"]], tuple(info["shape"]), base + begin, base + end
        )
    return entries


def folder_entries(folder: Path) -> dict[str, TensorEntry]:
    """Every tensor of the folder's weights: ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` lists (each header read once)."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        shards = {name: read_header(folder / name) for name in sorted(set(weight_map.values()))}
        out = {}
        for key, shard in weight_map.items():
            if key not in shards[shard]:
                raise FolderError(f"{index}: {key!r} is listed in {shard}, which does not hold it")
            out[key] = shards[shard][key]
        return out
    if (folder / SINGLE_FILE).is_file():
        return read_header(folder / SINGLE_FILE)
    raise FolderError(
        f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}; save the model with save_pretrained "
        "(safe_serialization, the default), or load it with from_pretrained and pass the module"
    )


class _Mappings:
    """One private mapping per file (``from_file(shared=False)``: mmap MAP_PRIVATE), made on
    first use; the tensors viewing it keep it alive after this object is gone."""

    def __init__(self) -> None:
        self._storages: dict[Path, torch.UntypedStorage] = {}

    def view(self, entry: TensorEntry) -> torch.Tensor | None:
        """``entry`` as a view of its file's mapping, or None where its offset is not a
        multiple of its element size (a torch view must be aligned)."""
        size = torch.empty(0, dtype=entry.dtype).element_size()
        if entry.start % size or (entry.end - entry.start) != size * _numel(entry.shape):
            return None
        if entry.path not in self._storages:
            nbytes = entry.path.stat().st_size
            mapped = torch.UntypedStorage.from_file(str(entry.path), shared=False, nbytes=nbytes)
            self._storages[entry.path] = mapped  # type: ignore[assignment]
        storage = self._storages[entry.path]
        t = torch.empty(0, dtype=entry.dtype)
        return t.set_(storage, entry.start // size, entry.shape, _strides(entry.shape))

    @staticmethod
    def read(entry: TensorEntry) -> torch.Tensor:
        """``entry``'s bytes read into ordinary memory (the unaligned case)."""
        with open(entry.path, "rb") as f:
            f.seek(entry.start)
            data = bytearray(f.read(entry.end - entry.start))
        return torch.frombuffer(data, dtype=entry.dtype).reshape(entry.shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


# --- what lies in a file mapping ---------------------------------------------------------------


class FileMappings:
    """A snapshot of this process's file-backed mappings (``/proc/self/maps``): which file, if
    any, a tensor's memory lies in. Anonymous memory, the heap, stacks and pseudo files
    (``[vdso]``...) are not file backed; on a system without ``/proc`` nothing is."""

    def __init__(self, ranges: list[tuple[int, int, str]]) -> None:
        self._ranges = sorted(ranges)
        self._starts = [r[0] for r in self._ranges]

    @classmethod
    def read(cls) -> FileMappings:
        ranges = []
        with contextlib.suppress(OSError):
            with open("/proc/self/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) < 6 or parts[4] == "0" or not parts[5].startswith("/"):
                        continue
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    ranges.append((lo, hi, parts[5].rstrip("\n")))
        return cls(ranges)

    def path_of(self, t: torch.Tensor) -> str | None:
        """The file whose mapping holds ``t``'s first byte (None: not file backed)."""
        if t.device.type != "cpu" or t.numel() == 0:
            return None
        ptr = t.data_ptr()
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0 and self._ranges[i][0] <= ptr < self._ranges[i][1]:
            return self._ranges[i][2]
        return None


def resident_file_bytes(paths: set[str]) -> int:
    """Bytes of ``paths``' pages resident in this process's mappings of them now (``Rss`` of
    ``/proc/self/smaps``; 0 without ``/proc``): page cache the kernel may evict, counted in the
    process's RSS."""
    total, counting = 0, False
    with contextlib.suppress(OSError):
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
                    counting = len(head) == 6 and head[5].rstrip("\n") in paths
                elif counting and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
    return total


def file_backing(t: torch.Tensor) -> str | None:
    """The file ``t``'s memory is mapped from, or None (one ``/proc/self/maps`` read; for many
    tensors read ``FileMappings.read()`` once)."""
    return FileMappings.read().path_of(t)


def served_from_files(params: Iterable[torch.Tensor], maps: FileMappings | None = None) -> set[int]:
    """``id`` of each of ``params`` that is frozen (``requires_grad`` False) and lies in a file
    mapping: the weights nothing writes, whose bytes the engine reads from the mapping where
    it uses them (clean page-cache pages, never pinned, never copied to a swap file: the
    parameter tier, storage/param_tier.py, and the host-RAM count, host_preflight.py, leave
    them out). ``maps``: a snapshot already read (one ``/proc/self/maps`` read otherwise)."""
    maps = FileMappings.read() if maps is None else maps
    return {id(p) for p in params if not p.requires_grad and maps.path_of(p) is not None}


# --- building and filling --------------------------------------------------------------------


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered in the block is moved to the meta device as it is registered
    (its class and attributes kept); buffers are built for real. A layer's weights therefore
    exist only until their module registers them (uninitialised ``torch.empty``, untouched:
    ``reset_parameters`` then runs on meta)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        p = module._parameters.get(name)
        if p is not None and p.device.type != "meta":
            attrs = dict(vars(p))
            meta = type(p)(p.to("meta"), requires_grad=p.requires_grad)
            meta.__dict__.update(attrs)
            module._parameters[name] = meta

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _load_config(folder: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder), local_files_only=True)


def build_empty(config: Any, *, dtype: torch.dtype | None = None, model_class: Any = None) -> Any:
    """A transformers model of ``config`` (``AutoModelForCausalLM``, or ``model_class``) with
    every parameter on the meta device, in ``dtype`` (None: the config's ``dtype``) and the
    config's attention implementation, in eval mode as ``from_pretrained`` leaves it."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)  # from_config writes the dtype it builds in into its config
    kwargs: dict[str, Any] = {} if dtype is None else {"dtype": dtype}
    with _parameters_on_meta():
        if model_class is None:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        else:
            model = model_class._from_config(config, **kwargs)
    return model.eval()


# peft's wrapper modules: a wrapped layer's own weights lie one level down under these names
# (LoRA's ``base_layer``, modules_to_save's ``original_module``); the files name them without it
_PEFT_WRAPPERS = frozenset({"base_layer", "original_module"})


def _saved_name(name: str) -> str:
    """``name`` as its transformers model saves it: peft's wrapper segments dropped."""
    return ".".join(part for part in name.split(".") if part not in _PEFT_WRAPPERS)


class FolderKeys:
    """The one resolution of a folder's keys for a model: which file tensor holds each of its
    parameters and buffers, after transformers' renames for the model's class (legacy names,
    ``model.`` base prefix missing or extra; identity for a plain module). A model wrapped
    around a transformers model (peft) is resolved through the transformers model inside it,
    its names taken as that model saves them (peft's wrapper segments dropped).

    Raises ``FolderError`` for a key that needs one of transformers' tensor conversions
    (merging, splitting)."""

    def __init__(self, model: nn.Module, entries: dict[str, TensorEntry]) -> None:
        self.entries = entries
        self._prefix, root = _transformers_model(model)
        self._names = _key_resolver(root, set(entries))
        self._aliases: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self._aliases.setdefault(id(p), []).append(name)

    def key(self, name: str) -> str | None:
        """The file key holding the model's tensor ``name`` (None: no file holds it)."""
        if not name.startswith(self._prefix):
            return None
        return self._names.get(_saved_name(name[len(self._prefix) :]))

    def key_of(self, param: torch.Tensor) -> str | None:
        """The file key holding ``param`` under any of its names (tied weights have several)."""
        return next(filter(None, map(self.key, self._aliases.get(id(param), []))), None)


def _transformers_model(model: nn.Module) -> tuple[str, nn.Module]:
    """``(name prefix, module)`` of the outermost transformers model in ``model`` (``model``
    itself unless a wrapper such as peft's holds it); ``("", model)`` where there is none."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return "", model
    for name, module in model.named_modules():
        if isinstance(module, PreTrainedModel):
            return (f"{name}." if name else ""), module
    return "", model


def _key_resolver(model: nn.Module, keys: set[str]) -> dict[str, str]:
    """``saved name -> file key`` for every key of the files that names a tensor of ``model``
    after transformers' renames for this model's class (identity for a plain module)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:  # pragma: no cover - transformers is a dependency
        return {k: k for k in keys}
    if not isinstance(model, PreTrainedModel):
        return {k: k for k in keys}
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    # names only (values are meta, partitions or buffers), as the model saves them
    own = {_saved_name(k): True for k in model.state_dict()}
    out: dict[str, str] = {}
    for key in sorted(keys):
        name, converted = rename_source_key(
            key,
            renamings,
            converters,
            model.base_model_prefix,
            own,  # type: ignore[arg-type]
        )
        if converted is not None:
            raise FolderError(
                f"file key {key!r} needs transformers' conversion {converted!r} (tensors merged "
                f"or split) for {type(model).__name__}; rp_engine maps tensors as they are in "
                "the files: load this model with from_pretrained and pass the module"
            )
        out.setdefault(name, key)
    return out


@dataclass
class LoadReport:
    """What :func:`load_weights` did, in bytes: ``mapped`` (views of file mappings: no memory
    of their own), ``read`` (into ordinary memory: casts and unaligned tensors), and the file
    keys no parameter or buffer took (``unused``)."""

    mapped: int = 0
    read: int = 0
    tensors: int = 0
    unused: tuple[str, ...] = ()


def load_weights(
    model: nn.Module, folder: str | os.PathLike[str], *, dtype: torch.dtype | None = None
) -> LoadReport:
    """Fill ``model``'s meta parameters (and the buffers the files hold) from ``folder``'s
    safetensors files, layer by layer; see the module doc. ``dtype``: floating-point tensors
    of another dtype in the files are cast to it per layer (None: each keeps its file dtype).
    Parameters that already hold data are left alone. Raises ``FolderError`` naming a
    parameter no file holds, a shape that differs, or a key transformers would convert."""
    path = Path(folder)
    entries = folder_entries(path)
    keys = FolderKeys(model, entries)
    plan: list[list[tuple[nn.Parameter, str, TensorEntry]]] = []
    missing = []
    for _, params in layer_groups(model):
        layer = []
        for name, p in params:
            if not p.is_meta:
                continue
            key = keys.key_of(p)
            if key is None:
                missing.append(name)
                continue
            entry = entries[key]
            if entry.shape != tuple(p.shape):
                raise FolderError(
                    f"{path}: {key!r} has shape {entry.shape}, the model's {name!r} "
                    f"{tuple(p.shape)}: the folder's config.json does not match its weights"
                )
            layer.append((p, key, entry))
        plan.append(layer)
    if missing:
        raise FolderError(
            f"{path}: no tensor for parameter(s) {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''}; the folder's weights do not fit this model "
            "(another class or config?)"
        )
    maps, report, used = _Mappings(), LoadReport(), set()
    with torch.no_grad():
        for layer in plan:  # one layer's casts exist at a time beyond what is kept
            for p, key, entry in layer:
                t = _tensor(maps, entry, dtype, report)
                used.add(key)
                torch.utils.swap_tensors(p, nn.Parameter(t, requires_grad=p.requires_grad))
        used |= _load_buffers(model, keys, maps)
    report.unused = tuple(sorted(set(entries) - used))
    if report.unused:
        log.info(
            "rp_engine: %s: %d tensor(s) in the files are not in the model (e.g. %s)",
            path, len(report.unused), report.unused[0],
        )  # fmt: skip
    log.info(
        "rp_engine: loaded %d tensors from %s layer by layer: %.1f MiB mapped from the files, "
        "%.1f MiB read or cast into memory", report.tensors, path, report.mapped / 2**20,
        report.read / 2**20,
    )  # fmt: skip
    return report


def _tensor(
    maps: _Mappings, entry: TensorEntry, dtype: torch.dtype | None, report: LoadReport
) -> torch.Tensor:
    report.tensors += 1
    view = maps.view(entry)
    cast = dtype is not None and entry.dtype.is_floating_point and entry.dtype != dtype
    if view is not None and not cast:
        report.mapped += entry.end - entry.start
        return view
    t = maps.read(entry) if view is None else view
    if cast:
        t = t.to(dtype)  # pages read through the page cache, the cast in anonymous memory
    report.read += t.numel() * t.element_size()
    return t


def _load_buffers(model: nn.Module, keys: FolderKeys, maps: _Mappings) -> set[str]:
    """Copy the buffers the files hold into the model (their own dtype kept: small); a meta
    buffer the files do not hold is rebuilt from the model's config, else refused."""
    used = set()
    twin: dict[str, torch.Tensor] | None = None
    for name, buf in list(model.named_buffers(remove_duplicate=False)):
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        key = keys.key(name)
        if key is not None:
            used.add(key)
            entry = keys.entries[key]
            view = maps.view(entry)
            src = view if view is not None else maps.read(entry)
            # buffers are small and may be written (pinned, updated): ordinary memory
            module._buffers[leaf] = src.to(buf.dtype, copy=True)
        elif buf.is_meta:
            if twin is None:
                twin = _twin_buffers(model)
            if name not in twin:
                raise FolderError(
                    f"buffer {name!r} is on the meta device and the folder does not hold it; "
                    "build the model with real buffers (only its parameters on meta)"
                )
            module._buffers[leaf] = twin[name]
    return used


def _twin_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers of the same transformers class built from the model's config (parameters
    on meta): the values ``__init__`` computes (rotary ``inv_freq``...)."""
    config = getattr(model, "config", None)
    if config is None:
        return {}
    twin = build_empty(config, dtype=None, model_class=type(model))
    return dict(twin.named_buffers(remove_duplicate=False))


def from_folder(folder: str | os.PathLike[str], *, dtype: torch.dtype | None = None) -> nn.Module:
    """The causal LM of a ``save_pretrained`` folder, loaded by :func:`load_weights` (frozen
    weights served from the files once ``own_trainable`` has run). ``dtype``: the run's compute
    dtype (None: the config's). A folder holding a peft adapter (``adapter_config.json``) loads
    the base folder (or hub id) it names, then the adapter with peft, trainable. A hub id
    (``"org/name[@revision]"``) is its snapshot folder of the Hugging Face cache (model/hub.py)."""
    from rp_engine.model.hub import local_folder

    path = local_folder(folder)
    if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        return _with_adapter(path, dtype)
    if not (path / "config.json").is_file():
        raise FolderError(
            f"{path}: no config.json; give a folder written by save_pretrained (config.json and "
            "safetensors weights), or a Hugging Face hub id (org/name or org/name@revision)"
        )
    config = _load_config(path)
    if dtype is None:  # the config's dtype ("bfloat16" or a torch.dtype), else the files'
        named = getattr(config, "dtype", None)
        named = getattr(torch, named, None) if isinstance(named, str) else named
        dtype = named if isinstance(named, torch.dtype) else None
    model = build_empty(config, dtype=dtype)
    load_weights(model, path, dtype=dtype)
    return model


def _with_adapter(path: Path, dtype: torch.dtype | None) -> nn.Module:
    from peft import PeftModel

    from rp_engine.model.hub import looks_like_hub_id

    info = json.loads((path / "adapter_config.json").read_text())
    base = info.get("base_model_name_or_path")
    if not base or not (Path(base).expanduser().is_dir() or looks_like_hub_id(base)):
        raise FolderError(
            f"{path}: a peft adapter whose base {base!r} is neither a local folder nor a hub id; "
            "set base_model_name_or_path in its adapter_config.json to the base model's folder"
        )
    model = from_folder(base, dtype=dtype)
    return PeftModel.from_pretrained(model, str(path), is_trainable=True)  # type: ignore[arg-type]


def frozen_file_views(model: nn.Module) -> Callable[[nn.Parameter], torch.Tensor | None] | None:
    """For a model loaded with ``from_pretrained`` from a local ``save_pretrained`` folder (its
    ``name_or_path``, under a wrapper such as peft's too): ``param -> the file tensor holding a
    frozen (``requires_grad=False``) parameter, as a view of the file's private mapping`` (None
    for a trainable parameter, one no file holds, or one that cannot be a view: unaligned).
    None where the model did not come from such a folder or its keys do not resolve (logged).

    The view is what the files hold, not necessarily the parameter's value (a user may change
    weights after loading): the caller compares before serving it (zero3.take_over)."""
    _, root = _transformers_model(model)
    where = getattr(getattr(root, "config", None), "name_or_path", None)
    if not where or not is_model_folder(os.path.expanduser(where)):
        return None
    path = Path(where).expanduser()
    try:
        keys = FolderKeys(model, folder_entries(path))
    except (FolderError, OSError) as e:
        log.info("rp_engine: %s: frozen weights not served from the files: %s", path, e)
        return None
    maps = _Mappings()

    def view(param: nn.Parameter) -> torch.Tensor | None:
        key = None if param.requires_grad else keys.key_of(param)
        return None if key is None else maps.view(keys.entries[key])

    return view


def own_trainable(model: nn.Module) -> int:
    """Copy every trainable parameter whose memory lies in a file mapping into ordinary memory,
    layer by layer (see the module doc); returns the bytes copied. Frozen ones stay mapped."""
    maps = FileMappings.read()
    done = 0
    with torch.no_grad():
        for _, params in layer_groups(model):
            for _, p in params:
                if p.requires_grad and maps.path_of(p) is not None:
                    p.data = p.data.clone(memory_format=torch.contiguous_format)
                    done += p.numel() * p.element_size()
    if done:
        log.info("rp_engine: %.1f MiB of trainable weights read from their files", done / 2**20)
    return done
