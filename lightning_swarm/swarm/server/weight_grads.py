"""Deferred weight gradients: a stage's backward replies once its input gradients are computed.

A stage's backward computes two things: the gradients of its inputs, which the stage before it waits for, and the
gradients of its parameters, which nothing needs before the stage's optimizer step. Zero-bubble pipeline
parallelism (Qi et al., 2023, "Zero Bubble Pipeline Parallelism"; torch's ``ScheduleZBVZeroBubble``) splits the
two ("B" and "W"), so that the previous stage gets its gradient about half a backward sooner, and fills the
pipeline's idle time with the W parts.

Here: a trainer-driven stage after the first (``stage > 0``; the first stage's input gradients go to the trainer's
own parameters, which wait for the step anyway) whose backward finds the forward's activations kept
(:class:`~.compute.Kept`) computes the input gradients alone and replies. On the way, the gradients arriving at
the activations that the parameters' gradients start from are captured (the graph is retained); the parameter
gradients are computed from them later, on this module's thread, when no forward or backward waits for the stage,
and added to the step's sum. Every step, and every other reader of the pending gradients, takes them first
(:meth:`DeferredWeights.drain`). The gradients are those of the whole backward: the same backward functions run
on the same values, once each (the W pass does not go through the activations again).

Where the split does not apply, the backward runs whole as before: a recomputed forward (another peer's, or one
whose parameters changed), merged calls, a stage whose inputs take no gradient, swarm-driven stages (each
backward's gradients are checked before they count), and graphs where a parameter reaches an output by a path
that does not meet the inputs' (an output computed from parameters alone), whose gradient the captured
activations would miss, or where a parameter is used at several places (tied or shared weights, as ALBERT's
shared layers: one of its activations may lie below another, and a pass from both would go through the
activations between them again). A stage whose graph could not be split stops trying. Beyond ``most`` parts
queued, they run before calls (each holds its backward's graph). ``LIGHTNING_SWARM_SPLIT_BACKWARD=0`` turns the
split off (a diagnostic switch: the benchmarks compare both).

The graph walk follows ``torch.distributed.pipelining._backward`` (``stage_backward_input`` / ``_weight``), without
its writes to ``.grad`` (the stepper owns the optimizer's gradients here). For one 4-layer Transformer stage of
width 1024 (one thread) B and W take about 60 ms each, the whole backward 127-140 ms
(``benchmarks/split_backward.py``; figures in docs/design/split-backward.md).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["SPLIT_ENV", "DeferredWeights", "WeightWork", "split_backward", "split_enabled"]

logger = logging.getLogger(__name__)

SPLIT_ENV = "LIGHTNING_SWARM_SPLIT_BACKWARD"


def split_enabled(environ: Any = os.environ) -> bool:
    """Whether backwards may be split (see the module docstring); on unless ``LIGHTNING_SWARM_SPLIT_BACKWARD`` is
    ``0``/``false``/``no``/``off``."""
    return str(environ.get(SPLIT_ENV, "1")).strip().lower() not in ("0", "false", "no", "off")


def _node(t: torch.Tensor) -> Node | None:
    """The autograd node that receives ``t``'s gradient (a leaf's accumulator, made by a view if not yet made)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    with torch.enable_grad():
        return t.view_as(t).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def _reverse_edges(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """For every node reachable from ``roots`` (towards the inputs), the nodes that feed it its gradient."""
    edges: dict[Node, list[Node]] = collections.defaultdict(list)
    queue, seen = collections.deque(roots), set(roots)
    while queue:
        node = queue.popleft()
        for fn, _ in node.next_functions:
            if fn is None:
                continue
            edges[fn].append(node)
            if fn not in seen:
                seen.add(fn)
                queue.append(fn)
    return edges


def _closure(
    starts: Sequence[Node], stop: set[Node], edges: dict[Node, list[Node]]
) -> tuple[set[Node], set[Node]]:
    """Nodes reachable from ``starts`` towards the outputs, not going past ``stop``; and the ``stop`` nodes met."""
    closure, met = set(starts), set()
    queue = collections.deque(starts)
    while queue:
        for fn in edges.get(queue.popleft(), ()):
            if fn in closure:
                continue
            if fn in stop:
                met.add(fn)
                continue
            closure.add(fn)
            queue.append(fn)
    return closure, met


class WeightWork:
    """The parameter gradients of one backward, still to compute: per group of parameters, the activation (autograd
    node) where their gradients start, and the gradients captured there by the input-gradient pass."""

    def __init__(self, groups: list[tuple[Node, list[int]]], accumulators: list[Node | None]) -> None:
        self.groups = groups  # (activation, indices of the parameters whose gradients start there)
        self.accumulators = accumulators  # per parameter: the node its gradient goes to (None: unused)
        self.captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
        self.grads: list[torch.Tensor | None] = [None] * len(accumulators)
        self.next_group = 0
        self.spent = 0.0  # seconds of compute so far (the input-gradient pass, then the groups)
        self.error: Exception | None = None

    def run_group(self) -> bool:
        """Compute the next group's parameter gradients; returns whether groups remain."""
        if self.next_group >= len(self.groups):
            return False  # none of the parameters was used by this forward
        node, indices = self.groups[self.next_group]
        self.next_group += 1
        captured = self.captured.pop(node, ())
        edges = [GradientEdge(node, i) for i, g in enumerate(captured) if g is not None]
        grads = [g for g in captured if g is not None]
        if edges:
            targets = [GradientEdge(self.accumulators[i], 0) for i in indices]  # type: ignore[arg-type]
            results = torch.autograd.grad(edges, targets, grads, allow_unused=True)
            for i, g in zip(indices, results, strict=True):
                self.grads[i] = g
        return self.next_group < len(self.groups)


def split_backward(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    wanted: Sequence[torch.Tensor],
    trained: Sequence[torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], WeightWork] | None:
    """The gradients of ``wanted`` (leaves) given those of ``outputs``, and the work left for the gradients of
    ``trained``; ``None`` (nothing computed) where the split does not apply (see the module docstring). The graph
    is retained until the work is done."""
    roots = [_node(o) for o in outputs]
    inputs = [_node(x) for x in wanted]
    if not roots or not inputs or any(n is None for n in roots) or any(n is None for n in inputs):
        return None
    edges = _reverse_edges(roots)  # type: ignore[arg-type]
    inputs_side, _ = _closure(inputs, set(), edges)  # type: ignore[arg-type]
    outputs_set = set(roots)
    accumulators = [_node(p) if p.requires_grad else None for p in trained]
    groups: dict[Node, list[int]] = {}  # activation -> the parameters whose gradients start there
    for index, acc in enumerate(accumulators):
        if acc is None or (acc not in edges and acc not in outputs_set):
            accumulators[index] = None  # not used by this forward: no gradient
            continue
        side, met = _closure([acc], inputs_side, edges)
        if not met or side & outputs_set:  # a path to an output that meets no activation of the inputs' path
            return None
        if len(met) > 1:
            # used at several places (tied or shared weights): one of its activations may lie below another, and
            # the second pass would go through the activations between them again
            return None
        groups.setdefault(met.pop(), []).append(index)  # a layer's weight and bias start at the same one
    work = WeightWork(list(groups.items()), accumulators)
    handles = [node.register_prehook(functools.partial(work.captured.__setitem__, node)) for node in groups]
    try:
        results = torch.autograd.grad(outputs, wanted, grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return results, work


class DeferredWeights:
    """The W parts waiting to run (oldest first), and the thread that runs them when the stage is otherwise idle.

    Args:
        lock: the stage's parameters lock (a W part runs under it, one parameter group at a time).
        waiting: how many calls wait for the stage besides those in :meth:`foreground` (the batcher's queue).
        name: the thread's name.
        most: beyond this many parts queued, they run before calls (each holds its backward's graph: a stage that
            is never idle until its step must not hold an unbounded number of them).
        log: called with ``("weights", start, end)`` (monotonic clock) for each parameter group run.
    """

    def __init__(
        self,
        lock: threading.Lock,
        waiting: Callable[[], int],
        name: str,
        most: int = 16,
        log: Callable[[str, float, float], None] | None = None,
    ) -> None:
        self._lock, self._waiting, self._name, self._most, self._log = lock, waiting, name, most, log
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[WeightWork, Callable[[WeightWork], None]]] = collections.deque()
        self._running = 0
        self._foreground = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self.failed: str | None = None  # why a W part failed since the last drain: no step with that sum
        self.deferred = 0  # W parts queued so far
        self.unsplittable = False  # set once the stage's graph could not be split: its backwards run whole

    @contextlib.contextmanager
    def foreground(self) -> Iterator[None]:
        """Around a forward's or backward's wait for the stage and its run: W parts wait for it to end."""
        with self._cond:
            self._foreground += 1
        try:
            yield
        finally:
            with self._cond:
                self._foreground -= 1
                self._cond.notify_all()

    def defer(self, work: WeightWork, done: Callable[[WeightWork], None]) -> None:
        """Queue ``work``; ``done(work)`` is called once its gradients are computed, or failed (``work.error``), in
        the thread that ran it."""
        with self._cond:
            if self._closed:
                return
            self._queue.append((work, done))
            self.deferred += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + self._running

    def drain(self, consume: bool = True) -> str | None:
        """Run every queued W part now, in this thread (and wait for the one running); returns why one failed since
        the last drain that ``consume``-d it, if one did."""
        while True:
            with self._cond:
                if self._queue:
                    item = self._queue.popleft()
                    self._running += 1
                elif self._running:
                    self._cond.wait(0.1)
                    continue
                else:
                    failed = self.failed
                    if consume:
                        self.failed = None
                    return failed
            self._run(item, urgent=True)

    def close(self) -> None:
        """Drop the queued work and stop the thread (the server stops)."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._queue or self._yields()):
                    self._cond.wait(0.05 if self._queue else None)
                if self._closed:
                    return
                item = self._queue.popleft()
                self._running += 1
            self._run(item, urgent=False)

    def _yields(self) -> bool:
        """Whether queued parts wait for calls now (under ``_cond``)."""
        return len(self._queue) <= self._most and bool(self._foreground or self._waiting())

    def _run(self, item: tuple[WeightWork, Callable[[WeightWork], None]], urgent: bool) -> None:
        """Run ``item``'s groups; a call that comes meanwhile goes first (unless ``urgent``: a step waits)."""
        work, done = item
        finished = True
        try:
            more = True
            while more:
                with self._lock:
                    start, began = time.perf_counter(), time.monotonic()
                    more = work.run_group()
                    work.spent += time.perf_counter() - start
                    if self._log is not None:
                        self._log("weights", began, time.monotonic())
                if more and not urgent:
                    with self._cond:
                        if self._yields():
                            self._queue.appendleft(item)  # resumed where it stopped
                            finished = False
                            return
        except Exception as e:  # the stage's own backward failed half-way: that step's sum lacks this part
            logger.warning(f"{self._name}: computing a backward's parameter gradients failed: {e!r}")
            work.error = e
            with self._cond:
                self.failed = repr(e)
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()
        if finished:
            done(work)
