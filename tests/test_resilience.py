"""Resilience of the engine over real hivemind DHT/P2P on 127.0.0.1: serving during averaging rounds, backwards
applied at most once, and the end-of-run handshake's bounded waits."""

from __future__ import annotations

import copy
import threading
import time

import hivemind
import pytest
import torch
from torch import nn

from lightning_swarm.swarm.client.client import MIN_ATTEMPT_TIMEOUT_S, SwarmClient
from lightning_swarm.swarm.dht.presence import Presence
from lightning_swarm.swarm.lifetime import PeerStopping
from lightning_swarm.swarm.settings import SwarmSettings
from lightning_swarm.swarm.states import FINISHED
from lightning_swarm.swarm.wire.errors import UNAVAILABLE
from lightning_swarm.swarm.wire.payload import Payload
from lightning_swarm.swarm.wire.protocol import StageRequest, stage_uid
from lightning_swarm.swarm.wire.transport import encode_request
from tests.test_stage_server import _client, _run_id, _serve


class SlowBackward(nn.Module):
    """A stage whose backward (the recomputed forward, with grad) takes ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            time.sleep(self.delay)
        return self.linear(x)


def _accumulated(server) -> int:
    server.flush()
    return int(server.optimizer.grad_averager.local_samples_accumulated)


@pytest.mark.timeout(120)
def test_backward_retried_after_a_timeout_is_applied_once(dhts, cleanup) -> None:  # noqa: F811
    """The first peer is too slow: the trainer times out and retries elsewhere, and the slow peer, finishing
    after the caller's commit deadline, does not apply the gradients: the microbatch counts exactly once."""
    torch.manual_seed(0)
    run_id = _run_id("once")
    slow_module = SlowBackward(delay=8.0)
    fast_module = copy.deepcopy(slow_module)
    fast_module.delay = 0.0
    slow = _serve(cleanup, dhts["server1"], run_id, slow_module)
    client = _client(
        cleanup,
        dhts["trainer"],
        run_id,
        request_timeout=4.0,
        refresh_period=600.0,
        no_peers_timeout=30.0,
        keep_activations=0,  # the backward recomputes the forward with grad: that is what is slow here
    )
    assert [p.peer_id for p in client.peers(0)] == [slow.peer_id]
    x = torch.randn(2, 4, requires_grad=True)
    y = client.call_stage(0, x)  # the forward is quick: it runs without grad
    fast = _serve(cleanup, dhts["server2"], run_id, fast_module)  # appears after the forward
    y.sum().backward()  # times out on `slow`, then a DHT lookup finds `fast`
    expected = torch.autograd.grad(fast_module.linear(x).sum(), x)[0]
    torch.testing.assert_close(x.grad, expected, atol=1e-5, rtol=0)
    assert client.stats()["swarm/retries"] == 1
    time.sleep(6.0)  # `slow` finishes its backward now, after the deadline
    assert _accumulated(slow) == 0 and slow.backend.samples_processed == 0
    assert _accumulated(fast) == 2 and fast.backend.samples_processed == 2


