"""Peer records carry a state and the number of stages; parsing them never raises on what a buggy or hostile peer
stored (pure: no network)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import ValueWithExpiration

from lightning_swarm.cli import format_status
from lightning_swarm.swarm.dht.records import get_stage_peers, parse_stage_peers
from lightning_swarm.swarm.states import JOINING, LEAVING, ONLINE, STATES
from lightning_swarm.swarm.training.stepping import read_swarm_epoch

NOW = 1_000.0
IDS = [
    PeerID.from_base58(s)
    for s in (
        "QmS7xWYXCHfk86VKafC2GgW5ZJ1nv2WoGFRYZa3phNEmWf",
        "QmVzdNAMF2pQMRB2CxxVYoPzVtJFsDahrsxWyCZ7gWJNRF",
        "QmPKTmGUmgaQnKz9RVnuxBQTRRqZBYxWg5AztAhfZsD2X2",
        "QmTvJyq6aVLDXsm7S7aoFy6Z3UdJXBkApJoZ9YzCWQdD2i",
    )
]


def _listing(entries: dict) -> ValueWithExpiration:
    return ValueWithExpiration({k: ValueWithExpiration(v, NOW + 30) for k, v in entries.items()}, NOW + 30)


def test_states_and_stage_counts_are_read_and_bad_entries_skipped() -> None:
    a, b, c, d = (i.to_base58() for i in IDS)
    listing = _listing(
        {
            a: [10.0, ONLINE, 4],
            b: [5.0, JOINING, 4],
            c: [7.0, LEAVING, 4],
            d: [3.0],  # an older peer: online, stage count unknown
            "not-a-peer-id": [1.0, ONLINE, 4],
        }
    )
    assert [p.peer_id for p in parse_stage_peers(listing, 1, now=NOW)] == sorted(
        [IDS[0], IDS[3]], key=lambda i: i.to_base58()
    )
    every = {
        p.peer_id: (p.state, p.num_stages) for p in parse_stage_peers(listing, 1, now=NOW, states=STATES)
    }
    assert every == {IDS[0]: (ONLINE, 4), IDS[1]: (JOINING, 4), IDS[2]: (LEAVING, 4), IDS[3]: (ONLINE, None)}
    for bad in (
        [1.0, "asleep", 4],  # unknown state
        [1.0, ONLINE, 1],  # stage 1 of a 1-stage pipeline
        [1.0, ONLINE, "4"],
        [1.0, ONLINE, True],
        [True, ONLINE, 4],
        ["7", ONLINE, 4],
        [float("nan"), ONLINE, 4],
        [1.0, ONLINE, 4, "extra"],
        [],
        {"throughput": 1.0},
        None,
    ):
        assert parse_stage_peers(_listing({a: bad}), 1, now=NOW, states=STATES) == [], bad


def test_status_table_names_the_bottleneck_and_every_state() -> None:
    a, b, c = IDS[:3]
    listing0 = _listing(
        {
            a.to_base58(): [10.0, ONLINE, 2, True, NOW - 4.0],
            b.to_base58(): [4.0, JOINING, 2, False, NOW - 1.0],
        }
    )
    listing1 = _listing({c.to_base58(): [6.0, ONLINE, 2, True, NOW - 300.0]})
    peers = parse_stage_peers(listing0, 0, now=NOW, states=STATES) + parse_stage_peers(
        listing1, 1, now=NOW, states=STATES
    )
    table = format_status("run", peers, 2, now=NOW)
    assert "2 stages, 3 peers (2 online); pipeline 6.0 samples/s, bottleneck: stage 1" in table
    rows = [line.split() for line in table.splitlines()]
    assert ["0", "2", "1", "10.0", "measured"] in rows
    assert ["1", "1", "1", "6.0", "measured", "<-", "bottleneck"] in rows
    assert ["0", "joining", "4.0", "estimate", "1", "s", str(b)] in rows  # each row: how old its figure is
    assert ["0", "online", "10.0", "measured", "4", "s", str(a)] in rows
    assert ["1", "online", "6.0", "measured", "5", "min", str(c)] in rows


def test_status_marks_throughputs_that_were_never_measured_as_estimates() -> None:
    """Before a peer has served calls it announces a matmul-based guess: the table says so, it does not pass it off
    as a measurement."""
    a, b = IDS[:2]
    peers = parse_stage_peers(
        _listing({a.to_base58(): [188_619.0, ONLINE, 2, False, NOW - 2.0]}), 0, now=NOW, states=STATES
    ) + parse_stage_peers(_listing({b.to_base58(): [14_264.0, ONLINE, 2, False, NOW - 3.0]}), 1, now=NOW)
    assert [(p.measured, p.figure_time) for p in peers] == [(False, NOW - 2.0), (False, NOW - 3.0)]
    table = format_status("run", peers, 2, now=NOW)
    assert "pipeline 14264.0 samples/s (not measured yet), bottleneck: stage 1" in table
    rows = [line.split() for line in table.splitlines()]
    assert ["0", "1", "1", "188619.0", "estimate"] in rows
    assert ["1", "online", "14264.0", "estimate", "3", "s", str(b)] in rows
    assert "estimate: a peer's guess" in table
    # an older record says neither: its figure's origin and age are unknown, not made up
    old = parse_stage_peers(_listing({a.to_base58(): [5.0, ONLINE, 1]}), 0, now=NOW)
    rows = [line.split() for line in format_status("run", old, 1, now=NOW).splitlines()]
    assert ["0", "online", "5.0", "unknown", "?", str(a)] in rows


def test_the_figure_fields_are_checked() -> None:
    a = IDS[0].to_base58()
    for bad in (
        [1.0, ONLINE, 4, 1, NOW],
        [1.0, ONLINE, 4, True, "now"],
        [1.0, ONLINE, 4, True, float("inf")],
    ):
        assert parse_stage_peers(_listing({a: bad}), 1, now=NOW) == [], bad
    from lightning_swarm.swarm.dht.validation import _StageValue

    assert _StageValue._check([1.0, ONLINE, 4, False, NOW]) == [1.0, ONLINE, 4, False, NOW]
    for bad in ([1.0, ONLINE, 4, True], [1.0, ONLINE, 4, 0, NOW], [1.0, ONLINE, 4, True, 3]):
        try:
            _StageValue._check(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} passed the schema")


def test_a_peer_behind_nat_says_so_with_its_circuit_addresses() -> None:
    from lightning_swarm.swarm.dht.validation import _StageValue

    a, b = IDS[0].to_base58(), IDS[1].to_base58()
    circuit = f"/ip4/10.0.0.1/tcp/31337/p2p/{b}/p2p-circuit"
    relayed = [1.0, ONLINE, 4, True, NOW, [circuit]]
    assert _StageValue._check(relayed) == relayed
    (peer,) = parse_stage_peers(_listing({a: relayed}), 1, now=NOW)
    assert peer.relayed and peer.relay_addrs == (circuit,)
    (direct,) = parse_stage_peers(_listing({a: [1.0, ONLINE, 4, True, NOW]}), 1, now=NOW)
    assert not direct.relayed and direct.relay_addrs == ()
    for bad in (
        [1.0, ONLINE, 4, True, NOW, circuit],  # not a list
        [1.0, ONLINE, 4, True, NOW, ["/ip4/10.0.0.1/tcp/31337"]],  # not a circuit address
        [1.0, ONLINE, 4, True, NOW, ["/p2p-circuit"]],  # no relay named
        [1.0, ONLINE, 4, True, NOW, [circuit] * 9],  # too many
        [1.0, ONLINE, 4, True, NOW, [circuit], "extra"],
    ):
        assert parse_stage_peers(_listing({a: bad}), 1, now=NOW) == [], bad
        try:
            _StageValue._check(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} passed the schema")


def test_signed_subkeys_read_as_their_owner_and_forged_ones_are_skipped() -> None:
    from lightning_swarm.swarm.dht.identity import PeerIdentity, subkey_peer_id

    owner, other = PeerIdentity(), PeerIdentity()
    assert subkey_peer_id(owner.subkey) == owner.peer_id
    forged = owner.peer_id.to_base58().encode() + other.owner  # owner's id, other's key
    listing = _listing({owner.subkey: [2.0, ONLINE, 4], forged: [1e12, ONLINE, 4], b"no-owner": [1.0]})
    assert [(p.peer_id, p.throughput) for p in parse_stage_peers(listing, 1, now=NOW)] == [
        (owner.peer_id, 2.0)
    ]


def test_a_lookup_in_a_dht_whose_process_died_ends_with_a_clear_error() -> None:
    from lightning_swarm.swarm.dht.process import SwarmDHT

    dht = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        assert get_stage_peers(dht, "lookup", 0) == []  # a live DHT answers at once
        os.kill(dht.pid, signal.SIGKILL)
        dht.join(timeout=10)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="did not answer a lookup of stage 0's peers within 2 s"):
            get_stage_peers(dht, "lookup", 0, timeout=2.0)
        assert time.monotonic() - start < 5
        start = time.monotonic()
        assert read_swarm_epoch(dht, "lookup") is None
        assert time.monotonic() - start < 15
    finally:
        if dht.is_alive():
            dht.shutdown()
