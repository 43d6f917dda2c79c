"""Data for extreme classification: an Amazon-670K-shaped synthetic generator, and the LightningDataModule that
feeds it or files in the Extreme Classification Repository format (read and written by :mod:`.xc_format`, whose
names are re-exported here).

Files are sorted by label, so the training loader shuffles.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .xc_format import (  # noqa: F401  (re-exported: the format's API)
    XCData,
    _indptr,
    iter_xc_file,
    read_header,
    read_xc_file,
    write_xc_file,
)

AMAZON670K_FEATURES = 135_909
AMAZON670K_LABELS = 670_091

# ---------------------------------------------------------------------------------------------
# Synthetic data with Amazon-670K's shape and label skew
# ---------------------------------------------------------------------------------------------


def make_synthetic(
    num_samples: int,
    num_features: int = AMAZON670K_FEATURES,
    num_labels: int = AMAZON670K_LABELS,
    seed: int = 0,
    label_zipf: float = 1.0,
    label_zipf_offset: float = 10.0,
    max_labels_per_sample: int = 5,
    prototype_size: int = 12,
    keep_prob: float = 0.6,
    noise_features: tuple[int, int] = (5, 20),
    sample_seed: int | None = None,
) -> XCData:
    """Generate learnable multi-label data shaped like Amazon-670K (vectorised, deterministic).

    Labels have Zipf-like frequencies (ranks shuffled over the ids). Each label owns a sparse
    prototype of ``prototype_size`` features with positive weights. A point takes 1 to
    ``max_labels_per_sample`` labels (P(n) proportional to 1/n), keeps each prototype feature of
    each of its labels with probability ``keep_prob``, adds noise features drawn with Zipf-like
    popularity, and gets tf-idf-like positive values, L2-normalised per row.

    The label structure (frequencies, prototypes) depends on ``seed`` only; the points drawn
    depend on ``sample_seed`` (default: ``seed``). So two calls with the same ``seed`` and
    different ``sample_seed`` give a train and a test set from the same distribution.

    Args:
        num_samples: number of points.
        num_features: size of the feature space.
        num_labels: number of labels.
        seed: seed of the label structure (and of the points unless ``sample_seed`` is given).
        label_zipf: exponent ``a`` of the label frequency law ``p(rank) ~ 1 / (rank + c) ** a``
            (ranks from 1).
        label_zipf_offset: offset ``c`` of that law; larger flattens the head.
        max_labels_per_sample: most labels per point (at least 1).
        prototype_size: features per label prototype.
        keep_prob: probability that a point keeps each prototype feature of its labels.
        noise_features: ``(low, high)`` inclusive range of noise features per point.
        sample_seed: seed of the points; ``None`` means ``seed``.
    """
    if num_samples < 0 or num_features <= 0 or num_labels <= 0:
        raise ValueError(
            f"make_synthetic: need num_samples >= 0 and positive num_features/num_labels, got "
            f"{num_samples}, {num_features}, {num_labels}."
        )
    if (
        max_labels_per_sample < 1
        or not 0.0 < keep_prob <= 1.0
        or not 0 <= noise_features[0] <= noise_features[1]
    ):
        raise ValueError(
            "make_synthetic: need max_labels_per_sample >= 1, 0 < keep_prob <= 1 and 0 <= low <= high "
            f"for noise_features, got {max_labels_per_sample}, {keep_prob}, {noise_features}."
        )
    structure = np.random.default_rng([seed, 0])
    label_p = _zipf_probabilities(structure, num_labels, label_zipf, label_zipf_offset)
    feature_p = _zipf_probabilities(structure, num_features, 1.0, 1.0)
    prototypes = structure.integers(0, num_features, size=(num_labels, prototype_size), dtype=np.int64)
    prototype_weights = structure.uniform(1.0, 3.0, size=(num_labels, prototype_size)).astype(np.float32)

    rng = np.random.default_rng([seed if sample_seed is None else sample_seed, 1])
    # Labels: n ~ P(n) proportional to 1/n, drawn from the Zipf law, duplicates within a point dropped.
    n_probs = 1.0 / np.arange(1, max_labels_per_sample + 1)
    n_labels = rng.choice(
        np.arange(1, max_labels_per_sample + 1), size=num_samples, p=n_probs / n_probs.sum()
    )
    label_rows = np.repeat(np.arange(num_samples, dtype=np.int64), n_labels)
    label_ids = _sample(rng, label_p, len(label_rows))
    label_rows, label_ids, _ = _dedup_sorted(
        label_rows, label_ids, np.zeros(len(label_ids), np.float32), num_labels
    )

    # Features: kept prototype features of each label, plus noise features.
    proto_rows = np.repeat(label_rows, prototype_size)
    proto_ids = prototypes[label_ids].ravel()
    proto_vals = prototype_weights[label_ids].ravel() * rng.lognormal(0.0, 0.3, size=len(proto_ids))
    keep = rng.random(len(proto_ids)) < keep_prob
    n_noise = rng.integers(noise_features[0], noise_features[1] + 1, size=num_samples)
    noise_rows = np.repeat(np.arange(num_samples, dtype=np.int64), n_noise)
    noise_ids = _sample(rng, feature_p, len(noise_rows))
    noise_vals = rng.uniform(0.2, 1.0, size=len(noise_rows))
    rows = np.concatenate([proto_rows[keep], noise_rows])
    ids = np.concatenate([proto_ids[keep], noise_ids])
    vals = np.concatenate([proto_vals[keep], noise_vals]).astype(np.float32)
    rows, ids, vals = _dedup_sorted(rows, ids, vals, num_features)
    norms = np.sqrt(np.bincount(rows, weights=vals.astype(np.float64) ** 2, minlength=num_samples))
    vals = (vals / np.maximum(norms[rows], 1e-12)).astype(np.float32)

    return XCData(
        _indptr(np.bincount(label_rows, minlength=num_samples)),
        label_ids.astype(np.int32),
        _indptr(np.bincount(rows, minlength=num_samples)),
        ids.astype(np.int32),
        vals,
        num_features,
        num_labels,
    )


def _zipf_probabilities(rng: np.random.Generator, n: int, exponent: float, offset: float) -> np.ndarray:
    """Zipf-Mandelbrot probabilities ``1 / (rank + offset) ** exponent`` over ``n`` ids, ranks shuffled."""
    p = 1.0 / (np.arange(1, n + 1, dtype=np.float64) + offset) ** exponent
    return (p / p.sum())[rng.permutation(n)]


def _sample(rng: np.random.Generator, p: np.ndarray, size: int) -> np.ndarray:
    """``size`` ids drawn with probabilities ``p`` (inverse CDF, vectorised)."""
    cdf = np.cumsum(p)
    return np.minimum(np.searchsorted(cdf, rng.random(size) * cdf[-1], side="right"), len(p) - 1)


def _dedup_sorted(
    rows: np.ndarray, ids: np.ndarray, vals: np.ndarray, num_ids: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sort entries by (row, id) and merge duplicates, summing their values."""
    keys, inverse = np.unique(rows * num_ids + ids, return_inverse=True)
    summed = np.bincount(inverse, weights=vals, minlength=len(keys)).astype(np.float32)
    return keys // num_ids, keys % num_ids, summed


