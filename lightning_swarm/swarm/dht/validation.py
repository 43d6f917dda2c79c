"""Which DHT records a swarm peer accepts: the keys of a run (stage, presence and failure records), the schema of
each record's value, and :func:`record_validators`, which a peer's DHT node runs (signatures: :mod:`.identity`)."""

from __future__ import annotations

import math
from typing import Any

import pydantic.v1 as pydantic
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import RecordValidatorBase

from lightning_swarm.swarm.dht.identity import (
    PeerIdentity,
    RecordSigner,
    subkey_peer_id,
)
from lightning_swarm.swarm.states import STATES


def stage_key(run_id: str, stage: int) -> str:
    """The DHT key listing the peers of ``stage`` in run ``run_id``."""
    return f"{run_id}.stage{stage}.0"


def presence_key(run_id: str) -> str:
    """The DHT key of the peers' presence records (see :mod:`.presence`)."""
    return f"{run_id}.peers.0"


def failure_key(run_id: str) -> str:
    """The DHT key where a peer whose run raised an exception publishes it (see :mod:`.presence`)."""
    return f"{run_id}.failure.0"


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
    """Schema type of a stage record's value: ``[throughput > 0 (float), state, num_stages >= 1 (int), measured
    (bool), figure_time (float)]``; the fields after the throughput are optional (the last two together)."""

    @classmethod
    def __get_validators__(cls):
        yield cls._check

    @classmethod
    def _check(cls, value: Any) -> list:
        if not isinstance(value, list) or not 1 <= len(value) <= 5 or len(value) == 4:
            raise ValueError("expected [throughput, state, num_stages, measured, figure_time]")
        if type(value[0]) is not float or not (math.isfinite(value[0]) and value[0] > 0):
            raise ValueError("throughput must be a positive finite float")
        if len(value) >= 2 and value[1] not in STATES:
            raise ValueError(f"state must be one of {STATES}")
        if len(value) >= 3 and (type(value[2]) is not int or value[2] < 1):
            raise ValueError("num_stages must be a positive int")
        if len(value) == 5 and (
            type(value[3]) is not bool or type(value[4]) is not float or not math.isfinite(value[4])
        ):
            raise ValueError("measured must be a bool and figure_time a finite float")
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
