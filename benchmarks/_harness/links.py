"""Shaped links and loopback behind one interface.

``link(num_ranks, rate_mbit)`` is a context manager whose value has ``address(rank)`` and
``popen(rank, cmd, env, **kwargs)``: with a rate, a ``testbed.netns.VirtualCluster`` (one network namespace per
rank, veth pairs through a bridge, ``tc``-shaped; root), without one, :class:`Loopback` (every rank on 127.0.0.1 in
this namespace, unshaped). Start processes on either with ``Launcher.start(..., net=..., rank=...)`` or pass
``**dies_with_me()`` to ``popen``.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

from testbed.netns import VirtualCluster, leftover_namespaces

__all__ = ["Loopback", "VirtualCluster", "leftover_namespaces", "link"]


class Loopback:
    """The ``VirtualCluster`` interface on 127.0.0.1 in this namespace (no shaping, no per-rank byte counter)."""

    rate_mbit = None

    def __init__(self, num_ranks: int = 1) -> None:
        self.num_ranks = num_ranks

    def __enter__(self) -> Loopback:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def address(self, rank: int) -> str:
        return "127.0.0.1"

    def popen(
        self, rank: int, cmd: list[str], env: dict[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen:
        return subprocess.Popen(cmd, env={**os.environ, **(env or {})}, **kwargs)


def link(
    num_ranks: int, rate_mbit: float | None, delay_ms: float = 0.0, net: int = 0
) -> VirtualCluster | Loopback:
    """``num_ranks`` ranks on a link of ``rate_mbit`` Mbit/s (namespaces, root), or on loopback (``None``)."""
    if rate_mbit is None:
        return Loopback(num_ranks)
    return VirtualCluster(num_ranks, rate_mbit=rate_mbit, delay_ms=delay_ms, net=net)
