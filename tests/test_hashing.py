"""Hash families (SimHash, DWTA) and the CSR tables of SparseLSHLinear."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_swarm.layers import DWTAHash, LSHTables, SimHash
from lightning_swarm.layers.tables import pseudo_uniform


def _pairs_at_angle(
    n: int, dim: int, angle: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random pairs of unit vectors at exactly ``angle`` radians."""
    u = torch.nn.functional.normalize(torch.randn(n, dim, generator=gen, dtype=torch.float64), dim=1)
    w = torch.randn(n, dim, generator=gen, dtype=torch.float64)
    w = torch.nn.functional.normalize(w - (w * u).sum(1, keepdim=True) * u, dim=1)
    return u.float(), (math.cos(angle) * u + math.sin(angle) * w).float()


def test_simhash_bit_collision_rate_matches_angle() -> None:
    # 2000 pairs x 8 independent hyperplanes = 16,000 Bernoulli(1 - angle/pi) draws per angle:
    # the standard deviation of the rate is <= 0.004, so 0.02 is a 5-sigma tolerance.
    gen = torch.Generator().manual_seed(0)
    h = SimHash(dim=64, num_bits=1, num_tables=8, seed=3)
    for angle in (math.pi / 6, math.pi / 3, math.pi / 2, 2 * math.pi / 3, 5 * math.pi / 6):
        a, b = _pairs_at_angle(2000, 64, angle, gen)
        rate = (h.codes(a) == h.codes(b)).float().mean().item()
        assert abs(rate - (1 - angle / math.pi)) < 0.02, (angle, rate)


def test_simhash_codes_are_deterministic_per_seed_and_in_range() -> None:
    x = torch.randn(100, 32)
    a, b, c = SimHash(32, 10, 4, seed=1), SimHash(32, 10, 4, seed=1), SimHash(32, 10, 4, seed=2)
    codes = a.codes(x)
    assert codes.shape == (100, 4) and codes.dtype == torch.long
    assert int(codes.min()) >= 0 and int(codes.max()) < 1 << 10
    assert torch.equal(codes, b.codes(x))
    assert not torch.equal(codes, c.codes(x))
    # Codes of a row do not depend on the other rows hashed with it (rebuilds are chunked).
    assert torch.equal(a.codes(x[37:38]), codes[37:38])


def test_dwta_collisions_increase_with_similarity() -> None:
    gen = torch.Generator().manual_seed(1)
    h = DWTAHash(dim=64, num_bits=3, num_tables=64, seed=5)
    rates = []
    for angle in (0.2, 0.6, 1.0, 1.4):
        a, b = _pairs_at_angle(500, 64, angle, gen)
        rates.append((h.codes(a) == h.codes(b)).float().mean().item())
    assert all(r1 > r2 + 0.03 for r1, r2 in zip(rates, rates[1:], strict=False)), rates
    assert rates[0] > 0.7


def test_dwta_densifies_empty_bins() -> None:
    h = DWTAHash(dim=64, num_bits=6, num_tables=8, seed=0)
    x = torch.zeros(3, 64)
    x[0, 5] = 1.0  # one non-zero coordinate: almost every bin is empty
    x[1, 5], x[1, 40] = 1.0, 0.5
    x[2] = torch.rand(64)
    codes = h.codes(x)
    assert int(codes.max()) < 1 << 6
    # With one non-zero coordinate, every bin borrows from a bin holding that coordinate,
    # whose winner is the coordinate's position in it (never the fallback value of a bin
    # left empty, which would be 0 for every bin).
    bins = torch.stack([(codes[0] >> 3 * j) & 7 for j in range(2)], dim=1)
    positions = (h.bin_coords == 5).nonzero()[:, 1]
    assert torch.isin(bins, positions).all() and 0 not in positions.tolist()
    assert torch.equal(h.codes(x), codes)  # deterministic


def test_hash_argument_errors() -> None:
    with pytest.raises(ValueError, match="num_bits"):
        SimHash(8, 0, 1)
    with pytest.raises(ValueError, match="multiple of log2"):
        DWTAHash(8, 4, 1)
    with pytest.raises(ValueError, match="bin_size"):
        DWTAHash(8, 6, 1, bin_size=6)
    with pytest.raises(ValueError, match=r"\[N, 8\]"):
        SimHash(8, 4, 2).codes(torch.randn(3, 7))


@pytest.mark.parametrize("num_bits", [6, 24])  # dense offsets / binary-search paths
def test_tables_hold_every_neuron_once_per_table_and_lookup_buckets(num_bits: int) -> None:
    n, L = 3000, 5
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 1 << min(num_bits, 6), (n, L), generator=gen)
    tables = LSHTables(L, 1 << num_bits)
    tables.build(codes, pseudo_uniform(torch.arange(n), 7))
    assert (tables.offsets is None) == (num_bits == 24)
    for t in range(L):
        assert torch.equal(tables.table(t).sort().values, torch.arange(n))
    q_tables = torch.tensor([0, 1, 4, 4])
    q_codes = torch.tensor([3, 17, 0, 63])
    query, members = tables.lookup(q_tables, q_codes)
    for i in range(4):
        expected = (codes[:, q_tables[i]] == q_codes[i]).nonzero().flatten()
        got = members[query == i]
        assert torch.equal(got.sort().values, expected)
    # A cap keeps exactly min(size, cap) members of each bucket, all from that bucket.
    query, members = tables.lookup(q_tables, q_codes, cap=10)
    for i in range(4):
        size = int((codes[:, q_tables[i]] == q_codes[i]).sum())
        got = members[query == i]
        assert got.numel() == min(size, 10)
        assert torch.all(codes[got, q_tables[i]] == q_codes[i])


def test_bucket_cap_keeps_a_random_subset_not_the_lowest_ids() -> None:
    n = 1000
    tables = LSHTables(1, 2)
    tables.build(torch.zeros(n, 1, dtype=torch.long), pseudo_uniform(torch.arange(n), 1))
    _, members = tables.lookup(torch.tensor([0]), torch.tensor([0]), cap=50)
    assert members.numel() == 50 and int(members.max()) > 500


def test_pseudo_uniform_is_deterministic_and_uniform() -> None:
    ids = torch.arange(100_000)
    u = pseudo_uniform(ids, 3, 4)
    assert u.dtype == torch.float64 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert torch.equal(pseudo_uniform(ids[500:600], 3, 4), u[500:600])  # independent of the batch
    assert not torch.equal(pseudo_uniform(ids[:100], 3, 5), u[:100])  # the salt matters
