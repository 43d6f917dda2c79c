"""Request/response framing shared by the stage server and the swarm client.

A payload is call metadata plus the tensors' parts (see :func:`~.codec.encode_parts`): each part is a
block-aligned, independently decodable slice of one tensor. Small payloads travel as one unary
``ExpertRequest``/``ExpertResponse`` over the daemon's persistent connection. Large ones are *streamed*: the
parts are grouped into messages of about :data:`STREAM_MESSAGE_BYTES`, and the sender puts message ``i`` on the
wire while it encodes message ``i + 1``, and the receiver decodes message ``i`` while message ``i + 1`` is in
flight. The first message of a stream carries the metadata (and, for requests, the stage uid).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

import msgpack
from hivemind.p2p.p2p_daemon_bindings.control import MAX_UNARY_PAYLOAD_SIZE
from hivemind.proto import runtime_pb2

from .codec import CodecError, PartsDecoder

__all__ = [
    "MAX_UNARY_PAYLOAD_SIZE",
    "STREAM_MESSAGE_BYTES",
    "RemoteStageError",
    "channel_error",
    "channel_reply",
    "channel_request",
    "decode_messages",
    "messages",
    "parse_channel_reply",
    "parse_channel_request",
]
_CHANNEL_KINDS = ("forward", "backward")

# a streamed message is sent once it holds this many bytes of parts: one 8-bit part of 64 Ki elements (66 KB)
# goes out on its own, so that sending overlaps with quantizing; small tensors share messages
STREAM_MESSAGE_BYTES = 64 * 1024

Msg = TypeVar("Msg", runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse)


class RemoteStageError(RuntimeError):
    """The peer received a call but could not serve it (its error message is included)."""


# A channel (``StageServer.rpc_channel``) is a long-lived stream to one stage of one peer that carries one call
# at a time: a request's metadata is ``[kind, call metadata]``, a reply's ``["ok", reply metadata]`` or
# ``["error", message]``.


def channel_request(kind: str, metadata: bytes) -> bytes:
    """Metadata of a channel request."""
    return msgpack.packb([kind, metadata], use_bin_type=True)


def parse_channel_request(metadata: bytes) -> tuple[str, bytes]:
    """``(kind, call metadata)`` of a channel request; raises ``ValueError`` if malformed."""
    try:
        kind, inner = msgpack.unpackb(metadata, raw=False)
    except Exception as e:
        raise ValueError(f"Malformed channel request ({type(e).__name__}: {e})") from None
    if kind not in _CHANNEL_KINDS or not isinstance(inner, bytes):
        raise ValueError(f"Malformed channel request: expected [one of {_CHANNEL_KINDS}, bytes]")
    return kind, inner


def channel_reply(metadata: bytes) -> bytes:
    """Metadata of a successful channel reply."""
    return msgpack.packb(["ok", metadata], use_bin_type=True)


def channel_error(error: BaseException) -> bytes:
    """Metadata of a failed channel reply."""
    return msgpack.packb(["error", f"{type(error).__name__}: {error}"[:4096]], use_bin_type=True)


def parse_channel_reply(metadata: bytes) -> bytes:
    """The reply's call metadata; raises ``RemoteStageError`` for an error reply, ``CodecError`` if malformed."""
    try:
        status, inner = msgpack.unpackb(metadata, raw=False)
    except Exception as e:
        raise CodecError(f"Malformed channel reply ({type(e).__name__}: {e})") from None
    if status == "error" and isinstance(inner, str):
        raise RemoteStageError(inner)
    if status != "ok" or not isinstance(inner, bytes):
        raise CodecError("Malformed channel reply: expected ['ok', bytes] or ['error', str]")
    return inner


def messages(
    message_type: type[Msg],
    parts: Iterable[runtime_pb2.Tensor],
    metadata: bytes,
    uid: str | None = None,
    message_bytes: int = STREAM_MESSAGE_BYTES,
) -> Iterator[Msg]:
    """Group ``parts`` (consumed lazily) into streamed messages of at least about ``message_bytes`` each."""
    header = {"metadata": metadata} if uid is None else {"metadata": metadata, "uid": uid}
    batch: list[runtime_pb2.Tensor] = []
    size = 0
    first = True
    for part in parts:
        batch.append(part)
        size += len(part.buffer) + 32
        if size >= message_bytes:
            yield message_type(tensors=batch, **(header if first else {}))
            batch, size, first = [], 0, False
    if batch or first:
        yield message_type(tensors=batch, **(header if first else {}))


def decode_messages(received: Iterable[Msg]) -> tuple[list, bytes, str]:
    """Decode streamed messages into ``(tensors, metadata, uid)``; raises ``CodecError`` if malformed."""
    decoder = PartsDecoder()
    metadata, uid = b"", ""
    count = 0
    for count, message in enumerate(received, start=1):
        if count == 1:
            metadata = message.metadata
            uid = getattr(message, "uid", "")
        for part in message.tensors:
            decoder.feed(part)
    if count == 0:
        raise CodecError("Received an empty stream")
    return decoder.finish(), metadata, uid
