"""Where a peer serves and how its stage server lives (a part of :class:`~.peer.SwarmPeer`): the server of its
stage made and started with the stage's current state from the stage's peers, the periodic rebalancing check and
the single migration (the policy is :mod:`.rebalance`)."""

from __future__ import annotations

import logging
import random
import threading
import time
import zlib
from dataclasses import dataclass

import hivemind
import torch

from lightning_swarm.swarm.client.client import SwarmClient
from lightning_swarm.swarm.dht.records import get_stage_peers
from lightning_swarm.swarm.peer.rebalance import Move, PeerLoad, next_check, plan_move
from lightning_swarm.swarm.peer.state import PeerState
from lightning_swarm.swarm.server import StageServer
from lightning_swarm.swarm.settings import SwarmSettings
from lightning_swarm.swarm.states import ONLINE, STATES
from lightning_swarm.swarm.training.optimizer_template import OptimizerTemplate

logger = logging.getLogger(__name__)

LOAD_ATTEMPTS = 3  # state downloads a joiner tries while the stage has other peers


@dataclass
class Since:
    """When this peer's current server was first seen with a measured throughput."""

    server: StageServer
    time: float


def stage_seed(run_id: str, stage: int) -> int:
    """The seed with which every peer initialises a stage it allocates itself (the same on every peer)."""
    return zlib.crc32(f"{run_id}.stage{stage}".encode())


def peer_loads(dht: hivemind.DHT, settings: SwarmSettings) -> list[PeerLoad]:
    """Every stage's announced peers (joining, online and leaving), for the rebalancing policy."""
    loads = []
    for stage in range(settings.num_stages):
        for p in get_stage_peers(dht, settings.run_id, stage, states=STATES):
            loads.append(PeerLoad(p.peer_id.to_base58(), stage, p.throughput, p.state))
    return loads


