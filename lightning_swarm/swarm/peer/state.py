"""What the parts of a :class:`~.peer.SwarmPeer` share: the peer's DHT node, its presence, its partition, the stage
it serves and that stage's server, its client and the trainers' step exchange. One explicit object (as Petals'
``SequenceManagerState``), handed to each part, rather than attributes spread over a class hierarchy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import hivemind

    from lightning_swarm.swarm.client.client import SwarmClient
    from lightning_swarm.swarm.dht.presence import Presence
    from lightning_swarm.swarm.peer.partition import Partition
    from lightning_swarm.swarm.server import StageServer
    from lightning_swarm.swarm.training.trainer_sync import TrainerSync


@dataclass
class PeerState:
    """A peer's running pieces, set as it starts, joins, migrates and leaves (``None``: not there, or gone).

    Attributes:
        dht: its DHT node (:meth:`~.peer.SwarmPeer.start_dht` to shutdown).
        presence: its presence record in the run (see :mod:`~lightning_swarm.swarm.dht.presence`).
        partition: the pipeline cut into stages (:meth:`~.peer.SwarmPeer.prepare`).
        stage: the stage it serves (or would serve); changes when it migrates.
        server: its stage server; replaced when it migrates (see :mod:`.hosting`).
        client: its client of the stages (a trainer's calls, the stages' states).
        trainer_sync: the exchange of several trainers' steps (see :mod:`~lightning_swarm.swarm.training.trainer_sync`).
    """

    dht: hivemind.DHT | None = None
    presence: Presence | None = None
    partition: Partition | None = None
    stage: int | None = None
    server: StageServer | None = None
    client: SwarmClient | None = None
    trainer_sync: TrainerSync | None = None
