"""DeepSpeed's CPU Adam called without the GIL (optim/nogil_adam.py) is DeepSpeed's CPU Adam.

The same C++ function of the same loaded op, reached through ctypes instead of its pybind11
binding: bit-identical results, the GIL free while it runs, DeepSpeed's binding for what the
function would throw on, and DeepSpeed's optimizer map never written while a step reads it.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from rp_engine.optim import nogil_adam
from rp_engine.optim.nogil_adam import gil_free_adam
from rp_engine.optim.optimizer import build_inner_optimizer


def _inner(adamw: bool = True, weight_decay: float = 0.01) -> Any:
    p = torch.nn.Parameter(torch.zeros(8))
    kind = "adamw" if adamw else "adam"
    params: dict[str, Any] = {"lr": 1e-3, "weight_decay": weight_decay}
    if not adamw:
        params["adam_w_mode"] = False
    inner, per_layer = build_inner_optimizer(kind, params, [{"params": [p]}])
    assert per_layer, "DeepSpeed's CPU Adam"
    return inner


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam-l2"])
def test_bit_identical_to_deepspeeds_binding(adamw: bool) -> None:
    inner = _inner(adamw)
    free = gil_free_adam(inner.ds_opt_adam)
    assert free is not None
    gen = torch.Generator().manual_seed(0)
    n = (1 << 16) + 37  # a scalar tail after the SIMD part
    w0 = torch.randn(n, generator=gen)
    states = [[w0.clone(), torch.zeros(n), torch.zeros(n)] for _ in range(2)]
    for step in range(1, 6):
        g = torch.randn(n, generator=gen)
        args = (inner.opt_id, step, 1e-2 / step, 0.9, 0.999, 1e-8, 0.1, True)
        w, m, v = states[0]
        inner.ds_opt_adam.adam_update(*args, w, g.clone(), m, v)
        w, m, v = states[1]
        assert free.update(*args, w, g.clone(), m, v) == 0
    for a, b in zip(*states, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(states[0][0], w0), "the step moved the weights"


def test_what_the_function_would_throw_on_goes_through_deepspeeds_binding() -> None:
    # a non-contiguous tensor would be copied by .contiguous() and the result lost; bf16 state
    # raises a C++ exception, which must never cross ctypes: DeepSpeed's binding takes both
    inner = _inner()
    free = gil_free_adam(inner.ds_opt_adam)
    assert free is not None
    base = torch.randn(64, 2)
    strided, ref = base[:, 0], base[:, 0].clone()
    g = torch.randn(64)
    m, v, m2, v2 = (torch.zeros(64) for _ in range(4))
    args = (inner.opt_id, 1, 1e-2, 0.9, 0.999, 1e-8, 0.0, True)
    inner.ds_opt_adam.adam_update(*args, ref, g, m2, v2)
    free.update(*args, strided, g, m, v)
    # DeepSpeed's binding copies a non-contiguous param too: the view is left as it was, the
    # moments (contiguous) are written, exactly as without rp_engine
    assert torch.equal(m, m2) and torch.equal(v, v2)
    with pytest.raises(RuntimeError, match="not supported"):
        free.update(*args, torch.zeros(64), g, torch.zeros(64, dtype=torch.bfloat16), v)


def test_the_gil_is_free_while_a_step_runs() -> None:
    """A Python thread sees the parameter half-updated: it ran while the C call was writing it.
    Under the GIL-holding binding no Python thread can run inside the call, so the same watcher
    never sees it (the control: the detector does not fire by itself)."""
    inner = _inner(weight_decay=0.0)
    free = gil_free_adam(inner.ds_opt_adam)
    assert free is not None
    n = 1 << 24  # DeepSpeed steps it tile by tile, front to back

    def seen_half_done(update: Any, tries: int) -> bool:
        for _ in range(tries):
            w, g, m, v = torch.zeros(n), torch.ones(n), torch.zeros(n), torch.zeros(n)
            calling, half = threading.Event(), threading.Event()

            def watch(
                w: torch.Tensor = w,
                calling: threading.Event = calling,
                half: threading.Event = half,
            ) -> None:
                calling.wait()
                while calling.is_set():
                    if float(w[0]) != 0.0 and float(w[-1]) == 0.0:
                        half.set()
                        return

            watcher = threading.Thread(target=watch)
            watcher.start()
            calling.set()
            update(inner.opt_id, 1, 1e-2, 0.9, 0.999, 1e-8, 0.0, True, w, g, m, v)
            calling.clear()
            watcher.join()
            assert float(w[-1]) != 0.0, "the whole tensor was stepped"
            if half.is_set():
                return True
        return False

    assert seen_half_done(free.update, tries=20)
    assert not seen_half_done(inner.ds_opt_adam.adam_update, tries=3)


def test_creating_or_destroying_an_optimizer_waits_for_steps_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # DeepSpeed's optimizer map (an unordered_map) is read by every step and written by
    # create_adam / destroy_adam: with the GIL released they could overlap, so they wait
    inner = _inner()
    op = inner.ds_opt_adam
    assert gil_free_adam(op) is not None
    assert getattr(op.create_adam, "_rp_map_locked", False)
    assert getattr(op.destroy_adam, "_rp_map_locked", False)
    lock = nogil_adam._MAP_LOCK
    reading, release = threading.Event(), threading.Event()

    def step_in_flight() -> None:
        with lock.read():
            reading.set()
            release.wait()

    order: list[str] = []
    reader = threading.Thread(target=step_in_flight)
    reader.start()
    reading.wait()
    writer = threading.Thread(target=lambda: order.append(lock.write(lambda: "created")))
    writer.start()
    writer.join(timeout=0.5)
    assert writer.is_alive() and not order, "the write waits while a step reads the map"
    order.append("step done")
    release.set()
    reader.join()
    writer.join()
    assert order == ["step done", "created"]
    # a write on a thread that holds a read itself (a collection inside a read) does not wait
    with lock.read():
        assert lock.write(lambda: 7) == 7
