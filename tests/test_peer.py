"""SwarmPeer end to end in one process: two peers (DHT, stage server, client) on 127.0.0.1, no Lightning.

Peer ``a`` trains and serves stage 0; peer ``b`` only serves stage 1. When the run ends, ``a`` gathers both
stages from the swarm into its module.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time

import pytest
import torch
from torch import nn

from lightning_swarm.swarm import SwarmPeer, SwarmSettings

_runs = itertools.count()


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), nn.Linear(4, 4))


def _two_peers(name: str) -> tuple[SwarmPeer, SwarmPeer, Model, dict]:
    settings = SwarmSettings(
        run_id=f"{name}-{next(_runs)}",
        num_stages=2,
        compression="none",
        stage_steps="async",  # the stages step on their own every target_batch_size samples
        target_batch_size=4,
        matchmaking_time=0.5,
        no_peers_timeout=3.0,
        request_timeout=5.0,
        linger_timeout=20.0,
    )
    torch.manual_seed(0)
    model_a = Model()
    model_b = copy.deepcopy(model_a)
    initial = copy.deepcopy(model_a.state_dict())
    a = SwarmPeer(settings.replace(stage=0))
    a.start_dht()
    maddrs = tuple(str(m) for m in a.dht.get_visible_maddrs())
    b = SwarmPeer(settings.replace(stage=1, role="server", initial_peers=maddrs))
    b.start_dht()
    for peer, model in ((a, model_a), (b, model_b)):
        peer.join(model, [torch.optim.SGD(model.parameters(), lr=0.1)], training=True)
    return a, b, model_a, initial


def _leave_together(a: SwarmPeer, b: SwarmPeer) -> None:
    """``b`` leaves in a thread while ``a`` leaves here (each waits for the other's phase)."""
    thread = threading.Thread(target=b.leave)
    thread.start()
    try:
        a.leave()
    finally:
        thread.join(timeout=60)
        assert not thread.is_alive()


@pytest.mark.timeout(180)
def test_gathered_module_equals_the_stage_servers() -> None:
    a, b, model, initial = _two_peers("gather")
    try:
        for _ in range(3):
            model.layers(torch.randn(4, 4)).pow(2).mean().backward()
        expected = {0: a.server.state_dict_local(), 1: b.server.state_dict_local()}
        _leave_together(a, b)
    finally:
        a.shutdown()
        b.shutdown()
    assert isinstance(model.layers, nn.Sequential)  # the container is back
    # stage 0 holds blocks 0-1 (Linear, Tanh), stage 1 blocks 2-3: every gathered tensor equals the server's
    gathered = model.state_dict()
    for stage, offset in ((0, 0), (1, 2)):
        for key, value in expected[stage].items():
            index, rest = key.split(".", 1)
            name = f"layers.{int(index) + offset}.{rest}"
            assert torch.equal(gathered[name], value), name
            assert not torch.equal(value, initial[name]), f"{name} did not train"


@pytest.mark.timeout(180)
def test_a_stage_that_cannot_be_gathered_is_an_error_not_stale_weights() -> None:
    a, b, model, _ = _two_peers("lost")
    try:
        model.layers(torch.randn(4, 4)).pow(2).mean().backward()
        b.server.shutdown()  # stage 1's only server is gone before the end of the run
        with pytest.raises(RuntimeError, match=r"could not gather the parameters of stage\(s\) \[1\]"):
            _leave_together(a, b)
    finally:
        a.shutdown()
        b.shutdown()
    assert isinstance(model.layers, nn.Sequential)  # still a whole module, but the caller was told


def _peer(settings: SwarmSettings, model: Model, **changes) -> SwarmPeer:
    peer = SwarmPeer(settings.replace(**changes))
    peer.start_dht()
    peer.join(model, [torch.optim.SGD(model.parameters(), lr=0.1)], training=True)
    return peer


@pytest.mark.timeout(180)
def test_a_trainer_that_serves_nothing_leaves_at_once_and_servers_serve_on(capfd) -> None:
    """Servers that never finish (``lightning-swarm serve``) do not hold a trainer back, and serve the next one."""
    settings = SwarmSettings(
        run_id=f"leave-{next(_runs)}",
        num_stages=1,
        compression="none",
        target_batch_size=4,
        linger_timeout=60.0,
    )
    torch.manual_seed(0)
    models = [Model() for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    server = _peer(settings, models[0], stage=0, role="server")
    peers = [server]
    try:
        maddrs = tuple(str(m) for m in server.dht.get_visible_maddrs())
        for model in models[1:]:
            trainer = _peer(settings, model, role="trainer", initial_peers=maddrs)
            peers.append(trainer)
            model.layers(torch.randn(4, 4)).pow(2).mean().backward()
            start = time.monotonic()
            trainer.leave()
            assert time.monotonic() - start < 10.0  # not linger_timeout
            assert isinstance(model.layers, nn.Sequential)  # gathered from the server, which still serves
            for name, value in server.server.state_dict_local().items():
                assert torch.equal(model.layers.state_dict()[name], value), name
        assert "still serving" not in capfd.readouterr().err
    finally:
        for peer in reversed(peers):
            peer.shutdown()


@pytest.mark.timeout(180)
def test_a_trainer_that_serves_a_stage_lingers_while_another_trainer_trains(capfd) -> None:
    a, b, _, initial = _two_peers("linger")
    peers = [a, b]
    left = threading.Event()
    thread = threading.Thread(target=lambda: (a.leave(), left.set()))
    try:
        other_model = Model()
        other_model.load_state_dict(initial)
        maddrs = tuple(str(m) for m in a.dht.get_visible_maddrs())
        other = _peer(a.settings, other_model, stage=None, role="trainer", initial_peers=maddrs)
        peers.append(other)
        other_model.layers(torch.randn(4, 4)).pow(2).mean().backward()
        thread.start()
        assert not left.wait(4.0)  # the other trainer still uses a's stage
        err = capfd.readouterr().err
        lines = [line for line in err.splitlines() if "still serving" in line]
        assert len(lines) == 1 and "until 1 other trainer(s) finish training (at most 20 s)" in lines[0], err
        other.leave()  # gathers both stages, a's included, then a may go
        assert left.wait(30.0)
    finally:
        if thread.is_alive():
            thread.join(timeout=60)
        for peer in reversed(peers):
            peer.shutdown()
    assert isinstance(other_model.layers, nn.Sequential)


def test_a_trainer_whose_record_lapses_for_a_moment_still_counts_as_live_and_a_finished_one_does_not(
    monkeypatch,
) -> None:
    """The trainers a step waits for come from the presence records. A record that vanishes (its peer died, or, on a
    loaded machine, its announcements lag behind the record's lifetime) keeps its trainer live for a grace period:
    a moment's lag must not make a live trainer's step go on without it. A record that says its trainer finished
    takes it out at once."""
    from lightning_swarm.swarm.peer import peer as peer_module
    from lightning_swarm.swarm.states import FINISHED

    monkeypatch.setattr(peer_module, "VANISHED_GRACE_S", 3.0)
    settings = SwarmSettings(run_id=f"live-{next(_runs)}", num_stages=2)
    me = SwarmPeer(settings)
    peers = [me]
    try:
        me.start_dht()
        maddrs = tuple(str(m) for m in me.dht.get_visible_maddrs())
        for _ in range(2):
            peers.append(SwarmPeer(settings.replace(initial_peers=maddrs)))
            peers[-1].start_dht()
        lapses, finishes = (p.presence.peer_name for p in peers[1:])
        assert me.presence is not None
        deadline = time.monotonic() + 20.0
        while me.live_trainers() != {p.presence.peer_name for p in peers} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert me.live_trainers() == {p.presence.peer_name for p in peers}
        peers[1].presence.shutdown()  # it announces no more: its record expires
        peers[2].presence.set_phase(FINISHED)
        while lapses in (me.presence.records() or {lapses}) and time.monotonic() < deadline:
            me.live_trainers()  # read as a step's leader reads them (at most every 0.5 s)
            time.sleep(0.2)
        live = me.live_trainers()
        assert (
            live is not None and lapses in live and finishes not in live
        )  # its record is gone, not its grace
        # the last read that found its record: the grace counts from there
        last_seen = me._trainers_seen[lapses]
        while lapses in (me.live_trainers() or {lapses}) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert me.live_trainers() == {me.presence.peer_name}
        assert time.monotonic() - last_seen >= 3.0
    finally:
        for peer in peers:
            peer.shutdown()
