"""How other peers reach this one: directly, or through a circuit relay when it is behind NAT.

Most volunteers' machines sit behind NAT: nothing outside can open a connection to them, but they can open
connections out. hivemind's p2p daemon (go-libp2p) speaks circuit relay v2: a peer behind NAT reserves a slot at a
public peer (every peer serves as a relay by default), and the others reach it through
``<relay>/p2p/<relay id>/p2p-circuit``. A peer's ``reachability`` (:class:`~lightning_swarm.swarm.SwarmSettings`):

- ``"direct"``: others dial this peer's own addresses (a public host, or a port forwarded to it); it relays for
  the peers behind NAT;
- ``"relay"``: this peer reserves a slot at each of its initial peers (the swarm's public peers) at start-up and
  announces the circuit addresses through them in its stage record (:mod:`.records`);
- ``"auto"`` (default): a swarm peer that has initial peers off this host asks one of them to dial it back from a
  fresh daemon (:func:`ask_dial_back`, served by every peer: :func:`serve_dial_back`); if that fails the peer is
  behind NAT and starts again as ``"relay"``. On loopback, or with no initial peers, it is ``"direct"``.

What hivemind 1.1.12 needs for this, done here:

- the daemon's relay client (``-autoRelay``) with its relays as a static list (``-trustedRelays`` with
  ``-relayDiscovery=0``, a flag hivemind does not pass: see :data:`_STATIC_RELAYS`). With discovery on, go-libp2p
  waits its boot delay (3 min) before it reserves a slot when it knows fewer than 4 relay candidates;
- reachability forced private (``-forceReachabilityPrivate``): AutoNAT never decides for addresses in private
  ranges (10/8, 192.168/16), and without a decision the relay client reserves nothing;
- a directly reachable peer forced public (``-forceReachabilityPublic``): its daemon's relay manager then starts
  the relay service with the daemon's limits (30 min and 4 GiB per relayed connection) at once. The bundled daemon
  also starts a relay with go-libp2p's default limits (2 min and 128 KiB per direction) right after its host, and
  whichever registers last serves: a race, which the configured relay lost in about half of our runs on the test
  bed. A relay that lost it would cut each relayed connection after 128 KiB. So a peer reached directly at an
  address off this host (one that others may be relayed through) checks its own relay at start-up
  (:func:`relay_cuts`: two fresh daemons, one reserving a slot, the other echoing 256 KiB through it) and starts
  its daemon again until the relay carries it (at most ``_RELAY_TRIES`` times). ``lightning-swarm doctor`` says
  which relays are limited.
- the circuit address sent to the daemon with its ``/p2p/`` parts as bare multihashes (:func:`wire_maddr`):
  hivemind's multiaddr encoder writes them as CIDv1, which the daemon refuses ("length greater than remaining
  number of bytes in buffer").

Hole punching (DCUtR): the daemon enables it together with AutoNAT (hivemind's default ``auto_nat=True``), but
go-libp2p starts a hole punch only once the NAT'd host knows its own public address from at least 4 peers'
observations, and only towards addresses it counts as public; on the test bed, relayed connections were never
upgraded. The relay carries such a peer's traffic; routing weighs it by the throughput measured through it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.utils.multiaddr import Multiaddr

from lightning_swarm.swarm.settings import REACHABILITIES

__all__ = [
    "DIAL_BACK",
    "ECHO",
    "REACHABILITIES",
    "ask_dial_back",
    "circuit_addrs",
    "daemon_options",
    "dial_relayed",
    "dialable",
    "is_local",
    "measure_link",
    "relay_addrs_of",
    "relay_cuts",
    "scope",
    "start_reachable",
    "serve_dial_back",
    "wire_maddr",
]

logger = logging.getLogger(__name__)

DIAL_BACK = "SwarmReach.dial_back"
ECHO = "SwarmReach.echo"
_DIAL_TIMEOUT = 5.0
_RELAY_TRIES = (
    8  # daemon starts a directly reached peer makes at most to get a relay without the default limits
)
_RELAY_PROBE_BYTES = (
    256 << 10
)  # echoed through a peer's own relay: more than go-libp2p's default limit (128 KiB)
_MAX_ADDRS = 8
_SHARED_RANGE = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT's inside (RFC 6598)
_P2P_CODE, _CIRCUIT_CODE = 0x01A5, 0x0122

# hivemind passes force_reachability through this table as daemon flags: two more rows give the flags it has no
# argument for (static relays: no discovery, no boot delay)
_STATIC_RELAYS = "lightning-swarm-relay"
P2P.FORCE_REACHABILITY_MAPPING.setdefault(
    _STATIC_RELAYS, {"forceReachabilityPrivate": 1, "relayDiscovery": 0}
)


def is_local(maddr: str) -> bool:
    """Whether ``maddr`` is an address on this host only (loopback)."""
    return "/ip4/127." in maddr or "/ip6/::1/" in maddr


def scope(maddr: str) -> str:
    """Where ``maddr``'s first hop is: ``"loopback"``, ``"private"`` (private, link-local or shared ranges: a LAN,
    a NAT's inside), ``"public"``, or ``"unknown"`` (a DNS name, or no IP address)."""
    parts = maddr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return "unknown"
    try:
        ip = ipaddress.ip_address(parts[2])
    except ValueError:
        return "unknown"
    if ip.is_loopback:
        return "loopback"
    if ip.is_private or ip.is_link_local or (ip.version == 4 and ip in _SHARED_RANGE):
        return "private"
    return "public"


