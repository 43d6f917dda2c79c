"""SwarmPeer's hivemind helper processes (its DHT's, its averagers') and what the end of a run does with the
stages: which helpers died during the run (reported once), and whether a trainer gathers the stages into its
module (a mixin of :class:`~.peer.SwarmPeer`)."""

from __future__ import annotations

import logging
from typing import Any

from lightning_swarm.swarm.dht.presence import _dht_alive
from lightning_swarm.swarm.lifetime import settle_dead_helpers

logger = logging.getLogger(__name__)


class _Helpers:
    @property
    def gathers_on_end(self) -> bool:
        """Whether this trainer gathers every stage into its module when the run ends (``gather_on_end``; by
        default unless the pipeline was built on meta: a model built so is taken to be larger than one peer)."""
        wanted = self.settings.gather_on_end
        return not getattr(self, "built_on_meta", False) if wanted is None else wanted

    def _report_dead_helpers(self) -> None:
        """Warn once about hivemind helper processes that died during the run; they skip their shutdown."""
        dead = settle_dead_helpers(
            self._helpers(), daemon_gone=self.dht is not None and not _dht_alive(self.dht)
        )
        reported = self.__dict__.setdefault("_reported_dead", set())
        dead = [d for d in dead if d not in reported]
        reported.update(dead)
        if dead:
            logger.warning(
                f"{self.describe()}: hivemind helper process(es) {', '.join(dead)} died during the run; shutting "
                "down without them."
            )

    def _helpers(self) -> list[tuple[str, Any]]:
        """This peer's hivemind helper processes by name: its DHT's (unless already reported) and its averagers."""
        helpers: list[tuple[str, Any]] = [] if self._cut_off else [("DHT", self.dht)]
        optimizers = [("trainer", self._trainer_optimizer)]
        if self.server is not None:
            optimizers.append((f"stage {self.server.stage}", self.server.optimizer))
        for owner, opt in optimizers:
            for kind in ("state_averager", "grad_averager"):
                helpers.append((f"{owner} {kind.replace('_', ' ')}", getattr(opt, kind, None)))
        return helpers
