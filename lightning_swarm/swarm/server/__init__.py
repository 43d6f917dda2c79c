"""A stage server: one peer's share of one pipeline stage (see :mod:`.server`).

- :mod:`.server`: the :class:`StageServer`, which owns the three parts below and runs their life (start, state
  download, announcing, drain, shutdown);
- :mod:`.shared`: the state the parts share (parameters and their lock, pending gradients, kept forwards);
- :mod:`.stage_backend`: the compute: serving (single, grouped, merged), kept activations, at-most-once backwards;
- :mod:`.stepper`: the optimizer off the serving path, trainer-driven steps, optimizer state;
- :mod:`.connection_handler`: the RPCs, per-peer caps and bans.

The overrides of hivemind's private averaging API are in :mod:`..training.averaging`, the optimizers in
:mod:`..training.optimizers`.
"""

from lightning_swarm.swarm.server.applied import AppliedRequests, TooLate
from lightning_swarm.swarm.server.server import StageServer

__all__ = ["AppliedRequests", "StageServer", "TooLate"]
