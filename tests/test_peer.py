"""SwarmPeer end to end in one process: two peers (DHT, stage server, client) on 127.0.0.1, no Lightning.

Peer ``a`` trains and serves stage 0; peer ``b`` only serves stage 1. When the run ends, ``a`` gathers both
stages from the swarm into its module.
"""

from __future__ import annotations

import copy
import itertools
import threading

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
