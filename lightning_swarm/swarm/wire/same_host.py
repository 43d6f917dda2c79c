"""The same-host path: stage calls between peers of one machine over a Unix socket, not through the p2p daemons.

Over hivemind's P2P a call's every message crosses two p2p daemons (the caller's and the callee's), each reading
it from a Unix socket, framing it and writing it again; on a small box the daemons burn about a sixth of the CPU
of a swarm training on it. Peers that share a machine (and a network namespace) skip them: a stage server also
listens on a Unix socket, and a trainer on the same machine that finds it carries its calls there, with the
same messages (:mod:`.transport`'s channels, ``StageService.rpc_channel`` on the far side: the same checks, caps
and bans). Calls to peers elsewhere go over P2P as before; so does everything else (DHT, averaging, state).

Where the sockets are: ``$XDG_RUNTIME_DIR`` (else the temp directory) ``/lightning-swarm-<uid>/net-<inode>/``,
one socket per stage server, named by a hash of its peer id and stage uid. The ``net-<inode>`` level is the
network namespace: peers in different namespaces (a benchmark's shaped links) never find each other's sockets,
so their calls keep to the network. Who may call: processes of the same user only (the directories are ``0700``
and the server checks the caller's uid, ``SO_PEERCRED``), the same trust as the p2p daemon's own control socket.
A private swarm (``secret`` or ``allowed_peers``) keeps every call on its authenticated P2P path: its servers do
not listen here.

Wire format: each message is a 4-byte big-endian length and a serialized ``ExpertRequest`` / ``ExpertResponse``.
The caller first sends a hello frame: :data:`HELLO` and its peer id (for the server's per-peer caps and bans).
A frame over the size limit, a malformed frame or a foreign uid closes the connection; the server goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import stat
import struct
import tempfile
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from lightning_swarm.swarm.wire.protocol import MAX_MESSAGE_BYTES, MAX_REPLY_BYTES, StageService

__all__ = ["HELLO", "SameHostListener", "SameHostStub", "private_directory", "socket_path"]

logger = logging.getLogger(__name__)

HELLO = b"lightning-swarm-same-host/1 "
_LENGTH = struct.Struct(">I")
_MAX_HELLO = len(HELLO) + 256
_REPLY_FRAME_LIMIT = min(MAX_REPLY_BYTES + (1 << 20), 0xFFFFFFFF)  # a frame's length is 4 bytes
_STREAM_LIMIT = 1 << 20  # asyncio's read buffer (a frame is read with readexactly, whatever its size)


def private_directory(base: str | None = None) -> str | None:
    """This user's directory for this network namespace under ``base`` (default: ``$XDG_RUNTIME_DIR``, else the
    temp directory), created ``0700``; ``None`` if it is not safe to use (owned by someone else, open to others) or
    there is none (no ``/proc``: then no same-host path)."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
        uid = os.getuid()
    except (OSError, AttributeError):
        return None
    base = base or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    top = os.path.join(base, f"lightning-swarm-{uid}")
    path = os.path.join(top, f"net-{netns}")
    try:
        for d in (top, path):
            os.makedirs(d, mode=0o700, exist_ok=True)
            st = os.lstat(d)
            if st.st_uid != uid or st.st_mode & 0o077 or not stat.S_ISDIR(st.st_mode):  # lstat: a link is not
                logger.debug(f"Same-host path off: {d} is not a private directory of uid {uid}")
                return None
    except OSError as e:
        logger.debug(f"Same-host path off: cannot create its directory ({e!r})")
        return None
    return path


def socket_path(peer_id: PeerID, namespace: str) -> str | None:
    """Where the server of stage ``namespace`` on ``peer_id`` listens if it is on this machine and namespace."""
    directory = private_directory()
    if directory is None:
        return None
    name = hashlib.sha256(peer_id.to_bytes() + b"/" + namespace.encode()).hexdigest()[:24]
    return os.path.join(directory, f"{name}.sock")


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> bytes | None:
    """The next frame, or ``None`` at a clean end of the stream; raises ``ValueError`` past ``limit`` bytes."""
    try:
        head = await reader.readexactly(_LENGTH.size)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise ConnectionError("the stream ended inside a frame's length") from None
        return None
    (length,) = _LENGTH.unpack(head)
    if length > limit:
        raise ValueError(f"a frame of {length} bytes; the limit is {limit}")
    return await reader.readexactly(length)


