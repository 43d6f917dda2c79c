"""The same-host sum (``lightning_swarm/swarm/wire/same_host_sum.py``): the peers of a stage on one machine sum a step's
gradients through shared memory. Real threads exchanging real files; the stage servers' use of it is in
``tests/test_stepping.py`` (``[shared-memory]``)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lightning_swarm.swarm.wire import same_host_sum
from lightning_swarm.swarm.wire.same_host import socket_path
from lightning_swarm.swarm.wire.same_host_sum import (
    SameHostSumFailed,
    _directories,
    _tag,
    on_one_host,
    sum_on_host,
)

PEERS = [b"peer-a", b"peer-b", b"peer-c"]


def _templates() -> list[torch.Tensor]:
    return [torch.zeros(3, 4), torch.zeros(5, dtype=torch.float64), torch.zeros(2, 2)]


def _leftovers(round_id: bytes) -> list[str]:
    tag = _tag(round_id)
    return [n for d in _directories() for n in os.listdir(d) if tag in n]


def _sum_all(grads: list[list[torch.Tensor | None]], round_id: bytes, timeout: float = 10.0):
    peers = PEERS[: len(grads)]
    with ThreadPoolExecutor(len(grads)) as pool:
        futures = [
            pool.submit(sum_on_host, g, _templates(), round_id, peers, peers[i], timeout)
            for i, g in enumerate(grads)
        ]
        return [f.result() for f in futures]


@pytest.mark.parametrize("n", [2, 3])
def test_every_peer_gets_the_same_bits_of_the_sum(n: int) -> None:
    torch.manual_seed(0)
    grads = [[torch.randn(3, 4), torch.randn(5, dtype=torch.float64), torch.randn(2, 2)] for _ in range(n)]
    grads[1][2] = None  # a tensor this peer has no gradient for counts as zeros
    round_id = os.urandom(16)
    results = _sum_all(grads, round_id)
    for k, template in enumerate(_templates()):
        expected = sum((g[k] if g[k] is not None else torch.zeros_like(template)).float() for g in grads)
        for result in results:
            assert result[k].shape == template.shape and result[k].dtype == template.dtype
            torch.testing.assert_close(result[k].float(), expected, rtol=1e-6, atol=1e-6)
            assert torch.equal(result[k], results[0][k])  # bit for bit on every peer
    assert _leftovers(round_id) == []  # every file was consumed


def test_peers_that_publish_in_different_directories_still_meet(monkeypatch) -> None:
    """One peer found ``/dev/shm`` too full (a container's 64 MB) and published in the sockets' directory."""
    directories = _directories()
    if os.path.isdir("/dev/shm"):
        assert len(directories) == 2 and directories[0].startswith("/dev/shm/")

    def choose(candidates: list[str], nbytes: int) -> str:
        return candidates[-1] if threading.current_thread().name == "second" else candidates[0]

    monkeypatch.setattr(same_host_sum, "_with_room", choose)
    round_id, results = os.urandom(16), {}
    grads = [[torch.full((3, 4), 1.0), None, None], [torch.full((3, 4), 2.0), None, torch.ones(2, 2)]]

    def one(i: int) -> None:
        results[i] = sum_on_host(grads[i], _templates(), round_id, PEERS[:2], PEERS[i], 10.0)

    threads = [
        threading.Thread(target=one, args=(i,), name=name) for i, name in enumerate(["first", "second"])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(results[0][0], torch.full((3, 4), 3.0)) and torch.equal(
        results[1][2], torch.ones(2, 2)
    )
    assert _leftovers(round_id) == []


def test_a_partner_that_never_comes_fails_the_round_in_time_and_leaves_nothing() -> None:
    round_id = os.urandom(16)
    started = time.monotonic()
    with pytest.raises(SameHostSumFailed, match="did not publish"):
        sum_on_host([torch.ones(3, 4), None, None], _templates(), round_id, PEERS[:2], PEERS[0], timeout=1.0)
    assert 1.0 <= time.monotonic() - started < 5.0
    assert _leftovers(round_id) == []


def test_partners_with_different_stages_fail_with_a_clear_error() -> None:
    round_id = os.urandom(16)
    errors: list[BaseException] = []

    def one(templates: list[torch.Tensor], me: bytes) -> None:
        try:
            sum_on_host([None] * len(templates), templates, round_id, PEERS[:2], me, timeout=3.0)
        except SameHostSumFailed as e:
            errors.append(e)

    threads = [
        threading.Thread(target=one, args=(_templates(), PEERS[0])),
        threading.Thread(target=one, args=(_templates()[:2], PEERS[1])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 2 and any("the peers' stages differ" in str(e) for e in errors)
    assert _leftovers(round_id) == []


def test_a_group_is_on_one_host_only_if_every_peer_serves_the_stage_here() -> None:
    from hivemind.p2p import PeerID

    peers = [PeerID(os.urandom(32)) for _ in range(2)]
    uid = f"uid-{os.getpid()}"
    listening = []
    try:
        for peer in peers:  # a stage server on this machine listens here (see same_host.py)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(socket_path(peer, uid))
            listening.append(sock)
        ids = [p.to_bytes() for p in peers]
        assert on_one_host(ids, uid)
        assert not on_one_host(ids, "another-stage")
        os.unlink(socket_path(peers[1], uid))  # the second serves elsewhere
        assert not on_one_host(ids, uid)
    finally:
        for sock in listening:
            sock.close()
        for peer in peers:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(socket_path(peer, uid))
    assert not on_one_host([], uid) and not on_one_host([ids[0]], uid)
    assert not on_one_host([ids[0], b"not a peer id"], uid)


def test_a_partner_file_this_peer_cannot_read_fails_the_round_not_the_peer() -> None:
    """Whatever a partner leaves at its name (here a directory), the round fails with SameHostSumFailed, which the
    stepper turns into a redo through hivemind; no other error reaches the step command."""
    round_id = os.urandom(16)
    bad = os.path.join(_directories()[0], f"sum-{_tag(round_id)}-1-to-0")
    os.mkdir(bad)
    try:
        with pytest.raises(SameHostSumFailed, match="cannot read peer 1"):
            sum_on_host(
                [torch.ones(3, 4), None, None], _templates(), round_id, PEERS[:2], PEERS[0], timeout=2.0
            )
    finally:
        os.rmdir(bad)
    assert _leftovers(round_id) == []
