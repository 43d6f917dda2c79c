"""A stage call as an autograd node: :class:`StageFunction` sends the forward when the trainer's graph is built
and the backward when autograd reaches it (to the peer that served the forward first, which may reuse its kept
activations), through the calls with retries of the client that makes it (a :class:`StageCaller`, such as
:class:`~.client.SwarmClient`); the input gradients a peer returns are checked (one finite gradient of each
differentiable input's shape and dtype)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from hivemind.p2p import PeerID

from lightning_swarm.swarm.client.deferred_grads import ChunkPool, DeferredGrads, finish_backward
from lightning_swarm.swarm.settings import SwarmSettings
from lightning_swarm.swarm.training.early_steps import OpenGradCalls
from lightning_swarm.swarm.wire.codec import all_finite, remember_wire_format
from lightning_swarm.swarm.wire.errors import ProtocolError
from lightning_swarm.swarm.wire.guards import check_finite
from lightning_swarm.swarm.wire.payload import EncodedPayload, Payload
from lightning_swarm.swarm.wire.protocol import StageRequest, stage_uid

# makes every stage call part of the autograd graph, so that stages whose inputs need no grad still train
DUMMY = torch.empty(0, requires_grad=True)


class StageCaller(Protocol):
    """What stage calls (whole, chunked, pipelined) need from the client that makes them: its calls with retries,
    the check of a forward's outputs, and a training step's bookkeeping. :class:`~.client.SwarmClient` is one."""

    run_id: str
    settings: SwarmSettings
    loss_scaled: bool  # gradients are loss-scaled: an overflow skips the step instead of failing the call
    nonfinite_backwards: int  # backwards that met non-finite values (the step is skipped)
    updates_buffers: bool  # train-mode forwards update the stages' buffers (see .client.SwarmClient)
    grad_calls: OpenGradCalls
    deferred_grads: DeferredGrads
    chunk_pool: ChunkPool

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
        """Serve ``request`` on some peer of ``stage``, with retries; the reply's payload and the encoded inputs."""
        ...

    def output_check(self, stage: int, inputs: Payload) -> Callable[[Payload], None]:
        """The validation of a forward reply of ``stage`` to ``inputs``."""
        ...

    def forward_no_grad(self, stage: int, inputs: Payload, training: bool, seed: int) -> Payload:
        """A forward outside autograd (no backward follows)."""
        ...

    def next_seed(self) -> int:
        """A dropout seed for one stage call."""
        ...

    def live_peers(self, stage: int) -> list[PeerID]:
        """The peers of ``stage`` not banned, as last looked up."""
        ...


class StageCall:
    """What one differentiable stage call keeps between its forward and backward."""

    def __init__(
        self,
        client: StageCaller,
        stage: int,
        inputs: Payload,
        device: torch.device,
        training: bool,
        seed: int,
    ):
        self.client, self.stage, self.inputs, self.device = client, stage, inputs, device
        self.training, self.seed = training, seed  # the backward repeats both (a recompute replays dropout)
        self.marks = [t.requires_grad and t.is_floating_point() for t in inputs.tensors]
        self.encoded_inputs: EncodedPayload | None = (
            None  # the forward's encoding of the inputs, re-sent by the backward
        )
        self.output_skeleton: Payload = Payload(None, [])
        self.forward_id: int | None = None  # the forward's request id and peer: its backward goes there first
        self.forward_peer: PeerID | None = None
        self.grad_generation = 0  # the step its backward counts in (see .early_steps)

    def forward(self) -> list[torch.Tensor]:
        uid = stage_uid(self.client.run_id, self.stage)
        request = StageRequest(
            "forward",
            uid,
            self.inputs,
            training=self.training,
            seed=self.seed,
            buffers=self.client.updates_buffers,
        )
        check = self.client.output_check(self.stage, self.inputs)
        served: list[PeerID] = []
        outputs, self.encoded_inputs = self.client.send(
            self.stage, request, check=check, keep=self.client.settings.keep_activations > 0, served=served
        )
        self.forward_id, self.forward_peer = request.forward_id, (served[-1] if served else None)
        self.output_skeleton = Payload(outputs.skeleton, [])
        self.grad_generation = self.client.grad_calls.opened(self.stage)
        return [moved(t, self.device) for t in outputs.tensors]

    def backward(
        self, grad_outputs: list[torch.Tensor | None], expected: list[tuple[torch.Size, torch.dtype]]
    ) -> list[torch.Tensor]:
        grads = Payload.flatten(tuple(grad_outputs))
        client = self.client
        if client.loss_scaled and not all(all_finite(t) for t in grads.tensors if t.is_floating_point()):
            # a loss-scaled gradient overflowed: this step is skipped (the trainer's scaler is told), so the stage
            # need not see it; its inputs' gradients are infinite, as they would be in one process
            client.nonfinite_backwards += 1
            return [torch.full(shape, float("inf"), dtype=dtype) for shape, dtype in expected]
        uid = stage_uid(client.run_id, self.stage)
        request = StageRequest("backward", uid, self.inputs, grads, training=self.training, seed=self.seed)
        request.forward_id = self.forward_id
        reply, _ = client.send(
            self.stage,
            request,
            reuse=self.encoded_inputs,
            check=lambda p: _check_grads(self.stage, p.rebuild(), expected, finite=not client.loss_scaled),
            prefer=self.forward_peer,
        )
        grads_in = list(reply.rebuild())
        if client.loss_scaled and not all(all_finite(t) for t in grads_in):
            client.nonfinite_backwards += 1  # the stage's own backward overflowed: skip the step
        # the stage committed this call's gradients
        client.grad_calls.closed(self.stage, self.grad_generation)
        return grads_in


