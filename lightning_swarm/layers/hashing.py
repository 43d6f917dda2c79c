"""Locality-sensitive hash families for the SLIDE active-set selection.

A hash family maps vectors (weight rows of a wide layer, or the layer's input
activations) to ``num_tables`` integer bucket codes of ``num_bits`` bits each.
Vectors that are close (in angle for SimHash, in the ranking of their
coordinates for DWTA) land in the same bucket of a table more often than
unrelated ones, which is what lets :class:`~lightning_swarm.layers.SparseLSHLinear`
find the neurons likely to fire without computing all of them.

Both families are pure functions of ``(dim, num_bits, num_tables, seed)``:
every process that builds one with the same arguments gets the same hash
functions, which is what lets a D-SLIDE shard hash its own rows into tables
compatible with every other shard's.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_ROW_CHUNK = 32768  # rows hashed at once: bounds the temporaries of a table rebuild


def _check_common(name: str, dim: int, num_bits: int, num_tables: int) -> None:
    if dim <= 0:
        raise ValueError(f"{name}: dim must be positive, got {dim}.")
    if not 1 <= num_bits <= 30:
        raise ValueError(f"{name}: num_bits must be in [1, 30] (bits of one bucket code), got {num_bits}.")
    if num_tables <= 0:
        raise ValueError(f"{name}: num_tables must be positive, got {num_tables}.")


def _check_input(name: str, x: Tensor, dim: int) -> None:
    if x.dim() != 2 or x.size(1) != dim:
        raise ValueError(f"{name}.codes expects a [N, {dim}] tensor, got shape {tuple(x.shape)}.")


class BucketHash:
    """What every hash family shares: ``num_tables`` codes of ``num_bits`` bits for each row of ``[N, dim]``
    inputs, hashed ``_ROW_CHUNK`` rows at a time (a family defines ``_chunk_codes``)."""

    dim: int
    num_bits: int
    num_tables: int

    @property
    def code_space(self) -> int:
        """Number of distinct bucket codes of one table."""
        return 1 << self.num_bits

    @torch.no_grad()
    def codes(self, x: Tensor) -> Tensor:
        """Bucket codes of the rows of ``x``.

        Args:
            x: ``[N, dim]`` float tensor.

        Returns:
            ``[N, num_tables]`` int64 codes in ``[0, 2**num_bits)``.
        """
        _check_input(type(self).__name__, x, self.dim)
        out = torch.empty(x.size(0), self.num_tables, dtype=torch.long)
        for lo in range(0, x.size(0), _ROW_CHUNK):
            out[lo : lo + _ROW_CHUNK] = self._chunk_codes(x[lo : lo + _ROW_CHUNK])
        return out

    def _chunk_codes(self, chunk: Tensor) -> Tensor:
        raise NotImplementedError


class SimHash(BucketHash):
    """Signed random projections: bit ``j`` of a code is ``sign(<x, r_j>)``.

    For two vectors at angle ``theta`` one bit collides with probability
    ``1 - theta / pi``. All ``num_tables * num_bits`` projections are one matmul.

    Args:
        dim: length of the hashed vectors.
        num_bits: bits per bucket code (``K``); a table has ``2**K`` buckets.
        num_tables: number of independent tables (``L``).
        seed: seed of the random projections; equal seeds give equal hash functions.
    """

    def __init__(self, dim: int, num_bits: int, num_tables: int, seed: int = 0) -> None:
        _check_common("SimHash", dim, num_bits, num_tables)
        self.dim, self.num_bits, self.num_tables, self.seed = dim, num_bits, num_tables, seed
        gen = torch.Generator().manual_seed(seed)
        self.projections = torch.randn(dim, num_tables * num_bits, generator=gen)
        # Powers of two as float: the packed code is exact in float32 for num_bits <= 24,
        # in float64 above that.
        self._dtype = torch.float32 if num_bits <= 24 else torch.float64
        self._powers = (2.0 ** torch.arange(num_bits, dtype=torch.float64)).to(self._dtype)

    def _chunk_codes(self, chunk: Tensor) -> Tensor:
        bits = (chunk @ self.projections.to(chunk.dtype) > 0).to(self._dtype)
        return (bits.view(-1, self.num_tables, self.num_bits) @ self._powers).long()


class DWTAHash(BucketHash):
    """Densified winner-take-all hashing (Chen & Shrivastava, 2018), as used by SLIDE.

    Each table draws ``num_bits / log2(bin_size)`` bins of ``bin_size`` coordinates from
    random permutations of ``range(dim)``; a bin hashes to the position of its largest
    coordinate and the table's code packs the bins. Similar vectors agree on which
    coordinate wins more often, so collisions increase with similarity. A bin whose
    coordinates are all zero (sparse or ReLU inputs) is *empty* and borrows the value of
    another bin along a fixed random probe sequence (densification).

    Args:
        dim: length of the hashed vectors.
        num_bits: bits per bucket code; must be a multiple of ``log2(bin_size)``.
        num_tables: number of independent tables (``L``).
        seed: seed of the permutations; equal seeds give equal hash functions.
        bin_size: coordinates per bin, a power of two (default 8: 3 bits per bin).
        num_probes: densification attempts before an empty bin falls back to 0.
    """

    def __init__(
        self, dim: int, num_bits: int, num_tables: int, seed: int = 0, bin_size: int = 8, num_probes: int = 16
    ) -> None:
        _check_common("DWTAHash", dim, num_bits, num_tables)
        if bin_size < 2 or bin_size & (bin_size - 1):
            raise ValueError(f"DWTAHash: bin_size must be a power of two >= 2, got {bin_size}.")
        bits_per_bin = int(math.log2(bin_size))
        if num_bits % bits_per_bin:
            raise ValueError(
                f"DWTAHash: num_bits={num_bits} must be a multiple of log2(bin_size)={bits_per_bin}; "
                f"use e.g. num_bits={max(bits_per_bin, num_bits - num_bits % bits_per_bin)}."
            )
        self.dim, self.num_bits, self.num_tables, self.seed = dim, num_bits, num_tables, seed
        self.bin_size, self.bits_per_bin = bin_size, bits_per_bin
        self.bins_per_table = num_bits // bits_per_bin
        total_bins = num_tables * self.bins_per_table
        gen = torch.Generator().manual_seed(seed)
        need = total_bins * bin_size
        perms = [torch.randperm(dim, generator=gen) for _ in range(-(-need // dim))]
        self.bin_coords = torch.cat(perms)[:need].view(total_bins, bin_size)
        # probes[j, a]: the bin an empty bin j borrows from at attempt a (never itself).
        shift = torch.randint(1, max(total_bins, 2), (total_bins, num_probes), generator=gen)
        self.probes = (torch.arange(total_bins).unsqueeze(1) + shift) % total_bins
        self._shifts = (bits_per_bin * torch.arange(self.bins_per_table)).view(1, 1, -1)

    def _chunk_codes(self, chunk: Tensor) -> Tensor:
        vals = chunk[:, self.bin_coords]  # [n, bins, bin_size]
        winner = vals.argmax(dim=2)  # [n, bins]
        empty = (vals == 0).all(dim=2)
        for attempt in range(self.probes.size(1)):
            if not bool(empty.any()):
                break
            src = self.probes[:, attempt]
            winner = torch.where(empty, winner[:, src], winner)
            empty = empty & empty[:, src]
        winner = winner.masked_fill(empty, 0).view(-1, self.num_tables, self.bins_per_table)
        return (winner << self._shifts).sum(dim=2)


def make_hash(family: str, dim: int, num_bits: int, num_tables: int, seed: int) -> BucketHash:
    """Build a hash family by name (``"simhash"`` or ``"dwta"``)."""
    if family == "simhash":
        return SimHash(dim, num_bits, num_tables, seed)
    if family == "dwta":
        return DWTAHash(dim, num_bits, num_tables, seed)
    raise ValueError(f"Unknown hash_family {family!r}; choose 'simhash' or 'dwta'.")
