"""lightning-swarm: train large models on preemptible GPUs over slow links (SWARM) and on small CPU
clusters (D-SLIDE), with one argument to the Lightning ``Trainer``.

Importing the package registers the strategy ``"swarm"`` and the accelerator ``"swarm"`` with Lightning, so
import it before constructing the ``Trainer``.
"""

from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry

from lightning_swarm.strategy import SwarmAccelerator, SwarmStrategy

__version__ = "0.1.0"
__all__ = ["SwarmAccelerator", "SwarmStrategy"]

if "swarm" not in StrategyRegistry:
    SwarmStrategy.register_strategies(StrategyRegistry)
if "swarm" not in AcceleratorRegistry:
    SwarmAccelerator.register_accelerators(AcceleratorRegistry)
