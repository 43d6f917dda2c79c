"""Batched stage servers: calls that wait for a busy stage are merged into one computation and split again.

One stage server (hivemind DHT/P2P on 127.0.0.1) serves a small MLP whose first call of a test is held at a gate,
so that the calls sent meanwhile queue up; they are then served together. Every answer is compared with the
stage's module run on that call alone (compression ``"none"``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import hivemind
import pytest
import torch
from torch import nn

from lightning_swarm.swarm.client.client import SwarmClient
from lightning_swarm.swarm.server import StageServer
from lightning_swarm.swarm.server.batching import mixes_rows
from lightning_swarm.swarm.server.stepper import Stepper
from lightning_swarm.swarm.settings import SwarmSettings
from lightning_swarm.swarm.wire.errors import COMPUTE, UNAVAILABLE
from lightning_swarm.swarm.wire.payload import Payload
from lightning_swarm.swarm.wire.protocol import StageReply, StageRequest, stage_uid
from tests._helpers import local_dhts

RUN_ID = "batching"
HIDDEN = 16
# float32 sums in another order (a batched matmul) may differ in the last bits: observed at most ~1e-7
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


class GatedMLP(nn.Module):
    """An MLP (rows independent) whose next forward of one kind (no grad: forward calls; grad: the backward's
    recomputation) blocks until released, and which raises for rows whose first value is 999."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(HIDDEN, 32), nn.GELU(), nn.Linear(32, HIDDEN))
        self.hold: tuple[bool, threading.Event] | None = None
        self.entered = threading.Event()

    def forward(self, x: torch.Tensor, scale: float = 1.0, bias: torch.Tensor | None = None, count=False):
        if self.hold is not None and self.hold[0] == torch.is_grad_enabled():
            (_, release), self.hold = self.hold, None
            self.entered.set()
            assert release.wait(60)
        if bool((x[:, 0] == 999).any()):
            raise ValueError("poisoned row")
        out = self.net(x) * scale + (0 if bias is None else bias)
        if count:  # a value about the whole batch: merged calls cannot be split
            return out, torch.tensor(x.shape[0])
        return out


class HeldStepper(Stepper):
    """Keeps the gradients of served backwards pending (no optimizer step)."""

    def step_pending(self) -> bool:
        return False


class HeldStageServer(StageServer):
    """Keeps the gradients of served backwards pending (no optimizer step), so that a test can read them."""

    stepper_class = HeldStepper


def _held_server(
    module: nn.Module, dht: hivemind.DHT, settings: SwarmSettings, **kwargs: Any
) -> HeldStageServer:
    """A :class:`HeldStageServer` of stage 0 serving ``module`` (SGD, never stepped), not started."""
    return HeldStageServer(
        0,
        module,
        dht=dht,
        settings=settings,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        throughput=1.0,
        **kwargs,
    )


@pytest.fixture(scope="module")
def swarm() -> Iterator[dict[str, Any]]:
    torch.manual_seed(0)
    things: list = []
    try:
        server_dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        things.append(server_dht)
        peers = server_dht.get_visible_maddrs()
        trainer_dhts = []
        for _ in range(2):
            trainer_dhts.append(
                hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers)
            )
            things.append(trainer_dhts[-1])
        module = GatedMLP()
        reference = GatedMLP()  # the parameters never change: the server does not step
        reference.load_state_dict(module.state_dict())
        settings = SwarmSettings(
            run_id=RUN_ID,
            num_stages=1,
            compression="none",
            target_batch_size=10**6,
            max_batch_rows=64,
            keep_activations=0,  # every backward recomputes its forward (the gate below holds that recomputation)
        )
        # calls of several structures (e.g. with and without a bias tensor): no schema check
        server = _held_server(module, server_dht, settings, check_schema=False)
        things.append(server.start())
        clients = []
        for dht in trainer_dhts:
            client_settings = settings.replace(request_timeout=30.0, no_peers_timeout=30.0)
            clients.append(SwarmClient(dht, client_settings))
            things.append(clients[-1])
        yield {"server": server, "module": module, "reference": reference, "clients": clients}
    finally:
        for thing in reversed(things):
            thing.shutdown()


