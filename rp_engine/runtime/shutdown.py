"""Orderly shutdown of one engine's worker threads: at ``destroy()``, garbage collection or exit.

Why it exists: the optimizer worker and the device stream workers are daemon threads. A daemon
thread still running torch code when the interpreter finalises is stopped as it retakes the GIL
(``pthread_exit`` unwinds its stack); unwinding through torch's C++ frames (a tensor deallocation
releases and retakes the GIL inside a ``noexcept`` destructor) calls ``std::terminate``:
"terminate called without an active exception", exit status 134. In async mode the last
optimizer step is still running when a training script ends, so a script that never called
``destroy()`` died that way about one run in three.

``watch(engine, stepper=, pool=)`` returns a ``weakref.finalize`` that holds the stepper and the
pool, never the engine, so it does not keep the engine alive. It runs once, whichever comes
first: ``destroy()`` calls it; the engine is collected; or the interpreter exits (``finalize``
runs its pending callbacks from an ``atexit`` hook, before teardown, while daemon threads still
run normally). Each time it stops the devices, drains the optimizer, publishes the newest weights
into the model and joins every worker thread::

    main thread   ... script ends | atexit: pool.close (join device threads)
                                  |         stepper.synchronize (wait for step t, publish w_t)
                                  |         stepper.close (join the optimizer thread) | teardown
    rp-optimizer  step_t(L) ... step_t(0) ........................ exits
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from rp_engine.device import DevicePool
from rp_engine.optim.stepper import OptimizerStepper

__all__ = ["watch"]

log = logging.getLogger("rp_engine")


def watch(
    engine: Any,
    *,
    stepper: OptimizerStepper,
    pool: DevicePool,
    inflight: Any = None,
    tier: Any = None,
) -> weakref.finalize:
    """Shut ``stepper`` and ``pool`` down when ``engine`` is collected or the process exits;
    call the returned finaliser to do it now (idempotent: it runs at most once). ``inflight``
    (engine.pipeline.InFlightBox): a training run still in flight is finished and its step
    applied first. ``tier`` (storage's OptimizerTier): closed last (its swap file removed)."""
    return weakref.finalize(engine, shutdown, stepper, pool, inflight, tier)


def shutdown(
    stepper: OptimizerStepper, pool: DevicePool, inflight: Any = None, tier: Any = None
) -> None:
    """Stop the devices, finish in-flight optimizer steps, publish, join every worker thread.

    Safe from any thread: a garbage-collection pass may run the finaliser on one of the engine's
    own workers, which can neither join itself nor wait for its own queue; a helper thread then
    does the work (not a daemon, so the interpreter waits for it before tearing down).
    """
    workers = {stepper.thread, *(t for d in pool.devices for t in getattr(d, "threads", ()))}
    if threading.current_thread() in workers:
        threading.Thread(
            target=shutdown, args=(stepper, pool, inflight, tier), name="rp-shutdown"
        ).start()
        return
    try:
        if inflight is not None:  # overlapping iterations: the last step is still in flight
            inflight.finish(stepper)
        # Devices first: a gradient download still running may wait for optimizer progress,
        # so the optimizer thread keeps running until the device threads are gone.
        pool.close()
    finally:
        try:
            stepper.synchronize()
        except Exception as exc:  # a failed step was already reported to the training call
            log.debug("optimizer not drained at shutdown: %r", exc)
        finally:
            stepper.close()
            if tier is not None:
                tier.close()
