"""Precision@k for extreme multi-label classification.

The standard metric of the Extreme Classification Repository: for each sample,
``P@k = |top-k predictions ∩ true labels| / k`` (always divided by ``k``, also
when the sample has fewer than ``k`` labels), averaged over samples. The
states are sums and a count reduced with ``sum``, so the value synced across
processes equals the value on all the data in one process.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchmetrics import Metric


class PrecisionAtK(Metric):
    """Precision@k averaged over samples, for several ``k`` at once.

    ``update(topk_ids, labels)`` takes the predicted ids sorted by decreasing
    score, ``[B, >= max(ks)]``, and the true labels ``[B, Ymax]`` padded with
    ``-1``. Predicted ids are expected to be distinct within a row. A sample
    without labels counts with precision 0. ``compute()`` returns
    ``{"p@1": ..., "p@3": ..., "p@5": ...}`` (one entry per ``k``).

    Args:
        ks: the cut-offs ``k`` to report, each a positive integer.
    """

    precision_sum: torch.Tensor  # states
    num_samples: torch.Tensor

    full_state_update = False
    higher_is_better = True
    is_differentiable = False

    def __init__(self, ks: Sequence[int] = (1, 3, 5), **kwargs) -> None:
        super().__init__(**kwargs)
        ks = tuple(int(k) for k in ks)
        if not ks or any(k <= 0 for k in ks):
            raise ValueError(f"PrecisionAtK: ks must be a non-empty list of positive integers, got {ks}.")
        self.ks = ks
        self.max_k = max(ks)
        self.add_state(
            "precision_sum", default=torch.zeros(len(ks), dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state("num_samples", default=torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, topk_ids: torch.Tensor, labels: torch.Tensor) -> None:
        """Add a batch.

        Args:
            topk_ids: ``[B, K]`` predicted ids, best first, with ``K >= max(ks)``.
            labels: ``[B, Ymax]`` true label ids, padded with ``-1``.
        """
        if topk_ids.dim() != 2 or labels.dim() != 2:
            raise ValueError(
                "PrecisionAtK.update expects topk_ids [B, K] and labels [B, Ymax] (2-D), "
                f"got shapes {tuple(topk_ids.shape)} and {tuple(labels.shape)}."
            )
        if topk_ids.size(0) != labels.size(0):
            raise ValueError(
                f"PrecisionAtK.update: topk_ids has {topk_ids.size(0)} rows but labels has {labels.size(0)}; "
                "pass one row of each per sample."
            )
        if topk_ids.size(1) < self.max_k:
            raise ValueError(
                f"PrecisionAtK.update: topk_ids has {topk_ids.size(1)} columns, fewer than max(ks)={self.max_k}; "
                f"ask the model for at least the top {self.max_k}."
            )
        top = topk_ids[:, : self.max_k].to(labels.device, torch.long)
        labels = labels.long()
        # hit[b, j]: the j-th prediction of sample b is one of its (non-padding) labels.
        hit = ((top[:, :, None] == labels[:, None, :]) & (labels[:, None, :] >= 0)).any(dim=2)
        hits_at = hit.cumsum(dim=1)  # [B, max_k]
        ks = torch.tensor(self.ks, device=hits_at.device)
        per_k = hits_at[:, ks - 1].to(torch.float64) / ks.to(torch.float64)  # [B, len(ks)]
        self.precision_sum += per_k.sum(dim=0).to(self.precision_sum.device)
        self.num_samples += labels.size(0)

    def compute(self) -> dict[str, torch.Tensor]:
        """Return ``{"p@k": mean precision}`` for each ``k`` (0 when no sample was seen)."""
        mean = self.precision_sum / self.num_samples.clamp(min=1)
        return {f"p@{k}": mean[i].float() for i, k in enumerate(self.ks)}
