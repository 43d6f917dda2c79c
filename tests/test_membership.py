"""Membership of a swarm, with real peers (DHT, P2P, hivemind averagers) on 127.0.0.1 and no Lightning: a peer
joining mid-run serves the stage's current weights from its first reply, peers move to the bottleneck stage
and stay there, a peer allocates only the stage it hosts, and a leaving peer says so."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from torch import nn

from lightning_swarm.swarm import SwarmPeer, SwarmSettings
from lightning_swarm.swarm.dht.records import get_stage_peers
from lightning_swarm.swarm.states import LEAVING, ONLINE, STATES

_runs = itertools.count()


class Rotary(nn.Module):
    """A block written as many libraries write theirs: a bare ``nn.Parameter`` (no ``reset_parameters()``) and a
    non-persistent buffer computed in ``__init__`` (rotary frequencies: in no ``state_dict``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(width))
        freqs = 1.0 / (10000 ** (torch.arange(0, width, 2).float() / width))
        self.register_buffer("inv_freq", torch.cat([freqs, freqs]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x) * torch.cos(self.inv_freq) * self.gain)


class Model(nn.Module):
    """Trainer-local ``inp``; a pipeline of 8 blocks (4 stages of 2 blocks, or 2 of 4)."""

    def __init__(
        self, width: int = 16, blocks: int = 8, meta_blocks: bool = False, rotary: bool = False
    ) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        with torch.device("meta" if meta_blocks else "cpu"):
            self.layers = nn.Sequential(
                *(
                    Rotary(width) if rotary else nn.Sequential(nn.Linear(width, width), nn.Tanh())
                    for _ in range(blocks)
                )
            )


def _settings(name: str, **changes) -> SwarmSettings:
    return SwarmSettings(
        run_id=f"{name}-{next(_runs)}",
        num_stages=2,
        compression="none",
        stage_steps="async",  # the stages step on their own every target_batch_size samples
        target_batch_size=4,
        matchmaking_time=0.5,
        averaging_timeout=10.0,
        no_peers_timeout=5.0,
        request_timeout=10.0,
        linger_timeout=20.0,
        announce_period=1.0,
        expiration=8.0,
        refresh_period=1.0,
        rebalance_period=0.0,
    ).replace(**changes)


def _peer(
    settings: SwarmSettings, seed: int, maddrs: tuple[str, ...] = (), **model_kwargs
) -> tuple[SwarmPeer, Model]:
    torch.manual_seed(seed)
    model = Model(**model_kwargs)
    peer = SwarmPeer(settings.replace(initial_peers=maddrs))
    peer.start_dht()
    peer.join(model, [torch.optim.Adam(model.parameters(), lr=0.01)], training=True)
    return peer, model


def _maddrs(peer: SwarmPeer) -> tuple[str, ...]:
    return tuple(str(m) for m in peer.dht.get_visible_maddrs())


def _optimizer_state(peer: SwarmPeer) -> list[torch.Tensor]:
    opt = peer.server.optimizer.state_averager.optimizer
    return [
        v for state in opt.state.values() for k, v in sorted(state.items()) if isinstance(v, torch.Tensor)
    ]


@pytest.mark.timeout(240)
def test_a_joining_peer_serves_its_stages_current_weights_before_its_first_reply() -> None:
    settings = _settings("join")
    peers = []
    try:
        a, model = _peer(settings.replace(stage=0), seed=0)
        peers.append(a)
        b, _ = _peer(settings.replace(stage=1, role="server"), seed=0, maddrs=_maddrs(a))
        peers.append(b)
        for _ in range(4):  # each backward is a target batch: stage 1 steps (Adam) every time
            model.layers(model.inp(torch.randn(4, 4))).pow(2).mean().backward()
            # backwards that pile up before the stepper takes them make one step (one epoch) together
            b.server.flush(timeout=30)
        assert b.server.optimizer.local_epoch >= 2
        # c starts from other initial weights; by the time join returns it is online with b's weights and state
        c, _ = _peer(settings.replace(stage=1, role="server"), seed=1, maddrs=_maddrs(a))
        peers.append(c)
        records = {p.peer_id: p.state for p in get_stage_peers(a.dht, settings.run_id, 1, states=STATES)}
        assert records[c.dht.peer_id] == ONLINE
        expected, served = b.server.state_dict_local(), c.server.state_dict_local()
        assert expected.keys() == served.keys()
        for key in expected:
            assert torch.equal(expected[key], served[key]), key
        assert c.server.optimizer.local_epoch == b.server.optimizer.local_epoch
        for theirs, ours in zip(_optimizer_state(b), _optimizer_state(c), strict=True):
            assert torch.equal(theirs, ours)
        # and the first call it answers (the trainer calls it in-process here) computes with those weights
        x = torch.randn(3, 16)
        with torch.no_grad():
            reply = c.server.module(x)
            reference = b.server.module(x)
        assert torch.equal(reply, reference)

        # a peer that stops announces it first; trainers no longer route to it
        c_id = c.dht.peer_id
        c.shutdown()
        peers.remove(c)
        records = {p.peer_id: p.state for p in get_stage_peers(a.dht, settings.run_id, 1, states=STATES)}
        assert records == {b.dht.peer_id: ONLINE, c_id: LEAVING}
        assert [p.peer_id for p in get_stage_peers(a.dht, settings.run_id, 1)] == [b.dht.peer_id]
    finally:
        for peer in peers:
            peer.shutdown()


