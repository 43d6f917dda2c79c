"""Early stage steps: a stage steps as soon as its last backward of the training step has returned.

With trainer-driven steps (see :mod:`.stepping`) a trainer commands the stages' steps after its whole backward,
so the last stage, whose backwards end first, waits for the first stage's last backward before stepping. GPipe's
ranks do not wait: each steps once its own backwards are done. Here, when the trainer's step cannot change
between its backward and its optimizer step (see ``strategy._loop_state.gradients_fixed_after_backward``: one
optimizer, automatic optimization, no gradient clipping, no loss scaling, no ``optimizer_step`` or
``on_before_optimizer_step`` override), the trainer sends a stage its ``"apply"`` command as soon as every differentiable call of that stage
made in the step has had its backward answered: the stage then holds all of the step's gradients. The command is
the one the trainer would send after its backward (same ``step_id``, the optimizer's hyper-parameters as they
are then), and it is idempotent per ``step_id``: the step after the backward waits for its reply instead of
sending it again, or sends it again if it failed.

A stage call that never gets a backward (its output did not reach the loss, or a chunk sent ahead that the model
did not use) keeps its stage from stepping early: that stage steps after the backward, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["OpenGradCalls", "run_in_thread"]


class OpenGradCalls:
    """Per stage, the differentiable calls made since :meth:`reset` whose backward has not returned; calls
    ``on_complete(stage)`` (from the thread whose backward returned) when a stage's last one returns while armed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, int] = {}
        self._on_complete: Callable[[int], None] | None = None
        self._fired: set[int] = set()
        self._generation = 0  # advanced by every reset: a call counts in the step it was opened in

    def reset(self) -> None:
        """A new training step: forget the calls so far and disarm."""
        with self._lock:
            self._open.clear()
            self._fired.clear()
            self._on_complete = None
            self._generation += 1

    def arm(self, on_complete: Callable[[int], None]) -> None:
        """From now on, call ``on_complete(stage)`` once per stage whose open calls all return. A stage whose
        calls have all returned already is not fired: its last backward returned before the arming, i.e. outside
        the step's backward."""
        with self._lock:
            self._on_complete = on_complete

    def disarm(self) -> None:
        with self._lock:
            self._on_complete = None

    def opened(self, stage: int) -> int:
        """A differentiable call of ``stage`` was made; returns the step it counts in, for :meth:`closed`."""
        with self._lock:
            self._open[stage] = self._open.get(stage, 0) + 1
            return self._generation

    def closed(self, stage: int, generation: int) -> None:
        """The backward of a call that :meth:`opened` counted in ``generation`` returned. A call of an earlier step
        (a deferred backward of the accumulation window, see ``.deferred_grads``) does not count in this one."""
        with self._lock:
            if generation != self._generation:
                return
            left = self._open.get(stage, 0) - 1
            if left < 0:  # a second backward of the same call (retain_graph): not this step's calls
                return
            self._open[stage] = left
            fire = self._on_complete if left == 0 and stage not in self._fired else None
            if fire is not None:
                self._fired.add(stage)
        if fire is not None:
            fire(stage)


def run_in_thread(fn: Callable[[], Any], name: str) -> Future:
    """``fn()`` in a daemon thread of its own; its result or exception in the returned future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # handed to whoever waits for the step
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
