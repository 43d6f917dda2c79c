"""Swarm client: how a trainer runs a pipeline stage somewhere in the swarm.

:meth:`SwarmClient.call_stage` is differentiable. Its forward picks one peer of the stage with the
:class:`~.routing.StageRouter` (stochastic wiring), sends the stage inputs there and returns the outputs; its
backward sends the saved stage *inputs* plus the output gradients to *any* live peer of the stage, which
recomputes the forward, accumulates its parameter gradients and returns the input gradients. A failed or
timed-out call is retried on another peer of the stage and the failing peer is banned with exponential
backoff. When a stage has no live peer the client polls the DHT for up to ``no_peers_timeout`` seconds, then
raises :class:`~.routing.NoPeersError`.

Calls whose chosen peer is this very process (libp2p cannot dial itself) go straight to the local
:class:`~.server.StageServer` object, without serialisation.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import hivemind
import msgpack
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PHandlerError
from hivemind.proto import runtime_pb2
from hivemind.utils.mpfuture import MPFuture

from . import _wire
from ._loop import get_loop, replicate_p2p, run_coroutine
from .codec import (
    CodecError,
    LazyPack,
    PartsDecoder,
    check_compression,
    decode_parts,
    flatten_tensors,
    rebuild_call,
    rebuild_tensors,
    remember_wire_format,
)
from .records import PeerInfo, parse_stage_peers, stage_key
from .routing import NoPeersError, StageRouter
from .server import StageServer, backward_metadata, batch_size_of, check_run_id, stage_uid

__all__ = ["SwarmClient"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_RESPONSE_TOO_LARGE = "response size exceeds message size limit"
# Payloads over hivemind's unary limit are streamed (pipelined). Below it, one message is faster on a small box:
# while choosing this design, a pipelined 1 MiB hop measured 17 ms on 2 cores against 11 ms as one message, since
# the sender's and receiver's threads and both p2p daemons all compete for the cores.
_STREAM_ABOVE = _wire.MAX_UNARY_PAYLOAD_SIZE - 64 * 1024
_END = object()
# makes every stage call part of the autograd graph, so that stages whose inputs need no grad still train
_DUMMY = torch.empty(0, requires_grad=True)


class SwarmClient:
    """Runs pipeline stages on the peers of a swarm, with routing, retries and traffic counters.

    Args:
        dht: this peer's running hivemind DHT.
        run_id: the swarm's run id.
        num_stages: number of pipeline stages.
        compression: boundary compression of the activations and gradients this client sends:
            "8bit", "fp16" or "none".
        local_servers: stage servers living in this process, by stage; calls routed to this peer use them
            directly.
        request_timeout: seconds before a call to a peer counts as failed (it is retried elsewhere).
        no_peers_timeout: seconds to wait for a live peer of a stage before raising ``NoPeersError``.
        ban_base_s: first ban of a failing peer in seconds, doubled on each consecutive failure.
        refresh_period: seconds between DHT lookups of a stage's peers.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        num_stages: int,
        *,
        compression: str = "8bit",
        local_servers: dict[int, StageServer] | None = None,
        request_timeout: float = 30.0,
        no_peers_timeout: float = 60.0,
        ban_base_s: float = 15.0,
        refresh_period: float = 2.0,
    ):
        if num_stages <= 0:
            raise ValueError(f"SwarmClient: num_stages must be positive, got {num_stages}")
        self.dht, self.num_stages = dht, num_stages
        self.run_id = check_run_id(run_id, "SwarmClient")
        self.compression = check_compression(compression)
        self.local_servers = dict(local_servers or {})
        self.request_timeout, self.no_peers_timeout = request_timeout, no_peers_timeout
        self.refresh_period = refresh_period
        self.peer_id: PeerID = dht.peer_id
        self.routers = [StageRouter(k, run_id=run_id, ban_base_s=ban_base_s) for k in range(num_stages)]
        self._last_refresh = [-float("inf")] * num_stages
        self._pending: list[MPFuture | None] = [None] * num_stages
        self._stream_stages: set[int] = set()  # stages whose responses exceeded the unary limit
        self._stubs: dict[tuple[PeerID, int], Any] = {}
        self._channels: dict[tuple[PeerID, int], _Channel] = {}
        self._p2p: P2P | None = None
        self._lock = threading.Lock()
        self._stub_lock = threading.Lock()
        self._router_lock = threading.Lock()
        self._counters: dict[str, float] = defaultdict(float)

    # ---- public API ----

    def call_stage(self, stage: int, *args: Any, **kwargs: Any) -> Any:
        """Run stage ``stage`` on ``(*args, **kwargs)`` somewhere in the swarm; differentiable.

        Every floating tensor argument that requires grad receives its gradient; the stage's parameters are
        trained on the servers. Outputs have the structure the stage module returns.
        """
        self._check_stage(stage)
        tensors, skeleton = flatten_tensors((args, kwargs))
        if not torch.is_grad_enabled():
            outputs = self._forward(stage, args, kwargs)[0]
            out_tensors, out_skeleton = flatten_tensors(outputs)
            device = _device_of(tensors)
            return rebuild_tensors(out_skeleton, [t.to(device) for t in out_tensors])
        marks = [t.requires_grad and t.is_floating_point() for t in tensors]
        call = _StageCall(self, stage, skeleton, tensors, marks)
        diff_inputs = [t for t, mark in zip(tensors, marks, strict=True) if mark]
        flat_outputs = _StageFunction.apply(call, _DUMMY, *diff_inputs)
        return rebuild_tensors(call.output_skeleton, list(flat_outputs))

    def peers(self, stage: int) -> list[PeerInfo]:
        """The live peers of ``stage`` (one fresh DHT lookup)."""
        self._check_stage(stage)
        found = self.dht.get(stage_key(self.run_id, stage), latest=True)
        peers = parse_stage_peers(found, stage)
        with self._router_lock:
            self.routers[stage].update_peers(peers)
        self._last_refresh[stage] = time.monotonic()
        return peers

    def fetch_stage_state(self, stage: int) -> dict[str, torch.Tensor]:
        """The current ``state_dict`` of stage ``stage``, from any live peer of it (or the local server)."""
        self._check_stage(stage)

        def attempt(peer_id: PeerID) -> dict[str, torch.Tensor]:
            if self._is_local(peer_id, stage):
                return self.local_servers[stage].state_dict_local()
            request = runtime_pb2.ExpertUID(uid=stage_uid(self.run_id, stage))
            responses = self._run(self._call_stream(self._stub(peer_id, stage), "rpc_state", [request]))
            self._count(stage, "state", 0, sum(response.ByteSize() for response in responses))
            tensors, metadata, _ = _wire.decode_messages(responses)
            _, state = rebuild_call(metadata, tensors)
            return state

        return self._with_retries(stage, 1.0, attempt)

    def stage_info(self, stage: int) -> list[dict[str, Any]]:
        """``rpc_info`` of every live peer of ``stage`` (peers that fail to answer are skipped)."""
        infos = []
        for info in self.peers(stage):
            if self._is_local(info.peer_id, stage):
                infos.append(self.local_servers[stage].info())
                continue
            try:
                request = runtime_pb2.ExpertUID(uid=stage_uid(self.run_id, stage))
                stub = self._stub(info.peer_id, stage)
                reply = self._run(stub.rpc_info(request, timeout=self.request_timeout))
                infos.append(msgpack.unpackb(reply.serialized_info))
            except Exception as e:
                logger.debug(f"Peer {info.peer_id} of stage {stage} did not answer rpc_info: {e!r}")
        return infos

    def stats(self) -> dict[str, float]:
        """Traffic and failure counters, e.g. ``swarm/bytes_sent`` and ``swarm/stage0/forward_bytes_recv``."""
        with self._lock:
            return dict(self._counters)

    def shutdown(self) -> None:
        """Close this client's P2P connection (idempotent)."""
        p2p, self._p2p = self._p2p, None
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
        self._stubs.clear()
        if p2p is not None:
            try:
                run_coroutine(p2p.shutdown(), timeout=10)
            except Exception as e:
                logger.debug(f"SwarmClient: error while closing P2P: {e!r}")

    # ---- forward / backward with retries ----

    def _forward(self, stage: int, args: tuple, kwargs: dict) -> tuple[Any, LazyPack | None]:
        """Run the stage forward; returns the outputs and the encoded request (None if it ran locally)."""
        encoded: list[LazyPack | None] = [None]

        def attempt(peer_id: PeerID) -> Any:
            if self._is_local(peer_id, stage):
                return self.local_servers[stage].forward_local(args, kwargs)
            if encoded[0] is None:
                encoded[0] = LazyPack(args, kwargs, self.compression, split_above=_STREAM_ABOVE)
            request = encoded[0]
            reply_tensors, reply_metadata = self._request(
                peer_id, stage, "forward", request.metadata, [request]
            )
            (outputs,), _ = rebuild_call(reply_metadata, reply_tensors)
            return outputs

        outputs = self._with_retries(stage, batch_size_of(args, kwargs), attempt)
        return outputs, encoded[0]

    def _backward(
        self, call: _StageCall, grad_outputs: list[torch.Tensor | None], expected: list[torch.Size]
    ) -> list[torch.Tensor]:
        """Input gradients (shapes ``expected``) of a stage call, computed by any live peer of the stage."""
        stage = call.stage
        args, kwargs = call.inputs()
        grads_encoded: list[LazyPack | None] = [None]

        def attempt(peer_id: PeerID) -> list[torch.Tensor]:
            if self._is_local(peer_id, stage):
                grad_inputs = self.local_servers[stage].backward_local(args, kwargs, grad_outputs)
                _check_grads(stage, grad_inputs, expected)
                return grad_inputs
            if call.encoded is None:
                call.encoded = LazyPack(args, kwargs, self.compression, split_above=_STREAM_ABOVE)
            if grads_encoded[0] is None:
                grads_encoded[0] = LazyPack(
                    tuple(grad_outputs), {}, self.compression, split_above=_STREAM_ABOVE
                )
            inputs, grads = call.encoded, grads_encoded[0]
            metadata = backward_metadata(inputs.metadata, inputs.num_tensors, grads.metadata)
            reply_tensors, reply_metadata = self._request(
                peer_id, stage, "backward", metadata, [inputs, grads]
            )
            grad_inputs, _ = rebuild_call(reply_metadata, reply_tensors)
            _check_grads(stage, grad_inputs, expected)
            return list(grad_inputs)

        grads = self._with_retries(stage, batch_size_of(args, kwargs), attempt)
        return grads

    def _with_retries(self, stage: int, task_size: float, attempt: Callable[[PeerID], T]) -> T:
        router = self.routers[stage]
        deadline = time.monotonic() + self.no_peers_timeout
        failed: set[PeerID] = set()
        last_error: BaseException | None = None
        while True:
            self._maybe_refresh(stage)
            try:
                with self._router_lock:
                    peer_id = router.choose(task_size, exclude=failed)
            except NoPeersError as e:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    message = f"{e} Waited {self.no_peers_timeout:.1f} s (no_peers_timeout)."
                    if last_error is not None:
                        message += f" Last error from a peer: {last_error!r}"
                    raise NoPeersError(message) from last_error
                failed.clear()  # everyone failed once: after a refresh, allow retrying unbanned peers
                self._maybe_refresh(stage, block=True, max_wait=min(self.refresh_period, remaining))
                continue
            try:
                result = attempt(peer_id)
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as e:
                if (
                    isinstance(e, P2PHandlerError)
                    and _RESPONSE_TOO_LARGE in str(e)
                    and stage not in self._stream_stages
                ):
                    self._stream_stages.add(stage)  # retry the same peer, streaming
                    continue
                last_error = e
                with self._router_lock:
                    duration = router.ban(peer_id)
                failed.add(peer_id)
                self._count_failure(stage)
                logger.warning(
                    f"Stage {stage} call to peer {peer_id} failed ({e!r}); banned it for {duration:.0f} s and retrying"
                )
                continue
            with self._router_lock:
                router.report_success(peer_id)
            return result

    # ---- transport ----

    def _request(
        self, peer_id: PeerID, stage: int, kind: str, metadata: bytes, sources: list[LazyPack]
    ) -> tuple[list[torch.Tensor], bytes]:
        """Send a forward/backward request made of ``sources``' parts; returns the decoded reply and its metadata.

        Payloads over the unary limit, and every call to a stage whose replies were that large, are streamed:
        parts go on the wire as they are encoded and are decoded as they come. Other calls travel as one message
        each way over the peer's channel for the stage (a long-lived stream, see ``_channel_call``).
        """
        if sum(source.estimated_bytes for source in sources) > _STREAM_ABOVE or stage in self._stream_stages:
            parts = itertools.chain.from_iterable(source.parts() for source in sources)
            uid = stage_uid(self.run_id, stage)
            requests = _wire.messages(runtime_pb2.ExpertRequest, parts, metadata, uid=uid)
            stub = self._stub(peer_id, stage)
            tensors, reply_metadata, sent, recv = self._stream(stub, f"rpc_{kind}_stream", requests)
        else:
            parts = [part for source in sources for part in source.parts()]
            reply, sent = self._channel_call(peer_id, stage, kind, parts, metadata)
            tensors, reply_metadata = decode_parts(reply.tensors), reply.metadata
            recv = reply.ByteSize()
            if recv > _STREAM_ABOVE:
                self._stream_stages.add(stage)  # large replies: stream them from now on, pipelined
        self._count(stage, kind, sent, recv)
        return tensors, reply_metadata

    def _channel_call(
        self, peer_id: PeerID, stage: int, kind: str, parts: list[runtime_pb2.Tensor], metadata: bytes
    ) -> tuple[runtime_pb2.ExpertResponse, int]:
        """One call over the peer's channel for this stage (opened on first use), or a unary call if the channel
        is busy; returns the reply and the bytes sent.

        A channel that worked before and now fails is replaced once without blaming the peer (the daemon may have
        dropped an idle stream); errors the peer reports for this call are raised as ``RemoteStageError``.
        """
        key = (peer_id, stage)
        for fresh_attempt in (False, True):
            with self._lock:
                channel = self._channels.get(key)
                if channel is None:
                    channel = self._channels[key] = _Channel(self._stub(peer_id, stage))
            uid = stage_uid(self.run_id, stage)
            if not channel.lock.acquire(blocking=False):  # another thread is using it
                request = runtime_pb2.ExpertRequest(uid=uid, tensors=parts, metadata=metadata)
                method = getattr(self._stub(peer_id, stage), f"rpc_{kind}")
                return run_coroutine(
                    method(request, timeout=self.request_timeout), timeout=None
                ), request.ByteSize()
            try:
                message = runtime_pb2.ExpertRequest(
                    uid=uid, tensors=parts, metadata=_wire.channel_request(kind, metadata)
                )
                reused = channel.calls > 0
                try:
                    reply = run_coroutine(
                        asyncio.wait_for(channel.call(message), self.request_timeout),
                        timeout=self.request_timeout + 5,
                    )
                except Exception:
                    self._drop_channel(key, channel)
                    if reused and not fresh_attempt:
                        continue
                    raise
                channel.calls += 1
            finally:
                channel.lock.release()
            reply.metadata = _wire.parse_channel_reply(reply.metadata)
            return reply, message.ByteSize()
        raise AssertionError("unreachable")

    def _drop_channel(self, key: tuple[PeerID, int], channel: _Channel) -> None:
        with self._lock:
            if self._channels.get(key) is channel:
                del self._channels[key]
        channel.close()

    def _stream(
        self, stub: Any, method: str, requests: Iterator[Any]
    ) -> tuple[list[torch.Tensor], bytes, int, int]:
        """A streaming RPC that overlaps this thread's encoding and decoding with the transfer.

        This thread encodes the request messages (``requests`` is lazy) and hands each to the event loop,
        which sends it while the next one is encoded; reply messages come back through a queue and are decoded
        here while the next ones are in flight. The whole call is bounded by ``request_timeout``.
        """
        loop = get_loop()
        outbox: asyncio.Queue = asyncio.Queue()
        inbox: queue.SimpleQueue = queue.SimpleQueue()

        async def outgoing() -> AsyncIterator[Any]:
            while (message := await outbox.get()) is not None:
                yield message

        async def call() -> None:
            async for response in await getattr(stub, method)(outgoing()):
                inbox.put(response)

        deadline = time.monotonic() + self.request_timeout
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(call(), self.request_timeout), loop)
        future.add_done_callback(lambda _: inbox.put(_END))
        sent = recv = 0
        try:
            for message in requests:
                sent += message.ByteSize()
                loop.call_soon_threadsafe(outbox.put_nowait, message)
                if future.done():
                    break  # the call already failed: stop encoding
            loop.call_soon_threadsafe(outbox.put_nowait, None)
            decoder = PartsDecoder()
            reply_metadata: bytes | None = None
            while (response := inbox.get(timeout=max(0.0, deadline - time.monotonic()) + 1.0)) is not _END:
                if reply_metadata is None:
                    reply_metadata = response.metadata
                recv += response.ByteSize()
                for part in response.tensors:
                    decoder.feed(part)
            future.result()  # the handler's error, if any
            if reply_metadata is None:
                raise CodecError("The peer closed the stream without replying")
            return decoder.finish(), reply_metadata, sent, recv
        except queue.Empty:
            raise TimeoutError(f"{method} did not finish within {self.request_timeout} s") from None
        finally:
            future.cancel()

    @staticmethod
    async def _call_stream(stub: Any, method: str, requests: Any) -> list[Any]:
        async def _requests() -> Any:
            for request in requests:
                yield request

        stream = await getattr(stub, method)(_requests())
        return [response async for response in stream]

    def _run(self, coro: Any) -> Any:
        return run_coroutine(asyncio.wait_for(coro, self.request_timeout), timeout=self.request_timeout + 5)

    def _stub(self, peer_id: PeerID, stage: int) -> Any:
        key = (peer_id, stage)
        stub = self._stubs.get(key)
        if stub is None:
            with self._stub_lock:  # threads calling at once must share one P2P connection
                stub = self._stubs.get(key)
                if stub is None:
                    if self._p2p is None:
                        self._p2p = run_coroutine(replicate_p2p(self.dht), timeout=60)
                    stub = self._stubs[key] = StageServer.get_stub(
                        self._p2p, peer_id, namespace=stage_uid(self.run_id, stage)
                    )
        return stub

    def _is_local(self, peer_id: PeerID, stage: int) -> bool:
        return peer_id == self.peer_id and stage in self.local_servers

    # ---- peer discovery ----

    def _maybe_refresh(self, stage: int, block: bool = False, max_wait: float = 0.0) -> None:
        """Start a DHT lookup when the listing is stale and apply finished ones.

        With ``block``, always look up, wait for the answer, and if the stage still has no live peer, sleep out
        the rest of ``max_wait`` seconds (this paces the polling while waiting for peers).
        """
        start = time.monotonic()
        pending = self._pending[stage]
        if pending is None and (block or start - self._last_refresh[stage] >= self.refresh_period):
            pending = self._pending[stage] = self.dht.get(
                stage_key(self.run_id, stage), latest=True, return_future=True
            )
            self._last_refresh[stage] = start
        if pending is not None and block:
            try:
                pending.result(timeout=max(max_wait, 0.01))
            except Exception:
                pass  # handled below
        if pending is not None and pending.done():
            self._pending[stage] = None
            try:
                peers = parse_stage_peers(pending.result(), stage)
                with self._router_lock:
                    self.routers[stage].update_peers(peers)
            except Exception as e:
                logger.debug(f"DHT lookup of stage {stage} failed: {e!r}")
        if block and self.routers[stage].num_live() == 0:
            time.sleep(max(0.0, max_wait - (time.monotonic() - start)))

    # ---- counters ----

    def _count(self, stage: int, kind: str, sent: int, recv: int) -> None:
        with self._lock:
            c = self._counters
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

    def _check_stage(self, stage: int) -> None:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"SwarmClient: stage must be in [0, {self.num_stages}), got {stage}")


