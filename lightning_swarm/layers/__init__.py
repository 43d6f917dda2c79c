"""Layers for sparse, wide networks (SLIDE / D-SLIDE): LSH-sparse output layer, sparse input
layer, lazy Adam and the active-set loss. Free of Lightning."""

from lightning_swarm.layers.hashing import DWTAHash, SimHash
from lightning_swarm.layers.loss import active_set_loss
from lightning_swarm.layers.metrics import PrecisionAtK
from lightning_swarm.layers.optim import LazyAdam
from lightning_swarm.layers.sparse_input import SparseInputLinear
from lightning_swarm.layers.sparse_linear import SparseLSHLinear
from lightning_swarm.layers.tables import LSHTables

__all__ = [
    "DWTAHash",
    "LSHTables",
    "LazyAdam",
    "PrecisionAtK",
    "SimHash",
    "SparseInputLinear",
    "SparseLSHLinear",
    "active_set_loss",
]
