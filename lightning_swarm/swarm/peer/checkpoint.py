"""Writing a swarm checkpoint stage by stage: the trainer never holds the whole model.

A trainer's ``state_dict`` for a checkpoint names every pipeline tensor with a :class:`Deferred` leaf (the
stage it lives on and its key in that stage's state), and every stage's optimizer state likewise. :func:`save_deferred`
writes the file in the format of ``torch.save`` (a zip archive: one 64-byte aligned record per storage, and the
pickled structure), fetching one stage's tensors at a time from the swarm, writing them, and dropping them before
the next stage; the pickled structure is written last (``torch.load`` finds records by name), once every
tensor's shape and dtype is known. The file loads with plain ``torch.load`` (and so
``LightningModule.load_from_checkpoint``) by anyone with the memory for it, or with ``torch.load(..., mmap=True)``
without that memory, which is how a swarm resuming from it seeds each peer's own stage only.

Free of Lightning.
"""

from __future__ import annotations

import io
import os
import warnings
import zipfile
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_swarm import torch_archive


@dataclass(eq=False)
class Deferred:
    """A tensor of a checkpoint that lives elsewhere: entry ``key`` of what ``fetch(group)`` returns.

    Leaves of one ``group`` are fetched together, once (a stage's whole state)."""

    group: Hashable
    key: str
    # filled by the writer once fetched
    shape: tuple[int, ...] = field(default=(), repr=False)
    dtype: torch.dtype | None = field(default=None, repr=False)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "A Deferred tensor (a stage's tensor still on the swarm) can only be saved by "
            "lightning_swarm.swarm.peer.checkpoint.save_deferred (the SwarmStrategy's save_checkpoint)."
        )


def find_deferred(obj: Any) -> Iterator[Deferred]:
    """The Deferred leaves of ``obj`` (dicts, lists, tuples), in order."""
    if isinstance(obj, Deferred):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from find_deferred(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from find_deferred(value)


def resolve_deferred(obj: Any, fetch: Callable[[Hashable], dict[str, Tensor]]) -> Any:
    """``obj`` with every Deferred leaf replaced by its tensor (all of them in memory: for a custom CheckpointIO)."""
    cache: dict[Hashable, dict[str, Tensor]] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, Deferred):
            if value.group not in cache:
                cache[value.group] = fetch(value.group)
            return cache[value.group][value.key]
        if isinstance(value, dict):
            return type(value)((k, walk(v)) for k, v in value.items())
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, tuple):
            return tuple(walk(v) for v in value)
        return value

    return walk(obj)


def save_deferred(obj: Any, path: str | os.PathLike, fetch: Callable[[Hashable], dict[str, Tensor]]) -> int:
    """Write ``obj`` to ``path`` as ``torch.save`` would, with each Deferred leaf as the tensor it stands for.

    Memory: ``obj``'s ordinary tensors, plus one group's fetched tensors at a time (groups in order of first
    appearance). Written through ``<path>.partial``, renamed when complete. Returns the file size in bytes.

    Raises:
        KeyError: a group's fetched state has no tensor for a leaf's key.
    """
    leaves = list(find_deferred(obj))
    groups: dict[Hashable, list[Deferred]] = {}
    for leaf in leaves:
        groups.setdefault(leaf.group, []).append(leaf)
    keys = {id(leaf): f"d{i}" for i, leaf in enumerate(leaves)}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.partial"
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
            torch_archive.write_format_records(archive)
            for group, members in groups.items():
                state = fetch(group)
                for leaf in members:
                    if leaf.key not in state:
                        raise KeyError(f"the state of {group!r} has no tensor {leaf.key!r}")
                    tensor = state[leaf.key].detach().cpu().contiguous()
                    leaf.shape, leaf.dtype = tuple(tensor.shape), tensor.dtype
                    flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor.new_empty(0)
                    data = memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]
                    torch_archive.write_record(archive, f"data/{keys[id(leaf)]}", [data])
                del state, tensor, flat
            buffer = io.BytesIO()
            storages: dict[str, Any] = {}
            with warnings.catch_warnings():
                warnings.simplefilter(
                    "ignore", UserWarning
                )  # TypedStorage is deprecated, but torch pickles it
                _DeferredPickler(buffer, storages, keys).dump(obj)
            for key, storage in storages.items():
                torch_archive.write_record(archive, f"data/{key}", [torch_archive.storage_bytes(storage)])
            torch_archive.write_record(archive, "data.pkl", [buffer.getvalue()])
            torch_archive.write_version_record(archive)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return os.path.getsize(path)


@dataclass
class _DeferredStorage:
    leaf: Deferred
    key: str
    numel: int


class _DeferredPickler(torch_archive.StoragePickler):
    """``torch.save``'s pickling, with a Deferred leaf pickled as the tensor whose record was written already."""

    def __init__(self, file: io.BytesIO, storages: dict[str, Any], keys: dict[int, str]):
        super().__init__(file, storages)
        self.deferred_keys = keys

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Deferred):
            storage = _DeferredStorage(obj, self.deferred_keys[id(obj)], torch_archive.numel_of(obj.shape))
            return torch_archive.rebuild_as_tensor(storage, obj.shape)
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _DeferredStorage):
            dtype = obj.leaf.dtype
            assert dtype is not None
            return ("storage", torch_archive.storage_type_of(dtype), obj.key, "cpu", obj.numel)
        return super().persistent_id(obj)
