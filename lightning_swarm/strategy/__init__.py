"""Lightning-facing classes: thin adapters over the engines in ``lightning_swarm.swarm`` and ``.layers``.

``SwarmStrategy`` is imported on first use (it pulls in hivemind; D-SLIDE does not need it)."""

from typing import TYPE_CHECKING, Any

from lightning_swarm.strategy.accelerator import SwarmAccelerator
from lightning_swarm.strategy.dslide import DSlideStrategy

if TYPE_CHECKING:
    from lightning_swarm.strategy.swarm import SwarmStrategy

__all__ = ["DSlideStrategy", "SwarmAccelerator", "SwarmStrategy"]


def __getattr__(name: str) -> Any:
    if name == "SwarmStrategy":
        from lightning_swarm.strategy.swarm import SwarmStrategy

        return SwarmStrategy
    raise AttributeError(f"module 'lightning_swarm.strategy' has no attribute {name!r}")
