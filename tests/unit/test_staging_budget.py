"""Issue 49: the download staging pool is held to a byte budget (runtime/staging.py).

A download whose gradients cannot land in their fp32 records comes down into staging buffers;
with the NVMe tiers under a memory limit the pool gets the host-RAM model's share, so a device
running ahead of the host's additions waits instead of growing the pool without bound.
"""

from __future__ import annotations

import threading

import torch

from rp_engine.runtime.staging import HostStaging


def _alloc(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype)


def test_a_take_past_the_budget_waits_for_another_holder_to_give_back() -> None:
    pool = HostStaging(_alloc, budget=4096)
    first, second = object(), object()
    a = pool.take(1024, torch.float32, holder=first)  # 4096 bytes: the whole budget
    got: list[torch.Tensor] = []
    thread = threading.Thread(
        target=lambda: got.append(pool.take(512, torch.float32, holder=second))
    )
    thread.start()
    thread.join(timeout=0.3)
    assert thread.is_alive() and not got  # waiting: the budget is the first holder's
    pool.give([a])
    thread.join(timeout=10)
    assert got and got[0].numel() == 512
    assert pool.waits >= 1
    # the free 4 KiB buffer was let go to make room: the pool holds what is out, no more
    assert pool.held_bytes() <= 4096


def test_a_lone_holder_passes_the_budget_rather_than_wait_for_itself() -> None:
    """One download's own buffers come back only after it: it never waits for them."""
    pool = HostStaging(_alloc, budget=4096)
    mine = object()
    bufs = [pool.take(1024, torch.float32, holder=mine) for _ in range(3)]
    assert len({id(b) for b in bufs}) == 3 and pool.waits == 0
    pool.give(bufs)
    # reuse: the same sizes come from the free list, nothing new is allocated
    before = pool.allocated_bytes
    pool.give([pool.take(1024, torch.float32, holder=object())])
    assert pool.allocated_bytes == before


def test_no_budget_never_waits() -> None:
    pool = HostStaging(_alloc)
    out = [pool.take(1 << 16, torch.float32, holder=object()) for _ in range(8)]
    assert pool.waits == 0 and pool.out() == 8
    pool.give(out)
