"""A ``SwarmClient``'s peer discovery: DHT lookups of a stage's peers, started when the listing is stale and
applied to the stage's router, and waits for a stage that has no live peer (see :mod:`.client`)."""

from __future__ import annotations

import logging
import time
from typing import Any

from lightning_swarm.swarm.dht.records import parse_stage_peers
from lightning_swarm.swarm.dht.validation import stage_key
from lightning_swarm.swarm.lifetime import PeerStopping
from lightning_swarm.swarm.loop import STOP_POLL_S

logger = logging.getLogger(__name__)


class _StageDiscovery:
    """A ``SwarmClient``'s peer discovery (a mixin: its attributes are the client's)."""

    def _maybe_refresh(self, stage: int, block: bool = False, max_wait: float = 0.0) -> None:
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
                with self._router_lock:
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
