"""What a trainer and a stage server agree on: names, framing, validation and error replies.

The client (:mod:`.client`) and the server (:mod:`.server`) depend on this module, not on each other. The guards
on values, schemas and bans are in :mod:`.guards`, the error types and error replies in :mod:`.errors`.

- Names: stage ``k`` of run ``run_id`` is :func:`stage_uid` (RPC namespace, request uid, optimizer prefix).
- Calls: a :class:`StageRequest` (``forward``: the call's inputs; ``backward``: the inputs again plus the output
  gradients, since any peer of the stage may serve the backward by recomputing the forward) and a
  :class:`StageReply` (the outputs or input gradients, or an :class:`ErrorReply`). In-process calls pass these
  objects as they are; over the network (:mod:`.transport`) they travel as tensor parts plus a *header*:
  ``[version, kind, request_id, uid, inputs metadata, grads metadata or None, commit_by or None, forward_id or
  None, training, seed or None, epoch or None, buffers]`` for a request (protocol version 6; a peer refuses other
  versions) and
  ``["ok", request_id, outputs metadata, kept]`` or ``["error", request_id, category, type, message]`` for a
  reply (``kept``: the server kept the forward for its backward).
  Which input tensors require grad travels with each tensor (its first part's ``requires_grad``, see
  :mod:`.codec`), so the server differentiates exactly the inputs the trainer marked. Every request carries a
  caller-chosen ``request_id`` that its reply repeats, unique across callers (random 62-bit start, then
  counted) and the same on every retry of one call: a server applies a backward's gradients at most once per
  id. ``commit_by`` (wall-clock seconds, ``time.time()``) is when the caller stops
  counting on the call: a backward that ends later is not applied, since the caller has retried it elsewhere.
  ``forward_id`` links a backward to its forward: a forward that sets it (to its own id) asks the server to keep
  its activations, and the backward that names it reuses them on that server instead of recomputing the forward
  (a server that does not have them recomputes). A backward sent to the peer that kept its forward carries no
  inputs (``None`` as the inputs metadata; only after the forward's reply said ``kept``): the server takes them
  from the kept forward, and replies
  :class:`~.errors.NotKept` if it no longer has it, which the trainer answers by sending the inputs (a backward's
  inputs are about a fifth of a stage's bytes per microbatch). ``training`` is the mode of the trainer's proxy module
  (``module.train()``/``eval()``): the server runs the stage in that mode for this call. ``seed`` (a 63-bit
  integer the caller draws per forward, repeated by its backward) seeds the random number generators the
  stage draws from (dropout), so that a backward served by recomputing the forward, on any peer, draws the
  forward's masks. ``buffers`` says whether a train-mode forward updates the stage's buffers (batch
  normalisation's running statistics): with several trainers only one trainer's forwards do, as only DDP's rank 0
  decides the buffers (see :mod:`~lightning_swarm.swarm.training.trainer_sync`).
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

from dataclasses import dataclass
from typing import AsyncIterator  # noqa: UP035 (hivemind detects stream handlers by typing.AsyncIterator)

import msgpack
import torch
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from lightning_swarm.swarm.wire.codec import CodecError
from lightning_swarm.swarm.wire.errors import (
    COMPUTE,
    MAX_MESSAGE,
    REQUEST,
    UNAVAILABLE,
    BadRequest,
    ErrorReply,
    Misrouted,
    ProtocolError,
)
from lightning_swarm.swarm.wire.guards import (
    check_finite,
    check_values,
)
from lightning_swarm.swarm.wire.payload import EncodedPayload, Payload

__all__ = [
    "KINDS",
    "PROTOCOL_VERSION",
    "StageReply",
    "StageRequest",
    "StageService",
    "check_run_id",
    "encode_reply_header",
    "encode_request_header",
    "fp32_bytes",
    "parse_reply",
    "parse_request",
    "stage_uid",
    "warm_up_codec",
]

# 4: requests carry the stage's epoch; 5: a backward may leave its inputs to its kept forward
PROTOCOL_VERSION = 6
SEED_BITS = 63  # a request's seed is in [0, 2**SEED_BITS)
KINDS = ("forward", "backward")
_CATEGORIES = (COMPUTE, REQUEST, UNAVAILABLE)
# limits on what a stage server accepts in one call (StageServer takes others as arguments)
MAX_REQUEST_BYTES = 512 * 1024 * 1024  # decoded tensors of one request (inputs plus output gradients)
MAX_REQUEST_TENSORS = 4096
MAX_MESSAGE_BYTES = (
    64 * 1024 * 1024
)  # one message on the wire (ours carry at most ~64 KiB of parts, or one call)
MAX_REQUEST_MESSAGES = 100_000
OPTIMIZER_PART_BYTES = (
    1 << 20
)  # a stage's optimizer state travels in parts (hivemind caps a unary message at 2 MiB)
MAX_REPLY_BYTES = 4 * 1024 * 1024 * 1024  # decoded tensors of one reply, on the trainer's side


def warm_up_codec(compression: str) -> None:
    """Load the 8-bit kernels now (importing bitsandbytes takes seconds on a busy machine): a peer's first call
    must not spend its ``request_timeout`` on that."""
    if compression == "8bit":
        from lightning_swarm.swarm.wire.quantize import quantize_to_buffer

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
        epoch: calls of a trainer that commands the stages' steps: the stage's optimizer epoch as its peers
            replied to the trainer's last step. A peer behind it missed steps (it joined or came back
            meanwhile) and loads the stage's state from its peers before serving; ``None``: no expectation.
        buffers: a train-mode forward updates the stage's buffers (batch normalisation's running statistics);
            ``False``: they are left as they were (the forward uses the batch's statistics all the same), for the
            calls of a trainer that does not own the buffers (several trainers: only the step's leader does).
    """

    kind: str
    uid: str
    # None: a received backward that leaves them to its kept forward (the server fills them in)
    inputs: Payload | None
    grad_outputs: Payload | None = None
    request_id: int = 0
    commit_by: float | None = None
    forward_id: int | None = None
    training: bool = True
    seed: int | None = None
    epoch: int | None = None
    buffers: bool = True

    def payloads(self) -> list[Payload]:
        assert self.inputs is not None, "a request is encoded with its inputs"
        return [self.inputs] if self.grad_outputs is None else [self.inputs, self.grad_outputs]


