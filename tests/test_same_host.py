"""The same-host path (``lightning_swarm/swarm/wire/same_host.py``): stage calls between peers of one machine over a
Unix socket, with real DHTs, P2P and stage servers on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import stat
import struct
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from lightning_swarm.swarm.dht.auth import protect, unprotect
from lightning_swarm.swarm.loop import run_coroutine
from lightning_swarm.swarm.server import StageServer
from lightning_swarm.swarm.settings import SwarmSettings
from lightning_swarm.swarm.wire.same_host import HELLO, SameHostStub, socket_path
from tests._helpers import local_dhts
from tests.test_stage_server import _client, _run_id, _serve


def _frame(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


@pytest.mark.timeout(120)
def test_calls_to_a_peer_on_this_machine_skip_the_p2p_daemons(dhts, cleanup) -> None:
    torch.manual_seed(0)
    run_id = _run_id("same-host")
    module = nn.Sequential(nn.Linear(8, 16), nn.GELU())
    server = _serve(cleanup, dhts["server1"], run_id, module)
    path = socket_path(server.peer_id, server.uid)
    assert path is not None and os.path.exists(path)
    # only this user may reach it: the directories are private, the socket too
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for directory in (os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700

    results = {}
    inputs = torch.randn(4, 8)
    for same_host in (True, False):
        client = _client(cleanup, dhts["trainer"], run_id, same_host=same_host)
        x = inputs.clone().requires_grad_()
        accepted = server._same_host.accepted
        y = client.call_stage(0, x)
        y.pow(2).sum().backward()
        stub = client.transport(server.peer_id, 0).stub
        assert isinstance(stub, SameHostStub) is same_host
        assert server._same_host.accepted == accepted + (1 if same_host else 0)
        # the stage's other RPCs still work (they go over P2P either way)
        assert client.stage_info(0)[0]["stage"] == 0
        results[same_host] = (y.detach(), x.grad)
    torch.testing.assert_close(results[True], results[False], atol=0, rtol=0)

    server.shutdown()
    assert not os.path.exists(path), "a stopped server removes its socket"


@pytest.mark.timeout(120)
def test_hostile_bytes_on_the_socket_never_crash_the_server(dhts, cleanup) -> None:
    run_id = _run_id("same-host-hostile")
    module = nn.Linear(3, 3)
    server = _serve(cleanup, dhts["server1"], run_id, module)
    path = socket_path(server.peer_id, server.uid)
    assert path is not None
    attacks = [
        b"GET / HTTP/1.1\r\n\r\n",  # no hello
        _frame(b"not the hello"),
        _frame(HELLO) + struct.pack(">I", 0xFFFFFFFF),  # a frame past the limit
        _frame(HELLO) + _frame(b"\xff\x00 not a protobuf \x07" * 10),
        _frame(HELLO) + struct.pack(">I", 100) + b"short",  # ends inside a frame
        _frame(HELLO + b"\x00" * 40),  # a malformed peer id
        b"\x00\x00",
    ]
    for attack in attacks:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(path)
            s.sendall(attack)
            s.shutdown(socket.SHUT_WR)
            data = s.recv(1 << 16)  # closed by the server (or an error reply, for a call it could parse)
            while data:
                data = s.recv(1 << 16)
    client = _client(cleanup, dhts["trainer"], run_id)
    x = torch.randn(2, 3)
    torch.testing.assert_close(client.call_stage(0, x), module(x), atol=1e-6, rtol=0)
    assert isinstance(client.transport(server.peer_id, 0).stub, SameHostStub)


@pytest.mark.timeout(120)
def test_a_killed_peer_leaves_a_dead_socket_and_its_calls_fail_over(dhts, cleanup) -> None:
    """A socket whose server is gone refuses connections at once: the call goes to the stage's other peer."""
    run_id = _run_id("same-host-dead")
    module = nn.Linear(3, 3)
    first = _serve(cleanup, dhts["server1"], run_id, module, throughput=100.0)
    second = _serve(cleanup, dhts["server2"], run_id, module, throughput=1.0)
    client = _client(cleanup, dhts["trainer"], run_id, ban_base_s=60.0)
    assert len(client.peers(0)) == 2
    path = socket_path(first.peer_id, first.uid)
    assert path is not None
    # what a SIGKILL leaves: the socket file, with nobody listening on it
    run_coroutine(first._same_host.stop())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(path)
    assert os.path.exists(path)
    started = time.monotonic()
    x = torch.randn(2, 3)
    for _ in range(3):
        torch.testing.assert_close(client.call_stage(0, x), module(x), atol=1e-6, rtol=0)
    assert time.monotonic() - started < 10
    assert (
        client.stats()["swarm/bans"] == 1
        and second.backend.requests_served >= 3
        and first.backend.requests_served == 0
    )
    # the next server that starts on this machine sweeps the dead socket away, and leaves the live one
    third = _serve(cleanup, dhts["server2"], _run_id("same-host-sweep"), module)
    assert not os.path.exists(path)
    assert os.path.exists(socket_path(second.peer_id, second.uid)) and third._same_host is not None


@pytest.mark.timeout(120)
def test_a_private_swarm_server_keeps_its_calls_on_authenticated_p2p(cleanup) -> None:
    (dht,) = local_dhts(1)
    try:
        protect(dht.peer_id, "a-long-secret")
        server = StageServer(
            0,
            nn.Linear(3, 3),
            dht=dht,
            settings=SwarmSettings(run_id=_run_id("private"), target_batch_size=10**6),
            optimizer_factory=None,
            throughput=1.0,
        )
        cleanup.append(server)
        server.start()
        path = socket_path(server.peer_id, server.uid)
        assert server._same_host is None and path is not None and not os.path.exists(path)
        server.shutdown()
    finally:
        unprotect(dht.peer_id)
        dht.shutdown()


def _needs_root_and_netns() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (another user, another network namespace)")


@pytest.mark.timeout(60)
def test_another_user_cannot_reach_the_sockets(dhts, cleanup) -> None:
    _needs_root_and_netns()
    server = _serve(cleanup, dhts["server1"], _run_id("same-host-uid"), nn.Linear(3, 3))
    path = socket_path(server.peer_id, server.uid)
    code = (
        "import os, socket, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    print('refused')\nelse:\n    print('connected')\n"
    )
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "refused", out.stderr


@pytest.mark.timeout(60)
def test_peers_in_another_network_namespace_do_not_find_the_sockets(dhts, cleanup) -> None:
    """A benchmark's shaped link is a network namespace: its peers must talk over the network, not here."""
    _needs_root_and_netns()
    name = f"lsw-{os.getpid()}-same-host"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create network namespaces here: {made.stderr.strip()}")
    try:
        server = _serve(cleanup, dhts["server1"], _run_id("same-host-ns"), nn.Linear(3, 3))
        here = socket_path(server.peer_id, server.uid)
        code = (
            "import sys\nfrom hivemind.p2p import PeerID\nfrom lightning_swarm.swarm.wire.same_host import socket_path\n"
            "print(socket_path(PeerID.from_base58(sys.argv[1]), sys.argv[2]))\n"
        )
        cmd = [
            "ip",
            "netns",
            "exec",
            name,
            sys.executable,
            "-c",
            code,
            server.peer_id.to_base58(),
            server.uid,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=os.getcwd())
        there = out.stdout.strip()
        assert out.returncode == 0, out.stderr
        assert here is not None and there not in ("", "None", here)
        assert os.path.exists(here) and not os.path.exists(there)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
