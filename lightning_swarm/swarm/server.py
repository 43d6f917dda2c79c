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

import asyncio
import contextlib
import functools
import io
import itertools
import logging
import math
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind detects stream handlers by typing.AsyncIterator)

import hivemind
import msgpack
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.partition import BannedException, TensorPartReducer
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import as_aiter, azip
from hivemind.utils.timed_storage import get_dht_time
from torch import nn

from ._loop import replicate_p2p, run_coroutine
from .batching import RequestBatcher, concat_payloads, merge_key, mixes_rows, split_payload
from .codec import CodecError, TooLarge, all_finite, check_encodable
from .errors import COMPUTE, REQUEST, UNAVAILABLE, BadRequest, ErrorReply, Misrouted
from .footprint import release_free_memory, share_optimizer_state, zero_grad_view
from .guards import BadPeers, StageSchemas, check_finite, check_grad_outputs, check_outputs
from .payload import Payload
from .protocol import (
    MAX_MESSAGE_BYTES,
    MAX_REQUEST_BYTES,
    MAX_REQUEST_MESSAGES,
    MAX_REQUEST_TENSORS,
    StageReply,
    StageRequest,
    StageService,
    encode_reply_header,
    parse_request,
    stage_uid,
    warm_up_codec,
)
from .records import declare_stage_peer
from .settings import SwarmSettings
from .states import JOINING, LEAVING, ONLINE, STATES
from .stepping import StepCommand, parse_command
from .throughput import Throughput
from .transport import MESSAGE_BYTES, SPLIT_ABOVE, MessageReceiver, messages

__all__ = ["StageServer"]

logger = logging.getLogger(__name__)

MAX_STEP_ATTEMPTS = 3  # averaging rounds a trainer-driven step tries before a peer steps on its own gradients
_EPOCH_POLL_S = 0.25  # how often an idle server checks whether its stage is ready to step
_REFRESH_DEFER_S = 5.0  # how long kept forwards may hold back new parameters (their backwards come first)
_KEPT_MAX_AGE_S = 120.0  # a kept forward whose backward has not come by then is dropped
_APPLIED_TTL_S = 600.0  # how long a peer remembers the id of a backward it applied
_APPLIED_MAX = 100_000  # ... and how many ids at most (16 bytes each, plus the dict's overhead)
_MAX_CALLS_PER_PEER = 32  # calls of one remote peer being received or served at once (a trainer's threads)
_SERVING_THREADS = 16  # with batching: calls being parsed, waiting for the compute thread or encoding at once
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