def _gated(swarm: dict, grad: bool, first: Callable[[], Any], others: list[Callable[[], Any]]) -> list[Any]:
    """Run ``first`` until the stage holds it at the gate, then ``others`` concurrently until they all wait for
    the stage, then release the gate; returns every call's result (in order)."""
    server, module = swarm["server"], swarm["module"]
    release = threading.Event()
    module.entered.clear()
    module.hold = (grad, release)
    results: list[Any] = [None] * (1 + len(others))

    def run(i: int, fn: Callable[[], Any]) -> None:
        try:
            results[i] = fn()
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(0, first))]
    threads[0].start()
    try:
        assert module.entered.wait(60), "the first call never reached the stage"
        threads += [threading.Thread(target=run, args=(i + 1, fn)) for i, fn in enumerate(others)]
        for t in threads[1:]:
            t.start()
        deadline = time.monotonic() + 60
        while server.backend.batcher.pending() < len(others):
            assert time.monotonic() < deadline, "the other calls never queued up"
            time.sleep(0.01)
    finally:
        module.hold = None
        release.set()
        for t in threads:
            t.join(60)
    return results


def _assert_pending_grew_by(server: StageServer, before: list[torch.Tensor], reference: nn.Module) -> None:
    """The server's pending parameter gradients are ``before`` plus ``reference``'s gradients."""
    after = server.shared.pending_sums() or []
    for was, now, p in zip(before, after, reference.parameters(), strict=True):
        torch.testing.assert_close(now - was, p.grad, **TOLERANCE)


def _pending(server: StageServer) -> list[torch.Tensor]:
    """A copy of the parameter gradients the server holds for the next optimizer step."""
    if server.shared.pending is None:
        return [torch.zeros_like(p) for p in server.module.parameters()]
    return [p.clone() for p in server.shared.pending_sums() or []]


def _request(kind: str, x: torch.Tensor, request_id: int, grad: torch.Tensor | None = None, **kwargs):
    inputs = Payload.call((x,), kwargs)
    grads = None if grad is None else Payload.flatten((grad,))
    return StageRequest(kind, stage_uid(RUN_ID, 0), inputs, grads, request_id)


@pytest.mark.timeout(120)
def test_concurrent_forwards_from_two_peers_are_merged_and_equal_the_calls_alone(swarm) -> None:
    server, reference = swarm["server"], swarm["reference"]
    clients = swarm["clients"]
    inputs = [torch.randn(rows, HIDDEN) for rows in (3, 4, 2, 5, 1)]
    computations, groups = server.backend.computations, server.backend.batcher.groups

    def forward(i: int) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            with torch.no_grad():
                return clients[i % 2].call_stage(0, inputs[i])

        return call

    outputs = _gated(swarm, False, forward(0), [forward(i) for i in range(1, len(inputs))])
    # the held call alone, then the four that queued meanwhile in one computation
    assert server.backend.computations - computations == 2 and server.backend.batcher.groups - groups == 2
    assert server.backend.batcher.largest >= 4
    with torch.no_grad():
        for x, y in zip(inputs, outputs, strict=True):
            assert isinstance(y, torch.Tensor), y
            torch.testing.assert_close(y, reference(x), **TOLERANCE)


@pytest.mark.timeout(120)
def test_merged_backwards_return_each_callers_gradients_and_sum_parameter_gradients(swarm) -> None:
    server, reference = swarm["server"], swarm["reference"]
    clients = swarm["clients"]
    rows = (2, 3, 4, 1)
    inputs = [torch.randn(n, HIDDEN, requires_grad=True) for n in rows]
    weights = [torch.randn(n, HIDDEN) for n in rows]
    outputs = [clients[i % 2].call_stage(0, x) for i, x in enumerate(inputs)]  # differentiable forwards
    samples, applied, pending = (
        server.backend.samples_processed,
        len(server.backend.applied),
        _pending(server),
    )
    pending_samples, computations = server.shared.pending_samples, server.backend.computations

    def backward(i: int) -> Callable[[], torch.Tensor | None]:
        def call() -> torch.Tensor | None:
            (outputs[i] * weights[i]).sum().backward()
            return inputs[i].grad

        return call

    grads = _gated(swarm, True, backward(0), [backward(i) for i in range(1, len(rows))])
    # the held backward alone, then the three queued meanwhile in one computation
    assert server.backend.computations - computations == 2
    # every request applied once, every sample counted once (towards target_batch_size too)
    assert len(server.backend.applied) - applied == len(rows)
    assert server.backend.samples_processed - samples == sum(rows)
    assert server.shared.pending_samples - pending_samples == sum(rows)

    reference.zero_grad()
    for x, w, y, grad in zip(inputs, weights, outputs, grads, strict=True):
        x_ref = x.detach().clone().requires_grad_(True)
        y_ref = reference(x_ref)
        torch.testing.assert_close(y.detach(), y_ref.detach(), **TOLERANCE)
        (y_ref * w).sum().backward()
        assert isinstance(grad, torch.Tensor), grad
        torch.testing.assert_close(grad, x_ref.grad, **TOLERANCE)
    # the parameter gradients of the merged backwards: the sum of those of the calls alone
    _assert_pending_grew_by(server, pending, reference)


