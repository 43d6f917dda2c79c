"""The SWARM engine, free of Lightning: one layer of the wire per module.

The engine's face: :class:`SwarmPeer` (one peer's life), :class:`SwarmSettings`, :class:`Partition` (stages and
proxies), :class:`SwarmClient` (differentiable stage calls) and :class:`StageServer`, plus the errors a caller
may see. The layers underneath: ``quantize`` (8-bit kernel) -> ``codec`` (tensor <-> parts) -> ``payload``
(structures <-> skeleton + tensors) -> ``protocol`` (requests, replies, validation, errors) -> ``transport``
(one request to one peer) -> ``client`` / ``server``; ``routing``, ``records``, ``presence`` and ``throughput``
beside them.
"""

from lightning_swarm.swarm.client.client import SwarmClient
from lightning_swarm.swarm.client.routing import NoPeersError
from lightning_swarm.swarm.dht.presence import PeerFailure
from lightning_swarm.swarm.peer.partition import Partition
from lightning_swarm.swarm.peer.peer import SwarmPeer
from lightning_swarm.swarm.server import StageServer
from lightning_swarm.swarm.settings import SwarmSettings
from lightning_swarm.swarm.wire.codec import CodecError
from lightning_swarm.swarm.wire.errors import RemoteStageError, RequestRefused

__all__ = [
    "CodecError",
    "NoPeersError",
    "Partition",
    "PeerFailure",
    "RemoteStageError",
    "RequestRefused",
    "StageServer",
    "SwarmClient",
    "SwarmPeer",
    "SwarmSettings",
]