def _allocated(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if not p.is_meta)


@pytest.mark.timeout(180)
def test_a_peer_allocates_only_the_stage_it_hosts() -> None:
    settings = _settings("memory", num_stages=4)
    peers = []
    try:
        # blocks built normally: the peer frees the three stages it does not host
        a, model_a = _peer(settings.replace(stage=1, role="server"), seed=0)
        peers.append(a)
        pipeline = sum(p.numel() for p in Model().layers.parameters())
        local = _allocated(model_a.inp)
        hosted = _allocated(a.server.module)
        assert hosted == pipeline // 4
        assert _allocated(model_a) == local  # the proxy holds no parameters; the container is aside
        assert _allocated(a.partition.container) == hosted <= pipeline / 4 + 1
        # blocks built on the meta device are never allocated except the hosted stage's, initialised the same
        # way on every peer that founds it
        b, model_b = _peer(
            settings.replace(stage=2, role="server"), seed=0, maddrs=_maddrs(a), meta_blocks=True
        )
        peers.append(b)
        c, _ = _peer(settings.replace(stage=2, role="server"), seed=5, maddrs=_maddrs(a), meta_blocks=True)
        peers.append(c)
        assert _allocated(b.partition.container) == pipeline // 4
        assert all(
            p.is_meta for k in (0, 1, 3) for blk in b.partition.stage_blocks(k) for p in blk.parameters()
        )
        for key, value in b.server.state_dict_local().items():
            assert torch.isfinite(value).all() and value.abs().sum() > 0, key
            assert torch.equal(value, c.server.state_dict_local()[key]), key
    finally:
        for peer in peers:
            peer.shutdown()


@pytest.mark.timeout(300)
def test_three_and_one_become_two_and_two_and_stay() -> None:
    period = 2.0
    settings = _settings("rebalance", rebalance_period=period, rebalance_min_gain=0.1)
    peers: list[SwarmPeer] = []
    try:
        maddrs: tuple[str, ...] = ()
        for stage in (0, 0, 0, 1):
            peer, _ = _peer(settings.replace(stage=stage, role="server"), seed=0, maddrs=maddrs)
            # same speed: announce the same throughput (nothing is measured without trainers)
            peer.server.throughput.value, peer.server.throughput.measured = 100.0, True
            peer.server.set_state(ONLINE)
            peers.append(peer)
            maddrs = maddrs or _maddrs(peer)

        def counts() -> list[int]:
            return [len(get_stage_peers(peers[0].dht, settings.run_id, k)) for k in range(2)]

        deadline = time.monotonic() + 20 * period
        while counts() != [2, 2] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert counts() == [2, 2], f"peers per stage: {counts()} after {20 * period:.0f} s"
        time.sleep(6 * period)  # it stays there: nobody moves again
        assert counts() == [2, 2]
        moved = [p for p in peers if p.host.migrations]
        assert len(moved) == 1 and len(moved[0].host.migrations) == 1
        mover = moved[0]
        assert (mover.host.migrations[0].src, mover.host.migrations[0].dst, mover.stage) == (0, 1, 1)
        # the mover freed its old stage, allocated the new one and serves the weights of the stage's peers
        assert not mover.partition.is_materialized(0) and mover.partition.is_materialized(1)
        expected = peers[3].server.state_dict_local()
        for key, value in mover.server.state_dict_local().items():
            assert torch.equal(value, expected[key]), key
    finally:
        for peer in peers:
            peer.shutdown()


@pytest.mark.timeout(180)
def test_a_peer_moves_to_a_stage_whose_blocks_hold_bare_parameters_and_non_persistent_buffers() -> None:
    """Moving to another stage allocates blocks the peer had freed: a bare parameter (no ``reset_parameters()``)
    comes from the stage's peer, a non-persistent buffer (in no state) comes back as the peer had built it, and
    the mover computes what the stage's other peer computes."""
    settings = _settings("move")
    peers = []
    try:
        a, model = _peer(settings.replace(stage=0), seed=0, rotary=True)
        peers.append(a)
        b, _ = _peer(settings.replace(stage=1, role="server"), seed=0, maddrs=_maddrs(a), rotary=True)
        peers.append(b)
        c, _ = _peer(settings.replace(stage=0, role="server"), seed=0, maddrs=_maddrs(a), rotary=True)
        peers.append(c)
        model.layers(model.inp(torch.randn(4, 4))).pow(2).mean().backward()  # stage 1 steps: new weights
        b.server.flush(timeout=30)
        assert b.server.optimizer.local_epoch >= 1
        c.host.migrate(1)
        assert c.stage == 1 and not c.partition.is_materialized(0) and c.partition.is_materialized(1)
        expected, served = b.server.state_dict_local(), c.server.state_dict_local()
        for key in expected:
            assert torch.equal(expected[key], served[key]), key
        freqs = Rotary(16).inv_freq
        for block in c.partition.stage_blocks(1):
            assert torch.equal(block.inv_freq, freqs)
        x = torch.randn(3, 16)
        with torch.no_grad():
            assert torch.equal(c.server.module(x), b.server.module(x))
    finally:
        for peer in peers:
            peer.shutdown()
