"""One swarm peer's life: join the DHT, host a stage, route the trainer's microbatches, move, leave cleanly.

This is the glue between the pieces of the engine (DHT, :class:`StageServer`, :class:`SwarmClient`,
:class:`Partition`, :class:`Presence`) and is free of Lightning: the ``SwarmStrategy`` and the
``lightning-swarm serve`` command both drive a :class:`SwarmPeer`.

- Joining: the peer takes the stage that most needs it (:func:`~.rebalance.choose_stage` over the announced
  records), announces itself ``"joining"``, downloads the stage's current parameters and optimizer state from a
  peer already serving it, and only then goes ``"online"`` (trainers call only online peers).
- Memory: the peer keeps only its own stage's blocks (and the trainer-local modules); the other blocks are
  released to the ``meta`` device (:meth:`~.partition.Partition.release`).
- Rebalancing: at randomised intervals a training server reads every stage's records and, if
  :func:`~.rebalance.plan_move` names it, migrates: announces ``"leaving"``, finishes its calls in flight, frees
  its old stage, allocates the new one, loads its state from the peers there and goes online.
- Leaving: a peer announces ``"leaving"`` before it stops serving.
- Failing: a peer whose run raised an exception publishes it (:meth:`SwarmPeer.publish_failure`); every other peer
  raises it at its next poll of :meth:`SwarmPeer.should_stop` (every stage call attempt, every wait), as DDP's ranks
  stop together. Shutting down is bounded: a step that hangs on a hivemind helper process that died is left behind.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
import random
import secrets
import socket
import tempfile
import threading
import time
import weakref
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import hivemind
import torch
from torch import nn

from .auth import REFUSED_MARKER, SECRET_ENV, protect, unprotect
from .chunking import rows_mixing_module
from .client import SwarmClient
from .errors import RemoteStageError
from .footprint import release_free_memory, trim_footprint
from .identity import PeerIdentity, register_identity
from .lifetime import bounded, describe_exit, settle_dead_helpers, sigint_kept, start_bounded, wait_bounded
from .logs import quiet_routine_logs
from .materialize import RngSnapshot, materialize
from .optim import HivemindOptimizer, initialize_optimizer_state
from .partition import Partition
from .presence import APPEAR_TIMEOUT, PeerFailure, Presence, _dht_alive
from .protocol import stage_uid
from .rebalance import Move, PeerLoad, choose_stage, next_check, plan_move
from .records import get_stage_peers
from .server import StageServer
from .settings import SwarmSettings
from .states import DEPARTING, FINISHED, LEAVING, ONLINE, STATES
from .stepping import StepCommand, read_swarm_epoch
from .validation import record_validators

logger = logging.getLogger(__name__)

INITIAL_PEERS_ENV = "LIGHTNING_SWARM_INITIAL_PEERS"
_EPOCH_READ_S = 0.2  # with stage_steps="swarm": how stale the swarm's epoch driving LR schedules may be
_INFO_POLL_S = 10.0  # with stage_steps="swarm": how often a trainer asks the stages for their step counts
FAILED_SHUTDOWN_S = 3.0  # after a failure, seconds a peer spends shutting down before it raises the error


def find_pipeline(module: nn.Module) -> str:
    """Attribute path of the ``nn.Sequential`` / ``nn.ModuleList`` holding the most parameters in ``module``."""
    best, best_params = None, -1
    for name, sub in module.named_modules():
        if name and isinstance(sub, (nn.Sequential, nn.ModuleList)) and len(sub) > 1:
            params = sum(p.numel() for p in sub.parameters())
            if params > best_params:
                best, best_params = name, params
    if best is None:
        raise ValueError(
            "The SwarmStrategy found no nn.Sequential or nn.ModuleList of blocks in the model; pass "
            "`SwarmStrategy(pipeline='<attribute path>')` naming the container of blocks to run in the swarm."
        )
    return best


class SwarmPeer:
    """A peer of the swarm: DHT node, optionally a stage server, and (for trainers) the client of the stages.

    Args:
        settings: the swarm's settings.
        peer_index: this peer's index among the peers started together on this machine (0 bootstraps).
        local_swarm_size: number of peers started together on this machine, or ``None`` when peers join from
            anywhere through ``initial_peers``.
        rendezvous_path: file where peer 0 of a local swarm writes its multiaddrs for the others.
        device: where this peer computes.
        should_stop: polled while this peer waits on the swarm (a stage call waiting for peers, a server-only
            peer waiting for trainers); once it returns True (SIGTERM), the wait ends at once. See
            :meth:`should_stop`, which also raises another peer's failure.
    """

    def __init__(
        self,
        settings: SwarmSettings,
        peer_index: int = 0,
        local_swarm_size: int | None = None,
        rendezvous_path: str | None = None,
        device: torch.device | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self._stop_requested: Callable[[], bool] = should_stop or (lambda: False)
        self.peer_index = peer_index
        self.local_swarm_size = local_swarm_size
        self.settings = settings
        if settings.stage_steps == "auto":  # one trainer drives the stages' steps; several: the swarm does
            settings = settings.replace(stage_steps="trainer" if self.num_trainers == 1 else "swarm")
        self.settings = settings
        self.rendezvous_path = rendezvous_path
        self.device = device or torch.device("cpu")
        self.dht: hivemind.DHT | None = None
        self.presence: Presence | None = None
        self.partition: Partition | None = None
        self.server: StageServer | None = None
        self.client: SwarmClient | None = None
        self.stage: int | None = None
        self.joined = False
        self.migrations: list[Move] = []
        self._trainer_optimizer: hivemind.Optimizer | None = None
        self._samples_since_step = 0
        self._step_ids = itertools.count(secrets.randbits(62))
        self._stage_epochs: dict[int, int] = {}  # the epoch each stage replied with at the last step
        # per stage: optimizer steps taken (the most of any peer) and averaging rounds with other peers
        self.stage_steps: dict[int, int] = {}
        self.stage_rounds: dict[int, int] = {}
        self._last_info_poll = -float("inf")
        self._swarm_epoch, self._epoch_read_at = 0, -float("inf")
        self._sent_hyper: dict[int, dict[int, dict[str, Any]]] = {}
        self._info_poller: threading.Thread | None = None
        self._stage_optimizer: _OptimizerTemplate | None = None
        # the pipeline's parameters before prepare() reallocated them: (parameter, owning module id, name); an
        # optimizer made before that still holds them (weak references: a released block's tensors are freed)
        self._pipeline_before: list[tuple[weakref.ref, int, str]] = []
        self._measured_since: _Since | None = None
        self._fresh = False  # whether the last stage built here was allocated from the meta device
        self._migration_lock = threading.Lock()
        self._stop_rebalancing = threading.Event()
        self._rebalancer: threading.Thread | None = None
        self._identity: PeerIdentity | None = None
        self._cut_off = False  # this peer's DHT process died: it stops (see should_stop)

    # ------------------------------------------------------------------ roles
    @property
    def is_trainer(self) -> bool:
        if self.settings.role == "server":
            return False
        if self.local_swarm_size is not None and self.settings.num_trainers is not None:
            return self.peer_index < self.settings.num_trainers
        return True

    @property
    def is_server(self) -> bool:
        return self.settings.role != "trainer"

    @property
    def num_trainers(self) -> int | None:
        """How many trainers the run has, where known (a local swarm, or ``num_trainers`` given)."""
        if self.local_swarm_size is None:
            return self.settings.num_trainers
        return min(self.settings.num_trainers or self.local_swarm_size, self.local_swarm_size)

    @property
    def drives_stages(self) -> bool:
        """Whether this trainer's optimizer steps are the stages' steps (``stage_steps="trainer"``)."""
        return self.settings.stage_steps == "trainer" and self.is_trainer

    def should_stop(self) -> bool:
        """Polled by every wait of this peer (stage calls, the end-of-run handshake): raises the failure another
        peer of the run published (a :class:`~.presence.PeerFailure`), else whether this peer must stop: it was
        asked to (SIGTERM), or its DHT helper process died (killed, e.g. by the OOM killer), which cuts it off the
        swarm: it then stops as after SIGTERM, with one warning, and the others carry on as after a crash."""
        if self.presence is not None:
            self.presence.check_failure()
        if not self._cut_off and self.dht is not None and self.joined and not _dht_alive(self.dht):
            self._cut_off = True
            how = describe_exit(self.dht.exitcode)
            logger.warning(
                f"{self.describe()}: its DHT helper process (pid {self.dht.pid}) died ({how}), so this peer can no "
                "longer reach the swarm: it stops now, and the other peers carry on without it. Check the machine's "
                "memory (the OOM killer) and start the peer again to rejoin."
            )
        return self._cut_off or self._stop_requested()

    def publish_failure(self, error: BaseException) -> bool:
        """This peer's run raised ``error``: publish it, so that every peer of the run stops with it. The failure
        another peer published, Ctrl-C and ``SystemExit`` (SIGTERM) are not published: only an ``Exception``. Returns
        whether the swarm fails with this peer (the error is published, or is the swarm's failure already)."""
        if self.presence is None or not isinstance(error, Exception):
            return False
        if error is self.presence.failure:
            return True
        if self.dht is None or not _dht_alive(self.dht):
            return False  # nobody to tell: the others carry on, as after a crash
        type_name, message, origin = type(error).__name__, str(error), self.describe()
        if isinstance(error, PeerFailure):  # a local peer's, seen by the launcher: pass it on as it came
            type_name, message, origin = error.type_name, error.remote_message, error.origin
        elif isinstance(error, RemoteStageError) and error.is_compute_error and error.error is not None:
            type_name = error.error.type_name  # a stage's own code raised it on the peer that served the call
        if self.presence.publish_failure(type_name, message, origin):
            return True
        logger.warning(
            f"{self.describe()} could not publish its error in the DHT: the other peers carry on without it, as "
            "after a crash."
        )
        return False

    def describe(self) -> str:
        """This peer in words, for the other peers' messages: its index in a local swarm, pid, host and peer id."""
        peer_id = self.presence.peer_name if self.presence is not None else "?"
        where = f"pid {os.getpid()} on {socket.gethostname()}, peer id {peer_id}"
        if self.local_swarm_size is not None:
            return f"Swarm peer {self.peer_index} ({where})"
        return f"Swarm peer {peer_id} (pid {os.getpid()} on {socket.gethostname()})"

    # ------------------------------------------------------------------ DHT
    def start_dht(self) -> hivemind.DHT:
        """Start this peer's DHT node: bootstrap (local peer 0 or no known peers) or join the given peers.

        The node has this peer's :class:`~.records.PeerIdentity` (its records are signed, the others' validated)
        and, in a private swarm (``secret`` / ``allowed_peers``), the access gate of :mod:`.auth`.

        Raises:
            RuntimeError: one line saying what failed (port in use, bad address, unreachable or refusing peers,
                p2p daemon failure) and what to do.
        """
        s = self.settings
        quiet_routine_logs()  # before hivemind forks its helpers, which inherit the filter
        trim_footprint()  # before the first helper and the first shared tensor
        release_free_memory()  # the DHT's process is forked below: it would keep freed pages alive
        host_maddrs = s.host_maddrs or ["/ip4/127.0.0.1/tcp/0"]
        initial_peers = list(s.initial_peers) or _env_peers()
        if self.local_swarm_size is not None and self.peer_index > 0 and not initial_peers:
            initial_peers = self._wait_rendezvous()
        key_path = s.identity_path
        if key_path and self.local_swarm_size is not None and self.peer_index > 0:
            key_path = f"{key_path}.{self.peer_index}"  # the peers of a local swarm need distinct identities
        identity = PeerIdentity.load_or_create(key_path) if key_path else PeerIdentity()
        secret = s.secret or os.environ.get(SECRET_ENV) or None
        private = secret is not None or bool(s.allowed_peers)
        if private:  # before the DHT forks its process, which inherits the gate
            protect(identity.peer_id, secret, s.allowed_peers or None)
        self._identity = identity
        with tempfile.TemporaryDirectory(prefix="swarm-id-") as tmp:
            identity_path = key_path
            if identity_path is None:
                identity_path = os.path.join(tmp, "identity.key")
                identity.save(identity_path)
            try:
                self.dht = hivemind.DHT(
                    start=True,
                    initial_peers=initial_peers,
                    host_maddrs=host_maddrs,
                    identity_path=identity_path,
                    check_if_identity_free=False,
                    record_validators=record_validators(s.run_id, s.num_stages, identity),
                )
            except Exception as e:
                unprotect(identity.peer_id)
                raise RuntimeError(
                    dht_start_error(e, host_maddrs, initial_peers, secret, s.allowed_peers)
                ) from e
        register_identity(self.dht, identity)
        if self.local_swarm_size is not None and self.peer_index == 0 and self.rendezvous_path:
            tmp = f"{self.rendezvous_path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write("\n".join(str(a) for a in self.dht.get_visible_maddrs()))
            os.replace(tmp, self.rendezvous_path)
        self.presence = Presence(self.dht, s.run_id, str(self.dht.peer_id), trainer=self.is_trainer)
        self.presence.start()
        logger.info(
            f"Swarm peer {self.peer_index} is up{' (private swarm)' if private else ''}: "
            f"{[str(a) for a in self.dht.get_visible_maddrs()]}"
        )
        return self.dht

    def _wait_rendezvous(self, timeout: float = 120.0) -> list[str]:
        assert self.rendezvous_path is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(self.rendezvous_path):
                with open(self.rendezvous_path) as f:
                    peers = [line.strip() for line in f if line.strip()]
                if peers:
                    return peers
            time.sleep(0.1)
        raise TimeoutError(
            f"SwarmStrategy: peer {self.peer_index} waited {timeout:.0f} s for peer 0 to start the swarm "
            f"({self.rendezvous_path} never appeared). Check that peer 0 is running and did not fail."
        )

    # ------------------------------------------------------------------ join
    @property
    def stage_known_offline(self) -> bool:
        """Whether this peer's stage is known before its DHT starts (a local swarm's peer, or ``stage`` given)."""
        return self.settings.stage is not None or self.local_swarm_size is not None

    def prepare(self, module: nn.Module, rng: RngSnapshot | None = None) -> None:
        """Cut ``module``'s pipeline into stages, choose this peer's stage and keep only what this peer hosts: its
        stage's blocks and the modules outside the pipeline. Blocks built on meta (see :mod:`.materialize`) get
        storage and their initial values here, and only here (replaying the build from ``rng``, the generators'
        states when the meta build began; ``None``: a seed of the run, the same on every peer); blocks built with
        storage are released to meta (the whole model then existed once, before any training state and before any
        helper process was forked).
        Called by :meth:`join` unless called before (earlier is better: before the DHT forks its process, which
        would otherwise keep pages of the released blocks alive)."""
        s = self.settings
        self.partition = Partition(module, s.pipeline or find_pipeline(module), s.num_stages)
        self._pipeline_before = [
            (weakref.ref(p), id(m), name)
            for m in self.partition.container.modules()
            for name, p in m.named_parameters(recurse=False)
        ]
        self.stage = self._choose_stage()
        hosted = self.partition.stage_blocks(self.stage) if self.is_server else []
        others = {id(m) for block in self.partition.container if block not in hosted for m in block.modules()}
        if rng is None:
            # built on meta by the user's own code (or nothing is on meta): every peer starts from a seed of the run
            rng = RngSnapshot.seeded(_stage_seed(s.run_id, -1), self.device)
        materialize(module, lambda m: id(m) not in others, self.device, rng)
        self.partition.release(keep=[self.stage] if self.is_server else [])
        release_free_memory()

    def _live_pipeline_before(self) -> dict[int, tuple[int, str]]:
        """``id(parameter) -> (id(owning module), name)`` of the pipeline's parameters from before
        :meth:`prepare` that are still alive (held by an optimizer made before it)."""
        live = {}
        for ref, owner, name in self._pipeline_before:
            p = ref()
            if p is not None:
                live[id(p)] = (owner, name)
        return live

    def join(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], training: bool
    ) -> list[torch.optim.Optimizer]:
        """Serve this peer's stage (see :meth:`prepare`), put the proxy in place and return the trainer's
        optimizers (see :meth:`trainer_optimizers`)."""
        s = self.settings
        assert self.dht is not None, "start_dht() first"
        self.check_stage_count()
        if self.partition is None or self.partition.root is not module:
            self.prepare(module)
        assert self.partition is not None and self.stage is not None
        mixer = rows_mixing_module(self.partition.container)
        if mixer is not None and s.microbatches not in ("auto", 1):
            raise ValueError(
                f"SwarmStrategy(microbatches={s.microbatches}) cannot cut this pipeline's batches into chunks: its "
                f"module {mixer} computes each row's output from the whole batch's statistics. Use microbatches=1 "
                "(or 'auto', which sends such a pipeline whole batches)."
            )
        if training and optimizers:  # before the trainer's optimizers lose the pipeline's parameters
            self._stage_optimizer = _OptimizerTemplate(
                optimizers, self.partition.container, before=self._live_pipeline_before()
            )
        local_servers = {}
        if self.is_server:
            self.server = self._make_server(self.stage)
            local_servers[self.stage] = self.server
        # hivemind optimizers fork their averager processes: create them all before this process starts the
        # event-loop thread of its P2P calls (a fork taken while that thread holds a lock can hang the child)
        optimizers = self.trainer_optimizers(optimizers) if training else optimizers
        # this peer keeps only its own stage: the other blocks are freed (see Partition.release)
        self.partition.release(keep=[self.stage] if self.server is not None else [])
        if self.server is not None:
            self._start_server(self.server)
        release_free_memory()  # the optimizers' set-up drew and freed zero gradients
        self.client = SwarmClient(self.dht, s, local_servers=local_servers, should_stop=self.should_stop)
        self.client.chunking = mixer is None  # see .chunking: batch statistics need whole batches
        self.partition.install_proxy(self.client.call_stage)
        self.joined = True
        if self.server is not None and self.server.optimizer is not None and s.rebalance_period > 0:
            self._stop_rebalancing.clear()
            self._rebalancer = threading.Thread(
                target=self._rebalance_loop, name="swarm-rebalance", daemon=True
            )
            self._rebalancer.start()
        return optimizers

    def check_stage_count(self) -> None:
        """Raise a ``ValueError`` if the peers of this run announce another number of stages than this peer's and
        none announces the same (this peer is the misconfigured one); only warn if some do (the others are: a
        single peer announcing a wrong count does not keep everyone out)."""
        assert self.dht is not None
        s = self.settings
        same, others = 0, {}
        for stage in range(s.num_stages):
            for p in get_stage_peers(self.dht, s.run_id, stage, states=STATES):
                if p.num_stages is None or p.num_stages == s.num_stages:
                    same += 1
                else:
                    others.setdefault(p.num_stages, []).append(p.peer_id.to_base58())
        if not others:
            return
        counts = ", ".join(f"{n} ({len(ids)} peer(s), e.g. {ids[0]})" for n, ids in sorted(others.items()))
        message = (
            f"SwarmStrategy(num_stages={s.num_stages}) but peers of run '{s.run_id}' announce num_stages={counts}: "
            "give every peer of a run the same num_stages (and pipeline), or use another run_id."
        )
        if not same:
            raise ValueError(message)
        logger.warning(f"{message} ({same} peer(s) announce {s.num_stages}, as this one does.)")

    def _choose_stage(self) -> int:
        s = self.settings
        if s.stage is not None:
            return s.stage
        if self.local_swarm_size is not None:
            return self.peer_index % s.num_stages
        return choose_stage(self.peer_loads(), s.num_stages)

    def peer_loads(self) -> list[PeerLoad]:
        """Every stage's announced peers (joining, online and leaving), for the rebalancing policy."""
        assert self.dht is not None
        loads = []
        for stage in range(self.settings.num_stages):
            for p in get_stage_peers(self.dht, self.settings.run_id, stage, states=STATES):
                loads.append(PeerLoad(p.peer_id.to_base58(), stage, p.throughput, p.state))
        return loads

    def _make_server(self, stage: int, throughput: float | None = None) -> StageServer:
        """A (not yet started) server of ``stage``, its blocks allocated on this peer's device, announcing
        ``throughput`` until it has measured its own (``None``: estimate it)."""
        assert self.partition is not None and self.dht is not None
        self._fresh = self.partition.materialize(
            stage, self.device, seed=_stage_seed(self.settings.run_id, stage)
        )
        stage_module = self.partition.stage_module(stage).to(self.device)
        template = self._stage_optimizer
        factory, groups = template.for_stage(stage_module) if template is not None else (None, None)
        return StageServer(
            stage,
            stage_module,
            dht=self.dht,
            settings=self.settings,
            optimizer_factory=factory,
            param_groups=groups,
            throughput=throughput,
        )

    def _start_server(self, server: StageServer) -> None:
        """Start ``server``; if its stage already has online peers, first as ``"joining"`` while it downloads the
        stage's current parameters and optimizer state from one of them, then online."""
        assert self.dht is not None
        me = self.dht.peer_id
        donors = [p for p in get_stage_peers(self.dht, self.settings.run_id, server.stage) if p.peer_id != me]
        joining = bool(donors) and server.optimizer_factory is not None
        if donors and not joining and self._fresh:
            # not training (validate/test/predict), and the stage was not allocated here: its weights come from
            # the stage's peers (the seeded initialisation would be a silent wrong answer)
            client = SwarmClient(self.dht, self.settings)
            try:
                server.module.load_state_dict(client.fetch_stage_state(server.stage))
            finally:
                client.shutdown()
        server.start(joining=joining)
        if joining:
            if server.load_state_from_peers():
                logger.info(f"Peer {me} loaded the current state of stage {server.stage} from its peers")
            else:
                logger.warning(
                    f"Peer {me} found no peer of stage {server.stage} to download its state from; it serves its own "
                    "initial weights until the stage's next averaging round"
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

    # ------------------------------------------------------------------ trainer-side optimisation
    def trainer_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
        """Drop the pipeline's parameters from the trainer's optimizers (the stages' servers own them) and, when
        several trainers feed the swarm, average the remaining (trainer-local) parameters' gradients among them."""
        assert self.partition is not None
        pipeline = set(self._live_pipeline_before()) | {id(p) for p in self.partition.container.parameters()}
        for opt in optimizers:
            for group in opt.param_groups:
                group["params"] = [p for p in group["params"] if id(p) not in pipeline]
        one_trainer = (
            self.num_trainers == 1 or self.settings.stage_steps == "trainer"
        )  # "trainer": one trainer
        if not self.is_trainer or one_trainer or len(optimizers) != 1:
            return optimizers
        if not any(g["params"] for g in optimizers[0].param_groups):
            return optimizers
        initialize_optimizer_state(optimizers[0])  # before hivemind does it with a real (decaying) step
        with sigint_kept():  # hivemind's averager would leave this process ignoring Ctrl-C
            self._trainer_optimizer = HivemindOptimizer(
                dht=self.dht,
                run_id=f"{self.settings.run_id}_trainers",
                target_batch_size=self.settings.target_batch_size,
                optimizer=optimizers[0],
                # requests time out before matchmaking ends (hivemind warns, and may deadlock, otherwise)
                averager_opts={
                    "initialize_optimizer": False,
                    "request_timeout": max(0.2, self.settings.matchmaking_time / 3),
                },
                # step locally every batch and average parameters in the background every `target_batch_size`
                # samples: a trainer never blocks on the others' averaging rounds
                use_local_updates=True,
                matchmaking_time=self.settings.matchmaking_time,
                averaging_timeout=self.settings.averaging_timeout,
                verbose=False,
            )
        return [self._trainer_optimizer]

    def note_batch_size(self, batch_size: int) -> None:
        """Count a training batch's samples towards the next optimizer step (accumulated batches add up)."""
        self._samples_since_step += max(1, int(batch_size))

    def optimizer_step_kwargs(self) -> dict[str, Any]:
        """What the trainers' hivemind optimizer's ``step`` needs: the samples since the last step (every
        accumulated batch, not the last one only)."""
        samples, self._samples_since_step = max(1, self._samples_since_step), 0
        return {"batch_size": samples} if self._trainer_optimizer is not None else {}

    def new_step_id(self) -> int:
        """The id of this trainer's next optimizer step (see :mod:`.stepping`)."""
        return next(self._step_ids)

    def _command_stages(self, make: Callable[[int], StepCommand]) -> dict[int, list[dict[str, Any]]]:
        """Send ``make(stage)`` to every stage at once (each to all its live peers); returns the replies."""
        assert self.client is not None
        client = self.client
        stages = range(self.settings.num_stages)
        if len(stages) == 1:
            return {0: client.step_stage(0, make(0))}
        with ThreadPoolExecutor(max_workers=len(stages), thread_name_prefix="swarm-step") as pool:
            futures = {k: pool.submit(client.step_stage, k, make(k)) for k in stages}
            return {k: f.result() for k, f in futures.items()}

    def stage_grad_sq_norm(self, step_id: int, optimizer: int, grad_scale: float = 1.0) -> float:
        """The squared norm of the stages' gradients of step ``step_id`` (summed over each stage's peers,
        unscaled by ``grad_scale``), for clipping by the whole model's norm; ``inf`` if any is not finite."""
        replies = self._command_stages(
            lambda k: StepCommand(
                stage_uid(self.settings.run_id, k),
                step_id,
                phase="norm",
                optimizer=optimizer,
                grad_scale=grad_scale,
                epoch=self._stage_epochs.get(k, 0),
            )
        )
        total = 0.0
        for stage_replies in replies.values():
            reply = stage_replies[0]  # the peers of a stage summed the same gradients
            if not reply.get("finite", True):
                return float("inf")
            total += float(reply.get("sq_norm", 0.0))
        return total

    def swarm_epoch(self) -> int:
        """With ``stage_steps="swarm"``: the swarm's epoch (the stages' steps together so far, from their progress
        in the DHT), read at most every ``_EPOCH_READ_S`` seconds; never goes back. With trainer-driven steps: the
        stages' epoch as they replied to this trainer's last step."""
        if self.drives_stages or self.dht is None:
            return max(self._stage_epochs.values(), default=0)
        now = time.monotonic()
        if now - self._epoch_read_at >= _EPOCH_READ_S:
            self._epoch_read_at = now
            epoch = read_swarm_epoch(self.dht, self.settings.run_id, 0)
            if epoch is not None:
                self._swarm_epoch = max(self._swarm_epoch, epoch)
        return self._swarm_epoch

    def send_stage_hyper(self, optimizer: int, groups: dict[int, dict[str, Any]]) -> None:
        """With ``stage_steps="swarm"``: give the stages this trainer's current hyper-parameters of ``optimizer``
        (its LR schedule) if they changed since last sent; the stages use them from their next step."""
        if self._sent_hyper.get(optimizer) == groups:
            return
        step_id = self.new_step_id()
        self._command_stages(
            lambda k: StepCommand(
                stage_uid(self.settings.run_id, k), step_id, phase="hyper", optimizer=optimizer, groups=groups
            )
        )
        self._sent_hyper[optimizer] = groups

    def zero_stage_grads(self, optimizer: int) -> None:
        """Drop the gradients the stages hold for the parameters of this trainer's optimizer ``optimizer``
        (``optimizer.zero_grad()`` under manual optimization, see :mod:`.stepping`)."""
        step_id = self.new_step_id()
        self._command_stages(
            lambda k: StepCommand(
                stage_uid(self.settings.run_id, k), step_id, phase="zero", optimizer=optimizer
            )
        )

    def step_stages(
        self,
        step_id: int,
        optimizer: int,
        groups: dict[int, dict[str, Any]],
        grad_scale: float = 1.0,
        clip_coef: float | None = None,
        clip_value: float | None = None,
        skip: bool = False,
    ) -> None:
        """Step every stage as this trainer's optimizer ``optimizer`` just stepped (see :mod:`.stepping`), and
        wait until each stage serves its new parameters."""
        replies = self._command_stages(
            lambda k: StepCommand(
                stage_uid(self.settings.run_id, k),
                step_id,
                phase="apply",
                optimizer=optimizer,
                groups=groups,
                grad_scale=grad_scale,
                clip_coef=clip_coef,
                clip_value=clip_value,
                skip=skip,
                epoch=self._stage_epochs.get(k, 0),
            )
        )
        for k, stage_replies in replies.items():
            self._stage_epochs[k] = max(int(r["epoch"]) for r in stage_replies)
            self.stage_steps[k] = max(int(r.get("steps", 0)) for r in stage_replies)
            if max(int(r.get("group", 1)) for r in stage_replies) > 1:
                self.stage_rounds[k] = self.stage_rounds.get(k, 0) + 1

    def stats(self) -> dict[str, float]:
        """The client's traffic counters, and per stage the optimizer steps and the averaging rounds with other
        peers of the stage (``swarm/stage{k}/steps``, ``swarm/stage{k}/rounds``): as the stages replied to this
        trainer's step commands, or (``stage_steps="swarm"``) as their peers last reported (``rpc_info``, polled
        in the background every ``_INFO_POLL_S`` seconds)."""
        stats = self.client.stats() if self.client is not None else {}
        if not self.drives_stages and self.client is not None:
            self._poll_stage_info()
        for k, steps in self.stage_steps.items():
            stats[f"swarm/stage{k}/steps"] = float(steps)
        for k, rounds in self.stage_rounds.items():
            stats[f"swarm/stage{k}/rounds"] = float(rounds)
        return stats

    def _poll_stage_info(self) -> None:
        now = time.monotonic()
        if now - self._last_info_poll < _INFO_POLL_S or (self._info_poller and self._info_poller.is_alive()):
            return
        self._last_info_poll = now
        client = self.client

        def poll() -> None:
            for k in range(self.settings.num_stages):
                try:
                    infos = client.stage_info(k) if client is not None else []
                except Exception as e:
                    logger.debug(f"rpc_info of stage {k} failed: {e!r}")
                    continue
                if infos:
                    self.stage_steps[k] = max(int(i.get("steps", 0)) for i in infos)
                    self.stage_rounds[k] = max(int(i.get("averaged_rounds", 0)) for i in infos)

        self._info_poller = threading.Thread(target=poll, name="swarm-info", daemon=True)
        self._info_poller.start()

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
        assert self.client is not None and self.partition is not None
        states: dict[int, dict[str, torch.Tensor]] = {}
        errors: dict[int, BaseException] = {}
        for _ in range(attempts):
            for stage in range(self.settings.num_stages) if stages is None else stages:
                if stage in states:
                    continue
                try:
                    state = self.client.fetch_stage_state(stage)
                    self.partition.to_container_state(stage, state)  # complete and nothing unknown
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
            "have finished (they linger for `linger_timeout` seconds), and save checkpoints during training."
        )

    def load_stage_optimizer_states(self, states: dict[int, bytes]) -> None:
        """Restore each stage's optimizer state on all its live peers (resuming from a checkpoint).

        Raises:
            ValueError: the checkpoint's stages do not match this run's (another ``num_stages``), or a stage
                refused its state.
        """
        assert self.client is not None
        if sorted(states) != list(range(self.settings.num_stages)):
            raise ValueError(
                f"SwarmStrategy: the checkpoint holds the optimizer states of stages {sorted(states)}, but this run "
                f"has num_stages={self.settings.num_stages}: resume with the num_stages of the run that saved it."
            )
        self.wait_for_stages()  # a local swarm's other peers may still be starting
        for stage, data in states.items():
            if not self.client.load_optimizer_state(stage, data):
                raise RuntimeError(
                    f"SwarmStrategy: no peer of stage {stage} is online to restore its optimizer state from the "
                    "checkpoint; start the stage's servers before resuming."
                )

    def wait_for_stages(self, timeout: float = APPEAR_TIMEOUT) -> bool:
        """Wait until every stage has its announced servers, at most ``timeout`` seconds (a local swarm's peers
        start together, and on a busy machine some take a minute to come up): in a local swarm every local peer
        that serves it (so that the trainer's first step already commands all of them, see :mod:`.stepping`),
        elsewhere at least one. Returns whether they did. A stage still missing then is reported by the first
        call to it, after ``no_peers_timeout``."""
        assert self.client is not None
        s = self.settings
        expected = dict.fromkeys(range(s.num_stages), 1)
        if self.local_swarm_size is not None and s.role != "trainer" and s.stage is None:
            for j in range(self.local_swarm_size):  # local peer j serves stage j % num_stages
                expected[j % s.num_stages] = sum(i % s.num_stages == j % s.num_stages for i in range(j + 1))
        deadline = time.monotonic() + timeout
        missing = list(range(s.num_stages))
        while missing and not self.should_stop():
            try:
                missing = [k for k in missing if len(self.client.peers(k)) < expected[k]]
            except Exception as e:
                logger.debug(f"DHT lookup of the stages failed: {e!r}")
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        return not missing

    # ------------------------------------------------------------------ leave
    def serve_until_trainers_finish(self) -> None:
        """For server-only peers: serve until trainers have appeared (however late) and every live one has
        finished training (a trainer that died drops out once its record expires)."""
        assert self.presence is not None
        self.presence.set_phase(FINISHED)
        self.presence.wait_for(
            FINISHED,
            self.local_swarm_size,
            timeout=float("inf"),
            trainers_only=True,
            should_stop=self.should_stop,
        )

    def leave(self, failed: bool = False) -> None:
        """End of a run: keep serving until the others are done, put the trained pipeline back into the module,
        then shut everything down. After a failure (this peer's, or another's that arrives meanwhile), restore the
        container and leave at once: shutting down takes at most ``FAILED_SHUTDOWN_S`` seconds."""
        s = self.settings
        if failed:
            try:
                if self.partition is not None and self.joined:
                    self.partition.restore()
            finally:
                self.shutdown(budget=FAILED_SHUTDOWN_S)
            return
        try:
            self._stop_rebalancer()  # no migrations while the run ends and the stages are gathered
            if self.presence is not None:
                self.presence.set_phase(FINISHED)
                self.presence.wait_for(
                    FINISHED, self.local_swarm_size, timeout=s.linger_timeout, should_stop=self.should_stop
                )
            error: BaseException | None = None
            if self.joined and self.partition is not None:
                states: dict[int, dict[str, torch.Tensor]] = {}
                if self.is_trainer:
                    try:
                        states = self.gather_stage_states()
                    except RuntimeError as e:
                        error = e
                self.partition.restore(states)
            if self.presence is not None:
                self.presence.set_phase(DEPARTING)
                self.presence.wait_for(
                    DEPARTING,
                    self.local_swarm_size,
                    timeout=min(60.0, s.linger_timeout),
                    should_stop=self.should_stop,
                )
            if error is not None:
                raise error
        except BaseException:
            failed = True  # e.g. another peer's failure, raised while this one lingered
            if self.partition is not None and self.joined:
                self.partition.restore()
            raise
        finally:
            self.shutdown(budget=FAILED_SHUTDOWN_S if failed else None)

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

    def shutdown(self, drain: bool = False, budget: float | None = None) -> None:
        """Stop everything. The stage server first announces that it is leaving; with ``drain`` it also keeps
        serving a little while so that trainers route their next calls elsewhere (see ``StageServer.drain``).

        Every step is bounded: one that has not finished within ``budget`` seconds in all (after a failure), or
        within a generous bound of its own, is left to its background thread, and the DHT is then left to the
        process's exit (the steps left behind still use it). A hivemind helper process (the DHT's, an averager's)
        that died during the run is reported in one warning and not waited for.
        """
        deadline = None if budget is None else time.monotonic() + budget
        s = self.settings
        rounds = s.averaging_timeout + s.matchmaking_time  # a round in progress ends within that

        def bound(default: float) -> float:
            return default if deadline is None else max(0.1, min(default, deadline - time.monotonic()))

        self._stop_rebalancer()
        dead = settle_dead_helpers(
            self._helpers(), daemon_gone=self.dht is not None and not _dht_alive(self.dht)
        )
        if dead:
            logger.warning(
                f"{self.describe()}: hivemind helper process(es) {', '.join(dead)} died during the run; shutting "
                "down without them."
            )
        finished = True
        with self._migration_lock:
            if self.server is not None:
                server = self.server
                finished = bounded(
                    "the announcement of the departure",
                    lambda: server.drain() if drain else server.set_state(LEAVING),
                    bound(30.0),
                )
        # independent of each other: shut down together, so that a failing peer is quick
        steps = [
            ("the trainer optimizer's shutdown", "_trainer_optimizer", rounds + 30),
            ("the client's shutdown", "client", 15.0),
            ("the stage server's shutdown", "server", rounds + 30),
        ]
        running = []
        for what, name, default in steps:
            obj = getattr(self, name)
            if obj is not None:
                running.append((what, start_bounded(what, obj.shutdown), default))
                setattr(self, name, None)
        for what, done, default in running:
            finished = wait_bounded(what, done, bound(default)) and finished
        if self.presence is not None:
            self.presence.shutdown()
            self.presence = None
        if self.dht is not None:
            if finished:
                bounded("the DHT's shutdown", self.dht.shutdown, bound(15.0))
            self.dht = None
        if self._identity is not None:
            unprotect(self._identity.peer_id)
        if self.peer_index == 0 and self.rendezvous_path and os.path.exists(self.rendezvous_path):
            os.remove(self.rendezvous_path)
        self.joined = False


