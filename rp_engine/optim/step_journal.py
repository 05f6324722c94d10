"""Undo log of the optimizer step in progress: a failed step is all-or-nothing.

The optimizer worker steps one layer at a time (optim/stepper.py), so an exception on layer k of
step t (a kernel error, a host allocation failure, a bug in a torch optimizer) would leave layers
stepped before k at w_t and the rest at w_{t-1}, with their Adam moments to match. Before a layer
steps, ``record`` copies its fp32 masters and optimizer state (Adam: ``exp_avg``, ``exp_avg_sq``,
the step count) into backup buffers; when the step has been applied and counted, ``commit`` forgets
them; when the step fails, ``rollback`` copies them back, so every layer is at w_{t-1} with its
moments of step t-1, bit for bit.

Cost: the backups are allocated once, on the first step, and reused: 12 B per trainable
parameter for Adam (fp32 master + two fp32 moments), on top of the store's 18-20 B, and one
extra read+write of those 12 B per step on the optimizer thread (Adam itself moves about 28 B
per parameter; measured 2-4x the host Adam step's time, benchmarks/RESULTS.md).
``journal_enabled`` turns it on by the ``roundpipe.step_journal`` knob: ``"if_memory_allows"``
(default), ``"on"``, ``"off"``. Without it a failed step still surfaces (naming the layer) but
cannot be undone: the engine refuses to train on until a checkpoint is loaded into a new engine.

One step is journaled at a time: the worker runs a step's layers before any layer of the next
step (one FIFO task queue), and the next step's first ``record`` drops records of a step that
was applied but not yet committed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, MutableMapping, Sequence
from typing import Any

import torch

__all__ = ["StepJournal", "build_journal", "journal_bytes", "journal_enabled"]

log = logging.getLogger("rp_engine.optim")

JOURNAL_MODES = ("if_memory_allows", "on", "off")
_MASTER = "\0master"  # the backup key of the master itself (state keys are identifiers)


class StepJournal:
    """Backups of the masters and optimizer state of the layers stepped in the open step.

    ``optimizer.state`` is the per-parameter state mapping (read at each call: torch's
    ``load_state_dict`` replaces it): the entries of a master are copied before it steps and
    restored on rollback (a master without state before the failed step loses it again).
    Called from the optimizer worker (``record``/``commit``) and, once the worker is idle, from
    the thread that recovers (``rollback``); never concurrently.
    """

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = optimizer
        self._step: int | None = None  # the step whose backups are held
        self._records: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}  # id(master) ->
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}  # reused between steps
        self.layers: set[int] = set()  # layers recorded in the held step

    @property
    def step(self) -> int | None:
        """The step whose layers are recorded (None: nothing to undo)."""
        return self._step

    @property
    def nbytes(self) -> int:
        """Host bytes held by the backup buffers (allocated on first use, then reused)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @torch.no_grad()
    def record(self, step: int, layer: int, masters: Sequence[torch.Tensor]) -> None:
        """Back up ``masters`` and their optimizer state before ``layer`` steps in ``step``."""
        if self._step != step:
            # The previous step committed (or was rolled back) before this one's first layer.
            self._records.clear()
            self.layers.clear()
            self._step = step
        self.layers.add(layer)
        for m in masters:
            if id(m) in self._records:
                continue
            saved: dict[str, Any] = {}
            for key, value in self._states().get(m, {}).items():
                saved[key] = self._backup((id(m), key), value)
            self._records[id(m)] = (m, saved)
            self._backup((id(m), _MASTER), m.data)

    def commit(self, step: int) -> None:
        """Every layer of ``step`` has stepped: nothing to undo any more (buffers are kept)."""
        if self._step == step:
            self._records.clear()
            self.layers.clear()
            self._step = None

    @torch.no_grad()
    def rollback(self, step: int) -> set[int]:
        """Put back every master and optimizer state recorded for ``step``; returns the layers
        restored (none if ``step`` recorded nothing: records of an earlier, applied step are
        dropped, never restored)."""
        if self._step != step:
            self.commit(self._step or 0)
            return set()
        states = self._states()
        for key, (master, saved) in self._records.items():
            master.data.copy_(self._buffers[(key, _MASTER)])
            state = states.get(master)
            if state is None or not saved:
                # stepped for the first time in the failed step: no state before it
                states.pop(master, None)
                continue
            for name in list(state):
                if name not in saved:
                    del state[name]
            for name, value in saved.items():
                if torch.is_tensor(value):
                    live = state.get(name)
                    if torch.is_tensor(live) and live.shape == value.shape:
                        live.copy_(value)  # in place: views the kernel was given stay valid
                    else:
                        state[name] = value.clone()
                else:
                    state[name] = value
        layers = set(self.layers)
        self._records.clear()
        self.layers.clear()
        self._step = None
        return layers

    def _states(self) -> MutableMapping[Any, dict[str, Any]]:
        states: MutableMapping[Any, dict[str, Any]] = self._optimizer.state
        return states

    def _backup(self, key: tuple[int, str], value: Any) -> Any:
        """A copy of ``value`` in a reusable buffer (tensors), or the value itself."""
        if not torch.is_tensor(value):
            return value
        buf = self._buffers.get(key)
        if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
            buf = torch.empty_like(value, memory_format=torch.contiguous_format)
            self._buffers[key] = buf
        buf.copy_(value)
        return buf


def journal_bytes(masters: Iterable[torch.Tensor], *, moments: int = 2) -> int:
    """Backup bytes of one step: each fp32 master plus ``moments`` same-sized state tensors."""
    return sum(m.numel() * m.element_size() for m in masters) * (1 + moments)


def journal_enabled(
    mode: str, nbytes: int, *, pending: int = 0, available: int | None = None
) -> bool:
    """Whether to keep a step journal of ``nbytes``: ``"on"``/``"off"`` as asked; ``"if_memory_allows"`` when
    host memory left after ``pending`` bytes still to be allocated (the optimizer moments, made
    on the first step) holds the journal three times over, so it never pushes the host towards
    the OOM killer (the double-buffered gradients rule in model/host_store.py is alike)."""
    if mode not in JOURNAL_MODES:
        raise ValueError(
            f"roundpipe.step_journal={mode!r}: expected one of {', '.join(JOURNAL_MODES)}"
        )
    if mode != "if_memory_allows":
        return mode == "on"
    if available is None:
        import psutil

        available = int(psutil.virtual_memory().available)
    fits = available - pending >= 3 * nbytes
    if not fits:
        log.warning(
            "step journal off: its %.1f MiB would leave too little host memory (%.1f MiB "
            "available, %.1f MiB still to be allocated); a failed optimizer step then cannot be "
            "undone (roundpipe.step_journal: \"on\" forces it)",
            nbytes / 2**20, available / 2**20, pending / 2**20,
        )  # fmt: skip
    return fits


def build_journal(mode: str, optimizer: Any) -> StepJournal | None:
    """A journal over ``optimizer`` (its ``param_groups`` hold the fp32 masters) if ``mode``
    and host memory allow (``journal_enabled``); the optimizer's moments, allocated on its first
    step, count as still to be allocated while its state is empty."""
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    nbytes = journal_bytes(masters)
    pending = 0 if len(optimizer.state) else nbytes * 2 // 3
    return StepJournal(optimizer) if journal_enabled(mode, nbytes, pending=pending) else None
