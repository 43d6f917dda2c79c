"""Several microbatches in flight: a stage call's batch cut into chunks that the stage's peers serve at once.

With ``microbatches=K`` (``SwarmSettings``; ``"auto"``: one chunk per online peer of the stage for a client with no
other call in flight, such as a Lightning trainer with its one batch; whole calls for a client that keeps several
calls in flight itself, whose calls keep the peers busy already, and for every trainer of a run with several
trainers, whose runs are then reproducible) a trainer's
stage call ``stage(x, *extra)`` becomes K calls on row ranges of the batch, sent together (forward, and later
backward, each from its own thread): the router spreads them over the stage's peers, so two peers of a stage
compute two chunks at the same time, and a chunk's transfer overlaps another's compute. One autograd node stands
for the K calls, so the backward is sent for all chunks at once too. The result is that of the same chunks sent
one after another: outputs are concatenated along dim 0, the gradients of split inputs concatenated and those of
inputs shared by every chunk summed (float summation order aside).

What is split: every tensor argument whose first dimension is the batch's (that of the first tensor argument:
activations, padding masks, token ids); the others go whole to every chunk (a ``[T, T]`` causal mask). A call
where that is ambiguous (another tensor argument of shape ``[B, B, ...]``), or whose first tensor has no rows, is
sent whole. Outputs must have the batch's rows (a stage returning something else fails with a clear error: use
``microbatches=1``; with ``"auto"`` the call is sent again whole, and so are that stage's later calls).

What is not chunked: a pipeline whose output for one row depends on the other rows of the batch (batch
normalisation in training mode): chunks would see other batch statistics. ``"auto"`` then sends whole batches;
an explicit ``microbatches > 1`` is refused at setup (:func:`rows_mixing_module`).

A call whose first argument is a tensor goes further: its chunks flow on through the following stages
(:mod:`.pipelining`); :func:`chunked_call` serves the other chunked calls.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from lightning_swarm.swarm.client.deferred_grads import finish_backward
from lightning_swarm.swarm.client.stage_autograd import DUMMY, StageCall, StageCaller, moved, remote_outputs
from lightning_swarm.swarm.wire.payload import Payload

__all__ = [
    "Unmergeable",
    "check_chunkable",
    "chunk_bounds",
    "joined_backward",
    "rows_mixing_module",
    "split_plan",
]


class Unmergeable(ValueError):
    """A stage returned an output without the chunk's rows in its first dimension: its chunks cannot be joined."""


def rows_mixing_module(container: nn.Module) -> str | None:
    """The qualified name of the first module in ``container`` whose output for one row depends on the batch's
    other rows in training mode (batch normalisation), or ``None``."""
    for name, module in container.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return f"{name} ({type(module).__name__})" if name else type(module).__name__
    return None


def check_chunkable(container: nn.Module, microbatches: int | str) -> str | None:
    """Refuse an explicit ``microbatches > 1`` for a pipeline that mixes rows; return the module that mixes them
    (see :func:`rows_mixing_module`), or ``None``.

    Raises:
        ValueError: naming the module and what to do instead.
    """
    mixer = rows_mixing_module(container)
    if mixer is not None and microbatches not in ("auto", 1):
        raise ValueError(
            f"SwarmStrategy(microbatches={microbatches}) cannot cut this pipeline's batches into chunks: its "
            f"module {mixer} computes each row's output from the whole batch's statistics. Use microbatches=1 "
            "(or 'auto', which sends such a pipeline whole batches)."
        )
    return mixer


def split_plan(tensors: list[torch.Tensor]) -> list[bool] | None:
    """Which of a call's tensors are cut into row chunks (see the module's doc); ``None`` if the call is sent
    whole."""
    if not tensors or tensors[0].dim() == 0 or tensors[0].shape[0] < 2:
        return None
    rows = tensors[0].shape[0]
    plan = []
    for i, t in enumerate(tensors):
        split = t.dim() >= 1 and t.shape[0] == rows
        if split and i > 0 and t.dim() >= 2 and t.shape[1] == rows:
            return None  # [B, B, ...]: a per-row tensor or a square mask? Sent whole.
        plan.append(split)
    return plan


def chunk_bounds(rows: int, chunks: int) -> list[int]:
    """``chunks + 1`` row boundaries splitting ``rows`` as evenly as possible (the first chunks one row larger)."""
    chunks = max(1, min(chunks, rows))
    base, extra = divmod(rows, chunks)
    bounds = [0]
    for i in range(chunks):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def chunk_payload(inputs: Payload, plan: list[bool], lo: int, hi: int) -> Payload:
    tensors = []
    for t, split in zip(inputs.tensors, plan, strict=True):
        part = t[lo:hi] if split else t
        part = part.detach()
        if t.requires_grad and t.is_floating_point():
            part.requires_grad_(True)  # the server differentiates exactly the inputs the trainer marked
        tensors.append(part)
    return Payload(inputs.skeleton, tensors)


def merge_outputs(stage: int, outputs: list[list[torch.Tensor]], bounds: list[int]) -> list[torch.Tensor]:
    merged = []
    for j, parts in enumerate(zip(*outputs, strict=True)):
        for i, part in enumerate(parts):
            if part.dim() == 0 or part.shape[0] != bounds[i + 1] - bounds[i]:
                raise Unmergeable(
                    f"Stage {stage} returned output {j} of shape {list(part.shape)} for a chunk of "
                    f"{bounds[i + 1] - bounds[i]} rows: with microbatches > 1 every output must have the batch's rows "
                    "in its first dimension. Use SwarmStrategy(microbatches=1) for this pipeline."
                )
        merged.append(torch.cat(parts, dim=0))
    return merged


