"""Stochastic wiring: proportional routing, probing of newcomers, bans with backoff, clear errors."""

from __future__ import annotations

from collections import Counter

import pytest
from hivemind.p2p import PeerID

from lightning_swarm.swarm.client.routing import NoPeersError, StageRouter
from lightning_swarm.swarm.dht.records import PeerInfo


def _peer(i: int) -> PeerID:
    return PeerID(f"peer-{i}".encode())


def _info(i: int, throughput: float) -> PeerInfo:
    return PeerInfo(peer_id=_peer(i), stage=1, throughput=throughput, expiration=float("inf"))


def test_selection_frequencies_follow_throughput() -> None:
    router = StageRouter(stage=1)
    router.update_peers([_info(0, 1.0), _info(1, 2.0), _info(2, 5.0)])
    counts = Counter(router.choose(task_size=8, now=0.0) for _ in range(800))
    assert sum(counts.values()) == 800
    # weighted round robin is deterministic: shares match 1:2:5 up to one task per peer
    assert abs(counts[_peer(0)] - 100) <= 1
    assert abs(counts[_peer(1)] - 200) <= 1
    assert abs(counts[_peer(2)] - 500) <= 1


def test_interleaving_is_smooth() -> None:
    router = StageRouter(stage=0)
    router.update_peers([_info(0, 1.0), _info(1, 1.0)])
    picks = [router.choose(task_size=1, now=0.0) for _ in range(10)]
    assert all(a != b for a, b in zip(picks, picks[1:], strict=False))  # equal peers alternate


def test_new_peer_is_probed_soon_without_being_flooded() -> None:
    router = StageRouter(stage=0)
    router.update_peers([_info(0, 1.0), _info(1, 1.0)])
    for _ in range(100):
        router.choose(task_size=1, now=0.0)
    router.update_peers([_info(0, 1.0), _info(1, 1.0), _info(2, 1.0)])
    picks = [router.choose(task_size=1, now=0.0) for _ in range(6)]
    assert _peer(2) in picks[:2]  # enters at the current minimum busy time
    assert picks.count(_peer(2)) == 2  # ...and then gets only its fair share


def test_departed_peer_is_not_chosen() -> None:
    router = StageRouter(stage=0)
    router.update_peers([_info(0, 1.0), _info(1, 1.0)])
    router.update_peers([_info(1, 1.0)])
    assert {router.choose(task_size=1, now=0.0) for _ in range(5)} == {_peer(1)}


def test_ban_with_exponential_backoff_and_reset() -> None:
    router = StageRouter(stage=2, ban_base_s=15.0, ban_max_s=100.0)
    router.update_peers([_info(0, 100.0), _info(1, 1.0)])
    assert router.ban(_peer(0), now=0.0) == 15.0
    assert all(router.choose(task_size=1, now=t) == _peer(1) for t in (0.0, 5.0, 14.9))
    assert router.is_banned(_peer(0), now=14.9) and not router.is_banned(_peer(0), now=15.0)
    assert router.choose(task_size=1, now=15.0) == _peer(0)  # back, and probed first
    assert router.ban(_peer(0), now=20.0) == 30.0  # second consecutive failure: doubled
    assert router.is_banned(_peer(0), now=49.9)
    assert router.ban(_peer(0), now=60.0) == 60.0
    assert router.ban(_peer(0), now=130.0) == 100.0  # capped
    router.report_success(_peer(0))
    assert router.ban(_peer(0), now=300.0) == 15.0  # success resets the backoff


def test_exclude_skips_peers_for_one_call() -> None:
    router = StageRouter(stage=0)
    router.update_peers([_info(0, 10.0), _info(1, 1.0)])
    assert router.choose(task_size=1, now=0.0, exclude={_peer(0)}) == _peer(1)
    assert router.choose(task_size=1, now=0.0) == _peer(0)


def test_ban_survives_reannouncement() -> None:
    router = StageRouter(stage=0)
    router.update_peers([_info(0, 1.0), _info(1, 1.0)])
    router.ban(_peer(0), now=0.0)
    router.update_peers([_info(0, 1.0), _info(1, 1.0)])
    assert {router.choose(task_size=1, now=1.0) for _ in range(4)} == {_peer(1)}


