"""A peer's identity: one RSA key that is both its libp2p identity (its peer id is the hash of the public key)
and the key that signs its DHT records; signed subkeys, and :class:`RecordSigner`, the validator that checks those
signatures (see :mod:`.records` for the scheme)."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import weakref
from collections.abc import Iterable
from typing import Any

import multihash
from cryptography.hazmat.primitives import serialization
from hivemind import DHT
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- identity
_OWNER = b"[swarm-owner:"


# set by a local swarm's launcher: the file of this peer's identity, the local ranks' identities given in the order
# of their peer ids (see SwarmLauncher._rank_identities)
RANK_IDENTITY_ENV = "LIGHTNING_SWARM_RANK_IDENTITY"


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
        assert self._private_key is not None  # an owner has its key
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
