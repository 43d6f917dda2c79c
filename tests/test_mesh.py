"""The D-SLIDE socket mesh (lightning_swarm/layers/mesh.py): real TCP connections between real processes on
127.0.0.1, set up through a real torch TCPStore; hostile connections during setup come from a real client."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_swarm.layers.mesh import STORE_PREFIX, MeshError, SocketMesh

HANDSHAKE_S = 2.5  # the late silent connection must not hold the setup this long, on a busy box too


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _attack(store: dist.Store) -> tuple[list[socket.socket], dict[str, str]]:
    """Hostile and broken connections to rank 0 while it waits for rank 1, from this (rank 1's) process: what a
    port scanner, a stray client, a broken client and an impostor would send. Returns the connections still open
    and what each attack saw."""
    prefix = f"{STORE_PREFIX}/0"
    host, port = store.get(f"{prefix}/0").decode().rsplit(" ", 1)
    key = bytes.fromhex(store.get(f"{prefix}/key").decode())  # a process that can read the store knows it
    target, seen, keep = (host, int(port)), {}, []

    def connect(source: str = "127.0.0.1") -> tuple[socket.socket, bytes]:
        conn = socket.create_connection(target, timeout=10, source_address=(source, 0))
        challenge = conn.recv(64)
        return conn, challenge

    def hello(magic: bytes, claimed: int, wanted: int, mac_key: bytes, nonce: bytes) -> bytes:
        mac = hmac.new(
            mac_key, b"hello" + nonce + struct.pack("<qq", claimed, wanted), hashlib.sha256
        ).digest()
        return magic + struct.pack("<qq", claimed, wanted) + mac

    def answer(conn: socket.socket) -> str:
        try:
            reply = conn.recv(64)
        except OSError as e:
            return f"error {e!r}"
        finally:
            conn.close()
        return "closed" if not reply else f"answered {len(reply)} bytes"

    silent, _ = connect()  # says nothing: dropped after the handshake timeout
    keep.append(silent)
    socket.create_connection(target, timeout=10).close()  # a port scanner: connects, leaves
    conn, _ = connect()
    conn.sendall(b"\x00" * 52)  # a malformed hello of the right size
    seen["malformed"] = answer(conn)
    conn, _ = connect()
    conn.sendall(b"GET /")  # part of something else, then gone
    conn.close()
    conn, challenge = connect()
    conn.sendall(hello(b"LSWm", 1, 0, os.urandom(32), challenge[4:20]))  # rank 1's number, a wrong key
    seen["wrong_key"] = answer(conn)
    conn, challenge = connect("127.0.0.2")  # the right key, before rank 1 published its address
    conn.sendall(hello(b"LSWm", 1, 0, key, challenge[4:20]))
    seen["unpublished"] = answer(conn)
    store.set(f"{prefix}/1", "127.0.0.1 1")  # what the real rank 1 publishes (its port will follow, below)
    conn, challenge = connect("127.0.0.2")  # the right key, from an address rank 1 did not publish
    conn.sendall(hello(b"LSWm", 1, 0, key, challenge[4:20]))
    seen["other_address"] = answer(conn)
    conn, challenge = connect()  # the right key and address, a rank that never connects to rank 0
    conn.sendall(hello(b"LSWm", 5, 0, key, challenge[4:20]))
    seen["out_of_range"] = answer(conn)
    time.sleep(HANDSHAKE_S + 0.5)  # the first silent connection times out
    late, _ = connect()  # silent while the real rank 1 joins: it must not hold the setup up
    keep.append(late)
    return keep, seen


JOINED = "test/rank_1_joined_rank_0"


class _SaysWhenJoined(SocketMesh):
    """Rank 1's mesh as it is, which also says in the store when its handshake with rank 0 is over (rank 0 then
    counts it as connected: it answers a hello only after it took it)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._store = args[2]
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _connect(self, peer: int, *args: object) -> socket.socket:
        conn = super()._connect(peer, *args)  # type: ignore[arg-type]
        if peer == 0:
            self._store.set(JOINED, "1")  # type: ignore[attr-defined]
        return conn