def dialable(addrs: Sequence[str], caller_addrs: Sequence[str]) -> list[str]:
    """The addresses of ``addrs`` that the dial-back service may dial for a caller connected from ``caller_addrs``:
    those in a scope (:func:`scope`) the caller connects from, at most ``_MAX_ADDRS``. A remote caller cannot make
    a peer dial into the peer's own host or LAN, only where the caller itself comes from; a circuit address is
    judged by its relay's address, the one dialled."""
    scopes = {scope(a) for a in caller_addrs} - {"unknown"}
    return [a for a in addrs[:_MAX_ADDRS] if scope(a) in scopes]


def daemon_options(reachability: str, relays: Sequence[str]) -> dict[str, Any]:
    """Keyword arguments for ``hivemind.DHT`` (passed on to ``P2P.create``) for a peer that is ``"direct"`` or
    ``"relay"`` (through ``relays``, full multiaddrs with ``/p2p/<id>``)."""
    if reachability == "direct":
        return {"force_reachability": "public"}
    if reachability == "relay":
        if not relays:
            raise ValueError(
                "reachability='relay' needs relays: give initial_peers (the swarm's public peers serve as relays)."
            )
        return {"use_auto_relay": True, "trusted_relays": list(relays), "force_reachability": _STATIC_RELAYS}
    raise ValueError(f"reachability must be 'direct' or 'relay' here, got {reachability!r}")


def circuit_addrs(relays: Iterable[str]) -> tuple[str, ...]:
    """The addresses through which a peer with a slot at each of ``relays`` is dialled (``<relay>/p2p-circuit``)."""
    return tuple(f"{r.rstrip('/')}/p2p-circuit" for r in relays if "/p2p/" in r and "p2p-circuit" not in r)


def wire_maddr(maddr: str) -> Multiaddr:
    """``maddr`` as a ``Multiaddr`` whose bytes the daemon reads: ``/p2p/`` values as bare multihashes."""
    out = b""
    parts = maddr.strip("/").split("/")
    i = 0
    while i < len(parts):
        name = parts[i]
        if name == "p2p-circuit":
            out += _uvarint(_CIRCUIT_CODE)
            i += 1
            continue
        if i + 1 >= len(parts):
            raise ValueError(f"{maddr!r}: /{name} has no value")
        if name in ("p2p", "ipfs"):
            digest = PeerID.from_base58(parts[i + 1]).to_bytes()
            out += _uvarint(_P2P_CODE) + _uvarint(len(digest)) + digest
        else:
            out += Multiaddr(f"/{name}/{parts[i + 1]}").to_bytes()
        i += 2
    return _WireMultiaddr(maddr, out)


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


