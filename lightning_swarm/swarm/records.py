"""DHT records: which peers serve which stage, and how fast.

Every stage server stores one record under the three-part key ``"{run_id}.stage{k}.0"``, subkeyed by its
base58 peer id, with value ``[throughput, state, num_stages]``: samples per second, the peer's state
(``"joining"`` while it loads the stage's current state, ``"online"`` while it serves, ``"leaving"`` once it is
about to stop or move) and the number of stages of the pipeline (so that ``lightning-swarm status`` needs no
``--num-stages``). A bare ``[throughput]`` (older peers) reads as online. A trainer lists a stage's swarm with a
single ``dht.get(key, latest=True)`` and routes only to online peers. Records expire unless re-announced (see
``StageServer``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from .rebalance import JOINING, LEAVING, ONLINE

__all__ = [
    "JOINING",
    "LEAVING",
    "ONLINE",
    "STATES",
    "PeerInfo",
    "declare_stage_peer",
    "get_stage_peers",
    "parse_stage_peers",
    "stage_key",
]

STATES = (JOINING, ONLINE, LEAVING)

logger = logging.getLogger(__name__)


@dataclass
class PeerInfo:
    """One peer serving a stage, as announced in the DHT.

    Args:
        peer_id: the libp2p id of the peer.
        stage: the stage index it serves.
        throughput: its measured speed in samples per second.
        expiration: DHT time (seconds since epoch) when the announcement expires.
        state: ``"joining"``, ``"online"`` or ``"leaving"``.
        num_stages: the pipeline's number of stages as the peer announced it (``None`` if it did not).
    """

    peer_id: PeerID
    stage: int
    throughput: float
    expiration: float
    state: str = ONLINE
    num_stages: int | None = None


def stage_key(run_id: str, stage: int) -> str:
    """The DHT key listing the peers of ``stage`` in run ``run_id``."""
    return f"{run_id}.stage{stage}.0"


def declare_stage_peer(
    dht: DHT,
    run_id: str,
    stage: int,
    peer_id: PeerID,
    throughput: float,
    expiration_time: float,
    state: str = ONLINE,
    num_stages: int | None = None,
) -> bool:
    """Announce that ``peer_id`` serves ``stage`` at ``throughput`` samples/s until ``expiration_time``.

    Args:
        dht: a running hivemind DHT.
        run_id: the swarm's run id.
        stage: stage index.
        peer_id: the announcing peer.
        throughput: samples per second (positive).
        expiration_time: absolute DHT time (``hivemind.get_dht_time()`` + lifetime); it must be later than the
            peer's previous record for this one to replace it.
        state: ``"joining"``, ``"online"`` or ``"leaving"``.
        num_stages: the pipeline's number of stages (lets tools list the swarm without being told).

    Returns:
        whether the DHT accepted the record.
    """
    if state not in STATES:
        raise ValueError(f"state must be one of {STATES}, got {state!r}")
    value: list[Any] = [float(throughput), state]
    if num_stages is not None:
        value.append(int(num_stages))
    return bool(
        dht.store(
            key=stage_key(run_id, stage),
            subkey=peer_id.to_base58(),
            value=value,
            expiration_time=expiration_time,
        )
    )


def parse_stage_peers(
    found: Any, stage: int, now: float | None = None, states: tuple[str, ...] = (ONLINE,)
) -> list[PeerInfo]:
    """Turn the result of ``dht.get(stage_key(...), latest=True)`` into live peers in one of ``states`` (by
    default the online ones: those that take calls).

    Malformed entries (written by buggy or hostile peers) are skipped with a debug log, expired ones silently.
    """
    now = get_dht_time() if now is None else now
    if found is None:
        return []
    records = getattr(found, "value", None)
    if not isinstance(records, dict):
        logger.debug(f"Ignoring malformed stage {stage} record: {found!r}")
        return []
    peers = []
    for subkey, entry in records.items():
        try:
            value, expiration = entry.value, float(entry.expiration_time)
            peer_id = PeerID.from_base58(subkey)
            state, num_stages = ONLINE, None
            if isinstance(value, (list, tuple)):
                if not 1 <= len(value) <= 3:
                    raise ValueError(f"expected [throughput, state, num_stages], got {len(value)} fields")
                if len(value) >= 2:
                    state = value[1]
                if len(value) >= 3:
                    num_stages = value[2]
                value = value[0]
            if isinstance(value, (bool, str, bytes)):
                raise ValueError(f"throughput must be a number, got {value!r}")
            throughput = float(value)
            if not math.isfinite(throughput) or throughput <= 0:
                raise ValueError(f"throughput must be positive, got {throughput}")
            if state not in STATES:
                raise ValueError(f"unknown state {state!r}")
            if num_stages is not None and (
                type(num_stages) is not int or num_stages < 1 or stage >= num_stages
            ):
                raise ValueError(f"bad num_stages {num_stages!r} for stage {stage}")
        except Exception as e:
            logger.debug(f"Ignoring malformed stage {stage} record {subkey!r}: {e}")
            continue
        if expiration < now or state not in states:
            continue
        peers.append(PeerInfo(peer_id, stage, throughput, expiration, state=state, num_stages=num_stages))
    peers.sort(key=lambda info: info.peer_id.to_base58())
    return peers


def get_stage_peers(dht: DHT, run_id: str, stage: int, states: tuple[str, ...] = (ONLINE,)) -> list[PeerInfo]:
    """List the live peers of ``stage`` in one of ``states`` (default: online), with one DHT lookup; never raises
    on malformed records."""
    return parse_stage_peers(dht.get(stage_key(run_id, stage), latest=True), stage, states=states)
