"""A stage server's RPC handlers (hivemind P2P), with per-peer caps on calls in flight and bans of peers
that send malformed requests."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Protocol  # noqa: UP035 (hivemind detects stream handlers by typing.AsyncIterator)

import msgpack
import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2

from lightning_swarm.swarm.server.stage_backend import error_reply
from lightning_swarm.swarm.settings import SwarmSettings
from lightning_swarm.swarm.training.stepping import StepCommand, parse_command
from lightning_swarm.swarm.wire.codec import CodecError, TooLarge
from lightning_swarm.swarm.wire.errors import REQUEST, UNAVAILABLE, BadRequest, Misrouted
from lightning_swarm.swarm.wire.guards import BadPeers
from lightning_swarm.swarm.wire.payload import Payload
from lightning_swarm.swarm.wire.protocol import (
    MAX_MESSAGE_BYTES,
    MAX_REQUEST_MESSAGES,
    MAX_REQUEST_TENSORS,
    OPTIMIZER_PART_BYTES,
    StageReply,
    StageRequest,
    StageService,
    encode_reply_header,
    parse_request,
)
from lightning_swarm.swarm.wire.transport import MESSAGE_BYTES, SPLIT_ABOVE, MessageReceiver, messages

logger = logging.getLogger(__name__)

# the optimizer state travels in parts (OPTIMIZER_PART_BYTES); uploads and downloads in progress are kept by
# token, a few at a time
_MAX_OPTIMIZER_BYTES = 64 << 30
_OPTIMIZER_TRANSFERS = 4
_tokens = itertools.count(secrets.randbits(62))
_MAX_CALLS_PER_PEER = 32  # calls of one remote peer being received or served at once (a trainer's threads)


class ServedStage(Protocol):
    """What a :class:`ConnectionHandler` needs of the server whose calls it receives (a ``StageServer``)."""

    stage: int
    uid: str
    settings: SwarmSettings

    def handle(self, request: StageRequest) -> StageReply: ...

    def info(self) -> dict[str, Any]: ...

    def state_dict_local(self) -> dict[str, torch.Tensor]: ...

    def step_command(self, command: StepCommand) -> dict[str, Any]: ...

    def optimizer_state(self) -> bytes: ...

    def load_optimizer_state(self, data: bytes) -> None: ...


class ConnectionHandler(StageService):
    """The RPCs of a stage server (hivemind P2P handlers, see :class:`~.protocol.StageService`): the call channel,
    info, steps, optimizer state and state downloads, with per-peer caps on calls in flight and bans of peers that
    send malformed requests. Calls are served by the server's public operations (``handle``, ``info``,
    ``step_command``, ...), in :attr:`executor`'s threads; none while it is ``None`` (the server is not running).

    Args:
        server: the stage server whose calls these are.
        bad_peers: which remote peers are ignored for sending bad requests.
        max_request_bytes: the decoded tensors of one request may take this many bytes.
    """

    def __init__(self, server: ServedStage, bad_peers: BadPeers, max_request_bytes: int) -> None:
        self.server, self.bad_peers, self.max_request_bytes = server, bad_peers, max_request_bytes
        self.stage, self.uid, self.settings = server.stage, server.uid, server.settings
        self.executor: ThreadPoolExecutor | None = None
        self._calls_by_peer: dict[PeerID, int] = {}
        # optimizer states in transfer, by token (see rpc_optimizer)
        self._optimizer_downloads: dict[int, bytes] = {}
        self._optimizer_uploads: dict[tuple[PeerID, int], bytearray] = {}

    # ---- RPC handlers ----

    async def rpc_channel(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A long-lived stream carrying one call after another (see :mod:`.transport`).

        Parts are decoded here as they arrive (a part is small: ~0.05 ms), overlapping with the transfer; the
        compute thread then serves the request and encodes the reply message by message, each sent as soon as it
        is ready. Every request gets a reply, an error reply if it failed; the channel stays open, except for a
        call beyond the size limits (answered at once, then the channel is closed) and for a peer this server
        ignores (see :class:`~.protocol.BadPeers`).
        """
        loop = asyncio.get_running_loop()
        peer = context.remote_id
        receiver: MessageReceiver | None = None
        counted = False  # whether a call of this channel counts in _calls_by_peer now (received to replied)
        try:
            async for message in requests:
                if receiver is None:  # the first message of a call
                    refusal = self._refusal(peer)
                    if refusal is not None:
                        yield refusal
                        return
                    receiver = self._receiver()
                    self._calls_by_peer[peer] = self._calls_by_peer.get(peer, 0) + 1
                    counted = True
                    if self._calls_by_peer[peer] > _MAX_CALLS_PER_PEER:
                        yield _reply(
                            error_reply(
                                -1,
                                UNAVAILABLE,
                                RuntimeError(
                                    f"Too many concurrent calls from peer {peer} (at most {_MAX_CALLS_PER_PEER})"
                                ),
                            )
                        )
                        return
                done_receiving = receiver.feed(message)
                if receiver.too_large:  # cut the sender off instead of waiting for the end of its call
                    try:
                        receiver.result()
                    except TooLarge as e:
                        self._strike(peer, e)
                        yield _reply(error_reply(-1, REQUEST, e))
                    return
                if not done_receiving:
                    continue
                received, receiver = receiver, None
                executor = self.executor
                if executor is None:
                    self._calls_by_peer[peer] -= 1
                    counted = False
                    error = error_reply(
                        -1, UNAVAILABLE, RuntimeError(f"Stage {self.stage} server is not running")
                    )
                    yield _reply(error)
                    continue

                def serve(
                    received: MessageReceiver = received,
                ) -> tuple[runtime_pb2.ExpertResponse, Iterator[runtime_pb2.ExpertResponse]]:
                    # the compute thread serves the call and encodes the reply's first message; the others are
                    # encoded below, on the loop, each as the previous one goes out (a large reply's parts:
                    # quantizing part i + 1 overlaps with sending part i, without a thread hand-over per part)
                    replies = self._serve_received(received, peer)
                    return next(replies), replies

                first, rest = await loop.run_in_executor(executor, serve)
                # ``rest`` never raises (a failure becomes an error reply) and ends with the reply's last message,
                # the one that carries its header
                for message in itertools.chain((first,), rest):
                    if message.metadata:
                        self._calls_by_peer[peer] -= 1
                        counted = False
                    yield message
        finally:
            if counted:
                self._calls_by_peer[peer] -= 1
            if self._calls_by_peer.get(peer, 1) <= 0:
                self._calls_by_peer.pop(peer, None)

    @property
    def max_message_bytes(self) -> int:
        """The largest request message this server accepts (over P2P or the same-host socket)."""
        return max(MAX_MESSAGE_BYTES, self.max_request_bytes + (1 << 20))

    def _receiver(self) -> MessageReceiver:
        return MessageReceiver(
            max_bytes=self.max_request_bytes,
            max_tensors=MAX_REQUEST_TENSORS,
            max_message_bytes=self.max_message_bytes,
            max_messages=MAX_REQUEST_MESSAGES,
        )

    def _refusal(self, peer: PeerID) -> runtime_pb2.ExpertResponse | None:
        """The error reply for a peer this server ignores now, or ``None``."""
        remaining = self.bad_peers.ignored_for(peer)
        if not remaining:
            return None
        return _reply(  # not this request's fault: another peer of the stage may serve it
            error_reply(
                -1,
                UNAVAILABLE,
                BadRequest(
                    f"Stage {self.stage} server ignores peer {peer} for another {remaining:.0f} s: it sent too many bad "
                    f"requests"
                ),
            )
        )

    def _strike(self, peer: PeerID | None, error: Exception) -> None:
        """Count a bad request of ``peer`` (logged at debug level: a remote peer's fault, not ours)."""
        logger.debug(f"Stage {self.stage}: bad request from {peer}: {error}")
        if peer is not None and self.bad_peers.strike(peer):
            logger.warning(
                f"Stage {self.stage}: ignoring peer {peer} for {self.bad_peers.ban_s:.0f} s after "
                f"{self.bad_peers.limit} bad requests (last: {str(error)[:200]})"
            )

    def _serve_received(
        self, received: MessageReceiver, peer: PeerID | None = None
    ) -> Iterator[runtime_pb2.ExpertResponse]:
        """Serve a received call and yield its reply messages (runs in the compute thread; never raises)."""
        request_id = -1
        try:
            try:
                header, tensors = received.result()
                request_id = _request_id(header)
                request = parse_request(header, tensors, self.uid)
            except Misrouted as e:  # another peer may serve it (a peer that migrated, another version)
                self._strike(peer, e)
                yield _reply(error_reply(request_id, UNAVAILABLE, e))
                return
            except (CodecError, BadRequest) as e:
                self._strike(peer, e)
                yield _reply(error_reply(request_id, REQUEST, e))
                return
            reply = self.server.handle(request)
            if reply.error is not None:
                if reply.error.category == REQUEST:
                    self._strike(peer, BadRequest(reply.error.message))
                yield _reply(reply)
                return
            assert reply.outputs is not None
            compression = self.settings.compression
            split = reply.outputs.estimated_bytes(compression) > SPLIT_ABOVE
            encoded = reply.outputs.encode(compression, split_above=0.0 if split else math.inf)
            size = MESSAGE_BYTES if split else math.inf  # not split: the whole reply in one message
            yield from messages(
                runtime_pb2.ExpertResponse, encoded.parts(), encode_reply_header(reply, encoded), size
            )
        except (
            Exception
        ) as e:  # a bug while encoding: end the call with an error reply (sent parts are dropped)
            logger.warning(f"Stage {self.stage}: failed to reply: {e!r}")
            yield _reply(error_reply(request_id, UNAVAILABLE, e))

    async def rpc_step(self, request: runtime_pb2.ExpertInfo, context: P2PContext) -> runtime_pb2.ExpertInfo:
        """A trainer's step command (see :mod:`.stepping`): msgpack in, msgpack reply out; a malformed command
        gets ``{"epoch": -1, "error": ...}`` and counts as a bad request of its sender."""
        remaining = self.bad_peers.ignored_for(context.remote_id)
        try:
            if remaining:
                raise BadRequest(
                    f"This peer ignores you for another {remaining:.0f} s: too many bad requests"
                )
            try:
                command = parse_command(request.serialized_info, self.uid)
            except ValueError as e:
                self._strike(context.remote_id, e)
                raise BadRequest(str(e)) from None
            loop = asyncio.get_running_loop()
            reply = await loop.run_in_executor(None, self.server.step_command, command)
        except BadRequest as e:
            reply = {"epoch": -1, "error": str(e)[:4096]}
        except Exception as e:
            # the optimizer's own failure (a bad hyper-parameter, a user optimizer that raises): the same on every
            # peer, so the trainer raises it at once instead of retrying
            logger.error(f"Stage {self.stage}: a step command failed: {e!r}")
            reply = {
                "epoch": -1,
                "fatal": True,
                "error": f"stage {self.stage}'s optimizer step raised {type(e).__name__}: {e}"[:4096],
            }
        return runtime_pb2.ExpertInfo(serialized_info=msgpack.packb(reply))

    async def rpc_optimizer(
        self, request: runtime_pb2.ExpertInfo, context: P2PContext
    ) -> runtime_pb2.ExpertInfo:
        """The stage optimizer's state for a checkpoint, or its restoration, in parts of at most
        ``OPTIMIZER_PART_BYTES`` (msgpack both ways; an ``{"error": str}`` reply if refused):

        - ``{"uid", "op": "get", "offset", "token"}`` -> ``{"state": bytes from offset, "total", "token"}``: offset 0
          without a token serialises the state and names it by a new token; the next parts ask with that token;
        - ``{"uid", "op": "set", "state": part, "offset", "total", "token"}`` -> ``{"ok": True, "done"}``: parts in
          order under a token of the caller's choosing; the last one restores the whole state."""
        try:
            remaining = self.bad_peers.ignored_for(context.remote_id)
            if remaining:
                raise BadRequest(
                    f"This peer ignores you for another {remaining:.0f} s: too many bad requests"
                )
            try:
                fields = msgpack.unpackb(request.serialized_info, raw=False)
                if not isinstance(fields, dict) or fields.get("uid") != self.uid:
                    raise BadRequest(f"This peer serves {self.uid!r}")
                op, data = fields.get("op"), fields.get("state")
                offset, total, token = fields.get("offset", 0), fields.get("total"), fields.get("token")
                if op not in ("get", "set") or (op == "set" and not isinstance(data, bytes)):
                    raise BadRequest("expected op 'get', or op 'set' with the state's bytes")
                if type(offset) is not int or offset < 0 or (token is not None and type(token) is not int):
                    raise BadRequest("expected an integer offset >= 0 and an integer token")
                if op == "set" and (
                    type(total) is not int
                    or not 0 < total <= _MAX_OPTIMIZER_BYTES
                    or token is None
                    or len(data) > OPTIMIZER_PART_BYTES  # type: ignore[arg-type]  # (bytes, checked above)
                    or offset + len(data) > total  # type: ignore[arg-type]
                ):
                    raise BadRequest(
                        "expected a part of at most OPTIMIZER_PART_BYTES within total, under a token"
                    )
            except BadRequest as e:
                self._strike(context.remote_id, e)
                raise
            except Exception as e:
                self._strike(context.remote_id, e)
                raise BadRequest(f"malformed optimizer request ({type(e).__name__})") from None
            loop = asyncio.get_running_loop()
            downloads, uploads = self._optimizer_downloads, self._optimizer_uploads
            if op == "get":
                blob = downloads.get(token) if token is not None else None
                if blob is None:
                    if offset:
                        raise BadRequest("unknown optimizer state token: ask again from offset 0")
                    blob = await loop.run_in_executor(None, self.server.optimizer_state)
                    token = next(_tokens)
                    downloads[token] = blob
                    while len(downloads) > _OPTIMIZER_TRANSFERS:
                        downloads.pop(next(iter(downloads)))
                assert token is not None
                reply: dict[str, Any] = {
                    "state": blob[offset : offset + OPTIMIZER_PART_BYTES],
                    "total": len(blob),
                    "token": token,
                }
                if offset + OPTIMIZER_PART_BYTES >= len(blob):
                    downloads.pop(token, None)
            else:
                assert (
                    isinstance(data, bytes) and isinstance(total, int) and isinstance(token, int)
                )  # (checked)
                key = (context.remote_id, token)
                buffer = uploads.get(key)
                if buffer is None:
                    if offset:
                        raise BadRequest("unknown optimizer upload: send again from offset 0")
                    buffer = uploads[key] = bytearray()
                    while len(uploads) > _OPTIMIZER_TRANSFERS:
                        uploads.pop(next(iter(uploads)))
                if offset != len(buffer):
                    uploads.pop(key, None)
                    raise BadRequest(f"optimizer upload part at {offset}, expected {len(buffer)}: send again")
                buffer += data
                done = len(buffer) >= total
                if done:
                    uploads.pop(key, None)
                    await loop.run_in_executor(None, self.server.load_optimizer_state, bytes(buffer))
                reply = {"ok": True, "done": done}
        except (BadRequest, ValueError) as e:
            reply = {"error": str(e)[:4096]}
        return runtime_pb2.ExpertInfo(serialized_info=msgpack.packb(reply, use_bin_type=True))

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        """Stage index, throughput, samples processed and optimizer epoch (msgpack dict)."""
        self._check_uid(request, context)
        return runtime_pb2.ExpertInfo(serialized_info=msgpack.packb(self.server.info()))

    def _check_uid(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> None:
        remaining = self.bad_peers.ignored_for(context.remote_id)
        if remaining:
            raise BadRequest(f"This peer ignores you for another {remaining:.0f} s: too many bad requests")
        if request.uid != self.uid:
            error = BadRequest(
                f"This peer serves {self.uid!r}, but the request was for {request.uid[:200]!r}"
            )
            self._strike(context.remote_id, error)
            raise error

    async def rpc_state(
        self, request: runtime_pb2.ExpertUID, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """The stage module's ``state_dict`` as an uncompressed payload, in messages (metadata on the last)."""
        try:
            self._check_uid(request, context)
        except BadRequest:
            yield runtime_pb2.ExpertResponse()  # no metadata: the caller reads an incomplete stream
            return
        loop = asyncio.get_running_loop()

        def encode() -> list[runtime_pb2.ExpertResponse]:
            encoded = Payload.flatten(self.server.state_dict_local()).encode("none", split_above=0.0)
            return list(messages(runtime_pb2.ExpertResponse, encoded.parts(), encoded.metadata))

        for message in await loop.run_in_executor(None, encode):
            yield message


def _reply(reply: StageReply) -> runtime_pb2.ExpertResponse:
    """A one-message error reply."""
    return runtime_pb2.ExpertResponse(metadata=encode_reply_header(reply, None))


def _request_id(header: bytes) -> int:
    """The request id of a header, or -1 if it cannot be read (the caller then sees a mismatched reply)."""
    try:
        fields = msgpack.unpackb(header, raw=False)
        return fields[2] if isinstance(fields, list) and len(fields) > 2 and type(fields[2]) is int else -1
    except Exception:
        return -1
