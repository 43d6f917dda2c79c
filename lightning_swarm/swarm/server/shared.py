"""What the parts of a stage server share (see :mod:`.server`): the stage's parameters and their lock, the gradients
of served backwards waiting for the optimizer, the forwards kept for their backward, and the optimizer.

The backend (:mod:`.stage_backend`) writes pending gradients and keeps forwards; the stepper (:mod:`.stepper`) takes
the gradients, steps the optimizer and refreshes the served parameters. Each is handed one :class:`SharedState`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_swarm.swarm.footprint import add_widened
from lightning_swarm.swarm.server.compute import Kept
from lightning_swarm.swarm.server.weight_grads import DeferredWeights
from lightning_swarm.swarm.wire.payload import Payload

if TYPE_CHECKING:
    import hivemind

__all__ = ["KEPT_MAX_AGE_S", "KeptForwards", "SharedState"]

KEPT_MAX_AGE_S = 120.0  # a kept forward whose backward has not come by then is dropped


class KeptForwards:
    """The forwards kept for their backward, by forward id (oldest first), at most ``most`` of them, and how many
    a backward has taken and not finished yet (new parameters wait for both, see ``Stepper.refresh_parameters``).

    :param most: forwards kept at most (the settings' ``keep_activations``); the oldest is dropped first, as is
        one older than ``KEPT_MAX_AGE_S`` seconds.
    """

    def __init__(self, most: int = 0) -> None:
        self.most = most
        self._lock = threading.Lock()
        self._kept: OrderedDict[int, Kept] = OrderedDict()
        self._in_use = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def keep(self, forward_id: int, kept: Kept) -> None:
        with self._lock:
            self._kept.pop(forward_id, None)
            self._kept[forward_id] = kept
            while len(self._kept) > self.most or (
                self._kept and kept.created - next(iter(self._kept.values())).created > KEPT_MAX_AGE_S
            ):
                self._kept.popitem(last=False)

    def holds(self, forward_id: int | None) -> bool:
        with self._lock:
            return forward_id is not None and forward_id in self._kept

    def inputs(self, forward_id: int | None) -> Payload | None:
        """The inputs of the kept forward ``forward_id`` (left in place), or ``None``."""
        with self._lock:
            kept = self._kept.get(forward_id) if forward_id is not None else None
            return None if kept is None else kept.inputs

    def take(self, forward_id: int | None) -> Kept | None:
        """Remove and return the kept forward ``forward_id``; it counts as in use until :meth:`done`."""
        if forward_id is None:
            return None
        with self._lock:
            kept = self._kept.pop(forward_id, None)
            if kept is not None:
                self._in_use += 1
        return kept

    def done(self) -> None:
        """A backward is done with the kept forward it took."""
        with self._lock:
            self._in_use -= 1

    def waiting(self) -> bool:
        """Whether kept forwards wait for their backward, or a backward uses one."""
        with self._lock:
            return bool(self._kept) or self._in_use > 0

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()


@dataclass(eq=False)
class SharedState:
    """The state a stage server's backend and stepper share."""

    # the parameters lock: compute reads the served parameters, refreshes and in-place steps write them
    lock: threading.Lock = field(default_factory=threading.Lock)
    # the trained parameters (served) and the optimizer's copy of them (the same tensors with shared_master)
    trained: list[nn.Parameter] = field(default_factory=list)
    master: list[nn.Parameter] = field(default_factory=list)
    shared_master: bool = False  # whether the optimizer steps the served parameters themselves
    # the running statistics of the stage's batch normalisations (torch's ``_NormBase`` modules): the buffers its
    # train-mode forwards update, which the stage's peers share at each trainer-driven step (see
    # Stepper.sync_buffers); written by the serving thread's forwards, under ``lock`` elsewhere
    running_stats: list[torch.Tensor] = field(default_factory=list)
    optimizer: hivemind.Optimizer | None = None  # None: the stage is served, not trained
    param_version: int = 0  # bumped when the served parameters change: kept forwards ran with older ones
    refresh_pending_since: float | None = None  # new parameters wait for kept forwards' backwards since then
    # the summed parameter gradients of the backwards served since the last step, their samples and backwards
    grads_lock: threading.Lock = field(default_factory=threading.Lock)
    pending: list[torch.Tensor | None] | None = None
    pending_samples: int = 0
    pending_backwards: int = 0
    wake: threading.Event = field(default_factory=threading.Event)  # the stepper has something to do
    kept: KeptForwards = field(default_factory=KeptForwards)
    # parameter gradients of backwards that replied first, still to compute (see .weight_grads)
    weights: DeferredWeights | None = None

    @property
    def training(self) -> bool:
        """Whether backwards' parameter gradients are wanted (the stage has an optimizer and trained parameters)."""
        return self.optimizer is not None and bool(self.trained)

    def add_pending(self, grads: list[torch.Tensor | None], samples: int, backwards: int = 1) -> None:
        """Add the parameter gradients of ``backwards`` backwards of ``samples`` samples (tensors no one else holds,
        see :func:`.compute.exclusive`) to the pending sum; the first backward after a step becomes the sum itself
        (no zero-filled buffer, no extra pass). Under ``grads_lock``.

        From the second backward on, a tensor's sum is kept in float64, where adding float32 (or half) values is
        exact unless one element's terms span more than about 2**28 in magnitude: the sum, rounded back to the
        parameter's dtype when taken, does not depend on the order the backwards came in (several trainers' calls
        arrive in any order; in float32, ``(a + b) + c`` and ``(a + c) + b`` differ in the last bits, and training
        grows that difference), so a run with several trainers is reproducible, as DDP's is."""
        self.pending_samples += samples
        self.pending_backwards += backwards
        if self.pending is None:
            self.pending = [
                None if g is None else g.to(device=m.device, dtype=m.dtype)
                for m, g in zip(self.master, grads, strict=True)
            ]
            return
        for i, (acc, grad) in enumerate(zip(self.pending, grads, strict=True)):
            if grad is None:
                continue
            if acc is None:
                self.pending[i] = grad.to(device=self.master[i].device, dtype=self.master[i].dtype)
                continue
            if acc.dtype != torch.float64 and acc.is_floating_point():
                acc = self.pending[i] = acc.to(torch.float64)
            add_widened(acc, grad.to(acc.device))

    def _summed(self, i: int, acc: torch.Tensor | None) -> torch.Tensor | None:
        """Pending sum ``acc`` of parameter ``i`` in the parameter's dtype (see :meth:`add_pending`)."""
        return None if acc is None else acc.to(self.master[i].dtype)

    def pending_sums(self) -> list[torch.Tensor | None] | None:
        """The pending gradients in the parameters' dtype, left pending (``None``: none). Under ``grads_lock``."""
        return None if self.pending is None else [self._summed(i, acc) for i, acc in enumerate(self.pending)]

    def take_pending(self) -> tuple[list[torch.Tensor | None] | None, int, int]:
        """Remove the pending gradients: ``(sum or None, samples, backwards)``. Under ``grads_lock``."""
        taken = self.pending_sums(), self.pending_samples, self.pending_backwards
        self.pending, self.pending_samples, self.pending_backwards = None, 0, 0
        return taken

    def take_pending_of(self, wanted: list[int]) -> list[torch.Tensor | None]:
        """Remove the pending gradients of the parameters ``wanted`` (indices into ``master``); returns them,
        aligned with ``master`` (``None`` elsewhere), as summed: float64 where several backwards were added, for a
        sum with the stage's other peers that does not depend on which backwards each peer served (the caller
        rounds to the parameters' dtype). The pending sum goes once none is left. Under ``grads_lock``."""
        grads: list[torch.Tensor | None] = [None] * len(self.master)
        pending = self.pending
        if pending is not None:
            for i in wanted:
                grads[i], pending[i] = pending[i], None
            if all(g is None for g in pending):
                self.take_pending()
        return grads
