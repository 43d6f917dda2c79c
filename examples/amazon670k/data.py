"""Data for extreme classification: the Extreme Classification Repository format, an
Amazon-670K-shaped synthetic generator, and the LightningDataModule that feeds both.

File format (Extreme Classification Repository, BoW features, 0-based ids)::

    num_points num_features num_labels
    l1,l2,... f:v f:v ...
     f:v f:v ...            <- a point with no labels starts with a space (or directly with f:v)

Files are sorted by label, so the training loader shuffles.
"""

from __future__ import annotations

import os
import warnings
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

AMAZON670K_FEATURES = 135_909
AMAZON670K_LABELS = 670_091

_FORMAT_HINT = "expected 'l1,l2,... f:v f:v ...' with 0-based ids (Extreme Classification Repository format)"


# ---------------------------------------------------------------------------------------------
# In-memory data: CSR arrays
# ---------------------------------------------------------------------------------------------


@dataclass
class XCData:
    """A multi-label sparse data set held as two CSR structures (labels and features).

    Row ``i`` has labels ``labels[label_indptr[i]:label_indptr[i+1]]`` and features
    ``feature_ids[feature_indptr[i]:feature_indptr[i+1]]`` with values ``feature_values[...]``.
    """

    label_indptr: np.ndarray  # int64 [N + 1]
    labels: np.ndarray  # int32 [nnz_labels]
    feature_indptr: np.ndarray  # int64 [N + 1]
    feature_ids: np.ndarray  # int32 [nnz_features]
    feature_values: np.ndarray  # float32 [nnz_features]
    num_features: int
    num_labels: int

    def __len__(self) -> int:
        return len(self.label_indptr) - 1

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Labels, feature ids and feature values of point ``i``."""
        l0, l1 = self.label_indptr[i], self.label_indptr[i + 1]
        f0, f1 = self.feature_indptr[i], self.feature_indptr[i + 1]
        return self.labels[l0:l1], self.feature_ids[f0:f1], self.feature_values[f0:f1]

    def select(self, rows: np.ndarray | slice) -> XCData:
        """A new ``XCData`` with the given rows (an index array or a slice), in that order."""
        rows = np.arange(len(self))[rows] if isinstance(rows, slice) else np.asarray(rows, dtype=np.int64)
        label_indptr, label_take = _gather_csr(self.label_indptr, rows)
        feature_indptr, feature_take = _gather_csr(self.feature_indptr, rows)
        return XCData(
            label_indptr,
            self.labels[label_take],
            feature_indptr,
            self.feature_ids[feature_take],
            self.feature_values[feature_take],
            self.num_features,
            self.num_labels,
        )


def _gather_csr(indptr: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """New indptr for ``rows`` and the flat positions of their entries (vectorised)."""
    lengths = indptr[rows + 1] - indptr[rows]
    new_indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_indptr[1:])
    # position of each output entry = start of its row + offset inside the row
    starts = np.repeat(indptr[rows] - new_indptr[:-1], lengths)
    return new_indptr, starts + np.arange(new_indptr[-1], dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# Reading and writing the repository format
# ---------------------------------------------------------------------------------------------


def read_header(path: str | os.PathLike) -> tuple[int, int, int]:
    """Read and validate the header line ``num_points num_features num_labels`` of a file."""
    with open(path, encoding="utf-8") as f:
        return _parse_header(path, f.readline())


def _parse_header(path: str | os.PathLike, line: str) -> tuple[int, int, int]:
    parts = line.split()
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(
            f"{path}:1: bad header {line.strip()!r}; expected three non-negative integers "
            "'num_points num_features num_labels'."
        )
    num_points, num_features, num_labels = (int(p) for p in parts)
    if num_features == 0 or num_labels == 0:
        raise ValueError(f"{path}:1: bad header {line.strip()!r}; num_features and num_labels must be > 0.")
    return num_points, num_features, num_labels


def iter_xc_file(path: str | os.PathLike) -> Iterator[tuple[list[int], list[int], list[float]]]:
    """Stream ``(labels, feature_ids, feature_values)`` for each point of a repository-format file.

    Every line is validated (syntax, ids in the header's ranges) and the number of points must
    match the header. A malformed line raises ``ValueError`` naming the file and line number.

    Args:
        path: the file, e.g. ``train.txt`` of Amazon-670K.
    """
    with open(path, encoding="utf-8") as f:
        num_points, num_features, num_labels = _parse_header(path, f.readline())
        count = 0
        for lineno, line in enumerate(f, start=2):
            count += 1
            if count > num_points:
                raise ValueError(
                    f"{path}:{lineno}: more points than the header's num_points={num_points}; "
                    "fix the header or remove the extra lines."
                )
            yield _parse_line(path, lineno, line, num_features, num_labels)
    if count != num_points:
        raise ValueError(
            f"{path}:{count + 2}: file ends after {count} points but the header says num_points={num_points}; "
            "the file is truncated or the header is wrong."
        )


def _parse_line(
    path: str | os.PathLike, lineno: int, line: str, num_features: int, num_labels: int
) -> tuple[list[int], list[int], list[float]]:
    def fail(what: str) -> ValueError:
        return ValueError(f"{path}:{lineno}: {what}; {_FORMAT_HINT}.")

    line = line.rstrip("\r\n")
    if not line.strip():
        raise fail("empty line")
    # The first field holds the labels unless it is already a feature (no labels on this point).
    if line[0].isspace():
        label_field, rest = "", line
    else:
        first, _, rest = line.partition(" ")
        if ":" in first:
            label_field, rest = "", line
        else:
            label_field = first
    try:
        labels = [int(t) for t in label_field.split(",")] if label_field else []
    except ValueError:
        raise fail(f"bad label list {label_field!r}") from None
    if labels and (min(labels) < 0 or max(labels) >= num_labels):
        bad = next(t for t in labels if not 0 <= t < num_labels)
        raise fail(f"label {bad} out of range [0, {num_labels})")

    tokens = rest.split()
    parts = rest.replace(":", " ").split()
    if rest.count(":") != len(tokens) or len(parts) != 2 * len(tokens):
        bad = next((t for t in tokens if t.count(":") != 1 or t.startswith(":") or t.endswith(":")), rest)
        raise fail(f"bad feature {bad!r}, expected 'f:v'")
    try:
        feat_ids = [int(t) for t in parts[0::2]]
        feat_vals = [float(t) for t in parts[1::2]]
    except ValueError:
        bad = next(t for t in tokens if not _is_feature(t))
        raise fail(f"bad feature {bad!r}, expected 'f:v' with an integer id and a number") from None
    if feat_ids and (min(feat_ids) < 0 or max(feat_ids) >= num_features):
        bad = next(t for t in feat_ids if not 0 <= t < num_features)
        raise fail(f"feature {bad} out of range [0, {num_features})")
    return labels, feat_ids, feat_vals


def _is_feature(token: str) -> bool:
    f, _, v = token.partition(":")
    try:
        int(f)
        float(v)
    except ValueError:
        return False
    return True


def read_xc_file(path: str | os.PathLike) -> XCData:
    """Read a whole repository-format file into CSR arrays (validated like ``iter_xc_file``).

    The file is parsed with vectorised numpy, 256 KB at a time (``reader_lines_per_s`` of
    ``benchmarks/sparse_vs_dense.py`` measures it against the line-by-line parser). A block the vectorised grammar
    does not cover (a malformed line, or a valid one with unusual syntax such as ``+5``, ``1_0`` or tabs) makes
    the reader fall back to the line-by-line parser, which gives the same result or the same error naming the
    file and line.

    Args:
        path: the file to read.
    """
    with open(path, "rb") as f:
        header = f.readline()
        try:
            num_points, num_features, num_labels = _parse_header(path, header.decode("utf-8"))
        except UnicodeDecodeError:
            num_points = num_features = num_labels = -1
        parts: list[_Parsed] = []
        lines = 0
        ok = num_points >= 0
        carry = b""
        while ok:
            block = f.read(_READ_BLOCK)
            if not block:
                break
            block = carry + block
            cut = block.rfind(b"\n") + 1
            if cut == 0:
                carry = block
                continue
            carry = block[cut:]
            parsed = _parse_lines(block[:cut], num_features, num_labels)
            ok = parsed is not None
            if ok:
                parts.append(parsed)
                lines += parsed.num_lines
        if ok and carry:
            parsed = _parse_lines(carry + b"\n", num_features, num_labels)
            ok = parsed is not None
            if ok:
                parts.append(parsed)
                lines += parsed.num_lines
    if not ok or lines != num_points:
        return _read_xc_file_by_lines(path)
    return XCData(
        _indptr(np.concatenate([p.label_lengths for p in parts]) if parts else np.zeros(0, np.int64)),
        np.concatenate([p.labels for p in parts] or [np.zeros(0, np.int32)]),
        _indptr(np.concatenate([p.feature_lengths for p in parts]) if parts else np.zeros(0, np.int64)),
        np.concatenate([p.feature_ids for p in parts] or [np.zeros(0, np.int32)]),
        np.concatenate([p.feature_values for p in parts] or [np.zeros(0, np.float32)]),
        num_features,
        num_labels,
    )


def _read_xc_file_by_lines(path: str | os.PathLike) -> XCData:
    """The line-by-line reader: plain Python, exact error messages (used when the fast path gives up)."""
    _, num_features, num_labels = read_header(path)
    label_lengths, labels = array("q"), array("i")
    feature_lengths, feature_ids, feature_values = array("q"), array("i"), array("f")
    for point_labels, ids, vals in iter_xc_file(path):
        label_lengths.append(len(point_labels))
        labels.extend(point_labels)
        feature_lengths.append(len(ids))
        feature_ids.extend(ids)
        feature_values.extend(vals)
    return XCData(
        _indptr(np.frombuffer(label_lengths, dtype=np.int64)),
        np.frombuffer(labels, dtype=np.int32).copy(),
        _indptr(np.frombuffer(feature_lengths, dtype=np.int64)),
        np.frombuffer(feature_ids, dtype=np.int32).copy(),
        np.frombuffer(feature_values, dtype=np.float32).copy(),
        num_features,
        num_labels,
    )


_READ_BLOCK = 256 << 10  # bytes parsed at once: small enough for the temporaries to stay in cache
_SPACE, _NEWLINE, _COMMA, _COLON = ord(" "), ord("\n"), ord(","), ord(":")


_POW10 = 10.0 ** np.arange(23)  # exact in float64


def _numbers(a: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """float64 value of every token ``a[starts[i]:ends[i]]`` and whether it is digits only; ``None`` if one is
    not a number (tabs and other characters are not separators here, so they make a token that is not one).

    Plain tokens (``digits[.digits]`` with at most 15 digits: all ids and nearly all values) are parsed with array
    arithmetic over their characters: the digits form an integer ``M < 10**15`` (exact in float64) and the value is
    ``M / 10**F`` for ``F`` digits after the point, one correctly rounded division, as ``float()`` gives. Other
    tokens (signs, exponents, long mantissas) go through numpy's parser, which rounds like ``float()`` too.
    """
    lengths = ends - starts
    inside = np.zeros(len(a) + 1, dtype=np.int8)
    inside[starts] += 1
    inside[ends] -= 1
    pos = np.flatnonzero(np.cumsum(inside[:-1], dtype=np.int8))  # positions of token characters, in order
    d = a[pos] - np.uint8(48)
    digit = d < 10
    dot = d == np.uint8(ord(".") + 256 - 48)
    first = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # index in `pos` of each token's first character
    digits_before = np.concatenate([[0], np.cumsum(digit, dtype=np.int32)])
    num_digits = digits_before[first + lengths] - digits_before[first]
    num_dots = np.add.reduceat(dot, first, dtype=np.int32) if len(first) else np.zeros(0, np.int32)
    plain = (num_digits + num_dots == lengths) & (num_dots <= 1) & (num_digits >= 1) & (num_digits <= 15)
    token_end = np.repeat(first + lengths, lengths)
    right = digits_before[token_end] - digits_before[1:][: len(pos)]  # digits right of each character
    weighted = np.where(digit, d, 0) * _POW10[np.minimum(right, 22)]
    mantissa = np.add.reduceat(weighted, first) if len(first) else np.zeros(0)
    frac = np.zeros(len(lengths), dtype=np.int64)
    dot_at = np.flatnonzero(dot)
    frac[np.searchsorted(first, dot_at, side="right") - 1] = right[dot_at]
    values = mantissa / _POW10[np.minimum(frac, 22)]
    other = np.flatnonzero(~plain)
    if len(other):  # rare: parse these tokens, separated by spaces, with numpy's own parser
        text = b" ".join(a[starts[i] : ends[i]].tobytes() for i in other)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # numpy warns (here: raises) when a token is not one whole number
            try:
                parsed = np.fromstring(text, dtype=np.float64, sep=" ")
            except (ValueError, DeprecationWarning):
                return None
        if len(parsed) != len(other):
            return None
        values[other] = parsed
    return values, plain & (num_dots == 0)


@dataclass
class _Parsed:
    num_lines: int
    label_lengths: np.ndarray
    labels: np.ndarray
    feature_lengths: np.ndarray
    feature_ids: np.ndarray
    feature_values: np.ndarray


def _parse_lines(block: bytes, num_features: int, num_labels: int) -> _Parsed | None:
    """Parse whole lines (``block`` ends with a newline) with numpy.

    Returns ``None`` (the caller then reads the file line by line) if any line is outside the plain grammar
    ``[l(,l)*] (f:v)*``, with digit-only ids and numbers that numpy's parser reads whole, or has an id out of
    range. Numbers are parsed by numpy's C parser, which rounds like ``float()``.
    """
    a = np.frombuffer(block, dtype=np.uint8)
    carriage = np.flatnonzero(a == ord("\r"))
    if (a[carriage + 1] != _NEWLINE).any():  # '\r' only as in '\r\n'
        return None
    newline = np.flatnonzero(a == _NEWLINE)
    sep = (a == _SPACE) | (a == _COMMA) | (a == _COLON) | (a == _NEWLINE) | (a == ord("\r"))
    edges = np.diff(np.concatenate([[0], (~sep).view(np.int8), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    line = np.searchsorted(newline, starts)  # line of each token
    num_lines = len(newline)
    if len(starts) == 0 or (np.bincount(line, minlength=num_lines) == 0).any():
        return None  # a blank line
    prev = np.where(starts > 0, a[np.maximum(starts - 1, 0)], _NEWLINE)
    nxt = a[ends]
    is_value, is_id = prev == _COLON, nxt == _COLON
    is_label = ~is_value & ~is_id
    colon, comma = np.flatnonzero(a == _COLON), np.flatnonzero(a == _COMMA)
    around = np.concatenate([colon - 1, colon + 1, comma - 1, comma + 1])
    if (
        sep[around].any()  # ':' joins an id and a value, ',' two labels, with nothing in between
        or (is_value & is_id).any()
        or (is_id & (prev != _SPACE) & (prev != _NEWLINE)).any()  # a pair follows a space or opens the line
        or (is_value & (nxt != _SPACE) & (nxt != _NEWLINE) & (nxt != ord("\r"))).any()
        or (is_label & (prev != _NEWLINE) & (prev != _COMMA)).any()  # labels open the line
        or (ends - starts)[~is_value].max(initial=0) > 15  # ids below 10**15: exact as float64
    ):
        return None
    parsed = _numbers(a, starts, ends)
    if parsed is None:
        return None
    numbers, digits_only = parsed
    if not digits_only[~is_value].all():  # labels and feature ids are plain digits
        return None
    labels, ids = numbers[is_label].astype(np.int64), numbers[is_id].astype(np.int64)
    if (labels >= num_labels).any() or (ids >= num_features).any():
        return None
    return _Parsed(
        num_lines,
        np.bincount(line[is_label], minlength=num_lines).astype(np.int64),
        labels.astype(np.int32),
        np.bincount(line[is_id], minlength=num_lines).astype(np.int64),
        ids.astype(np.int32),
        numbers[is_value].astype(np.float32),
    )


def _indptr(lengths: np.ndarray) -> np.ndarray:
    indptr = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    return indptr


def write_xc_file(path: str | os.PathLike, data: XCData) -> None:
    """Write ``data`` in the repository format (float32 values round-trip exactly).

    Args:
        path: the file to write (overwritten).
        data: the points to write.
    """
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{len(data)} {data.num_features} {data.num_labels}\n")
        for i in range(len(data)):
            labels, ids, vals = data.row(i)
            feats = " ".join(f"{int(j)}:{float(v):.9g}" for j, v in zip(ids, vals, strict=True))
            f.write(",".join(str(int(y)) for y in labels) + " " + feats + "\n")


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
