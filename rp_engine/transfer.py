"""Moving tensors between host and devices on the copy streams.

Three kinds of traffic, each on its own stream so none waits behind another::

    H2D_PARAM  |== w(stage k+1) chunk ==|== chunk ==|      |== w(stage k+2) ==|   low priority
    H2D_ACT        |= act m =|      |= act m+1 =|                                 high priority
    COMPUTE    |====== stage k ======|======= stage k+1 =======|
    D2H                              |= act/grad out =|

Weights are uploaded in chunks packed largest-first (LPT) into a bounded number of bytes each, so
a critical activation copy that shares the link waits at most one chunk. A tensor larger than a
chunk (a tied embedding of 622 MB) is first split into chunk-sized pieces of its flat storage,
each copied into a view of one device tensor by a copy of its own. An activation whose next
stage runs on the same device never leaves it. Everything that crosses a stage boundary is a
``dict[str, Tensor]`` ("state"); only "hidden" and "hidden.<name>" carry gradient, and a traced
model's plain Python values (ints, an output's structure) ride along uncopied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from rp_engine.device.base import ComputeTimer, Device, Event, StreamRole
from rp_engine.model.base import State

__all__ = [
    "State",
    "pack_largest_first",
    "split_pieces",
    "WeightUpload",
    "upload_weights",
    "upload_state",
    "download_state",
]


DEFAULT_CHUNK_BYTES = 64 << 20


def pack_largest_first(sizes: Sequence[int], chunk_bytes: int) -> list[list[int]]:
    """Pack item indices into chunks of at most ``chunk_bytes`` (an item larger than that gets a
    chunk of its own), largest items first: LPT bin filling, so big tensors never trail behind.

    Returns the chunks in upload order; every index appears exactly once.
    """
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    chunks: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for c, free in enumerate(room):
            if sizes[i] <= free:
                chunks[c].append(i)
                room[c] -= sizes[i]
                break
        else:
            chunks.append([i])
            room.append(max(chunk_bytes - sizes[i], 0))
    return chunks


def split_pieces(
    tensors: Sequence[torch.Tensor], chunk_bytes: int, *, dense: Sequence[bool] | None = None
) -> list[tuple[int, int, int]]:
    """The pieces uploads copy: ``(tensor index, first element, end element)``. A tensor of
    more than ``chunk_bytes`` is cut into pieces of ``chunk_bytes`` (the last one shorter) when
    it is contiguous (and ``dense[i]``, when given); any other tensor is one piece. The pieces
    of a tensor cover it exactly once, so the bytes copied are the tensors' bytes."""
    pieces = []
    for i, t in enumerate(tensors):
        n, size = t.numel(), t.element_size()
        step = max(chunk_bytes // size, 1)
        splittable = t.is_contiguous() and (dense is None or dense[i])
        if n * size <= chunk_bytes or not splittable:
            pieces.append((i, 0, n))
            continue
        pieces.extend((i, s, min(s + step, n)) for s in range(0, n, step))
    return pieces


class WeightUpload:
    """Device copies of a stage's weights, filled by closures on the H2D_PARAM stream.

    ``tensors`` maps ``id(host tensor)`` to its device copy; read it only after ``event``.
    """

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        self.params: dict[int, torch.nn.Parameter] = {}  # made on first use; hold .grad
        self.event: Event | None = None
        self.nbytes = 0
        self._grads: dict[int, torch.Tensor] = {}  # accumulated over the group's micro-batches

    def fold_grads(self, device: Device) -> None:
        """After each backward micro-batch: move ``.grad`` into the group's accumulator (counted
        against ``device``'s memory budget until the download frees it).

        fp32 gradients add up in place. Half-precision ones add up in fp32 from the second
        micro-batch on (exactly what an fp32 host accumulation of each micro-batch's gradient
        gives); a group of one micro-batch keeps its half gradient and downloads half the bytes.
        """
        for key, p in self.params.items():
            g = p.grad
            if g is None:
                continue
            p.grad = None
            acc = self._grads.get(key)
            if acc is None:
                self._grads[key] = g
                device.track(g)
            elif acc.dtype != torch.float32:
                device.free(acc, used_by=())  # allocated and last read on the compute stream
                self._grads[key] = acc.float().add_(g)
                device.track(self._grads[key])
            else:
                acc.add_(g)

    def grads(self) -> dict[int, torch.Tensor]:
        """Gradients accumulated on the device by the slot's micro-batches, by id(host param)."""
        return dict(self._grads)

    def take_grads(self) -> dict[int, torch.Tensor]:
        """``grads()``, handed over: the next micro-batches accumulate into new tensors (the
        weights may serve another run while the taker still holds these)."""
        grads, self._grads = self._grads, {}
        return grads

    def release(self, device: Device) -> None:
        """Drop the weights and the accumulated gradients (after their download)."""
        for t in self.tensors.values():
            device.free(t, used_by=(StreamRole.COMPUTE,))  # uploaded on H2D_PARAM, read there
        self.tensors = {}
        self.params = {}
        self._grads = {}


def upload_weights(
    device: Device,
    host_tensors: Sequence[torch.Tensor],
    *,
    sources: Sequence[torch.Tensor] | None = None,
    after: Iterable[Event] = (),
    before: Callable[[], None] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    label: str = "",
) -> WeightUpload:
    """Queue uploads of ``host_tensors`` on ``device``'s weight stream; returns the handle.

    ``after``: events the upload must wait for (e.g. memory freed by an earlier stage).
    ``before``: a host-side wait run on the copy thread first (the layer-version protocol).
    ``sources``: what to copy for each host tensor (same shapes; e.g. the second buffer of
    double-buffered compute weights); the device copies stay keyed by ``id(host_tensors[i])``.
    """
    stream = device.stream(StreamRole.H2D_PARAM)
    for ev in after:
        stream.wait(ev)
    handle = WeightUpload()
    reads = host_tensors if sources is None else sources
    if before is not None:
        stream.submit(before, label=label)
    handle.nbytes = sum(t.numel() * t.element_size() for t in host_tensors)
    # a piece of a split tensor is a view of the source's flat storage: it must be dense too
    dense = [r.is_contiguous() for r in reads]
    pieces = split_pieces(host_tensors, chunk_bytes, dense=dense)
    sizes = [(end - start) * host_tensors[i].element_size() for i, start, end in pieces]
    for chunk in pack_largest_first(sizes, chunk_bytes):

        def copy_chunk(chunk: list[int] = chunk) -> None:
            for p in chunk:
                _copy_piece(device, handle, host_tensors, reads, pieces[p])

        stream.submit(copy_chunk, label=label)
    handle.event = stream.record()
    return handle


def _copy_piece(
    device: Device,
    handle: WeightUpload,
    host_tensors: Sequence[torch.Tensor],
    reads: Sequence[torch.Tensor],
    piece: tuple[int, int, int],
) -> None:
    """Upload one piece (on the weight stream's thread): a whole tensor gets a device copy of
    its own; a split one is allocated whole by its first piece to run, which every piece then
    fills through a view (the pieces run in order on one thread)."""
    i, start, end = piece
    key, src = id(host_tensors[i]), reads[i].detach()
    if start == 0 and end == src.numel():
        handle.tensors[key] = device.to_device(src)
        return
    dst = handle.tensors.get(key)
    if dst is None:
        dst = handle.tensors[key] = device.empty(src.shape, src.dtype)
    device.to_device(src.view(-1)[start:end], out=dst.view(-1)[start:end])


Trace = Callable[[ComputeTimer], None]  # receives the timer of one transfer, once stopped


def upload_state(
    device: Device,
    get_state: Callable[[], State],
    put: Callable[[State], None],
    *,
    label: str = "",
    trace: Trace | None = None,
) -> Event:
    """Copy a host state to ``device`` on its activation stream (high priority), handing the
    device copy to ``put``. Queue any wait on the stream before calling this."""
    stream = device.stream(StreamRole.H2D_ACT)

    def run() -> None:
        timer = device.timer()
        put({k: device.to_device(v) if _is_tensor(v) else v for k, v in get_state().items()})
        _done(timer, trace)

    stream.submit(run, label=label)
    return stream.record()


def download_state(
    device: Device,
    get_state: Callable[[], State],
    put: Callable[[State], None],
    *,
    after: Event,
    label: str = "",
    trace: Trace | None = None,
) -> Event:
    """Copy a device state to the host on the activation download stream once ``after`` has
    completed (its own stream and thread: gradient downloads never delay it)."""
    stream = device.stream(StreamRole.D2H_ACT)
    stream.wait(after)

    def run() -> None:
        timer = device.timer()
        state = get_state()
        put({k: device.to_host(v) if _is_tensor(v) else v for k, v in state.items()})
        for v in state.values():  # the device copy is dropped once it is on the host
            if _is_tensor(v):
                device.free(v, used_by=(StreamRole.D2H_ACT,))
        _done(timer, trace)

    stream.submit(run, label=label)
    return stream.record()


def _done(timer: ComputeTimer, trace: Trace | None) -> None:
    timer.stop()
    if trace is not None:
        trace(timer)


def _is_tensor(value: object) -> bool:
    """States may carry plain Python values (a traced model's ints, an output's structure):
    they pass through every copy unchanged."""
    return isinstance(value, torch.Tensor)
