"""What a trainer and a stage server agree on: names, framing, validation and error replies.

The client (:mod:`.client`) and the server (:mod:`.server`) depend on this module, not on each other.

- Names: stage ``k`` of run ``run_id`` is :func:`stage_uid` (RPC namespace, request uid, optimizer prefix).
- Calls: a :class:`StageRequest` (``forward``: the call's inputs; ``backward``: the inputs again plus the output
  gradients, since any peer of the stage may serve the backward by recomputing the forward) and a
  :class:`StageReply` (the outputs or input gradients, or an :class:`ErrorReply`). In-process calls pass these
  objects as they are; over the network (:mod:`.transport`) they travel as tensor parts plus a *header*:
  ``[version, kind, request_id, uid, inputs metadata, grads metadata or None, commit_by or None, forward_id or
  None, training, seed or None]`` for a request (protocol version 3; a peer refuses other versions) and
  ``["ok", request_id, outputs metadata]`` or ``["error", request_id, category, type, message]`` for a reply.
  Which input tensors require grad travels with each tensor (its first part's ``requires_grad``, see
  :mod:`.codec`), so the server differentiates exactly the inputs the trainer marked. Every request carries a
  caller-chosen ``request_id`` that its reply repeats, unique across callers (random 62-bit start, then
  counted) and the same on every retry of one call: a server applies a backward's gradients at most once per
  id. ``commit_by`` (wall-clock seconds, ``time.time()``) is when the caller stops
  counting on the call: a backward that ends later is not applied, since the caller has retried it elsewhere.
  ``forward_id`` links a backward to its forward: a forward that sets it (to its own id) asks the server to keep
  its activations, and the backward that names it reuses them on that server instead of recomputing the forward
  (a server that does not have them recomputes). ``training`` is the mode of the trainer's proxy module
  (``module.train()``/``eval()``): the server runs the stage in that mode for this call. ``seed`` (a 63-bit
  integer the caller draws per forward, repeated by its backward) seeds the random number generators the
  stage draws from (dropout), so that a backward served by recomputing the forward, on any peer, draws the
  forward's masks.
- Validation: :func:`parse_request` is the one place where a received request is checked (framing, stage,
  structure, values); anything wrong raises :class:`BadRequest`. Values: inputs that do not require grad are
  *data* (a float attention mask with ``-inf``, booleans, integers) and pass untouched unless they hold NaN;
  activations and gradients are checked: NaN is refused everywhere, an infinity in an input that requires grad
  and in an output gradient (:func:`check_values`). Outputs are checked the same way on both sides
  (:func:`check_outputs`): NaN nowhere, and an infinity only in an output that is one of the call's data inputs
  passed through. Size limits apply while the request is decoded (:data:`MAX_REQUEST_BYTES` etc., see
  :class:`~.transport.MessageReceiver`), before anything is allocated. A server checks a request's tensors
  against the stage's :class:`InputSchema` (count, dtype and number of dimensions of each tensor, learned from
  the calls it served successfully), and ignores for a while a peer that keeps sending bad requests (:class:`BadPeers`).
- Errors: an error reply says *why* a call failed. ``"compute"``: the stage's own code raised (a shape
  mismatch, a wrong dtype): the trainer gets that error, with the remote type and message, at once.
  ``"request"``: the server refused the request's own content (malformed, a schema mismatch, a non-finite
  activation, too large): every peer would refuse it, so the trainer raises :class:`RequestRefused` with the
  server's message at once, without retrying or banning anyone. ``"unavailable"``: this peer cannot serve
  it, another may: it is shutting down, out of memory, serves another stage (:class:`Misrouted`: a peer that
  migrated) or speaks another protocol version, or ignores the caller for a while (:class:`BadPeers`). Those,
  like transport failures (a peer that does not answer) and malformed replies, make the trainer retry on
  another peer of the stage and ban this one.
"""

from __future__ import annotations

import builtins
import functools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind detects stream handlers by typing.AsyncIterator)

import msgpack
import torch
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from .codec import CodecError, all_finite
from .payload import EncodedPayload, Payload
from .quantize import one_thread

__all__ = [
    "KINDS",
    "PROTOCOL_VERSION",
    "BadPeers",
    "BadRequest",
    "Misrouted",
    "ErrorReply",
    "InputSchema",
    "ProtocolError",
    "RemoteStageError",
    "RequestRefused",
    "StageSchemas",
    "StageReply",
    "StageRequest",
    "StageService",
    "check_finite",
    "check_outputs",
    "check_values",
    "check_run_id",
    "encode_reply_header",
    "encode_request_header",
    "parse_reply",
    "parse_request",
    "stage_uid",
    "warm_up_codec",
]

