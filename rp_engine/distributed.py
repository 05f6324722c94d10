"""Data parallel across processes (one per node) over torch.distributed.

Each process drives its local devices exactly as a single-process engine does; the processes
form one data-parallel group. Per optimizer step::

    backward, every rank     layer_ready(l) -> [reduce thread] reduce(grad_l -> owner(l)) ...
    close_step               all_reduce(partial ||g||^2, skip flag): the GLOBAL norm, one scalar
    optimizer, owner(l)      step layer l (only its owner holds Adam state for it)
    [weights thread]         broadcast(master_l from owner(l)) -> every rank finishes layer l:
                             publish / version protocol exactly as in one process

Design: **layer ownership** (each layer's optimizer state lives on one rank, chosen to balance
parameter counts), not a flat ZeRO shard. Why: the runtime's unit of work, of readiness and of
the version protocol is the layer; with whole layers a rank steps complete tensors with the
existing per-layer kernel, the reduce of layer l is exactly "its gradient is complete", and
"layer l has step t" means one broadcast landed. A flat shard would cut tensors across ranks and
need per-fragment bookkeeping for the same result. Host memory that falls with the number of
ranks: the Adam moments (8 B per parameter) and the optimizer compute; masters, gradient
buffers and compute weights stay whole on every rank (they feed the local devices).

Ordering: torch.distributed collectives must be issued in the same order on every rank, but
``layer_ready`` is called by several device host threads in whatever order gradients land. So
each kind of traffic has its own gloo group and its own thread that issues it in a fixed order:
gradients in backward order (last layer first, then the norm scalar), weights in the order the
steps are issued (identical on every rank). A third group serves the main thread (loss mean,
checkpoint gathers). Host tensors travel over gloo whatever the default backend (NCCL moves
device memory only).

Errors: a collective that fails or times out (``init_distributed(timeout=...)``) raises a
``DistributedError`` naming this rank, the peer it waited for and the layer.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from rp_engine.model.host_store import HostStore

__all__ = [
    "DataParallel",
    "DistributedError",
    "init_distributed",
    "data_parallel",
    "dp_world",
    "balance_layers",
]

log = logging.getLogger("rp_engine.distributed")

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
_timeout = DEFAULT_TIMEOUT  # of the process group made by init_distributed; the DP groups use it


class DistributedError(RuntimeError):
    """A data-parallel collective failed or timed out; the message names the ranks and layer."""


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """``deepspeed.init_distributed``: make the default process group once (idempotent).

    Reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT as set by ``torchrun`` or the
    ``deepspeed`` launcher; missing ones mean a single process (rank 0 of 1 on
    ``127.0.0.1:distributed_port``; MPI discovery is not attempted). Backend: NCCL when CUDA is
    available, else gloo. ``dist_init_required=False`` asserts a group already exists. The
    ``timeout`` also bounds every data-parallel collective of the engine.
    """
    global _timeout
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"timeout={timeout!r}: expected a datetime.timedelta")
    if dist.is_initialized():
        return  # a group made by the user or an earlier call: keep it (DeepSpeed does too)
    if dist_init_required is False:
        raise RuntimeError(
            "dist_init_required=False but no torch.distributed process group exists: call "
            "rp_engine.init_distributed() (or torch.distributed.init_process_group) first"
        )
    _timeout = timeout
    if rank < 0 and world_size < 0 and init_method is None:
        defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
        defaults |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(distributed_port)}
        for key, value in defaults.items():
            os.environ.setdefault(key, value)
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if verbose and int(os.environ.get("RANK", "0")) == 0:
        log.info("initializing torch.distributed (%s) on %s", backend, socket.gethostname())
    dist.init_process_group(
        backend, init_method=init_method, timeout=timeout, rank=rank, world_size=world_size
    )


def dp_world() -> int:
    """The data-parallel world size: the process group's size, else ``WORLD_SIZE`` (1)."""
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def balance_layers(sizes: Sequence[int], world: int) -> list[int]:
    """Owner rank of each layer: largest layers first, each to the least loaded rank (ties: the
    lower rank). Deterministic, so every rank computes the same table."""
    load = [0] * world
    owners = [0] * len(sizes)
    for layer in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[layer] = rank
        load[rank] += sizes[layer]
    return owners