class _WireMultiaddr(Multiaddr):
    """A multiaddr given by its text and its bytes (see :func:`wire_maddr`)."""

    def __init__(self, text: str, data: bytes) -> None:  # noqa: D107 (no parsing: hivemind's would re-encode)
        self._text, self._bytes = text, data

    def to_bytes(self) -> bytes:
        return self._bytes

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        return f"<Multiaddr {self._text}>"


async def dial_relayed(
    p2p: P2P, peers: Iterable[tuple[PeerID, Sequence[str]]], timeout: float = 10.0
) -> None:
    """Make ``p2p``'s daemon connect to each relayed peer through its circuit addresses (a no-op for a peer it is
    already connected to), so that later calls by peer id find a connection. Failures are logged, not raised: the
    caller's retries and bans handle a peer that cannot be reached."""

    async def one(peer_id: PeerID, addrs: Sequence[str]) -> None:
        try:
            maddrs = [wire_maddr(a) for a in addrs]
            await asyncio.wait_for(p2p._client.connect(peer_id, maddrs), timeout)
        except Exception as e:
            logger.debug(f"Could not connect to {peer_id} through its relays {list(addrs)}: {e!r}")

    await asyncio.gather(*(one(peer_id, addrs) for peer_id, addrs in peers if addrs))


# ------------------------------------------------------------------------------------------ dial-back service
_dial_slots: asyncio.Semaphore | None = None
_ECHO_BUDGET = 64 << 20  # bytes all echoes send back per minute at most
_echo_sent: deque[tuple[float, int]] = deque()  # (when, bytes) of the last minute's echoes
_ECHO_MAX = 4 << 20  # bytes an echo sends back at most


async def _caller_addrs(p2p: P2P, peer_id: PeerID) -> list[str]:
    """The addresses ``p2p``'s daemon is connected to ``peer_id`` at (where the caller comes from)."""
    for info in await p2p.list_peers():
        if info.peer_id == peer_id:
            return [str(a) for a in info.addrs]
    return []


async def _dial_back(p2p: P2P, request: BytesValue, context: P2PContext) -> BytesValue:
    """Dial the caller at the addresses it lists from a fresh daemon that has no connection to it, and say whether
    that worked, how long the connection took and how it is connected: ``"direct"``, ``"relay"`` (circuit addresses
    are dialled through their relay) or ``"hole-punched"`` (a relayed connection that the daemons upgraded to a
    direct one within a second and a half). Only addresses in a scope the caller connects from are dialled
    (:func:`dialable`): a caller on this host gets loopback, one on this LAN private addresses, one from the internet
    public ones."""
    global _dial_slots
    if _dial_slots is None:
        _dial_slots = asyncio.Semaphore(2)  # a probe costs a daemon start: a few at a time
    try:
        addrs = json.loads(request.value.decode())["addrs"]
        if not isinstance(addrs, list) or not all(isinstance(a, str) and len(a) < 256 for a in addrs):
            raise ValueError("addrs must be a list of multiaddr strings")
        chosen = dialable(addrs, await _caller_addrs(p2p, context.remote_id))
        circuit = bool(chosen) and all("p2p-circuit" in a for a in chosen)
        maddrs = [wire_maddr(a) for a in chosen if ("p2p-circuit" in a) == circuit]
    except Exception as e:
        return BytesValue(value=json.dumps({"reachable": False, "error": f"bad request: {e}"}).encode())
    if not maddrs:
        error = "no address it listed is where it connects from (its host, its LAN or the internet)"
        return BytesValue(value=json.dumps({"reachable": False, "error": error}).encode())
    async with _dial_slots:
        probe = await P2P.create(use_relay=circuit, auto_nat=circuit, nat_port_map=False)
        try:
            start = time.perf_counter()
            await asyncio.wait_for(probe._client.connect(context.remote_id, maddrs), _DIAL_TIMEOUT)
            answer: dict[str, Any] = {"reachable": True, "connect_ms": 1000 * (time.perf_counter() - start)}
            answer["via"] = "relay" if circuit else "direct"
            if circuit:
                await asyncio.sleep(1.5)  # DCUtR, if it happens, upgrades the connection meanwhile
                for info in await probe.list_peers():
                    if info.peer_id == context.remote_id and any(
                        "p2p-circuit" not in str(a) for a in info.addrs
                    ):
                        answer["via"] = "hole-punched"
        except Exception as e:
            answer = {"reachable": False, "error": (str(e).strip().splitlines() or [repr(e)])[-1][:300]}
        finally:
            await probe.shutdown()
    return BytesValue(value=json.dumps(answer).encode())