def _impostor(store: dist.Store) -> tuple[socket.socket, str]:
    """From rank 2's process, once rank 1 has connected to rank 0: a connection with this job's key, from rank 1's
    address, claiming rank 1. Returns it and what it saw."""
    prefix = f"{STORE_PREFIX}/0"
    store.wait([JOINED])
    host, port = store.get(f"{prefix}/0").decode().rsplit(" ", 1)
    key = bytes.fromhex(store.get(f"{prefix}/key").decode())
    conn = socket.create_connection((host, int(port)), timeout=10)
    nonce = conn.recv(64)[4:20]
    mac = hmac.new(key, b"hello" + nonce + struct.pack("<qq", 1, 0), hashlib.sha256).digest()
    conn.sendall(b"LSWm" + struct.pack("<qq", 1, 0) + mac)
    try:
        reply = conn.recv(64)
    except OSError as e:
        return conn, f"error {e!r}"
    return conn, "closed" if not reply else f"answered {len(reply)} bytes"


def _rank(rank: int, world: int, port: int, case: str, results: dict) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=30))
        attack: dict[str, str] = {}
        if case == "hostile" and rank == 1:
            held, attack = _attack(store)
        if case == "impostor" and rank == 2:
            impostor, attack["impostor"] = _impostor(store)
            impostor.close()
        warnings: list[str] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("lightning_swarm.layers.mesh").addHandler(handler)
        started = time.monotonic()
        mesh = (_SaysWhenJoined if case == "impostor" and rank == 1 else SocketMesh)(
            rank, world, store, "127.0.0.1", timeout_s=20.0, spin_s=0.05, handshake_timeout_s=HANDSHAKE_S
        )
        if case in ("hostile", "impostor"):  # the job goes on: a collective over the mesh
            x = torch.full((4,), float(rank + 1))
            mesh.start_all_reduce(x, lambda a, b: a.add_(b)).wait()
            results[rank] = {
                "sum": x.tolist(),
                "refused": mesh.refused,
                "warnings": warnings,
                "attack": attack,
                "setup_s": time.monotonic() - started,
            }
        elif case == "ok":
            x = torch.full((3, 4), float(rank + 1))
            # two collectives in flight, waited for in the reverse order; a third in between, synchronous
            flags = torch.tensor([rank, -rank, 7], dtype=torch.int64)
            first = mesh.start_all_reduce(flags, lambda a, b: torch.minimum(a, b, out=a))
            second = mesh.start_all_gather(torch.arange(5.0) * (rank + 1))
            summed = mesh.start_all_reduce(x, lambda a, b: a.add_(b))
            summed.wait()
            second.wait()
            first.wait()
            empty = mesh.start_all_gather(torch.empty(0, 4))
            empty.wait()
            results[rank] = {
                "sum": x.tolist(),
                "gathered": [p.tolist() for p in second.parts],
                "min": flags.tolist(),
                "empty": [tuple(p.shape) for p in empty.parts],
            }
        elif case == "out_of_step":  # rank 1 sends a tensor of another size: both ranks must say so, not hang
            handle = mesh.start_all_gather(torch.zeros(4 if rank == 0 else 6))
            handle.wait()
            results[rank] = "no error"
        elif case == "peer_dies":
            if rank == 1:
                mesh.close()
                results[rank] = "closed"
                return
            handle = mesh.start_all_gather(torch.zeros(1000))
            handle.wait()
            results[rank] = "no error"
        mesh.close()
    except MeshError as e:
        results[rank] = f"MeshError: {e}"
    except Exception:
        results[rank] = traceback.format_exc()