class Hangs(nn.Module):
    """A stage that stops answering (as a SIGKILLed peer whose stream is not reset) while ``hang`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.hang, self.release = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hang.is_set():
            self.release.wait(timeout=90)
        return self.linear(x)


@pytest.mark.timeout(150)
def test_a_peer_that_stops_answering_costs_seconds_not_the_request_timeout(dhts, cleanup) -> None:  # noqa: F811
    """With another peer of the stage to retry on, an attempt that takes far longer than the stage's recent calls
    is given up after a few seconds (the adaptive attempt timeout), not after ``request_timeout``."""
    torch.manual_seed(0)
    run_id = _run_id("stall")
    stalling = Hangs()
    a = _serve(cleanup, dhts["server1"], run_id, stalling)
    twin = Hangs()
    twin.load_state_dict(stalling.state_dict())
    _serve(cleanup, dhts["server2"], run_id, twin)
    client = _client(cleanup, dhts["trainer"], run_id, request_timeout=60.0, refresh_period=600.0)
    assert len(client.peers(0)) == 2
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(12):  # both peers answer quickly: the client learns the stage's usual latency
            client.call_stage(0, x)
        assert MIN_ATTEMPT_TIMEOUT_S <= client._attempt_timeout(0, "forward") < 60.0
        stalling.hang.set()
        try:
            start = time.monotonic()
            for _ in range(4):
                torch.testing.assert_close(client.call_stage(0, x), stalling.linear(x))
            elapsed = time.monotonic() - start
        finally:
            stalling.release.set()
    # one attempt hung, then that peer was banned (on a loaded box a healthy attempt may also outlast the adaptive
    # timeout once: it is retried too)
    assert 1 <= client.stats()["swarm/retries"] <= 2
    assert elapsed < 30.0, f"4 calls took {elapsed:.1f} s: the hung attempt waited for request_timeout (60 s)"
    assert client.routers[0].is_banned(a.peer_id)


@pytest.mark.timeout(120)
def test_a_call_in_flight_is_abandoned_once_the_peer_must_stop(dhts, cleanup) -> None:  # noqa: F811
    """A call waiting for a peer that does not answer ends within a fraction of a second of the peer's
    ``should_stop`` turning: with another peer's failure (what ``should_stop`` raises), that error; else
    ``PeerStopping``. Not after ``request_timeout`` (60 s here)."""
    torch.manual_seed(0)
    run_id = _run_id("abandon")
    stage = Hangs()
    _serve(cleanup, dhts["server1"], run_id, stage)
    verdict: list = [False]

    def should_stop() -> bool:
        if isinstance(verdict[0], BaseException):
            raise verdict[0]
        return verdict[0]

    settings = SwarmSettings(
        run_id=run_id, num_stages=1, compression="none", request_timeout=60.0, refresh_period=600.0
    )
    client = SwarmClient(dhts["trainer"], settings, should_stop=should_stop)
    cleanup.append(client)
    x = torch.randn(2, 4)
    with torch.no_grad():
        client.call_stage(0, x)  # answered: the channel to the peer is open
        stage.hang.set()
        try:
            for turn in (True, ValueError("user bug on another peer")):
                verdict[0] = False
                ended: list = []

                def call(ended: list = ended) -> None:
                    try:
                        client.call_stage(0, x)
                    except BaseException as e:  # what the call raised is the point
                        ended.append((e, time.monotonic()))

                thread = threading.Thread(target=call)
                thread.start()
                time.sleep(1.0)  # the call is in flight, waiting for the hung peer
                assert not ended
                verdict[0], turned = turn, time.monotonic()
                thread.join(timeout=10)
                assert ended, "the call did not end after should_stop turned"
                error, when = ended[0]
                assert when - turned < 2.0, when - turned
                if turn is True:
                    assert isinstance(error, PeerStopping), error
                else:
                    assert error is turn, error
        finally:
            stage.release.set()


@pytest.mark.timeout(120)
def test_a_resent_backward_is_applied_once_and_a_late_one_not_at_all(dhts, cleanup) -> None:  # noqa: F811
    torch.manual_seed(0)
    run_id = _run_id("dup")
    server = _serve(cleanup, dhts["server1"], run_id, nn.Linear(4, 4))
    x, g = torch.randn(3, 4), torch.randn(3, 4)
    request = StageRequest(
        "backward", stage_uid(run_id, 0), Payload.call((x.requires_grad_(),), {}), Payload.flatten((g,)), 77
    )
    first, again = server.handle(request), server.handle(request)
    assert first.error is None and again.error is None
    torch.testing.assert_close(first.outputs.rebuild(), again.outputs.rebuild())  # the caller gets its reply
    assert _accumulated(server) == 3 and server.backend.samples_processed == 3  # ... but it counts once
    request.request_id, request.commit_by = 78, time.time() - 1.0
    late = server.handle(request)
    assert (
        late.error is not None and late.error.category == UNAVAILABLE and "not applied" in late.error.message
    )
    assert _accumulated(server) == 3


class _SlowSGD(torch.optim.SGD):
    """SGD whose step takes ``delay`` seconds, as a long averaging round or a large optimizer step does."""

    delay = 2.0

    def step(self, closure=None):  # type: ignore[override]
        time.sleep(self.delay)
        return super().step(closure)


@pytest.mark.timeout(180)
def test_serving_continues_during_a_long_optimizer_step(dhts, cleanup) -> None:  # noqa: F811
    """Peer A's stepper is busy for seconds in each optimizer step (what an averaging round that waits for its
    partners, or a large stage's step, costs): all that time A answers forward calls at once."""
    torch.manual_seed(0)
    run_id = _run_id("avg")
    opts = {"target_batch_size": 4, "matchmaking_time": 1.0, "averaging_timeout": 8.0}
    a = _serve(
        cleanup,
        dhts["server1"],
        run_id,
        nn.Linear(4, 4),
        optimizer_factory=lambda p: _SlowSGD(p, lr=0.1),
        **opts,
    )
    client = _client(cleanup, dhts["trainer"], run_id)
    uid = stage_uid(run_id, 0)

    def call(server, kind: str, batch: int, request_id: int) -> float:
        x = torch.randn(batch, 4, requires_grad=kind == "backward")
        grads = Payload.flatten((torch.ones(batch, 4),)) if kind == "backward" else None
        request = StageRequest(kind, uid, Payload.call((x,), {}), grads, request_id)
        start = time.monotonic()
        reply, _, _ = client.transport(server.peer_id, 0).call(request, encode_request(request, "none"))
        assert reply.error is None, reply.error
        return time.monotonic() - start

    during_steps: list[float] = []
    deadline = time.monotonic() + 90
    while len(during_steps) < 5 and time.monotonic() < deadline:
        call(a, "backward", 1, 1000 + int(time.monotonic() * 1000))  # A's stepper gets work...
        for _ in range(3):  # ... while forwards keep coming
            in_step = a.stepper.step_lock.locked()
            latency = call(a, "forward", 4, 0)
            if in_step and a.stepper.step_lock.locked():
                during_steps.append(latency)
            time.sleep(0.1)
    assert len(during_steps) >= 5, "A never ran a long optimizer step"
    assert max(during_steps) < 1.5, during_steps
    assert a.optimizer.local_epoch >= 1  # the steps ended


