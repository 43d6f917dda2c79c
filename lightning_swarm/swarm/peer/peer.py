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
- Leaving: a peer announces ``"leaving"`` before it stops serving. At the end of a run a peer that serves a stage
  lingers while other trainers still train and gather; a trainer that serves nothing leaves at once.
- Failing: a peer whose run raised an exception publishes it (:meth:`SwarmPeer.publish_failure`); every other peer
  raises it at its next poll of :meth:`SwarmPeer.should_stop` (every stage call attempt, every wait), as DDP's ranks
  stop together. Shutting down is bounded: a step that hangs on a hivemind helper process that died is left behind.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import hivemind
import torch
from torch import nn

from lightning_swarm.swarm.client.chunking import check_chunkable
from lightning_swarm.swarm.client.client import SwarmClient
from lightning_swarm.swarm.dht.auth import SECRET_ENV, protect, unprotect
from lightning_swarm.swarm.dht.bootstrap import dht_start_error, env_peers
from lightning_swarm.swarm.dht.identity import RANK_IDENTITY_ENV, PeerIdentity, register_identity
from lightning_swarm.swarm.dht.presence import PeerFailure, Presence, dht_alive, p2pd_pid
from lightning_swarm.swarm.dht.process import SwarmDHT
from lightning_swarm.swarm.dht.reachability import start_reachable
from lightning_swarm.swarm.dht.records import get_stage_peers
from lightning_swarm.swarm.dht.validation import record_validators
from lightning_swarm.swarm.footprint import before_fork, release_free_memory, share_parameters, trim_footprint
from lightning_swarm.swarm.lifetime import (
    bounded,
    describe_exit,
    die_with_parent,
    start_bounded,
    wait_bounded,
)
from lightning_swarm.swarm.logs import quiet_routine_logs
from lightning_swarm.swarm.peer.deferred_init import InitRecorder, replay
from lightning_swarm.swarm.peer.helpers import HelperProcesses
from lightning_swarm.swarm.peer.hosting import StageHost, peer_loads, stage_seed
from lightning_swarm.swarm.peer.materialize import RngSnapshot, has_meta, materialize
from lightning_swarm.swarm.peer.partition import Partition, find_pipeline
from lightning_swarm.swarm.peer.rebalance import choose_stage
from lightning_swarm.swarm.peer.stage_state import StageStates
from lightning_swarm.swarm.peer.state import PeerState
from lightning_swarm.swarm.peer.steps import TrainerSteps
from lightning_swarm.swarm.server import StageServer
from lightning_swarm.swarm.settings import SwarmSettings
from lightning_swarm.swarm.states import DEPARTING, FINISHED, LEAVING, STATES, TRAINING
from lightning_swarm.swarm.training.optimizer_template import OptimizerTemplate
from lightning_swarm.swarm.training.trainer_sync import TrainerSync
from lightning_swarm.swarm.wire.errors import RemoteStageError

logger = logging.getLogger(__name__)

FAILED_SHUTDOWN_S = 3.0  # after a failure, seconds a peer spends shutting down before it raises the error
# seconds a trainer whose presence record vanished still counts as live (see SwarmPeer.live_trainers)
VANISHED_GRACE_S = 10.0


T = TypeVar("T")