class StageHost:
    """The stage server of a :class:`~.peer.SwarmPeer` (``state.server``, serving ``state.stage``): made, started,
    moved to another stage.

    Args:
        settings: the swarm's settings.
        state: what the peer's parts share; this part sets its ``server`` and ``stage``.
        device: where the peer computes.
        peer_index: the peer's index in a local swarm (for its messages).
    """

    def __init__(
        self, settings: SwarmSettings, state: PeerState, device: torch.device, peer_index: int
    ) -> None:
        self.settings, self.state, self.device, self.peer_index = settings, state, device, peer_index
        # the trainer's optimizers as the recipe of the stages' (taken when the peer joins; None: not training)
        self.optimizer_template: OptimizerTemplate | None = None
        self.migrations: list[Move] = []
        # held while the server changes (a migration), so that the peer's departure sees one server
        self.lock = threading.Lock()
        self._fresh = False  # whether the last stage built here was allocated from the meta device
        self._measured_since: Since | None = None
        self._stop_rebalancing = threading.Event()
        self._rebalancer: threading.Thread | None = None

    # ------------------------------------------------------------------ a server of a stage
    def make_server(self, stage: int, throughput: float | None = None) -> StageServer:
        """A (not yet started) server of ``stage``, its blocks allocated on this peer's device, announcing
        ``throughput`` until it has measured its own (``None``: estimate it)."""
        partition, dht = self.state.partition, self.state.dht
        assert partition is not None and dht is not None
        self._fresh = partition.materialize(stage, self.device, seed=stage_seed(self.settings.run_id, stage))
        stage_module = partition.stage_module(stage).to(self.device)
        template = self.optimizer_template
        factory, groups = template.for_stage(stage_module) if template is not None else (None, None)
        return StageServer(
            stage,
            stage_module,
            dht=dht,
            settings=self.settings,
            optimizer_factory=factory,
            param_groups=groups,
            throughput=throughput,
        )

    def start_server(self, server: StageServer) -> None:
        """Start ``server``; if its stage already has online peers, first as ``"joining"`` while it downloads the
        stage's current parameters and optimizer state from one of them, then online.

        Raises:
            ValueError: the stage holds parameters this peer could not initialise (no ``reset_parameters()``) and
                no peer of the stage sent them (:meth:`~.partition.Partition.check_initialised`).
        """
        dht, partition = self.state.dht, self.state.partition
        assert dht is not None and partition is not None
        me, stage = dht.peer_id, server.stage
        donors = [p for p in get_stage_peers(dht, self.settings.run_id, stage) if p.peer_id != me]
        joining = bool(donors) and server.optimizer_factory is not None
        if donors and not joining and self._fresh:
            # not training (validate/test/predict), and the stage was not allocated here: its weights come from
            # the stage's peers (the seeded initialisation would be a silent wrong answer)
            client = SwarmClient(dht, self.settings)
            try:
                server.module.load_state_dict(client.fetch_stage_state(stage))
            finally:
                client.shutdown()
            partition.uninitialised.pop(stage, None)
        if not joining:
            partition.check_initialised(stage)  # nobody sends the stage: every tensor must be initialised
        server.start(joining=joining)
        if not joining:
            return
        try:
            loaded = server.load_state_from_peers()
            for _ in range(
                LOAD_ATTEMPTS - 1
            ):  # a donor that was busy or just left: the stage may have others
                if loaded or not [
                    p for p in get_stage_peers(dht, self.settings.run_id, stage) if p.peer_id != me
                ]:
                    break
                loaded = server.load_state_from_peers()
            if not loaded:
                partition.check_initialised(stage)
        except BaseException:
            server.shutdown(abort=True)
            raise
        if loaded:
            partition.uninitialised.pop(stage, None)
            logger.info(f"Peer {me} loaded the current state of stage {stage} from its peers")
        else:
            logger.warning(
                f"Peer {me} found no peer of stage {stage} to download its state from; it serves its own initial "
                "weights until the stage's next averaging round"
            )
        server.set_state(ONLINE)

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
        dht, server = self.state.dht, self.state.server
        assert dht is not None
        if server is None or not server.throughput.measured:
            self._measured_since = None
            return None  # an estimate is no ground for a move; without trainers there is nothing to speed up
        now = time.monotonic()
        if self._measured_since is None or self._measured_since.server is not server:
            self._measured_since = Since(server, now)
        # every peer's announced figure should rest on more than its first calls before anyone moves
        settle = max(3 * self.settings.announce_period, self.settings.rebalance_period / 2)
        if now - self._measured_since.time < settle:
            return None
        loads = peer_loads(dht, self.settings)
        me = dht.peer_id.to_base58()
        listed = {p.stage for p in loads}
        if len(listed) < self.settings.num_stages or not any(p.peer_id == me for p in loads):
            return None
        move = plan_move(loads, self.settings.num_stages, min_gain=self.settings.rebalance_min_gain)
        if move is None or move.peer_id != me or move.src != self.state.stage:
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
        state = self.state
        with self.lock:
            assert state.partition is not None and state.server is not None and state.client is not None
            old = state.server
            if stage == old.stage:
                return
            # this peer's speed on the new stage, until measured there: what it announced (and the policy assumed)
            # scaled by the stages' sizes, as compute per sample grows with the parameters
            size_old = sum(p.numel() for p in old.module.parameters()) or 1
            size_new = (
                sum(b.numel() for blk in state.partition.stage_blocks(stage) for b in blk.parameters()) or 1
            )
            throughput = old.throughput.value * size_old / size_new
            old.drain()
            state.client.set_local_server(old.stage, None)
            old.shutdown()
            state.server = None
            try:
                state.partition.release(keep=[stage])
                new = self.make_server(stage, throughput)
                self.start_server(new)
            except Exception:
                # serve the old stage again (its state comes back from its peers) rather than nothing
                state.partition.release(keep=[old.stage])
                new = self.make_server(old.stage)
                self.start_server(new)
                state.server = new
                state.client.set_local_server(old.stage, new)
                raise
            state.server, state.stage = new, stage
            state.client.set_local_server(stage, new)

    def start_rebalancing(self) -> None:
        """Check the stages' loads at randomised intervals in a thread of its own and move when the policy says so
        (see :meth:`rebalance_once`), until :meth:`stop_rebalancing`."""
        self._stop_rebalancing.clear()
        self._rebalancer = threading.Thread(target=self._rebalance_loop, name="swarm-rebalance", daemon=True)
        self._rebalancer.start()

    def stop_rebalancing(self) -> None:
        self._stop_rebalancing.set()
        thread, self._rebalancer = self._rebalancer, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=120)
