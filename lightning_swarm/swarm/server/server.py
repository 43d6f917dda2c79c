"""Stage server: one peer's share of one pipeline stage.

A :class:`StageServer` hosts the module of stage ``k`` and serves :class:`~.protocol.StageRequest` s, from
this process (:meth:`StageServer.handle`, through :class:`~.transport.LocalTransport`) or over hivemind's P2P:

- ``forward``: stage inputs -> stage outputs (no grad);
- ``backward``: stage inputs + output gradients -> input gradients. The forward is recomputed with grad (so
  *any* peer of the stage can serve the backward of a microbatch), parameter gradients accumulate here, and
  the stage's ``hivemind.Optimizer`` steps together with the other peers of the stage once the swarm has
  processed ``target_batch_size`` samples.

Mode and randomness: every request carries the trainer's mode and a seed (see :mod:`.protocol`). The stage
module runs in eval mode for an eval call (every submodule ``.eval()``) and in the modes it was built with for
a train call, and its random number generators (CPU, and the CUDA device it runs on) are seeded with the
call's seed for that run and restored afterwards: a recomputed forward draws the dropout masks its forward drew,
on whichever peer. A recompute in train mode leaves the module's buffers as it found them (batch normalisation's
running statistics were updated once, by the forward).

Serving never waits on averaging. Forward and backward run in one compute thread under the *parameters lock*;
a backward's parameter gradients go to a pending buffer, and a separate *stepper* thread feeds that buffer to
the ``hivemind.Optimizer``, which keeps its own copy of the stage's parameters (the *master* copy): its averaging
rounds (up to ``averaging_timeout``) and optimizer steps touch only that copy, and the served parameters are
refreshed from it under the parameters lock afterwards (a copy, well under a millisecond for a typical stage).
Gradients of backwards served during a round count towards the next optimizer step.

Batching (``max_batch_rows`` > 0, the default): calls are served in several threads, the stage running in one of
them at a time, which merges the calls waiting for the stage into one forward or backward when they fit together
(see :mod:`.batching`), falling back to one by one whenever a merged computation cannot be split or committed per
call. Calls of different modes never merge, and train-mode calls of a stage that draws random numbers (dropout)
do not either: a merged run cannot draw each call's own masks (the server learns whether its stage draws from
the runs it serves; a merged train-mode run that drew is discarded and its calls served one by one).

Kept activations (``keep_activations`` > 0, the default): a forward served alone whose request asks for it
(``forward_id``, see :mod:`.protocol`) runs with autograd and its graph is kept, up to ``keep_activations``
forwards (oldest dropped first); its backward, which the trainer sends to the same peer while it lives, reuses
the graph instead of recomputing the forward, unless the served parameters were refreshed in between (the
backward would then differ from the recomputed one); merged calls and every other backward recompute as above.
New parameters from the optimizer wait for the backwards of the forwards kept so far (at most
a few seconds, see :mod:`.stepper`; forwards that arrive meanwhile are not kept), so that a trainer's microbatch in
flight across an optimizer step does not lose its kept forward; the served parameters may lag the optimizer
by that much, as they may anyway while a step runs.

Split backwards (see :mod:`.weight_grads`): a trainer-driven stage after the first whose backward finds its
forward kept replies with the input gradients alone, and computes the parameter gradients after, while no call
waits for the stage; a step takes them first.

At most once: every backward carries a request id; a peer applies each id once (a resent duplicate gets its
input gradients recomputed, but its parameter gradients are dropped), and a backward whose compute ends after
the caller's ``commit_by`` deadline is not applied at all (the caller has retried it on another peer by then).

RPCs: ``rpc_channel`` (a long-lived stream carrying one call after another, see :mod:`.transport`),
``rpc_info`` (stage, throughput, progress) and ``rpc_state`` (the stage's ``state_dict``, for gathering the model).
A server announces a state with its record (see :mod:`.records`): a joining server starts ``"joining"``, loads the
stage's current parameters and optimizer state from a peer already serving it (hivemind's state download, which
picks at random among the peers with the newest epoch, so joiners spread over donors), and only then goes
``"online"``; a server about to stop or move announces ``"leaving"`` first and stops taking calls after trainers
have had time to see it (:meth:`StageServer.drain`). The compute runs in
one background thread, so the event loop keeps answering. Every request gets a reply; a failed one gets an error reply that says why (see
:mod:`.protocol`). Every ``announce_period`` seconds a background thread re-announces the peer in the DHT with
its measured throughput (samples/s of forward + backward, see :mod:`.throughput`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import hivemind
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.utils.timed_storage import get_dht_time
from torch import nn

from lightning_swarm.swarm.dht.auth import is_protected
from lightning_swarm.swarm.dht.presence import dht_alive
from lightning_swarm.swarm.dht.reachability import relay_addrs_of
from lightning_swarm.swarm.dht.records import declare_stage_peer, get_stage_peers
from lightning_swarm.swarm.lifetime import settle_dead_helpers
from lightning_swarm.swarm.loop import replicate_p2p, run_coroutine
from lightning_swarm.swarm.server.compute import module_device, running_stats
from lightning_swarm.swarm.server.connection_handler import ConnectionHandler
from lightning_swarm.swarm.server.shared import KeptForwards, SharedState
from lightning_swarm.swarm.server.stage_backend import StageBackend
from lightning_swarm.swarm.server.stepper import EPOCH_POLL_S, Stepper
from lightning_swarm.swarm.settings import SwarmSettings
from lightning_swarm.swarm.states import JOINING, LEAVING, ONLINE, STATES
from lightning_swarm.swarm.throughput import Throughput
from lightning_swarm.swarm.training.optimizers import OptimizerFactory
from lightning_swarm.swarm.training.stepping import StepCommand
from lightning_swarm.swarm.wire.guards import BadPeers
from lightning_swarm.swarm.wire.protocol import (
    MAX_REQUEST_BYTES,
    StageReply,
    StageRequest,
    stage_uid,
    warm_up_codec,
)
from lightning_swarm.swarm.wire.same_host import SameHostListener, socket_path

_SERVING_THREADS = 16  # with batching: calls being parsed, waiting for the compute thread or encoding at once


__all__ = ["StageServer"]

logger = logging.getLogger(__name__)


class StageServer:
    """Serves one stage of a SWARM pipeline to the trainers of a swarm.

    A server owns three parts, each with its own job, and hands them the state they share (a
    :class:`~.shared.SharedState`: the parameters and their lock, the pending gradients, the optimizer):

    - :attr:`backend` (:class:`~.stage_backend.StageBackend`): the compute: calls served alone or merged, kept
      forwards, at-most-once backwards;
    - :attr:`stepper` (:class:`~.stepper.Stepper`): the optimizer, its thread and trainer-driven steps;
    - :attr:`handler` (:class:`~.connection_handler.ConnectionHandler`): the RPCs, per-peer caps and bans.

    The server itself starts and stops them, announces the peer in the DHT and answers for the stage as a whole
    (its info, state, steps and optimizer state). Subclasses may set :attr:`backend_class` or
    :attr:`stepper_class` to serve or step differently.

    Args:
        stage: the stage index.
        module: the stage's blocks; ``module(*args, **kwargs)`` returns a tensor or a nested tuple/list/dict
            of tensors.
        dht: this peer's running hivemind DHT.
        settings: the swarm's settings (run id, compression of replies, target batch size, timeouts).
        optimizer_factory: builds the torch optimizer from ``param_groups``, e.g.
            ``lambda groups: torch.optim.AdamW(groups, lr=1e-4)``. ``None`` serves the stage without training
            it (backward still returns input gradients; parameter gradients are discarded).
        param_groups: the optimizer's parameter groups (dicts with ``"params"`` and per-group hyper-parameters);
            ``None``: one group with every parameter of ``module`` that requires grad.
        throughput: samples/s of forward + backward announced until measured; ``None`` estimates it.
        max_request_bytes: the decoded tensors of one request (inputs plus output gradients) may take this many
            bytes; larger requests are refused before they are allocated.
        bad_peers: which remote peers are ignored for sending bad requests (default: 20 bad requests within 60 s
            get a peer ignored for 60 s).
        check_schema: refuse requests whose tensors fit none of the input schemas learned from the calls served
            so far (count, dtype, dimensions and last dimension of each tensor; see
            :class:`~.protocol.StageSchemas`). Turn off for a stage whose tensors' last dimension varies from call
            to call (e.g. masks over sequences of varying length).
    """

    backend_class: type[StageBackend] = StageBackend
    stepper_class: type[Stepper] = Stepper

    def __init__(
        self,
        stage: int,
        module: nn.Module,
        *,
        dht: hivemind.DHT,
        settings: SwarmSettings,
        optimizer_factory: OptimizerFactory | None,
        param_groups: list[dict[str, Any]] | None = None,
        throughput: float | None = None,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        bad_peers: BadPeers | None = None,
        check_schema: bool = True,
    ):
        if stage < 0:
            raise ValueError(f"StageServer: stage must be >= 0, got {stage}")
        self.stage, self.module, self.dht, self.settings = stage, module, dht, settings
        self.optimizer_factory, self.param_groups = optimizer_factory, param_groups
        self.uid = stage_uid(settings.run_id, stage)
        if throughput is None:
            from lightning_swarm.swarm.throughput import estimate_throughput

            throughput = estimate_throughput(module, self.device)
        self.throughput = Throughput(throughput)
        self.state = ONLINE
        self.shared = SharedState(kept=KeptForwards(settings.keep_activations))
        self.stepper = self.stepper_class(stage, dht, settings, self.shared)
        self.backend = self.backend_class(
            stage,
            module,
            settings,
            self.shared,
            self.throughput,
            self.stepper.catch_up_for_call,
            check_schema=check_schema,
        )
        self.handler = ConnectionHandler(
            self, BadPeers() if bad_peers is None else bad_peers, max_request_bytes
        )
        self.p2p: P2P | None = None
        self._same_host: SameHostListener | None = None  # see ..same_host
        self._dht_gone_reported = False
        self._helper_gone = False  # a helper process of the stage's optimizer died (see _watch_helpers)
        self._stop = threading.Event()
        self._announcer: threading.Thread | None = None
        self._started = False

    @property
    def device(self) -> torch.device:
        """Where the stage module lives (inputs are moved there)."""
        return module_device(self.module)

    @property
    def peer_id(self) -> PeerID:
        """The libp2p id of this peer (shared with its DHT)."""
        return self.dht.peer_id

    @property
    def optimizer(self) -> hivemind.Optimizer | None:
        """The stage's optimizer; ``None`` if this server does not train its stage (or the run is over)."""
        return self.shared.optimizer

    # ---- lifecycle ----

    def start(self, joining: bool = False) -> StageServer:
        """Create the optimizer, register the RPC handlers and start announcing; returns ``self``.

        With ``joining``, the server announces itself as ``"joining"`` (trainers do not call it yet, and other
        joiners do not download their state from it) until :meth:`set_state` puts it online, usually after
        :meth:`load_state_from_peers`.
        """
        if self._started:
            return self
        s = self.settings
        self.state = JOINING if joining else ONLINE
        groups = self.param_groups
        if groups is None:
            groups = [{"params": [p for p in self.module.parameters() if p.requires_grad]}]
        self.shared.running_stats = running_stats(self.module)
        self.stepper.create_optimizer(groups, self.optimizer_factory, joining)
        warm_up_codec(s.compression)  # before this peer is announced: its first reply must not wait for it
        # batching: calls are served in several threads (the stage runs in one of them at a time)
        if self.backend.start():
            executor = ThreadPoolExecutor(
                max_workers=_SERVING_THREADS, thread_name_prefix=f"stage{self.stage}-serve"
            )
        else:
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{self.stage}-compute")
        self.p2p = run_coroutine(self._start_p2p(), timeout=60)
        self._stop.clear()
        self._started = True
        self.handler.executor = executor
        self.backend.accepting = True
        self.stepper.start()
        self._announce()
        self._announcer = threading.Thread(
            target=self._announce_loop, name=f"stage{self.stage}-announce", daemon=True
        )
        self._announcer.start()
        return self

    async def _start_p2p(self) -> P2P:
        p2p = await replicate_p2p(self.dht)
        await self.handler.add_p2p_handlers(p2p, namespace=self.uid)
        if self.settings.same_host and not is_protected(self.peer_id):
            path = socket_path(self.peer_id, self.uid)
            if path is not None:
                listener = SameHostListener(path, self.handler.rpc_channel, self.handler.max_message_bytes)
                try:
                    await listener.start()
                    self._same_host = listener
                except OSError as e:  # callers on this machine use P2P, as callers elsewhere do
                    logger.info(f"Stage {self.stage}: no same-host socket ({e!r}); calls go over P2P")
        self.stepper.same_host = self._same_host is not None
        return p2p

    def shutdown(self, abort: bool = False) -> None:
        """Stop announcing and serving and shut the optimizer down (idempotent). With ``abort`` (the run failed),
        an averaging round in progress is cancelled rather than waited for."""
        if not self._started:
            return
        self._started = False
        self.backend.accepting = False
        executor, self.handler.executor = self.handler.executor, None
        self._stop.set()
        self.stepper.stop(abort)
        if self._announcer is not None:
            self._announcer.join(timeout=5)
        if self.p2p is not None:
            p2p, self.p2p = self.p2p, None
            try:
                run_coroutine(self._stop_p2p(p2p), timeout=10)
            except Exception as e:
                logger.debug(f"Stage {self.stage} server: error while removing handlers: {e!r}")
        if executor is not None:
            executor.shutdown(wait=True)
        self.backend.close()
        self.stepper.close()

    def release_training_state(self) -> None:
        """The run is over (every trainer finished): shut the stage's optimizer down, freeing its state, its
        averagers' buffers and any pending gradients. The stage's parameters, as trained, stay served (for the
        trainers' end-of-run gather); steps are no longer taken (idempotent)."""
        self.stepper.release()

    async def _stop_p2p(self, p2p: P2P) -> None:
        listener, self._same_host = self._same_host, None
        if listener is not None:
            await listener.stop()
        try:
            await self.handler.remove_p2p_handlers(p2p, namespace=self.uid)
        finally:
            await p2p.shutdown()

    def load_state_from_peers(self) -> bool:
        """Download the stage's current parameters and optimizer state (and epoch) from a peer already serving
        the stage, in place; returns whether a peer sent it. A server that does not train the stage (no
        optimizer) has nothing to load this way and returns ``False``."""
        return self.stepper.load_state_from_peers()

    def set_state(self, state: str) -> None:
        """Announce ``state`` (``"joining"``, ``"online"`` or ``"leaving"``) now; an online server offers its
        state to joiners, a leaving one no longer does."""
        if state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {state!r}")
        self.state = state
        if self.optimizer is not None:
            self.optimizer.state_averager.allow_state_sharing = state == ONLINE
        self._announce()

    def drain(self, grace: float | None = None) -> None:
        """Leave gracefully: announce ``"leaving"``, keep serving for ``grace`` seconds (default: two of the
        trainers' DHT refresh periods, so they route new calls elsewhere), then refuse new calls and wait for the
        one in flight. :meth:`shutdown` follows."""
        if not self._started:
            return
        self.set_state(LEAVING)
        grace = 2 * self.settings.refresh_period if grace is None else grace
        self._stop.wait(grace)
        self.backend.accepting = False
        with self.shared.lock:  # the call in flight, if any, finishes first
            pass

    # ---- the stage as a whole ----

    def handle(self, request: StageRequest) -> StageReply:
        """Serve one request, from this process (see :class:`~.transport.LocalTransport`) or received over P2P;
        never raises: failures become error replies (see :mod:`.protocol`)."""
        return self.backend.handle(request)

    def info(self) -> dict[str, Any]:
        """Stage, throughput (samples/s of forward + backward), samples processed, optimizer epoch and steps,
        averaging rounds (and, of the swarm-driven ones, the sum of their group sizes), and backwards whose parameter
        gradients came after the reply (:mod:`.weight_grads`)."""
        opt = self.optimizer
        weights = self.shared.weights
        return {
            "stage": self.stage,
            "throughput": self.throughput.value,
            "samples_processed": self.backend.samples_processed,
            "epoch": int(opt.local_epoch if opt is not None else 0),
            "steps": self.stepper.steps,
            "averaged_rounds": self.stepper.averaged_rounds + getattr(opt, "rounds", 0),
            "round_peers": self.stepper.round_peers + getattr(opt, "round_peers", 0),
            "split_backwards": 0 if weights is None else weights.deferred,
        }

    def state_dict_local(self) -> dict[str, torch.Tensor]:
        """A detached CPU copy of the stage module's ``state_dict``, including every backward received so far
        (see :meth:`flush`)."""
        self.flush()
        with self.shared.lock:
            return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the gradients received so far have been handed to the optimizer (and a step they
        triggered has been taken), at most ``timeout`` seconds (default: one averaging round)."""
        self.stepper.flush(timeout)

    def step_command(self, command: StepCommand) -> dict[str, Any]:
        """Run one phase of a trainer's step command (see :meth:`.stepper.Stepper.step_command`)."""
        return self.stepper.step_command(command)

    def optimizer_state(self) -> bytes:
        """The stage optimizer's state, for a trainer's checkpoint (see :meth:`.stepper.Stepper.optimizer_state`)."""
        return self.stepper.optimizer_state()

    def load_optimizer_state(self, data: bytes) -> None:
        """Restore the stage optimizer's state from :meth:`optimizer_state`'s bytes (a resumed run)."""
        self.stepper.load_optimizer_state(data)

    # ---- announcing ----

    def _announce(self) -> None:
        # the DHT's helper process is gone (e.g. killed with the process group): there is nobody to tell
        if not dht_alive(self.dht):
            if not self._dht_gone_reported:
                self._dht_gone_reported = True
                logger.warning(
                    f"Stage {self.stage} server: this peer's DHT process has stopped; not announcing"
                )
            return
        try:
            declare_stage_peer(
                self.dht,
                self.settings.run_id,
                self.stage,
                self.peer_id,
                self.throughput.value,
                get_dht_time() + self.settings.expiration,
                state=self.state,
                num_stages=self.settings.num_stages,
                measured=self.throughput.measured,
                figure_time=self.throughput.at,
                relay_addrs=relay_addrs_of(self.dht),
            )
        except Exception as e:
            logger.warning(f"Stage {self.stage} server could not announce itself in the DHT: {e!r}")

    def _watch_helpers(self) -> None:
        """Within a poll period of a helper process of the stage's optimizer dying (an averager killed, say), say so
        once and act: a stage that other peers serve is left cleanly (announced, calls drained, the optimizer shut
        down; the peer trains on, and its run ends as any other); a stage that only this peer serves is served on
        without the helper (its steps need no other peer)."""
        found = None if self._helper_gone else self.stepper.dead_helper()
        if found is None:
            return
        self._helper_gone = True
        name, helper = found
        what = f"stage {self.stage} {name}"
        settled = settle_dead_helpers([(what, helper)])  # hivemind's shutdown of it is skipped from now on
        what = settled[0] if settled else f"{what} (a thread)"
        others = []
        try:  # (a DHT that is gone too leaves nobody to hand the stage to)
            if dht_alive(self.dht):
                peers = get_stage_peers(self.dht, self.settings.run_id, self.stage)
                others = [p for p in peers if p.peer_id != self.peer_id]
        except Exception as e:
            logger.debug(f"Stage {self.stage} server: could not list the stage's peers: {e!r}")
        if not others:
            self.stepper.failed = None
            logger.warning(
                f"Stage {self.stage} server: hivemind helper process {what} died during the run; no other peer "
                "serves the stage, so this peer serves it on without it"
            )
            return
        logger.warning(
            f"Stage {self.stage} server: hivemind helper process {what} died during the run; this peer leaves the "
            f"stage to its {len(others)} other peer(s) and trains on"
        )
        self.stepper.failed = f"its {name} died"
        self.drain()
        self.stepper.release()

    def _announce_loop(self) -> None:
        next_announce = time.monotonic() + self.settings.announce_period
        while not self._stop.wait(EPOCH_POLL_S):
            self._watch_helpers()
            if time.monotonic() >= next_announce:
                self._announce()
                next_announce = time.monotonic() + self.settings.announce_period
