"""``torch.save`` without holding the big tensors: a checkpoint file filled storage by storage.

DeepSpeed's files hold a few huge tensors (the flat fp32 partitions and Adam's moments, each the
size of a whole parameter group). With the NVMe tiers their values exist only layer by layer, in
a small pool of buffers; building them whole would need the RAM the tiers exist to save. So:

- ``StreamedSave.deferred(shape, dtype, fill)`` stands for such a tensor in the object to save:
  a FakeTensor (a shape and a dtype, no memory), and ``fill(sink)`` writes its bytes in order
  when asked (``sink.write(tensor)``, ``sink.zeros(n)``), e.g. one layer at a time.
- ``StreamedSave.save(obj, file)`` has torch write the file with every storage's bytes left out
  (``torch.serialization.skip_data``: the pickle, the zip records and their offsets are torch's
  own), then writes each storage's bytes at its record's offset: a deferred one through its
  ``fill``, any other from its own memory, in pieces.

``torch.load`` (DeepSpeed's loader and zero_to_fp32 included) reads the result as any file
torch.save writes; tests/unit/test_streamed_save.py holds its storage records to torch.save's
bytes and its loaded values to the saved ones.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable, Sequence
from typing import IO, Any

import torch

__all__ = ["Sink", "StreamedSave"]

_CHUNK = 64 << 20  # bytes per write of a tensor in RAM (bounded extra memory for casts/copies)


class Sink:
    """Where a deferred tensor's ``fill`` writes its bytes, in order from the storage's start."""

    def __init__(self, fd: int, offset: int, nbytes: int, what: str) -> None:
        self._fd, self._at, self._end, self.what = fd, offset, offset + nbytes, what

    def write(self, tensor: torch.Tensor) -> None:
        """Append ``tensor``'s bytes (any layout; written as its contiguous values)."""
        flat = tensor.detach().reshape(-1)
        step = max(1, _CHUNK // max(1, flat.element_size()))
        for start in range(0, flat.numel(), step):
            self._put(_bytes_of(flat[start : start + step]))

    def zeros(self, nbytes: int) -> None:
        """Append ``nbytes`` zero bytes (paddings)."""
        while nbytes > 0:
            n = min(nbytes, _CHUNK)
            self._put(memoryview(bytes(n)))
            nbytes -= n

    @property
    def left(self) -> int:
        return self._end - self._at

    def _put(self, data: memoryview) -> None:
        if len(data) > self.left:
            raise RuntimeError(f"{self.what}: fill wrote more bytes than the tensor holds")
        while len(data):
            done = os.pwrite(self._fd, data, self._at)
            self._at += done
            data = data[done:]


Fill = Callable[[Sink], None]


class StreamedSave:
    """Deferred tensors for one ``save`` (see the module docstring)."""

    def __init__(self) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self._mode = FakeTensorMode()
        # storage -> (its FakeTensor, kept alive so the storage id stays valid; fill; name)
        self._fills: dict[int, tuple[torch.Tensor, Fill, str]] = {}

    def deferred(
        self, shape: Sequence[int], dtype: torch.dtype, fill: Fill, *, what: str = "tensor"
    ) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` whose bytes ``fill`` writes during ``save``
        (exactly ``numel * element_size``, in order; ``what`` names it in errors)."""
        with self._mode:
            fake = torch.empty(tuple(shape), dtype=dtype)
        self._fills[fake.untyped_storage()._cdata] = (fake, fill, what)
        return fake

    def save(self, obj: Any, f: IO[bytes]) -> None:
        """Write ``obj`` to the open, seekable, empty binary file ``f`` as ``torch.save`` would,
        filling the deferred tensors' bytes through their ``fill``."""
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            keys = _storage_keys(obj)
            torch.save(obj, f)
        f.flush()
        f.seek(0)
        reader = torch._C.PyTorchFileReader(f)  # reads the zip's directory only
        fd = f.fileno()
        for key, storage in keys.items():
            record = f"data/{key}"
            offset = reader.get_record_offset(record)  # type: ignore[attr-defined]  # untyped
            nbytes = reader.get_record_size(record)
            if nbytes != storage.nbytes():  # the key order is torch's: a mismatch is a bug here
                raise RuntimeError(f"streamed save: record {record} is {nbytes} B, expected "
                                   f"{storage.nbytes()} B")  # fmt: skip
            deferred = self._fills.get(storage._cdata)
            if deferred is None:
                sink = Sink(fd, offset, nbytes, record)
                sink.write(_as_bytes(storage))
            else:
                _fake, fill, what = deferred
                sink = Sink(fd, offset, nbytes, what)
                fill(sink)
            if sink.left:
                raise RuntimeError(f"{sink.what}: {sink.left} of {nbytes} bytes were not written")


def _storage_keys(obj: Any) -> dict[str, torch.UntypedStorage]:
    """The storages of ``obj`` by the record key torch.save gives them: keys are numbered in the
    order the pickler meets storages (torch/serialization.py ``_save``), so a dry run of the same
    pickling, inside the same ``skip_data`` context, meets them in the same order."""
    seen: dict[int, tuple[str, torch.UntypedStorage]] = {}

    class _Order(pickle.Pickler):
        def persistent_id(self, o: Any) -> str | None:
            if isinstance(o, torch.storage.TypedStorage):
                storage = o._untyped_storage
            elif torch.is_storage(o):
                storage = o
            else:
                return None
            return seen.setdefault(storage._cdata, (str(len(seen)), storage))[0]

    # torch.save's default pickle protocol (2): the traversal order is the protocol's
    _Order(io.BytesIO(), protocol=torch.serialization.DEFAULT_PROTOCOL).dump(obj)
    return {key: storage for key, storage in seen.values()}


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the storage's bytes (on the CPU)."""
    if storage.device.type != "cpu":
        storage = storage.cpu()
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _bytes_of(t: torch.Tensor) -> memoryview:
    data = t.contiguous().view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
    return memoryview(data.cpu().numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is one
