"""Where a peer should serve: the stage a joining peer takes and the migrations of adaptive rebalancing.

SWARM's pipeline runs at the speed of its slowest stage, and a stage's speed is the sum of its peers'
throughputs. Peers come and go, so the swarm drifts out of balance; SWARM's answer is that peers of over-served
stages move, one at a time and at randomised moments, to the bottleneck. This module is the policy only: pure
functions of the announced peer records (stage, throughput, state), so it is unit-tested without a network
and every peer that reads the same records reaches the same decision.

Rules:
- a joining peer takes the stage with the least total throughput (ties: fewest peers, then lowest index);
- a move is considered only from a stage that keeps at least one online peer (a stage is never emptied);
- of all single moves to the bottleneck stage, the one that raises the pipeline's throughput (the minimum over
  stages) the most is chosen, and only if it raises it by more than ``min_gain`` (relative): the reverse of a
  chosen move never passes that test, so the swarm does not oscillate;
- every peer computes the same best move; only the peer it names moves (see :func:`plan_move`), so several
  peers never rush to the same stage at once, and nobody plans while a peer is still joining or leaving.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_swarm.swarm.states import LEAVING, ONLINE

__all__ = [
    "PeerLoad",
    "Move",
    "stage_totals",
    "pipeline_throughput",
    "choose_stage",
    "plan_move",
    "next_check",
]


@dataclass(frozen=True)
class PeerLoad:
    """What a peer announces about itself: ``throughput`` in samples per second of forward+backward."""

    peer_id: str
    stage: int
    throughput: float
    state: str = ONLINE


@dataclass(frozen=True)
class Move:
    """A planned migration: ``peer_id`` leaves ``src`` for ``dst``; the pipeline goes from ``before`` to
    ``after`` samples per second (its bottleneck stage's total throughput)."""

    peer_id: str
    src: int
    dst: int
    before: float
    after: float


def stage_totals(peers: Iterable[PeerLoad], num_stages: int) -> list[float]:
    """Total throughput each stage serves, counting online and joining peers (leaving ones are gone already)."""
    totals = [0.0] * num_stages
    for p in peers:
        if p.state != LEAVING and 0 <= p.stage < num_stages:
            totals[p.stage] += max(0.0, p.throughput)
    return totals


def pipeline_throughput(totals: Sequence[float]) -> float:
    """Samples per second of the whole pipeline: its slowest stage's."""
    return min(totals) if totals else 0.0


def choose_stage(peers: Iterable[PeerLoad], num_stages: int) -> int:
    """The stage a joining peer should serve: least total throughput, then fewest peers, then lowest index."""
    peers = list(peers)
    totals = stage_totals(peers, num_stages)
    counts = [0] * num_stages
    for p in peers:
        if p.state != LEAVING and 0 <= p.stage < num_stages:
            counts[p.stage] += 1
    return min(range(num_stages), key=lambda k: (totals[k], counts[k], k))


def plan_move(peers: Iterable[PeerLoad], num_stages: int, min_gain: float = 0.1) -> Move | None:
    """The single best migration for the swarm described by ``peers``, or ``None`` if no move raises the
    pipeline's throughput by more than ``min_gain`` (0.1: 10 %), or while any peer is joining or leaving."""
    peers = [p for p in peers if 0 <= p.stage < num_stages]
    if any(p.state != ONLINE for p in peers):
        return None  # the records are about to change: decide on settled ones
    totals = stage_totals(peers, num_stages)
    before = pipeline_throughput(totals)
    online = [0] * num_stages
    for p in peers:
        online[p.stage] += 1
    best: tuple[tuple[float, ...], Move] | None = None
    for p in peers:
        if online[p.stage] < 2:
            continue  # never empty a stage
        for dst in range(num_stages):
            if dst == p.stage:
                continue
            after_totals = list(totals)
            after_totals[p.stage] -= p.throughput
            after_totals[dst] += p.throughput
            after = pipeline_throughput(after_totals)
            if after <= before * (1.0 + min_gain) or after <= 0:
                continue
            # best: highest pipeline throughput, then the most even stages, then a deterministic tie-break
            key = (after, -max(after_totals), -p.throughput)
            move = Move(p.peer_id, p.stage, dst, before, after)
            if best is None or key > best[0] or (key == best[0] and move.peer_id < best[1].peer_id):
                best = (key, move)
    return best[1] if best is not None else None


def next_check(period: float, rng: random.Random | None = None) -> float:
    """Seconds until a peer next looks for a move: uniform in [period/2, 3*period/2], so that peers started
    together do not all decide at the same instant."""
    draw = rng.random() if rng is not None else random.random()
    return period * (0.5 + draw)
