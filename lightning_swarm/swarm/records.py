"""DHT records: which peers serve which stage, and how fast.

Every stage server stores one record under the three-part key ``"{run_id}.stage{k}.0"``, subkeyed by its
base58 peer id, with value ``[throughput, state, num_stages]``: samples per second, the peer's state
(``"joining"`` while it loads the stage's current state, ``"online"`` while it serves, ``"leaving"`` once it is
about to stop or move) and the number of stages of the pipeline (so that ``lightning-swarm status`` needs no
``--num-stages``). A bare ``[throughput]`` (older peers) reads as online. A trainer lists a stage's swarm with a
single ``dht.get(key, latest=True)`` and routes only to online peers. Records expire unless re-announced (see
``StageServer``).

Signed records. A peer started by :class:`~.peer.SwarmPeer` has a :class:`PeerIdentity`: one RSA key that is both
its libp2p identity (its peer id is the hash of the public key) and the key that signs its DHT records. Its
subkeys are ``b"<base58 peer id>[swarm-owner:<public key>]"`` and its values carry its RSA signature (over key,
subkey, value and expiration) as their last element. Its DHT node runs :func:`record_validators`, which reject
records under the swarm's keys (stage, presence and failure records of the run)

- whose subkey carries no owner key (unsigned), whose signature does not verify (only the key's owner can write or
  overwrite them), or whose subkey names a peer id that is not the one of its key (a peer announcing another's
  identity): :class:`RecordSigner`, hivemind's ``RSASignatureValidator`` scheme with the signature inside the
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

import functools
import hashlib
import logging
import math
import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import multihash
import pydantic.v1 as pydantic
from cryptography.hazmat.primitives import serialization
from hivemind import DHT
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from .states import ONLINE, STATES

__all__ = [
    "PeerIdentity",
    "PeerInfo",
    "declare_stage_peer",
    "failure_key",
    "get_stage_peers",
    "identity_of",
    "parse_stage_peers",
    "presence_key",
    "record_validators",
    "register_identity",
    "RecordSigner",
    "strip_signature",
    "swarm_keys",
    "stage_key",
    "subkey_of",
    "subkey_peer_id",
]

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


def presence_key(run_id: str) -> str:
    """The DHT key of the peers' presence records (see :mod:`.presence`)."""
    return f"{run_id}.peers.0"


def failure_key(run_id: str) -> str:
    """The DHT key where a peer whose run raised an exception publishes it (see :mod:`.presence`)."""
    return f"{run_id}.failure.0"


# ---------------------------------------------------------------------------------------------- identity
_OWNER = b"[swarm-owner:"


class PeerIdentity:
    """A peer's RSA key: its libp2p identity (peer id = hash of the public key) and the key signing its records.

    Args:
        private_key: the key; a new one by default.
    """

    def __init__(self, private_key: RSAPrivateKey | None = None) -> None:
        self.private_key = private_key if private_key is not None else RSAPrivateKey()
        self.owner: bytes = _OWNER + self.private_key.get_public_key().to_bytes() + b"]"
        self.peer_id = _peer_id_of_owner(self.owner)
        self.subkey: bytes = self.peer_id.to_base58().encode() + self.owner

    @classmethod
    def from_file(cls, path: str) -> PeerIdentity:
        """The identity saved at ``path`` (a libp2p private-key protobuf, as ``hivemind``'s ``identity_path``)."""
        with open(path, "rb") as f:
            data = crypto_pb2.PrivateKey.FromString(f.read())
        if data.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError(
                f"{path} holds a {crypto_pb2.KeyType.Name(data.key_type)} key; an RSA key is needed"
            )
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key._private_key = serialization.load_der_private_key(data.data, password=None)
        return cls(key)

    @classmethod
    def load_or_create(cls, path: str) -> PeerIdentity:
        """The identity saved at ``path``, or a new one saved there (readable by this user only)."""
        if os.path.exists(path):
            return cls.from_file(path)
        identity = cls()
        identity.save(path)
        return identity

    def save(self, path: str) -> None:
        """Write the key as a libp2p identity file (what ``hivemind.DHT(identity_path=...)`` reads)."""
        blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=self.private_key.to_bytes())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(blob.SerializeToString())


@functools.lru_cache(maxsize=4096)
def _peer_id_of_owner(owner: bytes) -> PeerID:
    """The libp2p peer id of the RSA key in an owner marker ``b"[swarm-owner:ssh-rsa ...]"`` (libp2p peer-id
    spec)."""
    public_key = _public_key_of_owner(owner)._public_key
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256")))


@functools.lru_cache(maxsize=4096)
def _public_key_of_owner(owner: bytes) -> RSAPublicKey:
    if not (owner.startswith(_OWNER) and owner.endswith(b"]")):
        raise ValueError("not an owner marker")
    return RSAPublicKey.from_bytes(owner[len(_OWNER) : -1])


