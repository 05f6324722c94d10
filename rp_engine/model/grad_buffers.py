"""fp32 gradient buffers: one preallocated arena per store (two when double-buffered), written
without temporaries.

Every trainable master's gradient is a fixed view into ONE flat fp32 tensor (the *arena*),
allocated once when the store is built (pinned when the pool is CUDA), so addresses never change
and no gradient-sized host memory is allocated per step. Double-buffered, a second arena of the
same layout takes step t+1's contributions while the optimizer reads step t's. Within a step:

- the first contribution to a parameter is a copy (``buf.copy_(grad)`` converts bf16/fp16 to
  fp32 on the fly): nothing has to be zeroed after the previous step. Or the device copies it
  straight into the buffer (``landing``/``land``: fp32 in place, bf16/fp16 into the buffer's
  upper half, then widened in place), with no host temporary at all;
- later contributions convert into a small per-thread scratch, chunk by chunk, then ``add_``:
  ``fp32.add_(bf16)`` would otherwise build a full fp32 temporary of the gradient (torch casts
  CPU inputs to the common dtype first), about 10x slower than converting into cached scratch;
- "has a contribution this step" is a flag per parameter. Discarding the step's gradients clears
  the flags (no memory pass); a parameter that had a gradient in an earlier step but none in this
  one is zero-filled only when the optimizer asks for it (``attach``), i.e. it steps with a zero
  gradient exactly as with a zeroed buffer.

The result of accumulating g_0, g_1, ... is bitwise ``g_0.float() + g_1.float() + ...`` (fp32 adds
in arrival order). Callers serialise writers per parameter (``HostStore`` holds the owner
layer's lock around ``write``).

**Pooled** (``groups``: the gradient tier, storage/grad_tier.py): no arena. The parameters of one
group (a layer) share a *record* per copy, which lives in a buffer of a bounded pool only while it
holds a gradient (``GradBlocks``: pinned around each read and write, spilled to a gradient file
when the pool runs out, read back when needed, forgotten once the optimizer consumed it). Two
copies always (the pool, not the copy count, bounds the memory). Every access pins the record
for its duration; ``landing`` pins it until ``land`` or ``unland`` and never waits (a copy
thread falls back to a staging buffer instead), and at most ``capacity - reserve`` landings hold
buffers at once, so a writer that waits for a buffer always finds one freed by a holder that
needs no lock it holds (``reserve``: the writer threads plus the optimizer's, ``use_blocks``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch

__all__ = ["GradBlocks", "GradBuffers", "CONVERT_CHUNK", "converted_chunks"]

# Elements converted per scratch round trip: 1M fp32 = 4 MB stays in the last-level cache, so
# the converted chunk is read back from cache by the add, not from memory.
CONVERT_CHUNK = 1 << 20
# Each buffer starts on a 64-byte boundary (a cache line, one AVX-512 vector).
_ALIGN = 16
# Gradient dtypes that can land in the upper half of their fp32 buffer (``GradBuffers.landing``).
_HALF = (torch.bfloat16, torch.float16)


class GradBlocks(Protocol):
    """Where pooled gradient records live (storage/grad_tier.py's GradTier): fp32 bytes of
    record (copy, group) while pinned."""

    def size_class(self, group: int) -> int: ...

    def capacity(self, size_class: int) -> int: ...

    def pin(self, copy: int, group: int, *, fresh: bool) -> torch.Tensor: ...

    def try_pin(self, copy: int, group: int, *, fresh: bool) -> torch.Tensor | None: ...

    def unpin(self, copy: int, group: int, *, dirty: bool) -> None: ...

    def discard(self, copy: int, group: int) -> None: ...

    def drop(self, copy: int, group: int) -> None: ...


class GradBuffers:
    """fp32 gradient buffers for ``masters`` (fp32 tensors), views into one arena per copy.

    ``alloc(n)`` returns a flat fp32 tensor of ``n`` elements (e.g. pinned memory); default
    ``torch.empty``. With ``copies=2`` (double buffering) each parameter alternates between two
    arenas: ``seal(i)`` ends the step's contributions and points new ones at the other arena,
    while the optimizer still reads the sealed one (``attach``) until it is released. So a
    download for step t+1 never waits for step t's optimizer. With one copy, ``seal`` changes
    nothing and the caller must not contribute again before ``release``.

    Per parameter: ``buffer(i)`` receives contributions, its contents are meaningful only while
    ``has(i)`` (a contribution landed in the current step).

    ``groups`` (per master, its group: the owner layer): pooled, see the module docstring; no
    arena is allocated, and nothing may be written before ``use_blocks``.
    """

    def __init__(
        self,
        masters: Sequence[torch.Tensor],
        *,
        alloc: Callable[[int], torch.Tensor] | None = None,
        chunk: int = CONVERT_CHUNK,
        copies: int = 1,
        groups: Sequence[int] | None = None,
    ) -> None:
        if copies not in (1, 2):
            raise ValueError(f"copies={copies}: gradient buffers are single (1) or double (2)")
        self._shapes = [m.shape for m in masters]
        self._numel = [m.numel() for m in masters]
        self.pooled = groups is not None
        self._blocks: GradBlocks | None = None
        if groups is not None:
            copies = 2
            self._layout(groups)
            self.arenas: list[torch.Tensor] = []
            self._views: list[list[torch.Tensor]] = []
            self._lock = threading.Lock()
            self._landing_pins: dict[tuple[int, int], int] = {}  # (copy, param) -> size class
            self._landings: dict[int, int] = {}  # size class -> landings holding a buffer
            self._attached: set[tuple[int, int]] = set()  # (copy, param) the optimizer reads
            self._reserve = 1
        else:
            offsets, total = [], 0
            for m in masters:
                offsets.append(total)
                total += -(-m.numel() // _ALIGN) * _ALIGN
            self.arenas = [self._allocate(alloc, total) for _ in range(copies)]  # (total,) fp32
            self._views = [
                [
                    arena[o : o + m.numel()].view(m.shape)
                    for o, m in zip(offsets, masters, strict=True)
                ]
                for arena in self.arenas
            ]
        self._copies = copies
        n = len(masters)
        self._has = [[False] * n for _ in range(copies)]  # [copy][param]: contributed this step
        self._ever = [False] * n  # contributed in some step
        self._cur = [0] * n  # the copy receiving contributions
        # per parameter, the sealed copies not yet released, oldest first: the optimizer reads
        # the oldest (with overlapping iterations step t+1 can seal before step t's optimizer
        # has read its copy)
        self._sealed: list[deque[int]] = [deque() for _ in range(n)]
        self._chunk = chunk
        self._local = threading.local()  # per-thread conversion scratch, made once per thread

    def _layout(self, groups: Sequence[int]) -> None:
        """Pooled: each parameter's group and its offset in the group's record."""
        self._group = list(groups)
        self._members: dict[int, list[int]] = {}
        self._offset: list[int] = []
        used: dict[int, int] = {}
        for i, g in enumerate(self._group):
            self._members.setdefault(g, []).append(i)
            self._offset.append(used.get(g, 0))
            used[g] = used.get(g, 0) + -(-self._numel[i] // _ALIGN) * _ALIGN
        self.group_elements = used  # group -> fp32 elements of its record

    def regroup(self, groups: Sequence[int]) -> None:
        """Pooled, before ``use_blocks``: records of other groups (per parameter, its group:
        pieces of a layer, the sliced NVMe tiers)."""
        if not self.pooled or self._blocks is not None or any(self._ever):
            raise RuntimeError("regroup: only pooled gradient buffers not in use yet")
        self._layout(groups)

    @staticmethod
    def _allocate(alloc: Callable[[int], torch.Tensor] | None, total: int) -> torch.Tensor:
        arena = alloc(total) if alloc is not None else torch.empty(total, dtype=torch.float32)
        if arena.dtype != torch.float32 or arena.numel() < total or not arena.is_contiguous():
            raise ValueError(
                f"gradient arena allocator returned {arena.dtype} x {arena.numel()} "
                f"(contiguous={arena.is_contiguous()}); it must return a contiguous float32 "
                f"tensor of at least {total} elements"
            )
        return arena

    def __len__(self) -> int:
        return len(self._ever)

    def use_blocks(self, blocks: GradBlocks, *, reserve: int) -> None:
        """Pooled: where the records live from now on. ``reserve``: buffers of each size class
        kept from landings, at least the threads that may wait for one while holding a lock a
        landing's holder needs (the hosts' writer threads and the optimizer's)."""
        if not self.pooled:
            raise RuntimeError("use_blocks on arena gradient buffers")
        self._blocks = blocks
        self._reserve = reserve

    @property
    def arena(self) -> torch.Tensor:
        """The first arena (the only one unless double-buffered)."""
        return self.arenas[0]

    @property
    def copies(self) -> int:
        return self._copies

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self.arenas)

    def buffer(self, i: int) -> torch.Tensor:
        """The fp32 buffer receiving parameter ``i``'s contributions (a fixed view into an arena;
        with two copies it alternates between two fixed addresses, step by step). Arena only:
        a pooled buffer exists only while pinned (``writing``, ``reading``)."""
        if self.pooled:
            raise RuntimeError(
                "pooled gradient buffers have no fixed address: use writing() or reading()"
            )
        return self._views[self._cur[i]][i]

    @contextmanager
    def writing(self, i: int) -> Iterator[tuple[torch.Tensor, bool]]:
        """``(buffer(i), first)`` for the block, which writes the current step's contribution
        (copy when ``first``, else add) and records it; pooled, the record is pinned meanwhile.
        The caller serialises writers of ``i`` (the owner's lock)."""
        first = not self.has(i)
        if not self.pooled:
            yield self._views[self._cur[i]][i], first
            self.mark(i)
            return
        c = self._cur[i]
        data = self._pin(c, i)
        try:
            yield self._view(data, i), first
            self.mark(i)
        finally:
            self._unpin(c, i, dirty=True)

    @contextmanager
    def reading(self, i: int) -> Iterator[torch.Tensor]:
        """The current step's buffer of ``i`` for the block, to read (pooled: pinned, read back
        from the gradient file when it was spilled). Meaningful only while ``has(i)``."""
        if not self.pooled:
            yield self._views[self._cur[i]][i]
            return
        c = self._cur[i]
        data = self._pin(c, i)
        try:
            yield self._view(data, i)
        finally:
            self._unpin(c, i, dirty=False)

    # --- pooled records -----------------------------------------------------------------------
    def _live(self, copy: int, i: int) -> bool:
        """Whether the record of ``i``'s group in ``copy`` holds a contribution of any member
        (else it is taken fresh: nothing read back)."""
        return any(self._has[copy][j] for j in self._members[self._group[i]])

    def _pin(self, copy: int, i: int) -> torch.Tensor:
        if self._blocks is None:
            raise RuntimeError("pooled gradient buffers used before use_blocks()")
        return self._blocks.pin(copy, self._group[i], fresh=not self._live(copy, i))

    def _unpin(self, copy: int, i: int, *, dirty: bool) -> None:
        assert self._blocks is not None
        self._blocks.unpin(copy, self._group[i], dirty=dirty)

    def _view(self, data: torch.Tensor, i: int) -> torch.Tensor:
        o = self._offset[i]
        return data[o : o + self._numel[i]].view(self._shapes[i])

    def _forget_if_consumed(self, copy: int, i: int) -> None:
        """Once no member of ``i``'s group holds a contribution in ``copy`` and the optimizer
        reads none of them, the record's bytes are dead: forget them (never written)."""
        assert self._blocks is not None
        g = self._group[i]
        members = self._members[g]
        if not self._live(copy, i) and not any((copy, j) in self._attached for j in members):
            self._blocks.discard(copy, g)

    def current(self, i: int) -> int:
        """The arena copy receiving parameter ``i``'s contributions (0 unless double-buffered)."""
        return self._cur[i]

    def has(self, i: int) -> bool:
        """Whether parameter ``i`` received a contribution in the current step."""
        return self._has[self._cur[i]][i]

    def mark(self, i: int, copy: int | None = None) -> None:
        """Record that a contribution was written into ``buffer(i)`` (or into arena ``copy``'s
        buffer of ``i``) by the caller."""
        self._has[self._cur[i] if copy is None else copy][i] = self._ever[i] = True

    def landing(self, i: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Where a device copy of a ``dtype`` gradient of parameter ``i`` can land in its current
        buffer, so that ``land`` makes it the step's first contribution with no temporary: the
        fp32 buffer itself for fp32; for a 2-byte float (bf16/fp16) the upper half of the
        buffer's bytes viewed as ``dtype`` (the parameter's shape), which ``land`` widens in
        place; None for any other dtype. The caller must know it is the first contribution."""
        if dtype != torch.float32 and dtype not in _HALF:
            return None
        if self.pooled:
            buf = self._pin_landing(i)
            if buf is None:
                return None
        else:
            buf = self.buffer(i)
        if dtype == torch.float32:
            return buf
        n = buf.numel()
        return buf.view(-1).view(dtype)[n:].view(buf.shape)

    def _pin_landing(self, i: int) -> torch.Tensor | None:
        """Pooled: pin ``i``'s current record for a landing when the class has room for one
        more landing and a buffer needs no wait; None otherwise (the copy uses staging)."""
        assert self._blocks is not None, "pooled gradient buffers used before use_blocks()"
        c, g = self._cur[i], self._group[i]
        k = self._blocks.size_class(g)
        with self._lock:
            if self._landings.get(k, 0) >= self._blocks.capacity(k) - self._reserve:
                return None
            self._landings[k] = self._landings.get(k, 0) + 1
        data = self._blocks.try_pin(c, g, fresh=not self._live(c, i))
        with self._lock:
            if data is None:
                self._landings[k] -= 1
                return None
            self._landing_pins[(c, i)] = k
        return self._view(data, i)

    def unland(self, i: int, copy: int) -> None:
        """A landing of ``i`` into ``copy`` will not land (its download failed): give back what
        ``landing`` took (pooled: the record's pin)."""
        if self.pooled and self._end_landing(copy, i):
            self._unpin(copy, i, dirty=False)

    def _end_landing(self, copy: int, i: int) -> bool:
        with self._lock:
            k = self._landing_pins.pop((copy, i), None)
            if k is None:
                return False
            self._landings[k] -= 1
            return True

    @torch.no_grad()
    def land(self, i: int, copy: int, dtype: torch.dtype) -> None:
        """A device copy into ``landing(i, dtype)`` of arena ``copy`` is complete: widen it in
        place (2-byte floats) and record it as that copy's first contribution."""
        if not self.pooled:
            if dtype != torch.float32:
                buf = self._views[copy][i].view(-1)
                _widen_upper_half(buf, buf.view(dtype)[buf.numel() :], self._local, self._chunk)
            self.mark(i, copy)
            return
        assert self._blocks is not None
        data = self._blocks.pin(copy, self._group[i], fresh=False)  # held by the landing: a hit
        try:
            if dtype != torch.float32:
                buf = self._view(data, i).view(-1)
                _widen_upper_half(buf, buf.view(dtype)[buf.numel() :], self._local, self._chunk)
            self.mark(i, copy)
        finally:
            self._unpin(copy, i, dirty=True)
            if self._end_landing(copy, i):
                self._unpin(copy, i, dirty=True)

    @torch.no_grad()
    def write(self, i: int, grad: torch.Tensor) -> None:
        """Accumulate ``grad`` (any float dtype, the parameter's shape) into buffer ``i``."""
        if grad.shape != self._shapes[i]:
            raise ValueError(
                f"gradient of shape {tuple(grad.shape)} for a parameter of shape "
                f"{tuple(self._shapes[i])}: gradients must match their parameter"
            )
        with self.writing(i) as (buf, first):
            if first:
                buf.copy_(grad)  # converts on the fly: no temporary, no zeroing pass
            elif grad.dtype == torch.float32:
                buf.add_(grad)
            else:
                self._add_converted(buf.view(-1), grad.reshape(-1))

    def _add_converted(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        for s, tmp in converted_chunks(src, self._local, self._chunk):
            dst[s : s + tmp.numel()].add_(tmp)

    def seal(self, i: int) -> None:
        """The current step's contributions to ``i`` are complete: the optimizer reads them
        (``attach``); later contributions go to the other copy, if there is one."""
        self._sealed[i].append(self._cur[i])
        if self.copies == 2:
            self._cur[i] ^= 1

    def attach(self, i: int) -> torch.Tensor | None:
        """The gradient the optimizer should use for parameter ``i``: the sealed step's.

        A contribution that step: the buffer. None that step but some earlier: the buffer,
        zero-filled now (a zero gradient, as with buffers zeroed after every step). Never: None
        (the parameter is not stepped, as torch optimizers skip ``grad is None``).
        """
        k = self._sealed[i][0] if self._sealed[i] else self._cur[i]
        if not self._has[k][i] and not self._ever[i]:
            return None
        if self.pooled:
            if (k, i) in self._attached:
                self._unpin(k, i, dirty=False)  # attached again (a retried step): one pin
            view = self._view(self._pin(k, i), i)
            self._attached.add((k, i))
        else:
            view = self._views[k][i]
        if not self._has[k][i]:
            view.zero_()
        return view

    def release(self, indices: Sequence[int]) -> None:
        """The optimizer has consumed the sealed step of ``indices`` (no memory is touched;
        pooled, the records it emptied are forgotten, never written)."""
        for i in indices:
            k = self._sealed[i].popleft() if self._sealed[i] else None
            if k is not None:
                self._has[k][i] = False
            if self.pooled:
                for c in range(self._copies):
                    if (c, i) in self._attached:
                        self._attached.discard((c, i))
                        self._unpin(c, i, dirty=False)
                if k is not None:
                    self._forget_if_consumed(k, i)

    def clear(self, indices: Sequence[int] | None = None) -> None:
        """Forget every contribution, sealed or not (no memory is touched; pooled, the records
        and every pin on them are dropped: a failed run's landings never settle)."""
        chosen = range(len(self)) if indices is None else indices
        for i in chosen:
            for has in self._has:
                has[i] = False
            self._sealed[i].clear()
        if self.pooled and self._blocks is not None:
            groups = {self._group[i] for i in chosen}
            with self._lock:
                for c, i in [key for key in self._landing_pins if self._group[key[1]] in groups]:
                    self._landings[self._landing_pins.pop((c, i))] -= 1
                self._attached = {a for a in self._attached if self._group[a[1]] not in groups}
            for g in groups:
                for c in range(self._copies):
                    self._blocks.drop(c, g)


def _widen_upper_half(
    buf: torch.Tensor, half: torch.Tensor, local: threading.local, chunk: int
) -> None:
    """``buf[k] = float(half[k])`` for the n fp32 elements of ``buf``, where ``half`` is the
    2-byte view of ``buf``'s upper half (bytes [2n, 4n)): bitwise ``buf.copy_(half)`` done
    without a second buffer. Chunks go low to high through the thread's scratch: writing
    ``buf[s:e]`` (bytes [4s, 4e)) never reaches an element of ``half`` not read yet (element
    j >= e sits at bytes >= 2n + 2e >= 4e, since e <= n), and chunk [s, e) itself was copied into
    the scratch first. (One ``buf.copy_(half)`` would read and write overlapping memory in an
    unspecified order.)"""
    for s, tmp in converted_chunks(half, local, chunk):
        buf[s : s + tmp.numel()].copy_(tmp)


def converted_chunks(
    src: torch.Tensor, local: threading.local, chunk: int = CONVERT_CHUNK
) -> Iterator[tuple[int, torch.Tensor]]:
    """The flat tensor ``src`` converted to fp32 ``chunk`` elements at a time into the calling
    thread's scratch (kept in ``local``: made once per thread, one chunk big; download threads
    live as long as their device). Yields (offset, fp32 view of that chunk); the view is
    overwritten by the next one."""
    scratch = getattr(local, "scratch", None)
    if scratch is None or scratch.numel() < chunk:
        scratch = local.scratch = torch.empty(chunk, dtype=torch.float32)
    n = src.numel()
    for s in range(0, n, chunk):
        tmp = scratch[: min(chunk, n - s)]
        tmp.copy_(src[s : s + tmp.numel()])
        yield s, tmp
