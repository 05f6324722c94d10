"""Transfers: LPT packing of weight chunks, chunked uploads, activations that stay on a device."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import config, engine_for
from models import random_batch, tiny_qwen3

from rp_engine.device import make_devices
from rp_engine.transfer import pack_largest_first, split_pieces, upload_weights


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


def test_split_pieces_cover_every_tensor_once_within_the_chunk() -> None:
    rng = random.Random(1)
    for _ in range(100):
        tensors = [torch.empty(rng.randint(0, 300)) for _ in range(rng.randint(0, 6))]
        bound = rng.randint(4, 500)
        pieces = split_pieces(tensors, bound)
        for i, t in enumerate(tensors):
            mine = sorted((s, e) for j, s, e in pieces if j == i)
            assert mine[0][0] == 0 and mine[-1][1] == t.numel()  # contiguous, in order, whole
            assert all(a[1] == b[0] for a, b in zip(mine, mine[1:], strict=False))
            if t.numel() * 4 > bound:
                assert all((e - s) * 4 <= bound for s, e in mine)
            else:
                assert len(mine) == 1
    strided = torch.empty(100, 2)[:, 0]  # not contiguous: its flat storage is not its data
    assert split_pieces([strided], 16) == [(0, 0, 100)]
    assert split_pieces([torch.empty(100)], 16, dense=[False]) == [(0, 0, 100)]


def test_a_tensor_larger_than_a_chunk_is_uploaded_in_chunk_sized_copies() -> None:
    """A tensor bigger than the chunk (a tied embedding) goes up in chunk-sized copies on the
    weight stream, so an activation copy never waits behind the whole of it; the device holds
    one tensor with the same bytes and the bytes copied are the tensor's."""
    with make_devices("cpu:1") as pool:
        device = pool[0]
        copies: list[int] = []
        real = device.to_device

        def to_device(host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            copies.append(host.numel() * host.element_size())
            return real(host) if out is None else real(host, out)

        device.to_device = to_device  # type: ignore[method-assign]
        big = torch.randn(2500)  # 10,000 B: 5 copies of at most 2048 B
        small = [torch.randn(7, 3), torch.randn(100)]
        sources = [t + 1 for t in [big, *small]]  # e.g. the second buffer of compute weights
        handle = upload_weights(device, [big, *small], sources=sources, chunk_bytes=2048)
        assert handle.event is not None
        handle.event.synchronize()
        assert max(copies) <= 2048 and sum(copies) == handle.nbytes == (2500 + 21 + 100) * 4
        assert len(copies) == 5 + 2
        for t, src in zip([big, *small], sources, strict=True):
            copy = handle.tensors[id(t)]
            assert copy.shape == t.shape and torch.equal(copy, src)
        stats = device.memory_stats()
        assert stats["allocated"] == handle.nbytes and stats["h2d_bytes"] == handle.nbytes
        handle.release(device)
        assert device.memory_stats()["allocated"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_upload_of_a_split_tensor_is_exact() -> None:
    from rp_engine.device.cuda import pin

    with make_devices("cuda:0") as pool:
        device = pool[0]
        big = pin(torch.randn(3_000_001).to(torch.bfloat16))  # 6 MB in 1 MB pieces
        small = pin(torch.randn(1000))
        handle = upload_weights(device, [big, small], chunk_bytes=1 << 20)
        assert handle.event is not None
        handle.event.synchronize()
        assert torch.equal(handle.tensors[id(big)].cpu(), big)
        assert torch.equal(handle.tensors[id(small)].cpu(), small)
        assert device.memory_stats()["h2d_bytes"] == handle.nbytes
        handle.release(device)


def _activation_d2h_bytes(devices: int) -> int:
    engine = engine_for(
        tiny_qwen3(0, layers=4),
        config(devices=devices, gas=1, fwd_cuts=[1, 1, 1, 1], bwd_cuts=[0, 4]),
    )
    try:
        engine.train_batch(iter([random_batch(128, batch=2, seq=16)]))
        # The gradients' downloads may still be in flight when train_batch returns (the
        # optimizer is asynchronous); read the counters once the step has drained.
        engine.synchronize()
        return sum(d.memory_stats()["d2h_bytes"] for d in engine.pool)
    finally:
        engine.destroy()


def test_activations_stay_on_the_device_when_the_next_stage_runs_there() -> None:
    """One device: the four forward stages hand activations on in place; four devices: each
    hop goes through the host (D2H + H2D), so more bytes come down."""
    one, four = _activation_d2h_bytes(1), _activation_d2h_bytes(4)
    hidden_bytes = 2 * 16 * 64 * 4  # (batch, seq, hidden) fp32, one boundary
    assert four - one >= 3 * hidden_bytes
