"""ZeRO-Infinity's host<->device traffic on an emulated PCIe link, for DeepSpeed runs on CPU.

On CPU DeepSpeed's "offload" is a copy inside host memory, so an emulated link (``--pcie-gbps``)
would slow rp_engine alone. This module charges DeepSpeed the same link, by the rule the
reference states for ZeRO-Infinity: every layer's parameters are fetched before its forward and
again before its backward (one layer prefetched ahead, as DeepSpeed's prefetcher does), and its
gradients are offloaded after its backward; each direction is one link, transfers on it are
serial. The waits are module hooks around DeepSpeed's own forward and backward, so compute and
the modelled copies overlap as they would with a copy engine. It models bytes and bandwidth
only (no latency, no all-gather collective cost: one rank).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

__all__ = ["EmulatedZeroLink"]


class EmulatedZeroLink:
    """Hooks on ``modules`` (execution order) charging their parameter bytes per use.

    ``param_bytes[i]``: bytes fetched for module i (its parameters in the compute dtype);
    ``grad_bytes[i]``: bytes offloaded after its backward. ``h2d_bytes`` / ``d2h_bytes`` count
    what was charged; ``wait_gradients()`` blocks until every offload charged so far is done (the
    optimizer step needs the gradients).
    """

    def __init__(
        self,
        modules: Sequence[Any],
        param_bytes: Sequence[int],
        grad_bytes: Sequence[int],
        gbps: float,
    ) -> None:
        if gbps <= 0:
            raise ValueError(f"pcie_gbps must be > 0, got {gbps}")
        self.rate = gbps * 1e9
        self.param_bytes, self.grad_bytes = list(param_bytes), list(grad_bytes)
        self.h2d_free = self.d2h_free = 0.0
        self.h2d_bytes = self.d2h_bytes = 0
        self._ready: dict[tuple[str, int], float] = {}
        self._handles = []
        for i, module in enumerate(modules):
            self._handles.append(module.register_forward_pre_hook(self._pre("fwd", i, +1)))
            self._handles.append(module.register_full_backward_pre_hook(self._pre("bwd", i, -1)))
            self._handles.append(module.register_full_backward_hook(self._offload(i)))
        self.num_modules = len(modules)

    def _fetch(self, phase: str, i: int) -> float:
        key = (phase, i)
        if key not in self._ready:
            start = max(time.perf_counter(), self.h2d_free)
            self.h2d_free = start + self.param_bytes[i] / self.rate
            self.h2d_bytes += self.param_bytes[i]
            self._ready[key] = self.h2d_free
        return self._ready[key]

    def _pre(self, phase: str, i: int, step: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            ready = self._fetch(phase, i)
            self._ready.pop((phase, i))
            nxt = i + step
            if 0 <= nxt < self.num_modules:
                self._fetch(phase, nxt)  # prefetch depth 1
            _sleep_until(ready)

        return hook

    def _offload(self, i: int) -> Any:
        def hook(module: Any, grad_in: Any, grad_out: Any) -> None:
            start = max(time.perf_counter(), self.d2h_free)
            self.d2h_free = start + self.grad_bytes[i] / self.rate
            self.d2h_bytes += self.grad_bytes[i]

        return hook

    @classmethod
    def over(cls, modules: Sequence[Any], bytes_per_param: int, gbps: float) -> EmulatedZeroLink:
        """The link over ``modules`` (execution order), each fetched and its gradients
        offloaded at ``bytes_per_param`` per parameter (4: fp32, 2: bf16)."""
        nbytes = [sum(p.numel() for p in m.parameters()) * bytes_per_param for m in modules]
        return cls(modules, nbytes, nbytes, gbps)

    def wait_gradients(self) -> None:
        _sleep_until(self.d2h_free)
        self._ready.clear()  # a prefetch past the last module of a pass is never consumed

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)  # drops the GIL, as a copy engine would leave the CPU free
