"""Masked-LM data for ALBERT: a text corpus, a WordPiece tokenizer trained on it locally, and MLM windows.

The corpus is, in order of preference: WikiText-103 (``wiki.train.raw`` / ``wiki.valid.raw`` in ``data_dir``), any
``*.txt`` / ``*.raw`` files in ``data_dir`` (the last 5% of the text held out), or, by default, the English
documentation that ships with CPython (``pydoc_data``, about 460 KB): nothing is downloaded. The tokenizer
(Hugging Face ``tokenizers``, WordPiece) is trained on the training text and cached under ``cache_dir``, keyed by
the corpus and the vocabulary size, so every peer of a swarm loads the same one.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, Dataset

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PAD, UNK, CLS, SEP, MASK = range(len(SPECIAL_TOKENS))
IGNORE = -100  # label of positions the MLM loss skips


def pydoc_text() -> str:
    """The English documentation bundled with CPython (``pydoc_data``): every pydoc topic, sorted by name."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def read_corpus(data_dir: str | None) -> tuple[str, str]:
    """``(train_text, held_out_text)`` from ``data_dir`` (see the module docstring), or CPython's docs if None."""
    if data_dir is None:
        text = pydoc_text()
        cut = int(len(text) * 0.95)
        return text[:cut], text[cut:]
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(
            f"AlbertDataModule: data_dir={data_dir!r} is not a directory. Point it at a folder with WikiText-103 "
            "(wiki.train.raw, wiki.valid.raw) or with .txt files, or leave it unset to use CPython's bundled docs."
        )
    train, valid = root / "wiki.train.raw", root / "wiki.valid.raw"
    if train.is_file() and valid.is_file():
        return train.read_text(encoding="utf-8"), valid.read_text(encoding="utf-8")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".txt", ".raw"))
    if not files:
        raise FileNotFoundError(
            f"AlbertDataModule: found no wiki.train.raw/wiki.valid.raw and no .txt or .raw files under {data_dir!r}."
        )
    text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
    cut = int(len(text) * 0.95)
    return text[:cut], text[cut:]


def train_tokenizer(text: str, vocab_size: int, cache_dir: str | os.PathLike) -> Tokenizer:
    """A WordPiece tokenizer (BERT normalisation and pre-tokenisation) trained on ``text``, cached by content.

    Training is deterministic: the same text and ``vocab_size`` give the same vocabulary on every machine.
    """
    key = hashlib.sha256(f"{vocab_size}\0{text}".encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"wordpiece-v2-{vocab_size}-{key}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    # peers of a local swarm set up their data at the same time: one trains, the others wait and load its file
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if path.is_file():
                return Tokenizer.from_file(str(path))
            return _train_and_save(text, vocab_size, path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _train_and_save(text: str, vocab_size: int, path: Path) -> Tokenizer:
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False
    )
    tokenizer.train_from_iterator(text.splitlines(), trainer=trainer)
    # the trainer finds the same vocabulary every time but numbers it in hash-map order: renumber it (special tokens
    # first, then sorted), so every peer and every machine maps text to the same ids
    learned = tokenizer.get_vocab()
    ordered = SPECIAL_TOKENS + sorted(t for t in learned if t not in SPECIAL_TOKENS)
    tokenizer.model = models.WordPiece({t: i for i, t in enumerate(ordered)}, unk_token="[UNK]")
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tokenizer.save(str(tmp))
    os.replace(tmp, path)  # atomic: peers starting together never read a half-written file
    return tokenizer


def encode(tokenizer: Tokenizer, text: str) -> torch.Tensor:
    """Token ids of ``text`` as one long stream (paragraphs joined by [SEP])."""
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    ids: list[int] = []
    for enc in tokenizer.encode_batch(paragraphs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(SEP)
    return torch.tensor(ids, dtype=torch.int32)


class MaskedWindows(Dataset):
    """Windows of ``seq_len`` tokens (``[CLS]`` + ``seq_len - 1`` tokens of the stream) with BERT masking.

    Item ``i`` is a pure function of ``(seed, i)``: its window's offset and its masks (15% of tokens chosen; of
    those 80% become ``[MASK]``, 10% a random token, 10% stay), so every run and every peer sees the same items.
    Returns ``(input_ids, labels)`` with ``labels`` = the original id at chosen positions, ``IGNORE`` elsewhere.
    """

    def __init__(
        self, ids: torch.Tensor, seq_len: int, num_samples: int, vocab_size: int, seed: int, mlm_prob: float
    ) -> None:
        if len(ids) < seq_len:
            raise ValueError(
                f"The text has {len(ids)} tokens, fewer than seq_len={seq_len}: use more text or a smaller seq_len."
            )
        self.ids, self.seq_len, self.vocab_size = ids, seq_len, vocab_size
        self.seed, self.mlm_prob = seed, mlm_prob
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(ids) - seq_len + 2, (num_samples,), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.starts[i])
        tokens = torch.cat([torch.tensor([CLS]), self.ids[start : start + self.seq_len - 1].long()])
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        chosen = torch.rand(self.seq_len, generator=g) < self.mlm_prob
        chosen[0] = False
        if not chosen.any():
            chosen[1] = True
        labels = torch.where(chosen, tokens, torch.full_like(tokens, IGNORE))
        roll = torch.rand(self.seq_len, generator=g)
        random_ids = torch.randint(len(SPECIAL_TOKENS), self.vocab_size, (self.seq_len,), generator=g)
        inputs = torch.where(chosen & (roll < 0.8), torch.full_like(tokens, MASK), tokens)
        inputs = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_ids, inputs)
        return inputs, labels


