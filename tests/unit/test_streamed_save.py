"""checkpoint/streamed.py: a file written with deferred tensors is the file torch.save writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rp_engine.checkpoint.streamed import Sink, StreamedSave


def _records(path: Path) -> dict[str, bytes]:
    with open(path, "rb") as f:
        reader = torch._C.PyTorchFileReader(f)
        # the pickle's memo numbering differs (a FakeTensor pickles one extra object): the
        # records compared are the storages and the format markers; the load compares the rest
        names = [
            n
            for n in reader.get_all_records()
            if n.endswith((".format_version", ".storage_alignment", "byteorder", "version"))
            or "/data/" in f"/{n}"
        ]
        return {n: bytes(reader.get_record(n)) for n in names}


def _objects(streamed: StreamedSave) -> tuple[Any, Any]:
    """The same checkpoint-like object twice: with real tensors, and with the big ones deferred
    (filled in pieces, with paddings, as the checkpoint writer fills flat groups)."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(300, generator=gen), torch.randn(7, 5, generator=gen)
    w = torch.randn(4, 6, generator=gen).to(torch.bfloat16)
    flat = torch.cat([a, torch.zeros(4), b.reshape(-1), torch.zeros(1)])

    def fill_flat(sink: Sink) -> None:
        sink.write(a)
        sink.zeros(16)
        sink.write(b.t().contiguous().t())  # a non-contiguous view is written by its values
        sink.zeros(4)

    common = {"step": 3, "shapes": [(300,), (7, 5)], "scalar": torch.tensor(2.5)}
    shared = torch.arange(10.0)
    real = {
        **common, "flat": flat, "w": w, "views": [shared, shared[2:5]], "none": torch.empty(0)
    }  # fmt: skip
    deferred = {
        **common,
        "flat": streamed.deferred(flat.shape, torch.float32, fill_flat),
        "w": streamed.deferred(w.shape, w.dtype, lambda sink: sink.write(w)),
        "views": [shared, shared[2:5]],
        "none": torch.empty(0),
    }
    return real, deferred


def test_a_streamed_file_has_torch_saves_records(tmp_path: Path) -> None:
    streamed = StreamedSave()
    real, deferred = _objects(streamed)
    torch.save(real, tmp_path / "plain.pt")
    with open(tmp_path / "streamed.pt", "w+b") as f:
        streamed.save(deferred, f)
    records = _records(tmp_path / "streamed.pt")
    assert records == _records(tmp_path / "plain.pt") and len(records) >= 9
    loaded = torch.load(tmp_path / "streamed.pt", weights_only=True, mmap=True)
    assert loaded.keys() == real.keys()
    for key, value in real.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
        elif key != "views":
            assert loaded[key] == value, key
    views = loaded["views"]  # storage sharing survives
    assert views[0].untyped_storage().data_ptr() == views[1].untyped_storage().data_ptr()


@pytest.mark.parametrize("wrong", [-1, 1])
def test_a_fill_of_the_wrong_size_names_the_tensor(tmp_path: Path, wrong: int) -> None:
    streamed = StreamedSave()
    t = torch.ones(8)
    short = streamed.deferred((8 + wrong,), torch.float32, lambda s: s.write(t), what="masters")
    with open(tmp_path / "bad.pt", "w+b") as f, pytest.raises(RuntimeError, match="masters"):
        streamed.save({"x": short}, f)
