"""Pipelined microbatches: the chunks of a batch flow through the stages on their own, so that stage ``k + 1``
works on chunk ``i`` while stage ``k`` works on chunk ``i + 1`` (GPipe's schedule, kept by the chunks themselves
rather than by a clock), forward and backward.

With ``microbatches=K`` a stage call cut into K row chunks (:mod:`.chunking` says which arguments are split)
opens a *run*: each chunk gets a chain, a task that sends the chunk to the stage, then its output to the next
stage, and so on. The model's own code still calls the stages one after another - ``self.layers(x)`` for an
``nn.Sequential`` pipeline, ``for stage in self.layers: x = stage(x, mask)`` for an ``nn.ModuleList`` - and a call
of stage ``k + 1`` whose first argument is the output the run returned for stage ``k`` (unchanged since) and whose
other arguments are the same objects joins the run: its chunks are already on their way, since each chain goes
on to the next stage as soon as its chunk is out of the previous one (at most one stage ahead of the model's
code: a call that does not join closes the run, and that stage's work is dropped; forwards change nothing on a
server). Any other call opens a new run.

Autograd: the output returned for stage ``t`` of a run that began at stage ``j`` is that of one node whose inputs
are the run's first call's differentiable inputs, and whose backward takes each chunk's gradient from stage ``t``
down to stage ``j``, every chunk at once: the stages' backwards overlap as their forwards did. The output of an
earlier stage of the run gets a gradient only if the model used it otherwise too (a residual around a stage); its
own node then sends that part back through its stages, and gradients add up as they would in one process.

At most two chunks per live peer of a stage are in flight to it (one computing, one arriving), so that a stage's
server does not merge them into one computation, which would hold them back until the last one is done.

The result is that of the same chunks sent one after another through every stage: outputs are concatenated along
dim 0, the gradients of split inputs too, and those of inputs shared by every chunk summed (float summation order
aside). Each (chunk, stage) call draws its own dropout seed, which its backward replays.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from lightning_swarm.swarm.client.chunking import (
    chunk_bounds,
    chunk_payload,
    joined_backward,
    merge_outputs,
)
from lightning_swarm.swarm.client.deferred_grads import finish_backward
from lightning_swarm.swarm.client.stage_autograd import DUMMY, StageCall, StageCaller, moved, remote_outputs
from lightning_swarm.swarm.wire.payload import Payload

__all__ = ["PipelineRun"]


class _Chain:
    """One chunk's way through the stages of a run: its calls (with grad) or its outputs (without), stage by
    stage."""

    def __init__(self, run: PipelineRun, first: Payload) -> None:
        self.run, self.first = run, first
        self.calls: list[StageCall] = []
        self.outputs: list[tuple[list[torch.Tensor], Payload]] = []  # per stage: tensors and their structure
        self.error: BaseException | None = None
        self.running = False

    def payload_for(self, index: int) -> Payload:
        """The chunk's call of the run's ``index``-th stage: the first call's, the previous output in front."""
        if index == 0:
            return self.first
        tensors = self.outputs[index - 1][0]
        out = tensors[0]
        if out.is_floating_point() and not out.requires_grad and self.run.grad:
            out.requires_grad_(True)  # the stages train: gradients flow back through every stage's output
        return Payload(self.first.skeleton, [out, *self.first.tensors[1:]])

    def advance(self) -> None:
        """Run this chunk's next stages while the run allows (see :meth:`PipelineRun.allow`)."""
        run = self.run
        while True:
            with run.cond:
                index = len(self.outputs)
                if self.error is not None or index > run.allowed or (run.closed and index > run.awaited):
                    self.running = False
                    run.cond.notify_all()
                    return
            stage = run.first_stage + index
            try:
                payload = self.payload_for(index)
                with run.gates[stage]:
                    if run.grad:
                        call = StageCall(
                            run.client, stage, payload, run.device, run.training, run.client.next_seed()
                        )
                        tensors = call.forward()
                        skeleton = call.output_skeleton
                    else:
                        reply = run.client.forward_no_grad(
                            stage, payload, run.training, run.client.next_seed()
                        )
                        tensors = [moved(t, run.device) for t in reply.tensors]
                        skeleton, call = Payload(reply.skeleton, []), None
            except BaseException as e:  # raised to the model's code when it joins this stage
                with run.cond:
                    self.error = e
                    self.running = False
                    run.cond.notify_all()
                return
            with run.cond:
                if call is not None:
                    self.calls.append(call)
                self.outputs.append((tensors, skeleton))
                run.cond.notify_all()

    def backward(self, upto: int, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The gradients of the first call's differentiable inputs, from those of the outputs of the run's
        ``upto``-th stage: down through every stage of the run, the shared arguments' summed over the stages."""
        shared: list[torch.Tensor | None] | None = None
        for index in range(upto, -1, -1):
            call = self.calls[index]
            marks = call.marks
            expected = [
                (t.shape, t.dtype) for t, mark in zip(call.inputs.tensors, marks, strict=True) if mark
            ]
            if all(g is None for g in grads):
                grads_in: list[torch.Tensor | None] = [None] * len(expected)
            else:
                with self.run.gates[call.stage]:
                    grads_in = list(
                        call.backward([None if g is None else g.detach() for g in grads], expected)
                    )
            flowing = iter(grads_in)
            per_tensor = [next(flowing) if mark else None for mark in marks]
            rest = per_tensor[1:]
            shared = rest if shared is None else [_add(a, b) for a, b in zip(shared, rest, strict=True)]
            if index == 0:
                total = [per_tensor[0], *shared]
                return [g for g, mark in zip(total, marks, strict=True) if mark]
            grads = [per_tensor[0]]  # a chained stage's output is one tensor: the next stage's first argument
        return []


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    return a + b


class PipelineRun:
    """The chunks of one batch on their way through consecutive stages (see the module docstring)."""

    def __init__(
        self,
        client: StageCaller,
        stage: int,
        inputs: Payload,
        plan: list[bool],
        chunks: int,
        device: torch.device,
        training: bool,
        num_stages: int,
    ) -> None:
        self.client, self.first_stage, self.device, self.training = client, stage, device, training
        self.num_stages, self.grad = num_stages, torch.is_grad_enabled()
        self.inputs, self.plan = inputs, plan
        self.bounds = chunk_bounds(inputs.tensors[0].shape[0], chunks)
        self.cond = threading.Condition()
        self.closed = False
        self.allowed = -1  # the last stage index (of the run) the chains may run
        self.awaited = -1  # the last stage index a call waits for: run even once the run is closed
        self.gates = {
            s: threading.BoundedSemaphore(2 * max(1, len(client.live_peers(s))))
            for s in range(stage, num_stages)
        }
        parts = [
            chunk_payload(inputs, plan, self.bounds[i], self.bounds[i + 1])
            for i in range(len(self.bounds) - 1)
        ]
        self.chains = [_Chain(self, part) for part in parts]
        self.pool = client.chunk_pool.executor()
        marks = [t.requires_grad and t.is_floating_point() for t in inputs.tensors]
        self.diff_inputs = [t for t, mark in zip(inputs.tensors, marks, strict=True) if mark]
        self.diff_plan = [split for split, mark in zip(plan, marks, strict=True) if mark]
        self.last: tuple[int, Any, int] | None = None  # (stage, the output returned, its version)
        self.others: list[torch.Tensor] = list(inputs.tensors[1:])

    # ---- the model's calls ----

    def joins(self, stage: int, inputs: Payload, training: bool) -> bool:
        """Whether a call of ``stage`` on ``inputs`` continues this run (see the module docstring)."""
        if self.closed or self.last is None or stage != self.last[0] + 1 or not inputs.tensors:
            return False
        last_output, version = self.last[1], self.last[2]
        first = inputs.tensors[0]
        if first is not last_output or first._version != version or self.grad != torch.is_grad_enabled():
            return False
        if training != self.training:
            return False
        rest = inputs.tensors[1:]
        return (
            len(rest) == len(self.others)
            and all(a is b for a, b in zip(rest, self.others, strict=True))
            and inputs.skeleton == self.inputs.skeleton
        )

    def call(self, stage: int) -> Any:
        """The merged output of ``stage`` (this run's next): let the chains run it (and speculatively the next
        one), wait for every chunk's, and return it (differentiable when grad is enabled)."""
        index = stage - self.first_stage
        self.allow(min(index + 1, self.num_stages - 1 - self.first_stage))
        with self.cond:
            self.awaited = max(self.awaited, index)
            while not all(len(c.outputs) > index or c.error is not None for c in self.chains):
                self.cond.wait()
            errors = [c.error for c in self.chains if c.error is not None and len(c.outputs) <= index]
        if errors:
            self.close()
            raise errors[0]
        tensors = merge_outputs(stage, [c.outputs[index][0] for c in self.chains], self.bounds)
        skeleton = self.chains[0].outputs[index][1]
        if self.grad:
            flat = _RunFunction.apply(_RunStage(self, index, tensors), DUMMY, *self.diff_inputs)
            result = skeleton.rebuild(list(flat))
        else:
            result = skeleton.rebuild(tensors)
        single = isinstance(result, torch.Tensor)
        if single and stage + 1 < self.num_stages:
            self.last = (stage, result, result._version)
        else:
            self.close()  # a structured output cannot be the next stage's first argument: nothing to chain
        return result

    def allow(self, index: int) -> None:
        with self.cond:
            self.allowed = max(self.allowed, index)
            idle = [
                c for c in self.chains if not c.running and c.error is None and len(c.outputs) <= self.allowed
            ]
            for chain in idle:
                chain.running = True
        for chain in idle:
            self.pool.submit(chain.advance)

    def close(self) -> None:
        """No further stage joins this run; the chains stop after their current call (once past the stage a call
        waits for)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class _RunStage:
    """What the node of one stage's output of a run keeps: the run, and which of its stages."""

    def __init__(self, run: PipelineRun, index: int, merged: list[torch.Tensor]) -> None:
        self.run, self.index, self.merged = run, index, merged


class _RunFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, state: _RunStage, dummy: torch.Tensor, *diff_inputs: torch.Tensor) -> tuple:
        ctx.state = state
        merged, state.merged = state.merged, []
        return remote_outputs(ctx, diff_inputs, merged)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple:
        state: _RunStage = ctx.state
        run = state.run
        if all(g is None for g in grad_outputs):
            return (None, None, *([None] * len(ctx.input_meta)))
        bounds = run.bounds

        def chunk_backward(i: int) -> list[torch.Tensor | None]:
            lo, hi = bounds[i], bounds[i + 1]
            grads = [None if g is None else g.detach()[lo:hi] for g in grad_outputs]
            return run.chains[i].backward(state.index, grads)

        backward = joined_backward(run.pool, chunk_backward, ctx.input_meta, run.diff_plan, bounds)
        return (None, None, *finish_backward(run.client, backward, ctx.diff_inputs))
