"""The first wide layer for sparse inputs (bag of feature:value pairs), with row-sparse gradients."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_swarm.layers.distributed import shard_range
from lightning_swarm.layers.init import born_shard_group, draw_init_seed, initialising, uniform_rows_


class SparseInputLinear(nn.Module):
    """Linear layer on a sparse input given as a flat bag of ``(feature, value)`` pairs.

    ``forward(indices, offsets, values)`` computes ``sum_j values[j] * weight[indices[j]] + bias``
    per sample (``F.embedding_bag`` with ``mode="sum"``); sample ``b`` owns the pairs
    ``offsets[b]:offsets[b+1]``. ``weight`` is ``[in_features, out_features]`` so its gradient
    is a ``sparse_coo`` tensor over the features present in the batch; ``bias`` gets a dense
    gradient. Initialisation matches ``nn.Linear``.

    Args:
        in_features: number of input features.
        out_features: output size.
        bias: whether to add a learnable bias.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"SparseInputLinear: in_features and out_features must be positive, got {in_features}, {out_features}."
            )
        self.row_offset, rows = 0, in_features
        group = born_shard_group()
        # Created whole inside `sharded_init`: hold only this rank's input features, the rows
        # `[row_offset, row_offset + rows)` of the weight (lightning_swarm.layers.init); the bias is whole.
        self.born_sharded = group is not None and in_features >= group.world_size
        if self.born_sharded:
            assert group is not None
            self.row_offset, hi = shard_range(in_features, group.rank, group.world_size)
            rows = hi - self.row_offset
        self.in_features, self.out_features = in_features, out_features
        self.init_seed = draw_init_seed() if initialising() else 0
        self.weight = nn.Parameter(torch.empty(rows, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if initialising():
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """``U(-1/sqrt(in), 1/sqrt(in))`` like ``nn.Linear``, drawn by blocks of hidden units from ``init_seed``, so
        a shard of input features gets exactly the values the whole layer's would (``lightning_swarm.layers.init``)."""
        bound = 1.0 / math.sqrt(self.in_features)
        uniform_rows_(self.weight.data.t(), 0, self.init_seed, 0, bound, self.row_offset, self.in_features)
        if self.bias is not None:
            uniform_rows_(self.bias.data.unsqueeze(1), 0, self.init_seed, 1, bound)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )

    def forward(self, indices: Tensor, offsets: Tensor, values: Tensor) -> Tensor:
        """Args:
            indices: ``[N]`` int64 feature ids in ``[0, in_features)``.
            offsets: ``[B]`` int64 start of each sample in ``indices`` (non-decreasing, first 0).
            values: ``[N]`` float feature values.

        Returns:
            ``[B, out_features]``.
        """
        self._check_input(indices, offsets, values)
        out = F.embedding_bag(
            indices,
            self.weight,
            offsets,
            mode="sum",
            per_sample_weights=values.to(self.weight.dtype),
            sparse=True,
        )
        return out if self.bias is None else out + self.bias

    def _check_input(self, indices: Tensor, offsets: Tensor, values: Tensor) -> None:
        if indices.dim() != 1 or offsets.dim() != 1 or values.shape != indices.shape:
            raise ValueError(
                "SparseInputLinear expects 1-D indices [N], offsets [B] and values [N], got shapes "
                f"{tuple(indices.shape)}, {tuple(offsets.shape)}, {tuple(values.shape)}."
            )
        if indices.dtype != torch.long or offsets.dtype != torch.long:
            raise ValueError(
                f"SparseInputLinear expects int64 indices and offsets, got {indices.dtype}, {offsets.dtype}."
            )
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= self.in_features):
            raise ValueError(
                f"SparseInputLinear: feature ids must be in [0, {self.in_features}), got values in "
                f"[{int(indices.min())}, {int(indices.max())}]."
            )
        if offsets.numel() and (int(offsets[0]) != 0 or int(offsets[-1]) > indices.numel()):
            raise ValueError(
                f"SparseInputLinear: offsets must start at 0 and not exceed len(indices)={indices.numel()}, got "
                f"first {int(offsets[0])}, last {int(offsets[-1])}."
            )
