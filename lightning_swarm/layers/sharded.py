"""D-SLIDE shards of the wide layers: each rank owns a contiguous range of neurons and its own hash tables.

- :class:`ShardedSparseInputLinear` owns input features ``[lo, hi)`` of a :class:`SparseInputLinear` (rows of
  its ``[in, H]`` weight). It sums the batch's pairs of its own features into a partial ``[B, H]`` and the ranks
  all-reduce it; the backward all-reduces the ``[B, H]`` gradient (why by features: see the class).
- :class:`ShardedSparseLSHLinear` owns output neurons ``[lo, hi)`` of a :class:`SparseLSHLinear` (rows of
  its weight), with tables over its own rows. The active set is the single-process one: each shard ranks its
  own candidates (:meth:`SparseLSHLinear.candidate_priorities`), one all-gather of the ``[R, k]`` local top
  priorities gives every shard the global k-th priority, and a shard keeps its candidates above it. The
  softmax over the active set is normalised globally with one all-gather of ``[B, 2 + Ymax]`` (each shard's max, sum
  of exponentials and own labels' logits).

How the sharded training forward keeps the model's loss code unchanged: it returns, per row, the logits of
the shard's active neurons, one column per label owned by another shard (holding that label's true logit,
sent by its owner) and one "rest" column holding the rest of the other shards' softmax mass; these extra
columns are constants (detached). :func:`~lightning_swarm.layers.active_set_loss` on these columns then
computes, on every rank, the value of the single-process loss (same logsumexp, same label logits), while its
gradient reaches only the shard's own logits, each getting exactly its single-process ``p - t``. Summed over
ranks (the all-reduce of the hidden gradient) this is the single-process gradient. The LSH queries of a batch
are hashed whole on every rank while that is cheaper than a collective; above that each rank hashes its slice of
the rows and one all-gather of the int32 codes gives every rank all of them
(:meth:`ShardedSparseLSHLinear.query_codes`). Each rank then looks them up in its own tables.

Free of Lightning.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_swarm.layers.checkpoint import StreamedTensor
from lightning_swarm.layers.distributed import ShardGroup, shard_range, shard_sizes, sum_over_ranks_plus_bias
from lightning_swarm.layers.init import skip_init
from lightning_swarm.layers.loss import label_positions
from lightning_swarm.layers.sparse_input import SparseInputLinear
from lightning_swarm.layers.sparse_linear import (
    SparseLSHLinear,
    distinct_labels,
    gather_rows,
    top_priorities,
)

_FAR = 1.0e4  # logits this far below the max have zero mass in float32 (padding columns)
_FOREIGN_PAD = -(1 << 40)  # ids of padding label columns: distinct from -2 (rest) and -3 - j (local padding)


class ShardedLayer(nn.Module):
    """What the strategy needs from a sharded layer: how each parameter is split, and full state I/O.

    Attributes:
        shard_dims: parameter name -> dimension along which the full parameter is split.
        full_shapes: parameter name -> shape of the full (unsharded) parameter.
        shard_slices: parameter name -> ``(lo, hi)`` of this rank along its shard dimension.
    """

    init_seed: int

    shard_group: ShardGroup
    shard_dims: dict[str, int]
    full_shapes: dict[str, tuple[int, ...]]
    shard_slices: dict[str, tuple[int, int]]

    def _init_shard(
        self,
        shard_group: ShardGroup,
        lo: int,
        hi: int,
        full: SparseInputLinear | SparseLSHLinear,
        layout: dict[str, tuple[int, tuple[int, ...]]],
    ) -> None:
        """Record how each parameter is split (``layout``: name -> (shard dim, shape of the whole layer's)) and
        take this rank's parameters: a layer born sharded as exactly this shard gives its own, else rank 0 sends
        slices of its full ones."""
        self.shard_group = shard_group
        layout = {name: spec for name, spec in layout.items() if getattr(full, name, None) is not None}
        self.shard_dims = {name: dim for name, (dim, _) in layout.items()}
        self.full_shapes = {name: shape for name, (_, shape) in layout.items()}
        self.shard_slices = dict.fromkeys(self.shard_dims, (lo, hi))
        self.init_seed = full.init_seed
        if getattr(full, "born_sharded", False):
            for name in self.shard_dims:
                mine, theirs = getattr(self, name), getattr(full, name)
                if theirs.shape != mine.shape:
                    raise ValueError(
                        f"{type(self).__name__}: a layer born sharded has {name} of shape {tuple(theirs.shape)} "
                        f"on rank {shard_group.rank}, expected {tuple(mine.shape)}: create the model inside the "
                        "strategy's sharded_init with the same number of ranks."
                    )
                setattr(self, name, theirs)  # adopt: no copy, no transfer
        else:
            self._receive_from_rank0(full)

    @torch.no_grad()
    def _receive_from_rank0(self, full: nn.Module) -> None:
        """Take this rank's slices of rank 0's full parameters (the only weight-sized transfer, at setup)."""
        group, world = self.shard_group, self.shard_group.world_size
        for name, dim in self.shard_dims.items():
            mine = getattr(self, name)
            if world == 1:
                mine.copy_(getattr(full, name))
                continue
            if group.rank == 0:
                source = getattr(full, name).detach()
                for peer in range(1, world):
                    lo, hi = shard_range(self.full_shapes[name][dim], peer, world)
                    dist.send(
                        source.narrow(dim, lo, hi - lo).contiguous(),
                        dst=_global(group, peer),
                        group=group.group,
                    )
                lo, hi = self.shard_slices[name]
                mine.copy_(source.narrow(dim, lo, hi - lo))
            else:
                buffer = torch.empty_like(mine)
                dist.recv(buffer, src=_global(group, 0), group=group.group)
                mine.copy_(buffer)

    def streamed_state_dict(self) -> dict[str, Any]:
        """The unsharded layer's state dict, its sharded tensors as :class:`StreamedTensor` (no communication;
        ``save_streamed`` writes it shard by shard)."""
        state = self.state_dict()
        for name, dim in self.shard_dims.items():
            state[name] = StreamedTensor(state[name].detach(), self.full_shapes[name], dim)
        return state

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the unsharded layer's state dict, keeping this rank's slices."""
        mine = dict(state_dict)
        for name, dim in self.shard_dims.items():
            if name not in mine:
                continue
            if tuple(mine[name].shape) != self.full_shapes[name]:
                raise ValueError(
                    f"{type(self).__name__}: checkpoint tensor {name!r} has shape {tuple(mine[name].shape)}, "
                    f"the full layer has {self.full_shapes[name]}. Load a checkpoint of the same model."
                )
            lo, hi = self.shard_slices[name]
            mine[name] = mine[name].narrow(dim, lo, hi - lo).clone()
        self.load_state_dict(mine)


def _global(group: ShardGroup, rank: int) -> int:
    return rank if group.group is None else dist.get_global_rank(group.group, rank)


class ShardedSparseInputLinear(SparseInputLinear, ShardedLayer):
    """Input features ``[lo, hi)`` of a :class:`SparseInputLinear` (rows of its ``[in, H]`` weight), with the whole
    bias; ``forward`` returns the full ``[B, H]``.

    Each rank sums only the ``(feature, value)`` pairs of the batch that fall in its features and the ranks
    all-reduce their partial ``[B, H]`` sums (see :func:`sum_over_ranks_plus_bias`). Why by features rather than
    by hidden units or data-parallel: by hidden units every rank walks all ``N`` pairs of the batch and its sparse
    gradient and optimizer step index all ``N`` (the sort and coalesce of ``N`` row ids are repeated on every
    rank); by features each rank handles about ``N / ranks`` pairs and rows, for the same bytes (``[B, H]`` each
    way). Data parallel with sparse row-gradient exchange would replicate the whole weight and its optimizer
    state on every rank and send the touched rows (``N x H`` floats) every step.

    The bias is replicated: every rank adds it after the all-reduce and its gradient is the all-reduced one, so
    it needs no reduce of its own; it is taken from rank 0 at setup.

    Args:
        full: the unsharded layer (rank 0's weights are taken), or this rank's born-sharded rows.
        shard_group: the ranks sharing the layer.
    """

    def __init__(self, full: SparseInputLinear, shard_group: ShardGroup) -> None:
        total = full.in_features
        born = getattr(full, "born_sharded", False)
        if not born and full.weight.size(0) != total:
            raise ValueError("ShardedSparseInputLinear: shard a whole SparseInputLinear, not a shard of one.")
        lo, hi = shard_range(total, shard_group.rank, shard_group.world_size)
        with skip_init():
            SparseInputLinear.__init__(self, hi - lo, full.out_features, bias=full.bias is not None)
        self.in_features, self.row_offset = total, lo
        self._init_shard(shard_group, lo, hi, full, {"weight": (0, (total, full.out_features))})
        if full.bias is not None:
            assert self.bias is not None
            with torch.no_grad():
                self.bias.copy_(full.bias)
                if shard_group.world_size > 1:
                    dist.broadcast(self.bias.data, src=_global(shard_group, 0), group=shard_group.group)

    def extra_repr(self) -> str:
        lo, hi = self.shard_slices["weight"]
        return f"{super().extra_repr()}, input features [{lo}, {hi})"

    def forward(self, indices: Tensor, offsets: Tensor, values: Tensor) -> Tensor:
        self._check_input(indices, offsets, values)
        lo, hi = self.shard_slices["weight"]
        mine = (indices >= lo) & (indices < hi)
        before = torch.zeros(indices.numel() + 1, dtype=torch.long)  # own pairs before each position
        torch.cumsum(mine, 0, out=before[1:])
        pos = mine.nonzero().squeeze(1)
        partial = F.embedding_bag(
            indices.index_select(0, pos) - lo,
            self.weight,
            before.index_select(0, offsets),
            mode="sum",
            per_sample_weights=values.index_select(0, pos).to(self.weight.dtype),
            sparse=True,
        )
        return sum_over_ranks_plus_bias(partial, self.bias, self.shard_group)


class ShardedSparseLSHLinear(SparseLSHLinear, ShardedLayer):
    """Output neurons ``[lo, hi)`` of a :class:`SparseLSHLinear`, with tables over its own rows.

    Training ``forward(x, labels)`` returns the shard's columns for
    :func:`~lightning_swarm.layers.active_set_loss` (see the module docstring); eval ``topk`` merges every
    shard's top-k with one all-gather, so every rank gets the global top-k.

    Args:
        full: the unsharded layer (its settings and rank 0's weights are taken).
        shard_group: the ranks sharing the layer.
    """

    split_hashing_min_macs: int = 1 << 27
    """Below this many multiply-adds a batch's LSH queries are hashed whole on every rank (see
    :meth:`query_codes`). ``1 << 27`` is about 4 ms of one core: split, each of 2 ranks saves about 2 ms, more
    than the all-gather costs."""

    def __init__(self, full: SparseLSHLinear, shard_group: ShardGroup) -> None:
        born = getattr(full, "born_sharded", False)
        if not born and (full.row_offset != 0 or full.total_out != full.out_features):
            raise ValueError("ShardedSparseLSHLinear: shard a whole SparseLSHLinear, not a shard of one.")
        lo, hi = shard_range(full.total_out, shard_group.rank, shard_group.world_size)
        with skip_init():
            SparseLSHLinear.__init__(
                self,
                full.in_features,
                hi - lo,
                num_active=full.num_active,
                hash_family=full.hash_family,
                num_bits=full.num_bits,
                num_tables=full.num_tables,
                bucket_cap=full.bucket_cap,
                rebuild_every=full.rebuild_every,
                rebuild_growth=full.rebuild_growth,
                reseed_every=full.reseed_every,
                eval_topk=full.eval_topk,
                seed=full.seed,
                active_set=full.active_set,
                row_offset=lo,
                total_out=full.total_out,
            )
        layout = {"weight": (0, (full.total_out, full.in_features)), "bias": (0, (full.total_out,))}
        self._init_shard(shard_group, lo, hi, full, layout)
        self.num_steps.copy_(full.num_steps)
        self._period = full._period
        self.num_rebuilds = full.num_rebuilds

    # ------------------------------------------------------------ training
    def forward(self, x: Tensor, labels: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Training: ``(ids [B, c], logits [B, c])`` columns of this shard for ``active_set_loss``.

        Eval (``labels is None`` or not training): ``(ids, scores)`` of the global top ``num_active``.
        """
        self._check_input(x, labels)
        if not self.training or labels is None:
            scores, ids = self.topk(x, self.num_active)
            return ids, scores
        self.maybe_rebuild()
        mine, keep = self.select_active_shard(x, labels)
        batch, shared = x.size(0), mine.size(0) == 1
        if shared:  # one active set for the batch
            local_ids = mine[0][keep[0]]
            logits = (
                self.active_logits(x, local_ids.unsqueeze(0)) if local_ids.numel() else x.new_zeros(batch, 0)
            )
            ids = local_ids.unsqueeze(0).expand(batch, -1)
            self.mark_active(local_ids)  # rows to re-hash at the next rebuild
        else:  # per sample: pad every row to the longest local part
            width = int(keep.sum(dim=1).max()) if keep.numel() else 0
            order = keep.long().argsort(dim=1, descending=True, stable=True)[:, :width]
            valid = keep.gather(1, order)
            ids = torch.where(valid, mine.gather(1, order), -3 - torch.arange(width).expand(batch, -1))
            logits = self._padded_logits(x, ids, valid)
            self.mark_active(ids[valid])
        foreign_ids, foreign_logits, rest = self._global_normaliser(ids, logits.detach(), labels, shared)
        if shared:  # one row of ids for the batch, as an expanded view: the loss then searches it once
            rest_id = torch.full((1,), -2, dtype=torch.long)
            out_ids = torch.cat([ids[0], foreign_ids[0], rest_id]).unsqueeze(0).expand(batch, -1)
        else:
            out_ids = torch.cat([ids, foreign_ids, torch.full((batch, 1), -2, dtype=torch.long)], dim=1)
        out_logits = torch.cat([logits, foreign_logits, rest.unsqueeze(1)], dim=1)
        self.num_steps += 1
        return out_ids, out_logits

    @torch.no_grad()
    def _global_normaliser(
        self, ids: Tensor, logits: Tensor, labels: Tensor, shared: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The extra columns that make this shard's softmax the global one (see the module docstring).

        One collective: an all-gather of ``[B, 2 + Ymax]`` per shard holding, per row, the shard's max logit, its
        sum of exponentials relative to that max, and the logits of the labels it owns (0 for the others). Every
        rank then combines them the same way (``sum_r s_r * exp(m_r - M)`` with ``M`` the max over shards), so the
        step has one synchronisation point here instead of a max all-reduce followed by a sum all-reduce.

        Returns:
            ``(foreign_ids [B, m], foreign_logits [B, m], rest [B])``.
        """
        group, batch = self.shard_group, logits.size(0)
        lo, hi = self.row_offset, self.row_offset + self.out_features
        valid = labels >= 0
        own = valid & (labels >= lo) & (labels < hi)
        foreign = valid & ~own
        if logits.size(1):
            local_max = logits.max(dim=1).values
            local_sum = (logits - local_max.unsqueeze(1)).exp_().sum(dim=1)
            pos, _ = label_positions(ids, labels)  # own labels are always in the shard's active set
            label_logits = logits.gather(1, pos).masked_fill(~own, 0.0)
        else:
            local_max = logits.new_full((batch,), -math.inf)
            local_sum = logits.new_zeros(batch)
            label_logits = logits.new_zeros(labels.shape)
        packed = torch.cat([local_max.unsqueeze(1), local_sum.unsqueeze(1), label_logits], dim=1)
        everyone = group.all_gather_cat(packed.unsqueeze(0), "softmax_all_gather", dim=0)  # [P, B, 2 + Ymax]
        maxes, sums = everyone[:, :, 0], everyone[:, :, 1]
        glob_max = maxes.max(dim=0).values
        glob_sum = (sums * (maxes - glob_max).exp()).sum(dim=0)  # a shard without logits: 0 * exp(-inf) = 0
        label_logits = everyone[:, :, 2:].sum(dim=0)  # each label's logit comes from the shard that owns it
        floor = (glob_max - _FAR).unsqueeze(1)
        own_sum = local_sum * (local_max - glob_max).exp()
        foreign_mass = ((label_logits - glob_max.unsqueeze(1)).exp() * foreign).sum(dim=1)
        other = (glob_sum - own_sum - foreign_mass).clamp(min=0)
        rest = torch.maximum(glob_max + other.log(), floor.squeeze(1))
        if shared:  # one column per foreign label of the batch, shared ids; the row's own labels get values
            foreign_ids = torch.unique(labels[foreign])
            values = floor.expand(batch, foreign_ids.numel()).clone()
            rows, cols = foreign.nonzero(as_tuple=True)
            where = torch.searchsorted(foreign_ids, labels[rows, cols])
            values[rows, where] = label_logits[rows, cols]
            return foreign_ids.unsqueeze(0).expand(batch, -1), values, rest
        pads = _FOREIGN_PAD - torch.arange(labels.size(1)).expand_as(labels)
        return torch.where(foreign, labels, pads), torch.where(foreign, label_logits, floor), rest

    def _padded_logits(self, x: Tensor, ids: Tensor, valid: Tensor) -> Tensor:
        """Logits ``[B, w]`` of the valid entries of ``ids``; padding gets ``-_FAR`` and touches no row.

        (Gathering a stand-in row for the padding would hand the optimizer a zero gradient for it, and a lazy
        Adam would still move that row by its momentum.)
        """
        rows, cols = valid.nonzero(as_tuple=True)
        local = ids[rows, cols] - self.row_offset
        values = (gather_rows(self.weight, local) * x[rows]).sum(dim=1) + gather_rows(self.bias, local)
        return x.new_full(ids.shape, -_FAR).index_put((rows, cols), values)

    @torch.no_grad()
    def select_active_shard(self, x: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """This shard's part of the single-process active set.

        Returns:
            ``(ids [R, k], keep [R, k])``: the shard's top-k candidates (global ids) and which of them are in
            the global top-k; ``R`` is 1 for a shared active set, ``B`` per sample.
        """
        per_sample = self.active_set == "per_sample"
        k, num_rows = self.num_active, x.size(0) if per_sample else 1
        distinct = distinct_labels(labels if per_sample else labels.reshape(1, -1))
        if distinct.numel() and int(distinct.max()) > k:
            raise ValueError(
                f"ShardedSparseLSHLinear: {int(distinct.max())} distinct labels but num_active={k}; labels must "
                "all be in the active set: increase num_active or use a smaller batch."
            )
        ids, prio = top_priorities(*self.candidate_priorities(x, labels), num_rows, k)
        return ids, self._in_global_top(prio, k)

    def _in_global_top(self, prio: Tensor, k: int) -> Tensor:
        """Which of this shard's ``[R, k]`` top priorities are in the top k over all shards.

        One all-gather of the ``[R, k]`` priorities (float64); priorities are distinct across shards (ties are
        broken by per-neuron noise), so comparing with the global k-th is exact. ``-inf`` is padding.
        """
        everyone = self.shard_group.all_gather_cat(prio, "active_set_all_gather", dim=1)
        kth = everyone.topk(k, dim=1).values[:, -1:]
        return (prio >= kth) & (prio > -math.inf)

    @torch.no_grad()
    def query_codes(self, x: Tensor) -> Tensor:
        """Bucket codes ``[B, L]`` of the batch, the same on every rank.

        Every shard uses the same hash functions (they depend on ``(seed, reseed count)`` only) and gets the same
        ``x``. A batch whose hashing costs fewer than :attr:`split_hashing_min_macs` multiply-adds is hashed whole
        on every rank: a collective is a synchronisation point, and on Ethernet (or a busy box) it costs a
        millisecond or more, while the reference network's batch (256 rows of 128 features, 8 tables of 14 bits:
        3.7M multiply-adds) hashes in about 0.1 ms. Above it, this rank hashes only its slice of the rows
        (``shard_range`` of the batch) and one all-gather of the int32 codes gives every rank all of them. A
        batch smaller than the group is always hashed whole.
        """
        assert self._hash is not None
        group, batch = self.shard_group, x.size(0)
        # SimHash's projections (DWTA's are fewer)
        work = batch * self.in_features * self.num_tables * self.num_bits
        if group.world_size == 1 or batch < group.world_size or work < self.split_hashing_min_macs:
            return super().query_codes(x)
        lo, hi = shard_range(batch, group.rank, group.world_size)
        mine = self._hash.codes(x[lo:hi].detach().float()).int()  # codes < 2**num_bits fit in int32
        sizes = shard_sizes(batch, group.world_size)
        return group.all_gather_cat(mine, "hash_codes_all_gather", dim=0, sizes=sizes).long()

    # ---------------------------------------------------------------- eval
    @torch.no_grad()
    def topk(self, x: Tensor, k: int, mode: str | None = None) -> tuple[Tensor, Tensor]:
        """Global top-``k`` per sample: local top-k on every shard, then one all-gather and a merge."""
        mode = self.eval_topk if mode is None else mode
        self._check_input(x, None)
        if not 1 <= k <= self.total_out:
            raise ValueError(f"ShardedSparseLSHLinear.topk: k must be in [1, {self.total_out}], got {k}.")
        if mode == "lsh":
            width = min(self.total_out, max(k, self.num_active))
            cand, prio = top_priorities(*self.candidate_priorities(x, None, True, width), x.size(0), width)
            keep = self._in_global_top(prio, width)
            scores = self.active_logits(x, cand.clamp(min=self.row_offset)).masked_fill(~keep, -math.inf)
            ids = cand.masked_fill(~keep, -1)
        elif mode == "exact":
            scores, ids = self._exact_topk(x, min(k, self.out_features))
        else:
            raise ValueError(f"ShardedSparseLSHLinear.topk: unknown mode {mode!r}; choose 'exact' or 'lsh'.")
        local_k = min(k, scores.size(1))
        scores, pick = scores.topk(local_k, dim=1)
        ids = ids.gather(1, pick)
        if local_k < k:  # a shard narrower than k: pad so that every rank sends [B, k]
            scores = torch.cat([scores, scores.new_full((x.size(0), k - local_k), -math.inf)], dim=1)
            ids = torch.cat([ids, ids.new_full((x.size(0), k - local_k), -1)], dim=1)
        # One all-gather of (score, id) pairs as float64 [B, 2k] (ids below 2**53 are exact in float64).
        packed = torch.stack([scores.double(), ids.double()], dim=2).reshape(x.size(0), 2 * k)
        everyone = self.shard_group.all_gather_cat(packed, "topk_all_gather", dim=1).view(x.size(0), -1, 2)
        best, pick = everyone[:, :, 0].topk(k, dim=1)
        return best.to(scores.dtype), everyone[:, :, 1].gather(1, pick).long()


def sharded_types() -> tuple[type[nn.Module], ...]:
    """The layer types that D-SLIDE shards."""
    return (SparseInputLinear, SparseLSHLinear)


def make_sharded(module: nn.Module, shard_group: ShardGroup) -> ShardedLayer:
    """The sharded replacement of ``module`` for this rank (collective: every rank must call it)."""
    if isinstance(module, ShardedLayer):
        return module
    if isinstance(module, SparseLSHLinear):
        return ShardedSparseLSHLinear(module, shard_group)
    if isinstance(module, SparseInputLinear):
        return ShardedSparseInputLinear(module, shard_group)
    raise TypeError(
        f"D-SLIDE cannot shard a {type(module).__name__}; it shards {[t.__name__ for t in sharded_types()]}."
    )