class AlbertDataModule(LightningDataModule):
    """Masked-LM windows of a corpus for ALBERT (see the module docstring for where the text comes from).

    Args:
        data_dir: folder with WikiText-103 raw files or ``.txt`` files; ``None`` uses CPython's bundled docs.
        vocab_size: WordPiece vocabulary size of the tokenizer trained on the corpus.
        seq_len: tokens per sample, ``[CLS]`` included.
        batch_size: samples per microbatch.
        train_samples: windows drawn from the training text (one epoch).
        val_samples: windows drawn from the held-out text (the evaluation set; fixed by ``seed``).
        mlm_probability: share of tokens the model must predict.
        seed: seed of the windows, the masks and the shuffling.
        cache_dir: where the trained tokenizer is cached; ``None`` means ``~/.cache/lightning_swarm``.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        vocab_size: int = 4096,
        seq_len: int = 64,
        batch_size: int = 32,
        train_samples: int = 100_000,
        val_samples: int = 256,
        mlm_probability: float = 0.15,
        seed: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        if not 0 < mlm_probability < 1:
            raise ValueError(f"AlbertDataModule: mlm_probability={mlm_probability} must be in (0, 1).")
        self.data_dir, self.vocab_size, self.seq_len = data_dir, vocab_size, seq_len
        self.batch_size, self.train_samples, self.val_samples = batch_size, train_samples, val_samples
        self.mlm_probability, self.seed = mlm_probability, seed
        self.cache_dir = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "lightning_swarm")
        self.tokenizer = None

    def prepare_data(self) -> None:
        self.setup()

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is not None:
            return
        train_text, held_out = read_corpus(self.data_dir)
        self.tokenizer = train_tokenizer(train_text, self.vocab_size, self.cache_dir)
        vocab = self.tokenizer.get_vocab_size()
        args = (self.seq_len, vocab, self.mlm_probability)
        self.train_set = _windows(encode(self.tokenizer, train_text), self.train_samples, self.seed, *args)
        self.val_set = _windows(encode(self.tokenizer, held_out), self.val_samples, self.seed + 1, *args)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, generator=g
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()


def _windows(
    ids: torch.Tensor, num_samples: int, seed: int, seq_len: int, vocab: int, mlm_prob: float
) -> MaskedWindows:
    return MaskedWindows(ids, seq_len, num_samples, vocab, seed, mlm_prob)
