"""The float64 sums of a stage's backwards (``SharedState.add_pending``) and of the trainers' own gradients add
narrower tensors through ``footprint.add_widened``: the same bits as torch's mixed-dtype add, without its float64
copy of the whole operand (which a 2048 x 2048 gradient pays in page faults at every add)."""

from __future__ import annotations

import itertools
import resource

import pytest
import torch
from torch import nn

from lightning_swarm.swarm.footprint import WIDEN_SLICE, add_widened
from lightning_swarm.swarm.server.shared import SharedState


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape", [(2 * WIDEN_SLICE + 5,), (700, 1031), (3, 5)], ids=["slices", "2d", "small"]
)
def test_a_widened_add_has_the_bits_of_torchs_mixed_dtype_add(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    gen = torch.Generator().manual_seed(0)
    total = torch.randn(shape, generator=gen, dtype=torch.float64) * 1e3
    values = (torch.randn(shape, generator=gen) * 1e-3).to(dtype)
    expected = total.clone().add_(values)
    assert add_widened(total, values) is total
    assert torch.equal(total, expected)


def test_a_strided_operand_and_anything_else_add_as_torch_adds() -> None:
    gen = torch.Generator().manual_seed(1)
    total = torch.randn(1031, 700, generator=gen, dtype=torch.float64)
    values = torch.randn(700, 1031, generator=gen).t()  # not contiguous
    assert torch.equal(add_widened(total.clone(), values), total.clone().add_(values))
    for operand in (torch.randn(1031, 700, generator=gen, dtype=torch.float64), torch.ones(1031, 700).int()):
        assert torch.equal(add_widened(total.clone(), operand), total.clone().add_(operand))
    narrow = torch.randn(1031, 700, generator=gen)  # not a float64 total
    assert torch.equal(add_widened(narrow.clone(), narrow), narrow.clone().add_(narrow))
    row = torch.randn(700, generator=gen)  # broadcast
    assert torch.equal(add_widened(total.clone(), row), total.clone().add_(row))


def _minor_faults(fn) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_widened_add_does_not_fault_in_a_float64_copy_of_its_operand() -> None:
    """torch widens the whole operand into a fresh float64 tensor (32 MB here, past glibc's mmap threshold: about
    8,000 pages faulted in at every add); add_widened reuses a 2 MiB scratch buffer."""
    total = torch.randn(2048, 2048, dtype=torch.float64)
    values = torch.randn(2048, 2048)
    add_widened(total, values)  # the scratch buffer
    total.add_(values)
    widened = min(_minor_faults(lambda: add_widened(total, values)) for _ in range(3))
    torchs = min(_minor_faults(lambda: total.add_(values)) for _ in range(3))
    page_count = values.numel() * 8 // resource.getpagesize()
    # what torch's copy costs (if this fails, torch no longer copies)
    assert torchs > page_count // 2, (torchs, page_count)
    assert widened < page_count // 20, (widened, page_count)


def test_a_stages_sum_of_backwards_has_the_same_bits_in_any_order() -> None:
    """Three backwards' gradients of a parameter larger than the scratch buffer, in every order: one float64 sum,
    the same bits each time, and the exact sum rounded to float32."""
    weight = nn.Parameter(torch.zeros(2 * WIDEN_SLICE + 3))
    bias = nn.Parameter(torch.zeros(4))
    gen = torch.Generator().manual_seed(2)
    backwards = [
        [torch.randn(weight.shape, generator=gen) * scale, torch.randn(4, generator=gen)]
        for scale in (1.0, 1e-4, 1e3)
    ]
    sums = []
    for order in itertools.permutations(range(3)):
        state = SharedState(trained=[weight, bias], master=[weight, bias], shared_master=True)
        for i in order:
            state.add_pending([g.clone() for g in backwards[i]], samples=2)
        assert all(p is not None and p.dtype == torch.float64 for p in state.pending or [])
        summed, samples, count = state.take_pending()
        assert (samples, count) == (6, 3)
        sums.append(summed)
    exact = [sum(b[k].double() for b in backwards).float() for k in range(2)]
    for summed in sums:
        assert summed is not None
        for got, want in zip(summed, exact, strict=True):
            assert got is not None and got.dtype == torch.float32
            assert torch.equal(got, want)