async def _echo(request: BytesValue, context: P2PContext) -> BytesValue:
    """The first 8 bytes of the request (big-endian) say how many bytes to send back: at most 4 MiB a reply and
    ``_ECHO_BUDGET`` bytes a minute in all, so that callers cannot take more of this peer's upload than a few
    measurements need (past the budget the call fails, and ``doctor`` says it could not measure)."""
    size = min(int.from_bytes(request.value[:8], "big"), _ECHO_MAX) if len(request.value) >= 8 else 0
    now = time.monotonic()
    while _echo_sent and _echo_sent[0][0] < now - 60.0:
        _echo_sent.popleft()
    if sum(n for _, n in _echo_sent) + size > _ECHO_BUDGET:
        raise RuntimeError("echo budget spent: try again in a minute")
    _echo_sent.append((now, size))
    return BytesValue(value=bytes(size))


async def _register(_dht: Any, node: Any) -> None:
    p2p = node.p2p

    async def dial_back(request: BytesValue, context: P2PContext) -> BytesValue:
        return await _dial_back(p2p, request, context)

    await p2p._add_protobuf_unary_handler(DIAL_BACK, dial_back, BytesValue)
    await p2p._add_protobuf_unary_handler(ECHO, _echo, BytesValue)


def serve_dial_back(dht: Any) -> None:
    """Serve :data:`DIAL_BACK` and :data:`ECHO` on ``dht``'s daemon (a ``hivemind.DHT``; the handlers run in its
    process)."""
    dht.run_coroutine(_register)


async def ask_dial_back(
    p2p: P2P, peer_id: PeerID, addrs: Sequence[str], timeout: float = 3 * _DIAL_TIMEOUT
) -> dict[str, Any]:
    """Ask ``peer_id`` to dial this peer back at ``addrs``: ``{"reachable": bool, "via"|"connect_ms"|"error": ...}``.
    Raises if ``peer_id`` does not answer (not a swarm peer, or gone)."""
    request = BytesValue(value=json.dumps({"addrs": list(addrs)}).encode())
    reply = await asyncio.wait_for(
        p2p._call_unary_protobuf_handler(peer_id, DIAL_BACK, request, BytesValue), timeout
    )
    return json.loads(reply.value.decode())


async def measure_link(
    p2p: P2P, peer_id: PeerID, nbytes: int = 1 << 20, pings: int = 5, timeout: float = 30.0
) -> dict[str, float]:
    """Round-trip time (the least of ``pings`` tiny echoes, ms) and throughput up and down (Mbit/s of an echo
    carrying ``nbytes`` one way) between ``p2p`` and ``peer_id`` (which serves :data:`ECHO`)."""

    async def echo(send: int, back: int) -> float:
        request = BytesValue(value=back.to_bytes(8, "big") + bytes(send))
        start = time.perf_counter()
        await asyncio.wait_for(p2p._call_unary_protobuf_handler(peer_id, ECHO, request, BytesValue), timeout)
        return time.perf_counter() - start

    rtt = min([await echo(0, 0) for _ in range(pings)])
    up, down = await echo(nbytes, 0), await echo(0, nbytes)
    return {
        "rtt_ms": 1000 * rtt,
        "up_mbit": nbytes * 8 / max(up - rtt, 1e-6) / 1e6,
        "down_mbit": nbytes * 8 / max(down - rtt, 1e-6) / 1e6,
    }


