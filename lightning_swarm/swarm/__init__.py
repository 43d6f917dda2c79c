"""The SWARM engine, free of Lightning: one layer of the wire per module.

The engine's face: :class:`SwarmPeer` (one peer's life), :class:`SwarmSettings`, :class:`Partition` (stages and
proxies), :class:`SwarmClient` (differentiable stage calls) and :class:`StageServer`, plus the errors a caller
may see. The layers underneath: ``quantize`` (8-bit kernel) -> ``codec`` (tensor <-> parts) -> ``payload``
(structures <-> skeleton + tensors) -> ``protocol`` (requests, replies, validation, errors) -> ``transport``
(one request to one peer) -> ``client`` / ``server``; ``routing``, ``records``, ``presence`` and ``throughput``
beside them.
"""

from lightning_swarm.swarm.client import SwarmClient
from lightning_swarm.swarm.codec import CodecError
from lightning_swarm.swarm.errors import RemoteStageError, RequestRefused
from lightning_swarm.swarm.partition import Partition
from lightning_swarm.swarm.peer import SwarmPeer
from lightning_swarm.swarm.presence import PeerFailure
from lightning_swarm.swarm.routing import NoPeersError
from lightning_swarm.swarm.server import StageServer
from lightning_swarm.swarm.settings import SwarmSettings

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