@pytest.mark.timeout(120)
def test_handshake_waits_are_bounded_and_unknown_is_not_empty(dhts) -> None:  # noqa: F811
    run_id = _run_id("presence")
    server = Presence(dhts["server1"], run_id, "server", period=1.0, trainer=False)
    server.start()
    server.set_phase(FINISHED)  # as a server-only peer does: it serves until the trainers are done
    try:
        # a server-only peer started before any trainer waits for one to appear (it used to leave at once)
        start = time.monotonic()
        assert not server.wait_for(FINISHED, None, timeout=2.0, trainers_only=True)
        assert time.monotonic() - start >= 2.0
        trainer = Presence(dhts["server2"], run_id, "trainer", period=1.0, trainer=True)
        trainer.start()
        assert not server.wait_for(FINISHED, None, timeout=1.5, trainers_only=True)  # it trains
        trainer.set_phase(FINISHED)
        assert server.wait_for(FINISHED, None, timeout=30.0, trainers_only=True)
        # a peer of a local swarm that appeared and died does not hold the others (its record expires)
        dying = Presence(dhts["trainer"], run_id, "dying", period=1.0, trainer=True)
        dying.start()
        assert not server.wait_for(FINISHED, 3, timeout=1.0)
        dying.shutdown()
        start = time.monotonic()
        assert server.wait_for(FINISHED, 3, timeout=30.0)
        assert time.monotonic() - start < 20.0  # its record lives 3 s
        # one that lived and died mid-run, while nobody was waiting, counts as having appeared too
        brief = Presence(dhts["trainer"], run_id, "brief", period=1.0, trainer=True)
        brief.start()
        time.sleep(2.5)  # the others' presence threads read the records meanwhile
        brief.shutdown()
        time.sleep(4.0)  # its record expires
        start = time.monotonic()
        assert server.wait_for(FINISHED, 4, timeout=30.0)
        assert time.monotonic() - start < 10.0
        trainer.shutdown()
    finally:
        server.shutdown()
    # an unreadable DHT is unknown, not "nobody is here": the wait gives up after unreadable_timeout
    dead = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    lonely = Presence(dead, run_id, "lonely", period=1.0, unreadable_timeout=1.0)
    dead.shutdown()
    assert lonely.records() is None
    start = time.monotonic()
    assert not lonely.wait_for(FINISHED, None, timeout=30.0)
    assert time.monotonic() - start < 10.0
