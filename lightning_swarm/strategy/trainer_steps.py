"""Trainer-driven stage steps on the Lightning side: step ids, mirrored zero_grad, loss scaling and clipping by the
whole model's norm, and the target_batch_size check."""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_swarm.strategy.loop_state import gradients_fixed_after_backward
from lightning_swarm.strategy.refusals import grad_scaler, refuse_zero_grad_after_backward
from lightning_swarm.swarm.peer.peer import SwarmPeer
from lightning_swarm.swarm.training.stepping import hyper_parameters


class TrainerDrivenSteps(ParallelStrategy):
    """The Lightning hooks of a trainer-driven step (``backward``, ``optimizer_step``, clipping, loss scaling, the
    several trainers' exchange): the base class of :class:`~lightning_swarm.strategy.swarm.SwarmStrategy`, which
    sets the state below in its ``__init__`` and runs the peer."""

    _peer: SwarmPeer | None  # between setup_environment and teardown
    _target_batch_size: int | None  # as the user gave it: checked against the trainer's step
    _step_id: int | None  # the trainer's optimizer step in progress (see swarm/training/stepping.py)
    _clip: tuple[int, str, float] | None  # how the step in progress clipped (see SwarmStrategy.__init__)
    _synced: int | None  # with several trainers: the optimizer whose global step was exchanged, not yet taken
    _backwards_since_sync: int
    _early_step: (
        tuple[int, int, Callable[[], dict[int, dict[str, Any]]]] | None
    )  # (step id, optimizer, hypers)

    @property
    def peer(self) -> SwarmPeer:
        """The running swarm peer (DHT, stage server, client); available between setup and teardown."""
        if self._peer is None:
            raise RuntimeError(
                "The SwarmStrategy's peer runs only between `setup_environment` and `teardown`."
            )
        return self._peer

    def _current_step_id(self) -> int:
        if self._step_id is None:
            self._step_id = self.peer.steps.new_step_id()
        return self._step_id

    def _optimizer_index(self, optimizer: Any) -> int:
        for i, opt in enumerate(self.optimizers):
            if opt is optimizer or getattr(opt, "_optimizer", None) is optimizer:
                return i
        raise ValueError(
            "When using the SwarmStrategy, only the optimizers returned by `configure_optimizers` can step the "
            f"pipeline; got {type(optimizer).__name__}."
        )

    def _mirror_zero_grad(self) -> None:
        """Manual optimization: ``optimizer.zero_grad()`` also drops the gradients the stages hold for that
        optimizer's pipeline parameters (under automatic optimization every backward is followed by a step,
        which consumes them). Both the optimizer and its ``LightningOptimizer`` wrapper (what
        ``self.optimizers()`` returns) get the mirrored ``zero_grad``. With several trainers every trainer's call
        carries the same id (see ``TrainerSync.zero_step_id``) and the stages apply the first; a call after a
        backward of the same step is refused (the stages could not tell which trainers' gradients to drop)."""
        wrappers = self._lightning_optimizers
        for index, optimizer in enumerate(self.optimizers):
            original = type(optimizer).zero_grad.__get__(optimizer)

            def zero_grad(set_to_none: bool = True, _index: int = index, _original: Any = original) -> None:
                if self.peer.trainer_sync is not None and self._backwards_since_sync:
                    refuse_zero_grad_after_backward(self.peer.num_trainers)
                _original(set_to_none=set_to_none)
                self.peer.steps.zero_stage_grads(_index)

            optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
            if index < len(wrappers):
                wrappers[index].zero_grad = zero_grad  # type: ignore[attr-defined]

    def _install_loss_scaling(self) -> None:
        """``16-mixed``: a step is skipped when any gradient of the whole model overflowed, as ``GradScaler`` does
        in one process. After the scaler unscales the trainer's gradients, the stages report whether theirs are
        finite (the ``"norm"`` phase), and a backward whose loss-scaled gradients overflowed before reaching a
        stage counts too; either marks the step as skipped in the scaler (which then lowers the scale), and the
        stages drop that step's gradients with it."""
        scaler = grad_scaler(self.precision_plugin)
        client = self.peer.client
        if scaler is None or client is None:
            return
        client.loss_scaled = True
        original = scaler.unscale_

        def unscale_(optimizer: Any) -> None:
            original(optimizer)
            raw = getattr(optimizer, "_optimizer", optimizer)
            overflowed, client.nonfinite_backwards = client.nonfinite_backwards > 0, 0
            sq = self.peer.steps.stage_grad_sq_norm(
                self._current_step_id(),
                self._optimizer_index(raw),
                self.peer.steps.stage_grad_factor / float(scaler.get_scale()),
            )
            if overflowed or not math.isfinite(sq):
                for found in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
                    found.fill_(1.0)

        scaler.unscale_ = unscale_

    def _install_clipping(self) -> None:
        """Clip by the whole model: the precision plugin's ``clip_gradients`` (what Lightning's gradient clipping
        and ``LightningModule.clip_gradients`` call) also takes the stages' gradients into account."""
        plugin = self.precision_plugin
        original = plugin.clip_gradients

        def clip_gradients(
            optimizer: Any,
            clip_val: float = 0.0,
            gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
        ) -> None:
            self._clip_gradients(original, optimizer, clip_val, gradient_clip_algorithm)

        plugin.clip_gradients = clip_gradients  # type: ignore[method-assign]

    def _clip_gradients(
        self, original: Any, optimizer: Any, clip_val: float | None, algorithm: GradClipAlgorithmType | str
    ) -> None:
        if clip_val is None or clip_val <= 0:
            return
        # manual optimization clips before optimizer.step(): with several trainers, the step's exchange comes
        # first, so that the clipping sees the averaged gradients (DDP's, reduced during the backward)
        self._sync_trainers(optimizer)
        raw = getattr(optimizer, "_optimizer", optimizer)
        index = self._optimizer_index(raw)
        algorithm = GradClipAlgorithmType(algorithm)
        if algorithm == GradClipAlgorithmType.VALUE:
            original(optimizer, clip_val, algorithm)
            self._clip = (index, "value", float(clip_val))
            return
        grads = [p.grad for group in raw.param_groups for p in group["params"] if p.grad is not None]
        local = sum(float(g.detach().float().pow(2).sum()) for g in grads)
        scaler = grad_scaler(self.precision_plugin)
        scale = 1.0 / float(scaler.get_scale()) if scaler is not None else 1.0
        scale *= self.peer.steps.stage_grad_factor
        stages = self.peer.steps.stage_grad_sq_norm(self._current_step_id(), index, scale)
        total = math.sqrt(local + stages)
        coef = min(1.0, float(clip_val) / (total + 1e-6))  # as torch.nn.utils.clip_grad_norm_
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        self._clip = (index, "norm", coef)

    def _driven_optimizer_step(
        self, step: Callable[..., Any], optimizer: Any, closure: Any, model: Any, **kwargs: Any
    ) -> Any:
        """The trainer's step (``step``: Lightning's), then every stage's step with the same optimizer's
        hyper-parameters, clipping and loss scale (the stages serve the new parameters before this returns). Where
        allowed, a stage steps already during the backward (see :meth:`backward`)."""
        raw = getattr(optimizer, "_optimizer", optimizer)
        index = self._optimizer_index(raw)
        scaler = grad_scaler(self.precision_plugin)
        scale = float(scaler.get_scale()) if scaler is not None else None
        if self._clip is not None and self._clip[0] != index:
            self._clip = None  # another optimizer's (manual optimization clips before the step)
        self.peer.steps.begin_step()  # forget the stage calls so far
        # the stages may step as soon as their backwards are done (one trainer: nobody else adds to their gradients)
        if self.peer.trainer_sync is None and gradients_fixed_after_backward(self):
            self._early_step = (self._current_step_id(), index, lambda: groups_hyper(raw))
        try:
            output = step(optimizer, closure, model, **kwargs)
        finally:
            self._early_step = None
        skipped = scaler is not None and scale is not None and float(scaler.get_scale()) < scale
        step_id, clip = self._current_step_id(), self._clip
        self._step_id, self._clip, self._synced = None, None, None
        sync = self.peer.trainer_sync
        self.peer.steps.step_stages(
            step_id,
            index,
            groups_hyper(raw),
            grad_scale=self.peer.steps.stage_grad_factor / (scale if scale else 1.0),
            clip_coef=clip[2] if clip is not None and clip[1] == "norm" else None,
            clip_value=clip[2] if clip is not None and clip[1] == "value" else None,
            skip=skipped,
        )
        self._stepped = (
            sync is not None
        )  # the next batch's start is a step boundary (see on_train_batch_start)
        return output

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """At a step boundary (the last optimizer step and the schedulers' update after it are done), a trainer
        that asked to join the run gets this one's state (see ``swarm/training/trainer_sync.py``)."""
        peer = getattr(self, "_peer", None)
        sync = peer.trainer_sync if peer is not None else None
        if sync is not None and getattr(self, "_stepped", False):
            self._stepped = False
            sync.offer_state(self._trainer_state)
        super().on_train_batch_start(batch, batch_idx)

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's backward. Inside an accumulation window (automatic optimization, a backward outside the
        optimizer step) the stage calls' input gradients may come later: the next microbatch starts while the
        stages compute them (see :mod:`lightning_swarm.swarm.client.deferred_grads`). In a step that allows early stage
        steps, a stage steps as soon as its part of this backward is done."""
        if self.peer.trainer_sync is not None:
            if self._synced is not None:
                raise ValueError(
                    "When using the SwarmStrategy with several trainers, a backward between clip_gradients() and "
                    "optimizer.step() is not supported: clipping took the step's gradients of every trainer "
                    "already. Clip after the step's last manual_backward()."
                )
            self._backwards_since_sync += 1
        deferred = self._deferred_grads()
        if deferred is not None and self._may_defer(kwargs):
            deferred.begin()
            try:
                output = super().backward(closure_loss, optimizer, *args, **{**kwargs, "retain_graph": True})
            finally:
                deferred.end()
            deferred.flush(keep=1)  # the previous microbatch's: its stage backwards ran during this one
            return output
        if deferred is not None:
            deferred.flush()  # before the early steps are armed: a stage must have all of the step's gradients
        early = getattr(self, "_early_step", None)
        if early is not None:
            self.peer.steps.arm_early_steps(*early)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step, whose closure ends with every deferred input gradient in (see :meth:`backward`), so
        that ``on_before_optimizer_step``, clipping and the optimizer see the whole gradient."""
        deferred = self._deferred_grads()

        def closure_then_flush() -> Any:
            result = closure()
            if deferred is not None:
                deferred.flush()
            self._sync_trainers(optimizer)
            return result

        self._in_optimizer_step = True
        try:
            return super().optimizer_step(optimizer, closure_then_flush, model, **kwargs)
        finally:
            self._in_optimizer_step = False

    def _sync_trainers(self, optimizer: Any) -> None:
        """With several trainers: after this trainer's backward, the gradients of its own parameters in
        ``optimizer`` become the average over the trainers of the global step (DDP's all-reduce; see
        ``swarm/training/trainer_sync.py``), and the step's id becomes the one every trainer derives from the global
        step and the optimizer, so that all name the same stage step. Once per optimizer step (manual clipping
        exchanges before the step)."""
        peer = self.peer
        if peer.trainer_sync is None:
            return
        raw = getattr(optimizer, "_optimizer", optimizer)
        index = self._optimizer_index(raw)
        if self._synced == index:
            return
        params = [p for group in raw.param_groups for p in group["params"]]
        buffers = self._own_buffers()
        result = peer.steps.sync_trainers([p.grad for p in params], index, params, buffers)
        assert result is not None
        self._step_id, self._synced, self._backwards_since_sync = result.step_id, index, 0
        for p, grad in zip(params, result.grads, strict=True):
            # a copy: clipping scales the gradients in place, and the step's result is served to the other trainers
            p.grad = None if grad is None else grad.to(device=p.device, dtype=p.dtype, copy=True)
        if result.buffers and result.leader != peer.trainer_sync.name:
            # the leader's buffers (DDP's broadcast_buffers: every rank takes rank 0's)
            if len(result.buffers) != len(buffers):
                raise RuntimeError(
                    f"The trainers' modules hold different buffers ({len(buffers)} here, {len(result.buffers)} on "
                    "the leader): every trainer must run the same LightningModule."
                )
            with torch.no_grad():
                for mine, leaders in zip(buffers, result.buffers, strict=True):
                    if leaders is not None:
                        mine.copy_(leaders)

    def _outside_pipeline(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The tensors of ``named`` (the module's named parameters or buffers) that this trainer owns: those outside
        the pipeline, by name, in the module's order (the same on every trainer)."""
        prefix = f"{self.peer.partition.path}." if self.peer.partition is not None else "\0"
        return {name: t for name, t in named if not name.startswith(prefix)}

    def _own_buffers(self) -> list[torch.Tensor]:
        """This trainer's own buffers (outside the pipeline), in the module's order."""
        assert self.lightning_module is not None
        return list(self._outside_pipeline(self.lightning_module.named_buffers()).values())

    def _own_tensors(self) -> dict[str, Any]:
        """This trainer's own parameters and buffers (everything outside the pipeline), by name."""
        module = self.lightning_module
        assert module is not None
        return {
            **self._outside_pipeline(module.named_parameters()),
            **self._outside_pipeline(module.named_buffers()),
        }

    def _trainer_state(self) -> bytes:
        """What a trainer that joins a run in progress needs from this one (see ``swarm/training/trainer_sync.py``): its own
        parameters and buffers, its optimizers' and LR schedulers' states."""
        buffer = io.BytesIO()
        assert self.lightning_module is not None
        loop = self.lightning_module.trainer.fit_loop.epoch_loop
        torch.save(
            {
                "tensors": {name: t.detach().cpu() for name, t in self._own_tensors().items()},
                "optimizers": [opt.state_dict() for opt in self.optimizers],
                "schedulers": [config.scheduler.state_dict() for config in self.lr_scheduler_configs],
                "batches_that_stepped": loop._batches_that_stepped,
            },
            buffer,
        )
        return buffer.getvalue()

    def _join_in_progress(self) -> None:
        """Trainers that start together take the initial parameters and buffers of the one with the smallest name
        (as DDP broadcasts rank 0's); a trainer that starts while the others are training takes their current
        parameters, optimizer and LR schedule and their global step (Lightning's step count with them), as a DDP
        rank would hold them."""
        sync = self.peer.trainer_sync
        if sync is None:
            return
        # from now on this trainer answers the others (a trainer that starts late is not led to)
        sync.start(initial=self._trainer_state())
        joined = sync.fetch_state()
        self.peer.steps.note_buffer_owner()
        if joined is None:
            return
        step, blob = joined
        state = torch.load(io.BytesIO(blob), weights_only=False, map_location="cpu")
        own = self._own_tensors()
        if set(own) != set(state["tensors"]):
            raise RuntimeError(
                "When using the SwarmStrategy, a trainer that joins a run must run the same LightningModule as the "
                f"others: its own parameters differ in names from the leader's ({sorted(set(own) ^ set(state['tensors']))[:5]})"
            )
        with torch.no_grad():
            for name, t in own.items():
                t.copy_(state["tensors"][name])
        for opt, saved in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(saved)
        for config, saved in zip(self.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(saved)
            config.scheduler._last_lr = [group["lr"] for group in config.scheduler.optimizer.param_groups]
        # Lightning's step count (max_steps, the schedule's intervals, logging) continues from the swarm's: its
        # optimizer steps are the global steps (manual optimization: every optimizer's), its batches the leader's
        assert self.lightning_module is not None
        loop = self.lightning_module.trainer.fit_loop.epoch_loop
        if self.lightning_module.automatic_optimization:
            progress = loop.automatic_optimization.optim_progress.optimizer.step.total
        else:
            progress = loop.manual_optimization.optim_step_progress.total
        progress.ready = progress.completed = step
        loop._batches_that_stepped = int(state.get("batches_that_stepped", step))

    def on_train_end(self) -> None:
        """Training stopped between two optimizer steps (``trainer.should_stop``): the stage backwards still in
        flight finish before the peer leaves."""
        deferred = self._deferred_grads()
        if deferred is not None:
            deferred.flush()
        super().on_train_end()

    def _deferred_grads(self) -> Any:
        peer = getattr(self, "_peer", None)
        client = peer.client if peer is not None and peer.is_trainer else None
        return client.deferred_grads if client is not None else None

    def _may_defer(self, kwargs: dict[str, Any]) -> bool:
        """Whether this backward may leave the stage calls' input gradients for later: a backward of automatic
        optimization between two optimizer steps, through Lightning's own ``LightningModule.backward`` (which
        passes ``retain_graph`` on), not told ``retain_graph=False``."""
        module = self.lightning_module
        return (
            not getattr(self, "_in_optimizer_step", False)
            and module is not None
            and module.automatic_optimization
            and kwargs.get("retain_graph", True) is not False
            and not is_overridden("backward", module, LightningModule)
        )

    def _check_target_batch_size(self, batch_size: int) -> None:
        """With trainer-driven steps, a global step is ``batch_size x accumulate_grad_batches x trainers``
        samples; a ``target_batch_size`` given that says otherwise is refused (it would not be honoured). Called
        at the start of training where the loader's batch size is known, else at the first batch."""
        self._batch_checked = True
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not self.peer.drives_stages or self._target_batch_size is None:
            return
        trainers = self.peer.num_trainers or 1
        step = batch_size * trainer.accumulate_grad_batches * trainers
        if self._target_batch_size != step:
            of = f" x {trainers} trainers" if trainers > 1 else ""
            raise ValueError(
                f"SwarmStrategy(target_batch_size={self._target_batch_size}) but a global step is {step} samples "
                f"(batch {batch_size} x accumulate_grad_batches={trainer.accumulate_grad_batches}{of}), and the "
                "stages step with the trainers: drop target_batch_size, or set the batch size or "
                "accumulate_grad_batches to match."
            )


def groups_hyper(optimizer: Any) -> dict[int, dict[str, Any]]:
    """The hyper-parameters of each of ``optimizer``'s parameter groups, as a step command carries them."""
    return {g: hyper_parameters(group) for g, group in enumerate(optimizer.param_groups)}