PROTOCOL_VERSION = 3
SEED_BITS = 63  # a request's seed is in [0, 2**SEED_BITS)
KINDS = ("forward", "backward")
COMPUTE, REQUEST, UNAVAILABLE = "compute", "request", "unavailable"
_CATEGORIES = (COMPUTE, REQUEST, UNAVAILABLE)
_MAX_MESSAGE = 4096
# limits on what a stage server accepts in one call (StageServer takes others as arguments)
MAX_REQUEST_BYTES = 512 * 1024 * 1024  # decoded tensors of one request (inputs plus output gradients)
MAX_REQUEST_TENSORS = 4096
MAX_MESSAGE_BYTES = (
    64 * 1024 * 1024
)  # one message on the wire (ours carry at most ~64 KiB of parts, or one call)
MAX_REQUEST_MESSAGES = 100_000
MAX_REPLY_BYTES = 4 * 1024 * 1024 * 1024  # decoded tensors of one reply, on the trainer's side


def warm_up_codec(compression: str) -> None:
    """Load the 8-bit kernels now (importing bitsandbytes takes seconds on a busy machine): a peer's first call
    must not spend its ``request_timeout`` on that."""
    if compression == "8bit":
        from .quantize import quantize_to_buffer

        quantize_to_buffer(torch.zeros(4096))


def stage_uid(run_id: str, stage: int) -> str:
    """Name of stage ``stage`` of run ``run_id`` (RPC namespace, request uid and optimizer run id)."""
    return f"{run_id}.stage{stage}"


def check_run_id(run_id: str, owner: str = "SwarmSettings") -> str:
    """Return ``run_id`` if usable in DHT keys and optimizer prefixes, else raise a ``ValueError`` saying why."""
    if not isinstance(run_id, str) or not run_id or "." in run_id:
        raise ValueError(
            f"{owner}: run_id must be a non-empty string without '.', got {run_id!r} "
            f"(it prefixes DHT keys like '<run_id>.stage0.0'); use e.g. '-' or '_' instead"
        )
    return run_id


class BadRequest(ValueError):
    """A received request is malformed: its own content is refused (every peer of the stage would refuse it)."""


class Misrouted(BadRequest):
    """A request this peer cannot take but another peer of the stage may: it names a stage this peer does not
    serve (it migrated), or speaks another protocol version. Replied as ``"unavailable"``."""


class ProtocolError(CodecError):
    """A received reply is malformed (the peer, not the caller, is at fault)."""


@dataclass
class StageRequest:
    """One forward or backward call of a stage.

    Args:
        kind: ``"forward"`` or ``"backward"``.
        uid: the stage's :func:`stage_uid`.
        inputs: the call's ``(args, kwargs)`` payload.
        grad_outputs: backward only: a tuple payload with one gradient (or ``None``) per output tensor.
        request_id: chosen by the caller, repeated by the reply; the same on every retry of one call.
        commit_by: backward only: wall-clock time (``time.time()``) after which the server must not apply the
            gradients any more; ``None``: no deadline (in-process calls).
        forward_id: forward: its own ``request_id`` to ask the server to keep its activations for the backward;
            backward: the ``request_id`` of its forward, whose kept activations it may reuse. ``None``: neither.
        training: run the stage in training mode (``True``) or in eval mode (dropout off, batch normalisation
            with its running statistics).
        seed: seeds the stage's random number generators for this call (a backward repeats its forward's, so a
            recomputed forward draws the same dropout masks); ``None``: the server's own generators, unseeded.
    """

    kind: str
    uid: str
    inputs: Payload
    grad_outputs: Payload | None = None
    request_id: int = 0
    commit_by: float | None = None
    forward_id: int | None = None
    training: bool = True
    seed: int | None = None

    def payloads(self) -> list[Payload]:
        return [self.inputs] if self.grad_outputs is None else [self.inputs, self.grad_outputs]


@dataclass
class ErrorReply:
    """Why a call failed: ``category`` (compute/request/unavailable), the exception's type name and message."""

    category: str
    type_name: str
    message: str

    @classmethod
    def from_exception(cls, error: BaseException, category: str) -> ErrorReply:
        return cls(category, type(error).__name__, str(error)[:_MAX_MESSAGE])


