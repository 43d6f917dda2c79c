"""A peer's hivemind helper processes (its DHT's, its averagers'), a part of :class:`~.peer.SwarmPeer`: which of them
died during the run, each reported once (a helper that died skips its shutdown)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lightning_swarm.swarm.dht.presence import dht_alive
from lightning_swarm.swarm.lifetime import settle_dead_helpers
from lightning_swarm.swarm.peer.state import PeerState

logger = logging.getLogger(__name__)


class HelperProcesses:
    """The hivemind helper processes of a peer and the ones already reported dead.

    Args:
        state: what the peer's parts share (its DHT, its stage server, the trainer's optimizer).
        describe: the peer in words, for the warning.
    """

    def __init__(self, state: PeerState, describe: Callable[[], str]) -> None:
        self.state, self.describe = state, describe
        self.reported: set[str] = set()

    def report_dead(self, cut_off: bool = False) -> None:
        """Warn once about hivemind helper processes that died during the run; they skip their shutdown. ``cut_off``:
        the DHT's process is known dead already (the peer said so when it stopped)."""
        dht = self.state.dht
        dead = settle_dead_helpers(self.named(cut_off), daemon_gone=dht is not None and not dht_alive(dht))
        dead = [d for d in dead if d not in self.reported]
        self.reported.update(dead)
        if dead:
            logger.warning(
                f"{self.describe()}: hivemind helper process(es) {', '.join(dead)} died during the run; shutting "
                "down without them."
            )

    def named(self, cut_off: bool = False) -> list[tuple[str, Any]]:
        """The peer's hivemind helper processes by name: its DHT's (unless ``cut_off``) and its stage's averagers."""
        state = self.state
        helpers: list[tuple[str, Any]] = [] if cut_off else [("DHT", state.dht)]
        if state.server is not None:
            for kind in ("state_averager", "grad_averager"):
                averager = getattr(state.server.optimizer, kind, None)
                helpers.append((f"stage {state.server.stage} {kind.replace('_', ' ')}", averager))
        return helpers
