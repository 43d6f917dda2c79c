"""Model families for the fidelity matrix, each written the way its own field writes it (not for this project).

Does a swarm train the model that one process trains (docs/design/swarm-optimisation.md, "The training contract")? These are
the models that question is asked of, small enough that 20 optimizer steps take seconds on a CPU:

- ``gpt``: a GPT-style decoder (nanoGPT's shape): token and position embeddings, pre-norm blocks in an
  ``nn.ModuleList`` each called with the float causal mask of ``nn.Transformer.generate_square_subsequent_mask``
  (0 / -inf), the LM head tied to the token embedding; AdamW with decay on matrices only, linear warm-up then
  cosine decay, gradient clipping at norm 1. Data: a sparse random Markov chain over 32 tokens.
- ``vit``: a Vision Transformer: Conv2d patch embedding, cls token and position embedding on the trainer,
  ``nn.TransformerEncoderLayer(batch_first=True, norm_first=True)`` blocks in an ``nn.Sequential``, head on the
  trainer; the field's recipe (ViT, DeiT, timm): AdamW with weight decay 0.05 on matrices only (not on the
  position embedding and cls token), linear warm-up over a tenth of the steps then cosine decay, gradient clipping
  at norm 1. Data: noisy class templates, 4 classes.
- ``encoder``: a Transformer encoder over padded variable-length sequences: ``nn.TransformerEncoderLayer(
  dropout=0.1)`` blocks in an ``nn.ModuleList`` called with a boolean ``src_key_padding_mask``, masked mean
  pooling; AdamW with a linear warm-up and linear decay (BERT's schedule), gradient clipping at norm 1. Data: which of 4 marker tokens is the most
  frequent among distractors.
- ``cnn``: conv-BN-ReLU blocks in an ``nn.Sequential``, stem and head on the trainer; SGD with momentum and
  weight decay, cosine annealing per step (torchvision's recipe). Data: the ``vit`` images with twice the noise
  (a task the CNN does not fit in 200 steps: at the ``vit`` noise its held-out loss ends near 0.03, where the
  relative gap of two runs measures which few images each gets wrong).
- ``albert``: ``examples/albert/model.py``'s ALBERT (tiny) on the bundled corpus.

Each family is a ``LightningModule`` with ``configure_optimizers``, a deterministic ``train_dataloader`` (the data
is a pure function of ``data_seed``; the model's initialisation comes from the global seed), a
``validation_step``, ``held_out_loss()`` (the mean loss over a fixed held-out set, computed in this process in
eval mode) and ``pipeline``, the attribute path for ``SwarmStrategy(pipeline=...)``. ``TRAINER_ARGS`` holds the
``Trainer`` settings a family trains with (gradient clipping), as its field would pass them.

    model = build("vit", batch_size=64, steps=200)
    Trainer(max_steps=200, **TRAINER_ARGS["vit"]).fit(model)
    model.held_out_loss()
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FAMILIES = ("gpt", "vit", "encoder", "cnn", "albert")
HELD_OUT = 256  # samples in every family's held-out set

# Trainer settings of each family (what its field passes to the Trainer); the swarm run must honour them too
TRAINER_ARGS: dict[str, dict[str, Any]] = {
    "gpt": {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "norm"},
    "vit": {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "norm"},
    "encoder": {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "norm"},
    "cnn": {},
    "albert": {},
}


class FamilyModule(LightningModule):
    """What every family shares: synthetic data made from ``data_seed``, the loaders, the held-out loss and the
    training/validation steps around the family's own ``loss``.

    Args:
        batch_size: samples per batch (one batch per optimizer step).
        steps: optimizer steps the run will take; the training set holds exactly ``steps * batch_size`` samples
            and schedules that decay run over ``steps``.
        lr: peak learning rate.
        data_seed: seed of the data (training and held-out sets), independent of the model's initialisation.
    """

    pipeline = "blocks"

    def __init__(self, batch_size: int, steps: int, lr: float, data_seed: int) -> None:
        super().__init__()
        self.batch_size, self.steps, self.lr, self.data_seed = batch_size, steps, lr, data_seed
        self._train: TensorDataset | None = None
        self._held_out: TensorDataset | None = None

    def make_data(self, n: int, seed: int) -> TensorDataset:
        """``n`` samples of this family's task, a pure function of ``seed``."""
        raise NotImplementedError

    def loss(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def _datasets(self) -> tuple[TensorDataset, TensorDataset]:
        if self._train is None or self._held_out is None:
            self._train = self.make_data(self.steps * self.batch_size, self.data_seed)
            self._held_out = self.make_data(HELD_OUT, self.data_seed + 1)
        return self._train, self._held_out

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(self.data_seed)
        return DataLoader(self._datasets()[0], batch_size=self.batch_size, shuffle=True, generator=g)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._datasets()[1], batch_size=self.batch_size)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), prog_bar=True, batch_size=len(batch[0]))

    @torch.no_grad()
    def held_out_loss(self) -> float:
        """Mean loss per sample over the held-out set, in eval mode, computed in this process."""
        was_training = self.training
        self.eval()
        total, count = 0.0, 0
        for batch in self.val_dataloader():
            total += float(self.loss(batch)) * len(batch[0])
            count += len(batch[0])
        self.train(was_training)
        return total / count


