"""ALBERT (Lan et al., 2020) as a LightningModule whose layer groups run in a swarm.

- Factorised embeddings: tokens are embedded in ``embedding_size`` (small) dimensions and projected to
  ``hidden_size``.
- Cross-layer parameter sharing: ``self.layers`` holds ``num_groups`` groups; group ``g`` applies ONE Transformer
  block ``layers_per_group`` times. With one group per swarm stage (``num_groups == num_stages``), every stage has
  its own shared block, as in the SWARM paper's shared-parameter models.
- The masked-LM head decodes with the (tied) word embeddings.
- Optional compression-aware boundaries between groups (``boundary="maxout"`` or ``"bottleneck"``, see
  :mod:`lightning_swarm.swarm.boundary`) shrink what crosses the network between stages.

Nothing here knows about the swarm: ``SwarmStrategy(pipeline="layers", num_stages=num_groups)`` does the rest.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

from lightning_swarm.swarm.boundary import compression_aware, end_boundaries

from .data import IGNORE


class AlbertBlock(nn.Module):
    """Pre-norm Transformer encoder block: bidirectional self-attention and a GELU MLP."""

    def __init__(self, hidden_size: int, num_heads: int, intermediate_size: int, dropout: float) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size={hidden_size} must be a multiple of num_heads={num_heads}.")
        self.num_heads = num_heads
        self.ln1 = nn.LayerNorm(hidden_size)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)
        self.ln2 = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, intermediate_size), nn.GELU(), nn.Linear(intermediate_size, hidden_size)
        )
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            self.qkv(self.ln1(x)).view(b, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        )
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.dropout(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.dropout(self.mlp(self.ln2(x)))


class SharedLayers(nn.Module):
    """One block applied ``num_layers`` times: ALBERT's cross-layer parameter sharing within a group."""

    def __init__(self, block: nn.Module, num_layers: int) -> None:
        super().__init__()
        self.block, self.num_layers = block, num_layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.num_layers):
            x = self.block(x)
        return x


class Albert(LightningModule):
    """ALBERT masked-LM: embeddings, projection and head on the trainer, ``layers`` (the groups) in the swarm.

    Args:
        vocab_size: size of the tokenizer's vocabulary (the data module's ``vocab_size``).
        embedding_size: width of the factorised token embeddings (ALBERT's E).
        hidden_size: width of the Transformer blocks (ALBERT's H).
        num_groups: groups of shared layers; use one per swarm stage.
        layers_per_group: how many times each group's block is applied.
        num_heads: attention heads.
        intermediate_size: width of the blocks' MLP.
        seq_len: maximum sequence length (position embeddings).
        dropout: dropout probability (ALBERT v2 uses 0).
        boundary: ``"none"``, ``"maxout"`` or ``"bottleneck"``: compression-aware layers between groups.
        boundary_factor: how many times narrower the tensor between groups becomes with a boundary.
        boundary_ends: with a boundary, also shrink the trainer's hops: the input of the first group and the output
            of the last (the model compresses before the groups and expands after them).
        lr: learning rate of AdamW (constant: the stage servers step with the same optimizer and no scheduler).
        weight_decay: weight decay of AdamW.
    """

    def __init__(
        self,
        vocab_size: int = 4096,
        embedding_size: int = 64,
        hidden_size: int = 256,
        num_groups: int = 2,
        layers_per_group: int = 2,
        num_heads: int = 4,
        intermediate_size: int = 1024,
        seq_len: int = 64,
        dropout: float = 0.0,
        boundary: Literal["none", "maxout", "bottleneck"] = "none",
        boundary_factor: int = 4,
        boundary_ends: bool = True,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.word_embeddings = nn.Embedding(vocab_size, embedding_size)
        self.position_embeddings = nn.Embedding(seq_len, embedding_size)
        self.embedding_norm = nn.LayerNorm(embedding_size)
        self.embedding_projection = nn.Linear(embedding_size, hidden_size)
        groups = [
            SharedLayers(AlbertBlock(hidden_size, num_heads, intermediate_size, dropout), layers_per_group)
            for _ in range(num_groups)
        ]
        self.boundary_in: nn.Module | None = None
        self.boundary_out: nn.Module | None = None
        if boundary == "none":
            self.layers = nn.ModuleList(groups)
        else:
            self.layers = compression_aware(
                groups, hidden_size, kind=boundary, factor=boundary_factor, ends=boundary_ends
            )
            if boundary_ends:
                self.boundary_in, self.boundary_out = end_boundaries(boundary, hidden_size, boundary_factor)
        self.final_norm = nn.LayerNorm(hidden_size)
        self.mlm_dense = nn.Linear(hidden_size, embedding_size)
        self.mlm_norm = nn.LayerNorm(embedding_size)
        self.mlm_bias = nn.Parameter(torch.zeros(vocab_size))
        self.apply(_init_weights)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[batch, seq, hidden_size]`` of the last group."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embedding_norm(self.word_embeddings(input_ids) + self.position_embeddings(positions))
        x = self.embedding_projection(x)
        if self.boundary_in is not None:
            x = self.boundary_in(x)
        for group in self.layers:
            x = group(x)
        if self.boundary_out is not None:
            x = self.boundary_out(x)
        return self.final_norm(x)

    def mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the vocabulary, decoded with the tied word embeddings."""
        h = self.mlm_norm(F.gelu(self.mlm_dense(hidden)))
        return F.linear(h, self.word_embeddings.weight, self.mlm_bias)

    def mlm_loss(self, batch: tuple[torch.Tensor, torch.Tensor], reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy over the masked positions only (the head runs on those alone)."""
        input_ids, labels = batch
        selected = labels != IGNORE
        hidden = self(input_ids)[selected]
        return F.cross_entropy(self.mlm_logits(hidden), labels[selected], reduction=reduction)

    @torch.no_grad()
    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean MLM loss per masked token over ``batches`` (e.g. the held-out set), in this process."""
        was_training = self.training
        self.eval()
        total, count = 0.0, 0
        for batch in batches:
            total += float(self.mlm_loss(batch, reduction="sum"))
            count += int((batch[1] != IGNORE).sum())
        self.train(was_training)
        return total / max(count, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.mlm_loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.mlm_loss(batch), prog_bar=True, batch_size=len(batch[0]))

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self.mlm_loss(batch), batch_size=len(batch[0]))

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The most likely token at every position."""
        return self.mlm_logits(self(batch[0])).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )


def _init_weights(module: nn.Module) -> None:
    # BERT's initialisation: N(0, 0.02) weights, zero biases
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
