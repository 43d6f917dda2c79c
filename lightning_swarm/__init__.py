"""lightning-swarm: train large models on preemptible GPUs over slow links (SWARM) and on small CPU
clusters (D-SLIDE), with one argument to the Lightning ``Trainer``.

Importing the package registers the strategies ``"swarm"`` and ``"dslide"`` and the accelerator ``"swarm"``
with Lightning, so import it before constructing the ``Trainer``. The SWARM side (hivemind, its p2p daemon,
bitsandbytes) is imported on first use of ``SwarmStrategy``, so that D-SLIDE ranks do not pay for it (about
25 MB of RSS per process).
"""

from typing import TYPE_CHECKING, Any

from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry

from lightning_swarm.strategy import DSlideStrategy, SwarmAccelerator

if TYPE_CHECKING:
    from lightning_swarm.strategy.swarm import SwarmStrategy

__version__ = "0.1.0"
__all__ = ["DSlideStrategy", "SwarmAccelerator", "SwarmStrategy"]


def __getattr__(name: str) -> Any:
    if name == "SwarmStrategy":
        from lightning_swarm.strategy.swarm import SwarmStrategy

        return SwarmStrategy
    raise AttributeError(f"module 'lightning_swarm' has no attribute {name!r}")


def _swarm_strategy(**kwargs: Any) -> "SwarmStrategy":
    """``Trainer(strategy="swarm")``: builds a :class:`SwarmStrategy` (imported here, on first use)."""
    from lightning_swarm.strategy.swarm import SwarmStrategy

    return SwarmStrategy(**kwargs)


if "swarm" not in StrategyRegistry:
    StrategyRegistry.register(
        "swarm", _swarm_strategy, description="SWARM parallelism: stochastic pipelines of hivemind peers."
    )
if "dslide" not in StrategyRegistry:
    DSlideStrategy.register_strategies(StrategyRegistry)
if "swarm" not in AcceleratorRegistry:
    SwarmAccelerator.register_accelerators(AcceleratorRegistry)
