"""Split backwards (lightning_swarm/swarm/server/weight_grads.py): the input gradients alone, then the parameter
gradients from the captured activations' gradients, equal the whole backward's, for stages written the way their
libraries write them; and where a parameter's gradient would be missed, the split is refused."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from lightning_swarm.swarm.server.weight_grads import DeferredWeights, split_backward, split_enabled


class _Blocks(nn.Module):
    """Transformer encoder layers called with the masks a real model passes: a float causal mask (-inf above the
    diagonal) and a boolean padding mask."""

    def __init__(self, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, src_mask=mask, src_key_padding_mask=padding)
        return x


class _GPTBlock(nn.Module):
    """A GPT-2 style block (pre-norm, fused qkv, causal attention, GELU MLP) with a learned position embedding
    added inside the stage: a parameter that meets the input's path at an add. With ``tied``, the output projection
    runs again on the block's output: a weight whose gradient starts at two activations, one below the other."""

    def __init__(self, width: int = 32, seq: int = 6, tied: bool = False) -> None:
        super().__init__()
        self.tied = tied
        self.pos = nn.Parameter(torch.randn(seq, width) * 0.02)
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.heads = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pos
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        x = x + self.down(nn.functional.gelu(self.up(self.ln2(x))))
        return self.proj(x) + x if self.tied else x


class _ParamOutput(nn.Module):
    """Two outputs, one computed from a parameter alone: its gradient never meets the input's path."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x) * self.scale, self.scale * 2


def _whole_and_split(
    module: nn.Module, inputs: list[torch.Tensor], extra: tuple = ()
) -> tuple[list, list] | None:
    torch.manual_seed(1)
    leaves = [x.detach().requires_grad_(True) for x in inputs]
    outputs = module(*leaves, *extra)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    grads = [torch.randn_like(o) for o in outputs]
    params = list(module.parameters())
    whole = torch.autograd.grad(outputs, leaves + params, grads, retain_graph=True, allow_unused=True)
    split = split_backward(outputs, grads, leaves, params)
    if split is None:
        return None
    inputs_grads, work = split
    while work.run_group():
        pass
    return list(whole), list(inputs_grads) + work.grads


@pytest.mark.parametrize("family", ["encoder", "gpt"])
def test_a_split_backward_gives_the_whole_backwards_gradients(family: str) -> None:
    torch.manual_seed(0)
    if family == "encoder":
        module, seq = _Blocks(), 6
        mask = torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1)
        padding = torch.zeros(3, seq, dtype=torch.bool)
        padding[0, -2:] = True
        result = _whole_and_split(module, [torch.randn(3, seq, 32)], (mask, padding))
    else:
        module = _GPTBlock()
        result = _whole_and_split(module, [torch.randn(3, 6, 32)])
    assert result is not None
    whole, split = result
    assert len(whole) == len(split)
    for w, s in zip(whole, split, strict=True):
        assert (w is None) == (s is None)
        if w is not None:
            torch.testing.assert_close(s, w, rtol=1e-5, atol=1e-6)


def test_unused_parameters_get_no_gradient_and_graphs_the_split_would_get_wrong_are_not_split() -> None:
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    unused = nn.Linear(8, 8)  # trained by the stage, not used by this forward
    x = torch.randn(4, 8, requires_grad=True)
    out = module(x)
    split = split_backward([out], [torch.ones_like(out)], [x], [*module.parameters(), *unused.parameters()])
    assert split is not None
    _, work = split
    while work.run_group():
        pass
    assert all(g is not None for g in work.grads[:2]) and work.grads[2:] == [None, None]
    # scale reaches the second output without meeting x's path: captured gradients would miss that part
    assert _whole_and_split(_ParamOutput(), [torch.randn(4, 8)]) is None
    # a weight used twice, one use below the other: the second pass would go through the block again
    assert _whole_and_split(_GPTBlock(tied=True), [torch.randn(3, 6, 32)]) is None


def test_deferred_parameter_gradients_wait_for_calls_and_are_drained_before_a_step() -> None:
    lock = threading.Lock()
    waiting = [0]
    weights = DeferredWeights(lock, lambda: waiting[0], "test-weights")
    module = _Blocks(layers=2)
    x = torch.randn(2, 6, 32, requires_grad=True)
    mask = torch.zeros(6, 6)
    out = module(x, mask, torch.zeros(2, 6, dtype=torch.bool))
    split = split_backward([out], [torch.ones_like(out)], [x], list(module.parameters()))
    assert split is not None
    done: list[float] = []
    with weights.foreground():  # a call holds the stage: the deferred part waits for it
        weights.defer(split[1], lambda w: done.append(time.monotonic()))
        time.sleep(0.3)
        assert not done and weights.pending() == 1
        left = time.monotonic()
    assert weights.drain() is None  # a step takes every deferred part first
    assert len(done) == 1 and done[0] >= left and weights.pending() == 0
    assert all(g is not None for g in split[1].grads)
    weights.close()


def test_the_split_is_on_unless_the_environment_turns_it_off() -> None:
    assert split_enabled({}) and split_enabled({"LIGHTNING_SWARM_SPLIT_BACKWARD": "1"})
    assert not split_enabled({"LIGHTNING_SWARM_SPLIT_BACKWARD": "0"})
    assert not split_enabled({"LIGHTNING_SWARM_SPLIT_BACKWARD": "off"})


def test_deferred_parts_beyond_the_bound_run_even_while_calls_hold_the_stage() -> None:
    """Each queued part holds its backward's graph: a stage that is never idle until its step must not keep more
    than ``most`` of them."""
    lock = threading.Lock()
    log: list[tuple[str, float, float]] = []
    weights = DeferredWeights(lock, lambda: 0, "test-weights", most=1, log=lambda *entry: log.append(entry))
    module = _Blocks(layers=1)
    done: list[int] = []
    with weights.foreground():
        for i in range(3):
            x = torch.randn(2, 6, 32, requires_grad=True)
            out = module(x, torch.zeros(6, 6), torch.zeros(2, 6, dtype=torch.bool))
            split = split_backward([out], [torch.ones_like(out)], [x], list(module.parameters()))
            assert split is not None
            weights.defer(split[1], lambda w, i=i: done.append(i))
        deadline = time.monotonic() + 10
        while weights.pending() > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        # the oldest ran; one stays for when the stage idles
        assert done[:2] == [0, 1] and weights.pending() == 1
    assert weights.drain() is None and done == [0, 1, 2]
    assert log and all(kind == "weights" and end >= start for kind, start, end in log)
    weights.close()


def test_a_forward_that_used_none_of_the_parameters_leaves_no_work_and_no_error() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    out = torch.tanh(x)
    split = split_backward([out], [torch.ones_like(out)], [x], list(nn.Linear(8, 8).parameters()))
    assert split is not None
    inputs_grads, work = split
    assert not work.run_group() and work.grads == [None, None]
    torch.testing.assert_close(inputs_grads[0], 1 - out.detach() ** 2)