class _Channel:
    """A long-lived stream to one stage of one peer (``StageServer.rpc_channel``), one call at a time."""

    def __init__(self, stub: Any):
        self.stub = stub
        self.lock = threading.Lock()  # held by the thread whose call is in flight
        self.calls = 0
        self._outbox: asyncio.Queue | None = None
        self._replies: Any = None

    async def call(self, message: runtime_pb2.ExpertRequest) -> runtime_pb2.ExpertResponse:
        """Send one request and wait for its reply (runs on the swarm event loop)."""
        if self._replies is None:
            outbox: asyncio.Queue = asyncio.Queue()

            async def outgoing() -> AsyncIterator[runtime_pb2.ExpertRequest]:
                while (request := await outbox.get()) is not None:
                    yield request

            self._outbox = outbox
            self._replies = await self.stub.rpc_channel(outgoing())
        assert self._outbox is not None
        self._outbox.put_nowait(message)
        try:
            return await self._replies.__anext__()
        except StopAsyncIteration:
            raise ConnectionError("the peer closed the channel") from None

    def close(self) -> None:
        """End the stream (from any thread; idempotent)."""
        outbox, replies, self._outbox, self._replies = self._outbox, self._replies, None, None
        if outbox is None:
            return
        loop = get_loop()
        loop.call_soon_threadsafe(outbox.put_nowait, None)
        if replies is not None:
            asyncio.run_coroutine_threadsafe(replies.aclose(), loop)