def _write_frame(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(_LENGTH.pack(len(data)))
    writer.write(data)


class SameHostStub:
    """The caller's side: ``rpc_channel`` like a hivemind stub's, over the server's Unix socket; the stage's other
    RPCs (info, steps, state) go to ``p2p_stub``, its P2P stub."""

    def __init__(self, path: str, caller: PeerID | None, p2p_stub: Any = None) -> None:
        self.path, self.caller, self.p2p_stub = path, caller, p2p_stub

    @classmethod
    def factory(
        cls, path: str, caller: PeerID | None, p2p: Any, peer_id: PeerID, namespace: str
    ) -> SameHostStub:
        """A ``StageService.get_stub``-compatible factory (bind ``path`` and ``caller`` first)."""
        return cls(path, caller, StageService.get_stub(p2p, peer_id, namespace=namespace))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("rpc_") and self.p2p_stub is not None:
            return getattr(self.p2p_stub, name)
        raise AttributeError(name)

    async def rpc_channel(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest]
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        reader, writer = await asyncio.open_unix_connection(self.path, limit=_STREAM_LIMIT)
        _write_frame(writer, HELLO + (self.caller.to_bytes() if self.caller is not None else b""))

        async def pump() -> None:
            try:
                async for message in requests:
                    _write_frame(writer, message.SerializeToString())
                    await writer.drain()
                if writer.can_write_eof():
                    writer.write_eof()  # the channel is done: the server ends its side
            except (ConnectionError, OSError):
                pass  # the reader sees the broken stream and fails the call

        sending = asyncio.ensure_future(pump())
        return _replies(reader, writer, sending)


async def _replies(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sending: asyncio.Future
) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    try:
        while (frame := await _read_frame(reader, _REPLY_FRAME_LIMIT)) is not None:
            yield runtime_pb2.ExpertResponse.FromString(frame)
    finally:
        sending.cancel()
        writer.close()


def _sweep(directory: str) -> None:
    """Remove the sockets that killed peers left in ``directory``: nobody listens on them (the connection is
    refused at once; a live server's backlog accepts it, however busy the server is)."""
    try:
        names = [n for n in os.listdir(directory) if n.endswith(".sock")]
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.setblocking(False)
            try:
                probe.connect(path)
            except ConnectionRefusedError:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            except OSError:
                pass  # in progress (a full backlog: alive), gone already, or not a socket: leave it


class SameHostListener:
    """The server's side: accepts same-host callers and serves each connection with ``handler`` (the stage
    server's ``rpc_channel``). Start and stop it on the swarm event loop."""

    def __init__(self, path: str, handler: Any, frame_limit: int = MAX_MESSAGE_BYTES) -> None:
        self.path, self.handler = path, handler
        self.frame_limit = min(frame_limit + (1 << 20), 0xFFFFFFFF)
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task] = set()
        self.accepted = 0  # connections that passed the hello (callers served here rather than over P2P)

    async def start(self) -> None:
        _sweep(os.path.dirname(self.path))
        if os.path.exists(self.path):  # left by a process of this peer id that was killed
            os.unlink(self.path)
        self._server = await asyncio.start_unix_server(self._serve, path=self.path, limit=_STREAM_LIMIT)
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            caller = await self._greet(reader, writer)
            if caller is None:
                return
            self.accepted += 1

            async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
                while (frame := await _read_frame(reader, self.frame_limit)) is not None:
                    yield runtime_pb2.ExpertRequest.FromString(frame)

            async for reply in self.handler(requests(), SimpleNamespace(remote_id=caller)):
                _write_frame(writer, reply.SerializeToString())
                await writer.drain()
        except asyncio.CancelledError:
            pass
        except Exception as e:  # a broken or malformed connection ends; the server goes on
            logger.debug(f"Same-host connection {self.path} ended: {e!r}")
        finally:
            self._connections.discard(task)
            writer.close()

    async def _greet(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> PeerID | None:
        sock = writer.get_extra_info("socket")
        if sock is not None and hasattr(socket, "SO_PEERCRED"):
            _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid():
                logger.debug(f"Same-host connection from uid {uid} refused")
                return None
        hello = await _read_frame(reader, _MAX_HELLO)
        if hello is None or not hello.startswith(HELLO):
            logger.debug("Same-host connection without a valid hello closed")
            return None
        try:
            return PeerID(hello[len(HELLO) :]) if len(hello) > len(HELLO) else PeerID(b"same-host")
        except Exception:
            return None
