"""Transports: one :class:`~.protocol.StageRequest` to one peer, one :class:`~.protocol.StageReply` back.

- :class:`LocalTransport`: the peer is this very process (libp2p cannot dial itself): the request goes to the
  in-process :class:`~.server.StageServer` object as it is, without serialisation.
- :class:`P2PTransport`: over hivemind's P2P. A trainer keeps long-lived streams (*channels*,
  ``StageService.rpc_channel``) to each stage of each peer it uses, and opens another when every one is busy
  (calls from several threads). A call travels as one or more messages each way: the tensor parts (see
  :mod:`.codec`) first, the header (see :mod:`.protocol`) in the last message. The sender puts message ``i``
  on the wire while it encodes message ``i + 1``, and the receiver decodes message ``i`` while ``i + 1`` is in
  flight, so encoding, transfer and decoding overlap.

Both return the reply and the bytes sent and received; both raise :class:`TransportError` (or a timeout) when
the peer did not answer, which the client treats as a peer failure. An error *reply* is not a transport
failure: it comes back as a :class:`~.protocol.StageReply` with ``error`` set.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from lightning_swarm.swarm.loop import get_loop, run_coroutine
from lightning_swarm.swarm.wire.codec import CodecError, PartsDecoder, TooLarge
from lightning_swarm.swarm.wire.errors import REQUEST, NotKept, ProtocolError
from lightning_swarm.swarm.wire.payload import EncodedPayload, Payload
from lightning_swarm.swarm.wire.protocol import (
    MAX_REPLY_BYTES,
    MAX_REQUEST_TENSORS,
    StageReply,
    StageRequest,
    encode_request_header,
    parse_reply,
)

__all__ = ["LocalTransport", "MessageReceiver", "P2PTransport", "TransportError", "call_lean", "messages"]

logger = logging.getLogger(__name__)

Msg = TypeVar("Msg", runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse)

# a message is sent once it holds this many bytes of parts: one 8-bit part of 64 Ki elements (66 KB) goes out
# on its own, so that sending overlaps with quantizing; small tensors share messages
MESSAGE_BYTES = 64 * 1024
# Payloads whose encoded size exceeds this are cut into block-aligned parts (64 Ki elements each, see
# codec.PART_ELEMENTS) and pipelined: the sender encodes part i + 1 while part i is on the wire, the receiver
# decodes part i while part i + 1 is in flight (both on the event loop, without a thread hand-over per message).
# Smaller payloads go as one message each way: on a 2-core box a hop is bound by the CPU, not the wire, and the
# parts' codec work competes with the daemons moving the earlier parts (1 MiB of fp32 in 8 bits over a 1 Gbit/s
# link, interleaved runs: 11-14 ms as one message each way, 13-25 ms in parts of 64 Ki elements; see README).
SPLIT_ABOVE = 2 * 1024 * 1024 - 64 * 1024


class TransportError(ConnectionError):
    """A request did not get a reply (the peer is gone, the stream broke, or the reply was malformed)."""


def messages(
    message_type: type[Msg],
    parts: Iterable[runtime_pb2.Tensor],
    header: bytes,
    message_bytes: float = MESSAGE_BYTES,
) -> Iterator[Msg]:
    """Group ``parts`` (consumed lazily) into messages of about ``message_bytes``; the last carries ``header``."""
    batch: list[runtime_pb2.Tensor] = []
    size = 0
    for part in parts:
        batch.append(part)
        size += len(part.buffer) + 32
        if size >= message_bytes:  # full: out now, before the next part is encoded
            yield message_type(tensors=batch)
            batch, size = [], 0
    yield message_type(tensors=batch, metadata=header)


class MessageReceiver:
    """Decodes the messages of one call as they arrive (see :func:`messages`).

    :meth:`feed` returns True once the last message (the one with the header) has arrived; :meth:`result` then
    gives ``(header, tensors)`` or raises the ``CodecError`` that a malformed part caused (the rest of the
    call's messages are still consumed, so a channel stays in step).

    Limits (a receiver of untrusted messages sets them; the defaults accept anything): ``max_bytes`` of decoded
    tensors (a tensor declaring more is refused before it is allocated), ``max_tensors``, ``max_message_bytes``
    per message on the wire and ``max_messages`` per call. Past a limit the call is marked :attr:`too_large`
    (the error is a :class:`~.codec.TooLarge`) and nothing more is decoded or kept.
    """

    def __init__(
        self,
        max_bytes: float = math.inf,
        max_tensors: float = math.inf,
        max_message_bytes: float = math.inf,
        max_messages: float = math.inf,
    ) -> None:
        self._decoder: PartsDecoder | None = PartsDecoder(max_bytes, max_tensors)
        self._error: CodecError | None = None
        self._header = b""
        self.max_message_bytes, self.max_messages = max_message_bytes, max_messages
        self.messages = 0

    @property
    def too_large(self) -> bool:
        """Whether the call exceeded a limit (the sender should be cut off rather than waited for)."""
        return isinstance(self._error, TooLarge)

    def feed(self, message: runtime_pb2.ExpertRequest | runtime_pb2.ExpertResponse) -> bool:
        self.messages += 1
        if self._decoder is not None:
            try:
                if self.messages > self.max_messages:
                    raise TooLarge(f"A call was sent in more than {self.max_messages} messages")
                if self.max_message_bytes < math.inf and message.ByteSize() > self.max_message_bytes:
                    raise TooLarge(
                        f"Received a message of {message.ByteSize()} bytes; the limit is "
                        f"{self.max_message_bytes:.0f} bytes per message"
                    )
                for part in message.tensors:
                    self._decoder.feed(part)
            except CodecError as e:
                self._decoder, self._error = None, e
        self._header = message.metadata
        return bool(message.metadata)

    def result(self) -> tuple[bytes, list[torch.Tensor]]:
        if self._decoder is None:
            assert self._error is not None
            raise self._error
        return self._header, self._decoder.finish()


def encode_request(
    request: StageRequest,
    compression: str,
    split_above: float = SPLIT_ABOVE,
    reuse_inputs: EncodedPayload | None = None,
) -> tuple[bytes, list[EncodedPayload]]:
    """``(header, encoded payloads)`` of a request; the parts are encoded lazily. ``reuse_inputs``: the inputs
    already encoded (a backward re-sends the forward's inputs without encoding them again)."""
    payloads = request.payloads()
    split = sum(p.estimated_bytes(compression) for p in payloads) > split_above
    encoded = [p.encode(compression, split_above=0.0 if split else math.inf) for p in payloads[1:]]
    inputs = (
        reuse_inputs
        if reuse_inputs is not None
        else payloads[0].encode(compression, 0.0 if split else math.inf)
    )
    encoded.insert(0, inputs)
    grads = encoded[1] if len(encoded) > 1 else None
    return encode_request_header(request, inputs, grads), encoded


def call_lean(
    transport: P2PTransport,
    request: StageRequest,
    encoded: tuple[bytes, list[EncodedPayload]],
    timeout: float | None,
) -> tuple[StageReply, int, int, bool]:
    """Send a backward (``encoded`` with its inputs) to the peer that kept its forward without its inputs (see
    :mod:`.protocol`), and again with them if that peer no longer keeps it (:class:`~.errors.NotKept`). Returns
    the reply, the bytes sent and received (both sends), and whether the inputs stayed home."""
    grads = encoded[1][1]
    lean = (encode_request_header(request, None, grads), [grads])
    reply, sent, recv = transport.call(request, lean, timeout)
    if reply.error is None or reply.error.type_name != NotKept.__name__:
        return reply, sent, recv, True
    reply, sent_again, recv_again = transport.call(request, encoded, timeout)
    return reply, sent + sent_again, recv + recv_again, False


class LocalTransport:
    """Calls go straight to an in-process stage server (``server.handle``), without serialisation."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def call(
        self, request: StageRequest, encoded: Any = None, timeout: float | None = None
    ) -> tuple[StageReply, int, int]:
        return self.server.handle(request), 0, 0

    def close(self) -> None:
        pass


class P2PTransport:
    """Calls to one stage of one remote peer over long-lived channels.

    Args:
        p2p: this process's P2P replica (shared by every transport of the client).
        peer_id: the remote peer.
        namespace: the stage's uid (the RPC namespace of its handlers).
        stub_factory: ``StageService.get_stub``-compatible callable ``(p2p, peer_id, namespace) -> stub``.
        timeout: seconds a call may take end to end.
        stop: polled while a call waits for its reply (see :func:`~._loop.run_coroutine`): a peer that is stopping,
            or that learnt of another peer's failure, abandons the call at once.
    """

    def __init__(
        self,
        p2p: P2P,
        peer_id: PeerID,
        namespace: str,
        stub_factory: Any,
        timeout: float,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        self.stub = stub_factory(p2p, peer_id, namespace=namespace)
        self.peer_id, self.timeout, self.stop = peer_id, timeout, stop
        self._idle: list[_Channel] = []
        self._lock = threading.Lock()
        self.channels_opened = 0

    def call(
        self,
        request: StageRequest,
        encoded: tuple[bytes, list[EncodedPayload]],
        timeout: float | None = None,
    ) -> tuple[StageReply, int, int]:
        """Send ``request`` (already encoded as ``(header, payloads)``); returns the reply and bytes sent/received.
        ``timeout``: seconds this call may take (default: the transport's).

        A channel that worked before and fails now is replaced once without blaming the peer (the daemon may
        have dropped an idle stream); other failures raise :class:`TransportError` or ``TimeoutError``.
        """
        header, payloads = encoded
        for fresh_attempt in (False, True):
            channel = self._take_channel()
            reused = channel.calls > 0
            try:
                parts = itertools.chain.from_iterable(p.parts() for p in payloads)
                split = any(p.split for p in payloads)
                size = MESSAGE_BYTES if split else math.inf  # not split: everything in one message
                outgoing = messages(runtime_pb2.ExpertRequest, parts, header, size)
                reply_header, tensors, sent, recv = channel.call(outgoing, timeout or self.timeout, self.stop)
            except BaseException as e:
                channel.close()  # broken, or cut mid-call (abandoned: this peer stops)
                if not isinstance(e, Exception):
                    raise
                if reused and not fresh_attempt and not isinstance(e, TimeoutError):
                    logger.debug(
                        f"A channel to {self.peer_id} broke after {channel.calls} calls ({e!r}); reopening"
                    )
                    continue
                if isinstance(e, (TimeoutError, TransportError)):
                    raise
                raise TransportError(f"{type(e).__name__}: {e}") from e
            channel.calls += 1
            self._give_back(channel)
            try:
                reply = parse_reply(reply_header, tensors)
            except CodecError as e:  # ProtocolError included: the peer replied garbage
                raise TransportError(f"Peer {self.peer_id} sent a malformed reply: {e}") from e
            if reply.request_id == -1 and reply.error is not None:  # refused before its id was read
                # refused for its own content (e.g. too large): the caller's fault, not the peer's
                if reply.error.category == REQUEST:
                    return StageReply(request.request_id, error=reply.error), sent, recv
                raise TransportError(
                    f"Peer {self.peer_id} refused the request ({reply.error.category}): {reply.error.type_name}: "
                    f"{reply.error.message}"
                )
            if reply.request_id != request.request_id:
                raise TransportError(
                    f"Peer {self.peer_id} answered request {reply.request_id} instead of {request.request_id}"
                )
            return reply, sent, recv
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for channel in idle:
            channel.close()

    def _take_channel(self) -> _Channel:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.channels_opened += 1
        return _Channel(self.stub)

    def _give_back(self, channel: _Channel) -> None:
        with self._lock:
            self._idle.append(channel)


class _Channel:
    """A long-lived stream to one stage of one peer (``StageService.rpc_channel``), one call at a time.

    A call runs on the swarm event loop from start to end, with one hand-over from the calling thread and one
    back: the request's messages are encoded there one at a time, each as the previous one goes on the wire (a
    tensor's parts are encoded lazily, so quantizing part ``i + 1`` overlaps with sending part ``i``), and the
    reply's messages are decoded as they arrive. Handing every message between threads instead costs a wake-up
    of each thread per message, which on a busy 2-core machine costs more than the overlap saves.
    """

    def __init__(self, stub: Any):
        self.stub = stub
        self.calls = 0
        self._outbox: asyncio.Queue | None = None
        self._replies: Any = None

    async def _open(self) -> None:
        outbox: asyncio.Queue = asyncio.Queue()

        async def outgoing() -> AsyncIterator[runtime_pb2.ExpertRequest]:
            while (item := await outbox.get()) is not None:
                message, taken = item
                if not taken.done():
                    taken.set_result(None)  # the sender may encode the next message: this one is written now
                yield message

        self._outbox = outbox
        self._replies = await self.stub.rpc_channel(outgoing())

    async def _exchange(self, outgoing: Iterator[runtime_pb2.ExpertRequest]) -> tuple[bytes, list, int, int]:
        """Send the request's messages and decode the reply's (runs on the swarm event loop)."""
        if self._replies is None:
            await self._open()
        assert self._outbox is not None
        loop = asyncio.get_running_loop()
        receiving = asyncio.ensure_future(self._receive())
        sent = 0
        try:
            for message in outgoing:  # encoded here, one message at a time
                sent += message.ByteSize()
                taken = loop.create_future()
                self._outbox.put_nowait((message, taken))
                if message.metadata:  # the last one (it carries the header): nothing more to encode
                    break
                # hivemind's writer takes it and writes it before this task resumes; a reply (or a broken
                # channel) before the request's end stops the sending
                await asyncio.wait((taken, receiving), return_when=asyncio.FIRST_COMPLETED)
                if receiving.done():
                    break
            header, tensors, received = await receiving
        finally:
            if not receiving.done():
                receiving.cancel()
        return header, tensors, sent, received

    async def _receive(self) -> tuple[bytes, list, int]:
        """The reply: its messages decoded as they arrive, each while the next is in flight."""
        receiver = _reply_receiver()
        received = 0
        while True:
            try:
                reply = await self._replies.__anext__()
            except StopAsyncIteration:
                raise TransportError("the peer closed the channel") from None
            received += reply.ByteSize()
            if receiver.feed(reply):
                break
        try:
            header, tensors = receiver.result()
        except CodecError as e:
            raise ProtocolError(f"the reply's tensors are malformed: {e}") from e
        return header, tensors, received

    def call(
        self,
        outgoing: Iterator[runtime_pb2.ExpertRequest],
        timeout: float,
        stop: Callable[[], bool] | None = None,
    ) -> tuple[bytes, list, int, int]:
        """Send the messages (encoded lazily, on the event loop) and decode the reply's; bounded by ``timeout``,
        abandoned once ``stop`` says so. Returns the reply's header and tensors and the bytes sent and received."""
        return run_coroutine(
            asyncio.wait_for(self._exchange(outgoing), timeout), timeout=timeout + 5, stop=stop
        )

    def close(self) -> None:
        """End the stream (from any thread; idempotent)."""
        outbox, replies, self._outbox, self._replies = self._outbox, self._replies, None, None
        if outbox is None:
            return
        loop = get_loop()
        loop.call_soon_threadsafe(outbox.put_nowait, None)
        if replies is not None:
            asyncio.run_coroutine_threadsafe(replies.aclose(), loop)


def _reply_receiver() -> MessageReceiver:
    """A receiver for a stage call's reply: bounded, so that a hostile peer cannot make a trainer allocate
    without limit (:data:`~.protocol.MAX_REPLY_BYTES` of decoded tensors)."""
    return MessageReceiver(max_bytes=MAX_REPLY_BYTES, max_tensors=MAX_REQUEST_TENSORS)


def decode_payload_stream(received: Iterable[Msg]) -> Payload:
    """The payload of a one-way message stream (e.g. ``rpc_state``): parts, then the payload metadata."""
    receiver = MessageReceiver()
    done = False
    for message in received:
        done = receiver.feed(message)
    if not done:
        raise TransportError("the stream ended before its last message")
    metadata, tensors = receiver.result()
    return Payload.from_wire(metadata, tensors)
