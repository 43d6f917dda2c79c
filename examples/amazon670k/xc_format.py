"""The Extreme Classification Repository's file format: reading it fast, writing it, and the in-memory CSR data.

File format (BoW features, 0-based ids)::

    num_points num_features num_labels
    l1,l2,... f:v f:v ...
     f:v f:v ...            <- a point with no labels starts with a space (or directly with f:v)

:func:`read_xc_file` parses whole blocks with numpy (``_read_xc_file_by_lines`` is the plain line-by-line parser it
is measured against, in ``benchmarks/sparse_vs_dense.py``); :class:`XCData` holds the points as two CSR structures.
"""

from __future__ import annotations

import os
import warnings
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

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
