"""SparseLSHLinear, SparseInputLinear and active_set_loss."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_swarm.layers import LazyAdam, SparseInputLinear, SparseLSHLinear, active_set_loss
from lightning_swarm.layers.sparse_linear import top_priorities

MODES = ["shared", "per_sample"]


def _labels(batch: int, num_labels: int, ymax: int, gen: torch.Generator) -> torch.Tensor:
    labels = torch.randint(0, num_labels, (batch, ymax), generator=gen)
    labels[0, 1:] = -1  # one label
    labels[1] = -1  # no label
    return labels


@pytest.mark.parametrize("mode", MODES)
def test_active_set_has_labels_first_and_no_duplicates_across_rebuilds(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    layer = SparseLSHLinear(
        16, 2000, num_active=64, num_bits=6, num_tables=4, rebuild_every=2, reseed_every=3, active_set=mode
    )
    for _ in range(7):
        x = torch.randn(8, 16, generator=gen)
        labels = _labels(8, 2000, 3, gen)
        ids, logits = layer(x, labels)
        assert ids.shape == logits.shape == (8, 64)
        for i in range(8):
            row = ids[i].tolist()
            assert len(set(row)) == 64 and min(row) >= 0 and max(row) < 2000
            mine = {y for y in labels[i].tolist() if y >= 0}
            assert mine <= set(row)
            if mode == "per_sample":
                assert set(row[: len(mine)]) == mine  # labels come first
            else:
                batch_labels = {y for y in labels.flatten().tolist() if y >= 0}
                assert set(row[: len(batch_labels)]) == batch_labels
        layer.zero_grad()
        active_set_loss(ids, logits, labels).backward()
    assert int(layer.num_steps) == 7 and layer.num_rebuilds == 5  # steps 0, 2, 3 (reseed), 5, 6 (reseed)


@pytest.mark.parametrize("mode", MODES)
def test_gradients_equal_dense_linear_restricted_to_active_ids(mode: str) -> None:
    gen = torch.Generator().manual_seed(1)
    layer = SparseLSHLinear(12, 300, num_active=40, num_bits=5, num_tables=3, active_set=mode).double()
    dense = torch.nn.Linear(12, 300).double()
    dense.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})
    x = torch.randn(6, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    labels = _labels(6, 300, 4, gen)
    ids, logits = layer(x, labels)
    loss = active_set_loss(ids, logits, labels) + (logits**2).mean()  # a loss touching every logit
    loss.backward()
    logits_ref = dense(x_ref).gather(1, ids)
    assert torch.allclose(logits, logits_ref, atol=1e-12)
    loss_ref = active_set_loss(ids, logits_ref, labels) + (logits_ref**2).mean()
    loss_ref.backward()
    assert layer.weight.grad.is_sparse and layer.bias.grad.is_sparse
    assert torch.allclose(layer.weight.grad.to_dense(), dense.weight.grad, atol=1e-12)
    assert torch.allclose(layer.bias.grad.to_dense(), dense.bias.grad, atol=1e-12)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-12)
    inactive = torch.ones(300, dtype=torch.bool)
    inactive[ids.flatten()] = False
    assert torch.all(layer.weight.grad.to_dense()[inactive] == 0)


@pytest.mark.parametrize("mode", MODES)
def test_full_active_set_trains_like_dense_softmax(mode: str) -> None:
    gen = torch.Generator().manual_seed(2)
    layer = SparseLSHLinear(10, 50, num_active=50, num_bits=4, num_tables=2, active_set=mode).double()
    dense = torch.nn.Linear(10, 50).double()
    dense.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})
    opt, opt_ref = LazyAdam(layer.parameters(), lr=0.01), torch.optim.Adam(dense.parameters(), lr=0.01)
    for _ in range(4):
        x = torch.randn(5, 10, generator=gen, dtype=torch.float64)
        labels = _labels(5, 50, 2, gen)
        ids, logits = layer(x, labels)
        opt.zero_grad()
        active_set_loss(ids, logits, labels).backward()
        opt.step()
        full = dense(x)
        valid = labels >= 0
        target = torch.zeros_like(full).scatter_add_(1, labels.clamp(min=0), valid.double())
        target = target / valid.sum(1, keepdim=True).clamp(min=1)
        rows = valid.any(1)
        loss_ref = -(target * full.log_softmax(1)).sum(1)[rows].mean()
        opt_ref.zero_grad()
        loss_ref.backward()
        opt_ref.step()
    assert torch.allclose(layer.weight, dense.weight, atol=1e-10)
    assert torch.allclose(layer.bias, dense.bias, atol=1e-10)


def _clustered_layer(family: str, mode: str) -> tuple[SparseLSHLinear, torch.Tensor, torch.Tensor]:
    """4096 neurons in 64 tight clusters; queries near the centres; exact top-32 per query."""
    gen = torch.Generator().manual_seed(3)
    bits = 9 if family == "dwta" else 8
    layer = SparseLSHLinear(
        64,
        4096,
        num_active=256,
        hash_family=family,
        num_bits=bits,
        num_tables=16,
        bucket_cap=None,
        active_set=mode,
    )
    centres = F.normalize(torch.randn(64, 64, generator=gen), dim=1)
    with torch.no_grad():
        layer.weight.copy_(centres.repeat_interleave(64, 0) + 0.05 * torch.randn(4096, 64, generator=gen))
        layer.bias.zero_()
    x = centres[torch.randint(0, 64, (32,), generator=gen)] + 0.05 * torch.randn(32, 64, generator=gen)
    true_top = (x @ layer.weight.T).topk(32, dim=1).indices
    return layer, x, true_top


@pytest.mark.parametrize("family", ["simhash", "dwta"])
def test_lsh_candidates_recall_true_top_neurons_far_better_than_random(family: str) -> None:
    layer, x, true_top = _clustered_layer(family, "per_sample")
    layer.maybe_rebuild()
    rows, ids, prio = layer.candidate_priorities(x, None)
    lsh = prio >= 1  # collision counts, not random fill
    cand, _ = top_priorities(rows[lsh], ids[lsh], prio[lsh], 32, 256)
    recall = torch.tensor([torch.isin(true_top[i], cand[i]).float().mean() for i in range(32)]).mean()
    random_recall = 256 / 4096
    assert recall > 0.6 > 5 * random_recall, recall
    # The LSH eval top-k finds most of the exact top-5.
    exact = layer.topk(x, 5, mode="exact")[1]
    scores, approx = layer.topk(x, 5, mode="lsh")
    assert torch.allclose(scores, (x @ layer.weight.T).gather(1, approx), atol=1e-5)
    assert torch.isin(exact, approx).float().mean() > 0.6


def test_exact_topk_and_eval_forward_match_dense() -> None:
    layer = SparseLSHLinear(8, 1000, num_active=20, num_bits=4, num_tables=2)
    x = torch.randn(7, 8)
    scores, ids = layer.topk(x, 10)
    ref = (x @ layer.weight.T + layer.bias).topk(10, dim=1)
    assert torch.equal(ids, ref.indices) and torch.allclose(scores, ref.values, atol=1e-6)
    layer.eval()
    ids_eval, scores_eval = layer(x, torch.zeros(7, 1, dtype=torch.long))  # labels ignored in eval
    assert ids_eval.shape == (7, 20) and torch.equal(ids_eval[:, :10], ids)


@pytest.mark.parametrize("mode", MODES)
def test_shards_select_exactly_their_part_of_the_single_process_active_set(mode: str) -> None:
    """The D-SLIDE recipe: per-shard priorities, local top-k, merge of [R, k] per shard."""
    gen = torch.Generator().manual_seed(4)
    n, k, batch = 3000, 128, 6
    kw = dict(num_active=k, num_bits=7, num_tables=6, bucket_cap=None, active_set=mode, seed=11)
    full = SparseLSHLinear(32, n, **kw)
    bounds = [(0, 1100), (1100, 2000), (2000, 3000)]
    shards = [SparseLSHLinear(32, hi - lo, row_offset=lo, total_out=n, **kw) for lo, hi in bounds]
    for shard, (lo, hi) in zip(shards, bounds, strict=True):
        shard.load_state_dict(
            {"weight": full.weight[lo:hi], "bias": full.bias[lo:hi], "num_steps": full.num_steps}
        )
    for _ in range(3):
        x = torch.randn(batch, 32, generator=gen)
        labels = _labels(batch, n, 3, gen)
        expected = full.select_active(x, labels)
        num_rows = expected.size(0)
        local = [top_priorities(*s.candidate_priorities(x, labels), num_rows, k) for s in shards]
        merged_ids = torch.cat([ids for ids, _ in local], dim=1)
        merged_prio = torch.cat([prio for _, prio in local], dim=1)
        rows = torch.arange(num_rows).unsqueeze(1).expand_as(merged_ids)
        got, _ = top_priorities(rows.flatten(), merged_ids.flatten(), merged_prio.flatten(), num_rows, k)
        assert torch.equal(got, expected)
        for s in [*shards, full]:
            s.num_steps += 1
            s.maybe_rebuild()


def test_active_set_loss_values_and_stability() -> None:
    ids = torch.tensor([[5, 6, 7], [1, 2, 3], [9, 8, 7]])
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [1e4, -1e4, 0.0]], requires_grad=True)
    labels = torch.tensor([[7, 5], [-1, -1], [9, -1]])
    loss = active_set_loss(ids, logits, labels)
    row0 = torch.logsumexp(torch.tensor([1.0, 2.0, 3.0]), 0) - (3.0 + 1.0) / 2
    row2 = torch.tensor(0.0)  # the label has all the mass
    assert torch.allclose(loss, (row0 + row2) / 2, atol=1e-5)
    loss.backward()
    assert torch.isfinite(logits.grad).all() and torch.all(logits.grad[1] == 0)
    # Shared (expanded) ids take the fast path and agree with materialised ids.
    shared = torch.tensor([4, 0, 2, 9]).expand(3, 4)
    lg = torch.randn(3, 4)
    lab = torch.tensor([[0, 9], [2, -1], [-1, -1]])
    assert torch.allclose(active_set_loss(shared, lg, lab), active_set_loss(shared.contiguous(), lg, lab))
    no_labels = active_set_loss(shared, lg.requires_grad_(), torch.full((3, 1), -1))
    assert no_labels.item() == 0.0 and no_labels.requires_grad


def test_sparse_input_linear_matches_dense_linear() -> None:
    gen = torch.Generator().manual_seed(5)
    layer = SparseInputLinear(50, 8).double()
    indices = torch.tensor([3, 7, 49, 0, 3, 3, 10])
    offsets = torch.tensor([0, 3, 3])  # the second sample is empty
    values = torch.rand(7, generator=gen, dtype=torch.float64)
    dense_x = torch.zeros(3, 50, dtype=torch.float64)
    rows = torch.tensor([0, 0, 0, 2, 2, 2, 2])
    dense_x.index_put_((rows, indices), values, accumulate=True)
    out = layer(indices, offsets, values)
    assert torch.allclose(out, dense_x @ layer.weight + layer.bias, atol=1e-12)
    out.sum().backward()
    assert layer.weight.grad.is_sparse
    assert torch.allclose(
        layer.weight.grad.to_dense(), dense_x.sum(0, keepdim=True).T.expand(50, 8), atol=1e-12
    )


def test_bad_arguments_give_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown hash_family 'minhash'"):
        SparseLSHLinear(8, 100, hash_family="minhash")
    with pytest.raises(ValueError, match="num_active must be in"):
        SparseLSHLinear(8, 100, num_active=101)
    with pytest.raises(ValueError, match="eval_topk"):
        SparseLSHLinear(8, 100, num_active=10, eval_topk="fast")
    with pytest.raises(ValueError, match="multiple of log2"):
        SparseLSHLinear(8, 100, num_active=10, hash_family="dwta", num_bits=8)
    layer = SparseLSHLinear(8, 100, num_active=10, num_bits=4, num_tables=2)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 100\)"):
        layer(torch.randn(2, 8), torch.tensor([[3], [100]]))
    with pytest.raises(ValueError, match=r"x of shape \[B, 8\]"):
        layer(torch.randn(2, 9), torch.tensor([[3], [4]]))
    with pytest.raises(ValueError, match=r"NaN or Inf values \(samples \[1\]"):
        layer(torch.tensor([[0.0] * 8, [float("nan")] + [0.0] * 7]), torch.tensor([[3], [4]]))
    with pytest.raises(ValueError, match="int64 tensor"):
        layer(torch.randn(2, 8), torch.tensor([[3.0], [4.0]]))
    with pytest.raises(ValueError, match=r"B=2"):
        layer(torch.randn(2, 8), torch.tensor([[3]]))
    with pytest.raises(ValueError, match="distinct labels but num_active=10"):
        layer(torch.randn(4, 8), torch.arange(12).view(4, 3))
    with pytest.raises(ValueError, match="not in the active set"):
        active_set_loss(torch.tensor([[1, 2]]), torch.randn(1, 2), torch.tensor([[3]]))
    with pytest.raises(ValueError, match="same shape"):
        active_set_loss(torch.tensor([[1, 2]]), torch.randn(1, 3), torch.tensor([[1]]))
    with pytest.raises(ValueError, match=r"k must be in \[1, 100\]"):
        layer.topk(torch.randn(2, 8), 101)
    inp = SparseInputLinear(20, 4)
    with pytest.raises(ValueError, match=r"feature ids must be in \[0, 20\)"):
        inp(torch.tensor([1, 20]), torch.tensor([0]), torch.ones(2))
    with pytest.raises(ValueError, match="1-D indices"):
        inp(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(3))


def test_state_dict_round_trip_rebuilds_tables() -> None:
    layer = SparseLSHLinear(8, 200, num_active=16, num_bits=4, num_tables=2)
    layer(torch.randn(4, 8), torch.tensor([[1], [2], [3], [4]]))
    other = SparseLSHLinear(8, 200, num_active=16, num_bits=4, num_tables=2)
    other.load_state_dict(layer.state_dict())
    assert int(other.num_steps) == 1 and torch.equal(other.weight, layer.weight)
    x, labels = torch.randn(4, 8), torch.tensor([[5], [6], [7], [8]])
    assert torch.equal(layer.select_active(x, labels), other.select_active(x, labels))
    assert math.isfinite(float(active_set_loss(*other(x, labels), labels)))


def test_incremental_rebuild_equals_full_rebuild_after_training() -> None:
    gen = torch.Generator().manual_seed(6)
    layer = SparseLSHLinear(16, 1500, num_active=64, num_bits=6, num_tables=4, rebuild_every=3)
    opt = LazyAdam(layer.parameters(), lr=0.05)
    for _ in range(7):
        x = torch.randn(8, 16, generator=gen)
        labels = _labels(8, 1500, 2, gen)
        opt.zero_grad()
        active_set_loss(*layer(x, labels), labels).backward()
        opt.step()
    layer.num_steps += 2  # make the schedule rebuild now (step 9 = 6 + 3)
    assert layer.maybe_rebuild()
    incremental = layer._tables.neurons.clone()
    layer.invalidate_tables()
    layer.maybe_rebuild()
    assert torch.equal(layer._tables.neurons, incremental)
