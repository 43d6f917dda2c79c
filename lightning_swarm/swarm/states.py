"""Every state a peer announces, defined once.

- A stage server's state, in its DHT record (:mod:`.records`): trainers route calls to ``ONLINE`` servers only,
  the rebalancer (:mod:`.rebalance`) plans with all three. A string on the wire.
- A peer's phase in the run, in its presence record (:mod:`.presence`): still ``TRAINING``, ``FINISHED`` training
  (it may still serve), or ``DEPARTING`` (leaving the run for good). An int on the wire.
"""

from __future__ import annotations

__all__ = ["DEPARTING", "FINISHED", "JOINING", "LEAVING", "ONLINE", "PHASES", "STATES", "TRAINING"]

JOINING, ONLINE, LEAVING = "joining", "online", "leaving"
STATES = (JOINING, ONLINE, LEAVING)

TRAINING, FINISHED, DEPARTING = 0, 1, 2
PHASES = (TRAINING, FINISHED, DEPARTING)