@pytest.mark.timeout(120)
def test_merged_backwards_apply_each_request_id_once_and_only_in_time(swarm) -> None:
    server, reference = swarm["server"], swarm["reference"]
    x = [torch.randn(2, HIDDEN, requires_grad=True) for _ in range(3)]
    g = [torch.randn(2, HIDDEN) for _ in range(3)]
    base = 10**9 + int(time.time() * 1000) % 10**6
    first = _request("backward", x[0], base, g[0])
    fresh = _request("backward", x[1], base + 1, g[1])
    duplicate = _request("backward", x[1], base + 1, g[1])  # a resend of `fresh`, queued next to it
    late = _request("backward", x[2], base + 2, g[2])
    late.commit_by = time.time() - 1  # the caller has retried it elsewhere by now
    applied, samples, pending = (
        len(server.backend.applied),
        server.backend.samples_processed,
        _pending(server),
    )
    computations = server.backend.computations
    replies = _gated(
        swarm,
        True,
        lambda: server.handle(first),
        [lambda r=r: server.handle(r) for r in (fresh, duplicate, late)],
    )
    assert [r.error is None for r in replies] == [True, True, True, False]
    assert replies[3].error.category == UNAVAILABLE and "commit deadline" in replies[3].error.message
    # input gradients for the duplicate too, parameter gradients of `first` and `fresh` only
    assert len(server.backend.applied) - applied == 2 and server.backend.samples_processed - samples == 4
    assert (
        server.backend.computations - computations == 5
    )  # held | merged (not committed) | the three one by one
    reference.zero_grad()
    for i in (0, 1):
        x_ref = x[i].detach().clone().requires_grad_(True)
        (reference(x_ref) * g[i]).sum().backward()
        for reply in (replies[i],) if i == 0 else replies[1:3]:
            torch.testing.assert_close(reply.outputs.tensors[0], x_ref.grad, **TOLERANCE)
    _assert_pending_grew_by(server, pending, reference)


@pytest.mark.timeout(120)
def test_incompatible_calls_run_alone_and_unsplittable_results_fall_back(swarm) -> None:
    server, reference = swarm["server"], swarm["reference"]
    bias = torch.randn(HIDDEN)
    calls = [
        (torch.randn(2, HIDDEN), {}),  # held at the gate
        (torch.randn(2, HIDDEN), {}),  # merges with the next one (other number of rows)
        (torch.randn(3, HIDDEN), {}),
        (torch.randn(2, HIDDEN), {"scale": 2.0}),  # another plain value: alone
        (torch.randn(4, HIDDEN), {"bias": bias}),  # a tensor without the batch dimension: alone
        (torch.randn(4, 8), {}),  # other sizes: alone (the stage's own error)
        (torch.randn(2, HIDDEN), {"count": True}),  # merge, but a 0-d output cannot be split: one by one
        (torch.randn(3, HIDDEN), {"count": True}),
    ]
    requests = [_request("forward", x, 100 + i, **kw) for i, (x, kw) in enumerate(calls)]
    computations, groups = server.backend.computations, server.backend.batcher.groups
    replies: list[StageReply] = _gated(
        swarm, False, lambda: server.handle(requests[0]), [lambda r=r: server.handle(r) for r in requests[1:]]
    )
    # groups: held | 2+3 rows | scale | bias | sizes | count pair; the count pair ran merged, then one by one
    assert server.backend.batcher.groups - groups == 6 and server.backend.computations - computations == 8
    with torch.no_grad():
        for (x, kwargs), reply in zip(calls, replies, strict=True):
            if x.shape[1] != HIDDEN:
                assert reply.error is not None and reply.error.category == COMPUTE
                continue
            assert reply.error is None, reply.error
            expected = reference(x, **kwargs)
            if kwargs.get("count"):
                out, count = reply.outputs.rebuild()
                assert int(count) == x.shape[0]
                expected = expected[0]
            else:
                out = reply.outputs.rebuild()
            torch.testing.assert_close(out, expected, **TOLERANCE)


