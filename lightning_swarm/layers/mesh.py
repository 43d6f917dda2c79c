"""Direct TCP connections between every pair of ranks, for D-SLIDE's small per-step collectives.

A D-SLIDE step synchronises its ranks five times over small tensors (a few hundred KB at most). Through gloo each
such collective passes between four threads (the caller, a gloo worker, gloo's socket thread, back), and every
hand-over that finds a thread asleep must wake it. Here the calling thread sends and receives itself on
non-blocking sockets, spinning while it waits (or blocking in ``select`` where spinning is off). A 128 KB
all-reduce of 2 ranks pinned to a core each, after 5 ms of compute (``benchmarks/collective_latency.py``, this
project's 2-core VM): 1.8 ms through gloo blocking, 0.85 ms through gloo spinning, 0.32 ms here.

Every rank keeps one connection to every other rank. A collective sends this rank's part to every other rank
and receives theirs; an all-reduce reduces the gathered parts in rank order, so every rank gets the same bits. A
rank sends ``(world_size - 1)`` times its part (gloo's ring all-reduce: about twice the part): the right trade for
the few ranks and small tensors of D-SLIDE's step. Several collectives may be in flight (started with
:meth:`SocketMesh.start_all_reduce` or :meth:`SocketMesh.start_all_gather`); every rank starts them in the same order, and each message carries a header with its
collective's sequence number and size, so that a rank that got out of step fails with an error instead of mixing
tensors.

The engine does not import Lightning.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

_HEADER = struct.Struct("<qq")  # collective sequence number, payload bytes
_HELLO = struct.Struct("<q")  # the connecting rank
_GENERATIONS = itertools.count()  # meshes made by this process: the same count on every rank (same code path)


class MeshError(RuntimeError):
    """A collective over the mesh failed: a rank closed its connection, timed out or got out of step."""


def _payload(tensor: Tensor) -> memoryview:
    """The bytes of a contiguous ``tensor`` (any dtype, empty too), sharing its memory."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


class _Collective:
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

    Args:
        rank: this rank.
        world_size: the number of ranks.
        store: a ``torch.distributed`` store every rank shares (``dist.distributed_c10d._get_default_store()``).
        address: the address other ranks reach this rank at.
        timeout_s: how long a collective (and setting up the mesh) may wait for another rank.
        spin_s: how long a wait spins on the sockets before it blocks in ``select``, or a function that returns
            it (asked at each wait).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: Any,
        address: str,
        timeout_s: float = 1800.0,
        spin_s: float | Callable[[], float] = 0.0,
    ) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._spin = spin_s if callable(spin_s) else (lambda: spin_s)
        self._sequence = itertools.count()
        self.conns: dict[int, socket.socket] = {}
        prefix = f"lightning_swarm/dslide_mesh/{next(_GENERATIONS)}"
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        listener = socket.create_server((address, 0), family=family, backlog=max(world_size, 1))
        listener.settimeout(timeout_s)
        try:
            store.set(f"{prefix}/{rank}", f"{address} {listener.getsockname()[1]}")  # split on the last space
            for peer in range(rank):  # connect to the ranks below, accept the ranks above
                host, port = store.get(f"{prefix}/{peer}").decode().rsplit(" ", 1)
                conn = socket.create_connection((host, int(port)), timeout=timeout_s)
                conn.sendall(_HELLO.pack(rank))
                self.conns[peer] = conn
            for _ in range(rank + 1, world_size):
                conn, _ = listener.accept()
                conn.settimeout(timeout_s)
                peer = _HELLO.unpack(_recv_exact(conn, _HELLO.size))[0]
                if not (rank < peer < world_size) or peer in self.conns:
                    raise MeshError(f"rank {rank}: an unexpected connection claimed to be rank {peer}")
                self.conns[peer] = conn
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        for conn in self.conns.values():
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setblocking(False)
        self.peers = sorted(self.conns)
        self._sends: dict[int, deque[list[Any]]] = {p: deque() for p in self.peers}
        self._recvs: dict[int, deque[_Collective]] = {p: deque() for p in self.peers}
        # per peer: the header being read, its bytes read, the payload bytes read
        self._rx: dict[int, list[Any]] = {p: [bytearray(_HEADER.size), 0, 0] for p in self.peers}

    # ----------------------------------------------------------------------------------------- collectives
    def start_all_gather(self, tensor: Tensor) -> _Collective:
        """Start gathering every rank's ``tensor`` (the same shape and dtype on every rank): after ``wait()``,
        ``handle.parts[r]`` is rank ``r``'s."""
        return _Collective(self, tensor, None)

    def start_all_reduce(self, tensor: Tensor, reduce: Callable[[Tensor, Tensor], Tensor]) -> _Collective:
        """Start an in-place all-reduce of ``tensor``: when it completes, ``tensor`` holds the parts reduced in rank
        order with ``reduce(accumulated, part)`` (which may update ``accumulated`` in place)."""

        def finish(parts: list[Tensor]) -> None:
            out = parts[0].clone()
            for part in parts[1:]:
                out = reduce(out, part)
            tensor.copy_(out)

        return _Collective(self, tensor, finish)

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

    def _complete(self, collective: _Collective) -> None:
        collective.done = True
        if collective.finish is not None:
            collective.finish(collective.parts)

    def _wait_for(self, collective: _Collective) -> None:
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
            select.select(readers, writers, [], min(1.0, max(deadline - time.monotonic(), 0.0)))
        # the other ranks wait for this rank's parts: send them out before going back to compute
        while any(self._sends[p] for p in self.peers):
            if not self._progress():
                select.select([], [self.conns[p] for p in self.peers if self._sends[p]], [], 1.0)
            if time.monotonic() > deadline:
                raise MeshError(
                    f"rank {self.rank}: sending to the other ranks took more than {self.timeout_s:.0f} s"
                )

    def _lost(self, peer: int, error: BaseException | None) -> MeshError:
        why = f": {error!r}" if error is not None else ""
        return MeshError(
            f"rank {self.rank}: the connection to rank {peer} was closed{why} (did that rank fail or stop?)"
        )

    def close(self) -> None:
        """Close every connection (the other ranks' collectives then fail at once)."""
        for conn in self.conns.values():
            try:
                conn.close()
            except OSError:
                pass
        self.conns = {}


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