def data_parallel(store: HostStore) -> DataParallel | None:
    """The engine's data-parallel peer for ``store``, or None in a single process."""
    if dp_world() <= 1:
        return None
    init_distributed()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if local > 1 and torch.cuda.is_available():
        log.warning(
            "LOCAL_WORLD_SIZE=%d: several rp_engine processes on one node each drive the GPUs "
            "of roundpipe.devices (default: all of them); launch one process per node "
            "(--nproc_per_node 1 / deepspeed --num_gpus 1) unless each process names its own",
            local,
        )
    return DataParallel(store)


class DataParallel:
    """Gradient reduction, sharded optimizer ownership and weight broadcast for one HostStore.

    The stepper drives it: ``reduce(layer, then)`` when a layer's local gradient is complete,
    ``finish_reduce(...)`` at ``close_step`` (the global norm), ``broadcast(layer, ...)`` for every
    issued layer step. ``start(on_error)`` launches the two threads; ``close()`` stops them.
    """

    def __init__(self, store: HostStore) -> None:
        self.store = store
        self.rank = int(dist.get_rank())
        self.world = int(dist.get_world_size())
        sizes = [sum(hp.master.numel() for hp in layer.owned) for layer in store.layers]
        self.owners = balance_layers(sizes, self.world)
        self._has_params = [bool(s) for s in sizes]
        # new_group is collective: every rank creates the three groups in this order.
        self._grads = dist.new_group(backend="gloo", timeout=_timeout)
        self._weights = dist.new_group(backend="gloo", timeout=_timeout)
        self._main = dist.new_group(backend="gloo", timeout=_timeout)
        self._cond = threading.Condition()
        self._pending: dict[int, Callable[[], None]] = {}
        self._submitted: set[int] = set()
        self._scalar: tuple[Callable[[], float], bool] | None = None
        self._total: tuple[float, bool] | None = None
        self._bcast: list[tuple[int, threading.Event | None, Callable[[], None]] | None] = []
        self._error: BaseException | None = None
        self._stopped = False
        self._on_error: Callable[[BaseException], None] = lambda exc: None
        self._failed: Callable[[], bool] = lambda: False
        self._threads: list[threading.Thread] = []

    # --- identity ----------------------------------------------------------------------------
    def owns(self, layer: int) -> bool:
        """Whether this rank steps ``layer`` (holds its optimizer state)."""
        return self.owners[layer] == self.rank

    def layout(self) -> dict[str, Any]:
        """The shard layout recorded in checkpoints."""
        return {"scheme": "layer_owner", "dp_world_size": self.world, "owners": list(self.owners)}

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self, on_error: Callable[[BaseException], None], failed: Callable[[], bool]) -> None:
        """Launch the threads. ``on_error`` hears of a failed collective; ``failed()`` says the
        optimizer has failed (a step that will never finish is not waited for)."""
        self._on_error = on_error
        self._failed = failed
        for name, target in (("rp-dp-grads", self._grad_loop), ("rp-dp-weights", self._bcast_loop)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self) -> None:
        """Stop both threads (idempotent); collectives in flight finish or time out first."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
        self._threads = []

    def abandon(self) -> None:
        """A run failed part-way: the ranks are no longer in step. Later calls raise."""
        self._fail(
            DistributedError(
                f"rank {self.rank}: a failed run left the data-parallel ranks out of step; "
                "restart every rank from the last checkpoint"
            )
        )

    # --- gradients ---------------------------------------------------------------------------
    def reduce(self, layer: int, then: Callable[[], None]) -> None:
        """The layer's local gradient is complete: reduce it onto its owner (in backward order,
        on the gradient thread), then run ``then`` there (the stepper's per-layer bookkeeping)."""
        with self._cond:
            self._raise()
            self._submitted.add(layer)
            self._pending[layer] = then
            self._cond.notify_all()

    def finish_reduce(
        self, then_for: Callable[[int], Callable[[], None]], partial_sq: Callable[[], float],
        skip: bool,
    ) -> tuple[float, bool]:  # fmt: skip
        """Close a step's reduction: submit the layers that saw no gradient, wait for every
        layer's reduction, then sum ``partial_sq()`` (this rank's owned layers) and OR ``skip``
        over the ranks. Returns (global squared norm, any rank skipped)."""
        with self._cond:
            self._raise()
            for layer in range(len(self.owners)):
                if layer not in self._submitted:
                    self._submitted.add(layer)
                    self._pending[layer] = then_for(layer)
            self._cond.notify_all()
            # the gradient thread takes the scalar after every layer of the step (then the
            # partial norm includes them all)
            self._scalar = (partial_sq, skip)
            while self._total is None:
                self._raise()
                self._cond.wait(timeout=0.1)
            total, self._total = self._total, None
            self._submitted = set()
        return total

    def _grad_loop(self) -> None:
        try:
            while True:
                for layer in range(len(self.owners) - 1, -1, -1):
                    then = self._take(partial(self._pending.pop, layer, None))
                    if then is None:
                        return
                    if self._has_params[layer]:
                        self._reduce_layer(layer)
                    then()
                scalar = self._take(lambda: self._scalar)
                if scalar is None:
                    return
                with self._cond:
                    self._scalar = None
                total = self._sum_norm(*scalar)
                with self._cond:
                    self._total = total
                    self._cond.notify_all()
        except BaseException as exc:
            self._fail(exc)

    def _sum_norm(self, partial: Callable[[], float], skip: bool) -> tuple[float, bool]:
        value = torch.tensor([partial(), 1.0 if skip else 0.0], dtype=torch.float64)
        self._call(
            "all_reduce of the gradient norm", None,
            lambda: dist.all_reduce(value, group=self._grads),
        )  # fmt: skip
        return float(value[0]), bool(value[1] > 0)

    def _take(self, pop: Callable[[], Any]) -> Any:
        with self._cond:
            while True:
                if self._error is not None:
                    return None
                item = pop()  # queued work still runs after close(): a last step finishes
                if item is not None or self._stopped:
                    return item
                self._cond.wait(timeout=0.1)

    def _reduce_layer(self, layer: int) -> None:
        """Sum the layer's fp32 gradients onto its owner, divided by the world size (DeepSpeed
        averages over data-parallel ranks). A parameter without a contribution on some rank
        counts as zero there; one without a contribution anywhere stays without a gradient."""
        owned = self.store.layers[layer].owned
        grads = self.store.grads
        sizes = [hp.master.numel() for hp in owned]
        flat = torch.zeros(sum(sizes) + len(owned), dtype=torch.float32)
        offset = 0
        for k, (hp, n) in enumerate(zip(owned, sizes, strict=True)):
            if grads.has(hp.slot):
                flat[offset : offset + n].copy_(grads.buffer(hp.slot).view(-1))
                flat[sum(sizes) + k] = 1.0
            offset += n
        owner = self.owners[layer]
        self._call(
            f"reduce of layer {layer}'s gradients onto rank {owner}", layer,
            lambda: dist.reduce(flat, dst=owner, group=self._grads),
        )  # fmt: skip
        if owner != self.rank:
            return
        flat[: sum(sizes)].div_(self.world)
        offset = 0
        for k, (hp, n) in enumerate(zip(owned, sizes, strict=True)):
            if flat[sum(sizes) + k] > 0:
                with self.store.grad_slot(hp.param) as (buf, _first):
                    buf.view(-1).copy_(flat[offset : offset + n])
            offset += n

    # --- weights -----------------------------------------------------------------------------
    def broadcast(
        self, layer: int, stepped: threading.Event | None, done: Callable[[], None]
    ) -> None:
        """Queue the broadcast of ``layer``'s masters from its owner, once ``stepped`` is set
        (owner: its optimizer step of the layer finished); then ``done`` runs on every rank."""
        with self._cond:
            self._raise()
            self._bcast.append((layer, stepped, done))
            self._cond.notify_all()

    def _bcast_loop(self) -> None:
        try:
            while True:
                item = self._take(lambda: self._bcast.pop(0) if self._bcast else None)
                if item is None:
                    return
                layer, stepped, done = item
                owner = self.owners[layer]
                if owner == self.rank and stepped is not None:
                    while not stepped.wait(timeout=0.1):
                        if self._error is not None or self._failed() or self._stopped:
                            return
                if self._has_params[layer]:
                    self._broadcast_layer(layer, owner)
                done()
        except BaseException as exc:
            self._fail(exc)

    def _broadcast_layer(self, layer: int, owner: int) -> None:
        masters = [hp.master for hp in self.store.layers[layer].owned]
        if owner == self.rank:
            flat = torch.cat([m.view(-1) for m in masters])
        else:
            flat = torch.empty(sum(m.numel() for m in masters), dtype=torch.float32)
        self._call(
            f"broadcast of layer {layer}'s weights from rank {owner}", layer,
            lambda: dist.broadcast(flat, src=owner, group=self._weights),
        )  # fmt: skip
        if owner != self.rank:
            offset = 0
            with torch.no_grad():
                for m in masters:
                    m.view(-1).copy_(flat[offset : offset + m.numel()])
                    offset += m.numel()

    # --- main thread -------------------------------------------------------------------------
    def mean(self, value: float) -> float:
        """Mean of ``value`` over the ranks (the loss ``train_batch`` returns, as DeepSpeed's
        pipeline engine)."""
        t = torch.tensor([value], dtype=torch.float64)
        self._call("all_reduce(loss)", None, lambda: dist.all_reduce(t, group=self._main))
        return float(t[0]) / self.world

    def all_ok(self, ok: bool, what: str) -> None:
        """Raise on every rank if ``ok`` is False on any (e.g. rank 0 failed to write)."""
        t = torch.tensor([0.0 if ok else 1.0])
        self._call(f"all_reduce({what} status)", None, lambda: dist.all_reduce(t, group=self._main))
        if t[0] > 0 and ok:
            raise DistributedError(f"rank {self.rank}: {what} failed on another rank")

    def gather_state(self, optimizer: Any) -> bool:
        """Copy every layer's optimizer state onto rank 0 (for a checkpoint, which rank 0 writes
        in the one-process layout). Returns whether this rank writes."""
        inner = optimizer.optimizer
        owned = self.store.owned_params()
        mine = {i: inner.state[hp.master] for i, hp in enumerate(owned) if hp.master in inner.state}
        mine = {i: s for i, s in mine.items() if self.owns(owned[i].layer)}
        gathered: list[Any] = [None] * self.world if self.rank == 0 else []
        self._call(
            "gather of optimizer state onto rank 0", None,
            lambda: dist.gather_object(mine, gathered if self.rank == 0 else None, dst=0,
                                       group=self._main),
        )  # fmt: skip
        if self.rank == 0:
            for part in gathered:
                for i, state in part.items():
                    inner.state[owned[i].master] = state
        return self.rank == 0

    def drop_foreign_state(self, optimizer: Any) -> None:
        """Forget the optimizer state of layers another rank owns (after a checkpoint save or a
        load of a checkpoint written at any world size): only the owned shard stays in memory."""
        inner = optimizer.optimizer
        for hp in self.store.owned_params():
            if not self.owns(hp.layer):
                inner.state.pop(hp.master, None)

    # --- internals ---------------------------------------------------------------------------
    def _call(self, what: str, layer: int | None, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:
            raise DistributedError(
                f"rank {self.rank} of {self.world}: {what} failed (timeout "
                f"{_timeout.total_seconds():g} s; a peer rank stopped, crashed or is out of step"
                f"): {exc}"
            ) from exc

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()
        self._on_error(exc)