class _StageCall:
    """What one differentiable stage call keeps between its forward and backward."""

    def __init__(
        self, client: SwarmClient, stage: int, skeleton: Any, tensors: list[torch.Tensor], marks: list[bool]
    ):
        self.client, self.stage, self.skeleton, self.marks = client, stage, skeleton, marks
        self.tensors = tensors
        self.encoded: LazyPack | None = None
        self.output_skeleton: Any = None
        self.diff_devices: list[tuple[torch.device, torch.dtype]] = []

    def inputs(self) -> tuple[tuple, dict]:
        """The stage inputs as detached tensors, marked ``requires_grad`` where gradients are wanted."""
        leaves = []
        for t, mark in zip(self.tensors, self.marks, strict=True):
            leaf = t.detach()
            remember_wire_format(t, leaf)
            if mark:
                leaf.requires_grad_(True)
            leaves.append(leaf)
        args, kwargs = rebuild_tensors(self.skeleton, leaves)
        return tuple(args), dict(kwargs)


class _StageFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _StageCall, dummy: torch.Tensor, *diff_inputs: torch.Tensor) -> tuple:
        args, kwargs = call.inputs()
        outputs, call.encoded = call.client._forward(call.stage, args, kwargs)
        out_tensors, call.output_skeleton = flatten_tensors(outputs)
        device = _device_of(call.tensors)
        moved = [t.to(device) for t in out_tensors]
        for source, target in zip(out_tensors, moved, strict=True):
            remember_wire_format(source, target)
        out_tensors = moved
        ctx.call = call
        ctx.set_materialize_grads(False)
        ctx.input_meta = [(t.device, t.dtype, t.shape) for t in diff_inputs]
        non_diff = [t for t in out_tensors if not t.is_floating_point()]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return tuple(out_tensors)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple:
        call: _StageCall = ctx.call
        grads_in: list[torch.Tensor | None]
        if all(g is None for g in grad_outputs):
            grads_in = [None] * len(ctx.input_meta)
        else:
            grads = call.client._backward(
                call,
                [None if g is None else g.detach() for g in grad_outputs],
                [m[2] for m in ctx.input_meta],
            )
            grads_in = [
                grad.to(device=device, dtype=dtype)
                for grad, (device, dtype, _) in zip(grads, ctx.input_meta, strict=True)
            ]
        return (None, None, *grads_in)


def _device_of(tensors: list[torch.Tensor]) -> torch.device:
    """Where a call's outputs should live: the device of its first tensor argument (CPU if none)."""
    return tensors[0].device if tensors else torch.device("cpu")


def _check_grads(stage: int, grads: Any, expected: list[torch.Size]) -> None:
    if not isinstance(grads, (tuple, list)) or len(grads) != len(expected):
        count = len(grads) if isinstance(grads, (tuple, list)) else type(grads).__name__
        raise CodecError(f"Stage {stage} returned {count} input gradients, expected {len(expected)}")
    for grad, shape in zip(grads, expected, strict=True):
        if not isinstance(grad, torch.Tensor) or grad.shape != shape or not grad.is_floating_point():
            raise CodecError(
                f"Stage {stage} returned a malformed input gradient (expected shape {list(shape)})"
            )
