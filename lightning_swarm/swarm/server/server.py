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
``_REFRESH_DEFER_S`` seconds; forwards that arrive meanwhile are not kept), so that a trainer's microbatch in
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

import collections
import functools
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import hivemind
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.utils.timed_storage import get_dht_time
from torch import nn

from lightning_swarm.swarm.dht.auth import is_protected
from lightning_swarm.swarm.dht.records import declare_stage_peer
from lightning_swarm.swarm.footprint import before_fork, release_free_memory, zero_grad_view
from lightning_swarm.swarm.loop import replicate_p2p, run_coroutine
from lightning_swarm.swarm.server.applied import AppliedRequests
from lightning_swarm.swarm.server.batching import RequestBatcher, mixes_rows
from lightning_swarm.swarm.server.compute import Kept
from lightning_swarm.swarm.server.connection_handler import ConnectionHandler
from lightning_swarm.swarm.server.stage_backend import StageBackend
from lightning_swarm.swarm.server.stepper import _EPOCH_POLL_S, Stepper
from lightning_swarm.swarm.server.weight_grads import DeferredWeights, split_enabled
from lightning_swarm.swarm.settings import SwarmSettings
from lightning_swarm.swarm.states import JOINING, LEAVING, ONLINE, STATES
from lightning_swarm.swarm.throughput import Throughput
from lightning_swarm.swarm.training.averaging import _GradientAverager, _StateAverager
from lightning_swarm.swarm.training.optimizers import OptimizerFactory, _make_initialized, _StageOptimizer
from lightning_swarm.swarm.wire.guards import BadPeers, StageSchemas
from lightning_swarm.swarm.wire.protocol import (
    MAX_REQUEST_BYTES,
    StageService,
    stage_uid,
    warm_up_codec,
)
from lightning_swarm.swarm.wire.same_host import SameHostListener, socket_path

_SERVING_THREADS = 16  # with batching: calls being parsed, waiting for the compute thread or encoding at once


__all__ = ["StageServer"]

logger = logging.getLogger(__name__)


def _dht_alive(dht: Any) -> bool:
    try:
        return bool(dht.is_alive())
    except (AssertionError, AttributeError):  # a DHT this process did not start: assume it lives
        return True