@dataclass
class StageReply:
    """The reply to a :class:`StageRequest`: its ``outputs`` payload, or an ``error``."""

    request_id: int
    outputs: Payload | None = None
    error: ErrorReply | None = None


class RemoteStageError(RuntimeError):
    """A peer replied to a stage call with an error (see :class:`ErrorReply`).

    Errors raised by the stage's own code (category ``"compute"``) reach the trainer as an exception that is
    both a ``RemoteStageError`` and, where the remote type is a Python built-in (``RuntimeError``,
    ``ValueError``, ``TypeError``...), an instance of that type.
    """

    def __init__(
        self, message: str, error: ErrorReply | None = None, stage: int | None = None, peer: Any = None
    ):
        super().__init__(message)
        self.error, self.stage, self.peer = error, stage, peer

    @property
    def is_compute_error(self) -> bool:
        """Whether the stage's own code raised (retrying on another peer would fail the same way)."""
        return self.error is not None and self.error.category == COMPUTE

    @property
    def is_caller_error(self) -> bool:
        """Whether another peer would fail the same way (the stage's code raised, or the request was refused):
        such an error is raised to the trainer at once, never retried elsewhere."""
        return self.error is not None and self.error.category in (COMPUTE, REQUEST)


class RequestRefused(RemoteStageError):
    """A peer refused a stage call for the request's own content (error category ``"request"``: malformed, a
    schema mismatch, NaN in an input, an infinity in an activation or gradient, beyond the size limits): every
    peer of the stage would, so it is raised at once with the server's message."""


@functools.cache
def _remote_class(
    type_name: str, origin: type[RuntimeError] = RemoteStageError, prefix: str = "Remote"
) -> type[RuntimeError]:
    """``origin`` (the kind of remote error), combined with the built-in exception type ``type_name`` if it is one
    (named ``prefix + type_name``): ``except ValueError`` catches a ``ValueError`` raised elsewhere in the swarm."""
    base = getattr(builtins, type_name, None)
    if not isinstance(base, type) or not issubclass(base, Exception) or base in (RuntimeError, Exception):
        return origin
    try:
        return type(f"{prefix}{type_name}", (origin, base), {"__module__": origin.__module__})
    except TypeError:  # a built-in whose instance layout differs (OSError, SyntaxError...)
        return origin


def remote_exception(error: ErrorReply, stage: int, peer: Any) -> RemoteStageError:
    """The exception a trainer raises for an error reply from ``peer`` serving ``stage``."""
    if error.category == COMPUTE:
        message = f"Stage {stage} raised {error.type_name}: {error.message} (on peer {peer})"
        cls = _remote_class(error.type_name)
    elif error.category == REQUEST:
        message = f"Peer {peer} refused the call of stage {stage}: {error.type_name}: {error.message}"
        cls = RequestRefused
    else:
        message = f"Peer {peer} could not serve stage {stage} ({error.category}): {error.type_name}: {error.message}"
        cls = RemoteStageError
    return cls(message, error, stage, peer)


# ---- the wire form of headers ----


def encode_request_header(
    request: StageRequest, inputs: EncodedPayload, grads: EncodedPayload | None
) -> bytes:
    """The header of a request whose payloads were encoded as ``inputs`` (and ``grads``)."""
    return msgpack.packb(
        [
            PROTOCOL_VERSION,
            request.kind,
            request.request_id,
            request.uid,
            inputs.metadata,
            None if grads is None else grads.metadata,
            request.commit_by,
            request.forward_id,
            bool(request.training),
            request.seed,
        ],
        use_bin_type=True,
    )


