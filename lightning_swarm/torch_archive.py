"""``torch.save``'s file format, written piece by piece: what both engines' streamed checkpoints share.

A ``torch.save`` file is a zip archive of uncompressed records: the pickled structure (``data.pkl``), a few
format records, and one record per storage whose data starts at a multiple of :data:`ALIGN` bytes (what
``torch.load(mmap=True)`` expects). Writing the records one at a time lets a checkpoint of a model that no single
process holds be written as its parts arrive (D-SLIDE's shards, a swarm's stages), and read back with plain
``torch.load``.

Free of Lightning and of either engine.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import sys
import zipfile
from collections.abc import Iterable
from typing import Any

import torch

ALIGN = 64
"""``torch.save`` aligns storage records to this many bytes."""


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))


def storage_bytes(storage: Any) -> memoryview:
    """The bytes of ``storage`` (moved to the CPU if needed), without a copy on the CPU."""
    flat = torch.empty(0, dtype=torch.uint8)
    flat.set_(storage.cpu() if storage.device.type != "cpu" else storage)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers


def write_record(archive: zipfile.ZipFile, name: str, chunks: Iterable[Any]) -> None:
    """One uncompressed record whose data starts at a multiple of :data:`ALIGN` bytes (padding in an extra field),
    written chunk by chunk."""
    info = zipfile.ZipInfo(f"archive/{name}", date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    assert archive.fp is not None
    start = (
        archive.fp.tell() + 30 + len(info.filename.encode()) + 20 + 4
    )  # header, name, zip64 extra, pad header
    pad = -start % ALIGN
    info.extra = struct.pack("<HH", 0x4246, pad) + b"\0" * pad  # 'FB': the id torch uses for its padding
    with archive.open(info, "w", force_zip64=True) as out:
        for chunk in chunks:
            out.write(chunk)


def write_format_records(archive: zipfile.ZipFile) -> None:
    """The records ``torch.load`` reads before the data: format version, storage alignment and byte order."""
    write_record(archive, ".format_version", [b"1"])
    write_record(archive, ".storage_alignment", [str(ALIGN).encode()])
    write_record(archive, "byteorder", [sys.byteorder.encode()])


def write_version_record(archive: zipfile.ZipFile) -> None:
    """The archive's last record, as ``torch.save`` writes it."""
    write_record(archive, "version", [b"3\n"])


def rebuild_as_tensor(storage: Any, shape: tuple[int, ...]) -> tuple[Any, tuple[Any, ...]]:
    """A pickle reduction that rebuilds a contiguous tensor of ``shape`` from ``storage`` (a persistent id's
    object), as ``torch.save`` pickles a tensor."""
    args: tuple[Any, ...] = (
        storage,
        0,
        tuple(shape),
        contiguous_stride(tuple(shape)),
        False,
        collections.OrderedDict(),
    )
    return (torch._utils._rebuild_tensor_v2, args)


def numel_of(shape: tuple[int, ...]) -> int:
    """The number of elements of a tensor of ``shape``."""
    numel = 1
    for size in shape:
        numel *= size
    return numel


class StoragePickler(pickle.Pickler):
    """``torch.save``'s pickling: storages become persistent ids ``("storage", type, key, "cpu", numel)`` and are
    collected in ``storages`` (key -> storage) for their records. Subclasses add leaves whose records are written
    apart (override :meth:`reducer_override` and :meth:`persistent_id`, falling back on these)."""

    def __init__(self, file: io.BytesIO, storages: dict[str, Any], ids: dict[Any, str] | None = None) -> None:
        super().__init__(file, protocol=2)
        self.storages = storages
        self.ids: dict[Any, str] = {} if ids is None else ids

    def key_for(self, identity: Any) -> str:
        """The record key of the object with ``identity`` (a new key the first time)."""
        return self.ids.setdefault(identity, str(len(self.ids)))

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            storage = obj._untyped_storage
            key = self.key_for(storage._cdata)
            self.storages[key] = storage
            return ("storage", getattr(torch, obj._pickle_storage_type()), key, "cpu", obj._size())
        if torch.is_storage(obj):
            key = self.key_for(obj._cdata)
            self.storages[key] = obj
            return ("storage", torch.UntypedStorage, key, "cpu", obj.nbytes())
        return None


def storage_type_of(dtype: torch.dtype) -> Any:
    """The typed storage class ``torch.save`` names for tensors of ``dtype``."""
    return getattr(torch, torch.TypedStorage(0, dtype=dtype)._pickle_storage_type())
