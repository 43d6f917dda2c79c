"""SLIDE's wide layer: a linear layer that computes only an LSH-selected active set of neurons.

In training, :class:`SparseLSHLinear` returns logits for ``num_active`` neurons per sample
(the sample's labels first, then the neurons its input collides with in the hash tables,
then random fill) as a dense ``[B, k]`` tensor with their ids, so the work vectorises and
only the active rows of ``weight`` receive (row-sparse) gradients. In eval it returns the
exact or LSH-approximate top-k.

Active-set selection is a per-neuron priority followed by a top-k, which is what lets a
D-SLIDE shard owning the rows ``[lo, hi)`` compute exactly its part of the single-process
active set (see :meth:`SparseLSHLinear.candidate_priorities`):

- label of the row: ``2**40 + u``; LSH candidate: ``collisions + u``, where ``collisions``
  counts the (sample, table) pairs whose bucket holds the neuron; random fill: ``-1 - p``
  for position ``p`` in a fill sequence drawn from ``(seed, step)`` over all outputs;
- ``u = pseudo_uniform(seed, step, row, neuron)`` in ``[0, 1)`` breaks ties identically in
  every process; hash functions depend only on ``(seed, reseed count)``.

A shard's training step (``R = 1`` for a shared active set, ``B`` per sample)::

    shard = SparseLSHLinear(in_f, hi - lo, row_offset=lo, total_out=N, <same settings and seed>)
    shard.maybe_rebuild()                                  # same schedule on every shard
    ids, prio = top_priorities(*shard.candidate_priorities(x, labels), R, k)   # [R, k] each
    ids, prio = all_gather(ids), all_gather(prio)          # concatenated along dim 1
    rows = torch.arange(R).unsqueeze(1).expand_as(ids)
    active, _ = top_priorities(rows.flatten(), ids.flatten(), prio.flatten(), R, k)  # = single process
    # logits of the own part: shard.active_logits(x, active[:, mine]) ...; then
    shard.mark_active(active); shard.num_steps += 1

The result equals the single-process active set when ``bucket_cap`` is ``None`` (with a
cap, each shard caps its own part of a bucket, so shards see slightly more candidates).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lightning_swarm.layers.distributed import shard_range
from lightning_swarm.layers.hashing import BucketHash, make_hash
from lightning_swarm.layers.init import born_shard_group, draw_init_seed, initialising, uniform_rows_
from lightning_swarm.layers.tables import LSHTables, pseudo_uniform

_LABEL_PRIORITY = float(2**40)
_DEFAULT_ACTIVE = 4096  # 0.6% of Amazon-670K's outputs, chosen with benchmarks/sparse_vs_dense.py
_SALT_TIE, _SALT_FILL, _SALT_BUCKET, _SALT_HASH = 1, 2, 3, 4
_PERM_FILL_MAX = 1 << 16  # rows * outputs up to this: random fill is a permutation (exact, no repeats)


class _GatherRows(torch.autograd.Function):
    """``weight[ids]`` whose gradient is a ``sparse_coo`` tensor holding only the gathered rows."""

    @staticmethod
    def forward(ctx, weight: Tensor, ids: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.weight_shape = weight.shape
        return weight.index_select(0, ids)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (ids,) = ctx.saved_tensors
        sparse = torch.sparse_coo_tensor(
            ids.unsqueeze(0), grad.contiguous(), ctx.weight_shape, check_invariants=False
        )
        return sparse, None


def gather_rows(weight: Tensor, ids: Tensor) -> Tensor:
    """Rows ``ids`` (1-D) of ``weight`` with a row-sparse gradient (like ``nn.Embedding(sparse=True)``)."""
    return _GatherRows.apply(weight, ids)


def top_priorities(rows: Tensor, ids: Tensor, prio: Tensor, num_rows: int, k: int) -> tuple[Tensor, Tensor]:
    """Per row, the ``k`` distinct ids of highest priority, best first.

    Entries ``(rows[j], ids[j], prio[j])`` may repeat an id within a row (the highest
    priority counts); entries with priority ``-inf`` are ignored. Rows with fewer than ``k``
    distinct ids are padded with id ``-1`` and priority ``-inf``. Merging the outputs of
    several shards with this same function gives the top-k of their union.

    Returns:
        ``(ids [num_rows, k] int64, prio [num_rows, k] float64)``.
    """
    keep = prio > -math.inf
    rows, ids, prio = rows[keep], ids[keep], prio[keep]
    order = prio.argsort(descending=True, stable=True)
    rows, ids, prio = rows[order], ids[order], prio[order]
    # Drop repeated (row, id) pairs, keeping the first (highest priority) occurrence.
    key = rows * (int(ids.max()) + 1 if ids.numel() else 1) + ids
    sorted_key, perm = key.sort(stable=True)
    first = torch.ones_like(sorted_key, dtype=torch.bool)
    first[1:] = sorted_key[1:] != sorted_key[:-1]
    unique_pos = perm[first].sort().values
    rows, ids, prio = rows[unique_pos], ids[unique_pos], prio[unique_pos]
    if num_rows > 1:
        by_row = rows.sort(stable=True).indices
        rows, ids, prio = rows[by_row], ids[by_row], prio[by_row]
    counts = torch.bincount(rows, minlength=num_rows)
    rank = torch.arange(rows.numel()) - (torch.cumsum(counts, 0) - counts)[rows]
    sel = rank < k
    out_ids = torch.full((num_rows, k), -1, dtype=torch.long)
    out_prio = torch.full((num_rows, k), -math.inf, dtype=torch.float64)
    out_ids[rows[sel], rank[sel]] = ids[sel]
    out_prio[rows[sel], rank[sel]] = prio[sel]
    return out_ids, out_prio


class SparseLSHLinear(nn.Module):
    """Wide linear layer (``out_features`` neurons) computed on an LSH-selected active set (SLIDE).

    Training ``forward(x, labels)`` returns ``(ids [B, k], logits [B, k])`` for ``k =
    num_active`` active neurons per sample: the sample's labels first, then LSH candidates
    ranked by collision count, then random fill; ids are distinct within a row. With
    ``active_set="shared"`` (default) the batch shares one active set (all labels of the
    batch, then the candidates colliding with most samples), so the logits are one
    ``[B, in] x [in, k]`` GEMM and ``ids`` is an expanded view of one row; with
    ``"per_sample"`` each sample gets its own ``k`` neurons (a ``[B, k, in]`` gather).
    Eval (``not self.training`` or ``labels is None``) returns ``(ids, scores)`` of the top
    ``num_active`` neurons, see :meth:`topk`. Gradients of ``weight`` and ``bias`` are
    ``torch.sparse_coo`` tensors over the active rows; pair with :class:`LazyAdam`.

    Args:
        in_features: input size.
        out_features: neurons (rows) this module holds: the whole layer, or a D-SLIDE shard's range.
        num_active: active neurons per sample in training (``k``), at most ``out_features``;
            default ``min(4096, out_features)``.
        hash_family: ``"simhash"`` (signed random projections) or ``"dwta"`` (densified WTA).
        num_bits: bits per bucket code (``K``); DWTA needs a multiple of 3.
        num_tables: number of hash tables (``L``).
        bucket_cap: at most this many neurons of a bucket become candidates (a random
            subset, re-drawn at every rebuild); ``None`` for no cap.
        rebuild_every: training steps between table rebuilds from the current weights (a
            rebuild re-hashes the rows that were active since the previous one).
        rebuild_growth: the rebuild period is multiplied by this after every rebuild (>= 1).
        reseed_every: training steps between new hash functions.
        eval_topk: eval top-k: ``"exact"`` (all neurons, chunked matmul) or ``"lsh"``.
        seed: seed of hash functions, tie-breaks and random fill.
        active_set: ``"shared"`` (one active set per batch) or ``"per_sample"``.
        row_offset: for a D-SLIDE shard, the global id of this module's first row.
        total_out: for a D-SLIDE shard, the number of neurons of the whole layer (default:
            ``row_offset + out_features``).
    """

    num_steps: Tensor  # a buffer

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_active: int | None = None,
        hash_family: str = "simhash",
        num_bits: int = 14,
        num_tables: int = 8,
        bucket_cap: int | None = 128,
        rebuild_every: int = 50,
        rebuild_growth: float = 1.0,
        reseed_every: int = 1000,
        eval_topk: str = "exact",
        seed: int = 0,
        active_set: str = "shared",
        row_offset: int = 0,
        total_out: int | None = None,
    ) -> None:
        super().__init__()
        group = born_shard_group()
        # Created whole inside `sharded_init`: hold only this rank's rows (see lightning_swarm.layers.init).
        self.born_sharded = (
            group is not None and row_offset == 0 and total_out is None and out_features >= group.world_size
        )
        if self.born_sharded:
            assert group is not None
            total_out = out_features
            row_offset, hi = shard_range(out_features, group.rank, group.world_size)
            out_features = hi - row_offset
        total = row_offset + out_features if total_out is None else total_out
        name = "SparseLSHLinear"
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"{name}: in_features and out_features must be positive, got {in_features}, {out_features}."
            )
        if not 0 <= row_offset <= total - out_features:
            raise ValueError(
                f"{name}: rows [{row_offset}, {row_offset + out_features}) do not fit in total_out={total}."
            )
        if hash_family not in ("simhash", "dwta"):
            raise ValueError(f"{name}: unknown hash_family {hash_family!r}; choose 'simhash' or 'dwta'.")
        if eval_topk not in ("exact", "lsh"):
            raise ValueError(f"{name}: unknown eval_topk {eval_topk!r}; choose 'exact' or 'lsh'.")
        if active_set not in ("shared", "per_sample"):
            raise ValueError(f"{name}: unknown active_set {active_set!r}; choose 'shared' or 'per_sample'.")
        num_active = min(_DEFAULT_ACTIVE, total) if num_active is None else num_active
        if not 1 <= num_active <= total:
            raise ValueError(f"{name}: num_active must be in [1, out_features={total}], got {num_active}.")
        if bucket_cap is not None and bucket_cap <= 0:
            raise ValueError(f"{name}: bucket_cap must be positive or None, got {bucket_cap}.")
        if rebuild_every <= 0 or reseed_every <= 0 or rebuild_growth < 1.0:
            raise ValueError(
                f"{name}: need rebuild_every > 0, reseed_every > 0 and rebuild_growth >= 1, got "
                f"{rebuild_every}, {reseed_every}, {rebuild_growth}."
            )
        make_hash(hash_family, in_features, num_bits, num_tables, seed)  # validates num_bits/num_tables
        self.in_features, self.out_features, self.num_active = in_features, out_features, num_active
        self.hash_family, self.num_bits, self.num_tables, self.bucket_cap = (
            hash_family,
            num_bits,
            num_tables,
            bucket_cap,
        )
        self.rebuild_every, self.rebuild_growth, self.reseed_every = (
            rebuild_every,
            rebuild_growth,
            reseed_every,
        )
        self.eval_topk, self.seed, self.active_set = eval_topk, seed, active_set
        self.row_offset, self.total_out = row_offset, total
        self.init_seed = draw_init_seed() if initialising() else 0
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features))
        if initialising():
            self.reset_parameters()
        self.register_buffer("num_steps", torch.zeros((), dtype=torch.long))
        self._hash: BucketHash | None = None
        self._hash_version = -1
        self._tables = LSHTables(num_tables, 1 << num_bits)
        self._built_at: int | None = None
        self._codes: Tensor | None = None  # [n, L] bucket codes of the rows at the last rebuild
        self._dirty = torch.zeros(out_features, dtype=torch.bool)  # rows active since the last rebuild
        self._period = float(rebuild_every)
        self.num_rebuilds = 0
        self.register_load_state_dict_post_hook(lambda module, _: module.invalidate_tables())

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, num_active={self.num_active}, "
            f"hash_family={self.hash_family}, K={self.num_bits}, L={self.num_tables}, active_set={self.active_set}"
        )

    def reset_parameters(self) -> None:
        """``U(-1/sqrt(in), 1/sqrt(in))`` like ``nn.Linear``, drawn by blocks of rows from ``init_seed``: a shard's
        rows get exactly the values the whole layer's rows would (``lightning_swarm.layers.init``)."""
        bound = 1.0 / math.sqrt(self.in_features)
        uniform_rows_(self.weight.data, self.row_offset, self.init_seed, 0, bound)
        uniform_rows_(self.bias.data.unsqueeze(1), self.row_offset, self.init_seed, 1, bound)
        self.invalidate_tables()

    # ----------------------------------------------------------------- tables
    def invalidate_tables(self) -> None:
        """Force a full table rebuild (all rows re-hashed) at the next use, e.g. after changing weights."""
        self._built_at = None
        self._codes = None

    def mark_active(self, ids: Tensor) -> None:
        """Record that rows ``ids`` (global) were active, so the next rebuild re-hashes them.

        The training forward calls it; a D-SLIDE shard calls it with its part of the active set.
        Rebuilds re-hash only these rows (a sparse optimizer changes no others); a new hash
        function or :meth:`invalidate_tables` re-hashes all rows.
        """
        local = ids.reshape(-1) - self.row_offset
        self._dirty[local[(local >= 0) & (local < self.out_features)]] = True

    @torch.no_grad()
    def maybe_rebuild(self) -> bool:
        """Rebuild the tables (and draw new hash functions) when the schedule says so.

        Runs at the start of every training forward; a D-SLIDE shard calls it at the same
        steps as every other shard. Returns whether the tables were rebuilt.
        """
        step = int(self.num_steps)
        version = step // self.reseed_every
        if self._hash is None or version != self._hash_version:
            hash_seed = int(pseudo_uniform(torch.tensor([version]), self.seed, _SALT_HASH)[0] * 2**62)
            self._hash = make_hash(
                self.hash_family, self.in_features, self.num_bits, self.num_tables, hash_seed
            )
            self._hash_version = version
            self.invalidate_tables()
        if self._built_at is not None and step - self._built_at < self._period:
            return False
        if self._built_at is not None:
            self._period *= self.rebuild_growth
        weight = self.weight.detach()
        if self._codes is None:
            self._codes = self._hash.codes(weight)
        else:  # only rows that were active since the last rebuild can have changed
            rows = self._dirty.nonzero().squeeze(1)
            self._codes[rows] = self._hash.codes(weight.index_select(0, rows))
        self._dirty.zero_()
        codes = self._codes
        global_ids = torch.arange(self.out_features) + self.row_offset
        order_key = pseudo_uniform(global_ids, self.seed, step, _SALT_BUCKET)
        self._tables.build(codes, order_key)
        self._built_at = step
        self.num_rebuilds += 1
        return True

    # ------------------------------------------------------ active-set selection
    @torch.no_grad()
    def candidate_priorities(
        self, x: Tensor, labels: Tensor | None, per_sample: bool | None = None, k: int | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Priorities of this module's rows for the active set of the current step.

        A D-SLIDE shard (``row_offset=lo``, ``out_features=hi-lo``, same seeds as the other
        shards, full batch ``x`` and ``labels``) gets the global active set as
        ``top_priorities(all-gather of top_priorities(*candidate_priorities(x, labels), R, k))``
        and keeps the ids in ``[lo, hi)``; this equals the single-process active set when
        ``bucket_cap`` is ``None`` (with a cap, each shard caps its own part of a bucket).

        Args:
            x: ``[B, in_features]`` input of the layer.
            labels: ``[B, Ymax]`` global label ids padded with ``-1``, or ``None``.
            per_sample: one active set per sample (default: ``active_set == "per_sample"``).
            k: active-set size (default ``num_active``); sizes the random fill.

        Returns:
            ``(rows, ids, prio)``: ``[M]`` tensors; row ``0`` only when the set is shared,
            ``ids`` global, ``prio`` float64.
        """
        per_sample = self.active_set == "per_sample" if per_sample is None else per_sample
        k = self.num_active if k is None else k
        if self._built_at is None:
            self.maybe_rebuild()
        assert self._hash is not None
        step, n, lo = int(self.num_steps), self.out_features, self.row_offset
        batch = x.size(0)
        num_rows = batch if per_sample else 1
        cap, cs, L = self.bucket_cap, self._tables.code_space, self.num_tables
        codes = self.query_codes(x)  # [B, L]
        if per_sample:
            query, neuron = self._tables.lookup(torch.arange(L).repeat(batch), codes.reshape(-1), cap)
            rows, weight = query // L, None
        else:
            keys, hits = torch.unique((codes + torch.arange(L) * cs).reshape(-1), return_counts=True)
            query, neuron = self._tables.lookup(keys // cs, keys % cs, cap)
            rows, weight = torch.zeros_like(neuron), hits.index_select(0, query).double()
        pair, inverse = torch.unique(rows * n + neuron, return_inverse=True)
        collisions = torch.zeros(pair.numel(), dtype=torch.float64)
        if weight is None:
            collisions.index_add_(0, inverse, torch.ones(inverse.numel(), dtype=torch.float64))
        else:
            collisions.index_add_(0, inverse, weight)
        c_rows, c_ids = pair // n, pair % n + lo
        c_prio = collisions + self._tie(c_rows, c_ids, step)
        if not per_sample and c_prio.numel() > k:  # only the k best candidates can make it
            best = c_prio.topk(k).indices
            c_rows, c_ids, c_prio = c_rows[best], c_ids[best], c_prio[best]
        parts = [(c_rows, c_ids, c_prio)]
        if labels is not None:
            valid = (labels >= lo) & (labels < lo + n)
            l_rows = torch.arange(batch).unsqueeze(1).expand_as(labels)[valid] if per_sample else None
            l_ids = labels[valid]
            l_rows = torch.zeros_like(l_ids) if l_rows is None else l_rows
            parts.append((l_rows, l_ids, _LABEL_PRIORITY + self._tie(l_rows, l_ids, step)))
        parts.append(self._fill(num_rows, k, step))
        return tuple(torch.cat(p) for p in zip(*parts, strict=True))  # type: ignore[return-value]

    @torch.no_grad()
    def query_codes(self, x: Tensor) -> Tensor:
        """Bucket codes ``[B, L]`` of the query rows ``x`` under the current hash functions.

        A D-SLIDE shard overrides it to hash only its slice of the batch and all-gather the codes: the hash
        functions depend only on ``(seed, reseed count)``, so every shard would compute the same codes.
        """
        assert self._hash is not None
        return self._hash.codes(x.detach().float())

    def _tie(self, rows: Tensor, ids: Tensor, step: int) -> Tensor:
        return pseudo_uniform(rows * self.total_out + ids, self.seed, step, _SALT_TIE)

    def _fill(self, num_rows: int, k: int, step: int) -> tuple[Tensor, Tensor, Tensor]:
        """The random fill in this module's rows: the same global sequence in every process."""
        total = self.total_out
        gen = torch.Generator().manual_seed(
            int(pseudo_uniform(torch.tensor([step]), self.seed, _SALT_FILL)[0] * 2**62)
        )
        if num_rows * total <= _PERM_FILL_MAX or 4 * k >= total:
            fill = torch.rand(num_rows, total, generator=gen).argsort(dim=1)[:, :k]
        else:  # with repeats; 2k draws leave > k distinct ids with overwhelming probability
            fill = torch.randint(0, total, (num_rows, 2 * k + 16), generator=gen)
        prio = (-1.0 - torch.arange(fill.size(1), dtype=torch.float64)).expand_as(fill)
        rows = torch.arange(num_rows).unsqueeze(1).expand_as(fill)
        mine = (fill >= self.row_offset) & (fill < self.row_offset + self.out_features)
        return rows[mine], fill[mine], prio[mine]

    @torch.no_grad()
    def select_active(self, x: Tensor, labels: Tensor | None) -> Tensor:
        """The active set of the current step in a single process (this module = all rows).

        Returns:
            ``[1, k]`` (shared) or ``[B, k]`` (per sample) global ids, labels first.
        """
        per_sample = self.active_set == "per_sample"
        k, num_rows = self.num_active, x.size(0) if per_sample else 1
        if labels is not None:
            distinct = distinct_labels(labels if per_sample else labels.reshape(1, -1))
            if int(distinct.max()) > k:
                what = "a sample has" if per_sample else "the batch has"
                raise ValueError(
                    f"SparseLSHLinear: {what} {int(distinct.max())} distinct labels but num_active={k}; "
                    "labels must all be in the active set: increase num_active or use a smaller batch."
                )
        ids, _ = top_priorities(*self.candidate_priorities(x, labels), num_rows, k)
        if bool((ids < 0).any()):  # only possible for a shard, or if the fill ran out
            raise RuntimeError("SparseLSHLinear: could not fill the active set; please report this.")
        return ids

    # ------------------------------------------------------------------ compute
    def active_logits(self, x: Tensor, ids: Tensor) -> Tensor:
        """Logits ``[B, k]`` of the active neurons (global ids in this module's rows).

        Args:
            x: ``[B, in_features]``.
            ids: ``[1, k]`` (one set for the batch: a GEMM) or ``[B, k]`` (per sample).
        """
        local = ids - self.row_offset
        if local.size(0) == 1:
            w = gather_rows(self.weight, local[0])
            b = gather_rows(self.bias, local[0])
            return torch.addmm(b, x, w.t())
        batch, k = local.shape
        w = gather_rows(self.weight, local.reshape(-1)).view(batch, k, self.in_features)
        b = gather_rows(self.bias, local.reshape(-1)).view(batch, k)
        return torch.baddbmm(b.unsqueeze(2), w, x.unsqueeze(2)).squeeze(2)

    def forward(self, x: Tensor, labels: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Training (labels given): ``(ids, logits)`` of the active set. Eval: ``(ids, scores)`` of the top-k.

        Args:
            x: ``[B, in_features]`` float input.
            labels: ``[B, Ymax]`` int64 label ids padded with ``-1`` (training).

        Returns:
            ``(ids [B, k] int64, logits [B, k])`` with ``k = num_active``.
        """
        self._check_input(x, labels)
        if not self.training or labels is None:
            scores, ids = self.topk(x, self.num_active)
            return ids, scores
        self.maybe_rebuild()
        ids = self.select_active(x, labels)
        logits = self.active_logits(x, ids)
        self.mark_active(ids)
        self.num_steps += 1
        return ids.expand(x.size(0), -1), logits

    @torch.no_grad()
    def topk(self, x: Tensor, k: int, mode: str | None = None) -> tuple[Tensor, Tensor]:
        """Top-``k`` neurons per sample by score ``x @ weight.T + bias``.

        Args:
            x: ``[B, in_features]``.
            k: how many, at most ``out_features``.
            mode: ``"exact"`` (all neurons, in chunks of rows to bound memory) or ``"lsh"``
                (each sample's LSH candidates, ``max(k, num_active)`` of them); default
                ``eval_topk``.

        Returns:
            ``(scores [B, k], ids [B, k])``, best first, like ``torch.topk``.
        """
        mode = self.eval_topk if mode is None else mode
        self._check_input(x, None)
        if not 1 <= k <= self.out_features:
            raise ValueError(f"SparseLSHLinear.topk: k must be in [1, {self.out_features}], got {k}.")
        if mode == "exact":
            return self._exact_topk(x, k)
        if mode != "lsh":
            raise ValueError(f"SparseLSHLinear.topk: unknown mode {mode!r}; choose 'exact' or 'lsh'.")
        width = min(self.out_features, max(k, self.num_active))
        scores, ids = [], []
        chunk = max(1, (1 << 24) // (width * self.in_features))  # bounds the [b, width, in] gather
        for lo in range(0, x.size(0), chunk):
            xs = x[lo : lo + chunk]
            cand, _ = top_priorities(*self.candidate_priorities(xs, None, True, width), xs.size(0), width)
            s = self.active_logits(xs, cand)
            top_s, top_i = s.topk(k, dim=1)
            scores.append(top_s)
            ids.append(cand.gather(1, top_i))
        return torch.cat(scores), torch.cat(ids)

    def _exact_topk(self, x: Tensor, k: int) -> tuple[Tensor, Tensor]:
        chunk = max(k, (1 << 24) // max(x.size(0), 1))  # [B, chunk] scores <= 64 MB
        best_s: Tensor | None = None
        best_i: Tensor | None = None
        for lo in range(0, self.out_features, chunk):
            s = torch.addmm(self.bias[lo : lo + chunk], x, self.weight[lo : lo + chunk].t())
            top_s, top_i = s.topk(min(k, s.size(1)), dim=1)
            top_i += lo + self.row_offset
            if best_s is not None and best_i is not None:
                top_s, pick = torch.cat([best_s, top_s], 1).topk(k, dim=1)
                top_i = torch.cat([best_i, top_i], 1).gather(1, pick)
            best_s, best_i = top_s, top_i
        assert best_s is not None and best_i is not None
        return best_s, best_i

    def _check_input(self, x: Tensor, labels: Tensor | None) -> None:
        if x.dim() != 2 or x.size(1) != self.in_features:
            raise ValueError(
                f"SparseLSHLinear expects x of shape [B, {self.in_features}], got {tuple(x.shape)}."
            )
        if x.is_floating_point() and not bool(torch.isfinite(x).all()):
            bad = (~torch.isfinite(x)).any(dim=1).nonzero().flatten()[:5].tolist()
            raise ValueError(
                f"SparseLSHLinear: x holds NaN or Inf values (samples {bad} of the batch): one such sample would "
                "corrupt the hash tables and every weight row it touches; clean the data or the layer before."
            )
        if labels is None:
            return
        if labels.dim() != 2 or labels.size(0) != x.size(0) or labels.dtype != torch.long:
            raise ValueError(
                f"SparseLSHLinear expects labels as an int64 tensor [B={x.size(0)}, Ymax] padded with -1, "
                f"got {labels.dtype} of shape {tuple(labels.shape)}."
            )
        if labels.numel() and (int(labels.min()) < -1 or int(labels.max()) >= self.total_out):
            raise ValueError(
                f"SparseLSHLinear: labels must be in [0, {self.total_out}) or -1 for padding, got values in "
                f"[{int(labels.min())}, {int(labels.max())}]."
            )


def distinct_labels(labels: Tensor) -> Tensor:
    """Number of distinct non-padding labels per row of a ``[R, Y]`` tensor."""
    if labels.size(1) == 0:
        return torch.zeros(labels.size(0), dtype=torch.long)
    s = labels.sort(dim=1).values
    new = torch.ones_like(s, dtype=torch.bool)
    new[:, 1:] = s[:, 1:] != s[:, :-1]
    return (new & (s >= 0)).sum(dim=1)
