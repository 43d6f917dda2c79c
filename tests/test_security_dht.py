"""Strangers cannot forge DHT records nor enter a private swarm (real DHTs and p2p daemons on 127.0.0.1).

- Signed records: a hostile node (a plain hivemind DHT, signing with its own key) stores unsigned records, records
  announcing another peer's id, records overwriting another peer's, and records off the schema; the honest peer's
  DHT keeps and returns none of them, while the hostile node's own well-formed record is accepted.
- Private swarms: a peer without the secret (or with a wrong one) cannot join the DHT, and a bare hivemind P2P
  cannot call a stage's RPCs nor download its state; a peer with the secret joins and downloads it; an allowlist
  admits exactly the listed ids.
"""

from __future__ import annotations

import itertools
import os

import hivemind
import pytest
import torch
from hivemind.p2p import P2P, P2PHandlerError
from hivemind.proto import averaging_pb2, dht_pb2, runtime_pb2
from hivemind.utils.timed_storage import get_dht_time
from torch import nn

from lightning_swarm.swarm import SwarmPeer, SwarmSettings
from lightning_swarm.swarm.client.client import SwarmClient
from lightning_swarm.swarm.dht.bootstrap import dht_start_error
from lightning_swarm.swarm.dht.identity import PeerIdentity, RecordSigner, subkey_peer_id
from lightning_swarm.swarm.dht.records import get_stage_peers
from lightning_swarm.swarm.dht.validation import presence_key, stage_key, swarm_keys
from lightning_swarm.swarm.loop import run_coroutine
from lightning_swarm.swarm.states import ONLINE, STATES
from lightning_swarm.swarm.training.averaging import StageStateAverager
from lightning_swarm.swarm.wire.protocol import StageService, stage_uid

pytestmark = pytest.mark.timeout(120)
_runs = itertools.count()
LOCAL = ("/ip4/127.0.0.1/tcp/0",)


def _maddrs(peer: SwarmPeer) -> tuple[str, ...]:
    return tuple(str(m) for m in peer.dht.get_visible_maddrs())


