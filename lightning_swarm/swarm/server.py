"""Stage server: one peer's share of one pipeline stage.

A :class:`StageServer` hosts the module of stage ``k`` and serves :class:`~.protocol.StageRequest` s, from
this process (:meth:`StageServer.handle`, through :class:`~.transport.LocalTransport`) or over hivemind's P2P:

- ``forward``: stage inputs -> stage outputs (no grad);
- ``backward``: stage inputs + output gradients -> input gradients. The forward is recomputed with grad (so
  *any* peer of the stage can serve the backward of a microbatch), parameter gradients accumulate here, and
  the stage's ``hivemind.Optimizer`` steps together with the other peers of the stage once the swarm has
  processed ``target_batch_size`` samples.

RPCs: ``rpc_channel`` (a long-lived stream carrying one call after another, see :mod:`.transport`),
``rpc_info`` (stage, throughput, progress) and ``rpc_state`` (the stage's ``state_dict``). The compute runs in
one background thread under a lock, so the event loop keeps answering and forward, backward and optimizer steps
of the stage never interleave. Every request gets a reply; a failed one gets an error reply that says why (see
:mod:`.protocol`). Every ``announce_period`` seconds a background thread re-announces the peer in the DHT with
its measured throughput (samples/s of forward + backward, see :mod:`.throughput`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind detects stream handlers by typing.AsyncIterator)

import hivemind
import msgpack
import torch
from hivemind.optim.grad_averager import GradientAverager
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.timed_storage import get_dht_time
from torch import nn

from ._loop import replicate_p2p, run_coroutine
from .codec import CodecError, check_encodable
from .payload import Payload
from .protocol import (
    COMPUTE,
    REQUEST,
    UNAVAILABLE,
    BadRequest,
    ErrorReply,
    StageReply,
    StageRequest,
    StageService,
    check_grad_outputs,
    encode_reply_header,
    parse_request,
    stage_uid,
)
from .records import declare_stage_peer
from .settings import SwarmSettings
from .throughput import Throughput
from .transport import MESSAGE_BYTES, SPLIT_ABOVE, MessageReceiver, messages

__all__ = ["StageServer"]

logger = logging.getLogger(__name__)

_EPOCH_POLL_S = 0.25  # how often an idle server checks whether its stage is ready to step
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
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._stop = threading.Event()
        self._announcer: threading.Thread | None = None
        self._started = False

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

    def start(self) -> StageServer:
        """Create the optimizer, register the RPC handlers and start announcing; returns ``self``."""
        if self._started:
            return self
        s = self.settings
        groups = self.param_groups
        if groups is None:
            groups = [{"params": [p for p in self.module.parameters() if p.requires_grad]}]
        groups = [g for g in groups if g["params"]]
        if groups and self.optimizer_factory is not None:
            request_timeout = max(0.2, s.matchmaking_time / 3)
            self.optimizer = hivemind.Optimizer(
                dht=self.dht,
                run_id=f"{s.run_id}_stage{self.stage}",  # hivemind forbids '.' in optimizer run ids
                target_batch_size=s.target_batch_size,
                batch_size_per_step=None,
                optimizer=functools.partial(_make_initialized, self.optimizer_factory),
                params=groups,
                matchmaking_time=s.matchmaking_time,
                averaging_timeout=s.averaging_timeout,
                # hivemind warns (and may deadlock) unless requests time out before matchmaking ends; the optimizer
                # state is initialized without moving the parameters (see initialize_optimizer_state)
                averager_opts={"request_timeout": request_timeout, "initialize_optimizer": False},
                grad_averager_factory=functools.partial(GradientAverager, request_timeout=request_timeout),
                verbose=False,
            )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{self.stage}-compute")
        self.p2p = run_coroutine(self._start_p2p(), timeout=60)
        self._stop.clear()
        self._started = True
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
        if self._announcer is not None:
            self._announcer.join(timeout=5)
        if self.p2p is not None:
            p2p, self.p2p = self.p2p, None
            try:
                run_coroutine(self._stop_p2p(p2p), timeout=10)
            except Exception as e:
                logger.debug(f"Stage {self.stage} server: error while removing handlers: {e!r}")
        if self._executor is not None:
            self._executor.shutdown(wait=True)
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

    def load_state_from_peers(self, **kwargs: Any) -> None:
        """Download the stage's parameters and optimizer state from another peer of the stage (for joiners)."""
        if self.optimizer is not None:
            with self._lock:
                self.optimizer.load_state_from_peers(**kwargs)

    def _announce(self) -> None:
        try:
            declare_stage_peer(
                self.dht,
                self.settings.run_id,
                self.stage,
                self.peer_id,
                self.throughput.value,
                get_dht_time() + self.settings.expiration,
            )
        except Exception as e:
            logger.warning(f"Stage {self.stage} server could not announce itself in the DHT: {e!r}")

    def _announce_loop(self) -> None:
        next_announce = time.monotonic() + self.settings.announce_period
        while not self._stop.wait(_EPOCH_POLL_S):
            self._join_ready_epoch()
            if time.monotonic() >= next_announce:
                self._announce()
                next_announce = time.monotonic() + self.settings.announce_period

    def _join_ready_epoch(self) -> None:
        """Join the stage's averaging round as soon as the swarm has collected the target batch, even when no
        backward call arrives here: otherwise a peer whose trainers are blocked on the stage's other peers (which
        wait in matchmaking for this one) would only join after the round has timed out."""
        opt = self.optimizer
        if opt is None or not opt.tracker.ready_to_update_epoch:
            return
        if opt.grad_averager.local_samples_accumulated <= 0:
            return  # nothing to contribute: the others step without us, and we catch up from their state
        with self._lock:
            if opt.tracker.ready_to_update_epoch and opt.grad_averager.local_samples_accumulated > 0:
                self._optimizer_step(0)

    # ---- serving a request (the same for in-process and remote callers) ----

    def handle(self, request: StageRequest) -> StageReply:
        """Serve one request; never raises: failures become error replies (see :mod:`.protocol`)."""
        try:
            if request.uid != self.uid:
                raise BadRequest(f"This peer serves {self.uid!r}, but the request was for {request.uid!r}")
            if not self._started:
                return _error(
                    request.request_id, UNAVAILABLE, RuntimeError(f"Stage {self.stage} server is not running")
                )
            if request.kind == "forward":
                outputs = self._forward(request.inputs)
            else:
                assert request.grad_outputs is not None
                outputs = self._backward(request.inputs, request.grad_outputs)
            return StageReply(request.request_id, outputs=outputs)
        except BadRequest as e:
            logger.debug(f"Stage {self.stage}: rejected a request: {e}")
            return _error(request.request_id, REQUEST, e)
        except _ComputeError as e:
            logger.warning(f"Stage {self.stage}: the stage raised {type(e.error).__name__}: {e.error}")
            return _error(request.request_id, COMPUTE, e.error)
        except (
            Exception
        ) as e:  # out of memory, or a bug here: not the caller's fault, another peer may do better
            logger.warning(f"Stage {self.stage}: could not serve a {request.kind} call: {e!r}")
            return _error(request.request_id, UNAVAILABLE, e)

    def _forward(self, inputs: Payload) -> Payload:
        args, kwargs = inputs.rebuild_call([t.detach().to(self.device) for t in inputs.tensors])
        with self._lock, torch.no_grad():
            outputs = self._run_module(args, kwargs)
        return _outputs_payload(outputs)

    def _backward(self, inputs: Payload, grad_outputs: Payload) -> Payload:
        leaves = []
        for t in inputs.tensors:
            leaf = t.detach().to(self.device)
            if t.requires_grad and t.is_floating_point():
                leaf.requires_grad_(True)
            leaves.append(leaf)
        args, kwargs = inputs.rebuild_call(leaves)
        grads = grad_outputs.rebuild()
        batch_size = inputs.batch_size()
        with self._lock:
            start = time.perf_counter()
            with torch.enable_grad():
                outputs = _outputs_payload(self._run_module(args, kwargs)).tensors
                check_grad_outputs(grads, outputs)
                pairs = [
                    (out, grad.to(device=out.device, dtype=out.dtype))
                    for out, grad in zip(outputs, grads, strict=True)
                    if grad is not None and out.requires_grad
                ]
                if pairs:
                    try:
                        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                    except (MemoryError, torch.OutOfMemoryError):
                        raise
                    except Exception as e:
                        raise _ComputeError(e) from e
            self.throughput.record(batch_size, time.perf_counter() - start)
            wanted = [leaf for leaf in leaves if leaf.requires_grad]
            grad_inputs = tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in wanted)
            self.samples_processed += batch_size
            self._optimizer_step(batch_size)
        return Payload.flatten(grad_inputs)

    def _run_module(self, args: tuple, kwargs: dict) -> Any:
        try:
            return self.module(*args, **kwargs)
        except (MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as e:
            raise _ComputeError(e) from e

    def state_dict_local(self) -> dict[str, torch.Tensor]:
        """A detached CPU copy of the stage module's ``state_dict``."""
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
        }

    def _optimizer_step(self, batch_size: int) -> None:
        if self.optimizer is None:
            self.module.zero_grad(set_to_none=True)  # not training this stage: drop parameter gradients
            return
        try:
            self.optimizer.step(batch_size=batch_size)
        except Exception as e:  # a failed averaging round must not fail the trainer's backward
            logger.warning(f"Stage {self.stage} optimizer step failed: {e!r}")
        self.optimizer.zero_grad()

    # ---- RPC handlers ----

    async def rpc_channel(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A long-lived stream carrying one call after another (see :mod:`.transport`).

        Parts are decoded here as they arrive (a part is small: ~0.05 ms), overlapping with the transfer; the
        compute thread then serves the request and encodes the reply message by message, each sent as soon as it
        is ready. Every request gets a reply, an error reply if it failed; the channel stays open.
        """
        loop = asyncio.get_running_loop()
        receiver = MessageReceiver()
        async for message in requests:
            if not receiver.feed(message):
                continue
            received, receiver = receiver, MessageReceiver()
            if self._executor is None or not self._started:
                error = _error(-1, UNAVAILABLE, RuntimeError(f"Stage {self.stage} server is not running"))
                yield runtime_pb2.ExpertResponse(metadata=encode_reply_header(error, None))
                continue
            outbox: asyncio.Queue = asyncio.Queue()

            def serve(
                received: MessageReceiver = received, outbox: asyncio.Queue = outbox
            ) -> runtime_pb2.ExpertResponse:
                # every message but the last is handed over as soon as it is encoded (a pipelined reply); the
                # last comes back as the result, so a one-message reply costs a single wake-up of the loop
                last = None
                for reply in self._serve_received(received):
                    if last is not None:
                        loop.call_soon_threadsafe(outbox.put_nowait, last)
                    last = reply
                assert last is not None
                return last

            done = loop.run_in_executor(self._executor, serve)
            while True:
                getter = asyncio.ensure_future(outbox.get())
                finished, _ = await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
                if getter in finished:
                    yield getter.result()
                    continue
                getter.cancel()
                break
            while not outbox.empty():  # handed over just before the last one
                yield outbox.get_nowait()
            yield done.result()

    def _serve_received(self, received: MessageReceiver) -> Iterator[runtime_pb2.ExpertResponse]:
        """Serve a received call and yield its reply messages (runs in the compute thread; never raises)."""
        request_id = -1
        try:
            try:
                header, tensors = received.result()
                request_id = _request_id(header)
                request = parse_request(header, tensors, self.uid)
            except (CodecError, BadRequest) as e:
                yield runtime_pb2.ExpertResponse(
                    metadata=encode_reply_header(_error(request_id, REQUEST, e), None)
                )
                return
            reply = self.handle(request)
            if reply.error is not None:
                yield runtime_pb2.ExpertResponse(metadata=encode_reply_header(reply, None))
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
            yield runtime_pb2.ExpertResponse(
                metadata=encode_reply_header(_error(request_id, UNAVAILABLE, e), None)
            )

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        """Stage index, throughput, samples processed and optimizer epoch (msgpack dict)."""
        if request.uid != self.uid:
            raise BadRequest(f"This peer serves {self.uid!r}, but the request was for {request.uid!r}")
        return runtime_pb2.ExpertInfo(serialized_info=msgpack.packb(self.info()))

    async def rpc_state(
        self, request: runtime_pb2.ExpertUID, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """The stage module's ``state_dict`` as an uncompressed payload, in messages (metadata on the last)."""
        if request.uid != self.uid:
            yield runtime_pb2.ExpertResponse()  # no metadata: the caller reads an incomplete stream
            return
        loop = asyncio.get_running_loop()

        def encode() -> list[runtime_pb2.ExpertResponse]:
            encoded = Payload.flatten(self.state_dict_local()).encode("none", split_above=0.0)
            return list(messages(runtime_pb2.ExpertResponse, encoded.parts(), encoded.metadata))

        for message in await loop.run_in_executor(None, encode):
            yield message


def initialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (which hivemind averages and hands to joining peers) without moving
    any parameter.

    hivemind does this with one optimizer step on zero gradients, which still applies weight decay: a silent
    extra step. Here that step runs with every learning rate at 0, and step counters are reset afterwards, so the
    first real step is the same as in a plain torch optimizer.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
    for state in optimizer.state.values():
        if "step" in state:
            step = state["step"]
            state["step"] = torch.zeros_like(step) if isinstance(step, torch.Tensor) else 0


def _make_initialized(factory: OptimizerFactory, params: Any) -> torch.optim.Optimizer:
    optimizer = factory(params)
    initialize_optimizer_state(optimizer)
    return optimizer


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
