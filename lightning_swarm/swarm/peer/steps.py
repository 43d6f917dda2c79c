"""A trainer's side of the optimisation (a part of :class:`~.peer.SwarmPeer`): its optimizers without the
pipeline's parameters, trainer-driven stage steps (:mod:`.stepping`), the swarm's epoch, and the stages' counters."""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from lightning_swarm.swarm.peer.state import PeerState
from lightning_swarm.swarm.settings import SwarmSettings
from lightning_swarm.swarm.training.early_steps import run_in_thread
from lightning_swarm.swarm.training.stepping import StepCommand, read_swarm_epoch
from lightning_swarm.swarm.training.trainer_sync import StepResult
from lightning_swarm.swarm.wire.protocol import stage_uid

logger = logging.getLogger(__name__)

_EPOCH_READ_S = 0.2  # with stage_steps="async": how stale the swarm's epoch driving LR schedules may be

_INFO_POLL_S = 10.0  # with stage_steps="async": how often a trainer asks the stages for their step counts


class TrainerSteps:
    """A trainer's optimizers and its commands to the stages.

    Args:
        settings: the swarm's settings.
        state: what the peer's parts share (its DHT, partition, client, trainers' step exchange).
        is_trainer: whether the peer trains (feeds data).
        num_trainers: how many trainers the run has, where known.
        drives_stages: whether the trainer's optimizer steps are the stages' steps (``stage_steps="trainer"``).
        should_stop: the peer's :meth:`~.peer.SwarmPeer.should_stop`.
    """

    def __init__(
        self,
        settings: SwarmSettings,
        state: PeerState,
        *,
        is_trainer: bool,
        num_trainers: int | None,
        drives_stages: bool,
        should_stop: Callable[[], bool],
    ) -> None:
        self.settings, self.state = settings, state
        self.is_trainer, self.num_trainers, self.drives_stages = is_trainer, num_trainers, drives_stages
        self.should_stop = should_stop
        self._step_ids = itertools.count(secrets.randbits(62))
        self._stage_epochs: dict[int, int] = {}  # the epoch each stage replied with at the last step
        self._early_steps: dict[int, Future] = {}  # stage -> its early step's replies (see .early_steps)
        self.early_stage_steps = 0  # stage steps taken early, before the trainer's backward ended
        # per stage: optimizer steps taken (the most of any peer) and averaging rounds with other peers
        self.stage_steps: dict[int, int] = {}
        self.stage_rounds: dict[int, int] = {}
        self._last_info_poll = -float("inf")
        self._swarm_epoch, self._epoch_read_at = 0, -float("inf")
        self._sent_hyper: dict[int, dict[int, dict[str, Any]]] = {}
        self._info_poller: threading.Thread | None = None
        self._sync_step: StepResult | None = (
            None  # the result of this trainer's current step (several trainers)
        )

    @property
    def stage_epochs(self) -> dict[int, int]:
        """Each stage's optimizer epoch as its peers replied to this trainer's last step (the client's calls carry
        it, see :class:`~lightning_swarm.swarm.client.client.SwarmClient`)."""
        return self._stage_epochs

    # ------------------------------------------------------------------ trainer-side optimisation
    def trainer_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
        """Drop the pipeline's parameters from the trainer's optimizers (the stages' servers own them).

        With several trainers in the synchronous mode the remaining (trainer-local) parameters get DDP's averaged
        gradients (see :mod:`~lightning_swarm.swarm.training.trainer_sync`). In the asynchronous mode each trainer
        steps them on its own and they are not averaged: hivemind's ``Optimizer(use_local_updates=True)`` waits,
        at the local step after each swarm epoch, for that epoch's averaging round, which held each trainer for up
        to the round's timeout (a fifth of the throughput the mode is for)."""
        partition = self.state.partition
        assert partition is not None
        pipeline = set(partition.original_parameters()) | {id(p) for p in partition.container.parameters()}
        for opt in optimizers:
            for group in opt.param_groups:
                group["params"] = [p for p in group["params"] if id(p) not in pipeline]
        return optimizers

    def new_step_id(self) -> int:
        """The id of this trainer's next optimizer step (see :mod:`.stepping`)."""
        return next(self._step_ids)

    def _command_stages(
        self, make: Callable[[int], StepCommand], done: Collection[int] = ()
    ) -> dict[int, list[dict[str, Any]]]:
        """Send ``make(stage)`` to every stage but those ``done`` already, at once (each to all its live peers);
        returns the replies."""
        client = self.state.client
        assert client is not None
        stages = [k for k in range(self.settings.num_stages) if k not in done]
        if not stages:
            return {}
        if len(stages) == 1:
            return {stages[0]: client.commands.step_stage(stages[0], make(stages[0]))}
        with ThreadPoolExecutor(max_workers=len(stages), thread_name_prefix="swarm-step") as pool:
            futures = {k: pool.submit(client.commands.step_stage, k, make(k)) for k in stages}
            return {k: f.result() for k, f in futures.items()}

    # ------------------------------------------------------------------ several trainers (see .trainer_sync)
    def sync_trainers(
        self,
        grads: list[torch.Tensor | None],
        optimizer: int,
        params: list[torch.Tensor],
        buffers: list[torch.Tensor] | None = None,
    ) -> StepResult | None:
        """With several trainers: hand this trainer's gradients of its own parameters in optimizer ``optimizer`` to
        the global step (a step of that optimizer) and return the step's result (the averaged gradients, the
        stages' step id, the leader and its ``buffers``); ``None`` with one trainer."""
        sync = self.state.trainer_sync
        if sync is None:
            return None
        client = self.state.client
        nonfinite = client.nonfinite_backwards if client is not None else 0
        result = sync.exchange(grads, optimizer, nonfinite=nonfinite, params=params, buffers=buffers)
        self._sync_step = result
        if client is not None:
            client.nonfinite_backwards = result.nonfinite  # a step any trainer's scaler must skip
        self.note_buffer_owner()
        return result

    def note_buffer_owner(self) -> None:
        """With several trainers: whether this trainer's next train-mode stage calls update the stages' buffers
        (it leads the next step, see ``TrainerSync.leads_next``)."""
        sync, client = self.state.trainer_sync, self.state.client
        if sync is not None and client is not None:
            client.updates_buffers = sync.leads_next()

    @property
    def stage_grad_factor(self) -> float:
        """What the stages' summed gradients of the current step are multiplied by: 1/K with K trainers in the
        step (DDP averages over its ranks), else 1."""
        step = self._sync_step
        return 1.0 / step.trainers if step is not None and step.trainers > 1 else 1.0

    def _from_leader(self, step_id: int, key: str) -> Any:
        """With several trainers, on a trainer that does not lead step ``step_id``: the value the leader published
        for it (the stages' norm, their replies); ``None`` where this trainer must command the stages itself (it
        leads, or the leader did not answer: the commands are idempotent per step id)."""
        step, sync = self._sync_step, self.state.trainer_sync
        if step is None or sync is None or step.step_id != step_id or step.leader == sync.name:
            return None
        s = self.settings
        try:
            return sync.await_value(step.leader, step_id, key, s.trainer_timeout + s.no_peers_timeout)
        except Exception as e:
            if self.should_stop():
                raise
            logger.warning(
                f"The leader of global step {sync.step - 1} did not answer ({type(e).__name__}: {e}); this trainer "
                "commands the stages itself"
            )
            return None

    def _publish(self, step_id: int, key: str, value: Any) -> None:
        if self.state.trainer_sync is not None:
            self.state.trainer_sync.publish(step_id, key, value)

    def stage_grad_sq_norm(self, step_id: int, optimizer: int, grad_scale: float = 1.0) -> float:
        """The squared norm of the stages' gradients of step ``step_id`` (summed over each stage's peers,
        unscaled by ``grad_scale``), for clipping by the whole model's norm; ``inf`` if any is not finite."""
        key = f"norm{optimizer}"
        published = self._from_leader(step_id, key)
        if published is not None:
            return float(published)
        total = self._stage_grad_sq_norm(step_id, optimizer, grad_scale)
        self._publish(step_id, key, total)
        return total

    def _stage_grad_sq_norm(self, step_id: int, optimizer: int, grad_scale: float) -> float:
        replies = self._command_stages(
            lambda k: StepCommand(
                stage_uid(self.settings.run_id, k),
                step_id,
                phase="norm",
                optimizer=optimizer,
                grad_scale=grad_scale,
                epoch=self._stage_epochs.get(k, 0),
            )
        )
        total = 0.0
        for stage_replies in replies.values():
            reply = stage_replies[0]  # the peers of a stage summed the same gradients
            if not reply.get("finite", True):
                return float("inf")
            total += float(reply.get("sq_norm", 0.0))
        return total

    def swarm_epoch(self) -> int:
        """With ``stage_steps="async"``: the swarm's epoch (the stages' steps together so far, from their progress
        in the DHT), read at most every ``_EPOCH_READ_S`` seconds; never goes back. With trainer-driven steps: the
        stages' epoch as they replied to this trainer's last step."""
        if self.drives_stages or self.state.dht is None:
            return max(self._stage_epochs.values(), default=0)
        now = time.monotonic()
        if now - self._epoch_read_at >= _EPOCH_READ_S:
            self._epoch_read_at = now
            epoch = read_swarm_epoch(self.state.dht, self.settings.run_id, 0)
            if epoch is not None:
                self._swarm_epoch = max(self._swarm_epoch, epoch)
        return self._swarm_epoch

    def send_stage_hyper(self, optimizer: int, groups: dict[int, dict[str, Any]]) -> None:
        """With ``stage_steps="async"``: give the stages this trainer's current hyper-parameters of ``optimizer``
        (its LR schedule) if they changed since last sent; the stages use them from their next step."""
        if self._sent_hyper.get(optimizer) == groups:
            return
        step_id = self.new_step_id()
        self._command_stages(
            lambda k: StepCommand(
                stage_uid(self.settings.run_id, k), step_id, phase="hyper", optimizer=optimizer, groups=groups
            )
        )
        self._sent_hyper[optimizer] = groups

    def zero_stage_grads(self, optimizer: int) -> None:
        """Drop the gradients the stages hold for the parameters of this trainer's optimizer ``optimizer``
        (``optimizer.zero_grad()`` under manual optimization, see :mod:`.stepping`). With several trainers the
        command's id is the same on every trainer (see ``TrainerSync.zero_step_id``): the stages drop the
        gradients at the first trainer's call and keep those its peers send after it."""
        sync = self.state.trainer_sync
        step_id = sync.zero_step_id(optimizer) if sync is not None else self.new_step_id()
        self._command_stages(
            lambda k: StepCommand(
                stage_uid(self.settings.run_id, k), step_id, phase="zero", optimizer=optimizer
            )
        )

    def begin_step(self) -> None:
        """A trainer-driven training step begins (before its forwards): forget the stage calls so far and any early
        step not waited for."""
        assert self.state.client is not None
        self.state.client.grad_calls.reset()
        self._early_steps = {}

    def arm_early_steps(
        self, step_id: int, optimizer: int, read_groups: Callable[[], dict[int, dict[str, Any]]]
    ) -> None:
        """The step's backward begins: from now on, a stage whose calls of this step have all had their backward
        steps at once (see :mod:`.early_steps`), with ``step_id`` and the hyper-parameters ``read_groups()``
        returns then; :meth:`step_stages` waits for its reply."""
        client = self.state.client
        assert client is not None

        def fire(stage: int) -> None:
            command = StepCommand(
                stage_uid(self.settings.run_id, stage),
                step_id,
                phase="apply",
                optimizer=optimizer,
                groups=read_groups(),
                epoch=self._stage_epochs.get(stage, 0),
            )
            self._early_steps[stage] = run_in_thread(
                lambda: client.commands.step_stage(stage, command), f"swarm-early-step-{stage}"
            )

        client.grad_calls.arm(fire)

    def step_stages(
        self,
        step_id: int,
        optimizer: int,
        groups: dict[int, dict[str, Any]],
        grad_scale: float = 1.0,
        clip_coef: float | None = None,
        clip_value: float | None = None,
        skip: bool = False,
    ) -> None:
        """Step every stage as this trainer's optimizer ``optimizer`` just stepped (see :mod:`.stepping`), and
        wait until each stage serves its new parameters. A stage that stepped early (see :meth:`arm_early_steps`)
        is not commanded again unless that failed. With several trainers, only the step's leader commands the
        stages; the others wait for the replies it publishes."""
        assert self.state.client is not None
        published = self._from_leader(step_id, "applied")
        if published is not None:
            self._note_stage_replies(published)
            return
        self.state.client.grad_calls.disarm()
        early, self._early_steps = self._early_steps, {}
        done: dict[int, list[dict[str, Any]]] = {}
        for k, future in early.items():
            try:
                done[k] = future.result()
                self.early_stage_steps += 1
            except Exception as e:  # sent again below (the command is idempotent per step_id)
                logger.debug(f"Stage {k}: its early step failed ({e!r}); commanding it again")
        replies = self._command_stages(
            lambda k: StepCommand(
                stage_uid(self.settings.run_id, k),
                step_id,
                phase="apply",
                optimizer=optimizer,
                groups=groups,
                grad_scale=grad_scale,
                clip_coef=clip_coef,
                clip_value=clip_value,
                skip=skip,
                epoch=self._stage_epochs.get(k, 0),
            ),
            done=done,
        )
        replies.update(done)
        self._note_stage_replies(replies)
        self._publish(
            step_id,
            "applied",
            {
                k: [
                    {
                        "epoch": int(r["epoch"]),
                        "steps": int(r.get("steps", 0)),
                        "group": int(r.get("group", 1)),
                    }
                    for r in rs
                ]
                for k, rs in replies.items()
            },
        )

    def _note_stage_replies(self, replies: dict[int, list[dict[str, Any]]]) -> None:
        """Remember each stage's epoch, steps and averaging rounds as its peers replied to a step."""
        for k, stage_replies in replies.items():
            self._stage_epochs[k] = max(int(r["epoch"]) for r in stage_replies)
            self.stage_steps[k] = max(int(r.get("steps", 0)) for r in stage_replies)
            if max(int(r.get("group", 1)) for r in stage_replies) > 1:
                self.stage_rounds[k] = self.stage_rounds.get(k, 0) + 1

    def stats(self) -> dict[str, float]:
        """The client's traffic counters, and per stage the optimizer steps and the averaging rounds with other
        peers of the stage (``swarm/stage{k}/steps``, ``swarm/stage{k}/rounds``): as the stages replied to this
        trainer's step commands, or (``stage_steps="async"``) as their peers last reported (``rpc_info``, polled
        in the background every ``_INFO_POLL_S`` seconds)."""
        client = self.state.client
        stats = client.stats() if client is not None else {}
        if not self.drives_stages and client is not None:
            self._poll_stage_info()
        sync = self.state.trainer_sync
        if sync is not None:
            stats["swarm/missed_trainer_steps"] = float(sync.missed_steps)
            if self._sync_step is not None:
                stats["swarm/trainers"] = float(self._sync_step.trainers)
        for k, steps in self.stage_steps.items():
            stats[f"swarm/stage{k}/steps"] = float(steps)
        for k, rounds in self.stage_rounds.items():
            stats[f"swarm/stage{k}/rounds"] = float(rounds)
        return stats

    def _poll_stage_info(self) -> None:
        now = time.monotonic()
        if now - self._last_info_poll < _INFO_POLL_S or (self._info_poller and self._info_poller.is_alive()):
            return
        self._last_info_poll = now
        client = self.state.client

        def poll() -> None:
            for k in range(self.settings.num_stages):
                try:
                    infos = client.stage_info(k) if client is not None else []
                except Exception as e:
                    logger.debug(f"rpc_info of stage {k} failed: {e!r}")
                    continue
                if infos:
                    self.stage_steps[k] = max(int(i.get("steps", 0)) for i in infos)
                    self.stage_rounds[k] = max(int(i.get("averaged_rounds", 0)) for i in infos)

        self._info_poller = threading.Thread(target=poll, name="swarm-info", daemon=True)
        self._info_poller.start()
