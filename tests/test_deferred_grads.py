"""Deferred input gradients (lightning_swarm/swarm/client/deferred_grads.py) on autograd itself: a node whose backward is
computed by the client's threads hands its inputs' gradients to the flush, and the gradients of the layers below
it come out as in one synchronous backward, with a residual path around it too; a failed backward raises at the
flush. (The swarm end to end: tests/test_contract.py's accumulation cases.)"""

import threading

import pytest
import torch

from lightning_swarm.swarm.client.deferred_grads import ChunkPool, DeferredGrads, finish_backward


class _Client:
    """What finish_backward reads of a SwarmClient: its DeferredGrads and its threads."""

    def __init__(self) -> None:
        self.deferred_grads = DeferredGrads()
        self.chunk_pool = ChunkPool()
        self.threads: set[str] = set()


class _Remote(torch.autograd.Function):
    """A stand-in for a stage call: y = 2 x + 1 (the "stage"), its backward computed by ``finish_backward``."""

    @staticmethod
    def forward(ctx, client, fail, x):
        ctx.client, ctx.fail, ctx.diff_inputs = client, fail, (x,)
        return 2 * x + 1

    @staticmethod
    def backward(ctx, grad):
        def backward():
            ctx.client.threads.add(threading.current_thread().name)
            if ctx.fail:
                raise RuntimeError("stage 1 failed in its backward")
            return [2 * grad]

        return (None, None, *finish_backward(ctx.client, backward, ctx.diff_inputs))


def _grads(client, deferred: bool, residual: bool, batches: int = 3):
    torch.manual_seed(0)
    emb, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    for _ in range(batches):
        x = torch.randn(8, 4)
        h = torch.tanh(emb(x))
        y = _Remote.apply(client, False, h)
        loss = head(y + h if residual else y).pow(2).mean()
        if deferred:
            client.deferred_grads.begin()
            loss.backward(retain_graph=True)
            client.deferred_grads.end()
            client.deferred_grads.flush(keep=1)
        else:
            loss.backward()
    client.deferred_grads.flush()
    return [p.grad.clone() for p in (*emb.parameters(), *head.parameters())]


@pytest.mark.parametrize("residual", [False, True])
def test_deferred_input_gradients_add_up_to_the_synchronous_ones(residual):
    client = _Client()
    synchronous = _grads(client, deferred=False, residual=residual)
    assert not any(name.startswith("swarm-chunk") for name in client.threads)
    deferred = _grads(client, deferred=True, residual=residual)
    assert any(name.startswith("swarm-chunk") for name in client.threads)  # computed by the client's threads
    assert client.deferred_grads.backwards == 3 and client.deferred_grads.pending() == 0
    for a, b in zip(synchronous, deferred, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_before_the_flush_the_layers_below_miss_that_part_only():
    client = _Client()
    emb = torch.nn.Linear(4, 4)
    h = emb(torch.randn(8, 4))
    client.deferred_grads.begin()
    (_Remote.apply(client, False, h) + h).sum().backward(retain_graph=True)  # a residual path around the call
    client.deferred_grads.end()
    residual_part = emb.weight.grad.clone()
    assert client.deferred_grads.pending() == 1
    client.deferred_grads.flush()
    torch.testing.assert_close(emb.weight.grad, 3 * residual_part)  # the call's part is 2x the residual's


def test_a_failed_deferred_backward_raises_at_the_flush():
    client = _Client()
    h = torch.nn.Linear(4, 4)(torch.randn(2, 4))
    client.deferred_grads.begin()
    _Remote.apply(client, True, h).sum().backward(retain_graph=True)  # returns: the failure is still to come
    client.deferred_grads.end()
    with pytest.raises(RuntimeError, match="stage 1 failed in its backward"):
        client.deferred_grads.flush()
    assert client.deferred_grads.pending() == 0
    client.chunk_pool.shutdown()
