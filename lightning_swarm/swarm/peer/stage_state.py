"""The stages' state seen from a peer (a part of :class:`~.peer.SwarmPeer`): gathering every stage's parameters and
optimizer state for checkpoints, loading them back, waiting for the stages to appear. (A stage server that starts
takes its stage's current state from the stage's peers: see :mod:`.hosting`.)"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from lightning_swarm.swarm.client.routing import NoPeersError
from lightning_swarm.swarm.dht.presence import APPEAR_TIMEOUT
from lightning_swarm.swarm.peer.state import PeerState
from lightning_swarm.swarm.settings import SwarmSettings

logger = logging.getLogger(__name__)


class StageStates:
    """Stage states for checkpoints and resuming, through the peer's client.

    Args:
        settings: the swarm's settings.
        state: what the peer's parts share (its client and partition).
        local_swarm_size: the number of peers started together on this machine, or ``None``.
        should_stop: the peer's :meth:`~.peer.SwarmPeer.should_stop`.
    """

    def __init__(
        self,
        settings: SwarmSettings,
        state: PeerState,
        local_swarm_size: int | None,
        should_stop: Callable[[], bool],
    ) -> None:
        self.settings, self.state = settings, state
        self.local_swarm_size, self.should_stop = local_swarm_size, should_stop

    # ------------------------------------------------------------------ state
    def gather_stage_states(
        self, attempts: int = 2, stages: list[int] | None = None
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Every stage's (or the given ``stages``') current ``state_dict``, each from some live peer of it.

        A stage that fails (no live peer within ``no_peers_timeout``, or an incomplete state) is tried again, up
        to ``attempts`` rounds in all.

        Raises:
            RuntimeError: some stages could not be gathered; the message names them and the last errors.
        """
        client, partition = self.state.client, self.state.partition
        assert client is not None and partition is not None
        states: dict[int, dict[str, torch.Tensor]] = {}
        errors: dict[int, BaseException] = {}
        for _ in range(attempts):
            for stage in range(self.settings.num_stages) if stages is None else stages:
                if stage in states:
                    continue
                try:
                    state = client.fetch_stage_state(stage)
                    partition.to_container_state(stage, state)  # complete and nothing unknown
                    states[stage] = state
                    errors.pop(stage, None)
                except Exception as e:
                    errors[stage] = e
            if not errors:
                return states
        details = "; ".join(f"stage {k}: {e!r}" for k, e in sorted(errors.items()))
        raise RuntimeError(
            f"SwarmStrategy: could not gather the parameters of stage(s) {sorted(errors)} of run "
            f"'{self.settings.run_id}' from the swarm ({details}). The module's pipeline would hold stale weights "
            "for them, so this is an error: keep at least one server of every stage running until the trainers "
            "have finished (a peer that serves a stage waits for them for up to `linger_timeout` seconds), and save "
            "checkpoints during training."
        )

    def load_stage_optimizer_states(self, states: dict[int, bytes]) -> None:
        """Restore each stage's optimizer state on all its live peers (resuming from a checkpoint).

        Raises:
            ValueError: the checkpoint's stages do not match this run's (another ``num_stages``), or a stage
                refused its state.
        """
        client = self.state.client
        assert client is not None
        if sorted(states) != list(range(self.settings.num_stages)):
            raise ValueError(
                f"SwarmStrategy: the checkpoint holds the optimizer states of stages {sorted(states)}, but this run "
                f"has num_stages={self.settings.num_stages}: resume with the num_stages of the run that saved it."
            )
        self.wait_for_stages()  # a local swarm's other peers may still be starting
        for stage, data in states.items():
            if not client.commands.load_optimizer_state(stage, data):
                raise RuntimeError(
                    f"SwarmStrategy: no peer of stage {stage} is online to restore its optimizer state from the "
                    "checkpoint; start the stage's servers before resuming."
                )

    def wait_for_stages_at_start(self) -> None:
        """A trainer's wait before its first batch, so that its first step's time is not the swarm's start-up: a
        local swarm's peers start together (see :meth:`wait_for_stages`); a swarm started beside this trainer may
        still be coming up: at most ``no_peers_timeout``, then ``NoPeersError`` names the stages still missing."""
        if self.local_swarm_size is not None:
            self.wait_for_stages()
            return
        s = self.settings
        if self.wait_for_stages(timeout=s.no_peers_timeout) or self.should_stop():
            return
        assert self.state.client is not None
        missing = [k for k in range(s.num_stages) if not self.state.client.peers(k)]
        if missing:
            raise NoPeersError(
                f"SwarmStrategy: no peer of stage(s) {missing} of run {s.run_id!r} appeared within "
                f"no_peers_timeout ({s.no_peers_timeout:.1f} s): start a server for each (role='server', stage=k) "
                "with the same run_id, num_stages and initial_peers as this trainer."
            )

    def wait_for_stages(self, timeout: float = APPEAR_TIMEOUT) -> bool:
        """Wait until every stage has its announced servers, at most ``timeout`` seconds (a local swarm's peers
        start together, and on a busy machine some take a minute to come up): in a local swarm every local peer
        that serves it (so that the trainer's first step already commands all of them, see :mod:`.stepping`),
        elsewhere at least one. Returns whether they did. A stage still missing then is reported by the first
        call to it, after ``no_peers_timeout``."""
        client = self.state.client
        assert client is not None
        s = self.settings
        expected = dict.fromkeys(range(s.num_stages), 1)
        if self.local_swarm_size is not None and s.role != "trainer" and s.stage is None:
            for j in range(self.local_swarm_size):  # local peer j serves stage j % num_stages
                expected[j % s.num_stages] = sum(i % s.num_stages == j % s.num_stages for i in range(j + 1))
        deadline = time.monotonic() + timeout
        missing = list(range(s.num_stages))
        while missing and not self.should_stop():
            try:
                missing = [k for k in missing if len(client.peers(k)) < expected[k]]
            except Exception as e:
                logger.debug(f"DHT lookup of the stages failed: {e!r}")
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        return not missing
