"""Where a peer serves: joiners' stage choice, the periodic check and the single migration (a mixin of
:class:`~.peer.SwarmPeer`; the policy is :mod:`.rebalance`)."""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass

from lightning_swarm.swarm.peer.rebalance import Move, next_check, plan_move
from lightning_swarm.swarm.server import StageServer

logger = logging.getLogger(__name__)


@dataclass
class _Since:
    """When this peer's current server was first seen with a measured throughput."""

    server: StageServer
    time: float


class _Rebalancing:
    """How a :class:`~.peer.SwarmPeer` moves between stages (a mixin: its attributes are the peer's)."""

    # ------------------------------------------------------------------ rebalance
    def _rebalance_loop(self) -> None:
        rng = random.Random()
        while not self._stop_rebalancing.wait(next_check(self.settings.rebalance_period, rng)):
            try:
                self.rebalance_once()
            except Exception as e:  # a failed check or move is retried at the next check
                logger.warning(f"Swarm peer {self.peer_index}: rebalancing failed: {e!r}")

    def rebalance_once(self) -> Move | None:
        """Read every stage's records and, if :func:`~.rebalance.plan_move` names this peer, migrate; returns the
        move made. Nothing is planned until this peer has measured its own throughput for a while (the longer of
        three announce periods and half a rebalance period, so that the figures of the others settle too), when a
        stage lists no peer at all (an unreadable DHT is not an empty stage) or when this peer's own record is not
        there yet."""
        assert self.dht is not None
        if self.server is None or not self.server.throughput.measured:
            self._measured_since = None
            return None  # an estimate is no ground for a move; without trainers there is nothing to speed up
        now = time.monotonic()
        if self._measured_since is None or self._measured_since.server is not self.server:
            self._measured_since = _Since(self.server, now)
        # every peer's announced figure should rest on more than its first calls before anyone moves
        settle = max(3 * self.settings.announce_period, self.settings.rebalance_period / 2)
        if now - self._measured_since.time < settle:
            return None
        loads = self.peer_loads()
        me = self.dht.peer_id.to_base58()
        listed = {p.stage for p in loads}
        if len(listed) < self.settings.num_stages or not any(p.peer_id == me for p in loads):
            return None
        move = plan_move(loads, self.settings.num_stages, min_gain=self.settings.rebalance_min_gain)
        if move is None or move.peer_id != me or move.src != self.stage:
            return None
        logger.info(
            f"Swarm peer {me} moves from stage {move.src} to stage {move.dst}: the pipeline's announced throughput "
            f"goes from {move.before:.1f} to {move.after:.1f} samples/s"
        )
        self.migrate(move.dst)
        self.migrations.append(move)
        return move

    def migrate(self, stage: int) -> None:
        """Serve ``stage`` instead of the current one: announce ``"leaving"``, finish the calls in flight, free the
        old stage's blocks, allocate the new ones, load their state from the stage's peers, go online."""
        with self._migration_lock:
            assert self.partition is not None and self.server is not None and self.client is not None
            old = self.server
            if stage == old.stage:
                return
            # this peer's speed on the new stage, until measured there: what it announced (and the policy assumed)
            # scaled by the stages' sizes, as compute per sample grows with the parameters
            size_old = sum(p.numel() for p in old.module.parameters()) or 1
            size_new = (
                sum(b.numel() for blk in self.partition.stage_blocks(stage) for b in blk.parameters()) or 1
            )
            throughput = old.throughput.value * size_old / size_new
            old.drain()
            self.client.set_local_server(old.stage, None)
            old.shutdown()
            self.server = None
            try:
                self.partition.release(keep=[stage])
                new = self._make_server(stage, throughput)
                self._start_server(new)
            except Exception:
                # serve the old stage again (its state comes back from its peers) rather than nothing
                self.partition.release(keep=[old.stage])
                new = self._make_server(old.stage)
                self._start_server(new)
                self.server = new
                self.client.set_local_server(old.stage, new)
                raise
            self.server, self.stage = new, stage
            self.client.set_local_server(stage, new)

    def _stop_rebalancer(self) -> None:
        self._stop_rebalancing.set()
        thread, self._rebalancer = self._rebalancer, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=120)
