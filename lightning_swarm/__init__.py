"""lightning-swarm: train large models on preemptible GPUs over slow links (SWARM) and on small CPU
clusters (D-SLIDE), with one argument to the Lightning ``Trainer``.

Importing the package registers the strategies ``"swarm"`` and ``"dslide"`` and the accelerator ``"swarm"``
with Lightning, so import it before constructing the ``Trainer``.
"""

from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry

from lightning_swarm.strategy import DSlideStrategy, SwarmAccelerator, SwarmStrategy

__version__ = "0.1.0"
__all__ = ["DSlideStrategy", "SwarmAccelerator", "SwarmStrategy"]

if "swarm" not in StrategyRegistry:
    SwarmStrategy.register_strategies(StrategyRegistry)
if "dslide" not in StrategyRegistry:
    DSlideStrategy.register_strategies(StrategyRegistry)
if "swarm" not in AcceleratorRegistry:
    SwarmAccelerator.register_accelerators(AcceleratorRegistry)
