"""DHT records: which peers serve which stage, and how fast.

Every stage server stores one record under the three-part key ``"{run_id}.stage{k}.0"``, subkeyed by its
base58 peer id, with value ``[throughput, state, num_stages, measured, figure_time, relay_addrs]``: samples per
second, the
peer's state (``"joining"`` while it loads the stage's current state, ``"online"`` while it serves, ``"leaving"``
once it is about to stop or move), the number of stages of the pipeline (so that ``lightning-swarm status`` needs
no ``--num-stages``), whether the throughput was measured on calls served (``False``: an estimate) and the DHT time
at which that figure was made, and the circuit addresses through which a peer behind NAT is reached (a list of
``<relay>/p2p/<relay id>/p2p-circuit``; absent or empty: the peer is dialled directly, see :mod:`.reachability`).
The fields after the throughput are optional: a bare ``[throughput]`` reads as online, of unknown origin and age. A trainer lists a stage's swarm with a
single ``dht.get(key, latest=True)`` and routes only to online peers. Records expire unless re-announced (see
``StageServer``).

Signed records. A peer started by :class:`~.peer.SwarmPeer` has a :class:`~.identity.PeerIdentity`: one RSA key that is both
its libp2p identity (its peer id is the hash of the public key) and the key that signs its DHT records. Its
subkeys are ``b"<base58 peer id>[swarm-owner:<public key>]"`` and its values carry its RSA signature (over key,
subkey, value and expiration) as their last element. Its DHT node runs :func:`~.validation.record_validators`, which reject
records under the swarm's keys (stage, presence and failure records of the run)

- whose subkey carries no owner key (unsigned), whose signature does not verify (only the key's owner can write or
  overwrite them), or whose subkey names a peer id that is not the one of its key (a peer announcing another's
  identity): :class:`~.identity.RecordSigner`, hivemind's ``RSASignatureValidator`` scheme with the signature inside the
  value, so that a DHT without the validators (``lightning-swarm status``, a plain ``hivemind.DHT`` given to a
  ``SwarmClient``) still reads the records (hivemind's format appends bytes that such a node cannot decode, and its
  lookup hangs);
- whose value breaks the schema (hivemind's ``SchemaValidator``): ``[throughput > 0, state, num_stages >= 1]`` for
  stage records, ``[phase, trainer]`` for presence records, ``[type, message, origin, time]`` for failure records.

Validators act where records are stored and where they are read, so a forged record is neither kept by an honest
node nor believed when a hostile node returns it. The readers (:func:`parse_stage_peers`, ``Presence``) map a
signed subkey back to its peer id (checking the binding once more) and drop the signature; a plain base58 subkey
(a DHT started without these validators, e.g. ``hivemind.DHT()`` in tests) still reads as that peer.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
from dataclasses import dataclass
from typing import Any

from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from lightning_swarm.swarm.dht.identity import (
    identity_of,
    strip_signature,
    subkey_peer_id,
)
from lightning_swarm.swarm.dht.validation import (
    check_relay_addrs,
    stage_key,
)
from lightning_swarm.swarm.states import ONLINE, STATES

__all__ = ["PeerInfo", "declare_stage_peer", "get_stage_peers", "parse_stage_peers"]

logger = logging.getLogger(__name__)

LOOKUP_TIMEOUT = 30.0  # seconds a lookup of a stage's peers may take


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
        measured: whether ``throughput`` was measured on calls served (``False``: an estimate; ``None``: not said).
        figure_time: DHT time at which ``throughput`` was estimated or last measured (``None``: not said).
        relay_addrs: circuit addresses through which the peer is reached: it is behind NAT, its calls go through
            a relay (empty: dialled directly).
    """

    peer_id: PeerID
    stage: int
    throughput: float
    expiration: float
    state: str = ONLINE
    num_stages: int | None = None
    measured: bool | None = None
    figure_time: float | None = None
    relay_addrs: tuple[str, ...] = ()

    @property
    def relayed(self) -> bool:
        """Whether the peer is reached only through a relay (it says so in its record)."""
        return bool(self.relay_addrs)


