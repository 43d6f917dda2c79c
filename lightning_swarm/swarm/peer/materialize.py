"""Building a model larger than one peer: blocks built on ``meta`` are given storage and values on the peer that
hosts them only, with the values one process building the whole model would have given them.

A model built on the ``meta`` device (Lightning's ``trainer.init_module(empty_init=True)`` or
``LightningModule.configure_model`` under the ``SwarmStrategy``) has shapes and dtypes but no storage and no
values. Lightning's own strategies for big models (FSDP, ModelParallel) materialise such a model the way torch
prescribes: every module that holds tensors of its own on ``meta`` gets storage (``to_empty``) and initialises
them itself (``reset_parameters()``), in the order of ``module.modules()``. :func:`materialize` does the same,
with two differences:

- Only the modules a peer keeps get storage; every other module is initialised on a scratch allocation of its own
  tensors (one module at a time) that is freed at once, so that the random number generator advances exactly as
  it would in one process building everything: a kept block gets the values a single process seeded alike gives
  it, whichever blocks the peer skipped before it.
- The generator starts from the state it had when the meta build began (:class:`RngSnapshot`, taken by the
  strategy's init context), and if nothing drew from it since, it is left where the single process would have it
  after the build.

Modules whose initialisation is not ``reset_parameters()`` (a bare ``nn.Parameter(torch.randn(...))``, a buffer
computed in ``__init__``) cannot be rebuilt from ``meta``: :func:`materialize` refuses them with one error naming
them, rather than serve uninitialised memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

__all__ = ["RngSnapshot", "has_meta", "mark_released", "materialize", "unmark_released"]

# modules released to meta by a partition (they held values; rebuilding them from their init would be wrong)
_RELEASED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def mark_released(module: nn.Module) -> None:
    """Note that ``module``'s meta tensors were released (they had values), not built on meta."""
    for m in module.modules():
        _RELEASED.add(m)


def unmark_released(module: nn.Module) -> None:
    for m in module.modules():
        _RELEASED.discard(m)


def has_meta(module: nn.Module, recurse: bool = True) -> bool:
    """Whether any parameter or buffer of ``module`` (its own only, unless ``recurse``) is on ``meta``."""
    tensors = (*module.parameters(recurse=recurse), *module.buffers(recurse=recurse))
    return any(t.is_meta for t in tensors)


@dataclass(frozen=True)
class RngSnapshot:
    """The default generators' states when a meta build began: the CPU's, and the accelerator's that the blocks
    are initialised on (``reset_parameters`` of a tensor on a CUDA device draws from that device's generator)."""

    cpu: torch.Tensor
    device: torch.device
    device_state: torch.Tensor | None

    @classmethod
    def capture(cls, device: torch.device | str = "cpu") -> RngSnapshot:
        device = torch.device(device)
        state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), device, state)

    @classmethod
    def seeded(cls, seed: int, device: torch.device | str = "cpu") -> RngSnapshot:
        """The generators' states right after ``torch.manual_seed(seed)`` (the current ones are left alone)."""
        device = torch.device(device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            return cls.capture(device)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device_state is not None:
            torch.cuda.set_rng_state(self.device_state, self.device)

    def is_current(self) -> bool:
        """Whether the generators are where they were when this snapshot was taken (nothing drew since)."""
        if not torch.equal(torch.get_rng_state(), self.cpu):
            return False
        if self.device_state is not None:
            return torch.equal(torch.cuda.get_rng_state(self.device), self.device_state)
        return True


def fresh_meta_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """``root``'s modules, in ``modules()`` order, with tensors of their own built on meta (not released there)."""
    return [(n, m) for n, m in root.named_modules() if m not in _RELEASED and has_meta(m, recurse=False)]


def materialize(
    root: nn.Module,
    keep: Callable[[nn.Module], bool],
    device: torch.device | str,
    rng: RngSnapshot | None,
) -> tuple[int, int]:
    """Give every module of ``root`` built on meta for which ``keep(module)`` holds its storage on ``device`` and
    its own initial values (see the module docstring); the others stay on meta, their initialisation only
    replayed. Returns ``(kept, skipped)``: the number of modules initialised of each kind.

    Raises:
        ValueError: a module built on meta has no ``reset_parameters()``; the message names them and the fix.
    """
    pending = fresh_meta_modules(root)
    if not pending:
        return 0, 0
    device = torch.device(device)
    lacking = [
        name or type(m).__name__ for name, m in pending if not callable(getattr(m, "reset_parameters", None))
    ]
    if lacking:
        raise ValueError(
            f"The model was built on the meta device (trainer.init_module() or configure_model under the "
            f"SwarmStrategy) and the modules {lacking[:5]} hold parameters or buffers of their own but have no "
            "reset_parameters() method, so no peer could give them their initial values. Give those modules a "
            "reset_parameters() that initialises their own tensors (as torch.nn's layers do), or build them outside "
            "the meta context: in __init__ without trainer.init_module, or with trainer.init_module(empty_init=False)."
        )
    kept = skipped = 0
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        if rng is not None:
            rng.restore()
        for _, module in pending:
            module.to_empty(device=device, recurse=False)
            with torch.no_grad():
                cast(Any, module).reset_parameters()
            if keep(module):
                kept += 1
            else:  # its values were drawn only to keep the generator in step: free them at once
                module._apply(lambda t: torch.empty_like(t, device="meta"), recurse=False)
                _RELEASED.add(module)
                skipped += 1
        after = RngSnapshot.capture(device)
    if rng is not None and rng.is_current():
        after.restore()  # as after one process's build: what draws next (dropout, shuffling) draws the same
    return kept, skipped
