"""The SLIDE training loss: softmax cross-entropy over the active set of each sample."""

from __future__ import annotations

import torch
from torch import Tensor


def label_positions(ids: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Column of each label in its row of ``ids`` and whether it was found there."""
    if ids.size(0) > 1 and ids.stride(0) == 0:  # one active set shared by the batch: search once
        sorted_ids, perm = ids[0].sort()
        pos = torch.searchsorted(sorted_ids, labels.clamp(min=0)).clamp_(max=ids.size(1) - 1)
        return perm[pos], sorted_ids[pos] == labels
    sorted_ids, perm = ids.sort(dim=1)
    pos = torch.searchsorted(sorted_ids, labels.clamp(min=0).contiguous()).clamp_(max=ids.size(1) - 1)
    return perm.gather(1, pos), sorted_ids.gather(1, pos) == labels


def active_set_loss(ids: Tensor, logits: Tensor, labels: Tensor) -> Tensor:
    """Softmax cross-entropy over the active set, with target mass ``1/|Y|`` on each label.

    For row ``i``: ``logsumexp(logits[i]) - mean(logits[i, j] for ids[i, j] in Y_i)``. Rows
    without labels contribute nothing; the result is the mean over rows with labels (zero,
    still differentiable, when no row has one).

    Args:
        ids: ``[B, k]`` neuron ids of the active set (distinct within a row).
        logits: ``[B, k]`` their logits.
        labels: ``[B, Ymax]`` int64 label ids padded with ``-1``; every label must be in its
            row of ``ids`` (the training forward of :class:`SparseLSHLinear` ensures it).

    Returns:
        Scalar loss.
    """
    if logits.dim() != 2 or ids.shape != logits.shape:
        raise ValueError(
            f"active_set_loss expects ids and logits of the same shape [B, k], got {tuple(ids.shape)} and "
            f"{tuple(logits.shape)}."
        )
    if labels.dim() != 2 or labels.size(0) != logits.size(0) or labels.dtype != torch.long:
        raise ValueError(
            f"active_set_loss expects labels as an int64 tensor [B={logits.size(0)}, Ymax] padded with -1, got "
            f"{labels.dtype} of shape {tuple(labels.shape)}."
        )
    valid = labels >= 0
    pos, found = label_positions(ids, labels)
    if bool((valid & ~found).any()):
        raise ValueError(
            "active_set_loss: some labels are not in the active set ids; compute the loss on the training "
            "forward of SparseLSHLinear (labels given, module in training mode), which always includes them."
        )
    num_labels = valid.sum(dim=1)
    has_labels = num_labels > 0
    label_logits = logits.gather(1, pos).masked_fill(~valid, 0.0).sum(dim=1)
    per_row = logits.logsumexp(dim=1) - label_logits / num_labels.clamp(min=1).to(logits.dtype)
    if not bool(has_labels.any()):
        return logits.sum() * 0.0
    return per_row[has_labels].mean()
