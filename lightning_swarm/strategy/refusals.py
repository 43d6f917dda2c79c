"""What the ``SwarmStrategy`` refuses at setup, with one line each: Lightning settings the swarm cannot honour."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch import Trainer


def grad_scaler(plugin: Any) -> Any:
    """The precision plugin's enabled loss scaler (``16-mixed``), or ``None``."""
    scaler = getattr(plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def refuse_weight_copies(trainer: Trainer) -> None:
    """Callbacks that keep their own copy of the model's weights (SWA, EMA) would average only the trainer-side
    parameters: the pipeline's live on the stages. Refused at setup, with one line."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging

    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's callback connector
        if isinstance(callback, (StochasticWeightAveraging, WeightAveraging)):
            raise ValueError(
                f"When using the SwarmStrategy, the {type(callback).__name__} callback is not supported: it keeps a "
                "copy of the model's weights in this process, while the pipeline's weights live on the stages. "
                "Average a saved checkpoint's weights after training instead."
            )


def refuse_for_swarm_steps(trainer: Trainer, plugin: Any, optimizers: Sequence[Any] = ()) -> None:
    """With ``stage_steps="async"`` (several trainers) the stages step on their own: settings that need the
    trainer's step on the stages are refused at setup, with one line."""
    fix = "use stage_steps='trainer' (the default: the stages step with the trainers)"
    if len(optimizers) > 1:
        raise ValueError(
            "When using the SwarmStrategy with stage_steps='async' (several trainers), configure_optimizers must "
            f"return one optimizer (got {len(optimizers)}): the trainers average their own parameters through one "
            f"hivemind optimizer and the stages step on their own; use one optimizer with parameter groups, or {fix}."
        )
    if trainer.gradient_clip_val:
        raise ValueError(
            "When using the SwarmStrategy with stage_steps='async' (several trainers), gradient_clip_val is not "
            f"supported: the stages step on their own and cannot clip by the whole model; {fix}, or clip nothing."
        )
    if grad_scaler(plugin) is not None:
        raise ValueError(
            "When using the SwarmStrategy with stage_steps='async' (several trainers), precision='16-mixed' is not "
            f"supported: the stages cannot unscale gradients of several trainers' loss scales; {fix}, or use "
            "'bf16-mixed'."
        )


def refuse_closure_optimizers(optimizers: list[Any]) -> None:
    """An optimizer whose ``step`` needs a closure (``torch.optim.LBFGS``) re-evaluates the model inside its step:
    the stages' optimizers step on the servers, where no closure can run the trainer's loss. Refused at setup."""
    import inspect

    for opt in optimizers:
        raw = getattr(opt, "_optimizer", opt)
        try:
            closure = inspect.signature(type(raw).step).parameters.get("closure")
        except (TypeError, ValueError):
            continue
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise ValueError(
                f"When using the SwarmStrategy, {type(raw).__name__} is not supported: its step needs a closure that "
                "re-evaluates the loss, and the pipeline's parameters step on the stage servers, which cannot run "
                "it. Use an optimizer whose step takes no closure (SGD, Adam, AdamW...)."
            )


def refuse_zero_grad_after_backward(trainers: int | None) -> None:
    """With several trainers stepping as DDP's ranks, manual optimization: an ``optimizer.zero_grad()`` after a
    backward of the same step is refused, with one line. The stages hold one sum of every trainer's gradients; a
    zero_grad that no step separates from the backwards before it would have to wait for every trainer's backwards
    to reach the stages (or drop some and keep others). Before the step's backwards, or after its step, it is
    mirrored once for all trainers."""
    count = f"{trainers} trainers" if trainers else "several trainers"
    raise ValueError(
        f"When using the SwarmStrategy with {count}, optimizer.zero_grad() after a manual_backward() of the same "
        "step is not supported: the stages sum every trainer's gradients, and cannot tell this trainer's from the "
        "others'. Call zero_grad() before the step's manual_backward() or after optimizer.step(), or use one "
        "trainer (num_trainers=1)."
    )


def refuse_before_launch(model: Any, settings: Any) -> None:
    """What the launching process can refuse before it starts the other peers of a local swarm (each peer checks
    again when it joins): a pipeline that mixes rows cut into ``microbatches`` chunks. A model whose pipeline is
    not built yet (``configure_model``) or cannot be found is left to the peers, which say what is wrong."""
    from torch import nn

    from lightning_swarm.swarm.client.chunking import check_chunkable
    from lightning_swarm.swarm.peer.partition import find_pipeline

    if settings.microbatches in ("auto", 1) or not isinstance(model, nn.Module):
        return
    try:
        container = model.get_submodule(settings.pipeline or find_pipeline(model))
    except (AttributeError, ValueError):
        return
    check_chunkable(container, settings.microbatches)
