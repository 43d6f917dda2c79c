"""The rebalancing policy is a pure function of the announced records: tested without a network."""

import random

from lightning_swarm.swarm.peer.rebalance import (
    PeerLoad,
    choose_stage,
    next_check,
    pipeline_throughput,
    plan_move,
    stage_totals,
)
from lightning_swarm.swarm.states import JOINING, LEAVING


def _swarm(*stages_and_speeds):
    return [PeerLoad(f"p{i}", stage, speed) for i, (stage, speed) in enumerate(stages_and_speeds)]


def _apply(peers, move):
    return [
        PeerLoad(p.peer_id, move.dst if p.peer_id == move.peer_id else p.stage, p.throughput) for p in peers
    ]


def test_three_and_one_become_two_and_two_and_stay():
    peers = _swarm((0, 10.0), (0, 10.0), (0, 10.0), (1, 10.0))
    move = plan_move(peers, 2)
    assert move is not None and (move.src, move.dst) == (0, 1)
    assert (move.before, move.after) == (10.0, 20.0)
    peers = _apply(peers, move)
    assert stage_totals(peers, 2) == [20.0, 20.0]
    for _ in range(5):
        assert plan_move(peers, 2) is None  # settled: no oscillation


def test_every_peer_plans_the_same_single_move():
    peers = _swarm((0, 10.0), (0, 10.0), (0, 10.0), (0, 10.0), (1, 10.0), (2, 10.0))
    moves = {plan_move(random.sample(peers, len(peers)), 3) for _ in range(10)}
    assert len(moves) == 1  # record order does not matter: one peer is named, the others stay


def test_never_empties_a_stage():
    # stage 1 is fast but alone; moving its only peer would empty it
    peers = _swarm((0, 1.0), (1, 100.0))
    assert plan_move(peers, 2) is None


def test_small_gains_are_not_worth_a_migration():
    peers = _swarm((0, 10.0), (0, 1.0), (1, 10.5))
    # moving the 1.0 peer: totals [10, 11.5] -> min 10 vs 10.5 before: worse; nothing else helps
    assert plan_move(peers, 2) is None
    peers = _swarm((0, 10.0), (0, 2.0), (1, 10.0))
    assert plan_move(peers, 2, min_gain=0.1) is None  # [10, 12] -> 10 vs 10: no gain
    peers = _swarm((0, 10.0), (0, 10.0), (0, 3.0), (1, 10.0))
    move = plan_move(peers, 2)
    assert move is not None and move.after == 13.0  # the 3.0 peer: [20, 13] beats moving a 10.0 ([13, 20])
    assert move.peer_id == "p2"


def test_unequal_speeds_reach_the_best_split():
    peers = _swarm((0, 8.0), (0, 4.0), (0, 2.0), (0, 2.0), (1, 1.0))
    for _ in range(10):
        move = plan_move(peers, 2)
        if move is None:
            break
        peers = _apply(peers, move)
    totals = stage_totals(peers, 2)
    # the best split of {8, 4, 2, 2, 1} into two non-empty stages has bottleneck 8
    assert pipeline_throughput(totals) == 8.0


def test_no_plans_while_peers_join_or_leave():
    peers = _swarm((0, 10.0), (0, 10.0), (0, 10.0), (1, 10.0))
    assert plan_move(peers + [PeerLoad("new", 1, 5.0, JOINING)], 2) is None
    assert plan_move(peers + [PeerLoad("old", 1, 5.0, LEAVING)], 2) is None


def test_joining_peer_takes_the_bottleneck():
    peers = _swarm((0, 10.0), (0, 10.0), (1, 5.0), (2, 7.0))
    assert choose_stage(peers, 3) == 1
    assert choose_stage([], 3) == 0
    assert choose_stage(_swarm((0, 0.0), (0, 0.0)), 2) == 1  # ties on throughput: fewest peers
    assert choose_stage(peers + [PeerLoad("x", 1, 50.0, LEAVING)], 3) == 1  # leaving peers do not count


def test_checks_are_spread_in_time():
    rng = random.Random(0)
    waits = [next_check(10.0, rng) for _ in range(200)]
    assert 5.0 <= min(waits) and max(waits) <= 15.0 and max(waits) - min(waits) > 5.0


def test_the_benchmarks_swarm_moves_a_slow_peer_not_the_fast_one():
    # benchmarks/swarm_rebalance.py: speeds 2, 1, 1 on stage 0 and 2 alone on stage 1
    peers = _swarm((0, 2.0), (0, 1.0), (0, 1.0), (1, 2.0))
    move = plan_move(peers, 2, min_gain=0.2)
    assert move is not None and move.peer_id in ("p1", "p2") and (move.before, move.after) == (2.0, 3.0)
    peers = _apply(peers, move)
    assert plan_move(peers, 2, min_gain=0.2) is None  # {2, 1} | {1, 2}: optimal, and it stays
    # noisy measurements of the same swarm do not make it move back
    noisy = [PeerLoad(p.peer_id, p.stage, p.throughput * (1.1 if p.stage else 0.9)) for p in peers]
    assert plan_move(noisy, 2, min_gain=0.2) is None
