"""A ``SwarmClient``'s peer discovery (a part of :class:`~.client.SwarmClient`): DHT lookups of a stage's peers,
started when the listing is stale and applied to the stage's router, and waits for a stage that has no live peer."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils.mpfuture import MPFuture

from lightning_swarm.swarm.client.routing import StageRouter
from lightning_swarm.swarm.dht.records import PeerInfo, parse_stage_peers
from lightning_swarm.swarm.dht.validation import stage_key
from lightning_swarm.swarm.lifetime import PeerStopping
from lightning_swarm.swarm.loop import STOP_POLL_S
from lightning_swarm.swarm.settings import SwarmSettings

logger = logging.getLogger(__name__)


class StageDiscovery:
    """Who serves each stage, as the DHT says: keeps the stages' routers' peer lists fresh.

    Args:
        dht: this peer's running hivemind DHT.
        settings: the swarm's settings (``run_id``, ``refresh_period``, ``request_timeout``).
        routers: the client's router of each stage, updated with what the lookups find.
        router_lock: the client's lock of the routers.
        should_stop: polled while waiting; once it returns True a wait raises :class:`~.errors.PeerStopping`.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        settings: SwarmSettings,
        routers: list[StageRouter],
        router_lock: threading.Lock,
        should_stop: Callable[[], bool],
    ) -> None:
        self.dht, self.settings, self.run_id = dht, settings, settings.run_id
        self.routers, self.router_lock, self.should_stop = routers, router_lock, should_stop
        self._last_refresh = [-float("inf")] * len(routers)
        self._pending: list[MPFuture | None] = [None] * len(routers)

    def lookup(self, stage: int) -> list[PeerInfo]:
        """The live peers of ``stage`` (one fresh DHT lookup, applied to its router)."""
        # bounded: a DHT process that died never answers
        found = self.dht.get(stage_key(self.run_id, stage), latest=True, return_future=True).result(
            timeout=self.settings.request_timeout
        )
        peers = parse_stage_peers(found, stage)
        with self.router_lock:
            self.routers[stage].update_peers(peers)
        self._last_refresh[stage] = time.monotonic()
        return peers

    def live_peers(self, stage: int) -> list[PeerID]:
        """The peers of ``stage`` that are not banned, after applying a finished lookup (and starting one when the
        listing is stale)."""
        self.refresh(stage)
        with self.router_lock:
            router = self.routers[stage]
            return [p for p in router.peers if not router.is_banned(p)]

    def refresh(self, stage: int, block: bool = False, max_wait: float = 0.0) -> None:
        """Start a DHT lookup when the listing is stale and apply finished ones.

        With ``block``, always look up, wait for the answer, and if the stage still has no live peer, sleep out
        the rest of ``max_wait`` seconds (this paces the polling while waiting for peers).
        """
        start = time.monotonic()
        pending = self._pending[stage]
        if pending is None and (block or start - self._last_refresh[stage] >= self.settings.refresh_period):
            pending = self._pending[stage] = self.dht.get(
                stage_key(self.run_id, stage), latest=True, return_future=True
            )
            self._last_refresh[stage] = start
        if pending is not None and block:
            self._wait_polling(start + max(max_wait, 0.01), pending)
        if pending is not None and pending.done():
            self._pending[stage] = None
            try:
                peers = parse_stage_peers(pending.result(), stage)
                with self.router_lock:
                    self.routers[stage].update_peers(peers)
            except Exception as e:
                logger.debug(f"DHT lookup of stage {stage} failed: {e!r}")
        if block and self.routers[stage].num_live() == 0:
            self._wait_polling(start + max_wait)

    def _wait_polling(self, deadline: float, future: Any = None) -> None:
        """Wait until ``deadline`` (or until ``future`` is done), polling ``should_stop`` meanwhile: a peer that is
        stopping raises :class:`~.routing.PeerStopping`, one that learnt of another peer's failure raises it."""
        while future is None or not future.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if future is None:
                time.sleep(min(left, STOP_POLL_S))
            else:
                try:
                    future.result(timeout=min(left, STOP_POLL_S))
                except Exception:
                    pass  # the caller reads the outcome
            if self.should_stop():
                raise PeerStopping("a wait for a stage's peers was abandoned: this peer is stopping")