class _Shared(Generic[T]):
    """A read-only attribute of the peer that is the field of the same name of its :class:`PeerState` (the state
    its parts share)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, peer: SwarmPeer | None, owner: type | None = None) -> T:
        if peer is None:
            raise AttributeError(self.name)
        return getattr(peer.state, self.name)

    def __set__(self, peer: SwarmPeer, value: T) -> None:
        raise AttributeError(
            f"SwarmPeer.{self.name} is read-only: it is peer.state.{self.name}, shared by its parts"
        )


class SwarmPeer:
    """A peer of the swarm: DHT node, optionally a stage server, and (for trainers) the client of the stages.

    The peer owns its parts, each handed the :class:`~.state.PeerState` they share: ``host``
    (:class:`~.hosting.StageHost`: its stage server, started, moved between stages), ``steps``
    (:class:`~.steps.TrainerSteps`: a trainer's optimizers and step commands to the stages), ``stage_states``
    (:class:`~.stage_state.StageStates`: the stages' states gathered and restored) and ``helpers``
    (:class:`~.helpers.HelperProcesses`: its hivemind helper processes).

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
        if settings.stage_steps == "auto":  # the trainers drive the stages' steps (several: as DDP's ranks)
            settings = settings.replace(stage_steps="trainer")
        self.settings = settings
        self.rendezvous_path = rendezvous_path
        self.device = device or torch.device("cpu")
        self.state = PeerState()
        self.reached = "direct"  # how the swarm reaches this peer: "direct" or "relay" (see start_dht)
        self.joined = False
        self.built_on_meta = False  # whether the pipeline was built on meta (see prepare)
        self._identity: PeerIdentity | None = None
        self._cut_off = False  # this peer's DHT process died: it stops (see should_stop)
        self._trainers_read: tuple[float, set[str] | None] = (-float("inf"), None)
        # each training trainer -> when its record was last read (time.monotonic)
        self._trainers_seen: dict[str, float] = {}
        self.host = StageHost(settings, self.state, self.device, peer_index)
        self.steps = TrainerSteps(
            settings,
            self.state,
            is_trainer=self.is_trainer,
            num_trainers=self.num_trainers,
            drives_stages=self.drives_stages,
            should_stop=self.should_stop,
        )
        self.stage_states = StageStates(settings, self.state, local_swarm_size, self.should_stop)
        self.helpers = HelperProcesses(self.state, self.describe)

    # ------------------------------------------------------------------ the shared state, read-only
    dht: _Shared[hivemind.DHT | None] = _Shared()
    presence: _Shared[Presence | None] = _Shared()
    partition: _Shared[Partition | None] = _Shared()
    stage: _Shared[int | None] = _Shared()
    server: _Shared[StageServer | None] = _Shared()
    client: _Shared[SwarmClient | None] = _Shared()
    trainer_sync: _Shared[TrainerSync | None] = _Shared()  # several trainers stepping as DDP's ranks

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

    @property
    def gathers_on_end(self) -> bool:
        """Whether this trainer gathers every stage into its module when the run ends (``gather_on_end``; by
        default unless the pipeline was built on meta: a model built so is taken to be larger than one peer)."""
        wanted = self.settings.gather_on_end
        return not self.built_on_meta if wanted is None else wanted

    def stats(self) -> dict[str, float]:
        """The client's traffic counters and the stages' step and averaging counters (see
        :meth:`~.steps.TrainerSteps.stats`)."""
        return self.steps.stats()

    def should_stop(self) -> bool:
        """Polled by every wait of this peer (stage calls, the end-of-run handshake): raises the failure another
        peer of the run published (a :class:`~.presence.PeerFailure`), else whether this peer must stop: it was
        asked to (SIGTERM), or its DHT helper process died (killed, e.g. by the OOM killer), which cuts it off the
        swarm: it then stops as after SIGTERM, with one warning, and the others carry on as after a crash."""
        if self.presence is not None:
            self.presence.check_failure()
        if not self._cut_off and self.dht is not None and self.joined and not dht_alive(self.dht):
            self._cut_off = True
            if self.dht.is_alive():  # its p2p daemon died
                what = f"the p2p daemon of its DHT (pid {p2pd_pid(self.dht)}) died"
            else:
                what = (
                    f"its DHT helper process (pid {self.dht.pid}) died ({describe_exit(self.dht.exitcode)})"
                )
            logger.warning(
                f"{self.describe()}: {what}, so this peer can no longer reach the swarm: it stops now, and the "
                "other peers carry on without it. Check the machine's memory (the OOM killer) and start the peer "
                "again to rejoin."
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
        if self.dht is None or not dht_alive(self.dht):
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
        # hivemind's helper processes (DHT, p2p daemon, averagers) must not outlive this peer, however it is used
        # (the strategy, `lightning-swarm serve`, a script of one's own): a SIGKILLed peer takes them along
        die_with_parent()
        quiet_routine_logs()  # before hivemind forks its helpers, which inherit the filter
        trim_footprint()  # before the first helper and the first shared tensor
        host_maddrs = s.host_maddrs or ["/ip4/127.0.0.1/tcp/0"]
        initial_peers = list(s.initial_peers) or env_peers()
        if self.local_swarm_size is not None and self.peer_index > 0 and not initial_peers:
            initial_peers = self._wait_rendezvous()
        key_path = s.identity_path
        if key_path and self.local_swarm_size is not None and self.peer_index > 0:
            key_path = f"{key_path}.{self.peer_index}"  # the peers of a local swarm need distinct identities
        if key_path is None and self.local_swarm_size is not None and os.environ.get(RANK_IDENTITY_ENV):
            key_path = os.environ[RANK_IDENTITY_ENV]  # the launcher's, in the order of the local ranks
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

            def create(daemon_options: dict[str, Any]) -> hivemind.DHT:
                before_fork()  # the DHT's process is forked here
                return SwarmDHT(
                    start=True,
                    initial_peers=initial_peers,
                    host_maddrs=host_maddrs,
                    identity_path=identity_path,
                    check_if_identity_free=False,
                    record_validators=record_validators(s.run_id, s.num_stages, identity),
                    **daemon_options,
                )

            try:
                self.state.dht, self.reached = start_reachable(create, s.reachability, initial_peers)
            except Exception as e:
                unprotect(identity.peer_id)
                raise RuntimeError(
                    dht_start_error(e, host_maddrs, initial_peers, secret, s.allowed_peers)
                ) from e
        dht = self.state.dht
        register_identity(dht, identity)
        if self.local_swarm_size is not None and self.peer_index == 0 and self.rendezvous_path:
            tmp = f"{self.rendezvous_path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write("\n".join(str(a) for a in dht.get_visible_maddrs()))
            os.replace(tmp, self.rendezvous_path)
        self.state.presence = Presence(dht, s.run_id, str(dht.peer_id), trainer=self.is_trainer)
        self.state.presence.start()
        logger.info(
            f"Swarm peer {self.peer_index} is up{' (private swarm)' if private else ''}"
            f"{' (behind NAT: reached through relays)' if self.reached == 'relay' else ''}: "
            f"{[str(a) for a in dht.get_visible_maddrs()]}"
        )
        return dht

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

    def prepare(
        self, module: nn.Module, rng: RngSnapshot | None = None, recorder: InitRecorder | None = None
    ) -> None:
        """Cut ``module``'s pipeline into stages, choose this peer's stage and keep only what this peer hosts: its
        stage's blocks and the modules outside the pipeline. Blocks built on meta (see :mod:`.materialize`) get
        storage and their initial values here, and only here (replaying the build from ``rng``, the generators'
        states when the meta build began; ``None``: a seed of the run, the same on every peer); blocks built with
        storage are released to meta (the whole model then existed once, before any training state and before any
        helper process was forked).
        Called by :meth:`join` unless called before (earlier is better: before the DHT forks its process, which
        would otherwise keep pages of the released blocks alive)."""
        s = self.settings
        partition = self.state.partition = Partition(
            module, s.pipeline or find_pipeline(module), s.num_stages
        )
        stage = self.state.stage = self._choose_stage()
        hosted = partition.stage_blocks(stage) if self.is_server else []
        others = {
            id(m) for block in partition.container.children() if block not in hosted for m in block.modules()
        }
        self.built_on_meta = has_meta(partition.container)
        if rng is None:
            # built on meta by the user's own code (or nothing is on meta): every peer starts from a seed of the run
            rng = RngSnapshot.seeded(stage_seed(s.run_id, -1), self.device)
        meta = [t for t in (*module.parameters(), *module.buffers()) if t.is_meta]
        if recorder is not None and meta and recorder.covers(meta):
            # the build was recorded: replayed, so that every kept tensor gets what the model's own code gives it
            replay(recorder, module, lambda m: id(m) not in others, self.device, rng)
        else:
            materialize(module, lambda m: id(m) not in others, self.device, rng)
        partition.release(keep=[stage] if self.is_server else [])
        release_free_memory()
        # what the optimizers write every step, in shared memory before the DHT forks (see .footprint)
        trim_footprint()  # first: torch's sharing strategy that needs no manager process
        share_parameters([*module.parameters(), *module.buffers()])

    def join(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], training: bool
    ) -> list[torch.optim.Optimizer]:
        """Serve this peer's stage (see :meth:`prepare`), put the proxy in place and return the trainer's
        optimizers (see :meth:`~.steps.TrainerSteps.trainer_optimizers`)."""
        s = self.settings
        assert self.dht is not None, "start_dht() first"
        self.check_stage_count()
        if self.partition is None or self.partition.root is not module:
            self.prepare(module)
        state, partition, stage = self.state, self.partition, self.stage
        assert partition is not None and stage is not None
        mixer = check_chunkable(partition.container, s.microbatches)
        if training and optimizers:  # before the trainer's optimizers lose the pipeline's parameters
            self.host.optimizer_template = OptimizerTemplate(
                optimizers, partition.container, before=partition.original_parameters()
            )
        local_servers = {}
        if self.is_server:
            state.server = self.host.make_server(stage)
            local_servers[stage] = state.server
        # hivemind optimizers fork their averager processes: create them all before this process starts the
        # event-loop thread of its P2P calls (a fork taken while that thread holds a lock can hang the child)
        optimizers = self.steps.trainer_optimizers(optimizers) if training else optimizers
        # this peer keeps only its own stage: the other blocks are freed (see Partition.release)
        partition.release(keep=[stage] if state.server is not None else [])
        if state.server is not None:
            self.host.start_server(state.server)
        release_free_memory()  # the optimizers' set-up drew and freed zero gradients
        client = state.client = SwarmClient(
            self.dht, s, local_servers=local_servers, should_stop=self.should_stop
        )
        client.chunking = mixer is None  # see .chunking: batch statistics need whole batches
        client.stage_epochs = self.steps.stage_epochs  # the stages' epochs at this trainer's last step
        partition.install_proxy(client.call_stage)
        if training and self.drives_stages and self.num_trainers != 1:
            assert self.presence is not None
            state.trainer_sync = TrainerSync(
                self.dht,
                s.run_id,
                self.presence.peer_name,
                self.live_trainers,
                expected=self.num_trainers,
                timeout=s.trainer_timeout,
                should_stop=self.should_stop,
            )  # started when its training starts (see SwarmStrategy.on_train_start): no one waits on it before
            if s.microbatches == "auto":
                # whole calls: the trainers' calls keep the stages' peers busy already, and "auto" chunks by the
                # calls in flight and the peers online, which vary from run to run (see .chunking): a run of
                # several trainers is reproducible, as DDP's is
                client.chunking = False
        self.joined = True
        if self.server is not None and self.server.optimizer is not None and s.rebalance_period > 0:
            self.host.start_rebalancing()
        return optimizers

    def live_trainers(self) -> set[str] | None:
        """The names of the trainers still training, from the presence records (read at most every 0.5 s);
        ``None`` when unknown. A trainer whose record announces another phase (it finished) leaves the set at
        once; one whose record vanished (it died, or its announcements lag on a loaded machine: a record lives
        ``3 * period`` seconds) stays in it for ``VANISHED_GRACE_S`` more seconds, so that a moment's lag does not
        count a live trainer as gone (its step would go on without it, and two trainers could each lead)."""
        read_at, names = self._trainers_read
        now = time.monotonic()
        if now - read_at < 0.5 or self.presence is None:
            return names
        records = self.presence.records()
        if records is not None:
            seen = self._trainers_seen
            for name, (phase, trainer) in records.items():
                if trainer and phase == TRAINING:
                    seen[name] = now
                else:
                    seen.pop(name, None)
            for name in [n for n, at in seen.items() if now - at > VANISHED_GRACE_S]:
                del seen[name]
            names = set(seen)
        self._trainers_read = (now, names)
        return names

    def check_stage_count(self) -> None:
        """Raise a ``ValueError`` if the peers of this run announce another number of stages than this peer's and
        none announces the same (this peer is the misconfigured one); only warn if some do (the others are: a
        single peer announcing a wrong count does not keep everyone out)."""
        assert self.dht is not None
        s = self.settings
        same = 0
        others: dict[int, list[str]] = {}
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
        assert self.dht is not None
        return choose_stage(peer_loads(self.dht, s), s.num_stages)

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
        """End of a run: a peer that serves a stage keeps serving while other trainers still train, put the
        trained pipeline back into the module, then shut everything down. A trainer that serves no stage leaves as
        soon as it has gathered the stages: nobody needs it any more (``lightning-swarm serve`` peers serve on until
        they are stopped). After a failure (this peer's, or another's that arrives meanwhile), restore the container
        and leave at once: shutting down takes at most ``FAILED_SHUTDOWN_S`` seconds."""
        s = self.settings
        if failed:
            try:
                if self.partition is not None and self.joined:
                    self.partition.restore()
            finally:
                self.shutdown(budget=FAILED_SHUTDOWN_S)
            return
        if self.trainer_sync is not None:
            self.trainer_sync.finished = True  # the other trainers' next steps go to another leader
        try:
            self.host.stop_rebalancing()  # no migrations while the run ends and the stages are gathered
            serves = self.server is not None
            all_finished = False
            if self.presence is not None:
                self.presence.set_phase(FINISHED)
                if serves:  # other trainers may still call this peer's stage
                    all_finished = self._linger(FINISHED, s.linger_timeout, "finish training")
            if all_finished and self.server is not None:
                # nobody steps any more: the stage's optimizer state and gradient buffers go before the gather
                self.helpers.report_dead(
                    self._cut_off
                )  # (a dead averager is told of, and skips its shutdown)
                self.server.release_training_state()
            error: BaseException | None = None
            if self.joined and self.partition is not None:
                states: dict[int, dict[str, torch.Tensor]] = {}
                if self.is_trainer and self.gathers_on_end:
                    try:
                        states = self.stage_states.gather_stage_states()
                    except RuntimeError as e:
                        error = e
                self.partition.restore(states)
            if self.presence is not None:
                self.presence.set_phase(DEPARTING)
                if serves:  # the trainers gather this peer's stage before it goes
                    self._linger(DEPARTING, min(60.0, s.linger_timeout), "gather the stages' parameters")
            if error is not None:
                raise error
        except BaseException:
            failed = True  # e.g. another peer's failure, raised while this one lingered
            if self.partition is not None and self.joined:
                self.partition.restore()
            raise
        finally:
            self.shutdown(budget=FAILED_SHUTDOWN_S if failed else None)

    def _linger(self, phase: int, timeout: float, until: str) -> bool:
        """Keep serving until every live trainer has reached ``phase`` (at most ``timeout`` seconds); if that means
        waiting, say so in one line. Returns whether they all did."""
        assert self.presence is not None

        def tell(behind: list[str]) -> None:
            other = "other " if self.is_trainer else ""
            others = f"{len(behind)} {other}trainer(s)" if behind else "the trainers of this run"
            print(
                f"{self.describe()}: still serving stage {self.stage} until {others} {until} "
                f"(at most {timeout:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

        return self.presence.wait_for(
            phase,
            self.local_swarm_size,
            timeout=timeout,
            trainers_only=True,
            should_stop=self.should_stop,
            on_wait=tell,
        )

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

        self.host.stop_rebalancing()
        self.helpers.report_dead(self._cut_off)
        finished = True
        with self.host.lock:
            if self.server is not None:
                server = self.server
                finished = bounded(
                    "the announcement of the departure",
                    lambda: server.drain() if drain else server.set_state(LEAVING),
                    bound(30.0),
                )
        # independent of each other: shut down together, so that a failing peer is quick
        steps = [
            ("the client's shutdown", "client", 15.0, {}),
            ("the trainers' step exchange's shutdown", "trainer_sync", 15.0, {}),
            # after a failure the server cancels its averaging rounds instead of waiting for them
            ("the stage server's shutdown", "server", rounds + 30, {"abort": budget is not None}),
        ]
        running = []
        for what, name, default, kwargs in steps:
            obj = getattr(self.state, name)
            if obj is not None:
                running.append(
                    (what, start_bounded(what, functools.partial(obj.shutdown, **kwargs)), default)
                )
                setattr(self.state, name, None)
        for what, done, default in running:
            finished = wait_bounded(what, done, bound(default)) and finished
        if self.presence is not None:
            self.presence.shutdown()
            self.state.presence = None
        if self.dht is not None:
            if finished:
                bounded("the DHT's shutdown", self.dht.shutdown, bound(15.0))
            self.state.dht = None
        if self._identity is not None:
            unprotect(self._identity.peer_id)
        if self.peer_index == 0 and self.rendezvous_path and os.path.exists(self.rendezvous_path):
            os.remove(self.rendezvous_path)
        self.joined = False