def remote_outputs(ctx: Any, diff_inputs: tuple, outputs: list[torch.Tensor]) -> tuple:
    """The bookkeeping of a remote call's autograd node: the inputs' metadata for the backward, no gradient
    materialised for unused outputs, and integer/boolean outputs marked non-differentiable."""
    ctx.set_materialize_grads(False)
    ctx.input_meta = [(t.device, t.dtype, t.shape) for t in diff_inputs]
    ctx.diff_inputs = diff_inputs  # where a deferred backward goes on (see .deferred_grads)
    ctx.num_outputs = len(outputs)
    non_diff = [t for t in outputs if not t.is_floating_point()]
    if non_diff:
        ctx.mark_non_differentiable(*non_diff)
    return tuple(outputs)


class StageFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: StageCall, dummy: torch.Tensor, *diff_inputs: torch.Tensor) -> tuple:
        ctx.call = call
        return remote_outputs(ctx, diff_inputs, call.forward())

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple:
        if all(g is None for g in grad_outputs):
            return (None, None, *([None] * len(ctx.input_meta)))
        grads_out = [None if g is None else g.detach() for g in grad_outputs]
        grads = finish_backward(
            ctx.call.client, lambda: _input_grads(ctx, grads_out), ctx.diff_inputs, _through_earlier_calls
        )
        return (None, None, *grads)


def _input_grads(ctx: Any, grads_out: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """A whole stage call's backward: its inputs' gradients from its outputs' (on the inputs' device and dtype)."""
    grads = ctx.call.backward(grads_out, [(m[2], m[1]) for m in ctx.input_meta])
    return [
        grad.to(device=device, dtype=dtype)
        for grad, (device, dtype, _) in zip(grads, ctx.input_meta, strict=True)
    ]


def _through_earlier_calls(
    inputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A deferred backward's (tensor, gradient) pairs for the flush: where a tensor is an output of an earlier
    whole stage call (a Sequential pipeline's previous stage), that call's backward runs now, in this thread, so
    that the stages' backwards go on down while the trainer goes on; the flush starts from that call's inputs.

    The earlier call's node got no gradient from this one during the trainer's backward (only from other uses of
    its output, such as a residual path, which it sent itself), and it gets none at the flush: each part of the
    gradient reaches the stage once, and the stage adds them up."""
    pairs = []
    for t, g in zip(inputs, grads, strict=True):
        if g is None:
            continue
        node: Any = t.grad_fn
        if isinstance(getattr(node, "call", None), StageCall):
            grads_out: list[torch.Tensor | None] = [None] * node.num_outputs
            grads_out[t.output_nr] = g
            node.call.client.deferred_grads.note_followed()
            pairs.extend(_through_earlier_calls(node.diff_inputs, _input_grads(node, grads_out)))
        else:
            pairs.append((t, g))
    return pairs


def moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, still known as the parts it was received in (so that it is re-sent as they are)."""
    moved = t.to(device)
    remember_wire_format(t, moved)
    return moved


def _check_grads(
    stage: int, grads: Any, expected: list[tuple[torch.Size, torch.dtype]], finite: bool = True
) -> None:
    """A backward reply must hold one finite gradient of the input's shape and dtype per differentiable input;
    anything else is the peer's failure (``ProtocolError``: the call is retried elsewhere and the peer banned).
    ``finite=False`` (loss-scaled gradients, which may overflow) accepts infinities and NaN."""
    if not isinstance(grads, (tuple, list)) or len(grads) != len(expected):
        count = len(grads) if isinstance(grads, (tuple, list)) else type(grads).__name__
        raise ProtocolError(f"Stage {stage} returned {count} input gradients, expected {len(expected)}")
    for grad, (shape, dtype) in zip(grads, expected, strict=True):
        if not isinstance(grad, torch.Tensor) or grad.shape != shape or grad.dtype != dtype:
            got = (
                f"{list(grad.shape)} {grad.dtype}" if isinstance(grad, torch.Tensor) else type(grad).__name__
            )
            raise ProtocolError(
                f"Stage {stage} returned a malformed input gradient: {got}, expected {list(shape)} {dtype}"
            )
    if finite:
        check_finite(list(grads), f"stage {stage} input gradient", ProtocolError)
