"""Private swarms: only peers that know the swarm's secret (and/or are on an allowlist) may talk to this peer.

libp2p authenticates every connection: the ``remote_id`` of a request is the caller's real peer id. A protected
peer gates *every* handler of its p2p daemon (the DHT's, the averagers', the stage servers', including state
downloads) on that id:

- ``allowed_peers``: the caller's id must be on the list (stable ids need ``identity_path``);
- ``secret``: the first time an unknown peer calls, the callee challenges it: it sends a random nonce to the
  caller's ``lightning_swarm.auth.prove`` handler and admits the caller if the answer is
  ``HMAC-SHA256(secret, nonce | caller id | callee id)``. Both ids are authenticated by libp2p, so an answer can
  be neither replayed nor relayed to another peer. Each process (DHT, averagers, this one) challenges a peer once.

A refused call fails on the caller's side with a message that says why and what to do. The gate is installed by
patching hivemind's ``P2P`` handler registration once per process, before the DHT (and the averagers) fork their
processes, which inherit it; a policy applies only to the p2p daemons of the peer ids it is registered for, so
protected and open peers can live in one process (tests).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Iterable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto.p2pd_pb2 import RPCError

__all__ = [
    "AUTH_PROTOCOL",
    "SECRET_ENV",
    "AccessPolicy",
    "PrivateSwarmError",
    "is_protected",
    "protect",
    "unprotect",
]

logger = logging.getLogger(__name__)

AUTH_PROTOCOL = "lightning_swarm.auth.prove"
SECRET_ENV = "LIGHTNING_SWARM_SECRET"
REFUSED_MARKER = "private swarm"
_CHALLENGE_TIMEOUT = 10.0
_REFUSAL_MEMORY = 10.0  # seconds a refused peer is refused without a new challenge
_TAG = b"lightning-swarm-auth-v1"
_CLOSE_WAIT = 5.0  # seconds a refused stream waits for the caller to close it


class PrivateSwarmError(RuntimeError):
    """This peer was refused by a peer of a private swarm."""


@dataclass(frozen=True)
class AccessPolicy:
    """Who may talk to a protected peer.

    Args:
        secret: the swarm's shared secret (``None``: no challenge).
        allowed: peer ids allowed to talk to it (``None``: any that passes the challenge).
    """

    secret: bytes | None = None
    allowed: frozenset[PeerID] | None = None


_POLICIES: dict[PeerID, AccessPolicy] = {}  # local peer id -> policy (inherited by forked processes)
_ADMITTED: set[tuple[PeerID, PeerID]] = (
    set()
)  # (local, remote) pairs that passed the challenge in this process
_REFUSED: dict[
    tuple[PeerID, PeerID], float
] = {}  # (local, remote) -> monotonic time until which it is refused
_PENDING: dict[tuple[PeerID, PeerID, int], asyncio.Future] = {}
_PATCH_LOCK = threading.Lock()
_patched = False


def protect(
    peer_id: PeerID, secret: str | bytes | None = None, allowed_peers: Iterable[Any] | None = None
) -> None:
    """Gate the p2p daemon of ``peer_id`` (call before its DHT starts): only peers that prove ``secret`` and/or
    are in ``allowed_peers`` (base58 strings or ``PeerID``) may call its handlers."""
    if secret is None and allowed_peers is None:
        raise ValueError("protect() needs a secret or allowed_peers")
    if isinstance(secret, str):
        secret = secret.encode()
    allowed = None
    if allowed_peers is not None:
        allowed = frozenset(p if isinstance(p, PeerID) else PeerID.from_base58(str(p)) for p in allowed_peers)
    _install()
    _POLICIES[peer_id] = AccessPolicy(secret=secret, allowed=allowed)


def unprotect(peer_id: PeerID) -> None:
    """Forget the policy of ``peer_id`` in this process (its daemon is gone)."""
    _POLICIES.pop(peer_id, None)
    for key in [k for k in list(_ADMITTED) if k[0] == peer_id]:
        _ADMITTED.discard(key)


def is_protected(peer_id: PeerID) -> bool:
    """Whether ``peer_id``'s daemon is gated in this process (a private swarm's peer)."""
    return peer_id in _POLICIES


def proof(secret: bytes, nonce: bytes, prover: PeerID, verifier: PeerID) -> bytes:
    """What ``prover`` answers to ``verifier``'s challenge ``nonce``."""
    message = _TAG + nonce + prover.to_bytes() + verifier.to_bytes()
    return hmac.new(secret, message, hashlib.sha256).digest()


def refusal_message(local: PeerID, remote: PeerID, why: str) -> str:
    return (
        f"peer {local} refused the call from {remote}: this is a {REFUSED_MARKER} and the caller {why}. Start "
        f"the caller with the swarm's secret (SwarmStrategy(secret=...) or the {SECRET_ENV} environment "
        "variable) or have its id added to the swarm's allowed_peers."
    )


