"""Swarm client: how a trainer runs a pipeline stage somewhere in the swarm.

:meth:`SwarmClient.call_stage` is differentiable. Its forward picks one peer of the stage with the
:class:`~.routing.StageRouter` (stochastic wiring), sends the stage inputs there and returns the outputs; its
backward sends the saved stage *inputs* plus the output gradients to *any* live peer of the stage, which
recomputes the forward, accumulates its parameter gradients and returns the input gradients.

Failure handling lives here, in :meth:`SwarmClient.with_retries`: a call that the peer could not serve but
another peer may (no answer, a timeout, a malformed or non-finite reply, an error reply of category
``unavailable``: shutting down, out of memory, serving another stage) is retried on another peer of the stage
and the failing peer is banned with exponential backoff; when a stage has no live peer the client polls the
DHT for up to ``no_peers_timeout`` seconds, then raises :class:`~.routing.NoPeersError`. An error that every
peer would give is raised to the caller at once, with the remote message, and bans nobody: one raised by the
stage's own code (with the remote type, see :class:`~.protocol.RemoteStageError`), and a refusal of the
request's own content (:class:`~.protocol.RequestRefused`: NaN in an input, a schema mismatch, too large...).

Every call carries the trainer's mode (``swarm_training``, which the proxies of :mod:`.partition` take from
their ``.training``) and a random seed drawn per forward and repeated by its backward, so that a backward
recomputed on any peer replays the forward's dropout masks (see :mod:`.protocol`).

Requests go through a transport (:mod:`.transport`): the in-process server for a stage this peer hosts,
channels over a Unix socket to a peer on this machine (:mod:`.same_host`), P2P channels for the others.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import random
import secrets
import threading
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable
from typing import Any, TypeVar

import hivemind
import msgpack
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from lightning_swarm.swarm.client.chunking import Unmergeable, chunked_call, split_plan
from lightning_swarm.swarm.client.commands import StageCommands
from lightning_swarm.swarm.client.deferred_grads import ChunkPool, DeferredGrads
from lightning_swarm.swarm.client.discovery import StageDiscovery
from lightning_swarm.swarm.client.pipelining import PipelineRun
from lightning_swarm.swarm.client.routing import NoPeersError, StageRouter
from lightning_swarm.swarm.client.stage_autograd import DUMMY, StageCall, StageFunction, moved
from lightning_swarm.swarm.dht.reachability import dial_relayed
from lightning_swarm.swarm.dht.records import PeerInfo
from lightning_swarm.swarm.lifetime import PeerStopping
from lightning_swarm.swarm.loop import get_loop, in_loop_thread, replicate_p2p, run_coroutine
from lightning_swarm.swarm.settings import SwarmSettings
from lightning_swarm.swarm.training.early_steps import OpenGradCalls
from lightning_swarm.swarm.wire.codec import CodecError, check_encodable
from lightning_swarm.swarm.wire.errors import ProtocolError, RemoteStageError, remote_exception
from lightning_swarm.swarm.wire.guards import check_outputs
from lightning_swarm.swarm.wire.payload import EncodedPayload, Payload
from lightning_swarm.swarm.wire.protocol import (
    SEED_BITS,
    StageRequest,
    StageService,
    encode_request_header,
    fp32_bytes,
    stage_uid,
    warm_up_codec,
)
from lightning_swarm.swarm.wire.same_host import SameHostStub, socket_path
from lightning_swarm.swarm.wire.transport import (
    LocalTransport,
    P2PTransport,
    call_lean,
    decode_payload_stream,
    encode_request,
)

__all__ = ["SwarmClient"]

logger = logging.getLogger(__name__)


T = TypeVar("T")
# a backward's gradients are applied only if the server finishes it within the first 80% of its attempt's timeout
COMMIT_MARGIN = 0.2
# Attempt timeouts adapt to the stage: when the stage has another live peer to retry on, a call that takes
# SLOW_FACTOR times longer than the slowest of the stage's last RECENT_CALLS calls of its kind (and at least
# MIN_ATTEMPT_TIMEOUT_S) is given up and retried there. A SIGKILLed peer then costs seconds, not request_timeout
# (a dead peer's stream is not always reset: the call just never returns). Before RECENT_CALLS / 4 calls were
# seen, and whenever the peer is the stage's only one, an attempt may take the full request_timeout.
SLOW_FACTOR = 10.0
MIN_ATTEMPT_TIMEOUT_S = 3.0
RECENT_CALLS = 32
_OUTPUT_SHAPES = 256  # input shapes per stage whose output shapes a client remembers


class SwarmClient:
    """Runs pipeline stages on the peers of a swarm, with routing, retries and traffic counters.

    The client owns its parts: ``discovery`` (:class:`~.discovery.StageDiscovery`: who serves each stage, from the
    DHT) and ``commands`` (:class:`~.commands.StageCommands`: optimizer step commands and optimizer states), which
    it hands its routers and its calls with retries.

    Args:
        dht: this peer's running hivemind DHT.
        settings: the swarm's settings (``run_id``, ``num_stages``, ``compression`` of what this client sends,
            ``request_timeout``, ``no_peers_timeout``, ``ban_base_s``, ``refresh_period``).
        local_servers: stage servers living in this process, by stage (objects with ``handle``, ``info`` and
            ``state_dict_local``); calls routed to this peer use them directly.
        check_outputs: a forward reply whose tensors differ in count, dtype or shape from what the stage answered
            before to inputs of the same dtypes and shapes is a failure of its peer; turn off for stages whose
            output shapes do not follow from their input shapes. Replies with NaN/Inf and malformed input
            gradients always count as failures.
        should_stop: polled before every attempt and while waiting for a stage's peers; once it returns True
            (the peer got SIGTERM), the call raises :class:`~.routing.PeerStopping` instead of waiting on.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        settings: SwarmSettings,
        local_servers: dict[int, Any] | None = None,
        check_outputs: bool = True,
        should_stop: Callable[[], bool] | None = None,
    ):
        self.dht, self.settings = dht, settings
        self.should_stop = should_stop or (lambda: False)
        self.run_id, self.num_stages = settings.run_id, settings.num_stages
        self.local_servers = dict(local_servers or {})
        self.peer_id: PeerID = dht.peer_id
        self.routers = [
            StageRouter(k, run_id=self.run_id, ban_base_s=settings.ban_base_s) for k in range(self.num_stages)
        ]
        self._transports: dict[tuple[PeerID, int], Any] = {}
        self._p2p: P2P | None = None
        # unique across trainers: a server remembers the ids of the backwards it applied
        self._request_ids = itertools.count(secrets.randbits(62))
        # each stage's optimizer epoch as its peers replied to this trainer's last step command (trainer-driven steps;
        # the peer fills it): every call carries it, and a peer behind it catches up before serving
        self.stage_epochs: dict[int, int] = {}
        # per-forward seeds of the stages' random number generators, from a generator of its own (drawing them
        # must not move the trainer's torch generators) seeded from torch's: a run under seed_everything(s)
        # draws the same dropout masks each time; trainers of a local swarm differ by their rank
        rank = f"{os.environ.get('NODE_RANK', '0')}/{os.environ.get('LOCAL_RANK', '0')}"
        self._seeds = random.Random(f"{torch.initial_seed()}/{rank}")
        self._lock = threading.Lock()
        self._transport_lock = threading.Lock()
        self.router_lock = threading.Lock()
        self.discovery = StageDiscovery(
            dht, settings, self.routers, self.router_lock, self.should_stop, on_found=self._reach_relayed
        )
        self.commands = StageCommands(self)
        self._counters: dict[str, float] = defaultdict(float)
        # durations of recent successful remote calls, by (stage, kind): what the attempt timeouts adapt to
        self._recent: dict[tuple[int, str], deque[float]] = defaultdict(lambda: deque(maxlen=RECENT_CALLS))
        # per stage, input shapes -> the output shapes its replies had (a reply unlike that is a peer failure)
        self._output_shapes: list[OrderedDict] = [OrderedDict() for _ in range(self.num_stages)]
        self.check_outputs = check_outputs
        # "16-mixed": gradients are loss-scaled, so an overflow (inf/NaN) is expected now and then; the step is then
        # skipped (see SwarmStrategy). Set by the strategy; counts the backwards that met non-finite values.
        self.loss_scaled = False
        # whether stage calls may be cut into chunks (see .chunking); off for a pipeline that mixes rows
        self.chunking = True
        self._whole_stages: set[int] = set()  # stages whose outputs cannot be joined from chunks ("auto")
        # per calling thread: the chunks of its latest chunked call, on through the stages (a run continues only
        # the calls of the thread that opened it; threads sharing a client must not close each other's runs)
        self._runs = threading.local()
        self.nonfinite_backwards = 0
        # whether this trainer's train-mode stage calls update the stages' buffers (batch normalisation's running
        # statistics): with several trainers only the step's leader's do, as only DDP's rank 0 decides the buffers
        # (set at each step by the peer, see .peer.steps)
        self.updates_buffers = True
        # the differentiable calls of the training step whose backward has not returned (see .early_steps)
        self.grad_calls = OpenGradCalls()
        self.deferred_grads = DeferredGrads()  # set active by the strategy (see .deferred_grads)
        self.chunk_pool = ChunkPool()  # the threads of chunk calls and deferred backwards
        warm_up_codec(settings.compression)  # the first call's timeout must not pay for loading the kernels

    # ---- public API ----

    def call_stage(self, stage: int, /, *args: Any, swarm_training: bool = True, **kwargs: Any) -> Any:
        """Run stage ``stage`` on ``(*args, **kwargs)`` somewhere in the swarm; differentiable.

        Every floating tensor argument that requires grad receives its gradient; the stage's parameters are
        trained on the servers. Outputs have the structure the stage module returns. Tensors that do not
        require grad are data (masks, token ids) and travel untouched.

        Args:
            swarm_training: keyword only (not passed to the stage): run the stage in training mode (default, as
                a freshly built module) or in eval mode (dropout off, batch normalisation with its running
                statistics); the pipeline's proxies pass their ``.training``.
        """
        self.check_stage(stage)
        if type(swarm_training) is not bool:
            raise TypeError(f"SwarmClient.call_stage: swarm_training must be a bool, got {swarm_training!r}")
        inputs = Payload.call(args, kwargs)
        for t in inputs.tensors:  # the caller's mistake, not a peer's: raise it before any peer is tried
            check_encodable(t)
        inputs.metadata()
        device = inputs.tensors[0].device if inputs.tensors else torch.device("cpu")
        run, self._pipeline_run = self._pipeline_run, None
        if run is not None and run.joins(stage, inputs, swarm_training):
            # the chunks are already on their way through this stage (see .pipelining)
            self._pipeline_run = run
            return run.call(stage)
        if run is not None:
            run.close()
        chunks, plan = self._chunking(stage, inputs)
        if chunks > 1 and plan is not None:
            try:
                # its output may be the next stage's first argument
                if args and isinstance(args[0], torch.Tensor):
                    run = PipelineRun(
                        self, stage, inputs, plan, chunks, device, swarm_training, self.settings.num_stages
                    )
                    self._pipeline_run = run
                    return run.call(stage)
                seeds = [self._seeds.getrandbits(SEED_BITS) for _ in range(chunks)]
                return chunked_call(self, stage, inputs, plan, chunks, device, swarm_training, seeds)
            except Unmergeable as e:
                if self._pipeline_run is not None:
                    self._pipeline_run.close()
                self._pipeline_run = None
                if self.settings.microbatches != "auto":
                    raise
                self._whole_stages.add(stage)
                logger.info(f"{e} Stage {stage}'s calls are sent whole from now on (microbatches='auto').")
        seed = self._seeds.getrandbits(SEED_BITS)
        if not torch.is_grad_enabled():
            outputs = self.forward_no_grad(stage, inputs, swarm_training, seed)
            return outputs.rebuild([moved(t, device) for t in outputs.tensors])
        call = StageCall(self, stage, inputs, device, swarm_training, seed)
        diff_inputs = [t for t, mark in zip(inputs.tensors, call.marks, strict=True) if mark]
        flat_outputs = StageFunction.apply(call, DUMMY, *diff_inputs)
        return call.output_skeleton.rebuild(list(flat_outputs))

    @property
    def _pipeline_run(self) -> PipelineRun | None:
        return getattr(self._runs, "run", None)

    @_pipeline_run.setter
    def _pipeline_run(self, run: PipelineRun | None) -> None:
        self._runs.run = run

    def next_seed(self) -> int:
        """A dropout seed for one stage call (replayed by its backward)."""
        return self._seeds.getrandbits(SEED_BITS)

    def forward_no_grad(self, stage: int, inputs: Payload, training: bool, seed: int) -> Payload:
        """A forward of ``stage`` on ``inputs`` outside autograd (no backward follows), with retries."""
        request = StageRequest(
            "forward",
            stage_uid(self.run_id, stage),
            inputs,
            training=training,
            seed=seed,
            buffers=self.updates_buffers,
        )
        outputs, _ = self.send(stage, request, check=self.output_check(stage, inputs))
        return outputs

    def _chunking(self, stage: int, inputs: Payload) -> tuple[int, list[bool] | None]:
        """How many chunks a call of ``stage`` on ``inputs`` is cut into (see :mod:`.chunking`), and which tensors
        are split."""
        setting = self.settings.microbatches if self.chunking and stage not in self._whole_stages else 1
        if setting == 1:
            return 1, None
        plan = split_plan(inputs.tensors)
        if plan is None:
            return 1, None
        if setting == "auto":  # a chunk per online peer of the stage, or whole while other calls are out
            with self.router_lock:
                busy = any(router.calls_in_flight() for router in self.routers)
            chunks = 1 if busy else max(1, len(self.live_peers(stage)))
        else:
            chunks = int(setting)
        return min(chunks, inputs.tensors[0].shape[0]), plan

    def _reach_relayed(self, peers: list[PeerInfo]) -> None:
        """Connect this peer's daemon, in the background, to the peers among ``peers`` that are behind NAT, through
        the relays their records name: calls by peer id then find the connection (a no-op when connected; a
        relayed connection that was cut is opened again at the next lookup)."""
        relayed = [(p.peer_id, p.relay_addrs) for p in peers if p.relay_addrs and p.peer_id != self.peer_id]
        if not relayed:
            return
        with self._transport_lock:  # the P2P replica the transports share
            if self._p2p is None and not in_loop_thread():
                self._p2p = run_coroutine(replicate_p2p(self.dht), timeout=60)
            p2p = self._p2p
        if p2p is not None:
            asyncio.run_coroutine_threadsafe(dial_relayed(p2p, relayed), get_loop())

    def peers(self, stage: int) -> list[PeerInfo]:
        """The live peers of ``stage`` (one fresh DHT lookup)."""
        self.check_stage(stage)
        return self.discovery.lookup(stage)

    def fetch_stage_state(self, stage: int) -> dict[str, torch.Tensor]:
        """The current ``state_dict`` of stage ``stage``, from a live peer of it (or the local server): with
        trainer-driven steps the one with the newest epoch, if it answers."""
        self.check_stage(stage)

        def attempt(peer_id: PeerID) -> dict[str, torch.Tensor]:
            if peer_id == self.peer_id and stage in self.local_servers:
                return self.local_servers[stage].state_dict_local()
            request = runtime_pb2.ExpertUID(uid=stage_uid(self.run_id, stage))
            stub = self.transport(peer_id, stage).stub

            async def fetch() -> list[runtime_pb2.ExpertResponse]:
                return [message async for message in await stub.rpc_state(request)]

            responses = self.run_rpc(fetch())
            self._count(stage, "state", 0, sum(response.ByteSize() for response in responses))
            state = decode_payload_stream(responses).rebuild()
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise CodecError(f"Peer {peer_id} sent a malformed state of stage {stage}")
            return state

        return self.with_retries(stage, 1.0, attempt, timed=False, prefer=self.most_current_peer(stage))

    def live_peers(self, stage: int) -> list[PeerID]:
        """The peers of ``stage`` that are not banned, as last looked up (see :meth:`~.discovery.StageDiscovery.live_peers`)."""
        return self.discovery.live_peers(stage)

    def stage_info(self, stage: int) -> list[dict[str, Any]]:
        """``rpc_info`` of every live peer of ``stage`` (peers that fail to answer are skipped)."""
        return [info for _, info in self._stage_infos(stage)]

    def _stage_infos(
        self, stage: int, peer_ids: list[PeerID] | None = None, timeout: float | None = None
    ) -> list[tuple[PeerID, dict[str, Any]]]:
        """(peer, ``rpc_info``) of every peer of ``stage`` in its records (or of ``peer_ids``) that answered with a
        well-formed reply within ``timeout`` (default ``request_timeout``)."""
        if peer_ids is None:
            peer_ids = [peer.peer_id for peer in self.peers(stage)]
        timeout = self.settings.request_timeout if timeout is None else timeout
        infos = []
        for peer_id in peer_ids:
            if peer_id == self.peer_id and stage in self.local_servers:
                infos.append((peer_id, self.local_servers[stage].info()))
                continue
            try:
                request = runtime_pb2.ExpertUID(uid=stage_uid(self.run_id, stage))
                stub = self.transport(peer_id, stage).stub
                reply = self.run_rpc(stub.rpc_info(request, timeout=timeout))
                info = msgpack.unpackb(reply.serialized_info)
                if not isinstance(info, dict) or info.get("stage") != stage:
                    raise ProtocolError(f"malformed rpc_info reply {str(info)[:100]}")
                infos.append((peer_id, info))
            except Exception as e:
                logger.debug(f"Peer {peer_id} of stage {stage} did not answer rpc_info: {e!r}")
        return infos

    def most_current_peer(self, stage: int) -> PeerID | None:
        """With trainer-driven steps: the live peer of ``stage`` with the newest optimizer epoch. A peer that missed
        the trainer's last step holds the values from before it until a call makes it catch up (see
        ``StageServer.catch_up_for_call``), so a state is fetched from the newest peer first."""
        if stage not in self.stage_epochs:
            return None
        # the live peers only, each given a few seconds: a peer that does not answer is not asked for the state first
        infos = self._stage_infos(stage, self.live_peers(stage), min(5.0, self.settings.request_timeout))
        epochs = [(info["epoch"], peer_id) for peer_id, info in infos if type(info.get("epoch")) is int]
        return max(epochs, key=lambda pair: pair[0])[1] if epochs else None

    def set_local_server(self, stage: int, server: Any | None) -> None:
        """Serve ``stage`` from ``server`` in this process, or no longer (``None``): for a peer that migrates."""
        with self._transport_lock:
            if server is None:
                self.local_servers.pop(stage, None)
            else:
                self.local_servers[stage] = server
            transport = self._transports.pop((self.peer_id, stage), None)
        if transport is not None:
            transport.close()

    def stats(self) -> dict[str, float]:
        """Traffic and failure counters, e.g. ``swarm/bytes_sent`` and ``swarm/stage0/forward_bytes_recv``."""
        with self._lock:
            return dict(self._counters)

    def shutdown(self) -> None:
        """Close this client's channels and P2P connection (idempotent)."""
        p2p, self._p2p = self._p2p, None
        self.chunk_pool.shutdown()
        with self._transport_lock:
            transports, self._transports = list(self._transports.values()), {}
        for transport in transports:
            transport.close()
        if p2p is not None:
            try:
                run_coroutine(p2p.shutdown(), timeout=10)
            except Exception as e:
                logger.debug(f"SwarmClient: error while closing P2P: {e!r}")

    # ---- one call with retries ----

    def send(
        self,
        stage: int,
        request: StageRequest,
        reuse: EncodedPayload | None = None,
        check: Callable[[Payload], None] | None = None,
        keep: bool = False,
        prefer: PeerID | None = None,
        served: list[PeerID] | None = None,
    ) -> tuple[Payload, EncodedPayload | None]:
        """Serve ``request`` on some peer of ``stage``; returns the reply's payload and the encoded inputs.

        The request is encoded at most once, by the first remote attempt (``reuse``: the inputs as the forward
        encoded them, for a backward); each attempt only renews the header, whose ``commit_by`` deadline leaves
        the last ``COMMIT_MARGIN`` of ``request_timeout`` for the reply to travel back (a backward the server
        finishes later is not applied: this attempt has timed out and the call moves on). Every attempt carries
        the same request id. ``check`` validates the reply; if it raises, the peer counts as failed. ``keep``: a
        forward that asks its server to keep its activations (``forward_id``, see :mod:`.protocol`); ``prefer``:
        the peer to try first if it is live (a backward's forward peer); ``served`` receives the peer that
        answered.
        """
        request.request_id = next(self._request_ids)
        if request.epoch is None:
            request.epoch = self.stage_epochs.get(stage)
        if keep:
            request.forward_id = request.request_id
        encoded: list[Any] = [None]
        lean_to = prefer if request.kind == "backward" and request.forward_id is not None else None

        def attempt(peer_id: PeerID) -> Payload:
            transport = self.transport(peer_id, stage)
            remote = isinstance(transport, P2PTransport)
            timeout = self._attempt_timeout(stage, request.kind) if remote else None
            lean = remote and peer_id == lean_to
            if remote:
                if encoded[0] is None:
                    encoded[0] = encode_request(request, self.settings.compression, reuse_inputs=reuse)
                if request.kind == "backward":
                    assert timeout is not None
                    request.commit_by = time.time() + (1 - COMMIT_MARGIN) * timeout
                    payloads = encoded[0][1]
                    encoded[0] = (encode_request_header(request, *payloads), payloads)
            else:
                request.commit_by = None  # in-process: the call cannot time out
            started = time.monotonic()
            if lean:  # to the forward's peer, without the inputs it kept (see .protocol)
                reply, sent, recv, lean = call_lean(transport, request, encoded[0], timeout)
            else:
                reply, sent, recv = transport.call(request, encoded[0], timeout=timeout)
            if remote and reply.error is None:
                self._recent[stage, request.kind].append(time.monotonic() - started)
            if sent or recv:
                self._count(stage, request.kind, sent, recv, fp32_bytes(request, reply, lean))
            if reply.error is not None:
                raise remote_exception(reply.error, stage, peer_id)
            if request.kind == "forward" and not reply.kept:  # its backward brings the inputs (see .protocol)
                request.forward_id = None
            assert reply.outputs is not None
            if check is not None:
                check(reply.outputs)
            if served is not None:
                served.append(peer_id)
            return reply.outputs

        assert request.inputs is not None
        outputs = self.with_retries(stage, request.inputs.batch_size(), attempt, prefer=prefer)
        return outputs, (None if encoded[0] is None else encoded[0][1][0])

    def _attempt_timeout(self, stage: int, kind: str) -> float:
        """Seconds one remote attempt of a ``kind`` call to ``stage`` may take (see ``SLOW_FACTOR``)."""
        full = self.settings.request_timeout
        recent = self._recent.get((stage, kind))
        if not recent or len(recent) < RECENT_CALLS // 4:
            return full
        with self.router_lock:
            others = self.routers[stage].num_live() > 1
        if not others:
            return full
        return min(full, max(MIN_ATTEMPT_TIMEOUT_S, SLOW_FACTOR * max(recent)))

    def output_check(self, stage: int, inputs: Payload) -> Callable[[Payload], None]:
        """Validates a forward reply of ``stage`` to ``inputs``: no NaN, no infinity except in an output that is
        one of the data inputs passed back (:func:`~.protocol.check_outputs`), and, once the stage has answered
        inputs of the same dtypes and shapes before, outputs of the same count, dtypes and shapes as then (every
        peer of a stage runs the same module; up to ``_OUTPUT_SHAPES`` input shapes are remembered per stage). A
        reply that fails counts as a failure of its peer (retried elsewhere, banned)."""
        key = tuple((t.dtype, tuple(t.shape)) for t in inputs.tensors)

        def check(outputs: Payload) -> None:
            check_outputs(outputs.tensors, inputs.tensors, f"stage {stage} output", ProtocolError)
            if not self.check_outputs:
                return
            shapes = tuple((t.dtype, tuple(t.shape)) for t in outputs.tensors)
            with self._lock:
                known = self._output_shapes[stage]
                expected = known.get(key)
                if expected is None:
                    known[key] = shapes
                    while len(known) > _OUTPUT_SHAPES:
                        known.popitem(last=False)
                    return
            if expected != shapes:
                raise ProtocolError(
                    f"stage {stage} replied with outputs {_describe(shapes)} to inputs {_describe(key)}, which "
                    f"its peers answered with {_describe(expected)}"
                )

        return check

    def with_retries(
        self,
        stage: int,
        task_size: float,
        attempt: Callable[[PeerID], T],
        timed: bool = True,
        prefer: PeerID | None = None,
    ) -> T:
        """Run ``attempt(peer)`` on a peer of ``stage`` chosen by its router, with retries: a peer whose attempt
        fails (except with an error every peer would give) is banned and another is tried; with no live peer left
        the stage is looked up again until ``no_peers_timeout``, then :class:`~.routing.NoPeersError`. ``timed``:
        the call's time counts towards the peer's measured speed; ``prefer``: the peer to try first if live."""
        router = self.routers[stage]
        deadline = time.monotonic() + self.settings.no_peers_timeout
        failed: set[PeerID] = set()
        last_error: BaseException | None = None
        while True:
            if self.should_stop():
                raise PeerStopping(f"stage {stage} call abandoned: this peer is stopping")
            self.discovery.refresh(stage)
            try:
                # chosen and counted in flight at once: the next choice sees this call
                with self.router_lock:
                    peer_id = router.choose(task_size, exclude=failed, prefer=prefer)
                    router.call_started(peer_id)
            except NoPeersError as e:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    message = f"{e} Waited {self.settings.no_peers_timeout:.1f} s (no_peers_timeout)."
                    if last_error is not None:
                        message += f" Last error from a peer: {last_error!r}"
                    raise NoPeersError(message) from last_error
                failed.clear()  # everyone failed once: after a refresh, allow retrying unbanned peers
                self.discovery.refresh(
                    stage, block=True, max_wait=min(self.settings.refresh_period, remaining)
                )
                continue
            try:
                try:
                    result = attempt(peer_id)
                finally:
                    with self.router_lock:
                        busy = router.call_ended(peer_id)
            except (KeyboardInterrupt, SystemExit):
                raise
            except RemoteStageError as e:
                # the stage's own code failed, or the request was refused for its content: the same on every peer
                if e.is_caller_error:
                    with self.router_lock:
                        router.report_success(peer_id)
                    raise
                last_error = e
            except Exception as e:
                last_error = e
            else:
                # the peer's busy time this call accounts for bounds its announced throughput (routing.py)
                with self.router_lock:
                    router.report_success(peer_id, task_size if timed else 0.0, busy)
                return result
            with self.router_lock:
                duration = router.ban(peer_id)
            failed.add(peer_id)
            self._count_failure(stage)
            logger.warning(
                f"Stage {stage} call to peer {peer_id} failed ({last_error!r}); banned it for {duration:.0f} s and "
                f"retrying"
            )

    def transport(self, peer_id: PeerID, stage: int) -> Any:
        """How to reach ``stage`` on ``peer_id``: the in-process server if it is this peer, channels over its
        same-host socket if it listens on one here, else P2P channels."""
        key = (peer_id, stage)
        transport = self._transports.get(key)
        if transport is None:
            with self._transport_lock:  # threads calling at once must share one P2P connection
                transport = self._transports.get(key)
                if transport is None:
                    if peer_id == self.peer_id and stage in self.local_servers:
                        transport = LocalTransport(self.local_servers[stage])
                    else:
                        uid = stage_uid(self.run_id, stage)
                        path = socket_path(peer_id, uid) if self.settings.same_host else None
                        stub: Any = StageService.get_stub
                        if path is not None and os.path.exists(path):  # the peer is on this machine
                            stub = functools.partial(SameHostStub.factory, path, self.peer_id)
                        if self._p2p is None:
                            self._p2p = run_coroutine(replicate_p2p(self.dht), timeout=60)
                        timeout = self.settings.request_timeout
                        transport = P2PTransport(
                            self._p2p, peer_id, uid, stub, timeout, stop=self.should_stop
                        )
                    self._transports[key] = transport
        return transport

    def run_rpc(self, coro: Any) -> Any:
        """Run an RPC's coroutine on the process's event loop, within ``request_timeout``."""
        timeout = self.settings.request_timeout
        return run_coroutine(asyncio.wait_for(coro, timeout), timeout=timeout + 5)

    # ---- counters ----

    def _count(self, stage: int, kind: str, sent: int, recv: int, fp32: int = 0) -> None:
        with self._lock:
            c = self._counters
            c["swarm/fp32_bytes"] += fp32
            c["swarm/bytes_sent"] += sent
            c["swarm/bytes_recv"] += recv
            c[f"swarm/stage{stage}/bytes_sent"] += sent
            c[f"swarm/stage{stage}/bytes_recv"] += recv
            c[f"swarm/stage{stage}/{kind}_bytes_sent"] += sent
            c[f"swarm/stage{stage}/{kind}_bytes_recv"] += recv
            c[f"swarm/stage{stage}/{kind}_calls"] += 1

    def _count_failure(self, stage: int) -> None:
        with self._lock:
            self._counters["swarm/retries"] += 1
            self._counters["swarm/bans"] += 1
            self._counters[f"swarm/stage{stage}/retries"] += 1

    def check_stage(self, stage: int) -> None:
        """Raise a ``ValueError`` unless ``stage`` is one of the swarm's stages."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"SwarmClient: stage must be in [0, {self.num_stages}), got {stage}")


def _describe(shapes: tuple) -> str:
    return "[" + ", ".join(f"{str(dtype).removeprefix('torch.')}{list(s)}" for dtype, s in shapes) + "]"