def test_no_peers_error_messages() -> None:
    router = StageRouter(stage=3, run_id="myrun")
    with pytest.raises(NoPeersError, match=r"stage 3 of run 'myrun': 0 known.*Start a server for stage 3"):
        router.choose(task_size=1, now=0.0)
    router.update_peers([_info(0, 1.0), _info(1, 1.0)])
    router.ban(_peer(0), now=0.0)
    with pytest.raises(NoPeersError, match=r"2 known, 1 banned, 1 excluded\. The next ban ends in 15\.0 s"):
        router.choose(task_size=1, now=0.0, exclude={_peer(1)})
    assert router.num_live(now=0.0) == 1


def test_invalid_settings_and_throughputs() -> None:
    with pytest.raises(ValueError, match="ban_base_s"):
        StageRouter(stage=0, ban_base_s=10.0, ban_max_s=1.0)
    router = StageRouter(stage=0)
    router.update_peers([_info(0, 0.0), _info(1, float("nan")), _info(2, 1.0)])
    counts = Counter(router.choose(task_size=1, now=0.0) for _ in range(50))
    assert counts[_peer(2)] >= 48  # zero/NaN throughput peers are probed once, then starve


def _simulate(
    router: StageRouter, speed: dict, calls: int, timed: bool = True, latency: float = 0.05
) -> Counter:
    """Route ``calls`` microbatches of 4 samples as the client does: choose, call (a peer of ``speed`` samples/s
    takes ``4 / speed + latency`` seconds), report the timing; returns the picks of the second half."""
    picks: Counter = Counter()
    for i in range(calls):
        peer = router.choose(task_size=4, now=0.0)
        seconds = 4 / speed[peer] + latency
        router.report_success(peer, 4, seconds) if timed else router.report_success(peer)
        if i >= calls // 2:
            picks[peer] += 1
    return picks


def test_an_absurd_throughput_claim_gets_only_its_measured_share() -> None:
    honest, liar = _peer(0), _peer(1)
    speed = {honest: 10.0, liar: 10.0}  # equally fast; the liar announces 1e12 samples/s
    announced = [_info(0, 10.0), _info(1, 1e12)]
    untimed = StageRouter(stage=0)
    untimed.update_peers(announced)
    assert _simulate(untimed, speed, 400, timed=False)[liar] > 0.99 * 200  # believed blindly: it takes all
    router = StageRouter(stage=0)
    router.update_peers(announced)
    picks = _simulate(router, speed, 400)
    assert 0.4 * 200 <= picks[liar] <= 0.6 * 200, picks  # its measured share: half
    assert router.peers[liar] <= 2 * router.peers[honest]
    router.update_peers(announced)  # a new DHT listing does not reset what was measured
    assert router.peers[liar] <= 2 * router.peers[honest]


def test_measurements_keep_honest_shares() -> None:
    slow, fast = _peer(0), _peer(1)
    router = StageRouter(stage=0)
    router.update_peers([_info(0, 10.0), _info(1, 30.0)])
    picks = _simulate(router, {slow: 10.0, fast: 30.0}, 800)
    assert 0.65 * 400 <= picks[fast] <= 0.8 * 400, picks  # announced 3:1; per-call latency shaves a little
    assert router.measured.keys() == {slow, fast}
    router.observe(slow, 4, float("nan"))  # nonsense timings are ignored
    router.observe(slow, 0, 1.0)
    assert set(router.peers) == {slow, fast}


