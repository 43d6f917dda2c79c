"""The D-SLIDE shard plan, free of Lightning: which layers of a module tree get sharded, how the replicated rest
is kept in sync, how full checkpoints are written shard by shard and split again, and the lock-step data loader."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module, Parameter
from torch.optim import Optimizer

from lightning_swarm.layers.checkpoint import StreamedTensor
from lightning_swarm.layers.distributed import ShardGroup
from lightning_swarm.layers.sharded import ShardedLayer, make_sharded, sharded_types
from lightning_swarm.layers.sparse_linear import SparseLSHLinear


@dataclass
class ShardPlan:
    """The sharded layers of one module tree and the replicated parameters around them.

    Args:
        root: the module whose layers were replaced (the LightningModule).
        shard_group: the group the shards talk over.
        sharded: qualified name -> sharded layer that replaced the plain one.
    """

    root: Module
    shard_group: ShardGroup
    sharded: dict[str, ShardedLayer] = field(default_factory=dict)

    def is_applied_to(self, root: Module) -> bool:
        """Whether ``root`` still holds this plan's sharded layers (a second ``fit`` reuses them)."""
        return root is self.root and all(
            root.get_submodule(name) is layer for name, layer in self.sharded.items()
        )

    def replicated_parameters(self) -> list[Parameter]:
        inside = {id(p) for layer in self.sharded.values() for p in layer.parameters()}
        return [p for p in self.root.parameters() if id(p) not in inside]

    def replicated_buffers(self) -> list[Tensor]:
        inside = {id(b) for layer in self.sharded.values() for b in layer.buffers()}
        return [b for b in self.root.buffers() if id(b) not in inside]

    def sync_replicated(self) -> None:
        """Make every replicated parameter and buffer equal to rank 0's (once, at setup)."""
        if self.shard_group.world_size == 1:
            return
        for tensor in [*self.replicated_parameters(), *self.replicated_buffers()]:
            dist.broadcast(tensor.data, src=0, group=self.shard_group.group)

    def all_reduce_replicated_grads(self) -> None:
        """Sum the replicated parameters' gradients over ranks, in one flat all-reduce.

        Each rank's gradient is its share: it reaches the network only through the rank's own logits (the
        other ranks' softmax mass enters as a constant), so the sum over ranks is the network's gradient.
        """
        params = [p for p in self.replicated_parameters() if p.grad is not None]
        if not params or self.shard_group.world_size == 1:
            return
        grads = [_dense(p.grad) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.shard_group.all_reduce_(flat, "replicated_grad_all_reduce")
        offset = 0
        for p, g in zip(params, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
            offset += g.numel()

    def streamed_state_dict(self) -> dict[str, Any]:
        """The state dict the unsharded module would have, each sharded tensor as a ``StreamedTensor`` (this
        rank's part): ``lightning_swarm.layers.checkpoint.save_streamed`` writes it without gathering."""
        full = {key: value for key, value in self.root.state_dict().items() if self._owner(key) is None}
        for name, layer in self.sharded.items():
            for key, value in layer.streamed_state_dict().items():
                full[f"{name}.{key}"] = value
        return full

    def load_full_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load an unsharded state dict: each sharded layer keeps its own rows, the rest loads as is."""
        rest = {k: v for k, v in state_dict.items() if self._owner(k) is None}
        for name, layer in self.sharded.items():
            prefix = f"{name}."
            layer.load_full_state_dict(
                {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
            )
        missing, unexpected = self.root.load_state_dict(rest, strict=False)
        missing = [k for k in missing if self._owner(k) is None]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"DSlideStrategy: the checkpoint does not match the module: missing keys {missing}, "
                f"unexpected keys {unexpected}. Load a checkpoint of the same LightningModule class."
            )

    def param_owner(self, param: Tensor) -> tuple[ShardedLayer, str] | None:
        """The sharded layer and parameter name of ``param``, or ``None`` for a replicated parameter (including one
        a sharded layer keeps whole on every rank, like the input layer's bias)."""
        for layer in self.sharded.values():
            for pname, p in layer.named_parameters(recurse=False):
                if p is param and pname in layer.shard_dims:
                    return layer, pname
        return None

    def _owner(self, key: str) -> str | None:
        for name in self.sharded:
            if key.startswith(f"{name}."):
                return name
        return None


def shard_lightning_module(root: Module, shard_group: ShardGroup) -> ShardPlan:
    """Replace every shardable layer of ``root`` by its sharded version; rank 0's weights are scattered.

    Raises:
        ValueError: if ``root`` has no ``SparseLSHLinear``: the loss must go through a sharded output layer for
            the ranks' gradients to add up to the network's gradient.
    """
    plan = ShardPlan(root=root, shard_group=shard_group)
    targets = [(name, m) for name, m in root.named_modules() if isinstance(m, sharded_types())]
    if not any(isinstance(m, SparseLSHLinear) for _, m in targets):
        raise ValueError(
            f"The DSlideStrategy shards `SparseLSHLinear` layers, but {type(root).__name__} has none. "
            "Build the wide output layer with `lightning_swarm.layers.SparseLSHLinear`, or use strategy='ddp'."
        )
    for name, module in targets:
        sharded = make_sharded(module, shard_group)
        parent_name, _, attr = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, attr, sharded)
        plan.sharded[name] = sharded
    return plan


def streamed_optimizer_state(optimizer: Optimizer, plan: ShardPlan) -> dict[str, Any]:
    """The optimizer state dict an unsharded run would have, sharded rows as ``StreamedTensor`` (no communication)."""
    state_dict = _unwrap(optimizer).state_dict()
    state = copy.copy(state_dict["state"])
    for index, param, layer, pname in _sharded_entries(optimizer, plan, state):
        dim, full_shape = layer.shard_dims[pname], layer.full_shapes[pname]
        state[index] = {
            key: StreamedTensor(value, full_shape if value.shape == param.shape else (full_shape[0],), dim)
            if _is_row_state(value, param.shape, dim)
            else value
            for key, value in state[index].items()
        }
    return {**state_dict, "state": state}


def shard_optimizer_state(
    state_dict: dict[str, Any], optimizer: Optimizer, plan: ShardPlan
) -> dict[str, Any]:
    """Cut an unsharded optimizer state dict down to this rank's rows."""
    state = copy.copy(state_dict["state"])
    for index, _, layer, pname in _sharded_entries(optimizer, plan, state):
        dim = layer.shard_dims[pname]
        full_shape = layer.full_shapes[pname]
        lo, hi = layer.shard_slices[pname]
        state[index] = {
            key: value.narrow(dim, lo, hi - lo).clone() if _is_row_state(value, full_shape, dim) else value
            for key, value in state[index].items()
        }
    return {**state_dict, "state": state}


def _unwrap(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer behind a ``LightningOptimizer``."""
    return getattr(optimizer, "_optimizer", optimizer)


def _sharded_entries(
    optimizer: Optimizer, plan: ShardPlan, state: dict
) -> Iterator[tuple[int, Tensor, Any, str]]:
    """``(index, param, layer, name)`` of every entry of an optimizer ``state`` that belongs to a sharded parameter."""
    params = [p for group in _unwrap(optimizer).param_groups for p in group["params"]]
    for index, param in enumerate(params):
        owner = plan.param_owner(param)
        if owner is not None and index in state:
            yield index, param, *owner


def _is_row_state(value: Any, param_shape: torch.Size | tuple[int, ...], dim: int) -> bool:
    """Whether an optimizer state tensor is laid out like the parameter along its shard dim."""
    if not isinstance(value, Tensor) or value.dim() == 0:
        return False
    if tuple(value.shape) == tuple(param_shape):
        return True
    # Per-row statistics (e.g. a lazy optimizer's per-row step counts) of a row-sharded parameter.
    return dim == 0 and value.dim() == 1 and value.shape[0] == param_shape[0]


class LockStepLoader:
    """Wraps a data loader so that all ranks take the same number of batches, and checks they are the same.

    Before each batch is handed out, the ranks all-reduce four integers (have-a-batch, the min and max of a
    fingerprint of the batch, and whether any rank asks to stop; started asynchronously when the batch is
    fetched, one batch ahead). When any rank runs out, every rank stops; if the fingerprints differ the ranks were
    given different batches, which D-SLIDE cannot train on, and the loader raises. When any rank's
    ``stop_requested`` said yes, :attr:`stop_agreed` becomes true on every rank at the same batch.

    Args:
        dataloader: the loader Lightning prepared (already without a ``DistributedSampler`` split).
        shard_group: the group of the ranks.
        stop_requested: asked as each batch is fetched (e.g. "did this process receive SIGTERM").
        skip: asked when an iteration starts: how many batches of it were trained on before (an epoch resumed
            from a checkpoint saved in its middle); they are drawn and dropped, the same on every rank, so that
            the resumed run sees the batches an uninterrupted one would.
    """

    def __init__(
        self,
        dataloader: Any,
        shard_group: ShardGroup,
        stop_requested: Callable[[], bool] | None = None,
        skip: Callable[[], int] | None = None,
    ) -> None:
        self.dataloader = dataloader
        self.shard_group = shard_group
        self.stop_requested = stop_requested
        self.skip = skip
        self.stop_agreed = False
        self._warned = False

    def __len__(self) -> int:
        return len(self.dataloader)

    def __getattr__(self, name: str) -> Any:
        # Lightning reads `sampler`, `batch_size`, `dataset`... of the wrapped loader.
        if name == "dataloader":
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    def __iter__(self) -> Iterator[Any]:
        if self.shard_group.world_size == 1:
            yield from self.dataloader
            return
        iterator = iter(self.dataloader)
        done = self.skip() if self.skip is not None else 0
        if 0 < done < len(self.dataloader):
            for _ in zip(range(done), iterator, strict=False):
                pass
        # The check of each batch is started when the batch is fetched, one batch ahead, and waited for just
        # before the batch is handed out: it runs while the previous step trains instead of adding a
        # synchronisation point of its own to every step (every rank issues the same collectives in the same
        # order, so the ranks' asynchronous all-reduces match).
        pending = self._fetch(iterator)
        while True:
            batch, flags, work = pending
            self.shard_group.wait(work)
            if int(flags[3]) < 0:
                self.stop_agreed = True
            if int(flags[0]) == 0:
                if batch is not None and not self._warned:
                    self._warned = True
                    warnings.warn(
                        "DSlideStrategy: the ranks have different numbers of batches; every rank stopped at "
                        "the shortest. Give every rank the same data (D-SLIDE is model parallel).",
                        stacklevel=2,
                    )
                return
            if int(flags[1]) != -int(flags[2]):
                raise RuntimeError(
                    "DSlideStrategy: the ranks were given different batches, but D-SLIDE needs the same batch on "
                    "every rank (it shards the model, not the data). Do not use your own DistributedSampler or "
                    "rank-dependent data; keep `Trainer(use_distributed_sampler=True)` (the default)."
                )
            pending = self._fetch(iterator)
            yield batch

    def _fetch(self, iterator: Iterator[Any]) -> tuple[Any, Tensor, Any]:
        """The next batch (``None`` at the end), its check flags, and the started all-reduce (MIN) of them."""
        stop = -int(self.stop_requested is not None and bool(self.stop_requested()))
        try:
            batch = next(iterator)
            fingerprint = batch_fingerprint(batch)
            flags = torch.tensor([1, fingerprint, -fingerprint, stop], dtype=torch.int64)
        except StopIteration:
            batch = None
            flags = torch.tensor([0, 0, 0, stop], dtype=torch.int64)
        work = self.shard_group.all_reduce_async(flags, "lockstep_all_reduce", op=dist.ReduceOp.MIN)
        return batch, flags, work


_FINGERPRINT_WEIGHTS = torch.empty(0, dtype=torch.float64)  # 1 + (position % 97), grown as needed


def _fingerprint_weights(n: int) -> Tensor:
    global _FINGERPRINT_WEIGHTS
    if _FINGERPRINT_WEIGHTS.numel() < n:
        _FINGERPRINT_WEIGHTS = torch.arange(1, 2 * n + 1, dtype=torch.float64) % 97 + 1
    return _FINGERPRINT_WEIGHTS[:n]


def batch_fingerprint(batch: Any) -> int:
    """A cheap integer summary of every tensor in ``batch`` (equal batches give equal fingerprints)."""
    total = 0.0
    count = 0
    stack = [batch]
    while stack:
        item = stack.pop()
        if isinstance(item, Tensor):
            flat = item.detach().reshape(-1)
            if flat.numel():
                total += float(torch.dot(flat.to(torch.float64), _fingerprint_weights(flat.numel())))
            count += flat.numel()
        elif isinstance(item, dict):
            stack.extend(item[k] for k in sorted(item, key=str))
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return (int(round(total * 1024)) * 1_000_003 + count) % (1 << 61)


def _dense(grad: Tensor | None) -> Tensor:
    assert grad is not None
    return grad.to_dense() if grad.is_sparse else grad
