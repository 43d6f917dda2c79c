"""Payloads: a nested Python structure of tensors and plain values <-> ``(skeleton, tensors)``.

A stage call's ``(*args, **kwargs)``, a stage's outputs and a backward's output gradients are all payloads. A
call is flattened once per hop on each side: the trainer's proxy flattens its arguments into a
:class:`Payload`, which travels as it is (in-process) or encoded (:meth:`Payload.encode`) to the server; the
server rebuilds the structure once to call the module and flattens the outputs once; the trainer rebuilds them
once. Skeleton nodes: plain scalars as themselves; containers as tagged msgpack arrays: ``["T", index]``
tensor, ``["t", *items]`` tuple, ``["l", *items]`` list, ``["d", k0, v0, k1, v1, ...]`` dict.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
from hivemind.proto import runtime_pb2

from lightning_swarm.swarm.wire.codec import CodecError, check_compression, encode_parts, estimated_bytes

__all__ = ["EncodedPayload", "Payload"]

_SCALARS = (type(None), bool, int, float, str, bytes)
_MAX_DEPTH = 64


@dataclass
class Payload:
    """A structure as its msgpack-able ``skeleton`` and its ``tensors`` (in order)."""

    skeleton: Any
    tensors: list[torch.Tensor]

    @classmethod
    def flatten(cls, obj: Any) -> Payload:
        """Split ``obj`` into skeleton and tensors; raises ``CodecError`` for objects that cannot travel."""
        tensors: list[torch.Tensor] = []
        return cls(_flatten(obj, tensors, 0), tensors)

    @classmethod
    def call(cls, args: tuple, kwargs: dict) -> Payload:
        """The payload of a call ``(*args, **kwargs)``."""
        return cls.flatten((tuple(args), dict(kwargs)))

    def rebuild(self, tensors: Sequence[torch.Tensor] | None = None) -> Any:
        """The structure, with ``tensors`` (default: this payload's) in the tensor slots."""
        tensors = self.tensors if tensors is None else tensors
        return _rebuild(self.skeleton, tensors, 0)

    def rebuild_call(self, tensors: Sequence[torch.Tensor] | None = None) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of a call payload; raises ``CodecError`` if it is not a call."""
        structure = self.rebuild(tensors)
        if (
            not isinstance(structure, tuple)
            or len(structure) != 2
            or not isinstance(structure[0], tuple)
            or not isinstance(structure[1], dict)
            or not all(isinstance(k, str) for k in structure[1])
        ):
            raise CodecError("Malformed call: expected (args tuple, kwargs dict with string keys)")
        return structure

    def batch_size(self) -> int:
        """The microbatch size: the first dimension of the first tensor that has one (1 if none)."""
        for t in self.tensors:
            if t.dim() > 0:
                return int(t.shape[0])
        return 1

    def estimated_bytes(self, compression: str) -> int:
        """About how many bytes the tensors take on the wire with ``compression`` (without encoding them)."""
        return sum(estimated_bytes(t, compression) for t in self.tensors)

    def metadata(self) -> bytes:
        """The skeleton and tensor count as msgpack bytes (the tensors travel as parts next to it)."""
        try:
            return msgpack.packb([self.skeleton, len(self.tensors)], use_bin_type=True)
        except (OverflowError, ValueError, TypeError) as e:
            raise CodecError(f"Cannot serialize the structure: {e}") from None

    @classmethod
    def from_wire(cls, metadata: bytes, tensors: Sequence[torch.Tensor]) -> Payload:
        """Inverse of :meth:`metadata` plus the decoded tensors; raises ``CodecError`` if they do not match."""
        try:
            parsed = msgpack.unpackb(metadata, raw=False, strict_map_key=False)
        except Exception as e:  # msgpack raises many types on garbage
            raise CodecError(f"Malformed payload metadata ({type(e).__name__}: {e})") from None
        if not isinstance(parsed, list) or len(parsed) != 2 or type(parsed[1]) is not int:
            raise CodecError("Malformed payload metadata: expected [skeleton, num_tensors]")
        if parsed[1] != len(tensors):
            raise CodecError(
                f"Payload metadata describes {parsed[1]} tensors but {len(tensors)} were received"
            )
        payload = cls(parsed[0], list(tensors))
        payload.rebuild()  # validates every node and tensor reference
        return payload

    def encode(self, compression: str, split_above: float = math.inf) -> EncodedPayload:
        """This payload for the wire, its tensor parts encoded lazily (see :class:`EncodedPayload`)."""
        return EncodedPayload(self, compression, split_above)


class EncodedPayload:
    """A payload whose metadata is ready at once and whose tensor parts are encoded on demand.

    :meth:`parts` yields the parts in order, encoding each the first time it is reached and replaying it
    afterwards (a retry re-sends what was already encoded). Not thread-safe: one thread iterates at a time.

    Args:
        payload: what to encode.
        compression: one of ``codec.COMPRESSIONS``, applied to the floating tensors.
        split_above: large tensors are cut into ``codec.num_parts`` parts (for pipelined sending) when the
            payload's estimated size exceeds this many bytes; otherwise every tensor is one part.
    """

    def __init__(self, payload: Payload, compression: str, split_above: float = math.inf):
        check_compression(compression)
        self.metadata: bytes = payload.metadata()
        self.num_tensors = len(payload.tensors)
        self.estimated_bytes = len(self.metadata) + payload.estimated_bytes(compression)
        split = self.split = self.estimated_bytes > split_above
        self._pending = (part for t in payload.tensors for part in encode_parts(t, compression, split))
        self._done: list[runtime_pb2.Tensor] = []
        self._complete = False

    def parts(self) -> Iterator[runtime_pb2.Tensor]:
        """Every part, in order (encoded lazily the first time)."""
        index = 0
        while True:
            if index == len(self._done):
                part = None if self._complete else next(self._pending, None)
                if part is None:
                    self._complete = True
                    return
                self._done.append(part)
            yield self._done[index]
            index += 1


def _flatten(obj: Any, tensors: list[torch.Tensor], depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise CodecError(f"Stage arguments or outputs are nested deeper than {_MAX_DEPTH} levels")
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return ["T", len(tensors) - 1]
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, tuple):
        return ["t", *(_flatten(item, tensors, depth + 1) for item in obj)]
    if isinstance(obj, list):
        return ["l", *(_flatten(item, tensors, depth + 1) for item in obj)]
    if isinstance(obj, dict):
        node: list[Any] = ["d"]
        for key, value in obj.items():
            node.append(_flatten(key, tensors, depth + 1))
            node.append(_flatten(value, tensors, depth + 1))
        return node
    raise CodecError(
        f"Cannot send a {type(obj).__name__} across a stage boundary; stage arguments and outputs may contain "
        f"tensors, None, bool, int, float, str, bytes and tuples/lists/dicts of those"
    )


def _rebuild(node: Any, tensors: Sequence[torch.Tensor], depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise CodecError(f"Metadata is nested deeper than {_MAX_DEPTH} levels")
    if isinstance(node, _SCALARS):
        return node
    if not isinstance(node, list) or not node or not isinstance(node[0], str):
        raise CodecError(f"Malformed metadata node of type {type(node).__name__}")
    tag = node[0]
    if tag == "T":
        if len(node) != 2 or type(node[1]) is not int or not 0 <= node[1] < len(tensors):
            raise CodecError(f"Malformed tensor reference {node!r} ({len(tensors)} tensors received)")
        return tensors[node[1]]
    if tag == "t":
        return tuple(_rebuild(item, tensors, depth + 1) for item in node[1:])
    if tag == "l":
        return [_rebuild(item, tensors, depth + 1) for item in node[1:]]
    if tag == "d":
        if len(node) % 2 != 1:
            raise CodecError("Malformed dict node in metadata (odd number of keys and values)")
        result = {}
        for i in range(1, len(node), 2):
            key = _rebuild(node[i], tensors, depth + 1)
            try:
                result[key] = _rebuild(node[i + 1], tensors, depth + 1)
            except TypeError as e:  # unhashable key
                raise CodecError(f"Malformed dict key in metadata: {e}") from None
        return result
    raise CodecError(f"Unknown metadata tag {tag!r}")