def chunked_call(
    client: StageCaller,
    stage: int,
    inputs: Payload,
    plan: list[bool],
    chunks: int,
    device: torch.device,
    training: bool,
    seeds: list[int],
) -> Any:
    """The stage call on ``inputs`` as ``chunks`` calls on row ranges, sent at once; differentiable when grad is
    enabled (one autograd node for all chunks)."""
    rows = inputs.tensors[0].shape[0]
    bounds = chunk_bounds(rows, chunks)
    parts = [chunk_payload(inputs, plan, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    pool = client.chunk_pool.executor()
    if not torch.is_grad_enabled():
        futures = [
            pool.submit(client.forward_no_grad, stage, part, training, seed)
            for part, seed in zip(parts, seeds, strict=False)
        ]
        results = [f.result() for f in futures]
        merged = merge_outputs(stage, [[moved(t, device) for t in r.tensors] for r in results], bounds)
        return results[0].rebuild(merged)
    calls = [
        StageCall(client, stage, part, device, training, seed)
        for part, seed in zip(parts, seeds, strict=False)
    ]
    marks = [t.requires_grad and t.is_floating_point() for t in inputs.tensors]
    diff_inputs = [t for t, mark in zip(inputs.tensors, marks, strict=True) if mark]
    diff_plan = [split for split, mark in zip(plan, marks, strict=True) if mark]
    state = _Chunked(stage, calls, bounds, diff_plan, pool)
    flat = _ChunkedStageFunction.apply(state, DUMMY, *diff_inputs)
    return calls[0].output_skeleton.rebuild(list(flat))


class _Chunked:
    """What the chunked call keeps between its forward and backward."""

    def __init__(
        self, stage: int, calls: list, bounds: list[int], diff_plan: list[bool], pool: ThreadPoolExecutor
    ):
        self.stage, self.calls, self.bounds, self.diff_plan, self.pool = stage, calls, bounds, diff_plan, pool


class _ChunkedStageFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, state: _Chunked, dummy: torch.Tensor, *diff_inputs: torch.Tensor) -> tuple:
        futures = [state.pool.submit(call.forward) for call in state.calls]
        outputs = [f.result() for f in futures]
        ctx.state = state
        return remote_outputs(ctx, diff_inputs, merge_outputs(state.stage, outputs, state.bounds))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple:
        state: _Chunked = ctx.state
        if all(g is None for g in grad_outputs):
            return (None, None, *([None] * len(ctx.input_meta)))
        bounds = state.bounds

        def chunk_backward(i: int) -> list[torch.Tensor | None]:
            lo, hi = bounds[i], bounds[i + 1]
            grads = [None if g is None else g.detach()[lo:hi] for g in grad_outputs]
            expected = [
                (torch.Size([hi - lo, *shape[1:]]) if split else shape, dtype)
                for (_, dtype, shape), split in zip(ctx.input_meta, state.diff_plan, strict=True)
            ]
            return state.calls[i].backward(grads, expected)

        backward = joined_backward(state.pool, chunk_backward, ctx.input_meta, state.diff_plan, bounds)
        return (None, None, *finish_backward(state.calls[0].client, backward, ctx.diff_inputs))


def joined_backward(
    pool: ThreadPoolExecutor,
    chunk_backward: Callable[[int], list[torch.Tensor | None]],
    input_meta: list[tuple[torch.device, torch.dtype, torch.Size]],
    diff_plan: list[bool],
    bounds: list[int],
) -> Callable[[], list[torch.Tensor]]:
    """The backward of a call cut into chunks: every chunk's ``chunk_backward(i)`` at once in ``pool``, their
    input gradients joined (see :func:`join_input_grads`)."""

    def backward() -> list[torch.Tensor]:
        futures = [pool.submit(chunk_backward, i) for i in range(len(bounds) - 1)]
        return join_input_grads(input_meta, diff_plan, [f.result() for f in futures], bounds)

    return backward


def join_input_grads(
    input_meta: list[tuple[torch.device, torch.dtype, torch.Size]],
    diff_plan: list[bool],
    per_chunk: list[list[torch.Tensor | None]],
    bounds: list[int],
) -> list[torch.Tensor]:
    """The gradients of a chunked call's differentiable inputs from each chunk's: those of split inputs joined
    along dim 0, those of inputs every chunk shared summed; a chunk without one counts zeros."""
    grads_in = []
    for j, ((device, dtype, shape), split) in enumerate(zip(input_meta, diff_plan, strict=True)):
        parts = [
            _zeros_if_none(
                chunk[j], (bounds[i + 1] - bounds[i], *shape[1:]) if split else tuple(shape), dtype
            )
            for i, chunk in enumerate(per_chunk)
        ]
        parts = [p.to(device=device, dtype=dtype) for p in parts]
        grads_in.append(torch.cat(parts, dim=0) if split else torch.stack(parts).sum(dim=0))
    return grads_in


def _zeros_if_none(grad: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype) if grad is None else grad
