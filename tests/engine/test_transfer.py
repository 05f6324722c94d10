"""Transfers: LPT packing of weight chunks, chunked uploads, activations that stay on a device."""

from __future__ import annotations

import random

import torch
from engine_helpers import config, engine_for
from models import random_batch, tiny_qwen3

from rp_engine.device import make_devices
from rp_engine.transfer import pack_largest_first, upload_weights


def test_pack_largest_first_covers_every_item_once_within_the_bound() -> None:
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.randint(1, 100) for _ in range(rng.randint(0, 30))]
        bound = rng.randint(1, 150)
        chunks = pack_largest_first(sizes, bound)
        assert sorted(i for c in chunks for i in c) == list(range(len(sizes)))
        for chunk in chunks:  # within the bound, or a single oversized item
            assert sum(sizes[i] for i in chunk) <= bound or len(chunk) == 1
        firsts = [sizes[c[0]] for c in chunks]
        assert firsts == sorted(firsts, reverse=True)  # largest first


def test_upload_weights_copies_every_tensor_in_chunks() -> None:
    with make_devices("cpu:1") as pool:
        device = pool[0]
        tensors = [torch.randn(n) for n in (1000, 10, 500, 3)]
        handle = upload_weights(device, tensors, chunk_bytes=2048)
        assert handle.event is not None
        handle.event.synchronize()
        for t in tensors:
            copy = handle.tensors[id(t)]
            torch.testing.assert_close(copy, t, rtol=0, atol=0)
            assert copy.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        handle.release(device)
        assert device.memory_stats()["allocated"] == 0


def _activation_d2h_bytes(devices: int) -> int:
    engine = engine_for(
        tiny_qwen3(0, layers=4),
        config(devices=devices, gas=1, fwd_cuts=[1, 1, 1, 1], bwd_cuts=[0, 4]),
    )
    try:
        engine.train_batch(iter([random_batch(128, batch=2, seq=16)]))
        return sum(d.memory_stats()["d2h_bytes"] for d in engine.pool)
    finally:
        engine.destroy()


def test_activations_stay_on_the_device_when_the_next_stage_runs_there() -> None:
    """One device: the four forward stages hand activations on in place; four devices: each
    hop goes through the host (D2H + H2D), so more bytes come down."""
    one, four = _activation_d2h_bytes(1), _activation_d2h_bytes(4)
    hidden_bytes = 2 * 16 * 64 * 4  # (batch, seq, hidden) fp32, one boundary
    assert four - one >= 3 * hidden_bytes