@dataclass
class StageReply:
    """The reply to a :class:`StageRequest`: its ``outputs`` payload, or an ``error``."""

    request_id: int
    outputs: Payload | None = None
    error: ErrorReply | None = None
    kept: bool = False  # a forward whose activations and inputs the server kept for its backward


def fp32_bytes(request: StageRequest, reply: StageReply, lean: bool = False) -> int:
    """What a call's floating-point tensors (the request's inputs and output gradients, the reply's outputs) take
    as float32: the bytes its boundaries would move without compression (``lean``: a backward sent without its
    inputs)."""
    payloads: tuple[Payload | None, ...] = (request.inputs, request.grad_outputs, reply.outputs)
    if lean:
        payloads = payloads[1:]
    return 4 * sum(t.numel() for p in payloads if p is not None for t in p.tensors if t.is_floating_point())


# ---- the wire form of headers ----


def encode_request_header(
    request: StageRequest, inputs: EncodedPayload | None, grads: EncodedPayload | None
) -> bytes:
    """The header of a request whose payloads were encoded as ``inputs`` (and ``grads``); ``inputs`` ``None``: a
    backward sent without them, to the peer that kept its forward."""
    return msgpack.packb(
        [
            PROTOCOL_VERSION,
            request.kind,
            request.request_id,
            request.uid,
            None if inputs is None else inputs.metadata,
            None if grads is None else grads.metadata,
            request.commit_by,
            request.forward_id,
            bool(request.training),
            request.seed,
            request.epoch,
            bool(request.buffers),
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
    if not isinstance(fields, list) or len(fields) != 12:
        raise BadRequest(
            "Malformed request header: expected [version, kind, id, uid, inputs, grads, commit_by, forward_id, "
            "training, seed, epoch, buffers]"
        )
    (
        version,
        kind,
        request_id,
        uid,
        inputs_meta,
        grads_meta,
        commit_by,
        forward_id,
        training,
        seed,
        epoch,
        buffers,
    ) = fields
    if type(buffers) is not bool:
        raise BadRequest("Malformed request header: buffers must be true or false")
    if epoch is not None and (type(epoch) is not int or not 0 <= epoch < 1 << 62):
        raise BadRequest("Malformed request header: epoch must be an integer in [0, 2**62) or None")
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
    lean = inputs_meta is None and kind == "backward" and forward_id is not None  # inputs: the kept forward's
    if not (lean or isinstance(inputs_meta, bytes)) or (kind == "backward") != isinstance(grads_meta, bytes):
        raise BadRequest(f"Malformed {kind} request: wrong payload metadata")
    inputs: Payload | None = None
    try:
        num_inputs = 0 if lean else _declared_tensors(inputs_meta)
        if not 0 <= num_inputs <= len(tensors):
            raise BadRequest(
                f"Malformed request: {num_inputs} input tensors declared, {len(tensors)} received"
            )
        if not lean:
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
    if inputs is not None:
        check_values(inputs.tensors, "input", BadRequest)
    if grads is not None:
        check_finite(grads.tensors, "output gradient", BadRequest)
    commit_by = None if commit_by is None else float(commit_by)
    return StageRequest(
        kind, uid, inputs, grads, request_id, commit_by, forward_id, training, seed, epoch, buffers
    )


def encode_reply_header(reply: StageReply, outputs: EncodedPayload | None) -> bytes:
    """The header of a reply (successful with ``outputs`` encoded, or an error)."""
    if reply.error is not None:
        e = reply.error
        return msgpack.packb(
            ["error", reply.request_id, e.category, e.type_name, e.message], use_bin_type=True
        )
    assert outputs is not None
    return msgpack.packb(["ok", reply.request_id, outputs.metadata, reply.kept], use_bin_type=True)


def parse_reply(header: bytes, tensors: list[torch.Tensor]) -> StageReply:
    """A received reply; raises :class:`ProtocolError` if it is malformed."""
    try:
        fields = msgpack.unpackb(header, raw=False)
    except Exception as e:
        raise ProtocolError(f"Malformed reply header ({type(e).__name__}: {e})") from None
    if isinstance(fields, list) and len(fields) == 5 and fields[0] == "error" and type(fields[1]) is int:
        _, request_id, category, type_name, message = fields
        if category in _CATEGORIES and isinstance(type_name, str) and isinstance(message, str):
            return StageReply(request_id, error=ErrorReply(category, type_name[:100], message[:MAX_MESSAGE]))
    if isinstance(fields, list) and len(fields) == 4 and fields[0] == "ok" and type(fields[1]) is int:
        if isinstance(fields[2], bytes) and type(fields[3]) is bool:
            return StageReply(fields[1], outputs=Payload.from_wire(fields[2], tensors), kept=fields[3])
    raise ProtocolError(
        "Malformed reply header: expected ['ok', id, bytes, kept] or ['error', id, category, type, message]"
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
    """The RPCs of a stage (served by a stage server's ``ConnectionHandler``; a client builds its stubs from this class).

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