class _ComputeError(Exception):
    """The stage's own code raised ``error`` (wrapped so that it is told apart from the server's errors)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class StageServer(StageService):
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
            from .throughput import estimate_throughput

            throughput = estimate_throughput(module, self.device)
        self.throughput = Throughput(throughput)
        self.samples_processed = 0
        self.optimizer: hivemind.Optimizer | None = None
        self.p2p: P2P | None = None
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
        self._kept: OrderedDict[int, _Kept] = OrderedDict()
        self._kept_lock = threading.Lock()
        self._param_version = 0
        self.kept_hits = 0  # backwards that reused a kept forward
        self._refresh_pending_since: float | None = None  # new parameters wait for kept forwards' backwards
        self._kept_in_use = 0  # kept forwards taken by a backward that has not finished yet
        # runs of the stage module for them (a merged group runs it once); counted under the parameters lock
        self.computations = 0
        # trainer-driven steps (settings.stage_steps == "trainer", see .stepping): the trainer's group of each
        # of this stage's optimizer groups, the prepared gradients of the step in progress, the ids applied
        self.driven = settings.stage_steps == "trainer"
        self._group_sources: list[
            tuple[int, int]
        ] = []  # (trainer optimizer, group) per stage optimizer group
        # the step in progress: (step id, own gradients, their indices, (summed gradients, facts) or None)
        self._prepared: tuple[int, list[torch.Tensor | None], list[int], Any, int] | None = None
        self._steps_applied: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self.steps = 0  # optimizer steps this server took (trainer-driven or swarm-driven)
        self.averaged_rounds = 0  # steps whose gradients were summed with other peers of the stage
        # the modes the module was built with (a train call runs in them; an eval call in eval), the mode it is in
        self._built_modes = [(m, m.training) for m in module.modules()]
        self._training = True
        self.draws_rng = False  # whether a train-mode run of the stage drew random numbers (learned, sticky)

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
            release_free_memory()  # hivemind forks its averagers below: pages freed but resident would be copied
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
        return p2p

    def shutdown(self) -> None:
        """Stop announcing and serving and shut the optimizer down (idempotent)."""
        if not self._started:
            return
        self._started = False
        self._stop.set()
        self._wake.set()
        if self._announcer is not None:
            self._announcer.join(timeout=5)
        if self._stepper is not None:  # a round in progress ends within averaging_timeout; do not wait longer
            self._stepper.join(timeout=self.settings.averaging_timeout + self.settings.matchmaking_time)
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

    async def _stop_p2p(self, p2p: P2P) -> None:
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
            )
        except Exception as e:
            logger.warning(f"Stage {self.stage} server could not announce itself in the DHT: {e!r}")

    def _announce_loop(self) -> None:
        next_announce = time.monotonic() + self.settings.announce_period
        while not self._stop.wait(_EPOCH_POLL_S):
            if time.monotonic() >= next_announce:
                self._announce()
                next_announce = time.monotonic() + self.settings.announce_period

    # ---- the stepper: the optimizer, off the serving path ----

    def _step_loop(self) -> None:
        """Feed pending gradients to the optimizer and take part in the stage's averaging rounds."""
        while not self._stop.is_set():
            self._wake.wait(_EPOCH_POLL_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.step_pending()
                if self._refresh_pending_since is not None:
                    with self._step_lock:
                        self._refresh_parameters(defer=True)
            except Exception as e:  # a failed round must not end the stepper; the next one may succeed
                logger.error(f"Stage {self.stage}: optimizer step failed: {e!r}; its gradients were dropped")

    def step_pending(self) -> bool:
        """Hand the gradients of the backwards served so far to the optimizer (one ``step``); returns whether it
        stepped. Also joins the stage's averaging round when the swarm has collected the target batch even if
        no backward arrived here (otherwise the stage's other peers would wait for this one in matchmaking)."""
        opt = self.optimizer
        if opt is None:
            return False
        with self._step_lock:
            with self._grads_lock:
                grads, samples, backwards = self._pending, self._pending_samples, self._pending_backwards
                self._pending, self._pending_samples, self._pending_backwards = None, 0, 0
            if grads is None:
                if not (
                    opt.tracker.ready_to_update_epoch and opt.grad_averager.local_samples_accumulated > 0
                ):
                    return False  # nothing to contribute: the others step without us, we catch up from them
                grads = [torch.zeros_like(m) for m in self._master]
            for master, grad in zip(self._master, grads, strict=True):
                master.grad = torch.zeros_like(master) if grad is None else grad
            averager = opt.grad_averager
            if isinstance(averager, _GradientAverager):
                averager.backwards = backwards
            epoch = opt.local_epoch
            try:
                opt.step(batch_size=samples)
            finally:
                for master in self._master:
                    master.grad = None
            self.steps += max(0, opt.local_epoch - epoch)
            # refresh even without a new epoch: hivemind applies a finished background state averaging here
            self._refresh_parameters(defer=True)
            return True

    @contextlib.contextmanager
    def _writing_served(self) -> Iterator[None]:
        """Around a write of the optimizer's parameters: when they are the served ones (``_shared_master``),
        serving waits (the parameters lock) and forwards kept before recompute their backward."""
        if not self._shared_master:
            yield
            return
        with self._lock:
            try:
                yield
            finally:
                self._param_version += 1

    def _refresh_parameters(self, defer: bool = False) -> None:
        """Copy the optimizer's parameters into the served ones if they changed (under the parameters lock:
        short); the caller holds ``_step_lock``. Unchanged ones are not written: a kept forward's graph stays
        valid. With ``defer``, changed parameters wait while forwards kept before are still waiting for their
        backward, up to ``_REFRESH_DEFER_S`` (the stepper retries, see :meth:`_step_loop`)."""
        if self._shared_master:
            return  # written in place (see _writing_served)
        with self._lock, torch.no_grad():
            changed = [
                not torch.equal(served, master)
                for served, master in zip(self._trained, self._master, strict=True)
            ]
            if not any(changed):
                self._refresh_pending_since = None
                return
            now = time.monotonic()
            if defer:
                with self._kept_lock:
                    waiting = bool(self._kept) or self._kept_in_use > 0
                since = self._refresh_pending_since
                if since is None:
                    since = self._refresh_pending_since = now
                if waiting and now - since < _REFRESH_DEFER_S:
                    return  # forwards arriving meanwhile are not kept (see _forward)
            for served, master, differs in zip(self._trained, self._master, changed, strict=True):
                if differs:
                    served.copy_(master)
            self._param_version += 1  # kept forwards saw the old values: their backwards recompute
            self._refresh_pending_since = None

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the gradients received so far have been handed to the optimizer (and a step they
        triggered has been taken), at most ``timeout`` seconds (default: one averaging round)."""
        if self.optimizer is None:
            return
        s = self.settings
        timeout = s.averaging_timeout + s.matchmaking_time if timeout is None else timeout
        deadline = time.monotonic() + timeout
        stepper = self._stepper
        if stepper is None or not stepper.is_alive():
            return
        while self._pending is not None and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.01)
        if self._step_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            try:  # the parameters of the steps taken so far are served from now on
                if self._refresh_pending_since is not None:
                    self._refresh_parameters()
            finally:
                self._step_lock.release()

    # ---- trainer-driven steps (see .stepping) ----

    def step_command(self, command: StepCommand) -> dict[str, Any]:
        """Run one phase of a trainer's step command (see :mod:`.stepping`); returns the reply
        (``epoch``, and ``sq_norm``/``finite`` of the step's gradients). Never applies a ``step_id`` twice."""
        opt = self.optimizer
        if opt is None or not self._trained:
            return {"epoch": 0, "sq_norm": 0.0, "finite": True, "steps": self.steps}
        if command.phase == "hyper":  # no lock: the stepper reads the groups at its next step
            self._set_hyper(command)
            return {"epoch": int(opt.local_epoch), "steps": self.steps}
        if not self.driven:
            return {
                "epoch": -1,
                "fatal": True,
                "error": f"the server of stage {self.stage} steps every target_batch_size samples "
                "(stage_steps='swarm') but a trainer commands its steps (stage_steps='trainer'): start every peer "
                "of the run with the same stage_steps",
            }
        with self._step_lock:
            done = self._steps_applied.get(command.step_id)
            if done is not None:
                return done
            if command.phase == "zero":
                self._take_pending(command.optimizer)
                self._prepared = None
                return {"epoch": int(opt.local_epoch), "steps": self.steps}
            state = self._prepared
            if state is None or state[0] != command.step_id:
                own, wanted = self._take_pending(command.optimizer)
                state = self._prepared = (command.step_id, own, wanted, None, -1)
            _, own, wanted, summed, attempt = state
            if summed is None or (command.phase == "norm" and command.attempt != attempt):
                # a new "norm" attempt redoes the sum from this peer's own gradients: the trainer found the
                # peers' sums of the last attempt inconsistent (see SwarmClient.step_stage)
                grads, group = own, 1
                if command.peers > 1:
                    grads, group = self._sum_with_peers(own, wanted)
                    if group == 1 and command.phase == "apply" and command.attempt < MAX_STEP_ATTEMPTS - 1:
                        # nobody to sum with this time (the peers missed each other): the trainer sends the command
                        # again, and this peer keeps its own gradients for that round
                        return {"epoch": int(opt.local_epoch), "retry": True, "group": 1, "steps": self.steps}
                if grads is own and command.grad_scale != 1.0:
                    # unscaled in place below: the own gradients stay as taken, for another attempt (without a
                    # loss scale nothing changes them before the step, which is the last use: no copy)
                    grads = [g.clone() if g is not None else None for g in own]
                summed = (grads, self._unscale(grads, command.grad_scale, group))
                self._prepared = (command.step_id, own, wanted, summed, command.attempt)
            grads, facts = summed
            if command.phase == "norm":
                return {"epoch": int(opt.local_epoch), **facts}
            self._prepared = None
            behind = command.epoch > opt.local_epoch
            if behind:
                # this peer missed steps: it takes the stage's state from its peers; the step's summed gradients
                # apply to it only if that state is from before this step (as the others' was)
                self._catch_up(command.epoch)
            if not behind or opt.local_epoch <= command.epoch:
                self._apply(command, grads, facts)
            reply = {"epoch": int(opt.local_epoch), **facts, "steps": self.steps}
            self._steps_applied[command.step_id] = reply
            while len(self._steps_applied) > 64:
                self._steps_applied.popitem(last=False)
            return reply

    def _set_hyper(self, command: StepCommand) -> None:
        """Give each of the stage optimizer's groups the trainer's hyper-parameters of the group it mirrors."""
        opt = self.optimizer
        assert opt is not None
        groups = opt.state_averager.optimizer.param_groups
        for group, (optimizer, index) in zip(groups, self._group_sources, strict=True):
            if optimizer == command.optimizer and index in command.groups:
                group.update(command.groups[index])

    def _catch_up(self, epoch: int) -> None:
        """This peer missed steps (the trainer saw the stage at ``epoch``): load the stage's state from its
        peers before stepping with them. Under ``_step_lock``."""
        opt = self.optimizer
        assert opt is not None
        logger.info(
            f"Stage {self.stage}: this peer is at step {opt.local_epoch}, the stage at {epoch}; loading its state"
        )
        averager = opt.state_averager
        assert isinstance(averager, _StateAverager)
        averager.loaded = False
        try:
            with self._writing_served():
                opt.load_state_from_peers()
        except Exception as e:
            logger.warning(f"Stage {self.stage}: could not load the stage's state from its peers: {e!r}")
        self._refresh_parameters()

    @staticmethod
    def _unscale(grads: list[torch.Tensor | None], grad_scale: float, group: int) -> dict[str, Any]:
        """Unscale the step's gradients in place; returns their facts (squared norm, finiteness, group size)."""
        sq_norm, finite = 0.0, True
        with torch.no_grad():
            for g in grads:
                if g is None:
                    continue
                if grad_scale != 1.0:
                    g.mul_(grad_scale)
                value = float(g.detach().float().pow(2).sum())
                finite = finite and math.isfinite(value)
                sq_norm += value
        return {"sq_norm": sq_norm if finite else 0.0, "finite": finite, "group": group}

    def _take_pending(self, optimizer: int) -> tuple[list[torch.Tensor | None], list[int]]:
        """Remove from the pending gradients those of the parameters in the trainer's optimizer ``optimizer``;
        returns them (aligned with the master parameters, ``None`` elsewhere) and those parameters' indices."""
        owned = {i for i, (source, _) in enumerate(self._group_sources) if source == optimizer}
        opt = self.optimizer
        assert opt is not None
        groups = opt.state_averager.optimizer.param_groups
        index_of = {id(m): i for i, m in enumerate(self._master)}
        wanted = [index_of[id(p)] for g, group in enumerate(groups) if g in owned for p in group["params"]]
        grads: list[torch.Tensor | None] = [None] * len(self._master)
        with self._grads_lock:
            pending = self._pending
            if pending is not None:
                for i in wanted:
                    grads[i], pending[i] = pending[i], None
                if all(g is None for g in pending):
                    self._pending, self._pending_samples, self._pending_backwards = None, 0, 0
        return grads, wanted

    def _sum_with_peers(
        self, grads: list[torch.Tensor | None], wanted: list[int]
    ) -> tuple[list[torch.Tensor | None], int]:
        """The sum of ``grads`` over the stage's peers stepping now (one all-reduce round of the stage's gradient
        averager, every peer with weight 1, times the group's size); this peer's own gradients if no round
        could be made (logged)."""
        opt = self.optimizer
        assert opt is not None
        averager = opt.grad_averager
        with torch.no_grad(), averager.get_tensors() as buffers:
            for buffer, grad in zip(buffers, grads, strict=True):
                buffer.copy_(grad) if grad is not None else buffer.zero_()
        try:
            group = self._one_round(averager)
        except Exception as e:
            group = None
            if not _no_partner(e):  # a broken round (shapes, a reducer's failure...), not a missing partner
                logger.error(
                    f"Stage {self.stage}: summing the step's gradients with the stage's peers failed: {e!r}; "
                    "stepping with this peer's own gradients"
                )
                return grads, 1
        if not group:
            logger.warning(
                f"Stage {self.stage}: found no peer of the stage to sum this step's gradients with; stepping with "
                "this peer's own gradients"
            )
            return grads, 1
        self.averaged_rounds += 1
        with torch.no_grad(), averager.get_tensors() as buffers:
            summed: list[torch.Tensor | None] = [None] * len(grads)
            for i in wanted:
                summed[i] = buffers[i].detach().clone().mul_(len(group))
        return summed, len(group)

    def _one_round(self, averager: DecentralizedAverager) -> Any:
        """One all-reduce round of ``averager`` with the stage's peers that step now: the group (``None`` or an
        exception if none formed). The trainer commands those peers at once, so a group forms within a few
        matchmaking periods or not at all (a partner that already finished this step, see
        ``SwarmClient.step_stage``): matchmaking is given that long, and the all-reduce ``averaging_timeout``."""
        s = self.settings
        control = DecentralizedAverager.step(averager, weight=1.0, timeout=s.averaging_timeout, wait=False)
        looking = time.monotonic() + 3 * s.matchmaking_time + 2.0
        while not control.done():
            if not control.began_allreduce and time.monotonic() > looking:
                control.cancel()
                return None
            try:
                return control.result(timeout=0.05)
            except TimeoutError:  # concurrent.futures.TimeoutError is TimeoutError
                continue
        return control.result()

    def _apply(self, command: StepCommand, grads: list[torch.Tensor | None], facts: dict[str, Any]) -> None:
        """Clip ``grads`` as commanded, take the trainer's hyper-parameters and step; then serve the new
        parameters. Under ``_step_lock``."""
        opt = self.optimizer
        assert opt is not None
        if command.skip or not facts["finite"]:
            if not facts["finite"] and not command.skip:
                logger.warning(
                    f"Stage {self.stage}: the step's gradients are not finite; this stage skips the step"
                )
            return
        averager = opt.state_averager
        with torch.no_grad():
            for g in grads:
                if g is None:
                    continue
                if command.clip_coef is not None and command.clip_coef < 1.0:
                    g.mul_(command.clip_coef)
                if command.clip_value is not None:
                    g.clamp_(-command.clip_value, command.clip_value)
        self._set_hyper(command)
        for master, grad in zip(self._master, grads, strict=True):
            master.grad = grad
        # a peer downloading the stage's state meanwhile gets it from before or after this step, never torn and
        # never with the new epoch on the old parameters (see _StateAverager.get_current_state)
        with _state_lock(averager), opt.tracker.pause_updates(), self._writing_served():
            try:
                averager.step(increment_epoch=True, optimizer_step=True)
            finally:
                for master in self._master:
                    master.grad = None
            self.steps += 1
            opt.tracker.update_epoch(new_epoch=averager.local_epoch)
        if not opt.client_mode:
            averager.state_sharing_priority = averager.local_epoch
        self._refresh_parameters()

    def optimizer_state(self) -> bytes:
        """The stage optimizer's state (``torch.save`` of ``{"optimizer": state_dict, "epoch": int}``), for a
        trainer's checkpoint; empty if this server does not train its stage."""
        opt = self.optimizer
        if opt is None:
            return b""
        with self._step_lock:
            averager = opt.state_averager
            buffer = io.BytesIO()
            torch.save(
                {"optimizer": averager.optimizer.state_dict(), "epoch": int(averager.local_epoch)}, buffer
            )
            return buffer.getvalue()

    def load_optimizer_state(self, data: bytes) -> None:
        """Restore the stage optimizer's state and epoch from :meth:`optimizer_state`'s bytes (a resumed run),
        in place: the state tensors that hivemind averages and shares stay the same objects.

        Raises:
            ValueError: the state does not fit this stage's optimizer (another model or stage layout).
        """
        opt = self.optimizer
        if opt is None:
            return
        try:
            loaded = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
            state, epoch = loaded["optimizer"], int(loaded["epoch"])
            params = state["state"]
        except Exception as e:
            raise ValueError(
                f"Stage {self.stage}: unreadable optimizer state ({type(e).__name__}: {e})"
            ) from None
        with self._step_lock:
            averager = opt.state_averager
            torch_opt = averager.optimizer
            masters = [p for group in torch_opt.param_groups for p in group["params"]]
            if len(state["param_groups"]) != len(torch_opt.param_groups) or sum(
                len(g["params"]) for g in state["param_groups"]
            ) != len(masters):
                raise ValueError(
                    f"Stage {self.stage}: the checkpoint's optimizer state has {len(state['param_groups'])} groups "
                    f"for another set of parameters than this stage's {len(torch_opt.param_groups)}: resume with "
                    "the same model, pipeline and num_stages as the run that saved it."
                )
            with torch.no_grad():
                for index, param in enumerate(masters):
                    mine, theirs = torch_opt.state.get(param), params.get(index, {})
                    for key, value in theirs.items():
                        if mine is not None and isinstance(mine.get(key), torch.Tensor):
                            if mine[key].shape != value.shape:
                                raise ValueError(
                                    f"Stage {self.stage}: optimizer state {key!r} of parameter {index} has shape "
                                    f"{list(value.shape)}, here {list(mine[key].shape)}: another model"
                                )
                            mine[key].copy_(value)
                        else:
                            torch_opt.state[param][key] = value
                for group, saved in zip(torch_opt.param_groups, state["param_groups"], strict=True):
                    group.update({k: v for k, v in saved.items() if k != "params"})
            with opt.tracker.pause_updates():
                averager.local_epoch = epoch
                opt.tracker.update_epoch(new_epoch=epoch)

    # ---- serving a request (the same for in-process and remote callers) ----

    def handle(self, request: StageRequest) -> StageReply:
        """Serve one request; never raises: failures become error replies (see :mod:`.protocol`). With batching,
        the request waits for the compute thread, which may merge it with other waiting requests."""
        # a trainer that has not seen this peer migrate: another peer of the stage can serve it
        if request.uid != self.uid:
            error = Misrouted(f"This peer serves {self.uid!r}, but the request was for {request.uid[:200]!r}")
            return _error(request.request_id, UNAVAILABLE, error)
        try:
            if not self._started or not self._accepting:
                return _error(
                    request.request_id, UNAVAILABLE, RuntimeError(f"Stage {self.stage} server is not running")
                )
            self.schemas.check(request.inputs.tensors)
        except BadRequest as e:
            logger.debug(f"Stage {self.stage}: rejected a request: {e}")
            return _error(request.request_id, REQUEST, e)
        with self._grads_lock:  # handle runs in several threads
            self.requests_served += 1
        batcher = self._batcher
        if batcher is None:
            return self._serve_one(request)
        try:
            return batcher.submit(request)
        except Exception as e:  # the server stopped meanwhile (or a bug in the batcher)
            return _error(request.request_id, UNAVAILABLE, e)

    def _serve_one(self, request: StageRequest) -> StageReply:
        """Serve one request on its own; never raises."""
        try:
            if request.kind == "forward":
                keep = request.forward_id if request.forward_id == request.request_id else None
                outputs = self._forward(request.inputs, keep, request.training, request.seed)
            else:
                assert request.grad_outputs is not None
                outputs = self._backward(
                    request.inputs,
                    request.grad_outputs,
                    request.request_id,
                    request.commit_by,
                    self._take_kept(request.forward_id),
                    request.training,
                    request.seed,
                )
            self.schemas.learn(request.inputs.tensors)
            return StageReply(request.request_id, outputs=outputs)
        except BadRequest as e:
            logger.debug(f"Stage {self.stage}: rejected a request: {e}")
            return _error(request.request_id, REQUEST, e)
        except TooLate as e:
            logger.debug(f"Stage {self.stage}: {e}")
            return _error(request.request_id, UNAVAILABLE, e)
        except _NonFinite as e:
            logger.warning(f"Stage {self.stage}: {e}")
            return _error(request.request_id, COMPUTE, e)
        except _ComputeError as e:
            logger.warning(f"Stage {self.stage}: the stage raised {type(e.error).__name__}: {e.error}")
            return _error(request.request_id, COMPUTE, e.error)
        except (
            Exception
        ) as e:  # out of memory, or a bug here: not the caller's fault, another peer may do better
            logger.warning(f"Stage {self.stage}: could not serve a {request.kind} call: {e!r}")
            return _error(request.request_id, UNAVAILABLE, e)

    def _serve_group(self, requests: list[StageRequest]) -> list[StageReply]:
        """Serve mergeable requests (one group at a time, see :class:`.batching.RequestBatcher`): merged into one computation, or one by one
        if the merged one fails in any way (each request then gets its own answer or error); never raises."""
        if len(requests) > 1 and any(self._is_kept(r) for r in requests):
            # a backward whose forward is kept here runs alone (no recomputation to share); the rest may merge
            kept = {id(r) for r in requests if self._is_kept(r)}
            rest = [r for r in requests if id(r) not in kept]
            by_request = {id(r): self._serve_one(r) for r in requests if id(r) in kept}
            if rest:
                by_request.update(zip((id(r) for r in rest), self._serve_group(rest), strict=True))
            return [by_request[id(r)] for r in requests]
        if len(requests) > 1:
            try:
                replies = self._serve_merged(requests)
                if replies is not None:
                    return replies
            except Exception as e:
                logger.debug(
                    f"Stage {self.stage}: {len(requests)} merged {requests[0].kind} calls failed ({e!r}); "
                    "serving them one by one"
                )
        return [self._serve_one(request) for request in requests]

    def _merge_key(self, request: StageRequest) -> tuple[Any, int]:
        return merge_key(request, distinct_seeds=self.draws_rng)

    def _serve_merged(self, requests: list[StageRequest]) -> list[StageReply] | None:
        """Serve ``requests`` (same kind, mode and structure, see :func:`.batching.merge_key`) with one
        computation, under the first request's seed; ``None`` if the results cannot be split or committed per
        request, or if a train-mode run drew random numbers (each call's dropout masks must come from its own
        seed): the caller serves them one by one. Raises whatever the merged computation raised."""
        rows = [request.inputs.batch_size() for request in requests]
        inputs = concat_payloads([request.inputs for request in requests])
        training, seed = requests[0].training, requests[0].seed
        if requests[0].kind == "forward":
            merged = self._forward(inputs, None, training, seed)
            if training and self.draws_rng:
                return None
            outputs = split_payload(merged, rows)
            if outputs is None:
                return None
            replies = [
                StageReply(r.request_id, outputs=out) for r, out in zip(requests, outputs, strict=True)
            ]
        else:
            grad_outputs = concat_payloads([request.grad_outputs for request in requests])  # type: ignore[misc]
            grad_inputs, param_grads = self._backward_compute(inputs, grad_outputs, None, training, seed)
            if training and self.draws_rng:
                return None
            pieces = split_payload(Payload.flatten(grad_inputs), rows)
            if pieces is None or not self._commit_merged(requests, param_grads, rows):
                return None
            replies = []
            for request, piece in zip(requests, pieces, strict=True):
                try:
                    check_finite(piece.tensors, f"stage {self.stage} input gradient", _NonFinite)
                    replies.append(StageReply(request.request_id, outputs=piece))
                except _NonFinite as e:
                    logger.warning(f"Stage {self.stage}: {e}")
                    replies.append(_error(request.request_id, COMPUTE, e))
        for request, reply in zip(requests, replies, strict=True):
            if reply.error is None:
                self.schemas.learn(request.inputs.tensors)
        return replies

    def _forward(
        self, inputs: Payload, keep_id: int | None = None, training: bool = True, seed: int | None = None
    ) -> Payload:
        """The stage's outputs for ``inputs`` in mode ``training`` under ``seed``; with ``keep_id`` (and
        ``keep_activations`` > 0) the forward runs with autograd and its graph is kept under that id for the
        backward."""
        leaves = _leaves(inputs, self.device)
        keep = (
            keep_id is not None and self.settings.keep_activations > 0 and self._refresh_pending_since is None
        )
        keep = keep and (bool(self._trained) or any(leaf.requires_grad for leaf in leaves))
        args, kwargs = inputs.rebuild_call(leaves)
        with self._lock, torch.enable_grad() if keep else torch.no_grad():
            start = time.perf_counter()
            outputs = self._run_module(args, kwargs, training, seed)
            version, spent = self._param_version, time.perf_counter() - start
        payload = _outputs_payload(outputs)
        check_outputs(payload.tensors, leaves, f"stage {self.stage} output", _NonFinite)
        if not keep:
            return payload
        assert keep_id is not None
        self._keep(keep_id, _Kept(leaves, payload.tensors, version, spent, time.monotonic()))
        return Payload(payload.skeleton, [t.detach() for t in payload.tensors])

    def _keep(self, forward_id: int, kept: _Kept) -> None:
        with self._kept_lock:
            self._kept.pop(forward_id, None)
            self._kept[forward_id] = kept
            while len(self._kept) > self.settings.keep_activations or (
                self._kept and kept.created - next(iter(self._kept.values())).created > _KEPT_MAX_AGE_S
            ):
                self._kept.popitem(last=False)

    def _is_kept(self, request: StageRequest) -> bool:
        if request.kind != "backward" or request.forward_id is None:
            return False
        with self._kept_lock:
            return request.forward_id in self._kept

    def _take_kept(self, forward_id: int | None) -> _Kept | None:
        if forward_id is None:
            return None
        with self._kept_lock:
            kept = self._kept.pop(forward_id, None)
            if kept is not None:
                self._kept_in_use += 1  # until its backward has run (see _backward)
        return kept

    def _backward(
        self,
        inputs: Payload,
        grad_outputs: Payload,
        request_id: int | None = None,
        commit_by: float | None = None,
        kept: _Kept | None = None,
        training: bool = True,
        seed: int | None = None,
    ) -> Payload:
        try:
            grad_inputs, param_grads = self._backward_compute(inputs, grad_outputs, kept, training, seed)
        finally:
            if kept is not None:
                with self._kept_lock:
                    self._kept_in_use -= 1
                if self._refresh_pending_since is not None:
                    self._wake.set()  # new parameters may have been waiting for this backward
        self._commit(param_grads, inputs.batch_size(), request_id, commit_by)
        check_finite(list(grad_inputs), f"stage {self.stage} input gradient", _NonFinite)
        return Payload.flatten(grad_inputs)

    def _backward_compute(
        self,
        inputs: Payload,
        grad_outputs: Payload,
        kept: _Kept | None = None,
        training: bool = True,
        seed: int | None = None,
    ) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor | None]]:
        """The gradients of the inputs that require grad and of the trained parameters (nothing committed), from
        the ``kept`` forward of these inputs if it is still valid, else by recomputing the forward in mode
        ``training`` under ``seed`` (the forward's dropout masks; buffers such as batch normalisation's running
        statistics are left as they were: the forward updated them already)."""
        grads = grad_outputs.rebuild()
        batch_size = inputs.batch_size()
        trained = self._trained
        with self._lock:
            start = time.perf_counter()
            results: list[torch.Tensor | None] | None = None
            if kept is not None and kept.matches(inputs, self._param_version):
                try:
                    results = self._grads_of(kept.leaves, kept.outputs, grads, trained)
                    leaves, spent = kept.leaves, kept.forward_s
                    self.kept_hits += 1
                except _ComputeError as e:  # e.g. an input changed in place since: recompute below
                    logger.debug(f"Stage {self.stage}: kept forward unusable ({e.error!r}); recomputing it")
                    results = None
            if results is None:
                leaves, spent = _leaves(inputs, self.device), 0.0
                args, kwargs = inputs.rebuild_call(leaves)
                with _buffers_kept(self.module, training), torch.enable_grad():
                    outputs = _outputs_payload(self._run_module(args, kwargs, training, seed)).tensors
                    results = self._grads_of(leaves, outputs, grads, trained)
            self.throughput.record(batch_size, spent + time.perf_counter() - start)
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        grad_inputs = tuple(
            g if g is not None else torch.zeros_like(t) for t, g in zip(wanted, results, strict=False)
        )
        return grad_inputs, _exclusive(results[len(wanted) :], grad_inputs)

    @staticmethod
    def _grads_of(
        leaves: list[torch.Tensor], outputs: list[torch.Tensor], grads: Any, trained: list[nn.Parameter]
    ) -> list[torch.Tensor | None]:
        """Gradients of the leaves that require grad, then of ``trained``, given the outputs' gradients."""
        check_grad_outputs(grads, outputs)
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        pairs = [
            (out, grad.to(device=out.device, dtype=out.dtype))
            for out, grad in zip(outputs, grads, strict=True)
            if grad is not None and out.requires_grad
        ]
        if not pairs or not (wanted or trained):
            return [None] * (len(wanted) + len(trained))
        try:  # gradients are returned, not accumulated in .grad: the stepper owns the optimizer's
            return list(
                torch.autograd.grad(
                    [o for o, _ in pairs], wanted + trained, [g for _, g in pairs], allow_unused=True
                )
            )
        except (MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as e:
            raise _ComputeError(e) from e

    def _commit(
        self,
        grads: list[torch.Tensor | None],
        batch_size: int,
        request_id: int | None,
        commit_by: float | None,
    ) -> None:
        """Add a backward's parameter gradients to the pending ones, at most once per request id, and only
        before the caller's ``commit_by`` deadline (raises :class:`TooLate` after it)."""
        if commit_by is not None and time.time() > commit_by:
            raise TooLate(
                f"backward request {request_id} finished {time.time() - commit_by:.1f} s after its commit deadline; "
                "its gradients were not applied (the caller retries it elsewhere)"
            )
        finite = _all_finite(grads)
        with self._grads_lock:
            if request_id is not None and not self._applied.add(request_id):
                logger.debug(f"Stage {self.stage}: backward request {request_id} was already applied here")
                return
            self.samples_processed += batch_size
            if self.optimizer is None or not self._trained:
                return  # not training this stage: parameter gradients are dropped
            if not finite:  # never let them reach the optimizer (nor, through averaging, the other peers)
                self.dropped_contributions += 1
                logger.warning(
                    f"Stage {self.stage}: backward request {request_id} produced NaN or infinite parameter "
                    f"gradients; its contribution was dropped ({self.dropped_contributions} so far)"
                )
                return
            self._add_pending(grads)
            self._pending_samples += batch_size
            self._pending_backwards += 1
        self._wake.set()

    def _commit_merged(
        self, requests: list[StageRequest], grads: list[torch.Tensor | None], rows: list[int]
    ) -> bool:
        """Commit the summed parameter gradients of merged backwards, counting every request's samples, if each
        request may be applied now: before its ``commit_by``, its id not applied yet (nor twice in the group)
        and the gradients finite. Otherwise commits nothing and returns False: the requests are then served one
        by one, which applies each exactly as :meth:`_commit` does."""
        now = time.time()
        if any(r.commit_by is not None and now > r.commit_by for r in requests):
            return False
        if not _all_finite(grads):
            return False
        ids = [r.request_id for r in requests if r.request_id is not None]
        with self._grads_lock:
            if len(set(ids)) != len(ids) or any(self._applied.known(i) for i in ids):
                return False
            for request_id in ids:
                self._applied.add(request_id)
            self.samples_processed += sum(rows)
            if self.optimizer is None or not self._trained:
                return True
            self._add_pending(grads)
            self._pending_samples += sum(rows)
            self._pending_backwards += len(requests)
        self._wake.set()
        return True

    def _add_pending(self, grads: list[torch.Tensor | None]) -> None:
        """Add parameter gradients (this server's own tensors, see :func:`_exclusive`) to the pending sum; the
        first backward after a step becomes the sum itself (no zero-filled buffer, no extra pass). Under
        ``_grads_lock``."""
        if self._pending is None:
            self._pending = [
                None if g is None else g.to(device=m.device, dtype=m.dtype)
                for m, g in zip(self._master, grads, strict=True)
            ]
            return
        for i, (acc, grad) in enumerate(zip(self._pending, grads, strict=True)):
            if grad is None:
                continue
            if acc is None:
                self._pending[i] = grad.to(device=self._master[i].device, dtype=self._master[i].dtype)
            else:
                acc.add_(grad.to(acc.device))

    def _run_module(self, args: tuple, kwargs: dict, training: bool = True, seed: int | None = None) -> Any:
        """Run the stage module in mode ``training`` with its random generators seeded with ``seed`` (under the
        parameters lock)."""
        self.computations += 1
        self._set_mode(training)
        try:
            autocast = self.settings.autocast
            # the trainer's mixed precision (Lightning's "bf16-mixed"/"16-mixed"): the same autocast here
            precision = (
                torch.autocast(self.device.type, dtype=getattr(torch, autocast), cache_enabled=False)
                if autocast is not None
                else contextlib.nullcontext()
            )
            with _seeded_rng(seed, self.device) as drew, precision:
                outputs = self.module(*args, **kwargs)
        except (MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as e:
            raise _ComputeError(e) from e
        if training and drew[0]:
            self.draws_rng = True  # from now on its train-mode calls are not merged (see batching)
        return outputs

    def _set_mode(self, training: bool) -> None:
        """Eval: every submodule in eval mode; train: the modes the module was built with (a block the user
        froze in eval stays so), as Lightning restores them after validation. Under the parameters lock."""
        if training == self._training:
            return
        if training:
            for module, mode in self._built_modes:
                module.training = mode
        else:
            self.module.eval()
        self._training = training

    def state_dict_local(self) -> dict[str, torch.Tensor]:
        """A detached CPU copy of the stage module's ``state_dict``, including every backward received so far
        (see :meth:`flush`)."""
        self.flush()
        with self._lock:
            return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    def info(self) -> dict[str, Any]:
        """Stage, throughput (samples/s of forward + backward), samples processed and optimizer epoch."""
        epoch = self.optimizer.local_epoch if self.optimizer is not None else 0
        return {
            "stage": self.stage,
            "throughput": self.throughput.value,
            "samples_processed": self.samples_processed,
            "epoch": int(epoch),
            "steps": self.steps,
            "averaged_rounds": self.averaged_rounds + getattr(self.optimizer, "rounds", 0),
        }

    # ---- RPC handlers ----

    async def rpc_channel(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A long-lived stream carrying one call after another (see :mod:`.transport`).

        Parts are decoded here as they arrive (a part is small: ~0.05 ms), overlapping with the transfer; the
        compute thread then serves the request and encodes the reply message by message, each sent as soon as it
        is ready. Every request gets a reply, an error reply if it failed; the channel stays open, except for a
        call beyond the size limits (answered at once, then the channel is closed) and for a peer this server
        ignores (see :class:`~.protocol.BadPeers`).
        """
        loop = asyncio.get_running_loop()
        peer = context.remote_id
        receiver: MessageReceiver | None = None
        counted = False  # whether a call of this channel counts in _calls_by_peer now (received to replied)
        try:
            async for message in requests:
                if receiver is None:  # the first message of a call
                    refusal = self._refusal(peer)
                    if refusal is not None:
                        yield refusal
                        return
                    receiver = self._receiver()
                    self._calls_by_peer[peer] = self._calls_by_peer.get(peer, 0) + 1
                    counted = True
                    if self._calls_by_peer[peer] > _MAX_CALLS_PER_PEER:
                        yield _reply(
                            _error(
                                -1,
                                UNAVAILABLE,
                                RuntimeError(
                                    f"Too many concurrent calls from peer {peer} (at most {_MAX_CALLS_PER_PEER})"
                                ),
                            )
                        )
                        return
                done_receiving = receiver.feed(message)
                if receiver.too_large:  # cut the sender off instead of waiting for the end of its call
                    try:
                        receiver.result()
                    except TooLarge as e:
                        self._strike(peer, e)
                        yield _reply(_error(-1, REQUEST, e))
                    return
                if not done_receiving:
                    continue
                received, receiver = receiver, None
                if self._executor is None or not self._started:
                    self._calls_by_peer[peer] -= 1
                    counted = False
                    error = _error(-1, UNAVAILABLE, RuntimeError(f"Stage {self.stage} server is not running"))
                    yield _reply(error)
                    continue

                def serve(
                    received: MessageReceiver = received,
                ) -> tuple[runtime_pb2.ExpertResponse, Iterator[runtime_pb2.ExpertResponse]]:
                    # the compute thread serves the call and encodes the reply's first message; the others are
                    # encoded below, on the loop, each as the previous one goes out (a large reply's parts:
                    # quantizing part i + 1 overlaps with sending part i, without a thread hand-over per part)
                    replies = self._serve_received(received, peer)
                    return next(replies), replies

                first, rest = await loop.run_in_executor(self._executor, serve)
                # ``rest`` never raises (a failure becomes an error reply) and ends with the reply's last message,
                # the one that carries its header
                for message in itertools.chain((first,), rest):
                    if message.metadata:
                        self._calls_by_peer[peer] -= 1
                        counted = False
                    yield message
        finally:
            if counted:
                self._calls_by_peer[peer] -= 1
            if self._calls_by_peer.get(peer, 1) <= 0:
                self._calls_by_peer.pop(peer, None)

    def _receiver(self) -> MessageReceiver:
        return MessageReceiver(
            max_bytes=self.max_request_bytes,
            max_tensors=MAX_REQUEST_TENSORS,
            max_message_bytes=max(MAX_MESSAGE_BYTES, self.max_request_bytes + (1 << 20)),
            max_messages=MAX_REQUEST_MESSAGES,
        )

    def _refusal(self, peer: PeerID) -> runtime_pb2.ExpertResponse | None:
        """The error reply for a peer this server ignores now, or ``None``."""
        remaining = self.bad_peers.ignored_for(peer)
        if not remaining:
            return None
        return _reply(  # not this request's fault: another peer of the stage may serve it
            _error(
                -1,
                UNAVAILABLE,
                BadRequest(
                    f"Stage {self.stage} server ignores peer {peer} for another {remaining:.0f} s: it sent too many bad "
                    f"requests"
                ),
            )
        )

    def _strike(self, peer: PeerID | None, error: Exception) -> None:
        """Count a bad request of ``peer`` (logged at debug level: a remote peer's fault, not ours)."""
        logger.debug(f"Stage {self.stage}: bad request from {peer}: {error}")
        if peer is not None and self.bad_peers.strike(peer):
            logger.warning(
                f"Stage {self.stage}: ignoring peer {peer} for {self.bad_peers.ban_s:.0f} s after "
                f"{self.bad_peers.limit} bad requests (last: {str(error)[:200]})"
            )

    def _serve_received(
        self, received: MessageReceiver, peer: PeerID | None = None
    ) -> Iterator[runtime_pb2.ExpertResponse]:
        """Serve a received call and yield its reply messages (runs in the compute thread; never raises)."""
        request_id = -1
        try:
            try:
                header, tensors = received.result()
                request_id = _request_id(header)
                request = parse_request(header, tensors, self.uid)
            except Misrouted as e:  # another peer may serve it (a peer that migrated, another version)
                self._strike(peer, e)
                yield _reply(_error(request_id, UNAVAILABLE, e))
                return
            except (CodecError, BadRequest) as e:
                self._strike(peer, e)
                yield _reply(_error(request_id, REQUEST, e))
                return
            reply = self.handle(request)
            if reply.error is not None:
                if reply.error.category == REQUEST:
                    self._strike(peer, BadRequest(reply.error.message))
                yield _reply(reply)
                return
            assert reply.outputs is not None
            compression = self.settings.compression
            split = reply.outputs.estimated_bytes(compression) > SPLIT_ABOVE
            encoded = reply.outputs.encode(compression, split_above=0.0 if split else math.inf)
            size = MESSAGE_BYTES if split else math.inf  # not split: the whole reply in one message
            yield from messages(
                runtime_pb2.ExpertResponse, encoded.parts(), encode_reply_header(reply, encoded), size
            )
        except (
            Exception
        ) as e:  # a bug while encoding: end the call with an error reply (sent parts are dropped)
            logger.warning(f"Stage {self.stage}: failed to reply: {e!r}")
            yield _reply(_error(request_id, UNAVAILABLE, e))

    async def rpc_step(self, request: runtime_pb2.ExpertInfo, context: P2PContext) -> runtime_pb2.ExpertInfo:
        """A trainer's step command (see :mod:`.stepping`): msgpack in, msgpack reply out; a malformed command
        gets ``{"epoch": -1, "error": ...}`` and counts as a bad request of its sender."""
        remaining = self.bad_peers.ignored_for(context.remote_id)
        try:
            if remaining:
                raise BadRequest(
                    f"This peer ignores you for another {remaining:.0f} s: too many bad requests"
                )
            try:
                command = parse_command(request.serialized_info, self.uid)
            except ValueError as e:
                self._strike(context.remote_id, e)
                raise BadRequest(str(e)) from None
            loop = asyncio.get_running_loop()
            reply = await loop.run_in_executor(None, self.step_command, command)
        except BadRequest as e:
            reply = {"epoch": -1, "error": str(e)[:4096]}
        except Exception as e:
            # the optimizer's own failure (a bad hyper-parameter, a user optimizer that raises): the same on every
            # peer, so the trainer raises it at once instead of retrying
            logger.error(f"Stage {self.stage}: a step command failed: {e!r}")
            reply = {
                "epoch": -1,
                "fatal": True,
                "error": f"stage {self.stage}'s optimizer step raised {type(e).__name__}: {e}"[:4096],
            }
        return runtime_pb2.ExpertInfo(serialized_info=msgpack.packb(reply))

    async def rpc_optimizer(
        self, request: runtime_pb2.ExpertInfo, context: P2PContext
    ) -> runtime_pb2.ExpertInfo:
        """The stage optimizer's state for a checkpoint (``{"uid", "op": "get"}`` -> ``{"state": bytes}``) or
        its restoration (``{"uid", "op": "set", "state": bytes}`` -> ``{"ok": True}``); msgpack both ways, an
        ``{"error": str}`` reply if refused."""
        try:
            remaining = self.bad_peers.ignored_for(context.remote_id)
            if remaining:
                raise BadRequest(
                    f"This peer ignores you for another {remaining:.0f} s: too many bad requests"
                )
            try:
                fields = msgpack.unpackb(request.serialized_info, raw=False)
                if not isinstance(fields, dict) or fields.get("uid") != self.uid:
                    raise BadRequest(f"This peer serves {self.uid!r}")
                op, data = fields.get("op"), fields.get("state")
                if op not in ("get", "set") or (op == "set" and not isinstance(data, bytes)):
                    raise BadRequest("expected op 'get', or op 'set' with the state's bytes")
            except BadRequest as e:
                self._strike(context.remote_id, e)
                raise
            except Exception as e:
                self._strike(context.remote_id, e)
                raise BadRequest(f"malformed optimizer request ({type(e).__name__})") from None
            loop = asyncio.get_running_loop()
            if op == "get":
                reply: dict[str, Any] = {"state": await loop.run_in_executor(None, self.optimizer_state)}
            else:
                await loop.run_in_executor(None, self.load_optimizer_state, data)
                reply = {"ok": True}
        except (BadRequest, ValueError) as e:
            reply = {"error": str(e)[:4096]}
        return runtime_pb2.ExpertInfo(serialized_info=msgpack.packb(reply, use_bin_type=True))

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        """Stage index, throughput, samples processed and optimizer epoch (msgpack dict)."""
        self._check_uid(request, context)
        return runtime_pb2.ExpertInfo(serialized_info=msgpack.packb(self.info()))

    def _check_uid(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> None:
        remaining = self.bad_peers.ignored_for(context.remote_id)
        if remaining:
            raise BadRequest(f"This peer ignores you for another {remaining:.0f} s: too many bad requests")
        if request.uid != self.uid:
            error = BadRequest(
                f"This peer serves {self.uid!r}, but the request was for {request.uid[:200]!r}"
            )
            self._strike(context.remote_id, error)
            raise error

    async def rpc_state(
        self, request: runtime_pb2.ExpertUID, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """The stage module's ``state_dict`` as an uncompressed payload, in messages (metadata on the last)."""
        try:
            self._check_uid(request, context)
        except BadRequest:
            yield runtime_pb2.ExpertResponse()  # no metadata: the caller reads an incomplete stream
            return
        loop = asyncio.get_running_loop()

        def encode() -> list[runtime_pb2.ExpertResponse]:
            encoded = Payload.flatten(self.state_dict_local()).encode("none", split_above=0.0)
            return list(messages(runtime_pb2.ExpertResponse, encoded.parts(), encoded.metadata))

        for message in await loop.run_in_executor(None, encode):
            yield message


class _NonFinite(FloatingPointError):
    """The stage's own computation produced NaN or infinite outputs or input gradients from finite inputs."""

    def __init__(self, message: str) -> None:
        super().__init__(
            f"{message}; the stage diverged (lower the learning rate, or check the model in fp32)"
        )


class TooLate(RuntimeError):
    """A backward finished after its caller's commit deadline, so its gradients were not applied."""


class AppliedRequests:
    """The ids of the backward requests a peer applied: bounded (oldest forgotten first) and expiring.

    :param ttl: seconds an id is remembered; a caller retries a request within its ``request_timeout`` times the
        number of peers it tries, far less than the default 10 minutes.
    :param max_size: ids remembered at most.
    """

    def __init__(self, ttl: float = _APPLIED_TTL_S, max_size: int = _APPLIED_MAX) -> None:
        self.ttl, self.max_size = ttl, max_size
        self._seen: OrderedDict[int, float] = OrderedDict()

    def add(self, request_id: int, now: float | None = None) -> bool:
        """Remember ``request_id``; returns False if it was already known (not thread-safe: callers lock)."""
        now = time.monotonic() if now is None else now
        while self._seen and (len(self._seen) >= self.max_size or next(iter(self._seen.values())) < now):
            self._seen.popitem(last=False)
        if request_id in self._seen:
            return False
        self._seen[request_id] = now + self.ttl
        return True

    def known(self, request_id: int, now: float | None = None) -> bool:
        """Whether ``request_id`` was added and has not expired (not thread-safe: callers lock)."""
        expires = self._seen.get(request_id)
        return expires is not None and expires >= (time.monotonic() if now is None else now)

    def __len__(self) -> int:
        return len(self._seen)


def initialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (which hivemind averages and hands to joining peers) without moving
    any parameter.

    hivemind does this with one optimizer step on zero gradients, which still applies weight decay: a silent
    extra step. Here that step runs with every learning rate at 0, and every state tensor it made is zeroed
    afterwards (weight decay on a zero gradient leaves ``wd x p`` in SGD's momentum and Adam's moments) and step
    counters reset, so the first real step is the same as in a plain torch optimizer (exactly so for Adam(W) and
    SGD without dampening, whose zero state equals a fresh one).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        for p in params:
            p.grad = zero_grad_view(p)
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
    with torch.no_grad():
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    value.zero_()
                elif key == "step":
                    state[key] = 0


class _LoadProbe(DecentralizedAverager):
    """Records whether the last state download got a state (hivemind's ``TrainingStateAverager`` only logs it)."""

    loaded = False

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None) -> Any:
        result = super().load_state_from_peers(wait=wait, timeout=timeout)
        self.loaded = result is not None
        return result


# averaging: a part whose norm exceeds this many times the median of the group's parts is dropped (groups of 3+)
OUTLIER_NORM_RATIO = 100.0


class _RobustPartReducer(TensorPartReducer):
    """hivemind's reducer of the slice of the averaged tensors this peer aggregates, guarded against hostile
    senders: a part that is not finite, or sent with a weight that is not a finite non-negative number, is
    dropped; so is, in groups of three senders or more, a part whose norm exceeds :data:`OUTLIER_NORM_RATIO`
    times the median norm of the parts of that slice. The slice's average is that of the remaining parts (every
    sender, the dropped ones included, gets it back). Dropped parts are logged as warnings."""

    def __init__(self, part_shapes: Any, num_senders: int, sender_names: list[Any]) -> None:
        self._stash: list[tuple[int, torch.Tensor, float]] = []
        self.sender_names = sender_names
        self.dropped = 0
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        self._stash = []
        super().reset_accumulators()

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        # hivemind's TensorPartReducer.accumulate_part, keeping the parts until the slice is complete
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            if tensor_part.shape != self.part_shapes[part_index]:
                raise AllreduceException(f"sender {sender_index} sent a part of the wrong shape")
            self._stash.append((sender_index, tensor_part, weight))
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await current_part_future

    def check_current_part_finished(self) -> None:
        if self.current_part_accumulated_from == self.num_current_senders:
            self.accumulator, self.denominator = self._robust_sum()
        super().check_current_part_finished()

    def _robust_sum(self) -> tuple[torch.Tensor, float]:
        kept, reasons = [], {}
        for sender, part, weight in self._stash:
            if not (math.isfinite(weight) and weight >= 0):
                reasons[sender] = f"weight {weight}"
            elif not all_finite(part):
                reasons[sender] = "NaN or infinite values"
            else:
                kept.append((sender, part, weight))
        weighted = [part for _, part, weight in kept if weight > 0]  # weight 0: a peer without samples
        if len(weighted) >= 3:
            norms = [float(part.float().norm()) for _, part, _ in kept]
            median = sorted(float(part.float().norm()) for part in weighted)[len(weighted) // 2]
            if median > 0:
                for (sender, _, _), norm in zip(kept, norms, strict=True):
                    if norm > OUTLIER_NORM_RATIO * median:
                        reasons[sender] = f"norm {norm:.3g}, {norm / median:.0f} times the group's median"
                kept = [item for item in kept if item[0] not in reasons]
        for sender, why in reasons.items():
            self.dropped += 1
            logger.warning(
                f"Averaging: dropped the part of peer {self.sender_names[sender]} ({why}); the others are "
                f"averaged without it"
            )
        accumulator = torch.zeros(self.part_shapes[self.current_part_index])
        denominator = 0.0
        for _, part, weight in kept:
            accumulator.add_(part, alpha=weight)
            denominator += weight
        self._stash = []
        if denominator <= 0:  # nothing usable: a zero average (hivemind would divide by zero)
            return accumulator, 1.0
        return accumulator, denominator


class _GuardedAllReduceRunner(AllReduceRunner):
    """hivemind's all-reduce with a :class:`_RobustPartReducer`, and the averaged slices that other peers send
    back checked: a reducer that returns NaN or infinite values counts as failed, so this peer keeps its own
    values for that slice (hivemind's handling of a reducer that drops out)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        plain = self.tensor_part_reducer
        self.tensor_part_reducer = _RobustPartReducer(
            plain.part_shapes, plain.num_senders, list(self.sender_peer_ids)
        )
        plain.num_senders = 0  # finalized unused: no "received 0% of input tensors" warning
        plain.finalize()
        container = self.tensor_part_container
        register = container.register_processed_part
        peer_ids = self.ordered_peer_ids

        def register_checked(peer_index: int, part_index: int, part: torch.Tensor) -> None:
            if not all_finite(part):
                logger.warning(
                    f"Averaging: peer {peer_ids[peer_index]} returned a non-finite average; keeping the local "
                    f"values of its slice"
                )
                raise AllreduceException(f"peer {peer_ids[peer_index]} returned a non-finite average")
            register(peer_index, part_index, part)

        container.register_processed_part = register_checked  # type: ignore[method-assign]


class _GuardedAveraging:
    """Runs a :class:`DecentralizedAverager`'s all-reduce rounds with :class:`_GuardedAllReduceRunner`."""

    async def _run_allreduce_inplace_(
        self, tensors: Any, group_info: Any, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        # hivemind's DecentralizedAverager._run_allreduce_inplace_ with another runner class
        group_id = group_info.group_id if group_id is None else group_id
        runner = _GuardedAllReduceRunner(
            p2p=self._p2p,  # type: ignore[attr-defined]
            servicer_type=type(self),
            prefix=self.prefix,  # type: ignore[attr-defined]
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        running = self._running_groups  # type: ignore[attr-defined]
        assert group_id in running, f"Group id {group_id} was not registered in _register_allreduce_group"
        running[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:  # type: ignore[attr-defined]
            async for tensor, update in azip(as_aiter(*tensors), runner):
                tensor.add_(update, alpha=self._averaging_alpha)  # type: ignore[attr-defined]
                self.last_updated = get_dht_time()
                self._state_updated.set()  # type: ignore[attr-defined]
        else:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")


class _StartsInAnyThread:
    """hivemind's averagers set SIGINT to be ignored in the *calling* process before they fork, so that the forked
    averager inherits it; only the main thread may do that, and a Ctrl-C that comes while the averager starts
    (a second or more) would be lost by the peer. These start from any thread without touching this process's
    SIGINT (a peer that migrates starts its new stage's averagers in a background thread); the forked averager
    ignores SIGINT itself, first thing (it is already in a process group of its own, see ``lifetime``). Free heap
    pages are handed back first (see ``footprint.release_free_memory``)."""

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        # hivemind has just moved the averaged tensors to shared memory (their private copies freed, still resident
        # in the heap): the forked averager would inherit those pages and keep them once this process reuses them
        release_free_memory()
        self.start()  # type: ignore[attr-defined]
        if await_ready:
            self.wait_until_ready(timeout)  # type: ignore[attr-defined]

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the peer stops its averagers itself, in order
        super().run()  # type: ignore[misc]


class _StateAverager(_StartsInAnyThread, _GuardedAveraging, TrainingStateAverager, _LoadProbe):
    """hivemind's state averager of a stage, telling whether a joiner's download succeeded, and serving downloads
    of a consistent state: hivemind increments the epoch before the optimizer step and reads the parameters
    without the optimizer's lock, so a download during a step could get the old parameters under the new epoch.
    Trainer-driven steps hold :func:`_state_lock` over the whole step; downloads take it too."""

    def get_current_state(self) -> Any:
        with _state_lock(self):
            return super().get_current_state()


def _state_lock(averager: Any) -> Any:
    """The lock that makes a stage's optimizer step and a download of its state exclusive (one per averager)."""
    lock = averager.__dict__.get("_swarm_state_lock")
    if lock is None:
        lock = averager.__dict__.setdefault("_swarm_state_lock", threading.RLock())
    return lock


@contextlib.contextmanager
def _seeded_rng(seed: int | None, device: torch.device) -> Iterator[list[bool]]:
    """Run the body with torch's CPU generator (and ``device``'s, if CUDA) seeded with ``seed``, restored
    afterwards (the server's own stream, and an in-process trainer's, do not move); ``None``: unseeded, as they
    are. Yields ``[drew]``, set on exit to whether the body drew random numbers from them."""
    cuda = device.type == "cuda" and torch.cuda.is_available()
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
    generators = [torch.default_generator] + ([torch.cuda.default_generators[index]] if cuda else [])
    drew = [False]
    with contextlib.ExitStack() as stack:
        if seed is not None:
            stack.enter_context(torch.random.fork_rng(devices=[] if index is None else [index]))
            for generator in generators:
                generator.manual_seed(seed)
        before = [generator.get_state() for generator in generators]
        yield drew
        drew[0] = any(
            not torch.equal(state, generator.get_state())
            for state, generator in zip(before, generators, strict=True)
        )


@contextlib.contextmanager
def _buffers_kept(module: nn.Module, training: bool) -> Iterator[None]:
    """Restore the module's buffers on exit (a recomputed train-mode forward must not update batch
    normalisation's running statistics a second time). All of them: batch norm's kernel updates its running
    statistics without bumping their version counter, so a change cannot be told cheaply. Eval mode: no copy."""
    saved = [(b, b.detach().clone()) for b in module.buffers()] if training else []
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def _leaves(inputs: Payload, device: torch.device) -> list[torch.Tensor]:
    """The inputs as autograd leaves on ``device``: floating tensors sent as requiring grad require it."""
    leaves = []
    for t in inputs.tensors:
        leaf = t.detach().to(device)
        if t.requires_grad and t.is_floating_point():
            leaf.requires_grad_(True)
        leaves.append(leaf)
    return leaves


class _Kept:
    """A forward kept for its backward: its input leaves, its outputs (with their autograd graph), the version
    of the served parameters it ran with, and how long it took."""

    __slots__ = ("leaves", "outputs", "version", "forward_s", "created")

    def __init__(
        self,
        leaves: list[torch.Tensor],
        outputs: list[torch.Tensor],
        version: int,
        forward_s: float,
        created: float,
    ) -> None:
        self.leaves, self.outputs, self.version = leaves, outputs, version
        self.forward_s, self.created = forward_s, created

    def matches(self, inputs: Payload, version: int) -> bool:
        """Whether a backward of ``inputs`` may use this forward: same parameters, same input shapes and dtypes,
        the same inputs requiring grad."""
        if version != self.version or len(inputs.tensors) != len(self.leaves):
            return False
        return all(
            t.shape == leaf.shape
            and t.dtype == leaf.dtype
            and (t.requires_grad and t.is_floating_point()) == leaf.requires_grad
            for t, leaf in zip(inputs.tensors, self.leaves, strict=True)
        )


def _all_finite(grads: list[torch.Tensor | None]) -> bool:
    """Whether every gradient is finite: one reduction per tensor (a sum is NaN or infinite when any element is,
    or when finite values are so large that they overflow, which is refused as well), one sync for all."""
    sums = [g.sum(dtype=torch.float32) for g in grads if g is not None and g.numel()]
    return not sums or bool(torch.isfinite(torch.stack(sums)).all())


def _exclusive(
    grads: list[torch.Tensor | None], others: tuple[torch.Tensor, ...]
) -> list[torch.Tensor | None]:
    """Parameter gradients that share no memory with each other nor with ``others`` (the input gradients sent
    back): autograd may hand one tensor to several inputs (``y = x + p`` gives ``x`` and ``p`` the same gradient),
    and the pending sum adds into the first backward's tensors in place. Shared or non-contiguous ones are copied."""
    seen = {t.untyped_storage().data_ptr() for t in others if t.numel()}
    out: list[torch.Tensor | None] = []
    for g in grads:
        if g is not None and g.numel():
            g = g.contiguous()  # an expanded gradient (``p.sum()`` gives one) cannot be added into in place
            ptr = g.untyped_storage().data_ptr()
            if ptr in seen:
                g = g.clone()
                ptr = g.untyped_storage().data_ptr()
            seen.add(ptr)
        out.append(g)
    return out


class _GradientAverager(_StartsInAnyThread, _GuardedAveraging, GradientAverager):
    """hivemind's gradient averager, startable from any thread, guarded against hostile contributions (see
    :class:`_RobustPartReducer`), and counting each backward the server sums into one optimizer step.

    hivemind takes the gradient of each ``step(batch_size)`` as one batch's mean gradient, scales it by its size
    relative to the round's first batch and divides the round's sum by the number of steps. The stage server
    hands it the *sum* of the backwards it served since its last step (one, or several that arrived together, or
    a merged backward): taken as one batch, they were counted ``n`` times over (and the others scaled down by the
    first step's size). Here the sum is added as it is and every backward counts once (:attr:`backwards`, set by
    the server before each step), so a round averages the backwards' gradients whatever their grouping, as
    accumulating gradients over batches does in one process.
    """

    backwards = 1

    def accumulate_grads_(self, batch_size: int) -> None:
        if self._anchor_batch_size is None:
            self._anchor_batch_size = batch_size
        self.local_samples_accumulated += batch_size
        self.local_times_accumulated += self.backwards
        for grad_buf, grad_acc in zip(self._grads_from_parameters(), self._grad_accumulators(), strict=True):
            grad_acc.add_(grad_buf.to(grad_acc.device))


_DRAIN_S = 2.0  # seconds a progress tracker's leftover tasks get to finish once cancelled


class _ProgressTracker(ProgressTracker):
    """hivemind's progress tracker, whose thread finishes its event loop's tasks before it ends.

    hivemind 1.1.12 stops the tracker's loop as soon as its two coroutines return, leaving the DHT lookup or store
    that was in flight at shutdown pending (the store cancelled, the lookup not); when the loop is garbage-collected,
    asyncio logs "Task was destroyed but it is pending!" at ERROR for each, often at interpreter exit. Here the
    leftovers are cancelled and run to their end (at most ``_DRAIN_S``), then the loop is closed.
    """

    def run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(asyncio.gather(self._progress_reporter(), self._progress_fetcher()))
        finally:
            try:
                leftovers = asyncio.all_tasks(loop)
                for task in leftovers:
                    task.cancel()
                if leftovers:
                    loop.run_until_complete(asyncio.wait(leftovers, timeout=_DRAIN_S))
                for task in leftovers:  # retrieved, or asyncio would log "exception was never retrieved"
                    if task.done() and not task.cancelled():
                        task.exception()
                loop.close()
            finally:
                self.shutdown_complete.set()


class HivemindOptimizer(hivemind.Optimizer):
    """``hivemind.Optimizer`` whose progress tracker finishes its tasks at shutdown (:class:`_ProgressTracker`)."""

    def _make_progress_tracker(self, target_batch_size: int, **kwargs: Any) -> ProgressTracker:
        return _ProgressTracker(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )


class _StageOptimizer(HivemindOptimizer):
    """hivemind's ``Optimizer`` with a :class:`_StateAverager`, which does not pre-schedule a gradient averaging
    round while its progress tracker sees no other peer of the stage: hivemind would run matchmaking for
    ``matchmaking_time`` before every step only to cancel it (no partner), costing the averager, DHT and p2p
    daemon CPU on every step. Once another peer reports progress, rounds are pre-scheduled as before; a round
    that was not pre-scheduled still starts at the step (hivemind's own fallback).

    Alone at the step with no round scheduled, hivemind 1.1.12 would step with the optimizer's last ``.grad``
    (here: the last batch handed over) instead of the epoch's accumulated gradients; it then takes the path of a
    round that found no partner instead, which loads the accumulated gradients (averaged over the backwards)."""

    def _maybe_schedule_gradient_averaging(self) -> None:
        if self.tracker.global_progress.num_peers <= 1:
            return
        super()._maybe_schedule_gradient_averaging()

    def _begin_averaging_gradients(self, grad_scaler: Any) -> bool:
        if (
            grad_scaler is None
            and self.scheduled_grads is None
            and self.tracker.global_progress.num_peers <= 1
        ):
            return True  # _average_gradients_and_load_into_optimizer(None): "no other peers", local gradients
        return super()._begin_averaging_gradients(grad_scaler)

    rounds = 0  # gradient averaging rounds completed with other peers

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control: Any) -> None:
        # hivemind logs a failed round at its status level (INFO) whatever the cause: a broken round is an ERROR
        if maybe_step_control is not None:
            try:
                maybe_step_control.result(self.averaging_timeout)
                self.rounds += 1
            except BaseException as e:
                if not _no_partner(e):
                    logger.error(f"{self.run_id}: averaging gradients failed: {e!r}; using local gradients")
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)

    def __init__(self, *args: Any, reuse_state_tensors: bool | None = None, **kwargs: Any) -> None:
        self._reuse_state_tensors = reuse_state_tensors  # None: hivemind's default
        super().__init__(*args, **kwargs)

    def _make_state_averager(self, **kwargs: Any) -> TrainingStateAverager:
        if self._reuse_state_tensors is not None:
            kwargs.setdefault("reuse_tensors", self._reuse_state_tensors)
        return _StateAverager(
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )


def _no_partner(error: BaseException) -> bool:
    """Whether an averaging round failed only because no partner showed up (expected now and then), as opposed
    to a broken round (shape mismatch, a reducer's exception, a peer that sent garbage)."""
    return "could not find a group" in str(error)


def _make_initialized(factory: OptimizerFactory, params: Any) -> torch.optim.Optimizer:
    optimizer = factory(params)
    initialize_optimizer_state(optimizer)
    share_optimizer_state(optimizer)
    return optimizer


def _dht_alive(dht: Any) -> bool:
    try:
        return bool(dht.is_alive())
    except (AssertionError, AttributeError):  # a DHT this process did not start: assume it lives
        return True


def _reply(reply: StageReply) -> runtime_pb2.ExpertResponse:
    """A one-message error reply."""
    return runtime_pb2.ExpertResponse(metadata=encode_reply_header(reply, None))


def _error(request_id: int, category: str, error: BaseException) -> StageReply:
    return StageReply(request_id, error=ErrorReply.from_exception(error, category))


def _request_id(header: bytes) -> int:
    """The request id of a header, or -1 if it cannot be read (the caller then sees a mismatched reply)."""
    try:
        fields = msgpack.unpackb(header, raw=False)
        return fields[2] if isinstance(fields, list) and len(fields) > 2 and type(fields[2]) is int else -1
    except Exception:
        return -1


def _outputs_payload(outputs: Any) -> Payload:
    """The stage's outputs as a payload; outputs that cannot travel are the stage's own error."""
    try:
        payload = Payload.flatten(outputs)
        for t in payload.tensors:
            check_encodable(t)
    except CodecError as e:
        raise _ComputeError(e) from e
    return payload