# ---------------------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------------------


class XCDataset(Dataset):
    """A map-style dataset over ``XCData``: item ``i`` is ``(labels, feature_ids, feature_values)``."""

    def __init__(self, data: XCData) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.data.row(i)


def collate_sparse(
    batch: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch points for ``SparseInputLinear``: ``(indices, offsets, values, labels)``.

    ``indices``/``values`` are all points' features concatenated, ``offsets[b]`` is where point
    ``b`` starts; ``labels`` is ``[B, Ymax]`` padded with ``-1`` (``Ymax >= 1``).
    """
    labels, ids, vals = zip(*batch, strict=True)
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    offsets = np.zeros(len(ids), dtype=np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    label_lengths = np.fromiter((len(y) for y in labels), dtype=np.int64, count=len(labels))
    padded = np.full((len(labels), max(1, int(label_lengths.max(initial=0)))), -1, dtype=np.int64)
    mask = np.arange(padded.shape[1]) < label_lengths[:, None]
    padded[mask] = np.concatenate(labels) if len(labels) else []
    return (
        torch.from_numpy(np.concatenate(ids).astype(np.int64)),
        torch.from_numpy(offsets),
        torch.from_numpy(np.concatenate(vals).astype(np.float32)),
        torch.from_numpy(padded),
    )


# ---------------------------------------------------------------------------------------------
# LightningDataModule
# ---------------------------------------------------------------------------------------------


class XCDataModule(L.LightningDataModule):
    """Extreme classification data: real files from ``data_dir`` or Amazon-670K-shaped synthetic data.

    With ``data_dir``, reads ``train_file`` and ``test_file`` in the Extreme Classification
    Repository format (the Amazon-670K BoW download unpacks to ``train.txt`` and ``test.txt``);
    ``num_features``/``num_labels`` then come from the files' headers. The test file is also the
    validation set (the repository has no separate one). Without ``data_dir``, generates
    ``synthetic_samples`` training and ``synthetic_test_samples`` test points from one distribution.

    Args:
        data_dir: folder with the repository files; ``None`` for synthetic data.
        synthetic_samples: number of synthetic training points.
        synthetic_test_samples: number of synthetic test (and validation) points.
        num_features: feature-space size; ``None`` means the file header, or 135,909 (Amazon-670K)
            for synthetic data. If given with ``data_dir`` it must match the header.
        num_labels: number of labels; ``None`` means the file header, or 670,091 (Amazon-670K).
        batch_size: points per batch.
        num_workers: DataLoader worker processes.
        seed: seed of the synthetic data (structure and points).
        train_file: training file name inside ``data_dir``.
        test_file: test file name inside ``data_dir``.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        synthetic_samples: int = 100_000,
        synthetic_test_samples: int = 10_000,
        num_features: int | None = None,
        num_labels: int | None = None,
        batch_size: int = 256,
        num_workers: int = 0,
        seed: int = 0,
        train_file: str = "train.txt",
        test_file: str = "test.txt",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.data_dir = data_dir
        self.synthetic_samples = synthetic_samples
        self.synthetic_test_samples = synthetic_test_samples
        self._num_features = num_features
        self._num_labels = num_labels
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.train_file = train_file
        self.test_file = test_file
        self.train_data: XCData | None = None
        self.test_data: XCData | None = None
        self._shape: tuple[int, int] | None = None

    @property
    def num_features(self) -> int:
        """Feature-space size (from the files' header when reading real data)."""
        return self._resolve_shape()[0]

    @property
    def num_labels(self) -> int:
        """Number of labels (from the files' header when reading real data)."""
        return self._resolve_shape()[1]

    def _resolve_shape(self) -> tuple[int, int]:
        if self._shape is None:
            if self.data_dir is None:
                self._shape = (
                    self._num_features or AMAZON670K_FEATURES,
                    self._num_labels or AMAZON670K_LABELS,
                )
            else:
                headers = {
                    name: read_header(self._path(name))[1:] for name in (self.train_file, self.test_file)
                }
                if len(set(headers.values())) != 1:
                    raise ValueError(
                        f"XCDataModule: the files disagree on (num_features, num_labels): {headers}."
                    )
                shape = headers[self.train_file]
                for given, found, what in zip(
                    (self._num_features, self._num_labels), shape, ("features", "labels"), strict=True
                ):
                    if given is not None and given != found:
                        raise ValueError(
                            f"XCDataModule: num_{what}={given} but the files in {self.data_dir} have {found}; "
                            f"leave num_{what} unset to take it from the files."
                        )
                self._shape = shape
        return self._shape

    def _path(self, name: str) -> str:
        path = os.path.join(self.data_dir, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"XCDataModule: {path} not found. Put the Extreme Classification Repository files there "
                "(train.txt/test.txt for Amazon-670K) or set train_file/test_file, or set data_dir to null "
                "for synthetic data."
            )
        return path

    def setup(self, stage: str | None = None) -> None:
        if self.train_data is not None:
            return
        num_features, num_labels = self._resolve_shape()
        if self.data_dir is None:
            common = {"num_features": num_features, "num_labels": num_labels, "seed": self.seed}
            self.train_data = make_synthetic(self.synthetic_samples, sample_seed=2 * self.seed, **common)
            self.test_data = make_synthetic(
                self.synthetic_test_samples, sample_seed=2 * self.seed + 1, **common
            )
        else:
            self.train_data = read_xc_file(self._path(self.train_file))
            self.test_data = read_xc_file(self._path(self.test_file))

    def _loader(self, data: XCData, shuffle: bool) -> DataLoader:
        return DataLoader(
            XCDataset(data),
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            collate_fn=collate_sparse,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        # The repository's files are sorted by label: shuffling is required, not optional.
        return self._loader(self.train_data, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.test_data, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_data, shuffle=False)


def popularity_p_at_1(train: XCData, test: XCData) -> float:
    """P@1 on ``test`` of always predicting the most frequent label of ``train`` (chance level)."""
    top = int(np.argmax(np.bincount(train.labels, minlength=train.num_labels)))
    rows = np.repeat(np.arange(len(test)), np.diff(test.label_indptr))
    return float(np.unique(rows[test.labels == top]).size / max(1, len(test)))
