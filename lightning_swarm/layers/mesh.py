"""Direct TCP connections between every pair of ranks, for D-SLIDE's small per-step collectives.

A D-SLIDE step synchronises its ranks five times over small tensors (a few hundred KB at most). Through gloo each
such collective passes between four threads (the caller, a gloo worker, gloo's socket thread, back), and every
hand-over that finds a thread asleep must wake it. Here the calling thread sends and receives itself on
non-blocking sockets, spinning while it waits (or blocking in ``select`` where spinning is off).
``benchmarks/collective_latency.py`` times a 128 KB all-reduce of 2 ranks after 5 ms of compute here and through
gloo waited for by spinning, as the strategy's ``collectives="gloo"`` waits (its figures: ``docs/benchmarks.md``).

Every rank keeps one connection to every other rank. A collective sends this rank's part to every other rank
and receives theirs; an all-reduce reduces the gathered parts in rank order, so every rank gets the same bits. A
rank sends ``(world_size - 1)`` times its part (gloo's ring all-reduce: about twice the part): the right trade for
the few ranks and small tensors of D-SLIDE's step. Several collectives may be in flight (started with
:meth:`SocketMesh.start_all_reduce` or :meth:`SocketMesh.start_all_gather`); every rank starts them in the same order, and each message carries a header with its
collective's sequence number and size, so that a rank that got out of step fails with an error instead of mixing
tensors.

Membership. The mesh listens on an address other hosts can reach, so it does not take a connection's word for
which rank it is. Rank 0 publishes a random 32-byte job key in the process group's store, next to every rank's
address; an accepting rank sends each new connection a random nonce, and the connection must answer within
``handshake_timeout_s`` with its rank, the rank it wants and ``HMAC-SHA256(key, nonce, both ranks)``, from the
address its rank published; the accepting rank answers with its own HMAC, so the connecting rank knows it reached
a rank of the same job. A connection that sends anything else, too little, nothing, or claims a rank that is not
above this one, is already connected or published another address, is closed and logged as a warning, and the
rank goes on waiting for its real peers: a port scanner or a stray client does not end the job or delay it.
Connections are served side by side while they prove themselves, and the listening socket is closed once every
rank has joined. What this does not cover (the store and gloo trust the network): see ``docs/security.md``.

The engine does not import Lightning.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import itertools
import logging
import os
import secrets
import select
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<qq")  # collective sequence number, payload bytes
_MAGIC = b"LSWm"  # the first bytes of a handshake's messages (a version change changes it)
_NONCE = 16
_CHALLENGE = struct.Struct(f"<4s{_NONCE}s")  # magic, nonce: from the accepting rank
_HELLO = struct.Struct("<4sqq32s")  # magic, connecting rank, accepting rank, HMAC: the answer
_ACK = struct.Struct("<32s")  # the accepting rank's HMAC: it knows the key too
_RANKS = struct.Struct("<qq")
_MAX_PENDING = 64  # connections that have not finished their handshake, at once
STORE_PREFIX = "lightning_swarm/dslide_mesh"
"""Where the ranks publish their addresses and rank 0 the job key, in the process group's store."""
_GENERATIONS = itertools.count()  # meshes made by this process: the same count on every rank (same code path)


class MeshError(RuntimeError):
    """A collective over the mesh failed: a rank closed its connection, timed out or got out of step.

    Args:
        message: what happened and what to do.
        lost_rank: the rank whose connection closed (it failed or stopped), if that is what happened.
    """

    def __init__(self, message: str, lost_rank: int | None = None) -> None:
        super().__init__(message)
        self.lost_rank = lost_rank


def _payload(tensor: Tensor) -> memoryview:
    """The bytes of a contiguous ``tensor`` (any dtype, empty too), sharing its memory."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


class Collective:
    """One collective in flight: this rank's part on its way to every other rank, theirs on the way here."""

    def __init__(
        self, mesh: SocketMesh, tensor: Tensor, finish: Callable[[list[Tensor]], None] | None
    ) -> None:
        self.mesh, self.finish, self.done = mesh, finish, False
        self.seq = next(mesh._sequence)
        part = tensor.detach().contiguous()
        self.parts: list[Tensor] = [torch.empty_like(part) for _ in range(mesh.world_size)]
        self.parts[mesh.rank] = part
        self.views = {peer: _payload(self.parts[peer]) for peer in mesh.peers}
        self.nbytes = part.numel() * part.element_size()
        message = bytearray(_HEADER.pack(self.seq, self.nbytes))
        message += _payload(part)  # a copy: the caller may change its tensor while the message travels
        self.pending = len(mesh.peers)
        for peer in mesh.peers:
            mesh._sends[peer].append([memoryview(message), 0])
            mesh._recvs[peer].append(self)
        if self.pending == 0:  # a mesh of one rank: nothing to receive
            mesh._complete(self)
        mesh._progress()

    def is_completed(self) -> bool:
        if not self.done:
            self.mesh._progress()
        return self.done

    def wait(self) -> None:
        self.mesh._wait_for(self)


