"""Request/response framing shared by the stage server and the swarm client.

Small payloads travel as one unary ``ExpertRequest``/``ExpertResponse`` over the daemon's persistent
connection; payloads over hivemind's unary limit (``MAX_UNARY_PAYLOAD_SIZE``, 2 MiB: half the daemon's 4 MiB
message limit) are cut into chunks and streamed. A streamed payload is a sequence of messages whose
``tensors`` are the parts of the tensors in order: the first part of each tensor says in ``chunks`` how many
parts it has. The first message carries the metadata.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

from hivemind.p2p.p2p_daemon_bindings.control import MAX_UNARY_PAYLOAD_SIZE
from hivemind.proto import runtime_pb2

from .codec import CodecError

__all__ = ["MAX_UNARY_PAYLOAD_SIZE", "STREAM_CHUNK_BYTES", "combine", "payload_size", "split"]

STREAM_CHUNK_BYTES = 1 << 20  # parts per streamed message; large parts keep the per-message overhead low
_MAX_PARTS = 1 << 20

Msg = TypeVar("Msg", runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse)


def payload_size(tensors: Sequence[runtime_pb2.Tensor], metadata: bytes) -> int:
    """Approximate bytes of a request or response carrying ``tensors`` and ``metadata``."""
    return sum(t.ByteSize() for t in tensors) + len(metadata) + 64


def split(
    message_type: type[Msg],
    tensors: Sequence[runtime_pb2.Tensor],
    metadata: bytes,
    uid: str | None = None,
    chunk_bytes: int = STREAM_CHUNK_BYTES,
) -> Iterator[Msg]:
    """Cut a payload into streamed messages of at most about ``chunk_bytes`` each."""
    header = {"metadata": metadata} if uid is None else {"metadata": metadata, "uid": uid}
    first = True
    for tensor in tensors:
        buffer = memoryview(tensor.buffer)
        num_chunks = max(1, -(len(buffer) // -chunk_bytes))
        for i in range(num_chunks):
            part = runtime_pb2.Tensor(buffer=buffer[i * chunk_bytes : (i + 1) * chunk_bytes].tobytes())
            if i == 0:
                part.size.extend(tensor.size)
                part.dtype, part.compression = tensor.dtype, tensor.compression
                part.requires_grad, part.chunks = tensor.requires_grad, num_chunks
            yield message_type(tensors=[part], **(header if first else {}))
            first = False
    if first:  # no tensors at all
        yield message_type(**header)


def combine(messages: Iterable[Msg]) -> tuple[list[runtime_pb2.Tensor], bytes, str]:
    """Reassemble streamed messages into ``(tensors, metadata, uid)``; raises ``CodecError`` if malformed."""
    tensors: list[runtime_pb2.Tensor] = []
    metadata, uid = b"", ""
    current: runtime_pb2.Tensor | None = None
    pieces: list[bytes] = []
    remaining = 0
    for index, message in enumerate(messages):
        if index == 0:
            metadata = message.metadata
            uid = getattr(message, "uid", "")
        for part in message.tensors:
            if remaining == 0:
                if not 1 <= part.chunks <= _MAX_PARTS:
                    raise CodecError(f"Malformed stream: a tensor starts with chunks={part.chunks}")
                current, pieces, remaining = part, [part.buffer], part.chunks - 1
            else:
                pieces.append(part.buffer)
                remaining -= 1
            if remaining == 0 and current is not None:
                whole = runtime_pb2.Tensor(
                    size=current.size,
                    dtype=current.dtype,
                    compression=current.compression,
                    requires_grad=current.requires_grad,
                    buffer=pieces[0] if len(pieces) == 1 else b"".join(pieces),
                )
                tensors.append(whole)
                current, pieces = None, []
    if remaining != 0:
        raise CodecError(f"Malformed stream: it ended {remaining} parts before the last tensor was complete")
    return tensors, metadata, uid
