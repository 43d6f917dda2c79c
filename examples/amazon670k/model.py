"""The reference extreme-classification network of SLIDE / D-SLIDE for Amazon-670K.

    sparse input features --SparseInputLinear--> 128 ReLU --SparseLSHLinear--> labels

In training, the output layer computes logits only for an active set of ``num_active``
labels per point (its true labels first, then LSH candidates, then random fill), and the loss
is a softmax over that set with target mass ``1/|Y|`` on each true label. In evaluation it
returns the exact (or LSH) top-5. ``output="dense"`` swaps in a plain ``nn.Linear`` with the
full softmax over all labels and the same targets, for comparison.
"""

from __future__ import annotations

from typing import Literal

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_swarm.layers import LazyAdam, SparseInputLinear, SparseLSHLinear, active_set_loss
from lightning_swarm.layers.metrics import PrecisionAtK

Batch = tuple[Tensor, Tensor, Tensor, Tensor]  # indices, offsets, values, labels [B, Ymax] padded with -1


class XCModel(L.LightningModule):
    """Sparse features -> hidden ReLU -> SparseLSHLinear (or dense) over the labels.

    Args:
        num_features: size of the sparse input (135,909 for Amazon-670K; linked from the data).
        num_labels: number of labels (670,091 for Amazon-670K; linked from the data).
        hidden: width of the hidden ReLU layer (128 in SLIDE).
        output: ``"sparse"`` for SparseLSHLinear with the active-set loss, ``"dense"`` for
            ``nn.Linear`` with the full softmax.
        num_active: active neurons in training (labels + LSH candidates + random fill), per batch
            with ``active_set="shared"``, per point with ``"per_sample"``.
        hash_family: ``"simhash"`` or ``"dwta"``.
        num_bits: hash bits per table (K).
        num_tables: hash tables (L).
        bucket_cap: most neurons kept per bucket (``None``: no cap).
        rebuild_every: rebuild the tables every this many training steps (SLIDE: 50).
        rebuild_growth: multiply the rebuild period by this after every rebuild (>= 1).
        reseed_every: draw new hash functions every this many steps (SLIDE: 1,000).
        eval_topk: ``"exact"`` (score every label) or ``"lsh"`` (score only LSH candidates).
        active_set: ``"shared"`` (one active set for the batch: one GEMM) or ``"per_sample"``.
        lr: learning rate of LazyAdam.
        seed: seed of the hash functions.
    """

    def __init__(
        self,
        num_features: int = 135_909,
        num_labels: int = 670_091,
        hidden: int = 128,
        output: Literal["sparse", "dense"] = "sparse",
        num_active: int = 4096,
        hash_family: Literal["simhash", "dwta"] = "simhash",
        num_bits: int = 14,
        num_tables: int = 8,
        bucket_cap: int | None = 128,
        rebuild_every: int = 50,
        rebuild_growth: float = 1.0,
        reseed_every: int = 1000,
        eval_topk: Literal["exact", "lsh"] = "exact",
        active_set: Literal["shared", "per_sample"] = "shared",
        lr: float = 1e-3,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if output not in ("sparse", "dense"):
            raise ValueError(f"XCModel: output must be 'sparse' or 'dense', got {output!r}.")
        self.save_hyperparameters()
        self.input_layer: SparseInputLinear
        self.output_layer: SparseLSHLinear | nn.Linear
        ks = tuple(k for k in (1, 3, 5) if k <= num_labels)  # P@1/3/5, all that the label space allows
        self.eval_k = max(ks)
        self.val_precision = PrecisionAtK(ks=ks)
        self.test_precision = PrecisionAtK(ks=ks)

    def configure_model(self) -> None:
        """Create the two wide layers. Lightning calls this once the strategy is set up (and
        ``load_from_checkpoint`` calls it too): under ``DSlideStrategy`` each rank then creates only
        its shard of them, so no process ever holds the whole network."""
        if "output_layer" in self._modules:  # a second fit() keeps the trained layers
            return
        hp = self.hparams
        self.input_layer = SparseInputLinear(hp.num_features, hp.hidden)
        if hp.output == "sparse":
            self.output_layer = SparseLSHLinear(
                hp.hidden,
                hp.num_labels,
                num_active=min(hp.num_active, hp.num_labels),
                hash_family=hp.hash_family,
                num_bits=hp.num_bits,
                num_tables=hp.num_tables,
                bucket_cap=hp.bucket_cap,
                rebuild_every=hp.rebuild_every,
                rebuild_growth=hp.rebuild_growth,
                reseed_every=hp.reseed_every,
                eval_topk=hp.eval_topk,
                active_set=hp.active_set,
                seed=hp.seed,
            )
        else:
            self.output_layer = nn.Linear(hp.hidden, hp.num_labels)

    def hidden_activations(self, indices: Tensor, offsets: Tensor, values: Tensor) -> Tensor:
        return F.relu(self.input_layer(indices, offsets, values))

    def top_labels(
        self, indices: Tensor, offsets: Tensor, values: Tensor, k: int = 5
    ) -> tuple[Tensor, Tensor]:
        """``(scores, ids)`` of the ``k`` best labels per point, best first."""
        h = self.hidden_activations(indices, offsets, values)
        if self.hparams.output == "sparse":
            return self.output_layer.topk(h, k)
        return self.output_layer(h).topk(k, dim=1)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        indices, offsets, values, labels = batch
        h = self.hidden_activations(indices, offsets, values)
        if self.hparams.output == "sparse":
            ids, logits = self.output_layer(h, labels)
            loss = active_set_loss(ids, logits, labels)
        else:
            loss = full_softmax_loss(self.output_layer(h), labels)
        self.log("train/loss", loss, prog_bar=True, batch_size=labels.size(0))
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        indices, offsets, values, labels = batch
        _, ids = self.top_labels(indices, offsets, values, k=self.eval_k)
        self.val_precision.update(ids, labels)

    def on_validation_epoch_end(self) -> None:
        # compute() reduces the metric's sums across processes.
        self.log_dict({f"val/{k}": v for k, v in self.val_precision.compute().items()}, prog_bar=True)
        self.val_precision.reset()

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        indices, offsets, values, labels = batch
        _, ids = self.top_labels(indices, offsets, values, k=self.eval_k)
        self.test_precision.update(ids, labels)

    def on_test_epoch_end(self) -> None:
        self.log_dict({f"test/{k}": v for k, v in self.test_precision.compute().items()})
        self.test_precision.reset()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Lazy Adam: only the rows that got a (sparse) gradient are updated; dense params get Adam.
        return LazyAdam(self.parameters(), lr=self.hparams.lr)


def full_softmax_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Softmax cross-entropy over all labels with target mass ``1/|Y|`` on each true label.

    Points without labels do not contribute; the result is the mean over the others.
    """
    valid = labels >= 0
    counts = valid.sum(dim=1)
    targets = torch.zeros_like(logits)
    weights = valid.float() / counts.clamp(min=1).unsqueeze(1).float()
    targets.scatter_add_(1, labels.clamp(min=0), weights)
    per_point = -(targets * F.log_softmax(logits, dim=1)).sum(dim=1)
    has_labels = counts > 0
    return per_point[has_labels].sum() / has_labels.sum().clamp(min=1)