class SocketMesh:
    """One TCP connection between every pair of ``world_size`` ranks, found through the process group's store.

    Setting up, every rank listens on ``address`` and publishes it in the store; rank 0 publishes a random job key
    (32 bytes). A rank connects to every rank below it and accepts the ranks above it. A connection proves that
    it is the rank it claims to be (see :mod:`.mesh`'s *Membership*): a connection that does not is closed and
    logged as a warning, and the rank goes on waiting for the real one.

    Args:
        rank: this rank.
        world_size: the number of ranks.
        store: a ``torch.distributed`` store every rank shares (``dist.distributed_c10d._get_default_store()``).
        address: the address other ranks reach this rank at; this rank's connections to the others leave from it.
        timeout_s: how long a collective (and setting up the mesh) may wait for another rank.
        spin_s: how long a wait spins on the sockets before it blocks in ``select``, or a function that returns
            it (asked at each wait).
        handshake_timeout_s: how long an accepted connection may take to prove that it is a rank of this job
            before it is closed (seconds).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: Any,
        address: str,
        timeout_s: float = 1800.0,
        spin_s: float | Callable[[], float] = 0.0,
        handshake_timeout_s: float = 5.0,
    ) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self._spin = spin_s if callable(spin_s) else (lambda: spin_s)
        self._sequence = itertools.count()
        self.conns: dict[int, socket.socket] = {}
        self.refused: list[str] = []
        """Why each connection that failed the handshake was closed (also logged as warnings)."""
        prefix = f"{STORE_PREFIX}/{next(_GENERATIONS)}"
        deadline = time.monotonic() + timeout_s
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        listener = socket.create_server((address, 0), family=family, backlog=max(world_size, 64))
        try:
            if rank == 0:
                store.set(f"{prefix}/key", secrets.token_hex(32))
            store.set(f"{prefix}/{rank}", f"{address} {listener.getsockname()[1]}")  # split on the last space
            key = bytes.fromhex(store.get(f"{prefix}/key").decode())
            for peer in range(rank):  # connect to the ranks below, accept the ranks above
                host, port = store.get(f"{prefix}/{peer}").decode().rsplit(" ", 1)
                self.conns[peer] = self._connect(peer, host, int(port), address, key, deadline)
            if rank + 1 < world_size:
                self._accept(listener, store, prefix, key, deadline)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()  # no connection is taken after setup
        for conn in self.conns.values():
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setblocking(False)
        self.peers = sorted(self.conns)
        self._sends: dict[int, deque[list[Any]]] = {p: deque() for p in self.peers}
        self._recvs: dict[int, deque[Collective]] = {p: deque() for p in self.peers}
        # per peer: the header being read, its bytes read, the payload bytes read
        self._rx: dict[int, list[Any]] = {p: [bytearray(_HEADER.size), 0, 0] for p in self.peers}

    # ----------------------------------------------------------------------------------------- setup
    def _connect(
        self, peer: int, host: str, port: int, address: str, key: bytes, deadline: float
    ) -> socket.socket:
        """Connect to rank ``peer`` (below this one) from ``address``, answer its challenge and check its answer."""
        where = f"{host}:{port}"
        try:
            conn = socket.create_connection(
                (host, port), timeout=_left(deadline), source_address=(address, 0)
            )
        except OSError as e:
            raise MeshError(
                f"rank {self.rank}: cannot connect to rank {peer} at {where} ({e!r}); is that address reachable "
                "from this host (firewall, MASTER_ADDR)?"
            ) from e
        try:
            conn.settimeout(_left(deadline))
            challenge = _recv_exact(conn, _CHALLENGE.size)
            magic, nonce = _CHALLENGE.unpack(challenge)
            if magic != _MAGIC:
                raise MeshError(
                    f"rank {self.rank}: the process at {where}, where rank {peer} said it listens, did not answer "
                    "as a D-SLIDE rank: is another job using this rendezvous (MASTER_ADDR:MASTER_PORT)?"
                )
            conn.sendall(_HELLO.pack(_MAGIC, self.rank, peer, _mac(key, b"hello", nonce, self.rank, peer)))
            ack = _recv_exact(conn, _ACK.size)
            if not hmac.compare_digest(ack, _mac(key, b"ack", nonce, self.rank, peer)):
                raise MeshError(
                    f"rank {self.rank}: the process at {where} did not prove that it is rank {peer} of this job "
                    "(wrong key): is another job using this rendezvous (MASTER_ADDR:MASTER_PORT)?"
                )
        except (OSError, MeshError) as e:
            conn.close()
            if isinstance(e, MeshError):
                raise
            raise MeshError(
                f"rank {self.rank}: the handshake with rank {peer} at {where} failed ({e!r}); did rank {peer} "
                "refuse this rank (see its log) or stop?"
            ) from e
        return conn

    def _accept(self, listener: socket.socket, store: Any, prefix: str, key: bytes, deadline: float) -> None:
        """Accept the ranks above this one. Each connection gets a challenge (a nonce) and must answer with its
        rank, the rank it wants and ``HMAC(key, nonce, both ranks)``, from the address its rank published, within
        :attr:`handshake_timeout_s`; any other is closed with a warning and the wait goes on. Connections are served
        side by side, so one that stays silent delays no other."""
        listener.setblocking(False)
        pending: dict[socket.socket, _Pending] = {}
        try:
            while len(self.conns) < self.world_size - 1:
                now = time.monotonic()
                if now > deadline:
                    missing = [p for p in range(self.rank + 1, self.world_size) if p not in self.conns]
                    raise MeshError(
                        f"rank {self.rank}: ranks {missing} did not join the mesh within {self.timeout_s:.0f} s"
                        + (f" (refused connections: {'; '.join(self.refused)})" if self.refused else "")
                    )
                for conn, state in list(pending.items()):
                    if now > state.deadline:
                        self._refuse(pending, conn, f"sent no hello within {self.handshake_timeout_s:g} s")
                wake = min([deadline, *(s.deadline for s in pending.values())]) - now
                readable = _wait_ready([listener, *pending], [], max(0.0, min(wake, 1.0)))
                for sock in readable:
                    if sock is listener:
                        self._take_new(listener, pending)
                    else:
                        self._read_hello(sock, pending, store, prefix, key)
        finally:
            for conn in pending:
                conn.close()

    def _take_new(self, listener: socket.socket, pending: dict[socket.socket, _Pending]) -> None:
        while True:
            try:
                conn, peer_address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. the connection was reset before it was accepted
                log.warning("DSlideStrategy mesh: rank %d could not accept a connection: %r", self.rank, e)
                return
            if len(pending) >= _MAX_PENDING:  # make room: the oldest has had the most time
                self._refuse(pending, next(iter(pending)), f"more than {_MAX_PENDING} connections at once")
            conn.setblocking(False)
            nonce = secrets.token_bytes(_NONCE)
            try:
                conn.send(_CHALLENGE.pack(_MAGIC, nonce))  # a new socket's buffer takes these few bytes
            except OSError:
                conn.close()
                continue
            state = _Pending(
                _host(peer_address), peer_address, nonce, time.monotonic() + self.handshake_timeout_s
            )
            pending[conn] = state

    def _read_hello(
        self, conn: socket.socket, pending: dict[socket.socket, _Pending], store: Any, prefix: str, key: bytes
    ) -> None:
        state = pending[conn]
        try:
            chunk = conn.recv(_HELLO.size - len(state.data))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._refuse(pending, conn, f"failed before its hello ({e!r})")
            return
        if not chunk:
            self._refuse(pending, conn, f"closed after {len(state.data)} of the hello's {_HELLO.size} bytes")
            return
        state.data += chunk
        if len(state.data) < _HELLO.size:
            return
        magic, claimed, wanted, mac = _HELLO.unpack(bytes(state.data))
        why = None
        if magic != _MAGIC:
            why = "sent a malformed hello (not a D-SLIDE rank)"
        elif wanted != self.rank:
            why = f"asked for rank {wanted}"
        elif not self.rank < claimed < self.world_size:
            why = f"claimed to be rank {claimed}, but only ranks {self.rank + 1}..{self.world_size - 1} connect here"
        elif not hmac.compare_digest(mac, _mac(key, b"hello", state.nonce, claimed, self.rank)):
            why = f"claimed to be rank {claimed} without this job's key"
        elif claimed in self.conns:
            why = f"claimed to be rank {claimed}, which is already connected"
        elif not store.check([f"{prefix}/{claimed}"]):  # a rank publishes its address before it connects
            why = f"claimed to be rank {claimed}, which has not published its address yet"
        else:
            published = store.get(f"{prefix}/{claimed}").decode().rsplit(" ", 1)[0]
            if _normal(published) != _normal(state.host):
                why = f"claimed to be rank {claimed}, which published the address {published}"
        if why is not None:
            self._refuse(pending, conn, why)
            return
        del pending[conn]
        try:
            conn.setblocking(True)
            conn.settimeout(self.handshake_timeout_s)
            conn.sendall(_mac(key, b"ack", state.nonce, claimed, self.rank))
        except OSError as e:
            conn.close()
            self._note_refusal(state, f"rank {claimed} left before the handshake ended ({e!r})")
            return
        self.conns[claimed] = conn

    def _refuse(self, pending: dict[socket.socket, _Pending], conn: socket.socket, why: str) -> None:
        state = pending.pop(conn)
        conn.close()
        self._note_refusal(state, why)

    def _note_refusal(self, state: _Pending, why: str) -> None:
        text = f"a connection from {state.peer_address[0]}:{state.peer_address[1]} {why}"
        self.refused.append(text)
        log.warning(
            "DSlideStrategy mesh: rank %d closed %s; it goes on waiting for the ranks.", self.rank, text
        )

    # ----------------------------------------------------------------------------------------- collectives
    def start_all_gather(self, tensor: Tensor) -> Collective:
        """Start gathering every rank's ``tensor`` (the same shape and dtype on every rank): after ``wait()``,
        ``handle.parts[r]`` is rank ``r``'s."""
        return Collective(self, tensor, None)

    def start_all_reduce(self, tensor: Tensor, reduce: Callable[[Tensor, Tensor], Tensor]) -> Collective:
        """Start an in-place all-reduce of ``tensor``: when it completes, ``tensor`` holds the parts reduced in rank
        order with ``reduce(accumulated, part)`` (which may update ``accumulated`` in place)."""

        def finish(parts: list[Tensor]) -> None:
            out = parts[0].clone()
            for part in parts[1:]:
                out = reduce(out, part)
            tensor.copy_(out)

        return Collective(self, tensor, finish)

    # ----------------------------------------------------------------------------------------- progress
    def _progress(self) -> bool:
        """Send and receive what the sockets take and hold now; whether anything moved."""
        moved = False
        for peer in self.peers:
            conn, sends = self.conns[peer], self._sends[peer]
            while sends:
                item = sends[0]
                try:
                    sent = conn.send(item[0][item[1] :])
                except BlockingIOError:
                    break
                except OSError as e:
                    raise self._lost(peer, e) from e
                moved = moved or sent > 0
                item[1] += sent
                if item[1] < len(item[0]):
                    break
                sends.popleft()
            moved = self._receive(peer) or moved
        return moved

    def _receive(self, peer: int) -> bool:
        """Read what ``peer``'s socket holds into the collectives waiting for it, in the order they were started:
        each message's header, then its payload straight into the collective's tensor for ``peer``."""
        conn, recvs, state = self.conns[peer], self._recvs[peer], self._rx[peer]
        moved = False
        while recvs:
            collective = recvs[0]
            if state[1] == _HEADER.size and state[2] == collective.nbytes:  # complete (or empty)
                state[1] = state[2] = 0
                recvs.popleft()
                collective.pending -= 1
                if collective.pending == 0:
                    self._complete(collective)
                continue
            try:
                if state[1] < _HEADER.size:
                    n = conn.recv_into(memoryview(state[0])[state[1] :])
                else:
                    n = conn.recv_into(collective.views[peer][state[2] :])
            except BlockingIOError:
                return moved
            except OSError as e:
                raise self._lost(peer, e) from e
            if n == 0:
                raise self._lost(peer, None)
            moved = True
            if state[1] < _HEADER.size:
                state[1] += n
                if state[1] == _HEADER.size:
                    seq, nbytes = _HEADER.unpack(state[0])
                    if seq != collective.seq or nbytes != collective.nbytes:
                        raise MeshError(
                            f"rank {self.rank}: rank {peer} sent collective #{seq} of {nbytes} bytes where "
                            f"#{collective.seq} of {collective.nbytes} was expected: the ranks ran different "
                            "collectives (different code or data on each rank?)"
                        )
            else:
                state[2] += n
        return moved

    def _complete(self, collective: Collective) -> None:
        collective.done = True
        if collective.finish is not None:
            collective.finish(collective.parts)

    def _wait_for(self, collective: Collective) -> None:
        deadline = time.monotonic() + self.timeout_s
        spin_until = time.perf_counter() + self._spin()
        while not collective.done:
            if self._progress() or collective.done:
                continue
            if time.monotonic() > deadline:
                raise MeshError(
                    f"rank {self.rank}: a collective waited more than {self.timeout_s:.0f} s for the other ranks"
                )
            if time.perf_counter() < spin_until:
                os.sched_yield()  # releases the GIL; runs any other thread ready on this core
                continue
            readers = [self.conns[p] for p in self.peers if self._recvs[p]]
            writers = [self.conns[p] for p in self.peers if self._sends[p]]
            _wait_ready(readers, writers, min(1.0, max(deadline - time.monotonic(), 0.0)))
        # the other ranks wait for this rank's parts: send them out before going back to compute
        while any(self._sends[p] for p in self.peers):
            if not self._progress():
                _wait_ready([], [self.conns[p] for p in self.peers if self._sends[p]], 1.0)
            if time.monotonic() > deadline:
                raise MeshError(
                    f"rank {self.rank}: sending to the other ranks took more than {self.timeout_s:.0f} s"
                )

    def _lost(self, peer: int, error: BaseException | None) -> MeshError:
        why = f": {error!r}" if error is not None else ""
        return MeshError(
            f"rank {self.rank}: the connection to rank {peer} was closed{why} (did that rank fail or stop?)",
            lost_rank=peer,
        )

    def close(self) -> None:
        """Close every connection (the other ranks' collectives then fail at once)."""
        for conn in self.conns.values():
            try:
                conn.close()
            except OSError:
                pass
        self.conns = {}