def stage_optimizer(
    optimizer: torch.optim.Optimizer, stage_module: nn.Module
) -> tuple[Callable[[Any], torch.optim.Optimizer], list[dict[str, Any]]]:
    """The optimizer a stage server steps with: the class of the module's own ``configure_optimizers`` choice,
    and its parameter groups restricted to the stage's parameters, each with its own hyper-parameters (a
    group without weight decay stays without it). Returns ``(factory, param_groups)``; parameters of the stage
    in none of the optimizer's groups are not trained, as in the user's optimizer."""
    return _OptimizerTemplate(optimizer, stage_module).for_stage(stage_module)


class _OptimizerTemplate:
    """The user's optimizers as a recipe for stage servers: the class and defaults of the ones that own pipeline
    parameters, and which group of which optimizer (with its own hyper-parameters) each block parameter belongs
    to, by the parameter's place in its module. Taken once when the peer joins, so that a peer that migrates
    later builds its new stage's optimizer the same way even though its blocks were freed and allocated again
    (new tensors). Each stage group carries ``swarm_optimizer``/``swarm_group``: the trainer's optimizer and
    group it mirrors, whose hyper-parameters the trainer's step commands bring (see :mod:`.stepping`).

    Raises:
        TypeError: a hivemind optimizer was given, or pipeline parameters belong to optimizers of different
            classes (a stage steps with one optimizer).
    """

    def __init__(
        self,
        optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer],
        pipeline: nn.Module,
        before: dict[int, tuple[int, str]] | None = None,
    ) -> None:
        optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        for optimizer in optimizers:
            if isinstance(optimizer, hivemind.Optimizer):
                raise TypeError(
                    "configure_optimizers must return a torch optimizer; the SwarmStrategy wraps it itself."
                )
        pipeline_ids = {id(p) for p in pipeline.parameters()} | set(before or {})
        owners = [
            i
            for i, opt in enumerate(optimizers)
            if any(id(p) in pipeline_ids for g in opt.param_groups for p in g["params"])
        ]
        classes = {type(optimizers[i]) for i in owners}
        if len(classes) > 1:
            names = ", ".join(f"optimizer {i}: {type(optimizers[i]).__name__}" for i in owners)
            raise TypeError(
                f"When using the SwarmStrategy, the pipeline's parameters must belong to optimizers of one class "
                f"({names}); a stage steps with one optimizer. Use one class for the pipeline's parameters, or "
                "move the parameters of the other optimizer out of the pipeline."
            )
        first = optimizers[owners[0]] if owners else (optimizers[0] if optimizers else None)
        self.cls = type(first) if first is not None else torch.optim.SGD
        # `defaults` may hold entries the constructor does not take (AdamW's `decoupled_weight_decay`)
        accepted = inspect.signature(self.cls.__init__).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        defaults = first.defaults if first is not None else {"lr": 0.0}
        self.defaults = {k: v for k, v in defaults.items() if takes_any or k in accepted}
        self.hyper: dict[tuple[int, int], dict[str, Any]] = {}
        self._group_of: dict[int, tuple[int, int]] = {}
        for i in owners:
            for g, group in enumerate(optimizers[i].param_groups):
                self.hyper[i, g] = {k: v for k, v in group.items() if k != "params"}
                for p in group["params"]:
                    self._group_of.setdefault(id(p), (i, g))
        self._by_slot: dict[tuple[int, str], tuple[int, int]] = {}  # (id(owner module), name) -> group
        for pid, slot in (before or {}).items():  # parameters the pipeline held before it was reallocated
            if pid in self._group_of:
                self._by_slot[slot] = self._group_of[pid]
        self.remember(pipeline)

    def remember(self, modules: nn.Module) -> None:
        """Note the group of every parameter under ``modules`` by (owning module, name), which survives
        reallocation (``Partition.release``/``materialize`` give the module new parameter objects)."""
        for module in modules.modules():
            for name, p in module.named_parameters(recurse=False):
                if id(p) in self._group_of:
                    self._by_slot[(id(module), name)] = self._group_of[id(p)]

    def for_stage(
        self, stage_module: nn.Module
    ) -> tuple[Callable[[Any], torch.optim.Optimizer], list[dict[str, Any]]]:
        grouped: dict[tuple[int, int], list[torch.Tensor]] = {}
        for module in stage_module.modules():
            for name, p in module.named_parameters(recurse=False):
                key = self._group_of.get(id(p), self._by_slot.get((id(module), name)))
                if key is not None:
                    grouped.setdefault(key, []).append(p)
        groups = [
            {**self.hyper[key], "params": grouped[key], "swarm_optimizer": key[0], "swarm_group": key[1]}
            for key in sorted(grouped)
        ]
        cls, defaults = self.cls, self.defaults

        def make(params: Any) -> torch.optim.Optimizer:
            return cls(params, **defaults)

        return make, groups


