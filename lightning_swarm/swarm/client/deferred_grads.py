"""Deferred input gradients: a trainer's next microbatch starts while the stages still run the last one's backward.

Under gradient accumulation a trainer's backward of one microbatch would wait for every stage's backward, down to
the first stage, before its next microbatch could start; the stages would then idle while the trainer computes its
loss, and the trainer while they compute the backward (1F1B's overlap lost between microbatches). The gradients
of the trainer's own parameters below the first stage (an embedding, say) are not needed before the optimizer
step, so the strategy lets a stage call's backward return at once during such a backward (:attr:`DeferredGrads.active`):
the call sends its backward and hands back no input gradient; the next microbatch's forward goes out while the
stages compute it. A whole stage call whose input is the previous stage's whole call's output takes the
gradient on through that call at once, in the client's threads (``stage_autograd._through_earlier_calls``), so
every stage's backward overlaps the trainer's next microbatch; a run of chained chunks spans its stages anyway.

The strategy runs that backward with ``retain_graph=True``, so that the graph below the stage calls (their inputs'
own autograd history) is still there when the gradients arrive. :meth:`DeferredGrads.flush` waits for them and
runs the rest of the backward from the calls' inputs (one ``torch.autograd.backward`` per deferred backward,
which also frees that graph). Gradients add up as they would have in one backward: a residual path around a stage
delivered its part during the backward, the stage's part is added by the flush (float summation order aside).

The strategy flushes a microbatch's deferred gradients at the end of the next microbatch's backward, before a
backward that may step the stages early (see :mod:`.early_steps`), and after the optimizer step's closure, so
that every hook from ``on_before_optimizer_step`` on, gradient clipping and the optimizer see the whole gradient.
Only ``on_after_backward`` of a microbatch inside an accumulation window sees the trainer's gradients below the
first stage without that microbatch's part.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["ChunkPool", "DeferredGrads", "finish_backward"]


Pairs = list[tuple[torch.Tensor, torch.Tensor]]


def _pairs(inputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> Pairs:
    return [(t, g) for t, g in zip(inputs, grads, strict=True) if g is not None]


class DeferredGrads:
    """The stage calls' backwards that returned before their input gradients arrived, by the backward that sent
    them (see the module docstring): per backward, the futures of the (tensor, gradient) pairs its flush starts
    from."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[list[Future]] = []  # one list per deferred backward, oldest first
        self.active = False  # set by the strategy during a backward whose input gradients may come later
        # stage-call backwards run deferred so far: those deferred, and the earlier calls they went on through
        self.backwards = 0

    def begin(self) -> None:
        """A backward whose stage calls defer their input gradients begins (:meth:`end` when it returns)."""
        with self._lock:
            self._pending.append([])
        self.active = True

    def end(self) -> None:
        self.active = False

    def pending(self) -> int:
        """How many backwards have input gradients to come."""
        with self._lock:
            return len(self._pending)

    def note_followed(self) -> None:
        """A deferred backward went on through an earlier stage call."""
        with self._lock:
            self.backwards += 1

    def add(self, future: Future) -> None:
        """A stage call of the current backward deferred its input gradients: ``future`` gives its pairs."""
        with self._lock:
            self.backwards += 1
            self._pending[-1].append(future)

    def flush(self, keep: int = 0) -> None:
        """Wait for the input gradients of every deferred backward but the newest ``keep`` and finish those
        backwards (a stage call's error is raised here)."""
        while True:
            with self._lock:
                if len(self._pending) <= keep:
                    return
                futures = self._pending.pop(0)
            pairs = [(t, g) for future in futures for t, g in future.result() if t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


class ChunkPool:
    """A client's threads for chunk calls and deferred backwards, started at their first use."""

    def __init__(self, max_workers: int = 32) -> None:
        self.max_workers = max_workers
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.max_workers, thread_name_prefix="swarm-chunk"
                )
            return self._pool

    def shutdown(self) -> None:
        """Stop the threads without waiting for them (a later use starts new ones)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)


def finish_backward(
    client: Any,
    backward: Callable[[], Sequence[torch.Tensor | None]],
    inputs: Sequence[torch.Tensor],
    follow: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor | None]], Pairs] = _pairs,
) -> list[torch.Tensor | None]:
    """The gradients of a stage call's differentiable ``inputs``, which ``backward()`` computes: now, or, during a
    backward that defers them (see :class:`DeferredGrads`), ``None`` for each while the client's threads compute
    them and ``follow(inputs, gradients)`` makes the pairs the flush starts from (it may take them on through
    earlier stage calls at once)."""
    deferred: DeferredGrads = client.deferred_grads
    if deferred.active:
        deferred.add(client.chunk_pool.executor().submit(lambda: follow(inputs, backward())))
        return [None] * len(inputs)
    return list(backward())
