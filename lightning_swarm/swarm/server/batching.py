"""Batched stage servers: compatible calls that wait for a stage's compute are merged into one.

When several trainers call the same stage peer at once, their calls queue up while the stage computes. A
:class:`RequestBatcher` serves them: each time the stage is free, the oldest waiting call is taken with the
waiting calls that can be merged with it (:func:`merge_key`: same kind, same mode, same structure and plain
values, same dtypes and sizes except along the first dimension) up to ``max_rows`` rows, and the group goes to the
server, which concatenates the tensors along the first (batch) dimension (:func:`concat_payloads`), runs the stage once
and splits the results again (:func:`split_payload`).

A call that is alone is served at once (``wait_s`` only applies to a group that already holds several calls):
batching adds no latency to an idle stage; it only merges calls that would have waited anyway.

Merging assumes the stage treats the rows of its inputs independently (true of Transformer blocks, MLPs,
convolutions; not of batch normalisation in training mode, which :func:`mixes_rows` detects), and calls of
different modes (train/eval) never merge. Nor do train-mode calls of a stage that draws random numbers
(dropout): each call's masks come from its own seed, which its backward replays when it recomputes the forward
alone, and one merged run cannot draw per-call masks. The server tells :func:`merge_key` whether its stage
draws (``distinct_seeds``); it learns that from the calls it serves, and a merged train-mode run that turns out
to draw is discarded and its calls served one by one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import msgpack
import torch
from torch import nn

from lightning_swarm.swarm.wire.payload import Payload

__all__ = ["RequestBatcher", "concat_payloads", "merge_key", "mixes_rows", "split_payload"]

logger = logging.getLogger(__name__)


def _tensor_specs(payload: Payload, rows: int) -> tuple | None:
    specs = []
    for t in payload.tensors:
        if t.dim() == 0 or t.shape[0] != rows:
            return None  # a tensor without the batch dimension: cannot be concatenated safely
        specs.append((t.dtype, tuple(t.shape[1:]), t.requires_grad, t.device))
    return tuple(specs)


def _frozen(skeleton: Any) -> bytes | None:
    try:
        return msgpack.packb(skeleton, use_bin_type=True)  # exact: 1, 1.0 and True differ
    except Exception:
        return None


def merge_key(request: Any, distinct_seeds: bool = False) -> tuple[Hashable | None, int]:
    """``(key, rows)`` of a :class:`~.protocol.StageRequest`: requests with equal keys can be merged; ``None``:
    this one runs alone. Mergeable: every tensor of the inputs (and of the output gradients) has the batch
    dimension first, the same for all of them (``rows``), and at least one row; the same mode (and, in train mode,
    whether the call updates the stage's buffers); with ``distinct_seeds`` (a stage that draws random numbers),
    train-mode calls only with calls of the same seed."""
    inputs: Payload = request.inputs
    rows = inputs.batch_size()
    if not inputs.tensors or rows < 1:
        return None, rows
    specs = _tensor_specs(inputs, rows)
    skeleton = _frozen(inputs.skeleton)
    if specs is None or skeleton is None:
        return None, rows
    training = bool(getattr(request, "training", True))
    key: tuple = (request.kind, training, skeleton, specs)
    if training:
        key += (bool(getattr(request, "buffers", True)),)
    if training and distinct_seeds:
        key += (getattr(request, "seed", None),)
    grads: Payload | None = request.grad_outputs
    if grads is not None:
        grad_specs = _tensor_specs(grads, rows)
        grad_skeleton = _frozen(grads.skeleton)
        if grad_specs is None or grad_skeleton is None:
            return None, rows
        key += (grad_skeleton, grad_specs)
    return key, rows


def concat_payloads(payloads: Sequence[Payload]) -> Payload:
    """One payload whose tensors are those of ``payloads`` (same skeleton) concatenated along dimension 0;
    a floating tensor requires grad if the first payload's does."""
    first = payloads[0]
    tensors = []
    for i, t in enumerate(first.tensors):
        merged = torch.cat([p.tensors[i].detach() for p in payloads])
        if t.requires_grad and merged.is_floating_point():
            merged.requires_grad_(True)
        tensors.append(merged)
    return Payload(first.skeleton, tensors)


def _only_tensors(node: Any) -> bool:
    """Whether a skeleton holds nothing but tensors, ``None`` and containers (a plain value in merged outputs
    may describe the whole batch, e.g. a count, and cannot be split)."""
    if node is None:
        return True
    if not isinstance(node, list) or not node:
        return False
    tag = node[0]
    if tag == "T":
        return True
    if tag in ("t", "l"):
        return all(_only_tensors(item) for item in node[1:])
    if tag == "d":
        return all(_only_tensors(value) for value in node[2::2])
    return False


def split_payload(payload: Payload, rows: Sequence[int]) -> list[Payload] | None:
    """``payload`` cut along dimension 0 into pieces of ``rows`` rows (one payload per merged call); ``None`` if
    it cannot be: a tensor without ``sum(rows)`` rows first, or a plain value among the outputs."""
    total = sum(rows)
    if not _only_tensors(payload.skeleton):
        return None
    if any(t.dim() == 0 or t.shape[0] != total for t in payload.tensors):
        return None
    pieces = [torch.split(t, list(rows)) for t in payload.tensors]
    return [Payload(payload.skeleton, [p[i] for p in pieces]) for i in range(len(rows))]


def mixes_rows(module: nn.Module) -> bool:
    """Whether ``module`` holds layers whose output for one row depends on the other rows of the batch (batch
    normalisation), so that merging calls would change their results."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


class _Entry:
    __slots__ = ("done", "error", "key", "request", "result", "rows")

    def __init__(self, request: Any, key: Hashable | None, rows: int) -> None:
        self.request, self.key, self.rows = request, key, rows
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None


class RequestBatcher:
    """Serves submitted requests one group of mergeable ones at a time, in the callers' threads.

    The first caller to find the stage idle serves (the *leader*): the oldest waiting request with the waiting
    requests mergeable with it, group after group, until its own request is served; the others wait for their
    results. A lone request is served at once in its caller's thread, as without batching.

    Args:
        run: serves a group (oldest first) and returns one result per request; never runs twice at once.
        max_rows: a group holds at most this many rows (a larger request still runs, alone).
        wait_s: how long a group that already holds several requests, but fewer than ``max_rows`` rows, waits for
            more; a lone request never waits.
        key: ``(key, rows)`` of a request (default :func:`merge_key`).
    """

    def __init__(
        self,
        run: Callable[[list[Any]], list[Any]],
        *,
        max_rows: int,
        wait_s: float = 0.0,
        key: Callable[[Any], tuple[Hashable | None, int]] = merge_key,
    ) -> None:
        self.run, self.max_rows, self.wait_s, self.key = run, max_rows, wait_s, key
        self._cond = threading.Condition()
        self._queue: list[_Entry] = []
        self._busy = False  # a leader is serving
        self._closed = False
        self.groups = 0  # groups handed to ``run``
        self.requests = 0  # requests in them
        self.largest = 0  # most requests in one group so far

    def pending(self) -> int:
        """Requests submitted and not yet taken into a group."""
        with self._cond:
            return len(self._queue)

    def submit(self, request: Any) -> Any:
        """Serve ``request``, alone or merged with others; returns its result (or raises ``run``'s error, or
        ``RuntimeError`` if the batcher is closed)."""
        key, rows = self.key(request)
        entry = _Entry(request, key, rows)
        with self._cond:
            if self._closed:
                raise RuntimeError("the stage server has stopped")
            self._queue.append(entry)
            self._cond.notify_all()  # a leader waiting for more rows
            while self._busy and not entry.done:
                self._cond.wait()
            leader = not entry.done
            if leader:
                self._busy = True
        if leader:
            try:
                while not entry.done:
                    with self._cond:
                        group = self._take()
                    self._serve(group)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()  # a waiting caller becomes the next leader
        if entry.error is not None:
            raise entry.error
        return entry.result

    def close(self) -> None:
        """Refuse new requests (those submitted already are served)."""
        with self._cond:
            self._closed = True

    def _take(self) -> list[_Entry]:
        """The next group (called with the condition held; the leader's own request is still queued)."""
        first = self._queue[0]
        group, rows = [first], first.rows
        if first.key is not None and self.max_rows > 1:
            deadline = time.monotonic() + self.wait_s
            scanned = 1
            while True:
                for entry in self._queue[scanned:]:
                    if entry.key == first.key and rows + entry.rows <= self.max_rows:
                        group.append(entry)
                        rows += entry.rows
                scanned = len(self._queue)
                remaining = deadline - time.monotonic()
                if len(group) < 2 or rows >= self.max_rows or remaining <= 0:
                    break
                self._cond.wait(remaining)
        taken = {id(entry) for entry in group}
        self._queue = [entry for entry in self._queue if id(entry) not in taken]
        return group

    def _serve(self, group: list[_Entry]) -> None:
        self.groups += 1
        self.requests += len(group)
        self.largest = max(self.largest, len(group))
        try:
            results = self.run([entry.request for entry in group])
            if len(results) != len(group):
                raise RuntimeError(f"served {len(group)} requests but got {len(results)} results")
            for entry, result in zip(group, results, strict=True):
                entry.result = result
        except BaseException as e:  # never leave a caller waiting
            logger.warning(f"Serving a group of {len(group)} requests failed: {e!r}")
            for entry in group:
                entry.error = e if isinstance(e, Exception) else RuntimeError(repr(e))
        finally:
            with self._cond:
                for entry in group:
                    entry.done = True
                self._cond.notify_all()
