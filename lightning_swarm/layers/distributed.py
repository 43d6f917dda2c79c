"""Batched, autograd-aware collectives for D-SLIDE model parallelism, with byte accounting.

D-SLIDE shards wide layers across ranks (input features, output neurons). A training step then needs only a few collectives over
small per-batch tensors (the sum of the ranks' partial hidden activations ``[B, H]``, per-sample softmax max and
sum ``[B, 2]``, the gradient with respect to the hidden activations ``[B, H]``), never one per sample and never a weight-sized one. This
module holds those collectives as autograd functions (their backward is the adjoint collective), and a
:class:`CommStats` that counts every byte they move so that the strategy can log it and tests can compare it
with the analytic count.

Byte convention: a collective is counted by the size of its logical payload, the tensor every rank ends up
holding: ``all_reduce`` of ``x`` counts ``x.numel() * x.element_size()``, ``all_gather`` counts the size of the
gathered result. The wire traffic of gloo's ring algorithms is within a factor ``2 (n - 1) / n`` of that.

The engine does not import Lightning.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_swarm.layers.mesh import Collective, SocketMesh


@dataclass
class CommStats:
    """Counts the collectives of one process: bytes and calls, per kind, since the last :meth:`reset`.

    Args:
        bytes_by_kind: logical payload bytes per collective kind (e.g. ``"hidden_all_reduce"``).
        calls_by_kind: number of calls per collective kind.
    """

    bytes_by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls_by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, tensor: Tensor) -> None:
        """Record one collective of ``kind`` whose logical payload is ``tensor``."""
        self.bytes_by_kind[kind] += tensor.numel() * tensor.element_size()
        self.calls_by_kind[kind] += 1

    @property
    def total_bytes(self) -> int:
        """All bytes counted since the last reset."""
        return sum(self.bytes_by_kind.values())

    @property
    def total_calls(self) -> int:
        """All collective calls counted since the last reset."""
        return sum(self.calls_by_kind.values())

    def reset(self) -> None:
        """Forget everything counted so far."""
        self.bytes_by_kind = defaultdict(int)
        self.calls_by_kind = defaultdict(int)

    def snapshot(self) -> dict[str, int]:
        """A plain copy of the per-kind byte counts (for logging and tests)."""
        return dict(self.bytes_by_kind)


@dataclass
class ShardGroup:
    """The process group a sharded layer talks over, with its rank, size and byte counter.

    Args:
        group: a ``torch.distributed`` process group, or ``None`` for the default (WORLD) group.
        stats: where the bytes of every collective are counted.
    """

    group: Any = None
    stats: CommStats = field(default_factory=CommStats)
    overlap: Callable[[], None] | None = None
    """Work to run on this rank while the hidden-gradient all-reduce of the backward is in flight (the
    strategy's early optimizer update of the output layers); ``None``: none."""
    spin_s: float = 0.0
    """How long a wait for a collective keeps this rank's core busy before it blocks (see
    ``DSlideStrategy(spin_wait=...)``); 0: it blocks at once. Never while the rank's thread has been kept
    waiting for a CPU for more than :data:`CONTENDED_FRACTION` of the last :data:`CONTENTION_WINDOW_S`: a rank
    that shares its cores with other busy processes (more ranks than cores, say) blocks, or its spinning would
    take the CPU from the ranks (and the kernel's network work) it waits for."""
    mesh: SocketMesh | None = None
    """Direct connections between the ranks that carry the collectives instead of gloo (``None``: gloo); see
    :mod:`.mesh`."""
    _probe: tuple[float, int] | None = field(default=None, init=False, repr=False, compare=False)
    _blocked_until: float = field(default=0.0, init=False, repr=False, compare=False)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def all_reduce_(
        self, tensor: Tensor, kind: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> Tensor:
        """In-place all-reduce of ``tensor`` (counted under ``kind``); returns ``tensor``."""
        if self.world_size > 1:
            self.wait(self.all_reduce_async(tensor, kind, op))
        return tensor

    def all_reduce_async(
        self, tensor: Tensor, kind: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> Any:
        """Start an in-place all-reduce of ``tensor`` (counted under ``kind``) and return its work handle
        (``None`` alone): the caller passes it to :meth:`wait` before reading ``tensor``."""
        if self.world_size == 1:
            return None
        self.stats.add(kind, tensor)
        if self.mesh is not None:
            return self.mesh.start_all_reduce(tensor, _REDUCERS[op])
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=True)

    def all_gather_cat(
        self, tensor: Tensor, kind: str, dim: int = 0, sizes: list[int] | None = None
    ) -> Tensor:
        """All-gather ``tensor`` from every rank and concatenate along ``dim``.

        Args:
            tensor: this rank's part.
            kind: the name the bytes are counted under.
            dim: the dimension along which parts may differ in size (gloo needs equal sizes on the wire, so
                parts are padded to the largest; the padded payload is what is counted).
            sizes: every rank's extent along ``dim``; ``None`` when all ranks send the same shape.
        """
        if self.world_size == 1:
            return tensor
        sizes = [tensor.shape[dim]] * self.world_size if sizes is None else sizes
        widest = max(sizes)
        tensor = tensor.contiguous()
        if tensor.shape[dim] < widest:
            pad_shape = list(tensor.shape)
            pad_shape[dim] = widest - tensor.shape[dim]
            tensor = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=dim)
        if self.mesh is not None:
            gathered = self.mesh.start_all_gather(tensor)
            self.wait(gathered)
            parts = gathered.parts
        else:
            parts = [torch.empty_like(tensor) for _ in sizes]
            self.wait(dist.all_gather(parts, tensor, group=self.group, async_op=True))
        for part in parts:
            self.stats.add(kind, part)
        return torch.cat(
            [part.narrow(dim, 0, size) for part, size in zip(parts, sizes, strict=True)], dim=dim
        )

    def wait(self, work: Any) -> None:
        """Wait for a collective started with ``async_op=True`` (``None``: nothing to wait for), spinning on
        its completion for up to :attr:`spin_s` first; its errors and timeout are the process group's."""
        if work is None:
            return
        if isinstance(work, Collective):  # the mesh's own wait spins (see spin_now) or blocks in select
            work.wait()
            return
        if not work.is_completed():
            deadline = time.perf_counter() + self.spin_now()
            while time.perf_counter() < deadline and not work.is_completed():
                os.sched_yield()  # releases the GIL; runs any other thread ready on this core
        work.wait()

    def spin_now(self) -> float:
        """How long the next wait may spin: :attr:`spin_s`, or 0 while this rank competes for a CPU."""
        return 0.0 if self.spin_s <= 0 or self.cpu_contended() else self.spin_s

    def cpu_contended(self) -> bool:
        """Whether this rank should block in its waits because its thread competes for a CPU: its time waiting
        for one (runnable, not running: ``/proc/thread-self/schedstat``) was more than
        :data:`CONTENDED_FRACTION` of a :data:`CONTENTION_WINDOW_S` window while it spun, within the last
        :data:`CONTENTION_BACKOFF_S`; ``True`` where the kernel does not say. (Measured only while spinning: a
        blocking rank competes less, so its own share would say it may spin again.)"""
        now = time.perf_counter()
        if now < self._blocked_until:
            return True
        probe = self._probe
        if probe is not None and now - probe[0] < CONTENTION_WINDOW_S:
            return False  # inside a window: nothing to read yet (a wait's hot path)
        queued = _runqueue_wait_ns()
        if queued is None:
            return True
        fresh = probe is not None and now - probe[0] <= 2 * CONTENTION_WINDOW_S + self.spin_s
        if fresh and probe is not None and (queued - probe[1]) / 1e9 > CONTENDED_FRACTION * (now - probe[0]):
            self._probe, self._blocked_until = None, now + CONTENTION_BACKOFF_S
            return True
        # a new window: after a full one that was not contended, the first, or one that ended long ago
        self._probe = (now, queued)
        return False


CONTENTION_WINDOW_S = 0.5
"""The window over which :meth:`ShardGroup.cpu_contended` measures a spinning rank's wait for a CPU (seconds)."""
CONTENTION_BACKOFF_S = 30.0
"""How long a rank found contended blocks in its waits before it tries spinning again (seconds)."""
CONTENDED_FRACTION = 0.3
"""The share of the time a rank's thread may wait for a CPU and still spin in its waits: 0.11 for 2 ranks pinned
to a core each of this project's 2-core VM (gloo's thread preempting it), 0.4-0.6 for 4 ranks on its 2 cores
spinning."""


_REDUCERS = {
    dist.ReduceOp.SUM: lambda acc, part: acc.add_(part),
    dist.ReduceOp.MIN: lambda acc, part: torch.minimum(acc, part, out=acc),
    dist.ReduceOp.MAX: lambda acc, part: torch.maximum(acc, part, out=acc),
}


def _runqueue_wait_ns() -> int | None:
    """Nanoseconds the calling thread has spent runnable but not running, or ``None`` where unknown."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


def shard_range(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """The contiguous range ``[lo, hi)`` of ``total`` items that ``rank`` owns out of ``world_size``.

    The first ``total % world_size`` ranks own one item more, so sizes differ by at most one.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"shard_range: rank {rank} is not in a group of {world_size} ranks.")
    if total < world_size:
        raise ValueError(
            f"Cannot shard {total} neurons over {world_size} ranks: every rank needs at least one. "
            "Use fewer ranks or a wider layer."
        )
    base, extra = divmod(total, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def shard_sizes(total: int, world_size: int) -> list[int]:
    """How many of ``total`` items each rank owns, in rank order (see :func:`shard_range`)."""
    return [hi - lo for lo, hi in (shard_range(total, rank, world_size) for rank in range(world_size))]


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; the adjoint (backward) is again a sum over ranks."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, shard_group: ShardGroup, kind: str) -> Tensor:
        ctx.shard_group = shard_group
        ctx.kind = kind
        return shard_group.all_reduce_(tensor.clone(), kind)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return ctx.shard_group.all_reduce_(grad.contiguous().clone(), ctx.kind + "_grad"), None, None


def all_reduce_sum(tensor: Tensor, shard_group: ShardGroup, kind: str) -> Tensor:
    """Differentiable sum over ranks: every rank gets the sum and its backward sums the gradients."""
    if shard_group.world_size == 1:
        return tensor
    return _AllReduceSum.apply(tensor, shard_group, kind)


class _SumOverRanksPlusBias(torch.autograd.Function):
    """``sum_r partial_r + bias`` on every rank; backward: all-reduce the gradient, which every rank's partial
    and the (replicated) bias then share."""

    @staticmethod
    def forward(ctx: Any, partial: Tensor, bias: Tensor | None, shard_group: ShardGroup) -> Tensor:
        ctx.shard_group = shard_group
        ctx.has_bias = bias is not None
        out = shard_group.all_reduce_(partial.contiguous().clone(), "hidden_all_reduce")
        return out if bias is None else out.add_(bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor | None, None]:
        # Every rank's loss depends on every hidden value: the total gradient is the sum of the ranks' partial
        # gradients. The bias gets it too, so its gradient is the network's on every rank (no further reduce).
        group: ShardGroup = ctx.shard_group
        total = grad.contiguous().clone()
        work = group.all_reduce_async(total, "hidden_grad_all_reduce")
        try:
            if group.overlap is not None:
                group.overlap()  # while the sum travels
        finally:
            group.wait(work)
        return total, (total.sum(dim=0) if ctx.has_bias else None), None


def sum_over_ranks_plus_bias(partial: Tensor, bias: Tensor | None, shard_group: ShardGroup) -> Tensor:
    """The layer output ``[B, H]`` from every rank's partial sum over its input features.

    Args:
        partial: this rank's ``[B, H]`` sum over the input features it owns.
        bias: ``[H]``, the same on every rank (or ``None``).
        shard_group: the group and byte counter.

    Returns:
        ``sum_r partial_r + bias`` on every rank. Its backward all-reduces the output gradient ``[B, H]``: each
        rank's partial gets the network's gradient (for its own weight rows), and so does the bias, which
        therefore stays equal on every rank without a reduce of its own.
    """
    if shard_group.world_size == 1:
        return partial if bias is None else partial + bias
    return _SumOverRanksPlusBias.apply(partial, bias, shard_group)
