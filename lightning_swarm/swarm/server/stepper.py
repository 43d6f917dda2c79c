"""The stepper of a stage server: the optimizer off the serving path, trainer-driven steps, optimizer state.

See :mod:`.server` for how serving and stepping share the stage's parameters."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p import PeerID
from torch import nn

from lightning_swarm.swarm.footprint import before_fork, release_free_memory, zero_grad_view
from lightning_swarm.swarm.server.shared import SharedState
from lightning_swarm.swarm.settings import SwarmSettings
from lightning_swarm.swarm.training.averaging import (
    HelperDied,
    NamedGroupFailed,
    NamedGroups,
    StageGradientAverager,
    StageStateAverager,
    WatchedAverager,
    helper_alive,
    named_group_id,
    no_partner,
)
from lightning_swarm.swarm.training.optimizers import OptimizerFactory, StageOptimizer, make_initialized
from lightning_swarm.swarm.training.stepping import StepCommand
from lightning_swarm.swarm.wire.protocol import stage_uid
from lightning_swarm.swarm.wire.same_host_sum import SameHostSumFailed, on_one_host, sum_on_host

logger = logging.getLogger(__name__)

MAX_STEP_ATTEMPTS = 3  # averaging rounds a trainer-driven step tries before a peer steps on its own gradients

EPOCH_POLL_S = 0.25  # how often an idle server checks whether its stage is ready to step

_REFRESH_DEFER_S = 5.0  # how long kept forwards may hold back new parameters (their backwards come first)


class Stepper:
    """The optimizer side of a stage server (see :mod:`.server`): the stage's ``hivemind.Optimizer``, the thread
    that feeds it the pending gradients (swarm-driven steps), trainer-driven step commands (:mod:`..stepping`) and
    the optimizer's state.

    Args:
        stage: the stage index.
        dht: this peer's running hivemind DHT (the optimizer's averagers use it).
        settings: the swarm's settings (run id, target batch size, averaging times, stage_steps).
        shared: the state shared with the server's backend.
    """

    def __init__(self, stage: int, dht: hivemind.DHT, settings: SwarmSettings, shared: SharedState) -> None:
        self.stage, self.dht, self.settings, self.shared = stage, dht, settings, shared
        self.uid = stage_uid(settings.run_id, stage)
        # trainer-driven steps (settings.stage_steps == "trainer", see .stepping): the trainer's step commands step
        self.driven = settings.stage_steps == "trainer"
        self.step_lock = threading.Lock()  # held while the optimizer runs (a step, a state load or save)
        self.same_host = False  # whether this server listens on a same-host socket (see ..same_host_sum)
        self.steps = 0  # optimizer steps this server took (trainer-driven or swarm-driven)
        self.averaged_rounds = 0  # steps whose gradients were summed with other peers of the stage
        self.round_peers = 0  # the sum of those rounds' group sizes (this peer included)
        self.same_host_rounds = 0  # of which through shared memory (see ..same_host_sum)
        self.failed: str | None = None  # why this stepper takes no more steps (a helper process died)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._master_versions: tuple[int, ...] | None = None  # see refresh_parameters
        # the trainer's group of each of this stage's optimizer groups: (trainer optimizer, group)
        self._group_sources: list[tuple[int, int]] = []
        # the step in progress: (step id, own gradients, their indices, (summed gradients, facts) or None)
        self._prepared: tuple[int, list[torch.Tensor | None], list[int], Any, Any] | None = None
        self._steps_applied: OrderedDict[int, dict[str, Any]] = OrderedDict()
        # the last trainer epoch a call made this peer catch up to (see catch_up_for_call)
        self._caught_up_to = 0
        # the stage's running statistics as this peer last shared them, and their sums over the stage's peers
        # in the step in progress: (step id, sums) (see sync_buffers)
        self._stats_seen: list[torch.Tensor] = []
        self._stats_sum: tuple[int, list[torch.Tensor]] | None = None

    @property
    def peer_id(self) -> PeerID:
        return self.dht.peer_id

    # ---- lifecycle ----

    def dead_helper(self) -> tuple[str, Any] | None:
        """``(name, helper)`` of a helper of the stage's optimizer that died: an averager's process, or the progress
        tracker's thread; ``None`` while they all live (or there is no optimizer)."""
        opt = self.shared.optimizer
        if opt is None:
            return None
        for name in ("grad_averager", "state_averager"):
            averager = getattr(opt, name, None)
            if averager is not None and averager.pid is not None and not helper_alive(averager):
                return name.replace("_", " "), averager
        tracker = getattr(opt, "tracker", None)
        if tracker is not None and tracker.ident is not None and not tracker.is_alive():
            # (the run's end shuts the optimizer down only after it is no longer shared: not a death)
            return ("progress tracker", tracker) if self.shared.optimizer is opt else None
        return None

    def create_optimizer(
        self, groups: list[dict[str, Any]], optimizer_factory: OptimizerFactory | None, joining: bool
    ) -> None:
        """Create the stage's optimizer over the parameter ``groups`` (dicts with ``"params"``, hyper-parameters and
        optionally ``swarm_optimizer``/``swarm_group``, the trainer's optimizer and group each mirrors); none if
        there is no factory or nothing to train. A ``joining`` server offers no state to download yet."""
        s, shared = self.settings, self.shared
        groups = [g for g in groups if g["params"]]
        self._group_sources = [
            (int(g.get("swarm_optimizer", 0)), int(g.get("swarm_group", i))) for i, g in enumerate(groups)
        ]
        groups = [{k: v for k, v in g.items() if k not in ("swarm_optimizer", "swarm_group")} for g in groups]
        if not groups or optimizer_factory is None:
            return
        before_fork()  # hivemind forks its averagers below
        request_timeout = max(0.2, s.matchmaking_time / 3)
        shared.trained = [p for g in groups for p in g["params"]]
        # trainer-driven steps on the CPU: the optimizer steps the served parameters themselves, with serving
        # paused (see _writing_served); its state averager and gradient averager reuse them (no copies)
        shared.shared_master = self.driven and all(p.device.type == "cpu" for p in shared.trained)
        if shared.shared_master:
            shared.master = list(shared.trained)
        else:
            shared.master = [nn.Parameter(p.detach().clone(), requires_grad=True) for p in shared.trained]
        for master in shared.master:  # else hivemind's gradient averager allocates zero gradients to copy
            master.grad = zero_grad_view(master)
        master_of = {id(p): m for p, m in zip(shared.trained, shared.master, strict=True)}
        groups = [{**g, "params": [master_of[id(p)] for p in g["params"]]} for g in groups]
        shared.optimizer = StageOptimizer(
            dht=self.dht,
            run_id=f"{s.run_id}_stage{self.stage}",  # hivemind forbids '.' in optimizer run ids
            target_batch_size=s.target_batch_size,
            batch_size_per_step=None,
            optimizer=functools.partial(make_initialized, optimizer_factory),
            params=groups,
            offload_optimizer=False,  # the master copy is already apart from the served parameters
            # driven: hivemind's local gradient accumulators are never used (the commands carry the step), and
            # the state averager averages no parameters (it only serves downloads): no copies for either
            reuse_grad_buffers=self.driven,
            # a peer that joins or catches up downloads the stage's running statistics with its parameters
            extra_tensors=tuple(shared.running_stats) if self.driven else (),
            reuse_state_tensors=shared.shared_master or None,
            matchmaking_time=s.matchmaking_time,
            averaging_timeout=s.averaging_timeout,
            # hivemind's default (matchmaking_time) gives up a state download whose next chunk is half a second
            # late on a loaded host; a stalled sender of an all-reduce is still dropped within averaging_timeout
            next_chunk_timeout=max(s.matchmaking_time, min(s.request_timeout, s.averaging_timeout)),
            # hivemind warns (and may deadlock) unless requests time out before matchmaking ends; the optimizer
            # state is initialized without moving the parameters (see initialize_optimizer_state)
            averager_opts={
                "request_timeout": request_timeout,
                "initialize_optimizer": False,
                "allow_state_sharing": not joining,  # a joiner's state is not worth downloading
            },
            grad_averager_factory=functools.partial(
                StageGradientAverager,
                request_timeout=request_timeout,
                allow_state_sharing=False,
                # trainer-driven rounds also sum the stage's running statistics (see sync_buffers)
                extra_like=(*shared.running_stats, torch.zeros(1))
                if self.driven and shared.running_stats
                else (),
            ),  # joiners download the state averager's state; a gradient buffer is not worth a download
            verbose=False,
        )
        for master in shared.master:  # hivemind made zero gradients; each step hands its own over
            master.grad = None
        self._stats_loaded()

    def start(self) -> None:
        """Swarm-driven steps: start the thread that steps the optimizer (trainer-driven: the commands step)."""
        self._stop.clear()
        if self.shared.optimizer is not None and not self.driven:
            self._thread = threading.Thread(
                target=self._step_loop, name=f"stage{self.stage}-step", daemon=True
            )
            self._thread.start()

    def stop(self, abort: bool = False) -> None:
        """Stop the stepper thread; with ``abort`` (the run failed) an averaging round in progress is cancelled
        rather than waited for."""
        self._stop.set()
        self.shared.wake.set()
        opt = self.shared.optimizer
        if abort and isinstance(opt, StageOptimizer):
            opt.abort()
        if self._thread is not None:  # a round in progress ends within averaging_timeout; do not wait longer
            rounds = self.settings.averaging_timeout + self.settings.matchmaking_time
            self._thread.join(timeout=min(rounds, 1.0) if abort else rounds)

    def close(self) -> None:
        """Shut the optimizer down (after :meth:`stop`)."""
        opt = self.shared.optimizer
        if opt is not None:
            try:
                opt.shutdown()
            except Exception as e:
                logger.warning(f"Stage {self.stage} server: error while shutting down the optimizer: {e!r}")

    def release(self) -> None:
        """The run is over: shut the optimizer down, freeing its state, its averagers' buffers and any pending
        gradients; the parameters of the steps taken so far stay served (see ``StageServer.release_training_state``)."""
        self.flush()
        shared = self.shared
        with self.step_lock:
            opt, shared.optimizer = shared.optimizer, None
            if opt is not None and not shared.shared_master:
                self.refresh_parameters()  # the steps taken so far are served, then the copies go
                shared.master = []
            with shared.grads_lock:
                shared.take_pending()
            self._prepared = None
        if opt is not None:
            try:
                opt.shutdown(run_over=True)
            except Exception as e:
                logger.warning(f"Stage {self.stage} server: error while shutting down the optimizer: {e!r}")
            del opt
            release_free_memory()

    def load_state_from_peers(self) -> bool:
        """Download the stage's current parameters and optimizer state (and epoch) from a peer already serving the
        stage, in place; returns whether a peer sent it (``False`` without an optimizer)."""
        opt = self.shared.optimizer
        if opt is None:
            return False
        averager = opt.state_averager
        assert isinstance(averager, StageStateAverager)
        with self.step_lock:  # the stepper is not running the optimizer while its state is replaced
            averager.loaded = False
            opt.load_state_from_peers()
            self._stats_loaded()
            self.refresh_parameters()
            return averager.loaded

    # ---- the stepper: the optimizer, off the serving path ----

    def _step_loop(self) -> None:
        """Feed pending gradients to the optimizer and take part in the stage's averaging rounds."""
        while not self._stop.is_set():
            self.shared.wake.wait(EPOCH_POLL_S)
            self.shared.wake.clear()
            if self._stop.is_set():
                return
            try:
                self.step_pending()
                if self.shared.refresh_pending_since is not None:
                    with self.step_lock:
                        self.refresh_parameters(defer=True)
            except HelperDied as e:  # the server sees it too, and says what it does about it
                logger.info(f"Stage {self.stage}: optimizer step failed: {e}")
            except Exception as e:  # a failed round must not end the stepper; the next one may succeed
                logger.error(f"Stage {self.stage}: optimizer step failed: {e!r}; its gradients were dropped")

    def step_pending(self) -> bool:
        """Hand the gradients of the backwards served so far to the optimizer (one ``step``); returns whether it
        stepped. Also joins the stage's averaging round when the swarm has collected the target batch even if
        no backward arrived here (otherwise the stage's other peers would wait for this one in matchmaking)."""
        opt = self.shared.optimizer
        if opt is None:
            return False
        with self.step_lock:
            with self.shared.grads_lock:
                grads, samples, backwards = self.shared.take_pending()
            if grads is None:
                if not (
                    opt.tracker.ready_to_update_epoch and opt.grad_averager.local_samples_accumulated > 0
                ):
                    return False  # nothing to contribute: the others step without us, we catch up from them
                grads = [torch.zeros_like(m) for m in self.shared.master]
            for master, grad in zip(self.shared.master, grads, strict=True):
                master.grad = torch.zeros_like(master) if grad is None else grad
            averager = opt.grad_averager
            if isinstance(averager, StageGradientAverager):
                averager.backwards = backwards
            epoch = opt.local_epoch
            try:
                opt.step(batch_size=samples)
            finally:
                for master in self.shared.master:
                    master.grad = None
            self.steps += max(0, opt.local_epoch - epoch)
            # refresh even without a new epoch: hivemind applies a finished background state averaging here
            self.refresh_parameters(defer=True)
            return True

    @contextlib.contextmanager
    def _writing_served(self) -> Iterator[None]:
        """Around a write of the optimizer's parameters: when they are the served ones (``_shared_master``),
        serving waits (the parameters lock) and forwards kept before recompute their backward."""
        if not self.shared.shared_master:
            yield
            return
        with self.shared.lock:
            try:
                yield
            finally:
                self.shared.param_version += 1

    def refresh_parameters(self, defer: bool = False) -> None:
        """Copy the optimizer's parameters into the served ones if they changed (under the parameters lock:
        short); the caller holds ``_step_lock``. Unchanged ones are not written: a kept forward's graph stays
        valid. With ``defer``, changed parameters wait while forwards kept before are still waiting for their
        backward, up to ``_REFRESH_DEFER_S`` (the stepper retries, see :meth:`_step_loop`)."""
        if self.shared.shared_master:
            return  # written in place (see _writing_served)
        # every write of the optimizer's parameters is in place (its step; hivemind's averaging and state loads
        # copy_ into them), which bumps their version counters: unchanged counters skip comparing every element
        # (two reads of the stage's parameters, after every backward of a swarm-driven stage)
        versions = tuple(master._version for master in self.shared.master)
        if versions == self._master_versions:
            self.shared.refresh_pending_since = None
            return
        with self.shared.lock, torch.no_grad():
            changed = [
                not torch.equal(served, master)
                for served, master in zip(self.shared.trained, self.shared.master, strict=True)
            ]
            if not any(changed):
                self._master_versions = versions
                self.shared.refresh_pending_since = None
                return
            now = time.monotonic()
            if defer:
                waiting = self.shared.kept.waiting()
                since = self.shared.refresh_pending_since
                if since is None:
                    since = self.shared.refresh_pending_since = now
                if waiting and now - since < _REFRESH_DEFER_S:
                    return  # forwards arriving meanwhile are not kept (see _forward)
            for served, master, differs in zip(self.shared.trained, self.shared.master, changed, strict=True):
                if differs:
                    served.copy_(master)
            self._master_versions = versions
            self.shared.param_version += 1  # kept forwards saw the old values: their backwards recompute
            self.shared.refresh_pending_since = None

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the gradients received so far have been handed to the optimizer (and a step they
        triggered has been taken), at most ``timeout`` seconds (default: one averaging round)."""
        if self.shared.optimizer is None:
            return
        s = self.settings
        timeout = s.averaging_timeout + s.matchmaking_time if timeout is None else timeout
        deadline = time.monotonic() + timeout
        stepper = self._thread
        if stepper is None or not stepper.is_alive():
            return
        while self.shared.pending is not None and time.monotonic() < deadline:
            self.shared.wake.set()
            time.sleep(0.01)
        if self.step_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            try:  # the parameters of the steps taken so far are served from now on
                if self.shared.refresh_pending_since is not None:
                    self.refresh_parameters()
            finally:
                self.step_lock.release()

    # ---- trainer-driven steps (see .stepping) ----

    def step_command(self, command: StepCommand) -> dict[str, Any]:
        """Run one phase of a trainer's step command (see :mod:`.stepping`); returns the reply (``epoch``,
        ``finite`` of the step's gradients and, in phase ``"norm"``, their ``sq_norm``). Never applies a
        ``step_id`` twice. A stepper that lost a helper process (:attr:`failed`) refuses: the trainer steps the
        stage's other peers without this one."""
        if self.failed is None:
            try:
                return self._step_command(command)
            except HelperDied as e:
                self.failed = str(e)
        return {"epoch": -1, "error": f"stage {self.stage} on this peer takes no steps: {self.failed}"}

    def _step_command(self, command: StepCommand) -> dict[str, Any]:
        opt = self.shared.optimizer
        if opt is None or not self.shared.trained:
            return {"epoch": 0, "sq_norm": 0.0, "finite": True, "steps": self.steps}
        if command.phase == "hyper":  # no lock: the stepper reads the groups at its next step
            self._set_hyper(command)
            return {"epoch": int(opt.local_epoch), "steps": self.steps}
        if not self.driven:
            return {
                "epoch": -1,
                "fatal": True,
                "error": f"the server of stage {self.stage} steps every target_batch_size samples "
                "(stage_steps='async') but a trainer commands its steps (stage_steps='trainer'): start every peer "
                "of the run with the same stage_steps",
            }
        with self.step_lock:
            done = self._steps_applied.get(command.step_id)
            if done is not None:
                return done
            if command.phase == "zero":
                self._take_pending(command.optimizer)
                self._prepared = None
                # remembered like a step: with several trainers each sends the same zero (one id), and only the
                # first drops gradients (the others' would drop what their peers sent since)
                return self._remember_step(
                    command.step_id, {"epoch": int(opt.local_epoch), "steps": self.steps}
                )
            state = self._prepared
            if state is None or state[0] != command.step_id:
                own, wanted = self._take_pending(command.optimizer)
                state = self._prepared = (command.step_id, own, wanted, None, None)
            _, own, wanted, summed, made = state
            if summed is None or (command.phase == "norm" and (command.attempt, command.group) != made):
                # a new "norm" attempt redoes the sum from this peer's own gradients: the trainer found the
                # peers' sums of the last attempt inconsistent (see SwarmClient.step_stage); so does one that
                # names other peers than the sum was made with (they would wait for this peer in vain)
                grads, group = own, 1
                if command.peers > 1:
                    grads, group = self._sum_with_peers(own, wanted, command)
                    if group == 1 and command.phase == "apply" and command.attempt < MAX_STEP_ATTEMPTS - 1:
                        # nobody to sum with this time (the peers missed each other): the trainer sends the command
                        # again, and this peer keeps its own gradients for that round
                        return {"epoch": int(opt.local_epoch), "retry": True, "group": 1, "steps": self.steps}
                if grads is own:
                    # in the parameters' dtype (the pending sums of several backwards are float64, see
                    # SharedState.add_pending); unscaled in place below: the own gradients stay as taken, for
                    # another attempt (without a loss scale nothing changes them before the step, which is the
                    # last use: no copy)
                    grads = [
                        None
                        if g is None
                        else g.clone()
                        if g.dtype == m.dtype and command.grad_scale != 1.0
                        else g.to(m.dtype)
                        for g, m in zip(own, self.shared.master, strict=True)
                    ]
                # the squared norm only where it is asked for: clipping by norm, or the peers' check of their sum
                norm = command.phase == "norm"
                summed = (grads, self._unscale(grads, command.grad_scale, group, norm))
                self._prepared = (command.step_id, own, wanted, summed, (command.attempt, command.group))
            grads, facts = summed
            if command.phase == "norm":
                return {"epoch": int(opt.local_epoch), **facts}
            self._prepared = None
            # before the epoch moves on: a call of the next step waits until it has (catch_up_for_call), so its
            # forward updates the statistics every peer of the stage shares
            self.sync_buffers(command.step_id)
            behind = command.epoch > opt.local_epoch
            if behind:
                # this peer missed steps: it takes the stage's state from its peers; the step's summed gradients
                # apply to it only if that state is from before this step (as the others' was)
                self._catch_up(command.epoch)
            if not behind or opt.local_epoch <= command.epoch:
                self._apply(command, grads, facts)
            return self._remember_step(
                command.step_id, {"epoch": int(opt.local_epoch), **facts, "steps": self.steps}
            )

    def _remember_step(self, step_id: int, reply: dict[str, Any]) -> dict[str, Any]:
        """Keep ``reply`` as the answer to any later command with ``step_id`` (bounded); returns it."""
        self._steps_applied[step_id] = reply
        while len(self._steps_applied) > 64:
            self._steps_applied.popitem(last=False)
        return reply

    def catch_up_for_call(self, epoch: int | None) -> None:
        """Before serving a call made at the stage's epoch ``epoch`` (as the trainer last saw it, see
        :class:`..protocol.StageRequest`): a trainer-driven peer behind it missed steps (it joined, or was not in
        the trainer's last step) and would serve stale parameters, so it loads the stage's state from its peers
        first. Tried once per epoch: a stage whose peers are all behind the trainer (they restarted) serves what
        it has, and the next step command sets the trainer's epoch right."""
        opt = self.shared.optimizer
        if epoch is None or opt is None or not self.driven or opt.local_epoch >= epoch:
            return
        # calls arriving during a catch-up wait for it: they must not serve stale values
        with self.step_lock:
            if opt.local_epoch >= epoch or epoch <= self._caught_up_to:
                return  # another call's catch-up or a step got here first, or this epoch was tried
            try:
                self._catch_up(epoch)
            finally:
                self._caught_up_to = epoch

    def _set_hyper(self, command: StepCommand) -> None:
        """Give each of the stage optimizer's groups the trainer's hyper-parameters of the group it mirrors."""
        opt = self.shared.optimizer
        assert opt is not None
        groups = opt.state_averager.optimizer.param_groups
        for group, (optimizer, index) in zip(groups, self._group_sources, strict=True):
            if optimizer == command.optimizer and index in command.groups:
                group.update(command.groups[index])

    def _catch_up(self, epoch: int) -> None:
        """This peer missed steps (the trainer saw the stage at ``epoch``): load the stage's state from its
        peers before stepping with them. Under ``_step_lock``."""
        opt = self.shared.optimizer
        assert opt is not None
        logger.info(
            f"Stage {self.stage}: this peer is at step {opt.local_epoch}, the stage at {epoch}; loading its state"
        )
        # the backwards served so far ran with the parameters about to be replaced
        if self.shared.weights is not None:
            self.shared.weights.drain(consume=False)
        averager = opt.state_averager
        assert isinstance(averager, StageStateAverager)
        averager.loaded = False
        try:
            with self._writing_served():
                opt.load_state_from_peers()
        except HelperDied as e:  # the server sees it too, and says what it does about it
            logger.info(f"Stage {self.stage}: could not load the stage's state from its peers: {e}")
        except Exception as e:
            logger.warning(f"Stage {self.stage}: could not load the stage's state from its peers: {e!r}")
        self._stats_loaded()
        self.refresh_parameters()

    @staticmethod
    def _unscale(
        grads: list[torch.Tensor | None], grad_scale: float, group: int, norm: bool = True
    ) -> dict[str, Any]:
        """Unscale the step's gradients in place; returns their facts: finiteness and group size, and with
        ``norm`` their squared norm (a squared copy of every gradient: a pass over the stage's size more than the
        finiteness check's one sum per tensor, on the step's critical path)."""
        sq_norm, finite, per_tensor = 0.0, True, []
        with torch.no_grad():
            for g in grads:
                if g is None:
                    continue
                if grad_scale != 1.0:
                    g.mul_(grad_scale)
                if norm:
                    value = float(g.detach().float().pow(2).sum())
                    sq_norm += value
                    per_tensor.append(value)
                else:  # NaN or infinite when any element is (or when the sum overflows: refused as well)
                    value = float(g.detach().sum(dtype=torch.float32))
                finite = finite and math.isfinite(value)
        facts: dict[str, Any] = {"finite": finite, "group": group}
        if norm:
            facts["sq_norm"] = sq_norm if finite else 0.0
            # each tensor's too: a part of a small tensor that one peer missed in the round changes the whole
            # norm by less than the peers' check allows (see SwarmClient._agree_on_sum)
            facts["sq_norms"] = per_tensor if finite else []
        return facts

    def _take_pending(self, optimizer: int) -> tuple[list[torch.Tensor | None], list[int]]:
        """Remove from the pending gradients those of the parameters in the trainer's optimizer ``optimizer``;
        returns them (aligned with the master parameters, ``None`` elsewhere) and those parameters' indices."""
        owned = {i for i, (source, _) in enumerate(self._group_sources) if source == optimizer}
        opt = self.shared.optimizer
        assert opt is not None
        groups = opt.state_averager.optimizer.param_groups
        index_of = {id(m): i for i, m in enumerate(self.shared.master)}
        wanted = [index_of[id(p)] for g, group in enumerate(groups) if g in owned for p in group["params"]]
        # deferred parameter gradients first (.weight_grads)
        failed = None if self.shared.weights is None else self.shared.weights.drain()
        with self.shared.grads_lock:
            grads = self.shared.take_pending_of(wanted)
        # a backward's parameter gradients are missing: the step is skipped, as a non-finite one is
        if failed is not None:
            first = next((g for g in grads if g is not None), None)
            if first is not None:
                first.fill_(float("nan"))
        return grads, wanted

    def _sum_with_peers(
        self, grads: list[torch.Tensor | None], wanted: list[int], command: StepCommand
    ) -> tuple[list[torch.Tensor | None], int]:
        """The sum of ``grads`` over the stage's peers stepping now, and the group's size; this peer's own gradients
        and 1 if no round could be made (logged). Named peers that all serve the stage on this machine sum a step's
        first attempt through shared memory (:mod:`..same_host_sum`); otherwise, and for every redo (which thus
        works wherever they failed to meet there), through the stage's gradient averager (hivemind)."""
        me = self.peer_id.to_bytes()
        here = command.attempt == 0 and self.same_host and me in command.group
        # the stage's running statistics ride along (see sync_buffers)
        stats = self._stats_contribution()
        if here and on_one_host(command.group, self.uid):
            sums, group = self._sum_on_host(grads, wanted, command, me, stats)
        else:
            sums, group = self._sum_through_averager(grads, wanted, command, stats)
        if sums is None:
            return grads, 1
        self.averaged_rounds += 1
        self.round_peers += group
        self._stats_sum = (command.step_id, sums[len(wanted) :])
        summed: list[torch.Tensor | None] = [None] * len(grads)
        for i, total in zip(wanted, sums[: len(wanted)], strict=True):
            summed[i] = total
        return summed, group

    def _stats_contribution(self) -> list[torch.Tensor]:
        """This peer's part of the sum of the stage's running statistics (see :meth:`sync_buffers`): their values
        (float64) and a weight of 1 if a call this peer served changed them since it last shared them, else
        zeros; nothing for a stage without any."""
        stats = self.shared.running_stats
        if not stats:
            return []
        with self.shared.lock:
            values = [b.detach().double() for b in stats]
            changed = any(not torch.equal(b, seen) for b, seen in zip(stats, self._stats_seen, strict=True))
        weight = 1.0 if changed else 0.0
        return [*(v * weight for v in values), torch.tensor([weight], dtype=torch.float64)]

    def sync_buffers(self, step_id: int) -> None:
        """After trainer-driven step ``step_id``: every peer of the stage takes the running statistics (batch
        normalisation's) of the peer whose calls updated them since the last step, summed with the gradients in
        that step's round: the statistics of all the batches that updated them, wherever they were served, as
        one process holds them. With several trainers only the leader's calls update them (as DDP's buffers
        follow rank 0's batches): one call per step and stage unless it accumulates, and then the peers that
        served its calls share the mean of theirs (each began from the last step's values: a first-order
        approximation). A step whose calls updated none, or without a sum with peers, leaves each peer's own."""
        stats = self.shared.running_stats
        if not stats:
            return
        summed, self._stats_sum = self._stats_sum, None
        opt = self.shared.optimizer
        assert opt is not None and isinstance(opt.state_averager, StageStateAverager)
        # a download of the stage's state meanwhile gets the statistics from before or after (see _apply)
        with torch.no_grad(), opt.state_averager.state_lock, self.shared.lock:
            weight = float(summed[1][-1].sum()) if summed is not None and summed[0] == step_id else 0.0
            if weight > 0 and summed is not None:
                for b, total in zip(stats, summed[1][:-1], strict=True):
                    mean = total.to(device=b.device, dtype=torch.float64) / weight
                    b.copy_(mean if b.is_floating_point() else mean.round())
            self._remember_stats()

    def _stats_loaded(self) -> None:
        """The stage's state was loaded from a peer, its running statistics with it (``extra_tensors`` of the
        stage's optimizer): they count as shared, not as changes of a call this peer served."""
        with self.shared.lock:
            self._remember_stats()

    def _remember_stats(self) -> None:
        """Take the stage's running statistics as this peer's last shared values. Under ``shared.lock``."""
        self._stats_seen = [b.detach().clone() for b in self.shared.running_stats]

    def _sum_on_host(
        self,
        grads: list[torch.Tensor | None],
        wanted: list[int],
        command: StepCommand,
        me: bytes,
        extra: list[torch.Tensor],
    ) -> tuple[list[torch.Tensor] | None, int]:
        """The sums of the ``wanted`` gradients, then of the ``extra`` tensors (in their dtype), through shared
        memory, and the group's size (``None`` if failed)."""
        try:
            sums = sum_on_host(
                [*(grads[i] for i in wanted), *extra],
                [*(self.shared.master[i] for i in wanted), *extra],
                named_group_id(command.uid, command.step_id, command.attempt),
                command.group,
                me,
                self.settings.averaging_timeout,
            )
        except SameHostSumFailed as e:
            logger.warning(
                f"Stage {self.stage}: the same-host sum of step {command.step_id} failed ({e}); the trainer has "
                "the peers sum again, through hivemind"
            )
            return None, 1
        self.same_host_rounds += 1
        return sums, len(command.group)

    def _sum_through_averager(
        self,
        grads: list[torch.Tensor | None],
        wanted: list[int],
        command: StepCommand,
        extra: list[torch.Tensor],
    ) -> tuple[list[torch.Tensor] | None, int]:
        """The sums of the ``wanted`` gradients, then of the ``extra`` tensors (the averager's slots after the
        gradients, see ``StageGradientAverager.extra_like``), in one all-reduce round of the stage's gradient
        averager (every peer with weight 1, times the group's size), and the group's size (``None`` if no round
        was made). The round is among the peers the command names (no matchmaking), or, for a command that names
        none, a group found by hivemind's matchmaking."""
        opt = self.shared.optimizer
        assert opt is not None
        averager = opt.grad_averager
        with torch.no_grad(), averager.get_tensors() as buffers:
            for buffer, grad in zip(buffers, [*grads, *extra], strict=True):
                buffer.copy_(grad) if grad is not None else buffer.zero_()
        try:
            group = self._one_round(averager, command)
        except HelperDied:
            raise
        except Exception as e:
            group = None
            if not no_partner(e):  # a broken round (shapes, a reducer's failure...), not a missing partner
                logger.error(
                    f"Stage {self.stage}: summing the step's gradients with the stage's peers failed: {e!r}; "
                    "stepping with this peer's own gradients"
                )
                return None, 1
        if not group:
            logger.warning(
                f"Stage {self.stage}: found no peer of the stage to sum this step's gradients with; stepping with "
                "this peer's own gradients"
            )
            return None, 1
        with torch.no_grad(), averager.get_tensors() as buffers:
            extras = range(len(grads), len(grads) + len(extra))
            return [buffers[i].detach().clone().mul_(group) for i in (*wanted, *extras)], group

    def _one_round(self, averager: DecentralizedAverager, command: StepCommand) -> int | None:
        """One all-reduce round of ``averager`` with the stage's peers that step now: the group's size (``None`` or
        an exception if none formed).

        With the peers named by the command, the round is among exactly them, under an id they all derive from
        the command (see :func:`..averaging.named_group_id`): a peer that does not join within
        ``averaging_timeout`` fails it. Otherwise the trainer commands the peers at once, so a group forms within
        a few matchmaking periods or not at all (a partner that already finished this step, see
        ``SwarmClient.step_stage``): matchmaking is given that long, and the all-reduce ``averaging_timeout``."""
        s = self.settings
        me = self.peer_id.to_bytes()
        if len(command.group) > 1 and me in command.group and isinstance(averager, NamedGroups):
            peers = [PeerID(p) for p in command.group]
            group_id = named_group_id(command.uid, command.step_id, command.attempt)
            try:
                return averager.sum_in_named_group(group_id, peers, timeout=s.averaging_timeout)
            except NamedGroupFailed as e:
                logger.info(f"Stage {self.stage}: the round with the peers the trainer named failed ({e})")
                return None
        # one round (not hivemind's GradientAverager.step, which accumulates): the bounded one where it exists
        round_step = (
            WatchedAverager.step if isinstance(averager, WatchedAverager) else DecentralizedAverager.step
        )
        control = round_step(averager, weight=1.0, timeout=s.averaging_timeout, wait=False)
        looking = time.monotonic() + 3 * s.matchmaking_time + 2.0
        while not control.done():
            if not control.began_allreduce and time.monotonic() > looking:
                control.cancel()
                return None
            if not helper_alive(averager):
                raise HelperDied(
                    f"stage {self.stage}'s gradient averager (pid {averager.pid}) died in a round"
                )
            try:
                control.result(timeout=0.05)
            except TimeoutError:  # concurrent.futures.TimeoutError is TimeoutError
                continue
        gathered = control.result()  # the group's peers (and what each gathered)
        return len(gathered) if gathered else None

    def _apply(self, command: StepCommand, grads: list[torch.Tensor | None], facts: dict[str, Any]) -> None:
        """Clip ``grads`` as commanded, take the trainer's hyper-parameters and step; then serve the new
        parameters. Under ``_step_lock``."""
        opt = self.shared.optimizer
        assert opt is not None
        if command.skip or not facts["finite"]:
            if not facts["finite"] and not command.skip:
                logger.warning(
                    f"Stage {self.stage}: the step's gradients are not finite; this stage skips the step"
                )
            return
        averager = opt.state_averager
        with torch.no_grad():
            for g in grads:
                if g is None:
                    continue
                if command.clip_coef is not None and command.clip_coef < 1.0:
                    g.mul_(command.clip_coef)
                if command.clip_value is not None:
                    g.clamp_(-command.clip_value, command.clip_value)
        self._set_hyper(command)
        for master, grad in zip(self.shared.master, grads, strict=True):
            master.grad = grad
        # a peer downloading the stage's state meanwhile gets it from before or after this step, never torn and
        # never with the new epoch on the old parameters (see StageStateAverager.get_current_state)
        with averager.state_lock, opt.tracker.pause_updates(), self._writing_served():
            try:
                averager.step(increment_epoch=True, optimizer_step=True)
            finally:
                for master in self.shared.master:
                    master.grad = None
            self.steps += 1
            opt.tracker.update_epoch(new_epoch=averager.local_epoch)
        if not opt.client_mode:
            averager.state_sharing_priority = averager.local_epoch
        self.refresh_parameters()

    def optimizer_state(self) -> bytes:
        """The stage optimizer's state (``torch.save`` of ``{"optimizer": state_dict, "epoch": int}``), for a
        trainer's checkpoint; empty if this server does not train its stage."""
        opt = self.shared.optimizer
        if opt is None:
            return b""
        with self.step_lock:
            averager = opt.state_averager
            buffer = io.BytesIO()
            torch.save(
                {"optimizer": averager.optimizer.state_dict(), "epoch": int(averager.local_epoch)}, buffer
            )
            return buffer.getvalue()

    def load_optimizer_state(self, data: bytes) -> None:
        """Restore the stage optimizer's state and epoch from :meth:`optimizer_state`'s bytes (a resumed run),
        in place: the state tensors that hivemind averages and shares stay the same objects.

        Raises:
            ValueError: the state does not fit this stage's optimizer (another model or stage layout).
        """
        opt = self.shared.optimizer
        if opt is None:
            return
        try:
            loaded = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
            state, epoch = loaded["optimizer"], int(loaded["epoch"])
            params = state["state"]
        except Exception as e:
            raise ValueError(
                f"Stage {self.stage}: unreadable optimizer state ({type(e).__name__}: {e})"
            ) from None
        with self.step_lock:
            averager = opt.state_averager
            torch_opt = averager.optimizer
            masters = [p for group in torch_opt.param_groups for p in group["params"]]
            if len(state["param_groups"]) != len(torch_opt.param_groups) or sum(
                len(g["params"]) for g in state["param_groups"]
            ) != len(masters):
                raise ValueError(
                    f"Stage {self.stage}: the checkpoint's optimizer state has {len(state['param_groups'])} groups "
                    f"for another set of parameters than this stage's {len(torch_opt.param_groups)}: resume with "
                    "the same model, pipeline and num_stages as the run that saved it."
                )
            with torch.no_grad():
                for index, param in enumerate(masters):
                    mine, theirs = torch_opt.state.get(param), params.get(index, {})
                    for key, value in theirs.items():
                        if mine is not None and isinstance(mine.get(key), torch.Tensor):
                            if mine[key].shape != value.shape:
                                raise ValueError(
                                    f"Stage {self.stage}: optimizer state {key!r} of parameter {index} has shape "
                                    f"{list(value.shape)}, here {list(mine[key].shape)}: another model"
                                )
                            mine[key].copy_(value)
                        else:
                            torch_opt.state[param][key] = value
                for group, saved in zip(torch_opt.param_groups, state["param_groups"], strict=True):
                    group.update({k: v for k, v in saved.items() if k != "params"})
            with opt.tracker.pause_updates():
                averager.local_epoch = epoch
                opt.tracker.update_epoch(new_epoch=epoch)