def declare_stage_peer(
    dht: DHT,
    run_id: str,
    stage: int,
    peer_id: PeerID,
    throughput: float,
    expiration_time: float,
    state: str = ONLINE,
    num_stages: int | None = None,
    measured: bool | None = None,
    figure_time: float | None = None,
    relay_addrs: tuple[str, ...] = (),
    timeout: float = 30.0,
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
        measured: whether ``throughput`` was measured on calls served (``False``: an estimate); announced with
            ``figure_time``, and only with ``num_stages``.
        figure_time: DHT time at which ``throughput`` was estimated or last measured.
        relay_addrs: circuit addresses of a peer behind NAT (announced only with ``measured`` and ``figure_time``).
        timeout: seconds to wait for the DHT (``TimeoutError`` after that).

    Returns:
        whether the DHT accepted the record.
    """
    if state not in STATES:
        raise ValueError(f"state must be one of {STATES}, got {state!r}")
    value: list[Any] = [float(throughput), state]
    if num_stages is not None:
        value.append(int(num_stages))
        if measured is not None and figure_time is not None:
            value += [bool(measured), float(figure_time)]
            if relay_addrs:
                value.append([str(a) for a in relay_addrs])
    identity = identity_of(dht)
    subkey = identity.subkey if identity is not None and identity.peer_id == peer_id else peer_id.to_base58()
    # a bounded wait: a DHT whose helper process died (e.g. SIGTERM to the process group) never answers, and a
    # peer announcing "leaving" on its way out must not hang there
    return bool(
        dht.store(
            key=stage_key(run_id, stage),
            subkey=subkey,
            value=value,
            expiration_time=expiration_time,
            return_future=True,
        ).result(timeout=timeout)
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
            value, expiration = strip_signature(entry.value), float(entry.expiration_time)
            peer_id = subkey_peer_id(subkey)
            state, num_stages, measured, figure_time = ONLINE, None, None, None
            relay_addrs: tuple[str, ...] = ()
            if isinstance(value, (list, tuple)):
                if not 1 <= len(value) <= 6 or len(value) == 4:
                    raise ValueError(
                        "expected [throughput, state, num_stages, measured, figure_time, relay_addrs], got "
                        f"{len(value)} fields"
                    )
                if len(value) == 6:
                    relay_addrs = tuple(check_relay_addrs(value[5]))
                if len(value) >= 2:
                    state = value[1]
                if len(value) >= 3:
                    num_stages = value[2]
                if len(value) >= 5:
                    measured, figure_time = value[3], value[4]
                    if not isinstance(measured, bool):
                        raise ValueError(f"measured must be a bool, got {measured!r}")
                    if type(figure_time) is not float or not math.isfinite(figure_time):
                        raise ValueError(f"figure_time must be a finite float, got {figure_time!r}")
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
        peers.append(
            PeerInfo(
                peer_id,
                stage,
                throughput,
                expiration,
                state=state,
                num_stages=num_stages,
                measured=measured,
                figure_time=figure_time,
                relay_addrs=relay_addrs,
            )
        )
    peers.sort(key=lambda info: info.peer_id.to_base58())
    return peers


def get_stage_peers(
    dht: DHT, run_id: str, stage: int, states: tuple[str, ...] = (ONLINE,), timeout: float = LOOKUP_TIMEOUT
) -> list[PeerInfo]:
    """List the live peers of ``stage`` in one of ``states`` (default: online), with one DHT lookup; never raises
    on malformed records. Raises ``TimeoutError`` if the DHT does not answer within ``timeout`` seconds (a DHT
    whose helper process died never answers)."""
    future = dht.get(stage_key(run_id, stage), latest=True, return_future=True)
    try:
        found = future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(
            f"the DHT did not answer a lookup of stage {stage}'s peers within {timeout:g} s: its process may have "
            "died, or the swarm's DHT peers are unreachable"
        ) from None
    return parse_stage_peers(found, stage, states=states)
