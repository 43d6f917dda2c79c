"""LazyAdam: sparse rows follow Adam, untouched rows and their moments stay put."""

from __future__ import annotations

import pytest
import torch

from lightning_swarm.layers import LazyAdam


def _sparse(rows: list[int], values: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor([rows]), values, shape, check_invariants=True)


def test_single_step_matches_adam_on_touched_rows_and_leaves_others() -> None:
    torch.manual_seed(0)
    w0 = torch.randn(10, 4, dtype=torch.float64)
    lazy_p = torch.nn.Parameter(w0.clone())
    dense_p = torch.nn.Parameter(w0.clone())
    lazy = LazyAdam([lazy_p], lr=0.1, betas=(0.8, 0.9), eps=1e-6)
    dense = torch.optim.Adam([dense_p], lr=0.1, betas=(0.8, 0.9), eps=1e-6)
    g = torch.randn(3, 4, dtype=torch.float64)
    lazy_p.grad = _sparse([1, 4, 7], g, (10, 4))
    dense_grad = torch.zeros(10, 4, dtype=torch.float64)
    dense_grad[[1, 4, 7]] = g
    dense_p.grad = dense_grad
    lazy.step()
    dense.step()
    touched = [1, 4, 7]
    untouched = [i for i in range(10) if i not in touched]
    assert torch.allclose(lazy_p[touched], dense_p[touched], atol=1e-12, rtol=0)
    assert torch.equal(lazy_p.detach()[untouched], w0[untouched])
    assert not torch.equal(lazy_p.detach()[touched], w0[touched])


def test_several_steps_match_adam_when_rows_are_touched_every_step() -> None:
    torch.manual_seed(1)
    w0 = torch.randn(6, 3, dtype=torch.float64)
    lazy_p = torch.nn.Parameter(w0.clone())
    dense_p = torch.nn.Parameter(w0.clone())
    lazy = LazyAdam([lazy_p], lr=0.05)
    dense = torch.optim.Adam([dense_p], lr=0.05)
    for _ in range(5):
        # Repeated row ids (as from a [B, k] gather) must be summed.
        rows = [0, 2, 2, 5, 0]
        g = torch.randn(5, 3, dtype=torch.float64)
        lazy_p.grad = _sparse(rows, g, (6, 3))
        dense_p.grad = lazy_p.grad.to_dense()
        lazy.step()
        dense.step()
    assert torch.allclose(lazy_p[[0, 2, 5]], dense_p[[0, 2, 5]], atol=1e-12, rtol=0)
    assert torch.equal(lazy_p.detach()[[1, 3, 4]], w0[[1, 3, 4]])


def test_moments_of_untouched_rows_are_not_decayed() -> None:
    p = torch.nn.Parameter(torch.zeros(4, 2))
    opt = LazyAdam([p], lr=0.01)
    p.grad = _sparse([0, 1], torch.ones(2, 2), (4, 2))
    opt.step()
    m_row1 = opt.state[p]["exp_avg"][1].clone()
    v_row1 = opt.state[p]["exp_avg_sq"][1].clone()
    for _ in range(3):
        p.grad = _sparse([0], torch.ones(1, 2), (4, 2))
        opt.step()
    assert torch.equal(opt.state[p]["exp_avg"][1], m_row1)
    assert torch.equal(opt.state[p]["exp_avg_sq"][1], v_row1)
    assert opt.state[p]["step"] == 4
    assert torch.equal(opt.state[p]["exp_avg"][2:], torch.zeros(2, 2))


def test_dense_gradients_get_plain_adam() -> None:
    torch.manual_seed(2)
    w0 = torch.randn(5, dtype=torch.float64)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    lazy, adam = LazyAdam([a], lr=0.02), torch.optim.Adam([b], lr=0.02)
    for _ in range(4):
        g = torch.randn(5, dtype=torch.float64)
        a.grad, b.grad = g.clone(), g.clone()
        lazy.step()
        adam.step()
    assert torch.allclose(a, b, atol=1e-12, rtol=0)


def test_sparse_1d_bias_gradient() -> None:
    b = torch.nn.Parameter(torch.zeros(8))
    opt = LazyAdam([b], lr=0.1)
    b.grad = torch.sparse_coo_tensor(torch.tensor([[2, 5]]), torch.tensor([1.0, -1.0]), (8,))
    opt.step()
    assert b[2] < 0 < b[5]
    assert torch.count_nonzero(b.detach()) == 2


def test_bad_arguments() -> None:
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="lr"):
        LazyAdam(p, lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        LazyAdam(p, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="eps"):
        LazyAdam(p, eps=-1e-8)


def _run_steps(early: bool, w0: torch.Tensor, b0: torch.Tensor, grads: list) -> tuple:
    w, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
    opt = LazyAdam([w, b], lr=0.1, betas=(0.8, 0.9))
    assert opt.step_early([w]) == 0  # not inside step(closure)
    updated: list[int] = []
    for gw, gb in grads:

        def closure(gw: torch.Tensor = gw, gb: torch.Tensor = gb) -> float:
            w.grad, b.grad = gw.clone(), gb.clone()
            if early:
                updated.append(opt.step_early([w]))
                assert opt.step_early([w]) == 0  # once per step
                assert opt.stepped_early(w) and not opt.stepped_early(b)
            return 0.0

        opt.step(closure)
        assert not opt.stepped_early(w)
    return w.detach().clone(), b.detach().clone(), opt.state[w]["step"], sum(updated)


def test_step_early_inside_the_closure_gives_the_update_of_the_step_and_only_once() -> None:
    """What D-SLIDE's overlap does: during ``step(closure)``'s closure, some parameters are updated early; the
    step then updates only the others. Outside a closure (a microbatch that only accumulates) it does nothing."""
    torch.manual_seed(2)
    w0, b0 = torch.randn(8, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    grads = [
        (_sparse(rows, torch.randn(2, 3, dtype=torch.float64), (8, 3)), torch.randn(5, dtype=torch.float64))
        for rows in ([0, 5], [5, 6])
    ]
    w_late, b_late, steps_late, _ = _run_steps(False, w0, b0, grads)
    w_early, b_early, steps_early, early_updates = _run_steps(True, w0, b0, grads)
    assert torch.equal(w_early, w_late) and torch.equal(b_early, b_late)
    assert steps_early == steps_late == 2 and early_updates == 2
    assert not torch.equal(w_early, w0)
