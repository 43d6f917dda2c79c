"""Writing one ordinary ``torch.save`` checkpoint of a model whose wide layers are spread over ranks, shard by shard.

A D-SLIDE rank never holds a whole wide layer, so its checkpoint cannot be gathered into one process's memory
first. Instead the state dict names each sharded tensor with a :class:`StreamedTensor` (this rank's part plus the
whole tensor's shape), and :func:`save_streamed` (collective) has rank 0 write the file in the format of
``torch.save`` (a zip archive: the pickled structure, then one record per storage, 64-byte aligned), receiving
each sharded tensor from its owners a few MB at a time and appending it to its record. The result loads with
plain ``torch.load`` (and so ``LightningModule.load_from_checkpoint``) by anyone with the memory for it, or with
``torch.load(..., mmap=True)`` without that memory.

Free of Lightning.
"""

from __future__ import annotations

import io
import json
import os
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_swarm import torch_archive
from lightning_swarm.layers.distributed import ShardGroup, shard_range

_CHUNK_BYTES = 16 << 20  # bytes moved and written at once per sharded tensor


@dataclass
class StreamedTensor:
    """A tensor split over the ranks along ``dim`` (contiguous, sizes by ``shard_range``), in a state dict.

    Args:
        local: this rank's part.
        full_shape: the whole tensor's shape.
        dim: the dimension it is split along (0, or 1 for a 2-D tensor).
    """

    local: Tensor
    full_shape: tuple[int, ...]
    dim: int

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "A StreamedTensor (a part of a tensor spread over D-SLIDE ranks) can only be saved by "
            "lightning_swarm.layers.checkpoint.save_streamed, on every rank."
        )


def save_streamed(
    obj: Any, path: str | os.PathLike, shard_group: ShardGroup, chunk_bytes: int = _CHUNK_BYTES
) -> int:
    """Write ``obj`` (with :class:`StreamedTensor` leaves) to ``path`` as ``torch.save`` would write the whole object.

    Collective: every rank calls it with structurally the same ``obj``; rank 0 writes the file. Memory: the
    pickled structure and its ordinary tensors, plus one chunk of a sharded tensor at a time.

    Args:
        obj: what to save (a Lightning checkpoint dict, say).
        path: the file rank 0 writes (through ``<path>.partial``, renamed when complete).
        shard_group: the ranks.
        chunk_bytes: bytes of a sharded tensor moved and written at once (bounds the extra memory).

    Returns:
        the file size in bytes on rank 0, 0 elsewhere.
    """
    streamed = list(_find_streamed(obj))
    if shard_group.rank != 0:
        for tensor in streamed:
            for _ in _chunks(tensor, shard_group, chunk_bytes):
                pass
        return 0
    buffer = io.BytesIO()
    storages: dict[str, Any] = {}
    keys: dict[int, str] = {}
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", UserWarning
        )  # TypedStorage is deprecated, but it is what torch pickles
        _Pickler(buffer, storages, keys).dump(obj)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.partial"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        torch_archive.write_record(archive, "data.pkl", [buffer.getvalue()])
        torch_archive.write_format_records(archive)
        for key, storage in storages.items():
            torch_archive.write_record(archive, f"data/{key}", [torch_archive.storage_bytes(storage)])
        for tensor in streamed:
            torch_archive.write_record(
                archive,
                f"data/{keys[id(tensor)]}",
                (memoryview(c.numpy()).cast("B") for c in _chunks(tensor, shard_group, chunk_bytes)),  # type: ignore[arg-type]
            )
        torch_archive.write_version_record(archive)
    os.replace(tmp, path)
    return os.path.getsize(path)


