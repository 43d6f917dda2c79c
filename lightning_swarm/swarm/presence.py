"""Peer presence and the end-of-run handshake of a swarm.

Every peer keeps a small DHT record ``{run_id}.peers.0`` (subkey: its peer id) with its *phase*: 0 while it
trains, 1 once it has finished training (it still serves its stage), 2 once it has gathered what it needs and may
leave. A peer leaves only when every live peer has reached the phase it waits for, so a trainer that finishes early
keeps serving the others, and checkpoints gathered at the end see the final weights. Records expire, so a peer that
dies simply drops out of the count.
"""

from __future__ import annotations

import logging
import threading
import time

import hivemind
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

TRAINING, FINISHED, LEAVING = 0, 1, 2


def _key(run_id: str) -> str:
    return f"{run_id}.peers.0"


class Presence:
    """Announces this peer's phase and waits for the others'.

    Args:
        dht: the running DHT of this peer.
        run_id: the swarm's run id.
        peer_name: this peer's subkey (its peer id as text).
        period: seconds between announcements; a record lives ``3 * period`` seconds.
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, peer_name: str, period: float = 2.0) -> None:
        self.dht, self.run_id, self.peer_name, self.period = dht, run_id, peer_name, period
        self.phase = TRAINING
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swarm-presence", daemon=True)

    def start(self) -> None:
        self._announce()
        self._thread.start()

    def set_phase(self, phase: int) -> None:
        self.phase = max(self.phase, phase)
        self._announce()

    def phases(self) -> dict[str, int]:
        """Phase of every live peer, by subkey (malformed records are ignored)."""
        found = self.dht.get(_key(self.run_id), latest=True)
        out: dict[str, int] = {}
        if found is None or not isinstance(found.value, dict):
            return out
        for subkey, entry in found.value.items():
            value = getattr(entry, "value", None)
            if isinstance(subkey, str) and isinstance(value, int) and not isinstance(value, bool):
                out[subkey] = value
        return out

    def wait_for(self, phase: int, expected_peers: int | None, timeout: float) -> bool:
        """Block until every live peer (and at least ``expected_peers`` of them, when given) has reached
        ``phase``; return False if ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        while True:
            phases = self.phases()
            phases[self.peer_name] = self.phase
            enough = expected_peers is None or len(phases) >= expected_peers
            if enough and all(p >= phase for p in phases.values()):
                return True
            if time.monotonic() > deadline:
                behind = sorted(name for name, p in phases.items() if p < phase)
                logger.warning(
                    f"Gave up waiting for the swarm to reach phase {phase} after {timeout:.0f} s "
                    f"({len(phases)} peers seen, behind: {behind})"
                )
                return False
            time.sleep(min(0.5, self.period))

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.period + 1)

    def _announce(self) -> None:
        try:
            self.dht.store(
                _key(self.run_id), self.phase, get_dht_time() + 3 * self.period, subkey=self.peer_name
            )
        except Exception as e:  # the DHT may be shutting down; presence is best effort
            logger.debug(f"Presence announcement failed: {e!r}")

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._announce()
