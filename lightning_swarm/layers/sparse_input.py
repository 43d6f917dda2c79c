"""The first wide layer for sparse inputs (bag of feature:value pairs), with row-sparse gradients."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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
        self.in_features, self.out_features = in_features, out_features
        bound = 1.0 / math.sqrt(in_features)
        self.weight = nn.Parameter(torch.empty(in_features, out_features).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(out_features).uniform_(-bound, bound)) if bias else None

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
        out = F.embedding_bag(
            indices,
            self.weight,
            offsets,
            mode="sum",
            per_sample_weights=values.to(self.weight.dtype),
            sparse=True,
        )
        return out if self.bias is None else out + self.bias
