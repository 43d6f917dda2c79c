"""The trainer's optimizers as a template for the stages': each stage server builds its optimizer with the class,
parameter groups and hyper-parameters the trainer's optimizer gives that stage's parameters."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import hivemind
import torch
from torch import nn

logger = logging.getLogger(__name__)


def stage_optimizer(
    optimizer: torch.optim.Optimizer, stage_module: nn.Module
) -> tuple[Callable[[Any], torch.optim.Optimizer], list[dict[str, Any]]]:
    """The optimizer a stage server steps with: the class of the module's own ``configure_optimizers`` choice,
    and its parameter groups restricted to the stage's parameters, each with its own hyper-parameters (a
    group without weight decay stays without it). Returns ``(factory, param_groups)``; parameters of the stage
    in none of the optimizer's groups are not trained, as in the user's optimizer."""
    return OptimizerTemplate(optimizer, stage_module).for_stage(stage_module)


class OptimizerTemplate:
    """The user's optimizers as a recipe for stage servers: the class and defaults of the ones that own pipeline
    parameters, and which group of which optimizer (with its own hyper-parameters) each block parameter belongs
    to, by the parameter's place in its module. Taken once when the peer joins, so that a peer that migrates
    later builds its new stage's optimizer the same way even though its blocks were freed and allocated again
    (new tensors). Each stage group carries ``swarm_optimizer``/``swarm_group``: the trainer's optimizer and
    group it mirrors, whose hyper-parameters the trainer's step commands bring (see :mod:`.stepping`).

    Raises:
        TypeError: a hivemind optimizer was given, or pipeline parameters belong to optimizers of different
            classes (a stage steps with one optimizer).
    """

    def __init__(
        self,
        optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer],
        pipeline: nn.Module,
        before: dict[int, tuple[int, str]] | None = None,
    ) -> None:
        optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        for optimizer in optimizers:
            if isinstance(optimizer, hivemind.Optimizer):
                raise TypeError(
                    "configure_optimizers must return a torch optimizer; the SwarmStrategy wraps it itself."
                )
        pipeline_ids = {id(p) for p in pipeline.parameters()} | set(before or {})
        owners = [
            i
            for i, opt in enumerate(optimizers)
            if any(id(p) in pipeline_ids for g in opt.param_groups for p in g["params"])
        ]
        classes = {type(optimizers[i]) for i in owners}
        if len(classes) > 1:
            names = ", ".join(f"optimizer {i}: {type(optimizers[i]).__name__}" for i in owners)
            raise TypeError(
                f"When using the SwarmStrategy, the pipeline's parameters must belong to optimizers of one class "
                f"({names}); a stage steps with one optimizer. Use one class for the pipeline's parameters, or "
                "move the parameters of the other optimizer out of the pipeline."
            )
        first = optimizers[owners[0]] if owners else (optimizers[0] if optimizers else None)
        self.cls = type(first) if first is not None else torch.optim.SGD
        # `defaults` may hold entries the constructor does not take (AdamW's `decoupled_weight_decay`)
        accepted = inspect.signature(self.cls.__init__).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        defaults = first.defaults if first is not None else {"lr": 0.0}
        self.defaults = {k: v for k, v in defaults.items() if takes_any or k in accepted}
        self.hyper: dict[tuple[int, int], dict[str, Any]] = {}
        self._group_of: dict[int, tuple[int, int]] = {}
        for i in owners:
            for g, group in enumerate(optimizers[i].param_groups):
                self.hyper[i, g] = {k: v for k, v in group.items() if k != "params"}
                for p in group["params"]:
                    self._group_of.setdefault(id(p), (i, g))
        self._by_slot: dict[tuple[int, str], tuple[int, int]] = {}  # (id(owner module), name) -> group
        for pid, slot in (before or {}).items():  # parameters the pipeline held before it was reallocated
            if pid in self._group_of:
                self._by_slot[slot] = self._group_of[pid]
        self.remember(pipeline)

    def remember(self, modules: nn.Module) -> None:
        """Note the group of every parameter under ``modules`` by (owning module, name), which survives
        reallocation (``Partition.release``/``materialize`` give the module new parameter objects)."""
        for module in modules.modules():
            for name, p in module.named_parameters(recurse=False):
                if id(p) in self._group_of:
                    self._by_slot[(id(module), name)] = self._group_of[id(p)]

    def for_stage(
        self, stage_module: nn.Module
    ) -> tuple[Callable[[Any], torch.optim.Optimizer], list[dict[str, Any]]]:
        grouped: dict[tuple[int, int], list[torch.Tensor]] = {}
        for module in stage_module.modules():
            for name, p in module.named_parameters(recurse=False):
                key = self._group_of.get(id(p), self._by_slot.get((id(module), name)))
                if key is not None:
                    grouped.setdefault(key, []).append(p)
        groups = [
            {**self.hyper[key], "params": grouped[key], "swarm_optimizer": key[0], "swarm_group": key[1]}
            for key in sorted(grouped)
        ]
        cls, defaults = self.cls, self.defaults

        def make(params: Any) -> torch.optim.Optimizer:
            return cls(params, **defaults)  # type: ignore[arg-type]  # the class's own keyword arguments

        return make, groups