async def _check(p2p: P2P, remote: PeerID) -> str | None:
    """``None`` if ``remote`` may call ``p2p``'s handlers, else the refusal message."""
    local = p2p.peer_id
    policy = _POLICIES.get(local)
    if policy is None or remote == local:
        return None
    if policy.allowed is not None and remote not in policy.allowed:
        return refusal_message(local, remote, "is not on its allowed_peers list")
    if policy.secret is None or (local, remote) in _ADMITTED:
        return None
    if _REFUSED.get((local, remote), 0.0) > time.monotonic():
        return refusal_message(local, remote, "did not prove that it knows the swarm secret")
    key = (local, remote, id(asyncio.get_running_loop()))
    pending = _PENDING.get(key)
    if pending is None:
        pending = _PENDING[key] = asyncio.ensure_future(_challenge(p2p, remote, policy.secret))
        pending.add_done_callback(lambda _: _PENDING.pop(key, None))
    if await asyncio.shield(pending):
        _ADMITTED.add((local, remote))
        _REFUSED.pop((local, remote), None)
        return None
    now = time.monotonic()
    if len(_REFUSED) > 10_000:  # many made-up peer ids: forget the expired refusals
        for stale in [k for k, until in list(_REFUSED.items()) if until <= now]:
            del _REFUSED[stale]
    _REFUSED[(local, remote)] = now + _REFUSAL_MEMORY
    return refusal_message(local, remote, "did not prove that it knows the swarm secret")


async def _challenge(p2p: P2P, remote: PeerID, secret: bytes) -> bool:
    nonce = os.urandom(32)
    try:
        answer = await asyncio.wait_for(
            p2p._call_unary_protobuf_handler(remote, AUTH_PROTOCOL, BytesValue(value=nonce), BytesValue),
            timeout=_CHALLENGE_TIMEOUT,
        )
    except Exception as e:
        logger.debug(f"Peer {remote} did not answer the private swarm's challenge: {e!r}")
        return False
    ok = hmac.compare_digest(answer.value, proof(secret, nonce, remote, p2p.peer_id))
    if not ok:
        logger.warning(f"Peer {remote} answered the private swarm's challenge with a wrong secret; refused")
    return ok


async def _discard(reader: asyncio.StreamReader) -> None:
    while await reader.read(1 << 16):
        pass


async def _prove(request: BytesValue, context: P2PContext) -> BytesValue:
    policy = _POLICIES.get(context.local_id)
    if policy is None or policy.secret is None:
        raise PermissionError("this peer has no swarm secret")
    if not 16 <= len(request.value) <= 64:
        raise ValueError("a challenge nonce has 16 to 64 bytes")
    return BytesValue(value=proof(policy.secret, request.value, context.local_id, context.remote_id))


def _install() -> None:
    """Patch hivemind's ``P2P`` (once per process) so that handlers of protected daemons are gated."""
    global _patched
    with _PATCH_LOCK:
        if _patched:
            return
        original_stream = P2P.add_binary_stream_handler
        original_unary = P2P._add_protobuf_unary_handler
        original_create = P2P.create.__func__

        async def add_binary_stream_handler(
            self: P2P, name: str, handler: Any, balanced: bool = False
        ) -> None:
            async def gated(stream_info: Any, reader: Any, writer: Any) -> None:
                refusal = await _check(self, stream_info.peer_id)
                if refusal is None:
                    return await handler(stream_info, reader, writer)
                with suppress(Exception):
                    await P2P.send_protobuf(RPCError(message=refusal), writer)
                    # let the caller read the refusal and close first: closing a stream with unread input resets
                    # it, and the caller would see an empty reply instead of the message
                    await asyncio.wait_for(_discard(reader), timeout=_CLOSE_WAIT)
                writer.close()

            return await original_stream(self, name, gated, balanced=balanced)

        async def _add_protobuf_unary_handler(
            self: P2P, handle_name: str, handler: Any, input_protobuf_type: Any, balanced: bool = False
        ) -> None:
            async def gated(request: Any, context: P2PContext) -> Any:
                refusal = await _check(self, context.remote_id)
                if refusal is not None:
                    raise PrivateSwarmError(refusal)
                return await handler(request, context)

            chosen = handler if handle_name == AUTH_PROTOCOL else gated
            return await original_unary(self, handle_name, chosen, input_protobuf_type, balanced=balanced)

        async def create(cls: type[P2P], *args: Any, **kwargs: Any) -> P2P:
            p2p = await original_create(cls, *args, **kwargs)
            policy = _POLICIES.get(p2p.peer_id)
            if policy is not None and policy.secret is not None:
                await p2p._add_protobuf_unary_handler(AUTH_PROTOCOL, _prove, BytesValue)
            return p2p

        P2P.add_binary_stream_handler = add_binary_stream_handler
        P2P._add_protobuf_unary_handler = _add_protobuf_unary_handler
        P2P.create = classmethod(create)
        _patched = True
