"""Lightning-facing classes: thin adapters over the engines in ``lightning_swarm.swarm`` and ``.layers``."""

from lightning_swarm.strategy.accelerator import SwarmAccelerator
from lightning_swarm.strategy.dslide import DSlideStrategy
from lightning_swarm.strategy.swarm import SwarmStrategy

__all__ = ["DSlideStrategy", "SwarmAccelerator", "SwarmStrategy"]
