"""DHT records: which peers serve which stage, and how fast.

Every stage server stores one record under the three-part key ``"{run_id}.stage{k}.0"``, subkeyed by its
base58 peer id, with value ``[throughput]`` (samples per second). A trainer lists a stage's swarm with a
single ``dht.get(key, latest=True)``. Records expire unless re-announced (see ``StageServer``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

__all__ = ["PeerInfo", "declare_stage_peer", "get_stage_peers", "parse_stage_peers", "stage_key"]

logger = logging.getLogger(__name__)


@dataclass
class PeerInfo:
    """One peer serving a stage, as announced in the DHT.

    Args:
        peer_id: the libp2p id of the peer.
        stage: the stage index it serves.
        throughput: its measured speed in samples per second.
        expiration: DHT time (seconds since epoch) when the announcement expires.
    """

    peer_id: PeerID
    stage: int
    throughput: float
    expiration: float


def stage_key(run_id: str, stage: int) -> str:
    """The DHT key listing the peers of ``stage`` in run ``run_id``."""
    return f"{run_id}.stage{stage}.0"


def declare_stage_peer(
    dht: DHT, run_id: str, stage: int, peer_id: PeerID, throughput: float, expiration_time: float
) -> bool:
    """Announce that ``peer_id`` serves ``stage`` at ``throughput`` samples/s until ``expiration_time``.

    Args:
        dht: a running hivemind DHT.
        run_id: the swarm's run id.
        stage: stage index.
        peer_id: the announcing peer.
        throughput: samples per second (positive).
        expiration_time: absolute DHT time (``hivemind.get_dht_time()`` + lifetime).

    Returns:
        whether the DHT accepted the record.
    """
    return bool(
        dht.store(
            key=stage_key(run_id, stage),
            subkey=peer_id.to_base58(),
            value=[float(throughput)],
            expiration_time=expiration_time,
        )
    )


def parse_stage_peers(found: Any, stage: int, now: float | None = None) -> list[PeerInfo]:
    """Turn the result of ``dht.get(stage_key(...), latest=True)`` into live peers.

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
            if isinstance(value, (list, tuple)) and len(value) >= 1:
                value = value[0]
            throughput = float(value)
            if not math.isfinite(throughput) or throughput <= 0:
                raise ValueError(f"throughput must be positive, got {throughput}")
        except Exception as e:
            logger.debug(f"Ignoring malformed stage {stage} record {subkey!r}: {e}")
            continue
        if expiration < now:
            continue
        peers.append(PeerInfo(peer_id=peer_id, stage=stage, throughput=throughput, expiration=expiration))
    peers.sort(key=lambda info: info.peer_id.to_base58())
    return peers


def get_stage_peers(dht: DHT, run_id: str, stage: int) -> list[PeerInfo]:
    """List the live peers serving ``stage`` (one DHT lookup; never raises on malformed records)."""
    return parse_stage_peers(dht.get(stage_key(run_id, stage), latest=True), stage)
