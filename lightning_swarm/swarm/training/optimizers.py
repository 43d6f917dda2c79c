"""The hivemind optimizers of the swarm, used by stage servers and by trainers (:mod:`.peer`): a
``hivemind.Optimizer`` whose progress tracker ends cleanly, the stages' optimizer, and the optimizer-state helpers."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import hivemind
import torch
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager

from lightning_swarm.swarm.footprint import share_optimizer_state, zero_grad_view
from lightning_swarm.swarm.training.averaging import (
    HelperDied,
    StageStateAverager,
    SwarmProgressTracker,
    no_partner,
)

logger = logging.getLogger(__name__)


OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


def initialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (which hivemind averages and hands to joining peers) without moving
    any parameter.

    hivemind does this with one optimizer step on zero gradients, which still applies weight decay: a silent
    extra step. Here that step runs with every learning rate at 0, and every state tensor it made is zeroed
    afterwards (weight decay on a zero gradient leaves ``wd x p`` in SGD's momentum and Adam's moments) and step
    counters reset, so the first real step is the same as in a plain torch optimizer (exactly so for Adam(W) and
    SGD without dampening, whose zero state equals a fresh one).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        for p in params:
            p.grad = zero_grad_view(p)
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
    with torch.no_grad():
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    value.zero_()
                elif key == "step":
                    state[key] = 0


class HivemindOptimizer(hivemind.Optimizer):
    """``hivemind.Optimizer`` whose progress tracker finishes its tasks at shutdown (:class:`SwarmProgressTracker`)."""

    def _make_progress_tracker(self, target_batch_size: int, **kwargs: Any) -> ProgressTracker:
        return SwarmProgressTracker(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )


class StageOptimizer(HivemindOptimizer):
    """hivemind's ``Optimizer`` with a :class:`StageStateAverager`, which does not pre-schedule a gradient averaging
    round while its progress tracker sees no other peer of the stage: hivemind would run matchmaking for
    ``matchmaking_time`` before every step only to cancel it (no partner), costing the averager, DHT and p2p
    daemon CPU on every step. Once another peer reports progress, rounds are pre-scheduled as before; a round
    that was not pre-scheduled still starts at the step (hivemind's own fallback).

    Alone at the step with no round scheduled, hivemind 1.1.12 would step with the optimizer's last ``.grad``
    (here: the last batch handed over) instead of the epoch's accumulated gradients; it then takes the path of a
    round that found no partner instead, which loads the accumulated gradients (averaged over the backwards)."""

    def _maybe_schedule_gradient_averaging(self) -> None:
        if self.tracker.global_progress.num_peers <= 1:
            return
        super()._maybe_schedule_gradient_averaging()

    def _begin_averaging_gradients(self, grad_scaler: Any) -> bool:
        if self.aborted:
            return True  # as alone: local gradients, no round
        if (
            grad_scaler is None
            and self.scheduled_grads is None
            and self.tracker.global_progress.num_peers <= 1
        ):
            return True  # _average_gradients_and_load_into_optimizer(None): "no other peers", local gradients
        return super()._begin_averaging_gradients(grad_scaler)

    rounds = 0  # gradient averaging rounds completed with other peers
    round_peers = 0  # the sum of those rounds' group sizes (this peer included)
    aborted = False  # the run failed: rounds are cancelled, not waited for

    def abort(self) -> None:
        """The run failed: cancel the averaging rounds scheduled or in progress, so that a step waiting for one
        goes on at once (with local gradients) instead of after up to ``averaging_timeout`` seconds, and the
        peer's shutdown does not wait for it."""
        self.aborted = True
        self.average_state_every = 2**62  # no new state averaging round either
        for control in (self.scheduled_grads, self.scheduled_state):  # type: ignore[has-type]
            if control is not None and not control.done():
                control.cancel()

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control: Any) -> None:
        # hivemind logs a failed round at its status level (INFO) whatever the cause: a broken round is an ERROR
        if maybe_step_control is not None:
            try:
                gathered = maybe_step_control.result(self.averaging_timeout)
                self.rounds += 1
                self.round_peers += len(gathered) if isinstance(gathered, dict) else 0
            except BaseException as e:
                if not (no_partner(e) or self.aborted):
                    logger.error(f"{self.run_id}: averaging gradients failed: {e!r}; using local gradients")
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)

    def shutdown(self, run_over: bool = False) -> None:
        """hivemind's shutdown; with ``run_over`` (every trainer has finished: no peer steps again) a round
        scheduled for the next epoch is cancelled first instead of joined with zero weight. hivemind waits up to
        ``averaging_timeout`` for such a round, and at the end of a run its partners are leaving too (or have
        cancelled theirs), so each peer of a stage with several peers waited the whole timeout."""
        if run_over or self.aborted:
            for control in (self.scheduled_grads, self.scheduled_state):  # type: ignore[has-type]
                if control is not None and not control.done():
                    control.cancel()
            self.scheduled_grads = self.scheduled_state = None
        if (
            self.aborted
        ):  # the run failed: no goodbye round, no waiting for a state averaging in the background
            self.tracker.shutdown(min(self.shutdown_timeout, 1.0))
            for pending in list(self.state_averager.pending_updates):
                pending.cancel()
            self.state_averager.pending_updates = set()
            self.state_averager.shutdown()
            if self.use_gradient_averaging:
                self.grad_averager.shutdown()
            return
        super().shutdown()

    def load_state_from_peers(self, **kwargs: Any) -> None:
        # hivemind's Optimizer.load_state_from_peers, except that a helper process that died ends it
        # (:class:`HelperDied`) instead of being retried forever
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self._tag_along_with_zero_weight(self.scheduled_grads)
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)
        with self.tracker.pause_updates():
            while True:
                try:
                    self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
                    if self.grad_averager is not None:
                        self.grad_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
                    break
                except (KeyboardInterrupt, HelperDied):
                    raise
                except BaseException as e:
                    logger.exception(f"Failed to load state from peers: {e}, retrying ...")
                    continue
            if self.tracker.global_epoch - 1 <= self.local_epoch < self.tracker.global_epoch:
                logger.log(
                    self.status_loglevel, f"Catching up with collaboration step {self.tracker.global_epoch}"
                )
                self.state_averager.local_epoch = self.tracker.global_epoch
            self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
            if not self.client_mode:
                self.state_averager.state_sharing_priority = self.local_epoch
            if self.use_gradient_averaging:
                self.grad_averager.reset_accumulated_grads_()
                if not self.client_mode:
                    self.grad_averager.state_sharing_priority = self.local_epoch

    def __init__(self, *args: Any, reuse_state_tensors: bool | None = None, **kwargs: Any) -> None:
        self._reuse_state_tensors = reuse_state_tensors  # None: hivemind's default
        super().__init__(*args, **kwargs)

    def _make_state_averager(self, **kwargs: Any) -> TrainingStateAverager:
        if self._reuse_state_tensors is not None:
            kwargs.setdefault("reuse_tensors", self._reuse_state_tensors)
        return StageStateAverager(
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )


def make_initialized(factory: OptimizerFactory, params: Any) -> torch.optim.Optimizer:
    optimizer = factory(params)
    initialize_optimizer_state(optimizer)
    share_optimizer_state(optimizer)
    return optimizer
