"""A stage server: one peer's share of one pipeline stage (see :mod:`.server`).

- :mod:`.server`: composition and lifecycle (start, state download, announcing, drain, shutdown);
- :mod:`.connection_handler`: the RPCs, per-peer caps and bans;
- :mod:`.stage_backend`: serving (single, grouped, merged), kept activations, at-most-once backwards;
- :mod:`.stepper`: the optimizer off the serving path, trainer-driven steps, optimizer state;

The overrides of hivemind's private averaging API are in :mod:`..averaging`, the optimizers in :mod:`..optim`.
"""

from lightning_swarm.swarm.server.applied import AppliedRequests, TooLate
from lightning_swarm.swarm.server.server import StageServer

__all__ = ["AppliedRequests", "StageServer", "TooLate"]