@pytest.mark.timeout(120)
def test_an_error_in_one_merged_call_does_not_poison_the_others(swarm) -> None:
    server, reference = swarm["server"], swarm["reference"]
    inputs = [torch.randn(2, HIDDEN) for _ in range(4)]
    inputs[2][1, 0] = 999.0  # the stage raises for this call
    requests = [_request("forward", x, 200 + i) for i, x in enumerate(inputs)]
    replies = _gated(
        swarm, False, lambda: server.handle(requests[0]), [lambda r=r: server.handle(r) for r in requests[1:]]
    )
    for i, (x, reply) in enumerate(zip(inputs, replies, strict=True)):
        if i == 2:
            assert reply.error is not None and reply.error.category == COMPUTE
            assert "poisoned row" in reply.error.message
            continue
        assert reply.error is None, reply.error
        with torch.no_grad():
            torch.testing.assert_close(reply.outputs.tensors[0], reference(x), **TOLERANCE)


def test_batching_settings_are_validated_and_batch_norm_is_never_merged() -> None:
    assert mixes_rows(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))) and not mixes_rows(GatedMLP())
    assert SwarmSettings(max_batch_rows=0).max_batch_rows == 0  # off
    for bad in (
        {"max_batch_rows": -1},
        {"max_batch_rows": 2.5},
        {"batch_wait_ms": -1},
        {"batch_wait_ms": 5000},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SwarmSettings(**bad)


class SlowGatedMLP(GatedMLP):
    """A :class:`GatedMLP` whose forward takes 100 ms: longer than merging spares (``MERGE_FORWARD_MAX_S``)."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any):
        time.sleep(0.1)
        return super().forward(x, *args, **kwargs)


@pytest.mark.timeout(120)
def test_slow_training_forwards_are_not_merged_and_keep_their_activations() -> None:
    """Training forwards that queue at a stage whose forward is slow run one by one, each keeping its activations:
    merged, every backward would recompute its forward. (Fast ones still merge, see the tests above.)"""
    torch.manual_seed(0)
    things: list = list(local_dhts(2))
    try:
        server_dht, trainer_dht = things
        module = SlowGatedMLP()
        settings = SwarmSettings(
            run_id=RUN_ID, num_stages=1, compression="none", target_batch_size=10**6, max_batch_rows=64
        )
        server = _held_server(module, server_dht, settings)
        things.append(server.start())
        client = SwarmClient(trainer_dht, settings.replace(request_timeout=30.0, no_peers_timeout=30.0))
        things.append(client)
        client.call_stage(
            0, torch.randn(2, HIDDEN, requires_grad=True)
        ).sum().backward()  # measures a forward
        inputs = [torch.randn(2, HIDDEN, requires_grad=True) for _ in range(4)]
        groups, largest, hits = (
            server.backend.batcher.groups,
            server.backend.batcher.largest,
            server.backend.kept_hits,
        )

        def forward(i: int) -> Callable[[], torch.Tensor]:
            return lambda: client.call_stage(0, inputs[i])

        outputs = _gated(
            {"server": server, "module": module}, True, forward(0), [forward(i) for i in range(1, 4)]
        )
        assert server.backend.batcher.groups - groups == 4 and server.backend.batcher.largest == largest == 1
        for y in outputs:
            assert isinstance(y, torch.Tensor), y
            y.sum().backward()
        assert server.backend.kept_hits - hits == 4  # no backward recomputed its forward
        assert all(x.grad is not None for x in inputs)
    finally:
        for thing in reversed(things):
            thing.shutdown()
