"""The NVMe tier's parts: aligned buffers, both I/O engines, the swap file and its checks."""

from __future__ import annotations

import errno
import os
import time

import prebuild
import pytest
import torch

from rp_engine.config.schema import AioConfig
from rp_engine.plan.host_ram import PoolSizes
from rp_engine.storage import ALIGN, NvmeSpaceError, SwapFile, aligned_empty, check_nvme_path
from rp_engine.storage.io_engine import ThreadEngine, aio_op_built, make_io_engine
from rp_engine.storage.record_pool import Record, RecordPool


def test_aligned_buffers_are_page_aligned_and_rounded_up() -> None:
    for n in (1, 4095, 4096, 10_000):
        buf = aligned_empty(n)
        assert buf.dtype == torch.uint8 and buf.data_ptr() % ALIGN == 0
        assert buf.numel() == -(-n // ALIGN) * ALIGN


def _roundtrip(engine, path: str) -> None:
    data = aligned_empty(3 * ALIGN + 5)
    data.copy_(torch.randint(0, 256, (data.numel(),), dtype=torch.uint8))
    engine.write(path, data, 2 * ALIGN).result()
    back = aligned_empty(data.numel())
    engine.read(path, back, 2 * ALIGN).result()
    assert torch.equal(back, data)
    stats = engine.stats
    assert (stats.read_bytes, stats.write_bytes) == (data.numel(), data.numel())
    assert (stats.reads, stats.writes) == (1, 1) and stats.busy_s > 0


def test_thread_engine_reads_back_what_it_wrote(tmp_path) -> None:
    path = str(tmp_path / "f.swp")
    SwapFile(str(tmp_path), "f.swp", 8 * ALIGN)  # a reserved file, as the tier's
    engine = ThreadEngine(block_size=ALIGN, threads=2)  # several blocks per operation
    try:
        _roundtrip(engine, path)
    finally:
        engine.close()


def test_aio_engine_reads_back_what_it_wrote(tmp_path) -> None:
    prebuild.wait("aio")  # `make test` builds it beside the first tests
    if not aio_op_built():
        pytest.skip("DeepSpeed's aio op is not built here (needs libaio-dev; make aio)")
    SwapFile(str(tmp_path), "f.swp", 8 * ALIGN)
    engine = make_io_engine("aio", AioConfig())
    try:
        assert "DeepSpeed aio" in engine.describe()
        # the tier's buffers come from the op's own locked memory: no bounce copy per operation
        locked = engine.alloc(5 * ALIGN)
        assert locked.data_ptr() % ALIGN == 0 and engine._handle.is_pinned(locked[:ALIGN])
        _roundtrip(engine, str(tmp_path / "f.swp"))
    finally:
        engine.close()


def test_engines_refuse_what_o_direct_cannot_do(tmp_path) -> None:
    engine = ThreadEngine()
    try:
        with pytest.raises(ValueError, match="4 KiB alignment"):
            engine.write(str(tmp_path / "f"), aligned_empty(ALIGN), 100)
        with pytest.raises(ValueError, match="4 KiB alignment"):
            engine.write(str(tmp_path / "f"), aligned_empty(2 * ALIGN)[1 : ALIGN + 1], 0)
        with pytest.raises(ValueError, match="uint8"):
            engine.write(str(tmp_path / "f"), torch.zeros(ALIGN), 0)
    finally:
        engine.close()


def test_io_engine_choice_is_checked() -> None:
    with pytest.raises(ValueError, match="auto, aio, threads"):
        make_io_engine("dma", AioConfig())
    engine = make_io_engine("threads", AioConfig(block_size=1 << 21, intra_op_parallelism=3))
    try:
        assert isinstance(engine, ThreadEngine) and engine.block_size == 1 << 21
    finally:
        engine.close()


def test_swap_file_is_reserved_locked_and_removed(tmp_path) -> None:
    swap = SwapFile(str(tmp_path), "rp_engine/rank0/optimizer.swp", 1 << 20)
    st = os.stat(swap.path)
    assert st.st_size == 1 << 20 and st.st_blocks * 512 >= 1 << 20  # allocated, not sparse
    with pytest.raises(NvmeSpaceError, match="in use by another running process") as info:
        SwapFile(str(tmp_path), "rp_engine/rank0/optimizer.swp", 1 << 20)
    assert info.value.errno == errno.EBUSY
    swap.close()
    assert os.listdir(tmp_path) == []  # the folders it made go too
    # a file left by a killed run (no lock holder) is taken over
    os.makedirs(tmp_path / "rp_engine" / "rank0")
    (tmp_path / "rp_engine" / "rank0" / "optimizer.swp").write_bytes(b"stale" * 100)
    again = SwapFile(str(tmp_path), "rp_engine/rank0/optimizer.swp", 8192)
    assert os.path.getsize(again.path) == 8192
    again.close()


def test_nvme_path_checks_name_the_key_the_path_and_the_bytes(tmp_path, monkeypatch) -> None:
    key = "zero_optimization.offload_optimizer.nvme_path"
    with pytest.raises(NvmeSpaceError, match=f"{key} is not set"):
        check_nvme_path(None, 10, key=key)
    with pytest.raises(NvmeSpaceError, match="does not exist") as info:
        check_nvme_path(str(tmp_path / "nope"), 10, key=key)
    assert key in str(info.value) and str(tmp_path / "nope") in str(info.value)
    assert check_nvme_path(str(tmp_path), 10, key=key) == str(tmp_path)

    class Usage:
        free = 1000

    monkeypatch.setattr("rp_engine.storage.swap_file.shutil.disk_usage", lambda _: Usage)
    with pytest.raises(NvmeSpaceError, match=r"needs 0\.00 GiB \(5000 bytes\).*\(1000 bytes\)"):
        check_nvme_path(str(tmp_path), 5000, key=key)


class _SlowFirstRead(ThreadEngine):
    """Its first read sleeps before reading: a prefetch still landing when its buffer is
    claimed for another record."""

    def __init__(self) -> None:
        super().__init__(threads=2)
        self.first: list[object] = []

    def read(self, path, buffer, offset):  # type: ignore[no-untyped-def]
        if self.first:
            return super().read(path, buffer, offset)
        slow = self._pool.submit(lambda: (time.sleep(0.4), self._pread(path, buffer, offset)))
        self.first.append(slow)
        return slow


def test_a_buffer_still_being_prefetched_is_not_reused_under_the_read(tmp_path) -> None:
    """Regression: ``pin`` took a buffer whose prefetch read was still in flight and issued its
    own read into it; the prefetch landed last and the pinned record held another's bytes
    (async runs with the parameter tier lost bit parity now and then)."""
    path = str(tmp_path / "pool.swp")
    records = [Record(k, k * ALIGN, ALIGN) for k in range(3)]
    with open(path, "wb") as f:
        for k in range(3):
            f.write(bytes([k + 1]) * ALIGN)
    engine = _SlowFirstRead()
    pool = RecordPool(path, engine, buffer_count=2, sizes=PoolSizes(ALIGN))
    pool.prefetch([records[0]])  # slow read into one buffer, nobody pins it
    views = pool.pin([records[1], records[2]])  # needs both buffers
    engine.first[0].result()  # the prefetch has landed by now
    assert [int(v[0]) for v in views] == [2, 3] and all(bool((v == v[0]).all()) for v in views)
    pool.unpin(records[1:])
    engine.close()


def _lazy_pool(tmp_path, buffers: int = 2, *, big: int = 0) -> tuple[RecordPool, ThreadEngine]:
    path = str(tmp_path / "grads.swp")
    with open(path, "wb") as f:
        f.truncate(16 * ALIGN)
    engine = ThreadEngine()
    sizes = PoolSizes(ALIGN, big, 1 if big else 0)
    return RecordPool(path, engine, buffer_count=buffers, sizes=sizes, lazy=True), engine


def test_a_lazy_pool_writes_only_what_it_evicts_and_reads_it_back(tmp_path) -> None:
    """The gradient tier's pool: a changed record stays in RAM after its last unpin (no write);
    taken for another record it is written first, and a later pin reads the same bytes back;
    a discarded record is never written."""
    pool, engine = _lazy_pool(tmp_path)
    recs = [Record(k, k * ALIGN, ALIGN) for k in range(4)]
    for k in range(2):
        (view,) = pool.pin([recs[k]], fresh=True)
        view.fill_(k + 1)
        pool.unpin([recs[k]], dirty=True)
    assert engine.stats.write_bytes == 0  # both still in their buffers
    pool.discard(recs[1])  # consumed: its buffer is free and clean
    (view,) = pool.pin([recs[2]], fresh=True)  # takes the discarded one's buffer: no write
    view.fill_(3)
    pool.unpin([recs[2]], dirty=True)
    assert engine.stats.write_bytes == 0
    pool.pin([recs[3]], fresh=True)  # evicts the least recently used changed record: 0
    assert engine.stats.write_bytes == ALIGN
    pool.unpin([recs[3]])
    (back,) = pool.pin([recs[0]])  # read back from the file (evicting record 2, written)
    assert bool((back == 1).all()) and engine.stats.read_bytes == ALIGN
    pool.unpin([recs[0]])
    (back,) = pool.pin([recs[2]])
    assert bool((back == 3).all())
    pool.unpin([recs[2]])
    engine.close()


def test_try_pin_never_waits_and_big_records_keep_their_own_buffers(tmp_path) -> None:
    pool, engine = _lazy_pool(tmp_path, big=4 * ALIGN)
    small = [Record(k, k * ALIGN, ALIGN) for k in range(3)]
    big = Record("big", 8 * ALIGN, 4 * ALIGN)
    assert pool.buffer_bytes == 2 * ALIGN + 2 * 4 * ALIGN
    views = [pool.try_pin(r, fresh=True) for r in small]
    assert views[0] is not None and views[1] is not None
    assert views[2] is None  # both ordinary buffers pinned: no wait, no big buffer taken
    (bv,) = pool.pin([big], fresh=True)  # a big buffer, although ordinary ones are busy
    assert bv.numel() == 4 * ALIGN
    pool.unpin(small[:2], dirty=True)
    assert pool.try_pin(small[2], fresh=True) is None  # only changed buffers: a write first
    assert pool.try_pin(small[0]) is not None  # held: a hit needs no wait
    with pytest.raises(ValueError, match="larger than the pool's buffers"):
        pool.pin([Record("huge", 0, 8 * ALIGN)])
    engine.close()