async def _relay_cuts(relays: Sequence[str], timeout: float) -> bool | None:
    """Whether the relay at ``relays`` (one peer's addresses, with ``/p2p/<id>``) cuts a relayed connection before
    ``_RELAY_PROBE_BYTES`` went through: a fresh daemon reserves a slot there and serves :data:`ECHO`, a second one
    dials it through the relay and asks for the bytes. Neither listens, so that they cannot connect directly (on
    one host they would, and the echo would bypass the relay). A failed dial (no slot yet, or a slot that a relay
    which replaced another since no longer knows, see the module docstring) is tried again by two fresh daemons
    (a daemon does not dial a peer again for seconds after a failure). ``None``: nothing could be relayed in
    ``timeout`` seconds."""
    circuits = [wire_maddr(a) for a in circuit_addrs(relays)]
    request = BytesValue(value=_RELAY_PROBE_BYTES.to_bytes(8, "big"))
    deadline = time.monotonic() + timeout
    wait = 0.5
    while time.monotonic() < deadline:
        inner = await P2P.create(no_listen=True, **daemon_options("relay", relays))
        outer = None
        try:
            await inner._add_protobuf_unary_handler(ECHO, _echo, BytesValue)
            await asyncio.sleep(wait)  # its slot is reserved meanwhile
            outer = await P2P.create(use_relay=True, auto_nat=False, nat_port_map=False, no_listen=True)
            try:
                await asyncio.wait_for(outer._client.connect(inner.peer_id, circuits), _DIAL_TIMEOUT)
            except Exception as e:
                logger.debug(f"No connection through this peer's own relay: {e!r}")
                wait = min(2 * wait, 4.0)
                continue
            try:
                reply = await asyncio.wait_for(
                    outer._call_unary_protobuf_handler(inner.peer_id, ECHO, request, BytesValue),
                    4 * _DIAL_TIMEOUT,
                )
            except Exception as e:
                logger.debug(f"This peer's own relay cut a connection: {e!r}")
                return True
            return len(reply.value) != _RELAY_PROBE_BYTES
        finally:
            for daemon in (outer, inner):
                if daemon is not None:
                    await daemon.shutdown()
    return None


def relay_cuts(dht: Any, timeout: float = 20.0) -> bool | None:
    """Whether ``dht``'s daemon relays with go-libp2p's default limits (see the module docstring): ``True`` if it
    cut a relayed connection at :data:`_RELAY_PROBE_BYTES`, ``False`` if it carried them, ``None`` if nothing
    could be relayed through it (the check is then inconclusive)."""
    from lightning_swarm.swarm.loop import run_coroutine

    own = [str(a) for a in dht.get_visible_maddrs(latest=True) if "p2p-circuit" not in str(a)]
    own = sorted(own, key=lambda a: not is_local(a))  # the same host: loopback first
    peer_id = dht.peer_id.to_base58()
    relays = [a if "/p2p/" in a else f"{a}/p2p/{peer_id}" for a in own[:1]]
    if not relays:
        return None
    return run_coroutine(_relay_cuts(relays, timeout), timeout=timeout + 10 * _DIAL_TIMEOUT)


def _serves_others(dht: Any) -> bool:
    """Whether peers off this host may dial ``dht``'s peer (an address that is not loopback): they may then be
    relayed through it."""
    return any(not is_local(str(a)) for a in dht.get_visible_maddrs(latest=True))


# ------------------------------------------------------------------------------------------ start-up
_RELAY_ADDRS: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()


def relay_addrs_of(dht: Any) -> tuple[str, ...]:
    """The circuit addresses ``dht``'s peer is reached through (empty: it is reached directly)."""
    return _RELAY_ADDRS.get(dht, ())