def subkey_peer_id(subkey: Any) -> PeerID:
    """The peer a record's subkey names: a signed subkey ``b"<base58 id>[swarm-owner:<key>]"`` names the peer id of its
    key (raises ``ValueError`` if the two differ: a peer announcing another's identity); a plain base58 string
    (a DHT without the swarm's validators) names that id."""
    if isinstance(subkey, str):
        return PeerID.from_base58(subkey)
    if not isinstance(subkey, bytes):
        raise ValueError(f"subkey must be bytes or str, got {type(subkey).__name__}")
    head, sep, rest = subkey.partition(_OWNER)
    if not sep:
        raise ValueError("subkey carries no owner key")
    claimed = PeerID.from_base58(head.decode("ascii"))
    try:
        owner = _peer_id_of_owner(sep + rest)
    except Exception as e:
        raise ValueError(f"subkey's owner key is unreadable: {e}") from None
    if owner != claimed:
        raise ValueError(f"subkey names peer {claimed} but carries the key of {owner}")
    return claimed


_IDENTITIES: weakref.WeakKeyDictionary[DHT, PeerIdentity] = weakref.WeakKeyDictionary()


def register_identity(dht: DHT, identity: PeerIdentity) -> None:
    """Note that ``dht`` runs with ``identity`` (its records are then written with signed subkeys)."""
    if dht.peer_id != identity.peer_id:
        raise ValueError(f"the DHT's peer id {dht.peer_id} is not the identity's {identity.peer_id}")
    _IDENTITIES[dht] = identity


def identity_of(dht: DHT) -> PeerIdentity | None:
    """The identity registered for ``dht`` (``None``: a DHT without signed records)."""
    return _IDENTITIES.get(dht)


def subkey_of(dht: DHT) -> bytes | str:
    """The subkey under which ``dht``'s peer writes its records: signed if it has an identity, else its id."""
    identity = identity_of(dht)
    return identity.subkey if identity is not None else dht.peer_id.to_base58()


# ---------------------------------------------------------------------------------------------- validators
def strip_signature(value: Any) -> Any:
    """A record's value without the signature a :class:`RecordSigner` appended (as a plain DHT returns it)."""
    if isinstance(value, list) and len(value) > 1 and isinstance(value[-1], bytes):
        return value[:-1]
    return value


class RecordSigner(RecordValidatorBase):
    """Signs this peer's records under ``keys`` and checks everyone's there: the subkey must be
    ``b"<base58 peer id>[swarm-owner:<public key>]"`` with the peer id of that key, and the value (a list) must end
    with that key's signature of ``(key, subkey, value, expiration)``. Other keys are left alone.

    Args:
        identity: this peer's identity (``None``: only check).
        keys: the DHT keys (as the application names them) whose records are protected.
    """

    def __init__(self, identity: PeerIdentity | None, keys: Iterable[str]) -> None:
        self._private_key = identity.private_key if identity is not None else None
        self._owner = identity.owner if identity is not None else None
        self._key_ids = frozenset(DHTID.generate(source=key).to_bytes() for key in keys)

    @property
    def priority(self) -> int:
        return 10  # validated (and stripped) before the schema sees the value

    @staticmethod
    def _message(record: DHTRecord, unsigned: bytes) -> bytes:
        return MSGPackSerializer.dumps((record.key, record.subkey, unsigned, record.expiration_time))

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key not in self._key_ids or self._owner is None or self._owner not in record.subkey:
            return record.value
        value = MSGPackSerializer.loads(record.value)
        if not isinstance(value, list):
            return record.value  # not a swarm record: the validators reject it
        unsigned = MSGPackSerializer.dumps(value)
        return MSGPackSerializer.dumps(value + [self._private_key.sign(self._message(record, unsigned))])

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self._key_ids:
            return True
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
            if not isinstance(subkey, bytes):
                return False
            subkey_peer_id(subkey)  # the subkey's peer id is the one of its key
            value = MSGPackSerializer.loads(record.value)
            if not (isinstance(value, list) and len(value) > 1 and isinstance(value[-1], bytes)):
                return False
            public_key = _public_key_of_owner(subkey[subkey.index(_OWNER) :])
            message = self._message(record, MSGPackSerializer.dumps(value[:-1]))
            return public_key.verify(message, value[-1])
        except Exception as e:
            logger.debug(f"Rejected a swarm record: {e!r}")
            return False

    def strip_value(self, record: DHTRecord) -> bytes:
        if record.key not in self._key_ids:
            return record.value
        try:
            return MSGPackSerializer.dumps(strip_signature(MSGPackSerializer.loads(record.value)))
        except Exception:
            return record.value