def _find_streamed(obj: Any) -> Iterator[StreamedTensor]:
    """The StreamedTensors of ``obj`` in a deterministic order (the same on every rank)."""
    if isinstance(obj, StreamedTensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _find_streamed(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _find_streamed(value)


def _chunks(tensor: StreamedTensor, group: ShardGroup, chunk_bytes: int) -> Iterator[Tensor]:
    """On rank 0: the whole tensor's bytes in order, as contiguous chunks; elsewhere: sends this rank's parts."""
    world, rank, full = group.world_size, group.rank, tensor.full_shape
    local = tensor.local.detach()
    row_numel = 1
    for size in full[1:]:
        row_numel *= size
    rows_per_chunk = max(1, chunk_bytes // max(1, row_numel * local.element_size()))
    if tensor.dim == 0:
        for owner in range(world):
            lo, hi = shard_range(full[0], owner, world)
            for a in range(0, hi - lo, rows_per_chunk):
                b = min(hi - lo, a + rows_per_chunk)
                if owner == rank == 0:
                    yield local[a:b].contiguous()
                elif rank == 0:
                    part = torch.empty((b - a, *full[1:]), dtype=local.dtype)
                    dist.recv(part, src=_global(group, owner), group=group.group)
                    group.stats.add("checkpoint_stream", part)
                    yield part
                elif rank == owner:
                    dist.send(local[a:b].contiguous(), dst=_global(group, 0), group=group.group)
    elif tensor.dim == 1 and len(full) == 2:
        widths = [hi - lo for lo, hi in (shard_range(full[1], r, world) for r in range(world))]
        rows_per_chunk = max(1, chunk_bytes // max(1, full[1] * local.element_size()))
        for a in range(0, full[0], rows_per_chunk):
            b = min(full[0], a + rows_per_chunk)
            if rank != 0:
                dist.send(local[a:b].contiguous(), dst=_global(group, 0), group=group.group)
                continue
            parts = [local[a:b]]
            for owner in range(1, world):
                part = torch.empty((b - a, widths[owner]), dtype=local.dtype)
                dist.recv(part, src=_global(group, owner), group=group.group)
                group.stats.add("checkpoint_stream", part)
                parts.append(part)
            yield torch.cat(parts, dim=1)
    else:
        raise ValueError(
            f"save_streamed: cannot stream a tensor of shape {full} split along dim {tensor.dim}."
        )


def _global(group: ShardGroup, rank: int) -> int:
    return rank if group.group is None else dist.get_global_rank(group.group, rank)


class _Pickler(torch_archive.StoragePickler):
    """``torch.save``'s pickling, with a StreamedTensor pickled as the whole tensor it stands for, with a storage
    record that is streamed later."""

    def __init__(self, file: io.BytesIO, storages: dict[str, Any], keys: dict[int, str]) -> None:
        super().__init__(file, storages)
        self.keys = keys

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, StreamedTensor):
            return torch_archive.rebuild_as_tensor(
                _Placeholder(obj, torch_archive.numel_of(tuple(obj.full_shape))), tuple(obj.full_shape)
            )
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Placeholder):
            key = self.key_for(id(obj.tensor))
            self.keys[id(obj.tensor)] = key
            return ("storage", torch_archive.storage_type_of(obj.tensor.local.dtype), key, "cpu", obj.numel)
        return super().persistent_id(obj)


@dataclass
class _Placeholder:
    tensor: StreamedTensor
    numel: int


# ----------------------------------------------------------------------------------------- sharded checkpoints
SHARDED_META = "meta.json"
"""The file that marks a sharded checkpoint folder complete (written by rank 0 once every rank has written)."""


def save_sharded(obj: dict[str, Any], directory: str | os.PathLike, shard_group: ShardGroup) -> None:
    """Write a sharded checkpoint: every rank writes its own part, ``obj`` (its rows of the sharded layers, its
    optimizer state), to ``directory/rank<r>.ckpt``; after a barrier rank 0 writes ``directory/meta.json``, which
    marks the folder complete. Collective. No rank sends or holds another rank's part: the wide layers' bytes go
    to disk in parallel, each rank's from its own memory.

    Args:
        obj: this rank's checkpoint (plain tensors, no :class:`StreamedTensor`).
        directory: the checkpoint's folder (created); on a file system every rank reads, to resume.
        shard_group: the ranks.
    """
    os.makedirs(directory, exist_ok=True)
    rank, world = shard_group.rank, shard_group.world_size
    path = os.path.join(directory, f"rank{rank}.ckpt")
    torch.save(obj, f"{path}.partial")
    os.replace(f"{path}.partial", path)
    if world > 1:
        dist.barrier(group=shard_group.group)
    if rank == 0:
        meta = {"world_size": world, "global_step": obj.get("global_step")}
        tmp = os.path.join(directory, f"{SHARDED_META}.partial")
        with open(tmp, "w") as f:
            json.dump(meta, f)
        os.replace(tmp, os.path.join(directory, SHARDED_META))


def sharded_meta(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The ``meta.json`` of a complete sharded checkpoint folder, or ``None`` (not one, or incomplete)."""
    try:
        with open(os.path.join(directory, SHARDED_META)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_sharded(directory: str | os.PathLike, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's part of a sharded checkpoint (memory-mapped), after checking it was written by as many ranks.

    Raises:
        ValueError: the folder is not a complete sharded checkpoint, or one of another number of ranks.
    """
    meta = sharded_meta(directory)
    if meta is None:
        raise ValueError(
            f"{directory} is not a complete sharded D-SLIDE checkpoint (no {SHARDED_META}: its save was "
            "interrupted?). Resume from another checkpoint."
        )
    if meta["world_size"] != world_size:
        raise ValueError(
            f"The sharded checkpoint {directory} was written by {meta['world_size']} ranks; it resumes only on "
            f"{meta['world_size']} ranks, not {world_size}. Run with as many ranks, or resume from a full "
            "checkpoint (`trainer.save_checkpoint(path)`), which loads on any number of ranks."
        )
    return torch.load(
        os.path.join(directory, f"rank{rank}.ckpt"), map_location="cpu", mmap=True, weights_only=False
    )