def check_direct(dht: Any, relays: Sequence[str]) -> dict[str, Any] | None:
    """Ask the peers ``relays`` in turn to dial ``dht``'s peer back at its own addresses; the first answer, or
    ``None`` if none of them answers."""
    from lightning_swarm.swarm.loop import replicate_p2p, run_coroutine

    addrs = [str(a) for a in dht.get_visible_maddrs(latest=True)]

    async def ask() -> dict[str, Any] | None:
        p2p = await replicate_p2p(dht)
        try:
            for relay in relays:
                try:
                    return await ask_dial_back(p2p, PeerID.from_base58(Multiaddr(relay)["p2p"]), addrs)
                except Exception as e:
                    logger.debug(f"{relay} did not answer a dial-back request: {e!r}")
            return None
        finally:
            await p2p.shutdown()

    return run_coroutine(ask(), timeout=len(relays) * 4 * _DIAL_TIMEOUT + 10)


def start_reachable(
    create: Callable[[dict[str, Any]], Any], reachability: str, initial_peers: Sequence[str]
) -> tuple[Any, str]:
    """Start a DHT with ``create(daemon_kwargs)`` so that the swarm can reach it, per ``reachability`` (see the
    module docstring); the DHT serves :data:`DIAL_BACK` and remembers its circuit addresses
    (:func:`relay_addrs_of`). Returns the DHT and how it is reached: ``"direct"`` or ``"relay"``."""
    relays = [p for p in initial_peers if not is_local(p) and "/p2p/" in p]
    mode = "direct" if reachability == "auto" else reachability
    if mode == "relay" and not relays:
        raise ValueError(
            "SwarmStrategy(reachability='relay') needs initial_peers off this host (with their /p2p/<peer id>): "
            "the swarm's public peers serve as relays."
        )
    dht = create(daemon_options(mode, relays))
    if reachability == "auto" and relays:
        answer = check_direct(dht, relays)
        if answer is None:
            logger.warning(
                f"No initial peer answered a dial-back request ({relays}): assuming this peer is reachable at its "
                "own addresses. Behind NAT, pass reachability='relay'."
            )
        elif not answer.get("reachable"):
            logger.info(
                f"This peer cannot be dialled at its own addresses ({answer.get('error')}): it is reached through "
                f"a relay at {relays}"
            )
            dht.shutdown()
            mode = "relay"
            dht = create(daemon_options(mode, relays))
    if mode == "direct" and _serves_others(dht):
        dht = _with_unlimited_relay(dht, create, daemon_options(mode, relays))
    serve_dial_back(dht)
    _RELAY_ADDRS[dht] = circuit_addrs(relays) if mode == "relay" else ()
    return dht, mode


def _with_unlimited_relay(dht: Any, create: Callable[[dict[str, Any]], Any], options: dict[str, Any]) -> Any:
    """``dht``, or a DHT started again with ``create(options)``, whose daemon's relay does not cut relayed
    connections at go-libp2p's default limits (see the module docstring); at most ``_RELAY_TRIES`` starts."""
    for attempt in range(1, _RELAY_TRIES + 1):
        try:
            cuts = relay_cuts(dht)
        except Exception as e:
            logger.debug(f"Could not check this peer's relay: {e!r}")
            return dht
        if not cuts:
            return dht  # it carries relayed connections (or the check could not tell: nothing to gain)
        if attempt == _RELAY_TRIES:
            break
        logger.info(
            "This peer's p2p daemon relays with go-libp2p's default limits (128 KiB per connection, a race in the "
            "bundled daemon): starting it again"
        )
        dht.shutdown()
        dht = create(options)
    logger.warning(
        f"This peer's p2p daemon relays with go-libp2p's default limits after {_RELAY_TRIES} starts: peers behind "
        "NAT that are relayed through it lose each connection after 128 KiB (their calls are retried). Restart "
        "this peer, or have them use another public peer as relay."
    )
    return dht
