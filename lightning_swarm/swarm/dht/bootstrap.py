"""Starting a peer's DHT: initial peers from the environment, and what a DHT that does not start says
(a refused private swarm, an unreachable bootstrap peer)."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile

from lightning_swarm.swarm.dht.auth import REFUSED_MARKER, protect, unprotect
from lightning_swarm.swarm.dht.identity import PeerIdentity

logger = logging.getLogger(__name__)


INITIAL_PEERS_ENV = "LIGHTNING_SWARM_INITIAL_PEERS"


def dht_start_error(
    error: BaseException,
    host_maddrs: list[str] | tuple[str, ...],
    initial_peers: list[str],
    secret: str | None = None,
    allowed_peers: tuple[str, ...] = (),
) -> str:
    """The one-line explanation (what failed, what to do) of a DHT that did not start with ``error``."""
    text = str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
    head = "SwarmStrategy: the swarm's DHT did not start: "
    if "address already in use" in text:
        return (
            f"{head}a listen address of host_maddrs {list(host_maddrs)} is already in use on this machine: pick a "
            "free port (tcp/0 takes any free port) or stop the process that holds it."
        )
    if "failed to parse multiaddr" in text or "invalid value" in text:
        return (
            f"{head}host_maddrs {list(host_maddrs)} or initial_peers {initial_peers} hold an invalid multiaddr "
            f"({text}): use addresses such as /ip4/0.0.0.0/tcp/31337 and /ip4/1.2.3.4/tcp/31337/p2p/<peer id>."
        )
    if initial_peers and ("bootstrap" in text or "initial_peers" in text):
        refusal = _probe_refusal(initial_peers, secret, allowed_peers)
        if refusal is not None:
            return f"{head}{refusal}"
        return (
            f"{head}no peer of initial_peers {initial_peers} could be reached ({text}): check that they are running "
            "and that the addresses (with their /p2p/<peer id>) are current and reachable from here (peers behind "
            "NAT need an open port or a relay); in a private swarm, this peer needs the swarm's secret."
        )
    if "Daemon failed to start" in text or "p2pd" in text.lower():
        return (
            f"{head}the p2p daemon failed to start ({text}): check host_maddrs {list(host_maddrs)}, that the "
            "hivemind package's p2pd binary runs on this machine, and that there are free file descriptors."
        )
    return f"{head}{text}. Check host_maddrs {list(host_maddrs)} and initial_peers {initial_peers}."


def _probe_refusal(
    initial_peers: list[str], secret: str | None, allowed_peers: tuple[str, ...]
) -> str | None:
    """Whether the initial peers refuse this peer as a private swarm would: asks one of them from a throw-away
    peer with this peer's credentials; returns the refusal it got, or ``None``."""
    from hivemind.p2p import P2P, P2PHandlerError, PeerID
    from hivemind.proto import dht_pb2
    from hivemind.utils.multiaddr import Multiaddr

    from lightning_swarm.swarm.loop import run_coroutine

    async def probe() -> str | None:
        identity = PeerIdentity()
        if secret is not None or allowed_peers:
            protect(identity.peer_id, secret, allowed_peers or None)
        with tempfile.TemporaryDirectory(prefix="swarm-id-") as tmp:
            path = os.path.join(tmp, "identity.key")
            identity.save(path)
            p2p = await P2P.create(
                initial_peers=initial_peers, identity_path=path, check_if_identity_free=False
            )
        try:
            for maddr in initial_peers:
                try:
                    peer = PeerID.from_base58(Multiaddr(maddr)["p2p"])
                    await asyncio.wait_for(
                        p2p._call_unary_protobuf_handler(
                            peer, "DHTProtocol.rpc_ping", dht_pb2.PingRequest(), dht_pb2.PingResponse
                        ),
                        timeout=15,
                    )
                except P2PHandlerError as e:
                    message = str(e)
                    if REFUSED_MARKER in message:  # "...: PrivateSwarmError('peer ... refused the call ...')"
                        message = message[message.find("peer ", message.find("PrivateSwarmError")) :]
                        message = message.rstrip("')\"").replace(identity.peer_id.to_base58(), "this peer")
                        message = message.replace("Start the caller", "Start this peer").replace(
                            "and the caller", "and this peer"
                        )
                        return message
                except Exception:
                    continue
            return None
        finally:
            unprotect(identity.peer_id)
            await p2p.shutdown()

    try:
        return run_coroutine(probe(), timeout=60)
    except Exception as e:
        logger.debug(f"Probing the initial peers failed: {e!r}")
        return None


def env_peers() -> list[str]:
    raw = os.environ.get(INITIAL_PEERS_ENV, "")
    return [p for p in raw.replace(",", " ").split() if p]