class StageServer(ConnectionHandler, StageBackend, Stepper, StageService):
    """Serves one stage of a SWARM pipeline to the trainers of a swarm.

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
        self.samples_processed = 0
        self.optimizer: hivemind.Optimizer | None = None
        self.p2p: P2P | None = None
        self._same_host: SameHostListener | None = None  # see ..same_host
        self._dht_gone_reported = False
        self._lock = threading.Lock()  # the parameters lock: compute reads them, refreshes write them
        self._executor: ThreadPoolExecutor | None = None
        self._stop = threading.Event()
        self._announcer: threading.Thread | None = None
        self._started = False
        # trained parameters (served) and the optimizer's copy of them; pending gradients of served backwards
        self._trained: list[nn.Parameter] = []
        self._master: list[nn.Parameter] = []
        self._shared_master = False  # whether the optimizer steps the served parameters themselves
        self._grads_lock = threading.Lock()
        self._pending: list[torch.Tensor | None] | None = None
        self._pending_samples = 0
        self._pending_backwards = 0  # how many backwards the pending gradients sum (see _GradientAverager)
        self._stepper: threading.Thread | None = None
        self._step_lock = threading.Lock()  # held by the stepper while it runs the optimizer
        self._wake = threading.Event()
        self._applied = AppliedRequests()
        self.max_request_bytes = max_request_bytes
        self.bad_peers = BadPeers() if bad_peers is None else bad_peers
        # what the stage's calls look like, learned from the ones it served
        self.schemas = StageSchemas(max_schemas=4 if check_schema else 0)
        self._calls_by_peer: dict[PeerID, int] = {}
        self.dropped_contributions = 0  # backwards whose parameter gradients were not finite
        self.state = ONLINE
        self._accepting = True
        self._batcher: RequestBatcher | None = None
        self.requests_served = 0  # forward and backward requests handed to the stage (batched or not)
        # forwards kept for their backward, by forward id (oldest first); the served parameters' version
        self._kept: OrderedDict[int, Kept] = OrderedDict()
        self._kept_lock = threading.Lock()
        self._param_version = 0
        self.kept_hits = 0  # backwards that reused a kept forward
        self._forward_s_per_row: float | None = None  # measured (see StageBackend._merge_key)
        self._refresh_pending_since: float | None = None  # new parameters wait for kept forwards' backwards
        self._master_versions: tuple[int, ...] | None = None  # see Stepper._refresh_parameters
        self._kept_in_use = 0  # kept forwards taken by a backward that has not finished yet
        # runs of the stage module for them (a merged group runs it once); counted under the parameters lock
        self.computations = 0
        # (kind, start, end) of the stage's latest computations, on the monotonic clock (shared by the processes
        # of one machine): when this server's stage was busy
        self.compute_log: collections.deque[tuple[str, float, float]] = collections.deque(maxlen=1024)
        # trainer-driven steps (settings.stage_steps == "trainer", see .stepping): the trainer's group of each
        # of this stage's optimizer groups, the prepared gradients of the step in progress, the ids applied
        self.driven = settings.stage_steps == "trainer"
        self._group_sources: list[
            tuple[int, int]
        ] = []  # (trainer optimizer, group) per stage optimizer group
        # the step in progress: (step id, own gradients, their indices, (summed gradients, facts) or None)
        self._prepared: tuple[int, list[torch.Tensor | None], list[int], Any, Any] | None = None
        self._steps_applied: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self.steps = 0  # optimizer steps this server took (trainer-driven or swarm-driven)
        # the last trainer epoch a call made this peer catch up to (see Stepper.catch_up_for_call)
        self._caught_up_to = 0
        self.averaged_rounds = 0  # steps whose gradients were summed with other peers of the stage
        self.same_host_rounds = 0  # of which through shared memory (see ..same_host_sum)
        # the modes the module was built with (a train call runs in them; an eval call in eval), the mode it is in
        self._built_modes = [(m, m.training) for m in module.modules()]
        self._training = True
        self.draws_rng = False  # whether a train-mode run of the stage drew random numbers (learned, sticky)
        # a trainer-driven stage after the first replies to a backward before its parameter gradients (.weight_grads)
        self._weights: DeferredWeights | None = None
        if self.driven and stage > 0 and split_enabled():
            waiting = lambda: 0 if self._batcher is None else self._batcher.pending()  # noqa: E731
            log = lambda *entry: self.compute_log.append(entry)  # noqa: E731
            most = max(settings.keep_activations, 1)
            self._weights = DeferredWeights(self._lock, waiting, f"stage{stage}-weights", most, log)

    @property
    def device(self) -> torch.device:
        """Where the stage module lives (inputs are moved there)."""
        for tensor in self.module.parameters():
            return tensor.device
        for tensor in self.module.buffers():
            return tensor.device
        return torch.device("cpu")

    @property
    def peer_id(self) -> PeerID:
        """The libp2p id of this peer (shared with its DHT)."""
        return self.dht.peer_id

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
        self._accepting = True
        groups = self.param_groups
        if groups is None:
            groups = [{"params": [p for p in self.module.parameters() if p.requires_grad]}]
        groups = [g for g in groups if g["params"]]
        self._group_sources = [
            (int(g.get("swarm_optimizer", 0)), int(g.get("swarm_group", i))) for i, g in enumerate(groups)
        ]
        groups = [{k: v for k, v in g.items() if k not in ("swarm_optimizer", "swarm_group")} for g in groups]
        if groups and self.optimizer_factory is not None:
            before_fork()  # hivemind forks its averagers below
            request_timeout = max(0.2, s.matchmaking_time / 3)
            self._trained = [p for g in groups for p in g["params"]]
            # trainer-driven steps on the CPU: the optimizer steps the served parameters themselves, with serving
            # paused (see _writing_served); its state averager and gradient averager reuse them (no copies)
            self._shared_master = self.driven and all(p.device.type == "cpu" for p in self._trained)
            if self._shared_master:
                self._master = list(self._trained)
            else:
                self._master = [nn.Parameter(p.detach().clone(), requires_grad=True) for p in self._trained]
            for master in self._master:  # else hivemind's gradient averager allocates zero gradients to copy
                master.grad = zero_grad_view(master)
            master_of = {id(p): m for p, m in zip(self._trained, self._master, strict=True)}
            groups = [{**g, "params": [master_of[id(p)] for p in g["params"]]} for g in groups]
            self.optimizer = _StageOptimizer(
                dht=self.dht,
                run_id=f"{s.run_id}_stage{self.stage}",  # hivemind forbids '.' in optimizer run ids
                target_batch_size=s.target_batch_size,
                batch_size_per_step=None,
                optimizer=functools.partial(_make_initialized, self.optimizer_factory),
                params=groups,
                offload_optimizer=False,  # the master copy is already apart from the served parameters
                # driven: hivemind's local gradient accumulators are never used (the commands carry the step), and
                # the state averager averages no parameters (it only serves downloads): no copies for either
                reuse_grad_buffers=self.driven,
                reuse_state_tensors=self._shared_master or None,
                matchmaking_time=s.matchmaking_time,
                averaging_timeout=s.averaging_timeout,
                # hivemind's default (matchmaking_time) gives up a state download whose next chunk is half a second
                # late on a loaded host; a stalled sender of an all-reduce is still dropped within averaging_timeout
                next_chunk_timeout=max(s.matchmaking_time, min(s.request_timeout, s.averaging_timeout)),
                # hivemind warns (and may deadlock) unless requests time out before matchmaking ends; the optimizer
                # state is initialized without moving the parameters (see initialize_optimizer_state)
                averager_opts={
                    "request_timeout": request_timeout,
                    "initialize_optimizer": False,
                    "allow_state_sharing": not joining,  # a joiner's state is not worth downloading
                },
                grad_averager_factory=functools.partial(
                    _GradientAverager, request_timeout=request_timeout, allow_state_sharing=False
                ),  # joiners download the state averager's state; a gradient buffer is not worth a download
                verbose=False,
            )
            for master in self._master:  # hivemind made zero gradients; each step hands its own over
                master.grad = None
        warm_up_codec(s.compression)  # before this peer is announced: its first reply must not wait for it
        batching = s.max_batch_rows > 0 and not mixes_rows(self.module)
        if s.max_batch_rows > 0 and not batching:
            logger.info(
                f"Stage {self.stage}: batch normalisation mixes the rows of a batch; calls are not merged"
            )
        # batching: calls are served in several threads (the stage runs in one of them at a time)
        if batching:
            self._batcher = RequestBatcher(
                self._serve_group,
                max_rows=s.max_batch_rows,
                wait_s=s.batch_wait_ms / 1000,
                key=self._merge_key,
            )
            self._executor = ThreadPoolExecutor(
                max_workers=_SERVING_THREADS, thread_name_prefix=f"stage{self.stage}-serve"
            )
        else:
            self._executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"stage{self.stage}-compute"
            )
        self.p2p = run_coroutine(self._start_p2p(), timeout=60)
        self._stop.clear()
        self._started = True
        if self.optimizer is not None and not self.driven:  # driven: the trainer's step commands step
            self._stepper = threading.Thread(
                target=self._step_loop, name=f"stage{self.stage}-step", daemon=True
            )
            self._stepper.start()
        self._announce()
        self._announcer = threading.Thread(
            target=self._announce_loop, name=f"stage{self.stage}-announce", daemon=True
        )
        self._announcer.start()
        return self

    async def _start_p2p(self) -> P2P:
        p2p = await replicate_p2p(self.dht)
        await self.add_p2p_handlers(p2p, namespace=self.uid)
        if self.settings.same_host and not is_protected(self.peer_id):
            path = socket_path(self.peer_id, self.uid)
            if path is not None:
                listener = SameHostListener(path, self.rpc_channel, self.max_message_bytes)
                try:
                    await listener.start()
                    self._same_host = listener
                except OSError as e:  # callers on this machine use P2P, as callers elsewhere do
                    logger.info(f"Stage {self.stage}: no same-host socket ({e!r}); calls go over P2P")
        return p2p

    def shutdown(self, abort: bool = False) -> None:
        """Stop announcing and serving and shut the optimizer down (idempotent). With ``abort`` (the run failed),
        an averaging round in progress is cancelled rather than waited for."""
        if not self._started:
            return
        self._started = False
        self._stop.set()
        self._wake.set()
        if abort and hasattr(self.optimizer, "abort"):
            self.optimizer.abort()
        if self._announcer is not None:
            self._announcer.join(timeout=5)
        if self._stepper is not None:  # a round in progress ends within averaging_timeout; do not wait longer
            rounds = self.settings.averaging_timeout + self.settings.matchmaking_time
            self._stepper.join(timeout=min(rounds, 1.0) if abort else rounds)
        if self.p2p is not None:
            p2p, self.p2p = self.p2p, None
            try:
                run_coroutine(self._stop_p2p(p2p), timeout=10)
            except Exception as e:
                logger.debug(f"Stage {self.stage} server: error while removing handlers: {e!r}")
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        with self._lock:  # the stage's blocks may be the trainer's own (put back when the run ends): as built
            self._set_mode(True)
        if self._weights is not None:
            self._weights.close()
        with self._kept_lock:
            self._kept.clear()
        if self._batcher is not None:
            batcher, self._batcher = self._batcher, None
            batcher.close()
        if self.optimizer is not None:
            try:
                self.optimizer.shutdown()
            except Exception as e:
                logger.warning(f"Stage {self.stage} server: error while shutting down the optimizer: {e!r}")

    def release_training_state(self) -> None:
        """The run is over (every trainer finished): shut the stage's optimizer down, freeing its state, its
        averagers' buffers and any pending gradients. The stage's parameters, as trained, stay served (for the
        trainers' end-of-run gather); steps are no longer taken (idempotent)."""
        self.flush()
        with self._step_lock:
            opt, self.optimizer = self.optimizer, None
            if opt is not None and not self._shared_master:
                self._refresh_parameters()  # the steps taken so far are served, then the copies go
                self._master = []
            with self._grads_lock:
                self._pending, self._pending_samples, self._pending_backwards = None, 0, 0
            self._prepared = None
        if opt is not None:
            try:
                opt.shutdown(run_over=True)
            except Exception as e:
                logger.warning(f"Stage {self.stage} server: error while shutting down the optimizer: {e!r}")
            del opt
            release_free_memory()

    async def _stop_p2p(self, p2p: P2P) -> None:
        listener, self._same_host = self._same_host, None
        if listener is not None:
            await listener.stop()
        try:
            await self.remove_p2p_handlers(p2p, namespace=self.uid)
        finally:
            await p2p.shutdown()

    def load_state_from_peers(self) -> bool:
        """Download the stage's current parameters and optimizer state (and epoch) from a peer already serving
        the stage, in place; returns whether a peer sent it. A server that does not train the stage (no
        optimizer) has nothing to load this way and returns ``False``."""
        opt = self.optimizer
        if opt is None:
            return False
        averager = opt.state_averager
        assert isinstance(averager, _StateAverager)
        with self._step_lock:  # the stepper is not running the optimizer while its state is replaced
            averager.loaded = False
            opt.load_state_from_peers()
            self._refresh_parameters()
            return averager.loaded

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
        self._accepting = False
        with self._lock:  # the call in flight, if any, finishes first
            pass

    def _announce(self) -> None:
        # the DHT's helper process is gone (e.g. killed with the process group): there is nobody to tell
        if not _dht_alive(self.dht):
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
            )
        except Exception as e:
            logger.warning(f"Stage {self.stage} server could not announce itself in the DHT: {e!r}")

    def _announce_loop(self) -> None:
        next_announce = time.monotonic() + self.settings.announce_period
        while not self._stop.wait(_EPOCH_POLL_S):
            if time.monotonic() >= next_announce:
                self._announce()
                next_announce = time.monotonic() + self.settings.announce_period