class _OwnedSubkey(bytes):
    """Schema type of a swarm record's subkey: ``b"<base58 peer id>[swarm-owner:<key>]"`` with a matching peer
    id."""

    @classmethod
    def __get_validators__(cls):
        yield cls._check

    @classmethod
    def _check(cls, value: Any) -> bytes:
        if not isinstance(value, bytes):
            raise ValueError("subkey must be bytes")
        subkey_peer_id(value)
        return value


class _StageValue(list):
    """Schema type of a stage record's value: ``[throughput > 0 (float), state, num_stages >= 1 (int)]``, the last
    two optional."""

    @classmethod
    def __get_validators__(cls):
        yield cls._check

    @classmethod
    def _check(cls, value: Any) -> list:
        if not isinstance(value, list) or not 1 <= len(value) <= 3:
            raise ValueError("expected [throughput, state, num_stages]")
        if type(value[0]) is not float or not (math.isfinite(value[0]) and value[0] > 0):
            raise ValueError("throughput must be a positive finite float")
        if len(value) >= 2 and value[1] not in STATES:
            raise ValueError(f"state must be one of {STATES}")
        if len(value) >= 3 and (type(value[2]) is not int or value[2] < 1):
            raise ValueError("num_stages must be a positive int")
        return value


class _PresenceValue(list):
    """Schema type of a presence record's value: ``[phase (int >= 0), trainer (bool)]``."""

    @classmethod
    def __get_validators__(cls):
        yield cls._check

    @classmethod
    def _check(cls, value: Any) -> list:
        if not isinstance(value, list) or len(value) != 2:
            raise ValueError("expected [phase, trainer]")
        if type(value[0]) is not int or value[0] < 0 or type(value[1]) is not bool:
            raise ValueError("expected [phase (int >= 0), trainer (bool)]")
        return value


class _FailureValue(list):
    """Schema type of a failure record's value: ``[type name, message, origin (the peer, in words), time]``."""

    @classmethod
    def __get_validators__(cls):
        yield cls._check

    @classmethod
    def _check(cls, value: Any) -> list:
        if not isinstance(value, list) or len(value) != 4:
            raise ValueError("expected [type name, message, origin, time]")
        if not all(type(v) is str for v in value[:3]) or type(value[3]) is not float:
            raise ValueError("expected [type name (str), message (str), origin (str), time (float)]")
        if len(value[0]) > 200 or len(value[1]) > 8000 or len(value[2]) > 500:
            raise ValueError("failure record too long")
        return value


def swarm_keys(run_id: str, num_stages: int, extra_stages: int = 16) -> list[str]:
    """The DHT keys whose records are signed: the presence key, the stage keys ``0 .. num_stages +
    extra_stages - 1`` of ``run_id`` (the extra stages cover peers of the run that were told another stage count) and
    the failure key."""
    stages = [stage_key(run_id, k) for k in range(num_stages + extra_stages)]
    return [presence_key(run_id), *stages, failure_key(run_id)]


def record_validators(
    run_id: str, num_stages: int, identity: PeerIdentity | None, extra_stages: int = 16
) -> list[RecordValidatorBase]:
    """The DHT record validators of a swarm peer (pass them to ``hivemind.DHT(record_validators=...)``): signed
    (:class:`RecordSigner`), schema-checked records under :func:`swarm_keys`. Other keys (the averagers', hivemind's
    own) are left to hivemind. ``identity=None``: check only (a node that writes no records, e.g. ``status``)."""
    keys = swarm_keys(run_id, num_stages, extra_stages)
    fields: dict[str, Any] = {key: (dict[_OwnedSubkey, _StageValue] | None, None) for key in keys[1:-1]}
    fields[keys[0]] = (dict[_OwnedSubkey, _PresenceValue] | None, None)
    fields[keys[-1]] = (dict[_OwnedSubkey, _FailureValue] | None, None)
    schema = pydantic.create_model(f"SwarmRecords_{abs(hash(run_id))}", **fields)
    return [SchemaValidator(schema, allow_extra_keys=True), RecordSigner(identity, keys)]


def declare_stage_peer(
    dht: DHT,
    run_id: str,
    stage: int,
    peer_id: PeerID,
    throughput: float,
    expiration_time: float,
    state: str = ONLINE,
    num_stages: int | None = None,
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
        timeout: seconds to wait for the DHT (``TimeoutError`` after that).

    Returns:
        whether the DHT accepted the record.
    """
    if state not in STATES:
        raise ValueError(f"state must be one of {STATES}, got {state!r}")
    value: list[Any] = [float(throughput), state]
    if num_stages is not None:
        value.append(int(num_stages))
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
