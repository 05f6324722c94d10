"""Compute cost through the executor's own path.

``executor_costs`` times each layer the way a compute action runs it (runtime/executor.py),
on one CPU virtual device with the intra-op threads a device of the pool gets, with the
runtime's own objects: the model's ``LayerSequence`` modules (the ``HFPrefix``, the
``HFDecoderBlock`` wrapper with its state dict, the ``CausalLMHead``), weights copied by the
device (``to_device``) into a ``WeightUpload``, a ``Replica`` loaded with them per action
(``Replica.load``), the stage call, the recompute and backward from a real upstream gradient,
``WeightUpload.fold_grads``, ``Replica.release``. Each part is timed on its own (``parts_ms``,
per micro-batch summed over the layers), so a difference from the plain layer timing
(``calibration.layer_costs``) can be traced to one of them. The prefix (embedding, rotary,
masks) has no cost slot of its own: it rides with forward slot 0 and the last backward slot, as
does layer 0, so its times are added to layer 0's.

Times are CPU time (the process's, divided by the intra-op threads): what an action costs when
it has its cores. On a shared machine the wall time of the same work depends on what else runs
at that moment; the simulator charges that separately, from the share of the cores other
processes left the run (``host_load.CoreShare``, ``Machine.host_share``), so the cost must not
hold it.

``compute_cpu_spans`` records the same bodies' CPU time inside a running engine; the head-to-head
calibration rescales the isolated costs to it, per kind of slot (forward / backward / head).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rp_engine.plan.partition import LayerCosts

__all__ = ["ExecutorTiming", "executor_costs", "compute_cpu_spans", "PARTS"]

# the parts of a compute action, as timed (ms per micro-batch, summed over the layers)
PARTS = (
    "load",  # Replica.load: the device tensors into the replica's module slots
    "call",  # the forward call of a forward action (no autograd), through the layer wrapper
    "recompute",  # the backward action's forward call with autograd
    "backward",  # autograd from the upstream gradient (the head: its fused forward+backward)
    "fold",  # WeightUpload.fold_grads: .grad into the group's accumulator
    "release",  # Replica.release
    "prefix",  # the prefix's forward, recompute and backward (embedding, rotary, masks)
    "head",  # the head's forward (no autograd) and fused forward + loss + backward
)


@dataclass(frozen=True)
class ExecutorTiming:
    """Per-layer costs through the executor's path (bytes as the base costs) and its parts."""

    costs: LayerCosts
    parts_ms: dict[str, float]


