"""Host-resident model state: compute weights, fp32 master copies, gradient buffers, versions.

All model state lives here, in host memory; devices only ever hold copies for the duration of a
stage. Per layer (index in the LayerSequence order: prefix, blocks..., head) the store keeps:

- the layer's own host module parameters: the *compute weights* that uploads read (bf16/fp16/fp32,
  pinned when the pool is CUDA, except frozen weights served from their file's mapping, which
  stay there: model/folder.py);
- for every trainable parameter the layer *owns*, an fp32 *master* tensor and an fp32 gradient
  buffer, a fixed view into the store's one gradient arena (``grad_buffers.py``: preallocated,
  pinned on CUDA, first contribution of a step copied there by the device when it can, else
  from a downloaded temporary, later ones added, no zeroing pass: ``announce``). While
  a step's gradient is being consumed ``master.grad`` is that buffer; otherwise it is None. A
  parameter shared by several layers (tied embeddings) is owned by the lowest layer index that
  uses it: in a backward pass that layer finishes last, so its gradient is complete exactly when
  the owner's is;
- a published *version* with a condition variable: version v means "compute weights hold the
  result of optimizer step v" (0 = initial weights);
- optionally (``double_buffer_weights``) a second buffer of the compute weights it owns, so that
  two versions coexist: version v is published into buffer v % 2, an upload that must see
  version v reads buffer v % 2, and a publish waits for the uploads still reading the older
  version in its buffer (``note_read``). Overlapping iterations of the asynchronous optimizer
  need it: iteration t+1 reads w_{t-1} while iteration t still reads w_{t-2}. The module's
  parameters are buffer 0.

Bytes per trainable parameter on the host: compute weight (2 or 4) + master (4) + Adam m, v (8,
held by the optimizer) + gradient (4) = 18 B for bf16/fp16 models, 20 B for fp32 models; 4 B more
with double-buffered gradients (the default when host memory allows, ``double_buffer``), one
compute weight more (2 or 4 B) with double-buffered compute weights, and 12 B more with the
optimizer's step journal (optim/step_journal.py, likewise).

Below RAM (storage/): with the optimizer tier the masters and moments are paged (``pager``:
``resident`` around each step), with the parameter tier the compute weights of its layers
(``weight_pager``: ``page_in``/``page_out`` around each upload, every weight buffer on disk,
``publish`` writes through it); ``materialized`` brings both into RAM for whole-state readers.

The gradient side (the arena's buffers, announced and direct landings, the step's seal / attach
/ release, the squared norms) is ``HostGrads`` in host_grads.py, which the store builds and
delegates its gradient methods to; the records both sides share (``HostParam``, ``HostLayer``)
are in host_layers.py. This module is the weights side: residency, versions, publishing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from rp_engine.model.folder import FileMappings
from rp_engine.model.grad_buffers import GradBuffers
from rp_engine.model.host_grads import GradLanding, HostGrads
from rp_engine.model.host_layers import HostLayer, HostParam
from rp_engine.plan.host_ram import pack_pieces

if TYPE_CHECKING:
    from rp_engine.device.base import Event


class Pager(Protocol):
    """Where paged masters live between steps (storage/optimizer_tier.py's OptimizerTier)."""

    def resident(
        self, layer: int, *, dirty: bool = False
    ) -> contextlib.AbstractContextManager[Any]: ...

    def materialized(self, *, writable: bool) -> contextlib.AbstractContextManager[Any]: ...

    def prefetch(self, layers: Iterable[int]) -> None: ...

    def slice_count(self, layer: int) -> int: ...

    def resident_slice(self, layer: int, index: int) -> contextlib.AbstractContextManager[Any]: ...


__all__ = ["GradLanding", "HostParam", "HostLayer", "HostStore", "Pager", "placeholder"]


class HostStore:
    """Host state of a layer sequence. Thread-safe version protocol; no device knowledge.

    ``pin`` (e.g. the CUDA backend's pinning helper) is applied once to what the copy engines
    read, the compute weights and the layers' buffers, so uploads can be asynchronous; CPU
    virtual devices pass ``None`` (pinning needs a GPU). ``alloc(n)`` allocates the flat fp32
    gradient arena of ``n`` elements, which the copy engines write (direct landings,
    ``announce``): the CUDA backend's ``pinned_empty``, uninitialised, since no buffer is read
    before a contribution overwrote it (``GradBuffers``). Without ``alloc`` the arena is
    ``pin(torch.zeros(n))`` (defined contents, a transient plain copy) or plain memory.
    ``double_buffer``: a second gradient arena, so step t+1's gradients land while the optimizer
    still reads step t's (+4 B per trainable parameter); None decides by free host memory
    (the second arena must leave at least three times its size available). ``trainable``
    False: a forward-only engine's store (``initialize`` without an optimizer), which steps
    nothing, so no parameter gets a master or a gradient buffer: the compute weights alone.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        *,
        pin: Callable[[torch.Tensor], torch.Tensor] | None = None,
        alloc: Callable[[int], torch.Tensor] | None = None,
        double_buffer: bool | None = None,
        paged_masters: bool = False,
        trainable: bool = True,
        grad_pool: bool = False,
    ) -> None:
        self.layers: list[HostLayer] = []
        make_master = _paged_master if paged_masters else _make_master
        self._owner: dict[int, HostParam] = {}
        for index, module in enumerate(modules):
            params: list[Any] = _unique(module.named_parameters(remove_duplicate=False))
            buffers = list(_unique(module.named_buffers(remove_duplicate=False)))
            layer = HostLayer(index, module, list(params), buffers)
            for name, p in layer.params:
                if trainable and p.requires_grad and id(p) not in self._owner:
                    hp = HostParam(name, p, make_master(p), index)
                    self._owner[id(p)] = hp
                    layer.owned.append(hp)
            self.layers.append(layer)
        owned = self.owned_params()
        for slot, hp in enumerate(owned):
            hp.slot = slot
        if alloc is None and pin is not None:
            alloc = _pinned_by(pin)
        masters = [hp.master for hp in owned]
        if grad_pool:  # records of a bounded pool (storage/grad_tier.py: ``use_grad_blocks``)
            self.grads = GradBuffers(masters, groups=[hp.layer for hp in owned])
        else:
            if double_buffer is None:
                double_buffer = _second_arena_fits(sum(m.numel() for m in masters) * 4)
            self.grads = GradBuffers(masters, alloc=alloc, copies=2 if double_buffer else 1)
        if pin is not None:  # in place (``.data``): the modules and uploads keep the objects
            mapped = FileMappings.read()
            for layer in self.layers:
                for _, t in [*layer.params, *layer.buffers]:
                    # a frozen weight served from its file's mapping (model/folder.py) stays
                    # there: pinning would copy it whole into locked anonymous memory; its
                    # uploads copy from pageable memory instead
                    if mapped.path_of(t) is None:
                        t.data = pin(t.data)  # a shared one is pinned once (pin returns it)
        self.gradients = HostGrads(self.layers, self._owner, self.grads)
        self._pin = pin
        self._shadow: dict[int, torch.Tensor] = {}  # id(param) -> its compute weight, buffer 1
        self._held = [[0] for _ in self.layers]  # per layer: the version each buffer holds
        # per layer and buffer: whether it holds a predicted version (``publish``'s ``predict``)
        self._predicted = [[False] for _ in self.layers]
        # per layer: (buffer, version, event) of uploads that read it, until a publish waits
        self._reads: list[list[tuple[int, int, Event]]] = [[] for _ in self.layers]
        self._cond = threading.Condition()
        self._failure: BaseException | None = None
        # where paged masters live between steps (storage/optimizer_tier.py); None: in RAM
        self.pager: Pager | None = None
        # where paged compute weights live (storage/param_tier.py's ParamTier); None: in RAM
        self.weight_pager: Any = None

    def param_users(self) -> dict[int, int]:
        """``id(parameter)`` -> how many layers use it (more than one: a tied weight)."""
        users: dict[int, int] = {}
        for layer in self.layers:
            for _, p in layer.params:
                users[id(p)] = users.get(id(p), 0) + 1
        return users

    def group_bytes(self) -> list[int]:
        """Per gradient record, its fp32 bytes (pooled gradients: what the gradient tier lays
        out): one per layer owning parameters (0 for one owning none), or after
        ``slice_grads`` one per piece of a layer."""
        elements = getattr(self.grads, "group_elements", {})
        return [4 * elements.get(g, 0) for g in range(max(elements, default=-1) + 1)]

    def slice_grads(self, limit: int) -> None:
        """Pooled gradients in records of at most ``limit`` elements where a parameter allows
        (``pack_pieces``: whole parameters packed; a larger one alone, whole), so the gradient
        pool's buffers no longer follow the layers' width. Before ``use_grad_blocks``."""
        groups: list[int] = []
        for layer in self.layers:
            base = max(groups, default=-1) + 1
            for k, piece in enumerate(
                pack_pieces([hp.master.numel() for hp in layer.owned], limit)
            ):
                for _i, a, _b in piece:
                    if a == 0:
                        groups.append(base + k)  # a parameter cut in pieces: its first one's
        self.grads.regroup(groups)

    def use_grad_blocks(self, blocks: Any, *, reserve: int) -> None:
        """Pooled gradients (``grad_pool``): their records live in ``blocks`` (the gradient
        tier) from now on; ``reserve``: see ``GradBuffers.use_blocks``."""
        self.grads.use_blocks(blocks, reserve=reserve)

    # --- residency of the masters (paged to NVMe by the optimizer tier) -----------------------
    def resident(
        self, layer: int, *, dirty: bool = False
    ) -> contextlib.AbstractContextManager[Any]:
        """The layer's masters (and optimizer moments) hold their values for the block; with
        ``dirty`` the block changes them. Always true in RAM; the NVMe tier reads and writes."""
        return self.pager.resident(layer, dirty=dirty) if self.pager else contextlib.nullcontext()

    def slice_count(self, layer: int) -> int:
        """How many slices the optimizer steps ``layer``'s masters and moments in, each inside
        ``resident_slice`` (a sliced NVMe tier: the layer's state is larger than the tier's
        records); 0 when they are held whole (``resident``)."""
        return self.pager.slice_count(layer) if self.pager else 0

    def resident_slice(self, layer: int, index: int) -> contextlib.AbstractContextManager[Any]:
        """Slice ``index`` of the layer's masters and moments for the block, as
        ``StateSegment`` views (optim/optimizer.py) the block steps in place."""
        assert self.pager is not None
        return self.pager.resident_slice(layer, index)

    @contextmanager
    def reading(self, layer: int) -> Iterator[None]:
        """The layer's masters, optimizer moments and compute weights hold their values for the
        block, to be read (a streamed checkpoint save). Always true in RAM; the NVMe tiers read
        the layer's records into their buffer pools. No optimizer step may run."""
        with contextlib.ExitStack() as stack:
            if self.pager is not None:
                stack.enter_context(self.pager.resident(layer))
            if self.weight_pager is not None:
                stack.enter_context(self.weight_pager.reading(layer))
            yield

    def paged_layer(self, param: torch.Tensor) -> int | None:
        """The layer whose NVMe record holds ``param``'s compute weights (read them inside
        ``reading(layer)``); None when they are in RAM."""
        return None if self.weight_pager is None else self.weight_pager.layer_of(param)

    def materialized(self, *, writable: bool) -> contextlib.AbstractContextManager[Any]:
        """Every master and moment, and every compute weight, holds its values for the block
        (checkpoint save/load, state_dict); ``writable``: what the block leaves in them is
        kept. No optimizer step may run."""
        return self._materialized(writable)

    @contextmanager
    def _materialized(self, writable: bool) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for pager in (self.pager, self.weight_pager):
                if pager is not None:
                    stack.enter_context(pager.materialized(writable=writable))
            yield

    def prefetch(self, layers: Iterable[int]) -> None:
        """Hint: the optimizer steps ``layers`` next, in this order (the tier starts reading)."""
        if self.pager is not None:
            self.pager.prefetch(layers)

    # --- lookup -------------------------------------------------------------------------------
    def master_of(self, param: nn.Parameter) -> torch.Tensor:
        """The fp32 master of a trainable parameter (KeyError if frozen or unknown)."""
        return self._owner[id(param)].master

    def owned_params(self) -> list[HostParam]:
        return [hp for layer in self.layers for hp in layer.owned]

    def trainable_of(self, layer: int) -> list[nn.Parameter]:
        """Trainable parameters the layer uses (including shared ones it does not own): those
        with a master (none in a forward-only store)."""
        return [p for _, p in self.layers[layer].params if id(p) in self._owner]

    def owner_layer(self, param: nn.Parameter) -> int:
        """The layer whose optimizer step consumes this parameter's gradient (tied weights: the
        lowest layer using it)."""
        return self._owner[id(param)].layer

    # --- gradients: HostGrads (host_grads.py) holds them; the store's methods delegate -------
    def accumulate(
        self, param: nn.Parameter, grad: torch.Tensor, *, landing: GradLanding | None = None
    ) -> bool:
        """``HostGrads.accumulate``: add a downloaded gradient into the owner's fp32 buffer."""
        return self.gradients.accumulate(param, grad, landing=landing)

    def announce(self, param: nn.Parameter, grad: torch.Tensor, *, free: bool) -> GradLanding:
        """``HostGrads.announce``: announce one contribution before its download is issued."""
        return self.gradients.announce(param, grad, free=free)

    def fenced(self, landings: Iterable[GradLanding], fence: Event) -> None:
        """``HostGrads.fenced``: the copies into these direct landings were issued."""
        self.gradients.fenced(landings, fence)

    def land(self, landing: GradLanding) -> None:
        """``HostGrads.land``: the copy into a direct landing is complete."""
        self.gradients.land(landing)

    def withdraw(self, landings: Iterable[GradLanding]) -> None:
        """``HostGrads.withdraw``: these announced contributions will not land."""
        self.gradients.withdraw(landings)

    def grad_buffer(self, param: nn.Parameter) -> torch.Tensor:
        """``HostGrads.grad_buffer``: the fp32 buffer of the parameter's current-step gradient."""
        return self.gradients.grad_buffer(param)

    def grad_slot(
        self, param: nn.Parameter
    ) -> contextlib.AbstractContextManager[tuple[torch.Tensor, bool]]:
        """``HostGrads.grad_slot``: write a contribution yourself, ``(buffer, first)``."""
        return self.gradients.grad_slot(param)

    @property
    def double_buffered(self) -> bool:
        return self.gradients.double_buffered

    def has_grad(self, param: nn.Parameter) -> bool:
        """``HostGrads.has_grad``: whether the parameter received a contribution this step."""
        return self.gradients.has_grad(param)

    def seal_grads(self, layer: int) -> None:
        """``HostGrads.seal_grads``: the layer's gradients for the current step are complete."""
        self.gradients.seal_grads(layer)

    def attach_grads(self, layers: Iterable[int] | None = None) -> None:
        """``HostGrads.attach_grads``: set ``master.grad`` for the optimizer."""
        self.gradients.attach_grads(layers)

    def release_grads(self, layers: Iterable[int]) -> None:
        """``HostGrads.release_grads``: the optimizer consumed the sealed step of ``layers``."""
        self.gradients.release_grads(layers)

    def attach_param_grads(self, owned: Iterable[HostParam]) -> None:
        """``HostGrads.attach_param_grads``: ``attach_grads`` for these parameters only."""
        self.gradients.attach_param_grads(owned)

    def release_param_grads(self, layer: int, owned: Sequence[HostParam]) -> None:
        """``HostGrads.release_param_grads``: ``release_grads`` for these parameters only."""
        self.gradients.release_param_grads(layer, owned)

    def zero_grads(self, layers: Iterable[int] | None = None) -> None:
        """``HostGrads.zero_grads``: discard every gradient of ``layers`` (all by default)."""
        self.gradients.zero_grads(layers)

    def note_sq_norm(self, layer: int, step: int, sq_norm: float) -> None:
        """``HostGrads.note_sq_norm``: record a device-computed squared gradient norm."""
        self.gradients.note_sq_norm(layer, step, sq_norm)

    def take_sq_norm(self, layer: int, step: int) -> float | None:
        """``HostGrads.take_sq_norm``: the noted squared norm of step ``step``, or None."""
        return self.gradients.take_sq_norm(layer, step)

    def grad_sq_norm(self, layer: int) -> float:
        """``HostGrads.grad_sq_norm``: the squared norm read from the layer's fp32 buffers."""
        return self.gradients.grad_sq_norm(layer)

    # --- versions -----------------------------------------------------------------------------
    @property
    def weight_copies(self) -> int:
        """Buffers of compute weights: 2 with ``double_buffer_weights``, else 1."""
        return len(self._held[0])

    def double_buffer_weights(self, enable: bool | None = None, *, allocate: bool = True) -> bool:
        """Give every owned compute weight a second buffer (see the module docstring); None
        decides by free host memory, as for the gradients (the second buffer must leave at least
        three times its size available). Returns whether the weights are double-buffered. Call
        it while no run is in flight. ``allocate=False``: the RAM copies wait for
        ``allocate_shadows`` (the parameter tier holds the paged layers' second buffer on disk;
        only the others get one in RAM)."""
        if self.weight_copies == 2:
            return True
        if self.weight_pager is not None:
            raise RuntimeError("decide the weight buffers before the parameter tier is built")
        owned = self.owned_params()
        nbytes = sum(hp.param.numel() * hp.param.element_size() for hp in owned)
        if enable is None:
            enable = _second_arena_fits(nbytes)
        if not enable:
            return False
        with self._cond:
            self._held = [[max(h), max(h)] for h in self._held]
            self._predicted = [[False, False] for _ in self._held]
        if allocate:
            self.allocate_shadows()
        return True

    def allocate_shadows(self) -> None:
        """Double-buffered: a second RAM buffer for each owned compute weight that has none and
        does not live in the parameter tier (``page_weights``)."""
        if self.weight_copies != 2:
            return
        pager = self.weight_pager
        for hp in self.owned_params():
            if id(hp.param) in self._shadow:
                continue
            if pager is not None and id(hp.param) in pager.views_of(hp.layer):
                continue
            copy = hp.param.detach().clone()
            self._shadow[id(hp.param)] = self._pin(copy) if self._pin is not None else copy

    def page_weights(self, pager: Any) -> None:
        """From now on the compute weights of ``pager``'s layers live in it (storage/
        param_tier.py's ParamTier, which holds every weight buffer): their RAM copies go."""
        self.weight_pager = pager
        for layer in self.layers:
            paged = pager.views_of(layer.index)
            for hp in layer.owned:
                if id(hp.param) in paged:
                    self._shadow.pop(id(hp.param), None)

    def _buffer_of(self, version: int) -> int:
        return version % self.weight_copies

    def version(self, layer: int) -> int:
        """The newest version the layer's compute weights hold (in either buffer)."""
        with self._cond:
            return max(self._held[layer])

    def versioned_layers(self, layers: Iterable[int]) -> list[int]:
        """``layers`` and the owners of the shared weights they use: the layers whose versions
        an upload of ``layers`` must wait for (a tied weight is published by its owner)."""
        out = set(layers)
        for layer in list(out):
            out.update(self.owner_layer(p) for p in self.trainable_of(layer))
        return sorted(out)

    def weight_sources(self, tensors: Sequence[torch.Tensor], version: int) -> list[torch.Tensor]:
        """What an upload that must see ``version`` copies for each of the layer tensors
        ``tensors`` (parameters and buffers): the buffer holding that version."""
        if self._buffer_of(version) == 0:
            return list(tensors)
        return [self._shadow.get(id(t), t) for t in tensors]

    def page_in(
        self, key: object, layers: Sequence[int], version: int, tensors: Sequence[torch.Tensor],
        sources: list[torch.Tensor], leases: list[Any],
    ) -> None:  # fmt: skip
        """On the upload's copy thread, before it copies: with compute weights on NVMe
        (``weight_pager``), pin ``layers``' weights of ``version``'s buffer, point the matching
        entries of ``sources`` (from ``weight_sources(tensors, version)``) at them, and add the
        lease to ``leases`` (``page_out`` releases it)."""
        if self.weight_pager is None:
            return
        lease = self.weight_pager.acquire(key, layers, version)
        if lease is not None:
            leases.append(lease)
            for i, t in enumerate(tensors):
                view = lease.views.get(id(t))
                if view is not None:
                    sources[i] = view

    def page_out(self, leases: list[Any], done: Event) -> None:
        """When the upload is issued: what ``page_in`` adds to ``leases`` (later, before
        ``done``) is released once ``done`` completes, the copies' end."""
        if self.weight_pager is not None:
            self.weight_pager.release_after(leases, done)

    def queue_page_in(self, key: object, layers: Sequence[int], version: int) -> None:
        """A plan READ: ``page_in(key, ...)`` follows; start reading (non-blocking)."""
        if self.weight_pager is not None:
            self.weight_pager.queue_reads(key, layers, version)

    def nvme_reads(self, run: object) -> list[tuple[Any, float, float]]:
        """The parameter tier's reads for the uploads of run ``run`` (``page_in``'s key
        ``(run, action)``): ``(action, start, end)``, perf_counter seconds; [] without it."""
        if self.weight_pager is None:
            return []
        return list(self.weight_pager.take_reads(run))

    def note_read(self, layers: Iterable[int], version: int, done: Event) -> None:
        """An upload issued now reads ``version``'s buffer of ``layers`` until ``done``: a later
        publish of a newer version into that buffer waits for it (never a newer reader)."""
        b = self._buffer_of(version)
        with self._cond:
            for layer in layers:
                self._reads[layer].append((b, version, done))

    def wait_version(self, layer: int, version: int) -> None:
        """Block until the buffer of ``version`` holds step ``version`` or newer for ``layer``.

        Raises instead of waiting forever once the optimizer has failed (``fail``).
        """
        b = self._buffer_of(version)
        with self._cond:
            while self._held[layer][b] < version:
                if self._failure is not None:
                    raise RuntimeError(
                        f"layer {layer} will not reach weights version {version}: the optimizer "
                        f"failed ({self._failure!r})"
                    ) from self._failure
                self._cond.wait()

    def fail(self, error: BaseException | None) -> None:
        """Record (or, with None, clear) an optimizer failure and wake every version waiter."""
        with self._cond:
            self._failure = error
            self._cond.notify_all()

    def publish(
        self,
        layer: int,
        version: int,
        *,
        everywhere: bool = False,
        predict: Callable[[HostParam, torch.Tensor], bool] | None = None,
    ) -> None:
        """Copy the layer's masters into the compute weights of ``version``'s buffer (every
        buffer with ``everywhere``: a drain) and mark them as ``version``.

        ``predict(hp, dst)``: write a prediction from ``hp.master`` into ``dst`` instead of the
        copy (the weight prediction of ``roundpipe.staleness_compensation``: optim/stepper.py)
        and return True, or return False to have the master copied; called inside
        ``resident(layer)``, in the same one pass over the layer. The buffer is then marked
        *predicted*: a later publish of the same version without ``predict`` (a drain) still
        overwrites it with the true masters, so drains, checkpoints and ``engine.module`` see
        the masters.

        Waits first for the uploads still reading an older version from that buffer. Monotonic:
        publishing an older version, or an equal one the buffer already holds (predicted or
        not; true masters replace a prediction), is a no-op, so a drain (which publishes
        everything) followed by the usual staleness-1 publish is harmless.
        """
        copies = len(self._held[layer])
        plain = predict is None
        for b in range(copies) if everywhere else [self._buffer_of(version)]:
            if not self._claim(layer, b, version, plain=plain):
                continue
            with self._cond:
                twin = [
                    o for o in range(copies)
                    if o != b and plain and self._held[layer][o] == version
                    and not self._predicted[layer][o]
                ]  # fmt: skip
            with torch.no_grad(), self._weights(layer, b, overwrite=True) as dst:
                if twin:  # the same cast of the same masters: copy it, never touch the masters
                    with self._weights(layer, twin[0], overwrite=False) as src:
                        for hp in self.layers[layer].owned:
                            dst(hp).copy_(src(hp))
                else:
                    with self.resident(layer):
                        for hp in self.layers[layer].owned:
                            out = dst(hp)
                            if predict is None or not predict(hp, out):
                                out.copy_(hp.master)
            self._mark(layer, b, version, predicted=not plain)

    @contextmanager
    def publishing(
        self, layer: int, version: int, *, predicted: bool, keep: bool = False
    ) -> Iterator[Callable[[HostParam], torch.Tensor] | None]:
        """``publish`` with the caller writing: yields ``hp -> compute weight`` of ``version``'s
        buffer for the caller to fill with every owned param's new value (the stepper writes
        each Adam slice as it is stepped, optim/optimizer.py ``step_params``), or None when the
        publish is a no-op (the buffer already holds ``version``, or a newer one). The buffer is
        marked as ``version`` (*predicted* with ``predicted``) when the block ends without an
        exception; after one it holds no version at all (-1: it may be half written), which the
        undo of the failed step rewinds (``rewind``). Waits first, as ``publish`` does, for
        uploads still reading an older version from the buffer. Call it inside
        ``resident(layer)``. ``keep``: the caller reads the buffer's old values before writing
        (delay compensation, optim/delay_compensation.py): a paged buffer is read in first."""
        b = self._buffer_of(version)
        if not self._claim(layer, b, version, plain=not predicted):
            yield None
            return
        try:
            with torch.no_grad(), self._weights(layer, b, overwrite=True, keep=keep) as dst:
                yield dst
        except BaseException:
            with self._cond:
                self._held[layer][b] = -1
            raise
        self._mark(layer, b, version, predicted=predicted)

    def _claim(self, layer: int, buffer: int, version: int, *, plain: bool) -> bool:
        """Whether publishing ``version`` into ``buffer`` writes anything (see ``publish``: not
        an older version or an equal one it holds, unless true masters replace a prediction);
        if so, first wait for the uploads still reading an older version from the buffer."""
        with self._cond:
            held = self._held[layer][buffer]
            if held > version or (
                held == version and not (plain and self._predicted[layer][buffer])
            ):
                return False
            reads = self._reads[layer]
            readers = [ev for bb, v, ev in reads if bb == buffer and v < version]
            self._reads[layer] = [r for r in reads if not (r[0] == buffer and r[1] < version)]
        for event in readers:
            with contextlib.suppress(Exception):  # a failed upload reads nothing more
                event.synchronize()
        return True

    def _mark(self, layer: int, buffer: int, version: int, *, predicted: bool) -> None:
        """``buffer`` of ``layer`` now holds ``version`` (a prediction of it with ``predicted``):
        wake the uploads waiting for it."""
        with self._cond:
            self._held[layer][buffer] = max(self._held[layer][buffer], version)
            self._predicted[layer][buffer] = predicted
            self._cond.notify_all()

    def predicted(self, layer: int) -> list[bool]:
        """Per weight buffer of ``layer``: whether it holds a prediction (``publish``'s
        ``predict``) rather than the masters' own values."""
        with self._cond:
            return list(self._predicted[layer])

    def _weight(self, hp: HostParam, buffer: int) -> torch.Tensor:
        return hp.param.data if buffer == 0 else self._shadow[id(hp.param)]

    @contextmanager
    def _weights(
        self, layer: int, buffer: int, *, overwrite: bool, keep: bool = False
    ) -> Iterator[Callable[[HostParam], torch.Tensor]]:
        """The layer's compute weights in ``buffer`` for the block, as ``HostParam -> tensor``;
        paged ones (``weight_pager``) are views of the tier's buffer, written back after the
        block when ``overwrite`` (read in first unless only overwritten: ``keep`` False)."""
        pager = self.weight_pager
        if pager is None or not pager.paged(layer):
            yield lambda hp: self._weight(hp, buffer)
            return
        with pager.buffer(layer, buffer, overwrite=overwrite, keep=keep) as views:
            yield (
                lambda hp: (
                    views[id(hp.param)] if id(hp.param) in views else self._weight(hp, buffer)
                )
            )

    def rewind(self, layer: int, version: int) -> None:
        """Copy the layer's masters into every compute-weight buffer and mark them as
        ``version``, which may be older than the current one: the undo of a failed optimizer
        step that had already been published (optim/step_journal.py). Only while nothing
        reads the layer."""
        with self._cond:
            self._held[layer] = [-1] * len(self._held[layer])
            self._predicted[layer] = [False] * len(self._held[layer])
            self._reads[layer] = []
        self.publish(layer, version, everywhere=True)

    def set_versions(self, version: int) -> None:
        """Declare every layer at ``version`` in every buffer (after loading a checkpoint or a
        drain; the second buffer is refreshed from the module's weights)."""
        self._refresh_shadow()
        with self._cond:
            self._held = [[version] * len(h) for h in self._held]
            self._predicted = [[False] * len(h) for h in self._held]
            self._reads = [[] for _ in self.layers]
            self._cond.notify_all()

    def _refresh_shadow(self) -> None:
        with torch.no_grad():
            if self.weight_pager is not None and self.weight_copies == 2:
                for layer in range(len(self.layers)):
                    if self.weight_pager.paged(layer):
                        with self._weights(layer, 0, overwrite=False) as src:
                            with self._weights(layer, 1, overwrite=True) as dst:
                                for hp in self.layers[layer].owned:
                                    dst(hp).copy_(src(hp))
            for hp in self.owned_params():
                shadow = self._shadow.get(id(hp.param))
                if shadow is not None:
                    shadow.copy_(hp.param.data)

    def reload_masters(self) -> None:
        """Refresh masters from the compute weights (after the user edited module weights)."""
        with torch.no_grad(), self.materialized(writable=True):
            for hp in self.owned_params():
                hp.master.copy_(hp.param.data)
        self._refresh_shadow()


def _second_arena_fits(nbytes: int) -> bool:
    import psutil

    return psutil.virtual_memory().available >= 4 * nbytes


def _pinned_by(pin: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[int], torch.Tensor]:
    def alloc(n: int) -> torch.Tensor:
        # pin copies its argument: zeros, never uninitialised memory (callers that can allocate
        # pinned memory directly pass ``alloc`` and skip the copy)
        return pin(torch.zeros(n, dtype=torch.float32))

    return alloc


def placeholder(shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A CPU tensor of ``shape`` and ``dtype`` that owns no memory (storage of size 0): where
    the NVMe tiers' state lives between uses, so a stray read fails instead of reading stale
    numbers."""
    t = torch.empty(tuple(shape), dtype=dtype)
    t.untyped_storage().resize_(0)
    return t


def _paged_master(p: nn.Parameter) -> torch.Tensor:
    """A master without memory (shape only): the NVMe tier fills it while a step needs it."""
    return placeholder(p.shape)


def _make_master(p: nn.Parameter) -> torch.Tensor:
    master = p.detach().to(device="cpu", dtype=torch.float32, copy=True)
    return master


def _unique(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Drop repeated objects within one module, keeping the first name (tied inside a layer)."""
    seen: set[int] = set()
    out = []
    for name, t in named:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out