def parse_request(header: bytes, tensors: list[torch.Tensor], expected_uid: str) -> StageRequest:
    """Validate a received request (its header and decoded tensors) for the stage ``expected_uid``.

    Raises:
        BadRequest: anything is wrong: framing, kind, metadata, tensor count, structure or values
            (:class:`Misrouted`: another protocol version, or another stage).
    """
    try:
        fields = msgpack.unpackb(header, raw=False)
    except Exception as e:
        raise BadRequest(f"Malformed request header ({type(e).__name__}: {e})") from None
    if isinstance(fields, list) and fields and fields[0] != PROTOCOL_VERSION:
        raise Misrouted(
            f"Request uses protocol version {str(fields[0])[:20]}; this peer speaks {PROTOCOL_VERSION}"
        )
    if not isinstance(fields, list) or len(fields) != 10:
        raise BadRequest(
            "Malformed request header: expected [version, kind, id, uid, inputs, grads, commit_by, forward_id, "
            "training, seed]"
        )
    version, kind, request_id, uid, inputs_meta, grads_meta, commit_by, forward_id, training, seed = fields
    if type(training) is not bool:
        raise BadRequest("Malformed request header: training must be true or false")
    if seed is not None and (type(seed) is not int or not 0 <= seed < 1 << SEED_BITS):
        raise BadRequest(f"Malformed request header: seed must be an integer in [0, 2**{SEED_BITS}) or None")
    if forward_id is not None and type(forward_id) is not int:
        raise BadRequest("Malformed request header: forward_id must be an integer or None")
    if commit_by is not None and (type(commit_by) not in (int, float) or commit_by != commit_by):
        raise BadRequest("Malformed request header: commit_by must be a number of seconds or None")
    if kind not in KINDS:
        raise BadRequest(f"Unknown request kind {kind!r}; expected one of {KINDS}")
    if type(request_id) is not int:
        raise BadRequest("Malformed request header: the request id must be an integer")
    if uid != expected_uid:
        raise Misrouted(f"This peer serves {expected_uid!r}, but the request was for {str(uid)[:200]!r}")
    if not isinstance(inputs_meta, bytes) or (kind == "backward") != isinstance(grads_meta, bytes):
        raise BadRequest(f"Malformed {kind} request: wrong payload metadata")
    try:
        num_inputs = _declared_tensors(inputs_meta)
        if not 0 <= num_inputs <= len(tensors):
            raise BadRequest(
                f"Malformed request: {num_inputs} input tensors declared, {len(tensors)} received"
            )
        inputs = Payload.from_wire(inputs_meta, tensors[:num_inputs])
        inputs.rebuild_call()
        grads = None
        if grads_meta is not None:
            grads = Payload.from_wire(grads_meta, tensors[num_inputs:])
            structure = grads.rebuild()
            if not isinstance(structure, tuple) or not all(
                g is None or isinstance(g, torch.Tensor) for g in structure
            ):
                raise BadRequest(
                    "Malformed backward request: output gradients must be a tuple of tensors/None"
                )
        elif num_inputs != len(tensors):
            raise BadRequest(f"Malformed request: {len(tensors) - num_inputs} tensors beyond the inputs")
    except CodecError as e:
        raise BadRequest(str(e)) from None
    check_values(inputs.tensors, "input", BadRequest)
    if grads is not None:
        check_finite(grads.tensors, "output gradient", BadRequest)
    commit_by = None if commit_by is None else float(commit_by)
    return StageRequest(kind, uid, inputs, grads, request_id, commit_by, forward_id, training, seed)


def check_finite(tensors: list[torch.Tensor], what: str, error: type[Exception]) -> None:
    """Raise ``error`` if a floating tensor among ``tensors`` holds a NaN or an infinity (for gradients).

    Runs on one OpenMP thread, as the codec does (see :mod:`.quantize`): a parallel region's spinning workers
    would starve the p2p daemons sharing the cores, on every call."""
    with one_thread():
        for i, t in enumerate(tensors):
            if not all_finite(t):
                raise error(
                    f"{what.capitalize()} tensor {i} holds NaN or infinite values; only finite values are accepted"
                )


def check_values(tensors: list[torch.Tensor], what: str, error: type[Exception]) -> None:
    """Raise ``error`` if a floating tensor among ``tensors`` holds a NaN, or an infinity while it requires grad.

    A tensor that does not require grad is data, not an activation: a float attention mask holds ``-inf`` by
    design (``nn.Transformer.generate_square_subsequent_mask``). Finite tensors cost one pass, as in
    :func:`check_finite`; only a non-finite one is scanned again for NaN."""
    with one_thread():
        for i, t in enumerate(tensors):
            if all_finite(t):
                continue
            if t.requires_grad:
                raise error(
                    f"{what.capitalize()} tensor {i} holds NaN or infinite values; an input that requires grad "
                    "(an activation) must be finite"
                )
            if bool(torch.isnan(t).any()):
                raise error(f"{what.capitalize()} tensor {i} holds NaN values; only numbers are accepted")


