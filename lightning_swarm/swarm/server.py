"""Stage server: one peer's share of one pipeline stage.

A :class:`StageServer` hosts the module of stage ``k`` and answers the swarm's RPCs over hivemind's P2P:

- ``rpc_forward``: stage inputs -> stage outputs (no grad);
- ``rpc_backward``: stage inputs + output gradients -> input gradients. The forward is recomputed with grad
  (so *any* peer of the stage can serve the backward of a microbatch), parameter gradients accumulate here,
  and the stage's ``hivemind.Optimizer`` steps together with the other peers of the stage once the swarm has
  processed ``target_batch_size`` samples;
- ``rpc_info`` (stage, throughput, progress) and ``rpc_state`` (the stage's ``state_dict``).

Payloads over hivemind's unary limit go through ``*_stream`` twins of the handlers. The compute runs in one
background thread under a lock, so the event loop keeps answering and forward, backward and optimizer steps
of the stage never interleave. A malformed request fails that request only. Every ``announce_period`` seconds
a background thread re-announces the peer in the DHT with its measured throughput.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind detects stream handlers by typing.AsyncIterator)

import hivemind
import msgpack
import torch
from hivemind.optim.grad_averager import GradientAverager
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.timed_storage import get_dht_time
from torch import nn

from . import _wire
from ._loop import replicate_p2p, run_coroutine
from .codec import (
    LazyPack,
    PartsDecoder,
    check_compression,
    decode_parts,
    flatten_tensors,
    rebuild_call,
    rebuild_tensors,
)
from .records import declare_stage_peer

__all__ = ["StageServer", "stage_uid"]

logger = logging.getLogger(__name__)

_THROUGHPUT_EMA = 0.1
_EPOCH_POLL_S = 0.25  # how often an idle server checks whether its stage is ready to step


def stage_uid(run_id: str, stage: int) -> str:
    """Name of stage ``stage`` of run ``run_id`` (RPC namespace, request uid and optimizer run id)."""
    return f"{run_id}.stage{stage}"


def check_run_id(run_id: str, owner: str) -> str:
    """Return ``run_id`` if usable in DHT keys and optimizer prefixes, else raise a ``ValueError`` saying why."""
    if not isinstance(run_id, str) or not run_id or "." in run_id:
        raise ValueError(
            f"{owner}: run_id must be a non-empty string without '.', got {run_id!r} "
            f"(it prefixes DHT keys like '<run_id>.stage0.0'); use e.g. '-' or '_' instead"
        )
    return run_id


def batch_size_of(args: tuple, kwargs: dict) -> int:
    """The microbatch size of a stage call: the first dimension of its first tensor (1 if none)."""
    tensors, _ = flatten_tensors((args, kwargs))
    for t in tensors:
        if t.dim() > 0:
            return int(t.shape[0])
    return 1


class StageServer(ServicerBase):
    """Serves one stage of a SWARM pipeline to the trainers of a swarm.

    Args:
        stage: the stage index.
        module: the stage's blocks; ``module(*args, **kwargs)`` returns a tensor or a nested tuple/list/dict
            of tensors.
        dht: this peer's running hivemind DHT.
        run_id: the swarm's run id (all peers of a swarm use the same one).
        optimizer_factory: builds the torch optimizer for the stage's parameters, e.g.
            ``lambda params: torch.optim.AdamW(params, lr=1e-4)``. ``None`` serves the stage without training
            it (backward still returns input gradients; parameter gradients are discarded).
        target_batch_size: the peers of this stage step together after this many samples (whole swarm).
        compression: boundary compression of the outputs and gradients this server sends: "8bit", "fp16"
            or "none".
        throughput: initial estimate of samples per second, announced until measured.
        announce_period: seconds between DHT announcements.
        expiration: seconds an announcement stays valid (more than ``announce_period``).
        matchmaking_time: seconds the optimizer looks for peers of the stage to average with.
        averaging_timeout: seconds after which a gradient averaging round is abandoned.
    """

    def __init__(
        self,
        stage: int,
        module: nn.Module,
        *,
        dht: hivemind.DHT,
        run_id: str,
        optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None,
        target_batch_size: int,
        compression: str = "8bit",
        throughput: float = 1.0,
        announce_period: float = 5.0,
        expiration: float = 30.0,
        matchmaking_time: float = 3.0,
        averaging_timeout: float = 30.0,
    ):
        if stage < 0:
            raise ValueError(f"StageServer: stage must be >= 0, got {stage}")
        if target_batch_size <= 0:
            raise ValueError(f"StageServer: target_batch_size must be positive, got {target_batch_size}")
        if expiration <= announce_period:
            raise ValueError(f"StageServer: expiration ({expiration} s) must exceed announce_period")
        self.stage, self.module, self.dht = stage, module, dht
        self.run_id = check_run_id(run_id, "StageServer")
        self.optimizer_factory, self.target_batch_size = optimizer_factory, target_batch_size
        self.compression = check_compression(compression)
        self.throughput = float(throughput)
        self.announce_period, self.expiration = announce_period, expiration
        self.matchmaking_time, self.averaging_timeout = matchmaking_time, averaging_timeout
        self.uid = stage_uid(run_id, stage)
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
        params = [p for p in self.module.parameters() if p.requires_grad]
        if params and self.optimizer_factory is not None:
            request_timeout = max(0.2, self.matchmaking_time / 3)
            self.optimizer = hivemind.Optimizer(
                dht=self.dht,
                run_id=f"{self.run_id}_stage{self.stage}",  # hivemind forbids '.' in optimizer run ids
                target_batch_size=self.target_batch_size,
                batch_size_per_step=None,
                optimizer=self.optimizer_factory,
                params=params,
                matchmaking_time=self.matchmaking_time,
                averaging_timeout=self.averaging_timeout,
                # hivemind warns (and may deadlock) unless requests time out before matchmaking ends
                averager_opts={"request_timeout": request_timeout},
                grad_averager_factory=functools.partial(GradientAverager, request_timeout=request_timeout),
                verbose=False,
            )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{self.stage}-compute")
        self.p2p = run_coroutine(self._start_p2p(), timeout=60)
        self._stop.clear()
        self._announce()
        self._announcer = threading.Thread(
            target=self._announce_loop, name=f"stage{self.stage}-announce", daemon=True
        )
        self._announcer.start()
        self._started = True
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
                self.run_id,
                self.stage,
                self.peer_id,
                self.throughput,
                get_dht_time() + self.expiration,
            )
        except Exception as e:
            logger.warning(f"Stage {self.stage} server could not announce itself in the DHT: {e!r}")

    def _announce_loop(self) -> None:
        next_announce = time.monotonic() + self.announce_period
        while not self._stop.wait(_EPOCH_POLL_S):
            self._join_ready_epoch()
            if time.monotonic() >= next_announce:
                self._announce()
                next_announce = time.monotonic() + self.announce_period

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

    # ---- computation (the same for local and remote callers) ----

    def forward_local(self, args: tuple, kwargs: dict) -> Any:
        """Run the stage on ``(args, kwargs)`` without grad; the caller is in this process."""
        args, kwargs = _detached((args, kwargs), keep_requires_grad=False, device=self.device)
        batch_size = batch_size_of(args, kwargs)
        with self._lock:
            start = time.perf_counter()
            with torch.no_grad():
                outputs = self.module(*args, **kwargs)
            self._record_throughput(batch_size, time.perf_counter() - start)
        return outputs

    def backward_local(
        self, args: tuple, kwargs: dict, grad_outputs: list[torch.Tensor | None]
    ) -> list[torch.Tensor]:
        """Recompute the stage with grad, backpropagate ``grad_outputs`` and step the optimizer.

        Args:
            args: the stage inputs as in the forward; floating tensors with ``requires_grad`` get gradients.
            kwargs: keyword inputs as in the forward.
            grad_outputs: one entry per output tensor (in flattening order); ``None`` for no gradient.

        Returns:
            the gradients of the inputs that require grad, in flattening order (zeros if unused).
        """
        args, kwargs = _detached((args, kwargs), keep_requires_grad=True, device=self.device)
        inputs = [t for t in flatten_tensors((args, kwargs))[0] if t.requires_grad]
        batch_size = batch_size_of(args, kwargs)
        with self._lock:
            with torch.enable_grad():
                outputs = self.module(*args, **kwargs)
            out_tensors, _ = flatten_tensors(outputs)
            if len(grad_outputs) != len(out_tensors):
                raise ValueError(
                    f"Stage {self.stage} produced {len(out_tensors)} output tensors but {len(grad_outputs)} "
                    f"output gradients were sent"
                )
            pairs = []
            for i, (out, grad) in enumerate(zip(out_tensors, grad_outputs, strict=True)):
                if grad is None or not out.requires_grad:
                    continue
                if grad.shape != out.shape:
                    raise ValueError(
                        f"Stage {self.stage}: gradient {i} has shape {list(grad.shape)}, output has {list(out.shape)}"
                    )
                pairs.append((out, grad.to(out.dtype)))
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
            self.samples_processed += batch_size
            self._optimizer_step(batch_size)
        return grads

    def state_dict_local(self) -> dict[str, torch.Tensor]:
        """A detached CPU copy of the stage module's ``state_dict``."""
        with self._lock:
            return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    def info(self) -> dict[str, Any]:
        """Stage, throughput (samples/s), samples processed and optimizer epoch."""
        epoch = self.optimizer.local_epoch if self.optimizer is not None else 0
        return {
            "stage": self.stage,
            "throughput": self.throughput,
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

    def _record_throughput(self, batch_size: int, seconds: float) -> None:
        if seconds > 0:
            measured = batch_size / seconds
            self.throughput = (1 - _THROUGHPUT_EMA) * self.throughput + _THROUGHPUT_EMA * measured

    # ---- serialised entry points, run in the compute thread ----

    def _compute(self, kind: str, tensors: list[torch.Tensor], metadata: bytes, split: bool) -> LazyPack:
        """Run a decoded forward/backward request; returns the reply, to be encoded lazily (in parts if split)."""
        split_above = 0.0 if split else math.inf
        if kind == "forward":
            args, kwargs = rebuild_call(metadata, tensors)
            return LazyPack((self.forward_local(args, kwargs),), {}, self.compression, split_above)
        inputs_meta, num_inputs, grads_meta = parse_backward_metadata(metadata)
        if not 0 <= num_inputs <= len(tensors):
            raise ValueError(f"Malformed backward request: {num_inputs} inputs of {len(tensors)} tensors")
        args, kwargs = rebuild_call(inputs_meta, tensors[:num_inputs])
        grad_outputs, _ = rebuild_call(grads_meta, tensors[num_inputs:])
        if not all(g is None or isinstance(g, torch.Tensor) for g in grad_outputs):
            raise ValueError("Malformed backward request: output gradients must be tensors or None")
        grads = self.backward_local(args, kwargs, list(grad_outputs))
        return LazyPack(tuple(grads), {}, self.compression, split_above)

    def _unary(
        self, kind: str, parts: list[runtime_pb2.Tensor], metadata: bytes
    ) -> runtime_pb2.ExpertResponse:
        reply = self._compute(kind, decode_parts(parts), metadata, split=False)
        return runtime_pb2.ExpertResponse(tensors=list(reply.parts()), metadata=reply.metadata)

    async def _in_executor(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._executor is None:
            raise RuntimeError(f"Stage {self.stage} server is not running")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _check_uid(self, uid: str) -> None:
        if uid != self.uid:
            raise ValueError(f"This peer serves {self.uid!r}, but the request was for {uid!r}")

    # ---- RPC handlers ----

    async def rpc_forward(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """Stage forward for small payloads."""
        self._check_uid(request.uid)
        return await self._in_executor(self._unary, "forward", request.tensors, request.metadata)

    async def rpc_backward(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """Stage backward for small payloads."""
        self._check_uid(request.uid)
        return await self._in_executor(self._unary, "backward", request.tensors, request.metadata)

    async def rpc_channel(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A long-lived stream carrying one forward or backward call after another (see ``_wire.channel_*``).

        Cheaper than a unary call per request (``benchmarks/swarm_hop.py``: a 1 MiB echo on one stream takes about
        half the time of a unary echo). Every request gets one reply; a request that fails (malformed, wrong
        stage, compute error) gets an error reply and the channel stays open.
        """
        async for request in requests:
            try:
                self._check_uid(request.uid)
                kind, metadata = _wire.parse_channel_request(request.metadata)
                response = await self._in_executor(self._unary, kind, request.tensors, metadata)
                response.metadata = _wire.channel_reply(response.metadata)
            except Exception as e:
                logger.debug(f"Stage {self.stage}: a channel request failed: {e!r}")
                response = runtime_pb2.ExpertResponse(metadata=_wire.channel_error(e))
            yield response

    async def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Stage forward for large payloads (streamed parts, see ``_wire``)."""
        async for message in self._streamed(requests, "forward"):
            yield message

    async def rpc_backward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Stage backward for large payloads (streamed parts, see ``_wire``)."""
        async for message in self._streamed(requests, "backward"):
            yield message

    async def _streamed(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], kind: str
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        # parts are decoded here as they arrive (a part is small: ~0.05 ms), overlapping with the transfer
        decoder = PartsDecoder()
        metadata: bytes | None = None
        async for request in requests:
            if metadata is None:
                self._check_uid(request.uid)
                metadata = request.metadata
            for part in request.tensors:
                decoder.feed(part)
        if metadata is None:
            raise ValueError("Received an empty request stream")
        tensors = decoder.finish()
        # the compute thread runs the stage, then encodes the reply message by message; each is sent as soon
        # as it is ready, while the next one is encoded
        loop = asyncio.get_running_loop()
        outbox: asyncio.Queue = asyncio.Queue()

        def compute() -> None:
            reply = self._compute(kind, tensors, metadata, split=True)
            for message in _wire.messages(runtime_pb2.ExpertResponse, reply.parts(), reply.metadata):
                loop.call_soon_threadsafe(outbox.put_nowait, message)

        done = loop.run_in_executor(self._executor, compute) if self._executor is not None else None
        if done is None:
            raise RuntimeError(f"Stage {self.stage} server is not running")
        done.add_done_callback(lambda _: outbox.put_nowait(None))  # runs after every message was queued
        while (message := await outbox.get()) is not None:
            yield message
        done.result()  # the compute error, if any

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        """Stage index, throughput, samples processed and optimizer epoch (msgpack dict)."""
        self._check_uid(request.uid)
        return runtime_pb2.ExpertInfo(serialized_info=msgpack.packb(self.info()))

    async def rpc_state(
        self, request: runtime_pb2.ExpertUID, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """The stage module's ``state_dict``, uncompressed, as ``pack((), state_dict)`` (chunked)."""
        self._check_uid(request.uid)
        loop = asyncio.get_running_loop()
        state = await loop.run_in_executor(None, self.state_dict_local)
        reply = LazyPack((), state, "none")
        messages = await loop.run_in_executor(
            None, lambda: list(_wire.messages(runtime_pb2.ExpertResponse, reply.parts(), reply.metadata))
        )
        for message in messages:
            yield message

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        # fixed class name, so that subclasses (e.g. in tests) and the client's stubs agree
        handle_name = f"StageServer.{method_name}"
        return handle_name if namespace is None else f"{namespace}::{handle_name}"


def backward_metadata(inputs_metadata: bytes, num_inputs: int, grads_metadata: bytes) -> bytes:
    """Metadata of a backward request: the forward's input metadata, its tensor count and the grads' one."""
    return msgpack.packb([inputs_metadata, num_inputs, grads_metadata], use_bin_type=True)


def parse_backward_metadata(metadata: bytes) -> tuple[bytes, int, bytes]:
    """Inverse of :func:`backward_metadata`; raises ``ValueError`` on malformed input."""
    try:
        inputs_meta, num_inputs, grads_meta = msgpack.unpackb(metadata, raw=False)
    except Exception as e:
        raise ValueError(f"Malformed backward request metadata ({type(e).__name__}: {e})") from None
    if not isinstance(inputs_meta, bytes) or type(num_inputs) is not int or not isinstance(grads_meta, bytes):
        raise ValueError("Malformed backward request metadata: expected [bytes, int, bytes]")
    return inputs_meta, num_inputs, grads_meta


def _detached(
    structure: tuple[tuple, dict], keep_requires_grad: bool, device: torch.device
) -> tuple[tuple, dict]:
    """Fresh leaves on ``device``: detach every tensor; floating ones keep their requires_grad if asked."""
    tensors, skeleton = flatten_tensors(structure)
    leaves = []
    for t in tensors:
        leaf = t.detach().to(device)
        if keep_requires_grad and t.requires_grad and t.is_floating_point():
            leaf.requires_grad_(True)
        leaves.append(leaf)
    args, kwargs = rebuild_tensors(skeleton, leaves)
    return tuple(args), dict(kwargs)
