"""Lazy Adam: Adam that updates only the rows a sparse gradient touches.

SLIDE's speed depends on never touching a weight-sized tensor per step: the wide layer's
gradient covers only the active rows, so the optimizer must update only those rows and
their moments. Moments of untouched rows are not decayed (as TensorFlow's LazyAdam and
``torch.optim.SparseAdam``); bias correction uses the parameter's global step count, so
a row touched at every step follows dense Adam exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer


class LazyAdam(Optimizer):
    """Adam for a mix of sparse (row-sparse ``sparse_coo``) and dense gradients.

    Sparse gradients update only their rows (lazy Adam); dense gradients get plain Adam
    (no weight decay, no amsgrad).

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: decay rates of the first and second moment.
        eps: added to the denominator for numerical stability.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"LazyAdam: lr must be >= 0, got {lr}.")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"LazyAdam: betas must be in [0, 1), got {betas}.")
        if eps < 0.0:
            raise ValueError(f"LazyAdam: eps must be >= 0, got {eps}.")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})
        self._in_closure = False
        self._stepped_early: set[int] = set()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step (parameters already updated by :meth:`step_early` during ``closure``
        are not updated again)."""
        loss = None
        if closure is not None:
            self._in_closure = True
            try:
                with torch.enable_grad():
                    loss = closure()
            finally:
                self._in_closure = False
        try:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None and id(p) not in self._stepped_early:
                        self._update(p, group)
        finally:
            self._stepped_early.clear()
        return loss

    @torch.no_grad()
    def step_early(self, params: Iterable[Tensor]) -> int:
        """Update ``params`` now, while this optimizer's ``step(closure)`` is running its closure, and leave them
        out of that step's update: the update they get is the one the step would give them, provided nothing
        changes their gradients between this call and the step's (clipping, another backward). Outside a closure
        (e.g. the backward of a microbatch that only accumulates) it does nothing.

        Returns:
            how many parameters were updated.
        """
        if not self._in_closure:
            return 0
        wanted = {id(p) for p in params}
        done = 0
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in wanted and p.grad is not None and id(p) not in self._stepped_early:
                    self._update(p, group)
                    self._stepped_early.add(id(p))
                    done += 1
        return done

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_in_closure", False)
        self.__dict__.setdefault("_stepped_early", set())

    def stepped_early(self, param: Tensor) -> bool:
        """Whether ``param`` was updated by :meth:`step_early` in the step now running."""
        return id(param) in self._stepped_early

    def _update(self, p: Tensor, group: dict[str, Any]) -> None:
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        bias1 = 1.0 - beta1 ** state["step"]
        bias2_sqrt = (1.0 - beta2 ** state["step"]) ** 0.5
        assert p.grad is not None
        if p.grad.is_sparse:
            self._sparse_update(p, state, lr / bias1, beta1, beta2, eps, bias2_sqrt)
        else:
            m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
            m.lerp_(g, 1.0 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            denom = (v.sqrt() / bias2_sqrt).add_(eps)
            p.addcdiv_(m, denom, value=-lr / bias1)

    @staticmethod
    def _sparse_update(
        p: Tensor,
        state: dict[str, Any],
        step_size: float,
        beta1: float,
        beta2: float,
        eps: float,
        bias2_sqrt: float,
    ) -> None:
        assert p.grad is not None
        grad = p.grad.coalesce()  # sums repeated rows
        rows = grad.indices()[0]
        g = grad.values()
        if g.numel() == 0:
            return
        m_all, v_all = state["exp_avg"], state["exp_avg_sq"]
        # Moments move by deltas written with index_add_ (rows are distinct after coalesce):
        # on CPU it is several times faster than index_copy_ into a weight-sized tensor.
        m = m_all.index_select(0, rows)
        v = v_all.index_select(0, rows)
        dm = (g - m).mul_(1.0 - beta1)
        dv = torch.addcmul(v, g, g, value=-1.0).mul_(beta2 - 1.0)  # (1 - beta2) * (g*g - v)
        m_all.index_add_(0, rows, dm)
        v_all.index_add_(0, rows, dv)
        m.add_(dm)
        v.add_(dv)
        update = m.div_(v.sqrt_().div_(bias2_sqrt).add_(eps)).mul_(-step_size)
        p.index_add_(0, rows, update)
