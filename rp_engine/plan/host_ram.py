"""Host RAM of a run with the NVMe tiers: a function of the largest layers, the pools and the
devices, not of the number of layers.

With ``offload_optimizer`` on NVMe the fp32 masters and Adam moments stream through the optimizer
tier's buffers, the fp32 gradients through the gradient tier's (storage/grad_tier.py), and with
``offload_param`` on NVMe the compute weights through the parameter tier's; each pool holds a few
records of an ordinary layer, plus two of a much larger one (an embedding, an LM head):
``size_classes`` is the rule the pools are built with (storage/record_pool.py). What remains:

  runtime                 Python, torch, transformers, DeepSpeed's ops, threads and allocator
                          slack: what the process holds at initialize besides the model
                          (measured by the preflight; ``RUNTIME_BYTES`` for the advisor) plus
                          what training adds to it (``RUNTIME_GROWTH``, measured here)
  compute weights         every weight in RAM (x2 when double-buffered), or with the parameter
                          tier only the shared ones (a tied embedding) and the tier's pool,
                          which grows to what one upload pins: a stage's weights; frozen
                          weights served from a model folder's file mapping (model/folder.py)
                          are neither: clean page-cache pages the kernel evicts, listed apart
                          and not counted, and the parameter tier leaves them in their files
  optimizer tier          ``buffer_count`` x 12 B x the largest ordinary layer (+ 2 big), or
                          sliced (``optimizer_slice`` bytes): ``buffer_count`` slices, whatever
                          the layers' width
  gradient tier           ``grad_buffers`` x 4 B x the largest ordinary layer (+ 2 big); without
                          it, the whole-model fp32 arena (4 B per trainable parameter)
  download staging        per device, a stage's gradients in the compute dtype
  CPU virtual devices     their memory (``device_memory_gb``) is host memory

A stage's weights (or gradients) are taken as four of the largest ordinary layers, at most half
of the device's memory ``device_bytes`` when it is known.

``initialize`` holds the user's model (every weight in the compute dtype) until the tiers took
it, layer by layer: the run's peak is the larger of that and the training total. Used by the
initialize preflight (host_preflight.py) and the advisor (advise.py). Pure: nothing of ours
but the host room's constants (host/units.py, host/defaults.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from rp_engine.host.defaults import OPTIMIZER_BUFFERS, PARAM_BUFFERS
from rp_engine.host.units import ALIGN, format_mib_gib

__all__ = [
    "RUNTIME_BYTES",
    "RUNTIME_GROWTH",
    "HostRam",
    "PoolCounts",
    "PoolSizes",
    "MIN_OPTIMIZER_SLICE",
    "default_stage",
    "fit_pools",
    "pack_pieces",
    "slice_bytes",
    "size_classes",
    "tier_host_ram",
]

# Python, torch, transformers and DeepSpeed imported, a model built: 0.25-0.35 GiB here besides
# the model's own bytes; training adds threads, DeepSpeed's ops and allocator slack: 0.2 GiB
RUNTIME_GROWTH = 200 * 2**20
RUNTIME_BYTES = 250 * 2**20  # what initialize finds besides the model, when not measured
# the smallest slice of a layer's optimizer state a pool buffer carries: 12 B x 512K elements,
# a quarter of a CPU Adam call's slice (optim/optimizer.py), so the calls stay long enough
# that their Python overhead is noise; halved from the largest record down to this when a
# budget needs it (``fit_pools``)
MIN_OPTIMIZER_SLICE = 6 * 2**20


@dataclass(frozen=True)
class PoolSizes:
    """The buffer sizes of a record pool (``size_classes``): ``ordinary`` bytes for records up
    to that size; ``big`` bytes (0: none) for the larger ones, ``big_count`` buffers of them."""

    ordinary: int
    big: int = 0
    big_records: int = 0

    @property
    def big_count(self) -> int:
        """Buffers of the big class: 2 (a pin of two big records at once, or one pinned while
        the other is written back or read ahead)."""
        return 2 if self.big else 0

    def pool_bytes(self, buffer_count: int) -> int:
        """Host bytes of a pool of ``buffer_count`` ordinary buffers (at least 2) and the big
        ones."""
        return self.ordinary * max(2, buffer_count) + self.big * self.big_count


def size_classes(record_bytes: Iterable[int]) -> PoolSizes:
    """Split records (bytes each; 0 skipped) into the ordinary class (up to twice the median
    record) and the big one (the rest), each class's buffers the size of its largest record
    (4 KiB multiples)."""
    sizes = [-(-b // ALIGN) * ALIGN for b in record_bytes if b]
    if not sizes:
        return PoolSizes(ALIGN)
    cut = 2 * sorted(sizes)[(len(sizes) - 1) // 2]
    big = [b for b in sizes if b > cut]
    ordinary = max(b for b in sizes if b <= cut)
    return PoolSizes(ordinary, max(big, default=0), len(big))


# elements: tensors are packed, and cut, in multiples of this (4 KiB of fp32; a multiple of CPU
# Adam's widest SIMD span, so a cut splits a tensor's vector and scalar parts as the whole does)
PIECE_ALIGN = 1024


def slice_bytes(slice_mb: float | None) -> int:
    """``roundpipe.optimizer_slice_mb`` in bytes, 4 KiB multiples (0: whole layers)."""
    return int(slice_mb * 2**20) // ALIGN * ALIGN if slice_mb else 0


def pack_pieces(sizes: Sequence[int], limit: int) -> list[list[tuple[int, int, int]]]:
    """A layer's trainable tensors (element counts, in order) in *pieces* of at most ``limit``
    elements (``PIECE_ALIGN`` multiples; sizes are rounded up to one): whole tensors packed in
    order while they fit, a tensor larger than ``limit`` alone in pieces of its own (cut at
    multiples of ``limit``). Per piece, its (tensor index, first element, end element).

    One rule for both NVMe tiers' sliced records: the gradient tier keeps each group of whole
    tensors (or one large tensor) as a record, the optimizer tier cuts its state at the same
    places, so a slice of masters and moments never needs more than one gradient record."""
    per = max(PIECE_ALIGN, limit // PIECE_ALIGN * PIECE_ALIGN)
    pieces: list[list[tuple[int, int, int]]] = []
    room = 0
    for i, size in enumerate(sizes):
        n = -(-size // PIECE_ALIGN) * PIECE_ALIGN
        if n > per:
            pieces += [[(i, a, min(a + per, n))] for a in range(0, n, per)]
            room = 0
        elif n <= room:
            pieces[-1].append((i, 0, n))
            room -= n
        else:
            pieces.append([(i, 0, n)])
            room = per - n
    return pieces


def default_stage(layer_params: Sequence[int], dtype_bytes: int, device_bytes: int = 0) -> int:
    """The weight bytes of a stage the host-RAM model assumes when the planner is not held to
    less (``stage_bytes``): four of the largest ordinary layers, at most half of the device's
    memory ``device_bytes`` when it is known, at least one layer (a stage never has fewer)."""
    layer = size_classes(layer_params).ordinary * dtype_bytes
    stage = 4 * layer
    if device_bytes:
        stage = min(stage, device_bytes // 2)
    return max(stage, layer)


@dataclass(frozen=True)
class HostRam:
    """Host bytes of a run, by part (``tier_host_ram``)."""

    parts: tuple[tuple[str, int], ...]  # (what, bytes) while training
    model: int  # the user's model in the compute dtype: held until initialize paged it
    runtime: int = RUNTIME_BYTES  # what the process holds at initialize besides the model
    file_pages: int = 0  # frozen weights read from their files' mappings: not counted

    @property
    def training(self) -> int:
        return sum(n for _, n in self.parts)

    @property
    def peak(self) -> int:
        """The larger of initialize's peak (runtime, the model, the optimizer tier's pool that
        the initial write fills) and the training total."""
        init = self.runtime + self.model + dict(self.parts).get("optimizer tier buffers", 0)
        return max(init, self.training)

    def lines(self) -> list[str]:
        out = [f"  {name:<38}{format_mib_gib(n)}" for name, n in self.parts if n]
        out.append(f"  {'training, in all':<38}{format_mib_gib(self.training)}")
        out.append(f"  {'peak (initialize holds your model)':<38}{format_mib_gib(self.peak)}")
        if self.file_pages:
            out.append(
                f"  (not counted: frozen weights read from their files, page cache, "
                f"{format_mib_gib(self.file_pages)})"
            )
        return out


def tier_host_ram(
    *,
    layer_params: Sequence[int],
    layer_trainable: Sequence[int],
    dtype_bytes: int,
    devices: int,
    optimizer_tier: bool,
    param_tier: bool,
    grad_buffers: int,
    optimizer_buffers: int = OPTIMIZER_BUFFERS,
    optimizer_slice: int = 0,
    layer_tensors: Sequence[Sequence[int]] | None = None,
    param_buffers: int = PARAM_BUFFERS,
    weight_copies: int = 2,
    shared_params: int = 0,
    device_bytes: int = 0,
    cpu_devices: bool = False,
    runtime_bytes: int = RUNTIME_BYTES,
    model_bytes: int | None = None,
    layer_files: Sequence[int] = (),
    stage_bytes: int = 0,
) -> HostRam:
    """The host RAM of a run over layers of ``layer_params`` parameters (``layer_trainable`` of
    them trainable) in a ``dtype_bytes`` compute dtype, on ``devices`` devices. Tiers as in the
    module docstring: ``grad_buffers`` 0 is the whole-model gradient arena (the default without
    the optimizer tier); ``shared_params``: parameters used by several layers (they stay in RAM
    with the parameter tier); ``device_bytes``: each device's memory budget (0: unknown);
    ``cpu_devices``: the devices are CPU virtual devices, whose memory is host memory;
    ``runtime_bytes``: what the process holds at initialize besides the model;
    ``optimizer_slice``: the optimizer tier's records are slices of at most that many bytes
    (0: whole layers), and the gradient tier's the same elements' gradients, in the pieces of
    ``pack_pieces`` over ``layer_tensors`` (per layer, its trainable tensors' elements; without
    it, whole layers are assumed for the gradients); ``model_bytes``: what the user's model
    holds in anonymous memory at initialize (None: every weight, in the compute dtype; a model
    served from its folder's file mapping holds less, model/folder.py).; ``layer_files``: per layer, how many of its ``layer_params`` are frozen weights
    served from their files (no anonymous memory, no record in the parameter tier; default
    none); ``stage_bytes``: the largest stage's weights, the planner held to it (0:
    ``default_stage``)."""
    files = list(layer_files) or [0] * len(layer_params)
    total = sum(layer_params)
    in_ram = total - sum(files)  # what is anonymous memory (or paged by the tier)
    trainable = sum(layer_trainable)
    stage = stage_bytes or default_stage(layer_params, dtype_bytes, device_bytes)
    runtime = ("runtime (Python, torch, DeepSpeed)", runtime_bytes + RUNTIME_GROWTH)
    parts: list[tuple[str, int]] = [runtime]
    if param_tier:
        paged = [p - f for p, f in zip(layer_params, files, strict=True)]
        records = size_classes([p * dtype_bytes for p in paged])
        # the pool grows to what one upload pins: a stage's paged weights (not its file ones)
        pinned = 4 * size_classes(paged).ordinary * dtype_bytes
        if device_bytes:
            pinned = min(pinned, device_bytes // 2)
        pool = max(records.pool_bytes(param_buffers), min(pinned, in_ram * dtype_bytes))
        parts.append(("compute weights (shared)", shared_params * dtype_bytes * weight_copies))
        parts.append(("parameter tier buffers", pool))
    else:
        parts.append(("compute weights", in_ram * dtype_bytes * weight_copies))
    if optimizer_tier:
        records = size_classes([12 * t for t in layer_trainable])
        pool = records.pool_bytes(optimizer_buffers)
        if optimizer_slice:
            largest = -(-max(12 * t for t in layer_trainable) // ALIGN) * ALIGN
            pool = max(2, optimizer_buffers) * min(optimizer_slice, largest)
        parts.append(("optimizer tier buffers", pool))
    else:
        parts.append(("fp32 masters + Adam moments", 12 * trainable))
    if grad_buffers:
        grads = [4 * t for t in layer_trainable]
        if optimizer_slice and layer_tensors is not None:
            grads = [
                4 * sum(-(-sizes[i] // PIECE_ALIGN) * PIECE_ALIGN for i, _, _ in piece)
                for sizes in layer_tensors
                for piece in pack_pieces(sizes, optimizer_slice // 12)
                if piece[0][1] == 0  # a tensor cut in pieces is one gradient record, whole
            ]
        parts.append(("gradient tier buffers", size_classes(grads).pool_bytes(grad_buffers)))
    else:
        parts.append(("fp32 gradients", 4 * trainable))
    parts.append(("download staging", devices * stage))
    if cpu_devices and device_bytes:
        parts.append(("CPU virtual devices", devices * device_bytes))
    model = in_ram * dtype_bytes if model_bytes is None else model_bytes
    return HostRam(tuple(parts), model, runtime_bytes, (total - in_ram) * dtype_bytes)


@dataclass(frozen=True)
class PoolCounts:
    """Buffers of the three tiers' pools: ``optimizer`` (offload_optimizer.buffer_count),
    ``grad`` (roundpipe.grad_buffers; 0: no gradient tier), ``param``
    (offload_param.buffer_count); ``optimizer_slice``: the optimizer tier's records are slices
    of at most that many bytes (roundpipe.optimizer_slice_mb; 0: whole layers)."""

    optimizer: int
    grad: int
    param: int
    optimizer_slice: int = 0
    stage: int = 0  # the largest stage's weight bytes the planner is held to (0: no bound)

    @staticmethod
    def fewest(devices: int, *, grad_tier: bool, slicing: bool = True) -> PoolCounts:
        """The fewest buffers each pool can make progress with: 2 per record pool (one pinned
        while another is read or written back), and for the gradient tier one per device's host
        thread, the optimizer's and one to spare (storage/build.py's ``grad_buffer_count``
        refuses fewer); the optimizer's records sliced to ``MIN_OPTIMIZER_SLICE`` where
        ``slicing`` may (not with delay compensation, which needs whole tensors)."""
        return PoolCounts(
            2, devices + 2 if grad_tier else 0, 2, MIN_OPTIMIZER_SLICE if slicing else 0
        )


def fit_pools(
    budget: int, wanted: PoolCounts, fewest: PoolCounts, need: Callable[[PoolCounts], HostRam],
    *, largest_record: int = 0, stage: int = 0,
) -> tuple[PoolCounts, HostRam]:  # fmt: skip
    """The pools a run of ``budget`` host bytes (its whole peak) gets: ``wanted`` when its
    ``need(...).peak`` fits, else, one step at a time, whichever of these gives back the most:
    a buffer less in one pool, or the optimizer tier's records sliced (from whole layers,
    ``largest_record`` bytes at most, halved each time down to ``fewest.optimizer_slice``),
    or the stages' weights held to less (from ``stage`` bytes, the model's default, halved
    down to ``fewest.stage``, one layer: the parameter tier's pool and each device's download
    staging follow it). Fewer or smaller buffers and stages cost speed (fewer reads ahead,
    more waits for write-backs, more I/O calls, more uploads), never a result: the tiers move
    the same bytes and Adam is elementwise. Returns
    the counts and their need; when even ``fewest`` does not fit, those (the caller refuses,
    naming ``need(fewest).peak`` as the least the run can work with)."""
    counts = wanted
    current = need(counts)
    while current.peak > budget:
        options = []
        for name in ("optimizer", "grad", "param"):
            if getattr(counts, name) > getattr(fewest, name):
                smaller = replace(counts, **{name: getattr(counts, name) - 1})
                options.append((need(smaller), smaller))
        sliced = _half_slice(counts.optimizer_slice or largest_record, fewest.optimizer_slice)
        if sliced and (not counts.optimizer_slice or sliced < counts.optimizer_slice):
            smaller = replace(counts, optimizer_slice=sliced)
            options.append((need(smaller), smaller))
        staged = _half_slice(counts.stage or stage, fewest.stage)
        if staged and (not counts.stage or staged < counts.stage):
            smaller = replace(counts, stage=staged)
            options.append((need(smaller), smaller))
        if not options:
            break
        current, counts = min(options, key=lambda option: option[0].peak)
    return counts, current


def _half_slice(current: int, smallest: int) -> int:
    """Half of ``current`` bytes (4 KiB multiples), not below ``smallest``; 0 when halving is
    not allowed (``smallest`` 0) or ``current`` is that small already."""
    if not smallest or current <= smallest:
        return 0
    return max(smallest, current // 2 // ALIGN * ALIGN)
