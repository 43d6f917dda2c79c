"""What the strategies read of the running Lightning loop: whether the logger writes this step's logs, and whether
anything between a step's backward and its optimizer step can change the gradients."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_swarm.strategy.refusals import grad_scaler


def logs_written_this_step(module: Any) -> bool:
    """Whether the logger writes this training step's logs (``Trainer(log_every_n_steps)``; the last step too).

    A ``LightningModule.log`` call costs about 0.1 ms: a strategy's own counters logged at every step would be
    a per-step cost on top of what the same Lightning run pays without the strategy.
    """
    trainer = module.trainer if module is not None else None
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", True))


def gradients_fixed_after_backward(strategy: Any, also: tuple[str, ...] = ()) -> bool:
    """Whether nothing between a training step's backward and its optimizer step can change the gradients, the
    hyper-parameters or whether the step happens, so that part of the step may be taken during the backward
    (the swarm's early stage steps, D-SLIDE's overlapped output-layer update).

    One optimizer under automatic optimization; no loss scaling (a step may be skipped) and no gradient clipping
    (it needs the whole gradient); no ``optimizer_step``, ``on_before_optimizer_step`` or
    ``configure_gradient_clipping`` of the module's own, nor a callback's ``on_before_optimizer_step``; and none
    of the hooks in ``also``, of the module or of a callback.
    """
    module = strategy.lightning_module
    trainer = module.trainer if module is not None else None
    if trainer is None or not module.automatic_optimization or len(strategy.optimizers) != 1:
        return False
    if grad_scaler(strategy.precision_plugin) is not None or trainer.gradient_clip_val:
        return False
    own = ("optimizer_step", "on_before_optimizer_step", "configure_gradient_clipping", *also)
    if any(is_overridden(hook, module, LightningModule) for hook in own):
        return False
    hooks = ("on_before_optimizer_step", *also)
    return not any(is_overridden(hook, cb, Callback) for cb in trainer.callbacks for hook in hooks)