@dataclass
class _Since:
    """When this peer's current server was first seen with a measured throughput."""

    server: StageServer
    time: float


def _stage_seed(run_id: str, stage: int) -> int:
    """The seed with which every peer initialises a stage it allocates itself (the same on every peer)."""
    return zlib.crc32(f"{run_id}.stage{stage}".encode())


def dht_start_error(
    error: BaseException,
    host_maddrs: list[str] | tuple[str, ...],
    initial_peers: list[str],
    secret: str | None = None,
    allowed_peers: tuple[str, ...] = (),
) -> str:
    """The one-line explanation (what failed, what to do) of a DHT that did not start with ``error``."""
    text = str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
    head = "SwarmStrategy: the swarm's DHT did not start: "
    if "address already in use" in text:
        return (
            f"{head}a listen address of host_maddrs {list(host_maddrs)} is already in use on this machine: pick a "
            "free port (tcp/0 takes any free port) or stop the process that holds it."
        )
    if "failed to parse multiaddr" in text or "invalid value" in text:
        return (
            f"{head}host_maddrs {list(host_maddrs)} or initial_peers {initial_peers} hold an invalid multiaddr "
            f"({text}): use addresses such as /ip4/0.0.0.0/tcp/31337 and /ip4/1.2.3.4/tcp/31337/p2p/<peer id>."
        )
    if initial_peers and ("bootstrap" in text or "initial_peers" in text):
        refusal = _probe_refusal(initial_peers, secret, allowed_peers)
        if refusal is not None:
            return f"{head}{refusal}"
        return (
            f"{head}no peer of initial_peers {initial_peers} could be reached ({text}): check that they are running "
            "and that the addresses (with their /p2p/<peer id>) are current and reachable from here (peers behind "
            "NAT need an open port or a relay); in a private swarm, this peer needs the swarm's secret."
        )
    if "Daemon failed to start" in text or "p2pd" in text.lower():
        return (
            f"{head}the p2p daemon failed to start ({text}): check host_maddrs {list(host_maddrs)}, that the "
            "hivemind package's p2pd binary runs on this machine, and that there are free file descriptors."
        )
    return f"{head}{text}. Check host_maddrs {list(host_maddrs)} and initial_peers {initial_peers}."