def warmup_cosine(warmup: int, steps: int, floor: float = 0.1) -> Any:
    """LR multiplier of nanoGPT's schedule: linear warm-up from 0 over ``warmup`` steps, then cosine decay to
    ``floor`` at ``steps``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _images(n: int, seed: int, classes: int = 4, size: int = 16, noise: float = 1.5) -> TensorDataset:
    """Noisy images of ``classes`` fixed random templates (3 x size x size), each shifted by up to 2 pixels."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(classes, 3, size, size, generator=torch.Generator().manual_seed(1234))
    templates = F.avg_pool2d(templates, 3, stride=1, padding=1) * 2  # smooth: shapes, not pixel noise
    labels = torch.randint(classes, (n,), generator=g)
    shifts = torch.randint(-2, 3, (n, 2), generator=g)
    images = torch.stack(
        [
            torch.roll(templates[y], (int(dx), int(dy)), (1, 2))
            for y, (dx, dy) in zip(labels, shifts, strict=True)
        ]
    )
    return TensorDataset(images + noise * torch.randn(images.shape, generator=g), labels)


# ---------------------------------------------------------------------------------------------------- GPT


class CausalSelfAttentionBlock(nn.Module):
    """Pre-norm decoder block: masked multi-head self-attention and a GELU MLP (GPT-2's layout)."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(FamilyModule):
    """GPT-style decoder LM; ``blocks`` (an ``nn.ModuleList``) is the pipeline."""

    def __init__(
        self,
        batch_size: int = 16,
        steps: int = 20,
        lr: float = 3e-3,
        data_seed: int = 1,
        vocab_size: int = 32,
        block_size: int = 16,
        dim: int = 32,
        heads: int = 4,
        layers: int = 4,
        dropout: float = 0.0,
        warmup: int = 5,
        weight_decay: float = 0.1,
    ) -> None:
        super().__init__(batch_size, steps, lr, data_seed)
        self.vocab_size, self.block_size, self.warmup, self.weight_decay = (
            vocab_size,
            block_size,
            warmup,
            weight_decay,
        )
        self.wte = nn.Embedding(vocab_size, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(CausalSelfAttentionBlock(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's initialisation: N(0, 0.02) weights, zero biases
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        for block in self.blocks:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def make_data(self, n: int, seed: int) -> TensorDataset:
        # a sparse Markov chain (each token has 3 likely successors), fixed across seeds; ``seed`` draws the walks
        chain = torch.Generator().manual_seed(4321)
        logits = torch.full((self.vocab_size, self.vocab_size), -4.0)
        for a in range(self.vocab_size):
            logits[a, torch.randperm(self.vocab_size, generator=chain)[:3]] = torch.tensor([2.0, 1.0, 0.5])
        probs = logits.softmax(-1)
        g = torch.Generator().manual_seed(seed)
        seq = torch.empty(n, self.block_size + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(self.vocab_size, (n,), generator=g)
        for t in range(self.block_size):
            seq[:, t + 1] = torch.multinomial(probs[seq[:, t]], 1, generator=g).squeeze(1)
        return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95))
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(self.warmup, self.steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


# ---------------------------------------------------------------------------------------------------- ViT


class ViT(FamilyModule):
    """Vision Transformer; ``blocks`` (an ``nn.Sequential`` of encoder layers) is the pipeline."""

    def __init__(
        self,
        batch_size: int = 16,
        steps: int = 20,
        lr: float = 1e-3,
        data_seed: int = 2,
        image_size: int = 16,
        patch: int = 4,
        dim: int = 32,
        heads: int = 4,
        layers: int = 4,
        classes: int = 4,
        dropout: float = 0.0,
        weight_decay: float = 0.05,
    ) -> None:
        super().__init__(batch_size, steps, lr, data_seed)
        self.image_size, self.classes, self.weight_decay = image_size, classes, weight_decay
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        patches = (image_size // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, patches + 1, dim) * 0.02)
        self.blocks = nn.Sequential(
            *(
                nn.TransformerEncoderLayer(
                    dim, heads, 2 * dim, dropout=dropout, activation="gelu", batch_first=True, norm_first=True
                )
                for _ in range(layers)
            )
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # [B, patches, dim]
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embed
        x = self.blocks(x)
        return self.head(self.norm(x[:, 0]))

    def loss(self, batch: Any) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self(images), labels)

    def make_data(self, n: int, seed: int) -> TensorDataset:
        return _images(n, seed, self.classes, self.image_size)

    def configure_optimizers(self) -> Any:
        # timm's recipe: no weight decay on biases, norms, the position embedding and the cls token
        plain = {"pos_embed", "cls_token"}
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2 and n not in plain]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2 or n in plain]
        groups = [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.lr)
        warmup = max(1, self.steps // 10)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup, self.steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


# ---------------------------------------------------------------------------------------------------- encoder


class PaddedEncoder(FamilyModule):
    """Transformer encoder classifier over padded sequences; ``blocks`` (an ``nn.ModuleList``) is the pipeline."""

    PAD = 0

    def __init__(
        self,
        batch_size: int = 16,
        steps: int = 20,
        lr: float = 2e-3,
        data_seed: int = 3,
        vocab_size: int = 16,
        max_len: int = 16,
        dim: int = 32,
        heads: int = 4,
        layers: int = 4,
        classes: int = 4,
        dropout: float = 0.1,
        warmup: int = 10,
    ) -> None:
        super().__init__(batch_size, steps, lr, data_seed)
        self.vocab_size, self.max_len, self.classes, self.warmup = vocab_size, max_len, classes, warmup
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=self.PAD)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=dropout, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pad = tokens == self.PAD  # True where there is no token
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.blocks:
            x = layer(x, src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(x.dtype)
        return self.head((x * keep).sum(1) / keep.sum(1))

    def loss(self, batch: Any) -> torch.Tensor:
        tokens, labels = batch
        return F.cross_entropy(self(tokens), labels)

    def make_data(self, n: int, seed: int) -> TensorDataset:
        # tokens 1..classes are markers, the rest distractors; the label is the most frequent marker
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(4, self.max_len + 1, (n,), generator=g)
        tokens = torch.randint(1, self.vocab_size, (n, self.max_len), generator=g)
        tokens[torch.arange(self.max_len).expand(n, -1) >= lengths.unsqueeze(1)] = self.PAD
        counts = torch.stack([(tokens == 1 + c).sum(1) for c in range(self.classes)], dim=1).float()
        labels = (counts + 1e-3 * torch.rand(counts.shape, generator=g)).argmax(1)  # ties broken at random
        return TensorDataset(tokens, labels)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        warmup = self.warmup
        steps = self.steps
        # transformers' get_linear_schedule_with_warmup: a linear warm-up, then a linear decay to 0 at the end
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: min((step + 1) / warmup, max(0.0, (steps - step) / max(1, steps - warmup))),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


# ---------------------------------------------------------------------------------------------------- CNN


def conv_bn_relu(channels: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(channels, channels, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(inplace=True),
    )


class ConvNet(FamilyModule):
    """A small VGG-style CNN with BatchNorm; ``blocks`` (an ``nn.Sequential`` of conv-BN-ReLU) is the pipeline."""

    def __init__(
        self,
        batch_size: int = 16,
        steps: int = 20,
        lr: float = 0.05,
        data_seed: int = 4,
        image_size: int = 16,
        channels: int = 16,
        layers: int = 4,
        classes: int = 4,
        noise: float = 3.0,
    ) -> None:
        super().__init__(batch_size, steps, lr, data_seed)
        self.image_size, self.classes, self.noise = image_size, classes, noise
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(inplace=True)
        )
        self.blocks = nn.Sequential(*(conv_bn_relu(channels, stride=1 + (i % 2)) for i in range(layers)))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(images)))

    def loss(self, batch: Any) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self(images), labels)

    def make_data(self, n: int, seed: int) -> TensorDataset:
        return _images(n, seed, self.classes, self.image_size, self.noise)

    def configure_optimizers(self) -> Any:
        # torchvision's classification recipe: SGD with momentum and weight decay, cosine annealing per step
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=5e-4)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


# ---------------------------------------------------------------------------------------------------- ALBERT


def _albert_family() -> type[FamilyModule]:
    """ALBERT (``examples/albert/model.py``, unchanged) with the family interface: its data module's loaders and
    ``Albert.evaluate`` as the held-out loss."""
    from examples.albert.data import AlbertDataModule
    from examples.albert.model import Albert

    class AlbertFamily(Albert):
        pipeline = "layers"

        def __init__(
            self, batch_size: int = 16, steps: int = 20, lr: float = 2e-3, data_seed: int = 5, **model: Any
        ) -> None:
            config = {"embedding_size": 16, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64}
            config.update(vocab_size=600, seq_len=32, num_groups=2, layers_per_group=2, lr=lr, **model)
            super().__init__(**config)
            self.data = AlbertDataModule(
                vocab_size=config["vocab_size"],
                seq_len=config["seq_len"],
                batch_size=batch_size,
                train_samples=steps * batch_size,
                val_samples=HELD_OUT,
                seed=data_seed,
            )

        def train_dataloader(self) -> DataLoader:
            self.data.setup()
            return self.data.train_dataloader()

        def val_dataloader(self) -> DataLoader:
            self.data.setup()
            return self.data.val_dataloader()

        def held_out_loss(self) -> float:
            return self.evaluate(self.val_dataloader())

    return AlbertFamily  # type: ignore[return-value]


def build(family: str, **kwargs: Any) -> LightningModule:
    """A new model of ``family`` (one of :data:`FAMILIES`); ``kwargs`` go to its constructor (``batch_size``,
    ``steps``, ``lr``, ``dropout``...). Seed the global RNG first: it decides the initialisation."""
    classes: dict[str, Any] = {"gpt": GPT, "vit": ViT, "encoder": PaddedEncoder, "cnn": ConvNet}
    if family == "albert":
        return _albert_family()(**kwargs)
    if family not in classes:
        raise ValueError(f"Unknown model family {family!r}; choose one of {FAMILIES}.")
    return classes[family](**kwargs)
