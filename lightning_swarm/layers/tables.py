"""CSR hash tables of the neurons of a wide layer, and the deterministic per-neuron noise.

A table stores the neuron ids sorted by their bucket code (one argsort), so a bucket is a
contiguous slice ``[offsets[code], offsets[code + 1])``; the offsets come from a bincount
and a cumsum when all tables' code spaces together hold up to ``2**22`` codes and from a binary search over the sorted codes
above that. All tables live in one flat array, table ``t`` at ``[t * n, (t + 1) * n)``.
Inside a bucket neurons are ordered by a per-neuron pseudo-random key, so a bucket cap
keeps a random subset rather than the lowest ids. Building and querying are vectorised:
no Python loop over neurons, buckets or queries.
"""

from __future__ import annotations

import torch
from torch import Tensor

_DENSE_OFFSETS_MAX = 1 << 22  # L * 2**K up to this gets a dense offsets array (<= 32 MB)

# splitmix64 constants as signed int64 (torch integer arithmetic wraps around).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(x: Tensor) -> Tensor:
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def pseudo_uniform(ids: Tensor, *salt: int) -> Tensor:
    """Deterministic noise in ``[0, 1)`` (float64) for each id, keyed by integer ``salt``.

    The same ``(salt, id)`` gives the same value in every process, whatever other ids are
    hashed alongside: this is what makes tie-breaks and bucket orders decompose across
    D-SLIDE shards.
    """
    key = torch.zeros((), dtype=torch.long)
    for s in salt:
        key = _splitmix(key ^ int(s))
    h = _splitmix(ids.long() ^ key)
    return _shr(h, 11).double() * (1.0 / (1 << 53))


class LSHTables:
    """``num_tables`` CSR hash tables over ``n`` neurons.

    Args:
        num_tables: number of tables (``L``).
        code_space: number of distinct bucket codes per table (``2**K``).
    """

    def __init__(self, num_tables: int, code_space: int) -> None:
        if num_tables <= 0 or code_space <= 0:
            raise ValueError(
                f"LSHTables: num_tables and code_space must be positive, got {num_tables}, {code_space}."
            )
        self.num_tables, self.code_space = num_tables, code_space
        self.num_neurons = 0
        self.neurons = torch.empty(0, dtype=torch.long)  # [L * n]: ids sorted by (table, code, key)
        self.offsets: Tensor | None = None  # [L * code_space + 1] when the code space is small
        self.sorted_keys: Tensor | None = None  # [L * n] table * code_space + code, otherwise

    @torch.no_grad()
    def build(self, codes: Tensor, order_key: Tensor | None = None) -> None:
        """(Re)build all tables.

        Args:
            codes: ``[n, num_tables]`` int64 bucket codes of the ``n`` neurons (local ids ``0..n-1``).
            order_key: ``[n]`` key that orders neurons inside a bucket (ascending); a bucket
                cap keeps the first ones. ``None`` orders by id.
        """
        if codes.dim() != 2 or codes.size(1) != self.num_tables:
            raise ValueError(
                f"LSHTables.build expects codes [n, {self.num_tables}], got {tuple(codes.shape)}."
            )
        n = codes.size(0)
        perm = order_key.argsort() if order_key is not None else torch.arange(n)
        table_base = torch.arange(self.num_tables).unsqueeze(1) * self.code_space
        keys = codes.index_select(0, perm).t() + table_base  # [L, n], neurons in key order
        if self.num_tables * self.code_space < 1 << 31:
            keys = keys.int()  # int32 sorts faster
        sorted_keys, idx = keys.reshape(-1).sort(stable=True)
        sorted_keys = sorted_keys.long()
        self.neurons = perm.repeat(self.num_tables).index_select(0, idx)
        self.num_neurons = n
        if self.num_tables * self.code_space <= _DENSE_OFFSETS_MAX:
            counts = torch.bincount(sorted_keys, minlength=self.num_tables * self.code_space)
            self.offsets = torch.zeros(counts.numel() + 1, dtype=torch.long)
            torch.cumsum(counts, 0, out=self.offsets[1:])
            self.sorted_keys = None
        else:
            self.offsets = None
            self.sorted_keys = sorted_keys

    def table(self, t: int) -> Tensor:
        """Neuron ids of table ``t`` in bucket order (a permutation of ``0..n-1``)."""
        return self.neurons[t * self.num_neurons : (t + 1) * self.num_neurons]

    def bucket_bounds(self, tables: Tensor, codes: Tensor) -> tuple[Tensor, Tensor]:
        """Flat ``[start, end)`` positions in :attr:`neurons` of the buckets ``(tables[i], codes[i])``."""
        keys = tables.long() * self.code_space + codes.long()
        if self.offsets is not None:
            return self.offsets[keys], self.offsets[keys + 1]
        assert self.sorted_keys is not None, "LSHTables: build() must run before queries."
        return (
            torch.searchsorted(self.sorted_keys, keys, right=False),
            torch.searchsorted(self.sorted_keys, keys, right=True),
        )

    def lookup(self, tables: Tensor, codes: Tensor, cap: int | None = None) -> tuple[Tensor, Tensor]:
        """Members of the buckets ``(tables[i], codes[i])``, each bucket cut to ``cap`` neurons.

        Args:
            tables: ``[Q]`` table index of each query.
            codes: ``[Q]`` bucket code of each query.
            cap: keep at most this many neurons of each bucket (``None``: all).

        Returns:
            ``(query, neuron)``: two ``[M]`` int64 tensors; ``neuron[j]`` is in bucket ``query[j]``.
        """
        if self.num_neurons == 0:
            empty = torch.empty(0, dtype=torch.long)
            return empty, empty
        start, end = self.bucket_bounds(tables, codes)
        size = end - start
        if cap is not None:
            size = size.clamp_(max=cap)
        query = torch.repeat_interleave(torch.arange(size.numel()), size)
        first = torch.cumsum(size, 0) - size
        pos = start.index_select(0, query) + torch.arange(query.numel()) - first.index_select(0, query)
        return query, self.neurons.index_select(0, pos)
