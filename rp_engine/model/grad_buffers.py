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
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch

__all__ = ["GradBuffers", "CONVERT_CHUNK", "converted_chunks"]

# Elements converted per scratch round trip: 1M fp32 = 4 MB stays in the last-level cache, so
# the converted chunk is read back from cache by the add, not from memory.
CONVERT_CHUNK = 1 << 20
# Each buffer starts on a 64-byte boundary (a cache line, one AVX-512 vector).
_ALIGN = 16
# Gradient dtypes that can land in the upper half of their fp32 buffer (``GradBuffers.landing``).
_HALF = (torch.bfloat16, torch.float16)


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
    """

    def __init__(
        self,
        masters: Sequence[torch.Tensor],
        *,
        alloc: Callable[[int], torch.Tensor] | None = None,
        chunk: int = CONVERT_CHUNK,
        copies: int = 1,
    ) -> None:
        if copies not in (1, 2):
            raise ValueError(f"copies={copies}: gradient buffers are single (1) or double (2)")
        offsets, total = [], 0
        for m in masters:
            offsets.append(total)
            total += -(-m.numel() // _ALIGN) * _ALIGN
        self.arenas = [self._allocate(alloc, total) for _ in range(copies)]  # (total,) fp32 each
        self._views = [
            [arena[o : o + m.numel()].view(m.shape) for o, m in zip(offsets, masters, strict=True)]
            for arena in self.arenas
        ]
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

    @property
    def arena(self) -> torch.Tensor:
        """The first arena (the only one unless double-buffered)."""
        return self.arenas[0]

    @property
    def copies(self) -> int:
        return len(self.arenas)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self.arenas)

    def buffer(self, i: int) -> torch.Tensor:
        """The fp32 buffer receiving parameter ``i``'s contributions (a fixed view into an arena;
        with two copies it alternates between two fixed addresses, step by step)."""
        return self._views[self._cur[i]][i]

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
        buf = self.buffer(i)
        if dtype == torch.float32:
            return buf
        if dtype in _HALF:
            n = buf.numel()
            return buf.view(-1).view(dtype)[n:].view(buf.shape)
        return None

    @torch.no_grad()
    def land(self, i: int, copy: int, dtype: torch.dtype) -> None:
        """A device copy into ``landing(i, dtype)`` of arena ``copy`` is complete: widen it in
        place (2-byte floats) and record it as that copy's first contribution."""
        if dtype != torch.float32:
            buf = self._views[copy][i].view(-1)
            _widen_upper_half(buf, buf.view(dtype)[buf.numel() :], self._local, self._chunk)
        self.mark(i, copy)

    @torch.no_grad()
    def write(self, i: int, grad: torch.Tensor) -> None:
        """Accumulate ``grad`` (any float dtype, the parameter's shape) into buffer ``i``."""
        buf = self.buffer(i)
        if grad.shape != buf.shape:
            raise ValueError(
                f"gradient of shape {tuple(grad.shape)} for a parameter of shape "
                f"{tuple(buf.shape)}: gradients must match their parameter"
            )
        if not self.has(i):
            buf.copy_(grad)  # converts on the fly: no temporary, no zeroing pass
        elif grad.dtype == torch.float32:
            buf.add_(grad)
        else:
            self._add_converted(buf.view(-1), grad.reshape(-1))
        self.mark(i)

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
        if self._has[k][i]:
            return self._views[k][i]
        if self._ever[i]:
            self._views[k][i].zero_()
            return self._views[k][i]
        return None

    def release(self, indices: Sequence[int]) -> None:
        """The optimizer has consumed the sealed step of ``indices`` (no memory is touched)."""
        for i in indices:
            if self._sealed[i]:
                self._has[self._sealed[i].popleft()][i] = False

    def clear(self, indices: Sequence[int] | None = None) -> None:
        """Forget every contribution, sealed or not (no memory is touched)."""
        for i in range(len(self)) if indices is None else indices:
            for has in self._has:
                has[i] = False
            self._sealed[i].clear()


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
