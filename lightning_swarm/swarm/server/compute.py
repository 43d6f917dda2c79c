"""Pieces of a stage server's computation: seeded randomness, buffers kept across a recompute, the inputs as
leaves, kept forwards, and the ownership and finiteness of parameter gradients (see :mod:`.stage_backend`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_swarm.swarm.wire.payload import Payload

__all__ = [
    "Kept",
    "all_finite",
    "buffers_kept",
    "exclusive",
    "leaves_of",
    "module_device",
    "running_stats",
    "seeded_rng",
]

# the generators are the process's: two servers of one process (tests; a trainer that serves a stage) read and set
# their states one at a time (two threads in torch's Generator.get_state at once hung a test, each waiting for the
# other). Not held while the stage runs: a slow stage would hold up the other server
_RNG_LOCK = threading.RLock()


@contextlib.contextmanager
def seeded_rng(seed: int | None, device: torch.device) -> Iterator[list[bool]]:
    """Run the body with torch's CPU generator (and ``device``'s, if CUDA) seeded with ``seed``, restored
    afterwards (the server's own stream, and an in-process trainer's, do not move); ``None``: unseeded, as they
    are. Yields ``[drew]``, set on exit to whether the body drew random numbers from them."""
    cuda = device.type == "cuda" and torch.cuda.is_available()
    generators = [torch.default_generator]
    if cuda:
        index = device.index if device.index is not None else torch.cuda.current_device()
        generators.append(torch.cuda.default_generators[index])
    drew = [False]
    with _RNG_LOCK:
        saved = None if seed is None else [generator.get_state() for generator in generators]
        if seed is not None:
            for generator in generators:
                generator.manual_seed(seed)
        before = [generator.get_state() for generator in generators]
    try:
        yield drew
        with _RNG_LOCK:
            drew[0] = any(
                not torch.equal(state, generator.get_state())
                for state, generator in zip(before, generators, strict=True)
            )
    finally:
        if saved is not None:
            with _RNG_LOCK:
                for generator, state in zip(generators, saved, strict=True):
                    generator.set_state(state)


@contextlib.contextmanager
def buffers_kept(module: nn.Module, training: bool) -> Iterator[None]:
    """Leave the module's buffers as they are through a train-mode call (a recomputed forward must not update
    batch normalisation's running statistics a second time; nor may the forward of a trainer that does not own
    them). Each persistent buffer is swapped for a copy during the call and put back after: the buffers keep their
    values and their version counters, which the graphs of kept forwards saved (batch normalisation saves its
    running statistics for its backward, and a backward refuses tensors changed in place since; restoring values
    with ``copy_`` would break every kept forward's backward). Every persistent one, changed or not: batch norm's
    kernel updates its running statistics without bumping their version counter, so a change cannot be told
    cheaply.
    Non-persistent buffers (masks, rotary tables) are left in place: nothing updates them in a forward, and they
    can be large. Eval mode: nothing to do."""
    swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
    if training:
        for m in module.modules():
            for name, buffer in m._buffers.items():
                if buffer is not None and name not in m._non_persistent_buffers_set:
                    swapped.append((m, name, buffer))
        for m, name, buffer in swapped:
            m._buffers[name] = buffer.detach().clone()
    try:
        yield
    finally:
        for m, name, buffer in swapped:
            m._buffers[name] = buffer


def running_stats(module: nn.Module) -> list[torch.Tensor]:
    """The buffers of ``module`` that its train-mode forwards update: the running mean, variance and batch count of
    every batch normalisation that tracks them (torch's ``_NormBase``: ``BatchNorm1d/2d/3d``, ``SyncBatchNorm``,
    ``InstanceNorm`` with ``track_running_stats``), in module order. Buffers a custom module updates in its own
    forward are not found (they follow the calls each peer served)."""
    found: list[torch.Tensor] = []
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                buffer = m._buffers.get(name)
                if buffer is not None:
                    found.append(buffer)
    return found


def module_device(module: nn.Module) -> torch.device:
    """Where a module lives: the device of its first parameter (or buffer); the CPU for a module with neither."""
    for tensor in module.parameters():
        return tensor.device
    for buffer in module.buffers():
        return buffer.device
    return torch.device("cpu")


def leaves_of(inputs: Payload, device: torch.device) -> list[torch.Tensor]:
    """The inputs as autograd leaves on ``device``: floating tensors sent as requiring grad require it."""
    leaves = []
    for t in inputs.tensors:
        leaf = t.detach().to(device)
        if t.requires_grad and t.is_floating_point():
            leaf.requires_grad_(True)
        leaves.append(leaf)
    return leaves


class Kept:
    """A forward kept for its backward: its input leaves (and the inputs' structure, for a backward sent without
    them), its outputs (with their autograd graph), the version of the served parameters it ran with, and how
    long it took."""

    __slots__ = ("skeleton", "leaves", "outputs", "version", "forward_s", "created")

    def __init__(
        self,
        skeleton: Any,
        leaves: list[torch.Tensor],
        outputs: list[torch.Tensor],
        version: int,
        forward_s: float,
        created: float,
    ) -> None:
        self.skeleton, self.leaves, self.outputs, self.version = skeleton, leaves, outputs, version
        self.forward_s, self.created = forward_s, created

    @property
    def inputs(self) -> Payload:
        """The forward's inputs, as its leaves (on the stage's device, requiring grad where they were sent so)."""
        return Payload(self.skeleton, list(self.leaves))

    def matches(self, inputs: Payload, version: int) -> bool:
        """Whether a backward of ``inputs`` may use this forward: same parameters, same input shapes and dtypes,
        the same inputs requiring grad."""
        if version != self.version or len(inputs.tensors) != len(self.leaves):
            return False
        return all(
            t.shape == leaf.shape
            and t.dtype == leaf.dtype
            and (t.requires_grad and t.is_floating_point()) == leaf.requires_grad
            for t, leaf in zip(inputs.tensors, self.leaves, strict=True)
        )


def all_finite(grads: list[torch.Tensor | None]) -> bool:
    """Whether every gradient is finite: one reduction per tensor (a sum is NaN or infinite when any element is,
    or when finite values are so large that they overflow, which is refused as well), one sync for all."""
    sums = [g.sum(dtype=torch.float32) for g in grads if g is not None and g.numel()]
    return not sums or bool(torch.isfinite(torch.stack(sums)).all())


def exclusive(
    grads: list[torch.Tensor | None], others: tuple[torch.Tensor, ...]
) -> list[torch.Tensor | None]:
    """Parameter gradients that share no memory with each other nor with ``others`` (the input gradients sent
    back): autograd may hand one tensor to several inputs (``y = x + p`` gives ``x`` and ``p`` the same gradient),
    and the pending sum adds into the first backward's tensors in place. Shared or non-contiguous ones are copied."""
    seen = {t.untyped_storage().data_ptr() for t in others if t.numel()}
    out: list[torch.Tensor | None] = []
    for g in grads:
        if g is not None and g.numel():
            g = g.contiguous()  # an expanded gradient (``p.sum()`` gives one) cannot be added into in place
            ptr = g.untyped_storage().data_ptr()
            if ptr in seen:
                g = g.clone()
                ptr = g.untyped_storage().data_ptr()
            seen.add(ptr)
        out.append(g)
    return out