def check_outputs(
    outputs: list[torch.Tensor], inputs: list[torch.Tensor], what: str, error: type[Exception]
) -> None:
    """Raise ``error`` if a floating tensor among a call's ``outputs`` holds a NaN, or an infinity unless it is
    one of the call's data ``inputs`` (one that does not require grad, e.g. a mask a block passes through)
    returned as it is: equal in dtype, shape and values. Checked by the server before it replies and by the
    trainer on receipt; finite outputs cost one pass each."""
    with one_thread():
        for i, t in enumerate(outputs):
            if all_finite(t):
                continue
            if not bool(torch.isnan(t).any()) and any(_same_data(t, x) for x in inputs):
                continue
            raise error(
                f"{what.capitalize()} tensor {i} holds NaN or infinite values; only finite values are accepted"
            )


def _same_data(output: torch.Tensor, data: torch.Tensor) -> bool:
    if output is data:
        return not data.requires_grad
    if data.requires_grad or data.dtype != output.dtype or data.shape != output.shape:
        return False
    return bool(torch.equal(output.detach().to(data.device), data))


@dataclass(frozen=True)
class InputSchema:
    """What a stage's calls look like: per tensor (in payload order) its dtype and number of dimensions. Sizes are
    not part of it: batch sizes, sequence lengths and even feature sizes may legitimately vary from call to call (a
    request whose sizes the module cannot take gets the module's own error, a ``compute`` error reply; the size
    limits bound what such a request can cost)."""

    specs: tuple[tuple[torch.dtype, int], ...]

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> InputSchema:
        return cls(tuple((t.dtype, t.dim()) for t in tensors))

    def mismatch(self, tensors: list[torch.Tensor]) -> str | None:
        """Why ``tensors`` do not fit this schema, or ``None`` if they do."""
        if len(tensors) != len(self.specs):
            return f"{len(tensors)} tensors sent, this stage takes {len(self.specs)}"
        for i, (t, (dtype, ndim)) in enumerate(zip(tensors, self.specs, strict=True)):
            if t.dtype != dtype:
                return f"input tensor {i} is {t.dtype}, this stage takes {dtype}"
            if t.dim() != ndim:
                return (
                    f"input tensor {i} has shape {list(t.shape)}, this stage takes {ndim}-dimensional tensors"
                )
        return None


class StageSchemas:
    """The input schemas a stage server has served successfully (at most ``max_schemas``; thread-safe).

    Until the first call succeeds anything well-formed is tried on the module; afterwards a request whose tensors
    match none of the learned schemas is refused before it reaches the module (:meth:`check`).
    """

    def __init__(self, max_schemas: int = 4) -> None:
        self.max_schemas = max_schemas
        self._schemas: list[InputSchema] = []
        self._lock = threading.Lock()

    def check(self, tensors: list[torch.Tensor]) -> None:
        schemas = self._schemas
        if not schemas:
            return
        reasons = [schema.mismatch(tensors) for schema in schemas]
        if all(reasons):
            raise BadRequest(f"The request does not fit this stage: {reasons[0]}")

    def learn(self, tensors: list[torch.Tensor]) -> None:
        """Remember the schema of a call the stage served successfully."""
        schema = InputSchema.of(tensors)
        with self._lock:
            if schema not in self._schemas and len(self._schemas) < self.max_schemas:
                self._schemas = [*self._schemas, schema]


class BadPeers:
    """Peers that sent too many bad requests, ignored for a while (thread-safe, bounded).

    A peer that sends ``limit`` bad requests within ``window`` seconds is ignored for ``ban_s`` seconds.
    """

    def __init__(self, limit: int = 20, window: float = 60.0, ban_s: float = 60.0, max_peers: int = 10_000):
        self.limit, self.window, self.ban_s, self.max_peers = limit, window, ban_s, max_peers
        self._strikes: OrderedDict[Any, list[float]] = OrderedDict()
        self._banned: OrderedDict[Any, float] = OrderedDict()
        self._lock = threading.Lock()

    def strike(self, peer: Any, now: float | None = None) -> bool:
        """Count one bad request of ``peer``; returns whether it is ignored from now on."""
        now = time.monotonic() if now is None else now
        with self._lock:
            times = [t for t in self._strikes.pop(peer, []) if t > now - self.window]
            times.append(now)
            if len(times) < self.limit:
                self._strikes[peer] = times
                while len(self._strikes) > self.max_peers:
                    self._strikes.popitem(last=False)
                return False
            self._banned.pop(peer, None)
            self._banned[peer] = now + self.ban_s
            while len(self._banned) > self.max_peers:
                self._banned.popitem(last=False)
            return True

    def ignored_for(self, peer: Any, now: float | None = None) -> float:
        """Seconds ``peer`` is still ignored (0: not ignored)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            until = self._banned.get(peer)
            if until is None:
                return 0.0
            if until <= now:
                del self._banned[peer]
                return 0.0
            return until - now


def check_grad_outputs(grads: tuple, outputs: list[torch.Tensor]) -> None:
    """Check a backward request's output gradients against the recomputed outputs; raises ``BadRequest``."""
    if len(grads) != len(outputs):
        raise BadRequest(
            f"The stage produced {len(outputs)} output tensors but {len(grads)} gradients were sent"
        )
    for i, (out, grad) in enumerate(zip(outputs, grads, strict=True)):
        if grad is not None and grad.shape != out.shape:
            raise BadRequest(
                f"Output gradient {i} has shape {list(grad.shape)}; the output has {list(out.shape)}"
            )
        if grad is not None and not grad.is_floating_point():
            raise BadRequest(f"Output gradient {i} is {grad.dtype}; gradients must be floating point")


