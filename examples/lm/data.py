"""Text that ships with Python (the pydoc topics of CPython's documentation), as byte-level LM windows."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset


def pydoc_text() -> bytes:
    """The English documentation bundled with CPython (``pydoc_data``), about 460 KB."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


class ByteWindows(Dataset):
    """Windows of ``seq_len + 1`` bytes; item ``i`` starts at a fixed pseudo-random offset."""

    def __init__(self, data: torch.Tensor, seq_len: int, num_samples: int, seed: int) -> None:
        if len(data) <= seq_len + 1:
            raise ValueError(f"The text has {len(data)} bytes, fewer than seq_len + 1 = {seq_len + 1}.")
        self.data, self.seq_len = data, seq_len
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(data) - seq_len - 1, (num_samples,), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = int(self.starts[i])
        return self.data[start : start + self.seq_len + 1].long()


class PydocTextDataModule(LightningDataModule):
    """Byte-level language-modelling data from CPython's bundled docs: 95% for training, 5% held out.

    Args:
        seq_len: tokens (bytes) per sample.
        batch_size: samples per microbatch.
        train_samples: windows drawn from the training text per epoch.
        val_samples: windows drawn from the held-out text.
        seed: seed for the window offsets.
    """

    def __init__(
        self,
        seq_len: int = 64,
        batch_size: int = 16,
        train_samples: int = 20000,
        val_samples: int = 256,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.train_samples, self.val_samples = train_samples, val_samples

    def setup(self, stage: str | None = None) -> None:
        data = torch.frombuffer(bytearray(pydoc_text()), dtype=torch.uint8)
        cut = int(len(data) * 0.95)
        self.train_set = ByteWindows(data[:cut], self.seq_len, self.train_samples, self.seed)
        self.val_set = ByteWindows(data[cut:], self.seq_len, self.val_samples, self.seed + 1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)