def executor_costs(
    model: Any, base: LayerCosts, mbs: int, seq: int, *, threads: int, reps: int = 5
) -> ExecutorTiming:
    """``base`` (``calibration.layer_costs`` of ``model``: its byte sizes are kept) with every
    time taken through the executor's path (module docstring). Per layer: ``fwd_ms`` = load +
    call + release; ``recompute_ms`` = load + recompute; ``bwd_ms`` = backward + fold +
    release; the head's forward and fused backward likewise; the prefix's onto layer 0."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        return _executor_costs(model, base, mbs, seq, reps, max(1, threads))
    finally:
        torch.set_num_threads(saved)


def _executor_costs(
    model: Any, base: LayerCosts, mbs: int, seq: int, reps: int, threads: int
) -> ExecutorTiming:
    import torch

    from rp_engine.device.cpu import CPUPool
    from rp_engine.model.layers import to_layers

    layers = list(to_layers(model).modules())
    prefix, blocks, head = layers[0], layers[1:-1], layers[-1]
    if len(blocks) != base.num_layers:
        raise ValueError(f"the model has {len(blocks)} blocks, the base costs {base.num_layers}")
    ids = torch.randint(0, model.config.vocab_size, (mbs, seq))
    batch = {"input_ids": ids, "labels": ids.clone()}
    with CPUPool(1) as pool:
        path = _Path(pool[0], reps, threads)
        with torch.no_grad():
            state = prefix(dict(batch))
        pre = path.prefix(prefix, batch, state["hidden"])
        fwd, redo, bwd = [], [], []
        for block in blocks:
            t = path.block(block, state)
            fwd.append(t["load"] + t["call"] + t["release"])
            redo.append(t["load"] + t["recompute"])
            bwd.append(t["backward"] + t["fold"] + t["release2"])
            with torch.no_grad():
                state = block(state)
        h = path.head(head, state)
    fwd[0] += pre["fwd"]
    redo[0] += pre["fwd_grad"]
    bwd[0] += pre["bwd"]
    parts = {k: sum(t[k] for t in path.seen) for k in PARTS[:6]}
    parts["prefix"] = pre["fwd"] + pre["fwd_grad"] + pre["bwd"]
    parts["head"] = h["fwd"] + h["fused"]
    costs = dataclasses.replace(
        base,
        fwd_ms=tuple(fwd),
        recompute_ms=tuple(redo),
        bwd_ms=tuple(bwd),
        head_fwd_ms=h["load"] + h["fwd"] + h["release"],
        head_bwd_ms=max(h["fused"] - h["fwd"], 0.0) + h["fold"],
    )
    return ExecutorTiming(costs, parts)


class _Path:
    """The executor's compute path for one layer at a time, each part timed (median ms)."""

    def __init__(self, device: Any, reps: int, threads: int) -> None:
        self.device, self.reps = device, reps
        self.seen: list[dict[str, float]] = []  # per block, for the parts' totals
        # CPU time of the process (the pool's threads idle meanwhile), per intra-op thread
        self.clock: Callable[[], float] = lambda: time.process_time() / threads

    def _upload(self, module: Any) -> Any:
        from rp_engine.transfer import WeightUpload

        w = WeightUpload()  # as upload_weights fills it: keyed by id(host tensor)
        for t in [*module.parameters(), *module.buffers()]:
            w.tensors[id(t)] = self.device.to_device(t.detach())
        return w

    def _median(self, run: Callable[[dict[str, list[float]]], None]) -> dict[str, float]:
        times: dict[str, list[float]] = {}
        run({})  # warm-up (allocator, kernels; the accumulator exists from here on)
        for _ in range(self.reps):
            run(times)
        return {k: statistics.median(v) for k, v in times.items()}

    def block(self, block: Any, state: dict[str, Any]) -> dict[str, float]:
        import torch

        from rp_engine.runtime.replica import Replica

        replica, weights = Replica(block), self._upload(block)
        grad = torch.ones_like(state["hidden"])  # a real (contiguous) upstream gradient
        clock = self.clock

        def run(out: dict[str, list[float]]) -> None:
            t0 = clock()
            replica.load(weights.tensors, training=True, params=weights.params)
            t1 = clock()
            with torch.no_grad():
                replica.module(state)
            t2 = clock()
            replica.release()
            t3 = clock()
            replica.load(weights.tensors, training=True, params=weights.params)
            x = _with_grad_input(state)
            t4 = clock()
            with torch.enable_grad():
                y = replica.module(x)
                t5 = clock()
                torch.autograd.backward(y["hidden"], grad)
            t6 = clock()
            weights.fold_grads(self.device)
            t7 = clock()
            replica.release()
            t8 = clock()
            _note(out, load=t1 - t0, call=t2 - t1, release=t3 - t2, recompute=t5 - t4,
                  backward=t6 - t5, fold=t7 - t6, release2=t8 - t7)  # fmt: skip

        t = self._median(run)
        # a forward and a backward action each load and release the replica
        self.seen.append({**t, "load": 2 * t["load"], "release": t["release"] + t["release2"]})
        weights.release(self.device)
        return t

    def prefix(self, prefix: Any, batch: dict[str, Any], hidden: Any) -> dict[str, float]:
        """The prefix's forward (forward slot 0), its recompute with autograd and backward
        (the last backward slot: the embedding's gradient)."""
        import torch

        grad = torch.ones_like(hidden)
        clock = self.clock

        def run(out: dict[str, list[float]]) -> None:
            t0 = clock()
            with torch.no_grad():
                prefix(dict(batch))
            t1 = clock()
            with torch.enable_grad():
                y = prefix(dict(batch))
                t2 = clock()
                torch.autograd.backward(y["hidden"], grad)
            t3 = clock()
            prefix.zero_grad(set_to_none=True)
            _note(out, fwd=t1 - t0, fwd_grad=t2 - t1, bwd=t3 - t2)

        return self._median(run)

    def head(self, head: Any, state: dict[str, Any]) -> dict[str, float]:
        """The HEAD action's head part: the fused forward + loss + backward (and, for the split
        into forward and backward, the forward alone), with its load, fold and release."""
        import torch

        from rp_engine.runtime.replica import Replica

        replica, weights = Replica(head), self._upload(head)
        clock = self.clock
        x = {**state, "hidden": state["hidden"].detach()}

        def run(out: dict[str, list[float]]) -> None:
            t0 = clock()
            replica.load(weights.tensors, training=True, params=weights.params)
            t1 = clock()
            with torch.no_grad():
                replica.module(x)
            t2 = clock()
            replica.module.forward_backward(x)
            t3 = clock()
            weights.fold_grads(self.device)
            t4 = clock()
            replica.release()
            t5 = clock()
            _note(out, load=t1 - t0, fwd=t2 - t1, fused=t3 - t2, fold=t4 - t3, release=t5 - t4)

        t = self._median(run)
        weights.release(self.device)
        return t


def _note(out: dict[str, list[float]], **seconds: float) -> None:
    """Append each part's time of one repetition, in ms, to ``out`` (a warm-up passes {})."""
    for key, s in seconds.items():
        out.setdefault(key, []).append(s * 1e3)


def _with_grad_input(state: dict[str, Any]) -> dict[str, Any]:
    """As the executor's backward takes its input: detached, 'hidden' a leaf with a gradient."""
    out = {k: v.detach() for k, v in state.items()}
    out["hidden"].requires_grad_(True)
    return out


@contextlib.contextmanager
def compute_cpu_spans(wall: bool = False) -> Iterator[list[tuple[str, float]]]:
    """Within the block, every compute action an rp_engine ``Executor`` runs appends (its text,
    e.g. "B2.3@1", seconds) to the yielded list: the CPU time of its body on its device's
    compute thread (``time.thread_time``: its work, not the time it waited for a core or the
    interpreter lock), or its wall time with ``wall`` (a device with several intra-op threads,
    whose work the compute thread alone does not hold). The body is the executor's own path:
    replica loads, the stage call through the layer wrapper, recompute and backward.

    It wraps ``Executor._launch`` (private: the one place a compute action's body is known) for
    the block only; a benchmark's instrument, not part of the engine."""
    from rp_engine.runtime.executor import Executor

    spans: list[tuple[str, float]] = []
    clock = time.perf_counter if wall else time.thread_time
    launch = Executor._launch

    def timed_launch(
        self: Any, ctx: Any, a: Any, layers: Any, inputs: Any, body: Any, **kw: Any
    ) -> Any:
        def timed(device: Any, weights: Any) -> None:
            start = clock()
            body(device, weights)
            spans.append((str(a), clock() - start))

        return launch(self, ctx, a, layers, inputs, timed, **kw)

    Executor._launch = timed_launch  # type: ignore[method-assign]
    try:
        yield spans
    finally:
        Executor._launch = launch  # type: ignore[method-assign]