def _serving_peer(settings: SwarmSettings, training: bool = False) -> tuple[SwarmPeer, nn.Module]:
    """A peer that serves the single stage of a tiny pipeline (training: with the stage's hivemind optimizer,
    whose averager runs in its own process)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"layers": nn.Sequential(nn.Linear(4, 4), nn.Tanh())})
    peer = SwarmPeer(settings)
    peer.start_dht()
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1)] if training else []
    peer.join(model, optimizers, training=training)
    return peer, model


# ---------------------------------------------------------------------------------------------- signed records
@pytest.fixture(scope="module")
def honest_and_hostile():
    """An honest peer serving stage 0 of run ``R`` and a hostile DHT node in the same DHT (its own identity, a
    signer for its own key and no checks: it stores whatever it likes)."""
    settings = SwarmSettings(
        run_id=f"signed-{next(_runs)}", num_stages=1, compression="none", host_maddrs=LOCAL
    )
    honest, model = _serving_peer(settings)
    hostile_identity = PeerIdentity()
    path = f"/tmp/hostile-{os.getpid()}-{next(_runs)}.key"
    hostile_identity.save(path)
    try:
        hostile = hivemind.DHT(
            start=True,
            initial_peers=list(_maddrs(honest)),
            host_maddrs=list(LOCAL),
            identity_path=path,
            check_if_identity_free=False,
            record_validators=[RecordSigner(hostile_identity, swarm_keys(settings.run_id, 1))],
        )
    finally:
        os.remove(path)
    yield settings, honest, model, hostile, hostile_identity
    hostile.shutdown()
    honest.shutdown()


def test_forged_unsigned_and_malformed_records_are_rejected(honest_and_hostile) -> None:
    settings, honest, _, hostile, hostile_identity = honest_and_hostile
    victim = honest.dht.peer_id
    key, expiration = stage_key(settings.run_id, 0), get_dht_time() + 30
    forged = {
        "unsigned, naming the victim": dict(subkey=victim.to_base58(), value=[1e12, ONLINE, 1]),
        "victim's id with the hostile's key": dict(
            subkey=victim.to_base58().encode() + hostile_identity.owner, value=[1e12, ONLINE, 1]
        ),
        "overwriting the victim's record": dict(subkey=honest._identity.subkey, value=[1e12, "leaving", 1]),
        "off the schema": dict(subkey=hostile_identity.subkey, value=["fast", ONLINE, 1]),
    }
    for i, (what, record) in enumerate(forged.items()):
        # (distinct expirations: hivemind's storage cannot order str and bytes subkeys expiring at the same time)
        hostile.store(key, expiration_time=expiration + i / 10, **record)
        if record["subkey"] != honest._identity.subkey:  # (the honest node would sign its own subkey)
            # the same record handed to the honest node's own DHT is refused too
            assert not honest.dht.store(key, expiration_time=expiration + i / 10, **record), what
    forged_presence = dict(subkey=victim.to_base58().encode() + hostile_identity.owner, value=[2, True])
    hostile.store(presence_key(settings.run_id), expiration_time=expiration, **forged_presence)
    # the hostile node's own, well-formed record is accepted: the rejections above are about the forgeries
    assert hostile.store(
        key, subkey=hostile_identity.subkey, value=[3.0, ONLINE, 1], expiration_time=expiration + 1
    )

    found = honest.dht.get(key, latest=True)
    assert found is not None
    assert {subkey_peer_id(s) for s in found.value} == {victim, hostile.peer_id}
    assert all(isinstance(s, bytes) for s in found.value)  # signed subkeys only
    peers = {p.peer_id: p for p in get_stage_peers(honest.dht, settings.run_id, 0, states=STATES)}
    assert set(peers) == {victim, hostile.peer_id}
    assert peers[victim].state == ONLINE and peers[victim].throughput != 1e12  # its own figure
    assert peers[hostile.peer_id].throughput == 3.0
    phases = honest.presence.phases()
    assert phases is not None and phases[victim.to_base58()] == 0  # not the forged "may leave" phase


def test_the_client_times_its_calls_to_bound_announced_throughputs(honest_and_hostile) -> None:
    _, honest, model, hostile, _ = honest_and_hostile
    router = honest.client.routers[0]
    router.ban(hostile.peer_id)  # the hostile node serves nothing; route to the honest peer only
    with torch.no_grad():
        for _ in range(4):
            model["layers"](torch.randn(3, 4))
    assert honest.dht.peer_id in router.measured and router.measured[honest.dht.peer_id] > 0


# ---------------------------------------------------------------------------------------------- private swarms
SECRET = "correct horse battery staple"


@pytest.fixture(scope="module")
def private_peer():
    settings = SwarmSettings(
        run_id=f"private-{next(_runs)}",
        num_stages=1,
        compression="none",
        host_maddrs=LOCAL,
        secret=SECRET,
        no_peers_timeout=5.0,
    )
    peer, _ = _serving_peer(settings, training=True)
    yield settings, peer
    peer.shutdown()


@pytest.mark.parametrize("secret", [None, "not the secret"])
def test_a_peer_without_the_secret_cannot_join(private_peer, secret) -> None:
    settings, peer = private_peer
    outsider = SwarmPeer(settings.replace(secret=secret, initial_peers=_maddrs(peer)))
    try:
        with pytest.raises(
            RuntimeError, match=r"refused the call from this peer: this is a private swarm.*secret"
        ) as info:
            outsider.start_dht()
        assert "\n" not in str(info.value)
    finally:
        outsider.shutdown()


def test_a_bare_p2p_cannot_call_rpcs_or_download_state(private_peer) -> None:
    settings, peer = private_peer
    uid = stage_uid(settings.run_id, 0)

    async def attempt() -> dict[str, BaseException | None]:
        p2p = await P2P.create(initial_peers=list(_maddrs(peer)))
        errors: dict[str, BaseException | None] = {}
        try:
            stub = StageService.get_stub(p2p, peer.dht.peer_id, namespace=uid)
            prefix = f"{settings.run_id}_stage0_state_averager"
            averager = StageStateAverager.get_stub(p2p, peer.dht.peer_id, namespace=prefix)
            calls = {
                "rpc_info": lambda: stub.rpc_info(runtime_pb2.ExpertUID(uid=uid), timeout=15),
                "rpc_state": lambda: _drain(stub.rpc_state(runtime_pb2.ExpertUID(uid=uid))),
                "dht ping": lambda: p2p._call_unary_protobuf_handler(
                    peer.dht.peer_id, "DHTProtocol.rpc_ping", dht_pb2.PingRequest(), dht_pb2.PingResponse
                ),
                # the stage's averager (its own process): its state download and its matchmaking
                "averager state": lambda: _drain(
                    averager.rpc_download_state(averaging_pb2.DownloadRequest())
                ),
                "averager join": lambda: _drain(averager.rpc_join_group(averaging_pb2.JoinRequest())),
            }
            for name, call in calls.items():
                try:
                    await call()
                    errors[name] = None
                except Exception as e:
                    errors[name] = e
        finally:
            await p2p.shutdown()
        return errors

    errors = run_coroutine(attempt(), timeout=90)
    for name, error in errors.items():
        assert isinstance(error, P2PHandlerError) and "private swarm" in str(error), (name, error)


async def _drain(responses) -> list:
    return [r async for r in await responses]


def test_a_peer_with_the_secret_joins_and_downloads_the_state(private_peer) -> None:
    settings, peer = private_peer
    member = SwarmPeer(settings.replace(initial_peers=_maddrs(peer), role="trainer"))
    try:
        member.start_dht()
        client = SwarmClient(member.dht, member.settings)
        try:
            state = client.fetch_stage_state(0)
        finally:
            client.shutdown()
    finally:
        member.shutdown()
    expected = peer.server.state_dict_local()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_status_reads_a_private_swarm_with_the_secret_only(private_peer, capsys, monkeypatch) -> None:
    from lightning_swarm import cli

    settings, peer = private_peer
    monkeypatch.delenv("LIGHTNING_SWARM_SECRET", raising=False)
    args = ["status", "--initial-peers", *_maddrs(peer), "--run-id", settings.run_id]
    cli.main([*args, "--secret", SECRET])
    table = capsys.readouterr().out
    assert "1 stages, 1 peers (1 online)" in table and str(peer.dht.peer_id) in table, table
    with pytest.raises(SystemExit, match="private swarm pass --secret"):
        cli.main(args)


def test_an_allowlist_admits_exactly_the_listed_peers(tmp_path) -> None:
    path = str(tmp_path / "member.key")
    member_id = PeerIdentity.load_or_create(path).peer_id
    settings = SwarmSettings(run_id=f"allow-{next(_runs)}", host_maddrs=LOCAL)
    owner = SwarmPeer(settings.replace(allowed_peers=(member_id.to_base58(),)))
    owner.start_dht()
    member = SwarmPeer(settings.replace(identity_path=path, initial_peers=_maddrs(owner)))
    stranger = SwarmPeer(settings.replace(initial_peers=_maddrs(owner)))
    try:
        member.start_dht()
        assert member.dht.peer_id == member_id
        with pytest.raises(RuntimeError, match="is not on its allowed_peers list"):
            stranger.start_dht()
    finally:
        for p in (stranger, member, owner):
            p.shutdown()


# ---------------------------------------------------------------------------------------------- config errors
def test_dht_start_errors_say_what_to_do() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = SwarmPeer(SwarmSettings(host_maddrs=(f"/ip4/127.0.0.1/tcp/{port}",)))
        with pytest.raises(RuntimeError, match=r"already in use on this machine: pick a free port") as info:
            busy.start_dht()
        assert "\n" not in str(info.value)
    with pytest.raises(RuntimeError, match="invalid multiaddr"):
        SwarmPeer(SwarmSettings(host_maddrs=("/ip4/999.0.0.1/tcp/0",))).start_dht()
    unreachable = "/ip4/127.0.0.1/tcp/9/p2p/QmS7xWYXCHfk86VKafC2GgW5ZJ1nv2WoGFRYZa3phNEmWf"
    with pytest.raises(RuntimeError, match=r"no peer of initial_peers .* could be reached"):
        SwarmPeer(SwarmSettings(host_maddrs=LOCAL, initial_peers=(unreachable,))).start_dht()
    # a daemon failing for another reason
    message = dht_start_error(
        RuntimeError("Daemon failed to start: out of file descriptors"), list(LOCAL), []
    )
    assert "p2p daemon failed to start" in message and "\n" not in message


def test_stage_count_mismatch_between_peers_of_a_run(honest_and_hostile) -> None:
    settings, honest, _, _, _ = honest_and_hostile  # announces num_stages=1
    other = SwarmPeer(settings.replace(num_stages=2, initial_peers=_maddrs(honest), role="trainer"))
    try:
        other.start_dht()
        with pytest.raises(ValueError, match=r"num_stages=2\) but peers of run .* announce num_stages=1"):
            model = nn.ModuleDict({"layers": nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))})
            other.join(model, [], training=False)
    finally:
        other.shutdown()


def test_more_stages_than_blocks_and_unknown_pipeline() -> None:
    from lightning_swarm.swarm.peer.partition import Partition

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"Cannot split 2 blocks into 3 stages.*num_stages <= 2"):
        Partition(nn.ModuleDict({"layers": model}), "layers", 3)
    with pytest.raises(ValueError, match=r"has no attribute 'blocks'.*Point `pipeline`"):
        Partition(nn.ModuleDict({"layers": model}), "blocks", 1)
