"""Helpers shared by tests and the processes they start (importable from both: ``from tests._helpers import ...``)."""

from __future__ import annotations

import socket

import hivemind


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_dhts(count: int) -> list[hivemind.DHT]:
    """``count`` hivemind DHT nodes on 127.0.0.1, the later ones bootstrapped from the first."""
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    nodes = [first]
    try:
        for _ in range(count - 1):
            nodes.append(
                hivemind.DHT(
                    start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs()
                )
            )
    except BaseException:
        for node in nodes:
            node.shutdown()
        raise
    return nodes
