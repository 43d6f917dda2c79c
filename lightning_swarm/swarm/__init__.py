"""The SWARM engine, free of Lightning: boundary codec, DHT records, stochastic wiring (routing), stage
servers and the trainer-side swarm client."""

from lightning_swarm.swarm._loop import run_coroutine
from lightning_swarm.swarm.client import SwarmClient
from lightning_swarm.swarm.codec import (
    COMPRESSIONS,
    CodecError,
    decode_tensor,
    encode_tensor,
    nbytes,
    pack,
    unpack,
)
from lightning_swarm.swarm.records import PeerInfo, declare_stage_peer, get_stage_peers
from lightning_swarm.swarm.routing import NoPeersError, StageRouter
from lightning_swarm.swarm.server import StageServer

__all__ = [
    "COMPRESSIONS",
    "CodecError",
    "NoPeersError",
    "PeerInfo",
    "StageRouter",
    "StageServer",
    "SwarmClient",
    "declare_stage_peer",
    "decode_tensor",
    "encode_tensor",
    "get_stage_peers",
    "nbytes",
    "pack",
    "run_coroutine",
    "unpack",
]