def _run(case: str, world: int) -> dict:
    """Run ``case`` on ``world`` ranks, each a process forked by a fork server that imported this module (and torch)
    once: a rank starts clean (no thread of the pytest worker) without importing torch again."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    port = _free_port()
    with ctx.Manager() as manager:
        results = manager.dict()
        procs = [ctx.Process(target=_rank, args=(r, world, port, case, results)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 100  # the fork server's first start imports torch: slow on a busy box
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join()
        assert not alive, f"{case}: a rank hung"
        return dict(results)


@pytest.mark.timeout(120)
def test_collectives_over_the_mesh_agree_on_every_rank_in_any_wait_order() -> None:
    world = 3
    results = _run("ok", world)
    for rank in range(world):
        got = results[rank]
        assert isinstance(got, dict), got
        assert got["sum"] == [[6.0] * 4] * 3  # 1 + 2 + 3
        assert got["gathered"] == [[float(i * (r + 1)) for i in range(5)] for r in range(world)]
        assert got["min"] == [0, -2, 7]
        assert got["empty"] == [(0, 4)] * world


@pytest.mark.timeout(120)
def test_hostile_connections_during_setup_are_refused_and_the_job_goes_on() -> None:
    """While rank 0 waits for rank 1: a silent connection, a port scan, a malformed hello, a partial one, a hello
    with rank 1's number and a wrong key, one with the right key from another address, one claiming a rank that does
    not exist; then a silent connection left open while the real rank 1 joins. Rank 0 refuses each with a warning
    that says why, the real rank joins and an all-reduce gives the right sum."""
    results = _run("hostile", 2)
    for rank in range(2):
        assert isinstance(results[rank], dict), results[rank]
        assert results[rank]["sum"] == [3.0] * 4
    refused = results[0]["refused"]
    expected = [
        f"sent no hello within {HANDSHAKE_S:g} s",
        "sent a malformed hello (not a D-SLIDE rank)",
        "closed after 5 of the hello's 52 bytes",
        "claimed to be rank 1 without this job's key",
        "claimed to be rank 1, which has not published its address yet",
        "claimed to be rank 1, which published the address 127.0.0.1",
        "claimed to be rank 5, but only ranks 1..1 connect here",
    ]
    reasons = [r.split(" ", 4)[-1] for r in refused]
    scans = [r for r in reasons if r not in expected]  # the port scan left before or after its challenge came
    assert len(scans) == 1 and scans[0].startswith(("closed after 0 of", "failed before its hello")), refused
    assert sorted(r for r in reasons if r in expected) == sorted(expected), refused
    assert "127.0.0.2" in next(r for r in refused if "published the address" in r)
    assert len(results[0]["warnings"]) == len(expected) + 1
    assert all("rank 0 closed a connection from 127.0.0." in w for w in results[0]["warnings"]), results[0]
    # refused connections are closed without an answer; the late silent one did not hold the setup up
    assert results[1]["attack"] == dict.fromkeys(
        ["malformed", "wrong_key", "unpublished", "other_address", "out_of_range"], "closed"
    )
    assert results[1]["setup_s"] < HANDSHAKE_S, results[1]["setup_s"]
    assert not results[1]["warnings"]


@pytest.mark.timeout(120)
def test_a_connection_that_claims_a_rank_already_connected_is_refused() -> None:
    """3 ranks. Once rank 1 has joined rank 0, a connection from rank 1's address that knows the job's key (a
    process that can read the store) claims rank 1 again: rank 0 refuses it with a warning, keeps the real rank 1's
    connection, and rank 2 joins; an all-reduce over the mesh gives the right sum on every rank."""
    results = _run("impostor", 3)
    for rank in range(3):
        assert isinstance(results[rank], dict), results[rank]
        assert results[rank]["sum"] == [6.0] * 4  # 1 + 2 + 3
    assert results[2]["attack"] == {"impostor": "closed"}
    (refused,) = results[0]["refused"]
    assert refused.startswith("a connection from 127.0.0.1:"), refused
    assert refused.endswith("claimed to be rank 1, which is already connected"), refused
    assert len(results[0]["warnings"]) == 1 and not results[1]["refused"] and not results[1]["warnings"]


@pytest.mark.timeout(120)
def test_ranks_out_of_step_fail_with_a_clear_error() -> None:
    results = _run("out_of_step", 2)
    for rank in range(2):
        assert "MeshError" in results[rank] and "ran different collectives" in results[rank], results[rank]


@pytest.mark.timeout(120)
def test_a_rank_that_closes_its_connections_ends_the_others_collective() -> None:
    results = _run("peer_dies", 2)
    assert results[1] == "closed"
    assert "MeshError: rank 0: the connection to rank 1 was closed" in results[0], results[0]