def encode_reply_header(reply: StageReply, outputs: EncodedPayload | None) -> bytes:
    """The header of a reply (successful with ``outputs`` encoded, or an error)."""
    if reply.error is not None:
        e = reply.error
        return msgpack.packb(
            ["error", reply.request_id, e.category, e.type_name, e.message], use_bin_type=True
        )
    assert outputs is not None
    return msgpack.packb(["ok", reply.request_id, outputs.metadata], use_bin_type=True)


def parse_reply(header: bytes, tensors: list[torch.Tensor]) -> StageReply:
    """A received reply; raises :class:`ProtocolError` if it is malformed."""
    try:
        fields = msgpack.unpackb(header, raw=False)
    except Exception as e:
        raise ProtocolError(f"Malformed reply header ({type(e).__name__}: {e})") from None
    if isinstance(fields, list) and len(fields) == 5 and fields[0] == "error" and type(fields[1]) is int:
        _, request_id, category, type_name, message = fields
        if category in _CATEGORIES and isinstance(type_name, str) and isinstance(message, str):
            return StageReply(request_id, error=ErrorReply(category, type_name[:100], message[:_MAX_MESSAGE]))
    if isinstance(fields, list) and len(fields) == 3 and fields[0] == "ok" and type(fields[1]) is int:
        if isinstance(fields[2], bytes):
            return StageReply(fields[1], outputs=Payload.from_wire(fields[2], tensors))
    raise ProtocolError(
        "Malformed reply header: expected ['ok', id, bytes] or ['error', id, category, type, message]"
    )


def _declared_tensors(metadata: bytes) -> int:
    try:
        parsed = msgpack.unpackb(metadata, raw=False, strict_map_key=False)
    except Exception as e:
        raise BadRequest(f"Malformed payload metadata ({type(e).__name__}: {e})") from None
    if not isinstance(parsed, list) or len(parsed) != 2 or type(parsed[1]) is not int:
        raise BadRequest("Malformed payload metadata: expected [skeleton, num_tensors]")
    return parsed[1]


class StageService(ServicerBase):
    """The RPCs of a stage (implemented by ``StageServer``; a client builds its stubs from this class).

    - ``rpc_channel``: a long-lived stream of calls, each one or more request messages (parts, then the
      request header on the last) answered by one or more reply messages (parts, then the reply header);
    - ``rpc_info``: ``ExpertUID(uid)`` -> msgpack ``{"stage", "throughput", "samples_processed", "epoch", "steps"}``;
    - ``rpc_step``: a trainer's step command (msgpack, see :mod:`.stepping`) -> msgpack reply;
    - ``rpc_optimizer``: get or set the stage optimizer's state (checkpoints and resuming);
    - ``rpc_state``: ``ExpertUID(uid)`` -> the stage's ``state_dict`` as a payload in messages (metadata last).
    """

    async def rpc_channel(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # pragma: no cover

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        raise NotImplementedError

    async def rpc_step(self, request: runtime_pb2.ExpertInfo, context: P2PContext) -> runtime_pb2.ExpertInfo:
        raise NotImplementedError

    async def rpc_optimizer(
        self, request: runtime_pb2.ExpertInfo, context: P2PContext
    ) -> runtime_pb2.ExpertInfo:
        raise NotImplementedError

    async def rpc_state(
        self, request: runtime_pb2.ExpertUID, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # pragma: no cover

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        # one fixed name, so that servers (and their subclasses, e.g. in tests) and clients' stubs agree
        handle_name = f"StageServer.{method_name}"
        return handle_name if namespace is None else f"{namespace}::{handle_name}"
