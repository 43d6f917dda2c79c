"""How the wide layers initialise their weights: deterministically by blocks, and optionally born sharded.

A wide layer draws one integer from torch's global generator (its ``init_seed``) and fills its weight block by
block (a block is a fixed number of consecutive rows of the full matrix, each drawn from its own generator
seeded by ``(init_seed, block)``). So any contiguous range of rows can be initialised alone, with exactly the
values the full layer would have, without ever holding the full matrix: this is what lets a D-SLIDE rank create
only its shard of an 825M-parameter layer (:func:`sharded_init`) and still match a single-process run with the
same seed.

Free of Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_swarm.layers.tables import pseudo_uniform

if TYPE_CHECKING:
    from lightning_swarm.layers.distributed import ShardGroup

_BLOCK_ELEMENTS = (
    1 << 16
)  # elements drawn per generator (256 KB of float32): the most a shard draws in excess
_SALT_INIT = 5

_born_sharded: ShardGroup | None = None
_skip_init = False


@contextmanager
def sharded_init(shard_group: ShardGroup) -> Iterator[None]:
    """Inside this context, wide layers created whole (``SparseLSHLinear``, ``SparseInputLinear``) allocate and
    initialise only this rank's shard (contiguous output rows, resp. input features); ``make_sharded`` then wraps
    them without moving any weights. Every rank must create the same layers in the same order."""
    global _born_sharded
    previous, _born_sharded = _born_sharded, shard_group
    try:
        yield
    finally:
        _born_sharded = previous


def born_shard_group() -> ShardGroup | None:
    """The group of the enclosing :func:`sharded_init` (if it has more than one rank), else ``None``."""
    if _skip_init or _born_sharded is None or _born_sharded.world_size == 1:
        return None
    return _born_sharded


@contextmanager
def skip_init() -> Iterator[None]:
    """Layers created inside allocate (``torch.empty``: no page is touched) but neither initialise nor draw an
    ``init_seed``, nor are born sharded: for shells whose parameters are replaced right after."""
    global _skip_init
    previous, _skip_init = _skip_init, True
    try:
        yield
    finally:
        _skip_init = previous


def initialising() -> bool:
    """Whether a layer created now should draw its seed and initialise its parameters."""
    return not _skip_init


def draw_init_seed() -> int:
    """One draw from torch's global generator: the seed of a layer's blockwise initialisation."""
    return int(torch.randint(0, 2**62, (1,), device="cpu")[0])


@torch.no_grad()
def uniform_rows_(
    rows: Tensor,
    first_row: int,
    seed: int,
    salt: int,
    bound: float,
    first_col: int = 0,
    full_width: int | None = None,
) -> Tensor:
    """Fill ``rows`` (rows ``[first_row, first_row + len(rows))`` of a full matrix) with ``U(-bound, bound)``
    values that depend only on ``(seed, salt)`` and the global row index, never on which rows are filled together.

    Args:
        rows: a 2-D tensor (may be a strided view, e.g. the transpose of a column shard).
        first_row: global index of ``rows[0]``.
        seed: the layer's ``init_seed``.
        salt: distinguishes the tensors of one layer (weight, bias).
        bound: half-width of the uniform distribution.
        first_col: global index of ``rows[:, 0]`` when ``rows`` holds only columns
            ``[first_col, first_col + rows.size(1))`` of rows of ``full_width`` (the full rows are drawn one block at
            a time and cut: at most one block of full rows is held beyond ``rows``).
        full_width: width of the full matrix's rows (default ``rows.size(1)``).
    """
    n, cols = rows.shape
    width = cols if full_width is None else full_width
    if not 0 <= first_col <= width - cols:
        raise ValueError(f"uniform_rows_: columns [{first_col}, {first_col + cols}) do not fit in {width}.")
    per_block = max(1, _BLOCK_ELEMENTS // max(width, 1))
    last_row = first_row + n
    for block in range(first_row // per_block, math.ceil(last_row / per_block) if n else 0):
        lo, hi = block * per_block, (block + 1) * per_block
        key = pseudo_uniform(torch.tensor([block]), seed, salt, _SALT_INIT)[0]
        gen = torch.Generator().manual_seed(int(key * 2**62))
        take_lo, take_hi = max(lo, first_row), min(hi, last_row)
        # torch draws CPU uniforms in order, so the first rows of a block do not depend on how many follow.
        values = torch.rand(take_hi - lo, width, generator=gen).mul_(2 * bound).sub_(bound)
        rows[take_lo - first_row : take_hi - first_row].copy_(
            values[take_lo - lo : take_hi - lo, first_col : first_col + cols]
        )
    return rows