@dataclass
class _Pending:
    """An accepted connection that has not proven which rank it is yet."""

    host: str
    peer_address: Any
    nonce: bytes
    deadline: float
    data: bytearray = field(default_factory=bytearray)


def _mac(key: bytes, what: bytes, nonce: bytes, connecting: int, accepting: int) -> bytes:
    return hmac.new(key, what + nonce + _RANKS.pack(connecting, accepting), hashlib.sha256).digest()


def _host(peer_address: Any) -> str:
    return str(peer_address[0])


def _normal(host: str) -> str:
    """``host`` as one spelling (an IPv4 address mapped into IPv6 as the IPv4 address); a name as it is."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise MeshError("a rank closed its connection while the mesh was being set up")
        data += chunk
    return data


def reachable_address(master_addr: str, master_port: int) -> str:
    """The local address this host uses to reach ``master_addr`` (where the other ranks can reach it too; no
    packet is sent). IPv4 or IPv6, as ``master_addr`` resolves."""
    family, _, _, _, target = socket.getaddrinfo(master_addr, master_port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        return probe.getsockname()[0]


def _wait_ready(
    readers: list[socket.socket], writers: list[socket.socket], timeout: float
) -> list[socket.socket]:
    """Wait up to ``timeout`` seconds until one of ``readers`` is readable or one of ``writers`` writable; returns
    the readable ones. ``poll``, not ``select``: a rank of a large job may hold file descriptors above 1023."""
    poller = select.poll()
    by_fd: dict[int, socket.socket] = {}
    for sock in readers:
        poller.register(sock, select.POLLIN)
        by_fd[sock.fileno()] = sock
    for sock in writers:
        events = select.POLLOUT | (select.POLLIN if sock.fileno() in by_fd else 0)
        poller.register(sock, events)
    ready = poller.poll(timeout * 1000)
    return [
        by_fd[fd]
        for fd, event in ready
        if fd in by_fd and event & (select.POLLIN | select.POLLHUP | select.POLLERR)
    ]