def test_a_newcomer_probed_at_its_first_estimate_is_not_starved_once_it_announces_its_real_figure() -> None:
    """A server announces a rough estimate until it has measured a backward call (throughput.py); the router charges
    the newcomer's probe at that figure. Once the newcomer announces a figure as high as its peers', the lead its
    probe gave it is re-expressed at the new figure: it gets calls again within a few picks, not after the others
    have caught up with a probe charged at a 100x smaller throughput (what made the chaos test's restarted peer
    wait most of the run)."""
    router = StageRouter(stage=1)
    router.update_peers([_info(0, 16000.0)])
    for _ in range(5):
        router.choose(task_size=8, now=0.0)
        router.observe(_peer(0), samples=8, seconds=0.008)  # the client times 1000 samples/s per call
    router.update_peers([_info(0, 16000.0), _info(1, 100.0)])  # a newcomer, still at its estimate
    assert router.choose(task_size=8, now=0.0) == _peer(1)  # probed at once
    router.update_peers([_info(0, 16000.0), _info(1, 16000.0)])  # it measured its backward and announced
    picks = [router.choose(task_size=8, now=0.0) for _ in range(8)]
    assert _peer(1) in picks[:3], picks
    # and a peer believed faster than it turns out to be falls back at once
    router = StageRouter(stage=1)
    router.update_peers([_info(0, 10.0)])
    assert {router.choose(task_size=10, now=0.0) for _ in range(4)} == {_peer(0)}
    router.update_peers([_info(0, 10.0), _info(1, 10.0)])
    assert router.choose(task_size=10, now=0.0) == _peer(1)  # its probe: a lead of 1 s of work over peer 0
    router.update_peers([_info(0, 10.0), _info(1, 0.1)])  # ...which is 100 s at its new figure
    assert [router.choose(task_size=10, now=0.0) for _ in range(20)].count(_peer(1)) == 0


def test_calls_queued_at_a_peer_are_charged_its_busy_time_once() -> None:
    """A fast peer with calls queued behind each other is measured by its samples per busy second, not per call:
    timed whole, each queued call would include the others' service and make the busiest peer look the slowest.
    Here the fast peer serves 4 samples a second with three calls in flight, the slow one 2 a second with one."""
    fast, slow = _peer(0), _peer(1)
    router = StageRouter(stage=0)
    router.update_peers([_info(0, 4.0), _info(1, 2.0)])
    t = 0.0
    for _ in range(10):
        for _ in range(3):  # three calls sent at once, served one after the other in 1 s each
            router.call_started(fast, now=t)
        router.call_started(slow, now=t)
        for k in (1, 2, 3):
            router.report_success(fast, 4, router.call_ended(fast, now=t + k))
        router.report_success(slow, 4, router.call_ended(slow, now=t + 2))
        t += 3
    assert router.measured[fast] == pytest.approx(4.0) and router.measured[slow] == pytest.approx(2.0)
    assert router.peers[fast] == pytest.approx(2 * router.peers[slow])
    # calls ending together (merged at the peer): the second is charged nothing, the average stays the rate
    router.call_started(fast, now=100.0)
    router.call_started(fast, now=100.0)
    router.report_success(fast, 4, router.call_ended(fast, now=101.0))
    router.report_success(fast, 4, router.call_ended(fast, now=101.0))
    assert 3.0 < router.measured[fast] < 6.0
    assert router.call_ended(fast, now=102.0) == 0.0  # nothing in flight: nothing to charge


def test_a_task_goes_to_an_idle_peer_rather_than_queue_where_it_would_finish_later() -> None:
    """Weighted round robin gives a peer twice as fast two tasks in a row; if the first is still in flight, the
    second goes to the idle peer, which finishes it no later (the chunks of one batch do not queue at one peer
    while another waits). A peer ten times as fast keeps it: its queue still ends first. With nothing in flight
    the shares are weighted round robin's."""
    fast, slow = _peer(0), _peer(1)

    def router_after_7_picks(speed: float) -> StageRouter:
        router = StageRouter(stage=0)
        router.update_peers([_info(0, speed), _info(1, 1.0)])
        for _ in range(7):
            router.choose(task_size=1, now=0.0)
        return router

    # nothing in flight: round robin's next two tasks both go to the fast peer
    alone = router_after_7_picks(2.0)
    assert [alone.choose(task_size=1, now=0.0) for _ in range(2)] == [fast, fast]
    router = router_after_7_picks(2.0)
    assert router.choose(task_size=1, now=0.0) == fast
    router.call_started(fast, now=0.0)
    # 1 s on the idle peer against 0.5 + 0.5 s in the queue
    assert router.choose(task_size=1, now=0.0) == slow
    router.call_started(slow, now=0.0)
    assert router.choose(task_size=1, now=0.0) == fast  # everyone busy: the fair share again

    router = router_after_7_picks(10.0)
    chosen = router.choose(task_size=1, now=0.0)
    router.call_started(chosen, now=0.0)
    assert router.choose(task_size=1, now=0.0) == fast  # 0.1 + 0.1 s in the queue against 1 s on the idle one
