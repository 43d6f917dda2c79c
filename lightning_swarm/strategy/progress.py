"""What a swarm trainer shows on Lightning's progress bar, whichever bar it is (TQDM, Rich or a user's own).

The strategy logs these with ``prog_bar=True`` from its ``training_step``, so any progress bar shows them with no
callback to add:

- ``swarm/samples_per_s``: the samples this trainer fed per second, from the end of its first training step (the
  first one includes start-up: the first calls to each stage);
- ``swarm/stage{k}/peers``: the live peers of stage ``k`` in the DHT, looked up in the background every
  ``peers_every_s`` seconds (a step never waits for the DHT; shown once the first lookup has answered);
- ``swarm/wire_mb``: the megabytes this trainer's stage calls sent and received;
- ``swarm/stage{k}/rounds``: the stage's averaging rounds with other peers of the stage (0 while the stage has
  one peer): averaging that never happens is visible.
"""

from __future__ import annotations

import time
from typing import Any

from lightning_swarm.swarm.dht.records import parse_stage_peers
from lightning_swarm.swarm.dht.validation import stage_key


class SwarmProgress:
    """The progress-bar figures of one trainer's run (see the module's docstring).

    Args:
        peers_every_s: seconds between two background DHT lookups of the stages' live peers.
    """

    def __init__(self, peers_every_s: float = 5.0) -> None:
        self.peers_every_s = peers_every_s
        self._dht: Any = None
        self._run_id = ""
        self._num_stages = 0
        self._clock: float | None = None
        self._samples = 0
        self._peers: dict[int, int] = {}
        self._lookups: dict[int, Any] = {}
        self._looked_up_at = 0.0

    def start(self, dht: Any, run_id: str, num_stages: int) -> None:
        """A new run of this trainer: counters from zero, and the first lookup of the stages' peers."""
        self._dht, self._run_id, self._num_stages = dht, run_id, num_stages
        self._clock, self._samples, self._peers, self._lookups = None, 0, {}, {}
        self._look_up()

    def step_done(self, batch_size: int | None) -> None:
        """A training step of ``batch_size`` samples has ended (the first one starts the clock)."""
        if self._clock is None:
            self._clock = time.monotonic()
        elif batch_size:
            self._samples += batch_size

    def metrics(self, stats: dict[str, float]) -> dict[str, float]:
        """The figures for the bar, from the peer's counters ``stats`` (``SwarmPeer.stats()``)."""
        figures: dict[str, float] = {}
        if self._clock is not None and self._samples:
            figures["swarm/samples_per_s"] = self._samples / max(time.monotonic() - self._clock, 1e-9)
        self._collect_lookups()
        for k in range(self._num_stages):
            if k in self._peers:
                figures[f"swarm/stage{k}/peers"] = float(self._peers[k])
        figures["swarm/wire_mb"] = (
            stats.get("swarm/bytes_sent", 0.0) + stats.get("swarm/bytes_recv", 0.0)
        ) / 1e6
        for k in range(self._num_stages):
            figures[f"swarm/stage{k}/rounds"] = stats.get(f"swarm/stage{k}/rounds", 0.0)
        return figures

    def _look_up(self) -> None:
        if self._dht is None:
            return
        self._looked_up_at = time.monotonic()
        for k in range(self._num_stages):
            try:
                self._lookups[k] = self._dht.get(stage_key(self._run_id, k), latest=True, return_future=True)
            except Exception:  # the DHT is shutting down: the bar keeps its last figures
                self._lookups.pop(k, None)

    def _collect_lookups(self) -> None:
        for k, future in list(self._lookups.items()):
            if not future.done():
                continue
            del self._lookups[k]
            try:
                self._peers[k] = len(parse_stage_peers(future.result(), k))
            except Exception:  # a lookup that failed leaves the last figure in place
                pass
        if not self._lookups and time.monotonic() - self._looked_up_at >= self.peers_every_s:
            self._look_up()