def _probe_refusal(
    initial_peers: list[str], secret: str | None, allowed_peers: tuple[str, ...]
) -> str | None:
    """Whether the initial peers refuse this peer as a private swarm would: asks one of them from a throw-away
    peer with this peer's credentials; returns the refusal it got, or ``None``."""
    from hivemind.p2p import P2P, P2PHandlerError, PeerID
    from hivemind.proto import dht_pb2
    from hivemind.utils.multiaddr import Multiaddr

    from ._loop import run_coroutine

    async def probe() -> str | None:
        identity = PeerIdentity()
        if secret is not None or allowed_peers:
            protect(identity.peer_id, secret, allowed_peers or None)
        with tempfile.TemporaryDirectory(prefix="swarm-id-") as tmp:
            path = os.path.join(tmp, "identity.key")
            identity.save(path)
            p2p = await P2P.create(
                initial_peers=initial_peers, identity_path=path, check_if_identity_free=False
            )
        try:
            for maddr in initial_peers:
                try:
                    peer = PeerID.from_base58(Multiaddr(maddr)["p2p"])
                    await asyncio.wait_for(
                        p2p._call_unary_protobuf_handler(
                            peer, "DHTProtocol.rpc_ping", dht_pb2.PingRequest(), dht_pb2.PingResponse
                        ),
                        timeout=15,
                    )
                except P2PHandlerError as e:
                    message = str(e)
                    if REFUSED_MARKER in message:  # "...: PrivateSwarmError('peer ... refused the call ...')"
                        message = message[message.find("peer ", message.find("PrivateSwarmError")) :]
                        message = message.rstrip("')\"").replace(identity.peer_id.to_base58(), "this peer")
                        message = message.replace("Start the caller", "Start this peer").replace(
                            "and the caller", "and this peer"
                        )
                        return message
                except Exception:
                    continue
            return None
        finally:
            unprotect(identity.peer_id)
            await p2p.shutdown()

    try:
        return run_coroutine(probe(), timeout=60)
    except Exception as e:
        logger.debug(f"Probing the initial peers failed: {e!r}")
        return None


def _env_peers() -> list[str]:
    raw = os.environ.get(INITIAL_PEERS_ENV, "")
    return [p for p in raw.replace(",", " ").split() if p]
