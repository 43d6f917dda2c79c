"""Stage servers and the swarm client over real hivemind DHT/P2P on 127.0.0.1.

Three DHT nodes live in this process: ``trainer`` (runs the SwarmClient) and two server peers. Each test uses
its own run id, so their records and handlers do not interfere.
"""

from __future__ import annotations

import copy
import io
import itertools
import signal
import threading
import time

import hivemind
import pytest
import torch
from hivemind.p2p.p2p_daemon_bindings.utils import P2PHandlerError
from hivemind.proto import runtime_pb2
from torch import nn

from lightning_swarm.swarm.client.client import SwarmClient
from lightning_swarm.swarm.client.routing import NoPeersError
from lightning_swarm.swarm.loop import run_coroutine
from lightning_swarm.swarm.server import StageServer
from lightning_swarm.swarm.server.stage_backend import StageBackend
from lightning_swarm.swarm.settings import SwarmSettings
from lightning_swarm.swarm.wire import quantize
from lightning_swarm.swarm.wire.errors import RemoteStageError
from lightning_swarm.swarm.wire.payload import Payload
from lightning_swarm.swarm.wire.protocol import StageRequest, parse_reply, stage_uid
from lightning_swarm.swarm.wire.same_host import SameHostStub

_run_ids = itertools.count()


def _run_id(name: str) -> str:
    return f"{name}-{next(_run_ids)}"


def _sgd(lr: float = 0.1):
    return lambda params: torch.optim.SGD(params, lr=lr)


def _serve(
    cleanup: list,
    dht: hivemind.DHT,
    run_id: str,
    module: nn.Module,
    stage: int = 0,
    *,
    optimizer_factory=None,
    cls: type = StageServer,
    throughput: float = 1.0,
    param_groups=None,
    **settings,
) -> StageServer:
    settings.setdefault("target_batch_size", 10**6)
    settings.setdefault("compression", "none")
    server = cls(
        stage,
        module,
        dht=dht,
        settings=SwarmSettings(run_id=run_id, **settings),
        optimizer_factory=_sgd() if optimizer_factory is None else optimizer_factory,
        param_groups=param_groups,
        throughput=throughput,
    )
    cleanup.append(server)
    return server.start()


def _client(
    cleanup: list, dht: hivemind.DHT, run_id: str, num_stages: int = 1, local_servers=None, **settings
) -> SwarmClient:
    settings.setdefault("compression", "none")
    settings.setdefault("no_peers_timeout", 10.0)
    settings.setdefault("request_timeout", 10.0)
    client = SwarmClient(dht, SwarmSettings(run_id=run_id, num_stages=num_stages, **settings), local_servers)
    cleanup.append(client)
    return client


class MixedStage(nn.Module):
    """A stage taking two differentiable tensors, plain values and keyword arguments, with nested outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.gate = nn.Linear(8, 8)

    def forward(self, x, h, scale: float, *, mask: torch.Tensor, mode: str = "add", extra=None):
        assert mode == "mul" and extra == {"k": [1, None]}
        out = torch.nn.functional.gelu(self.proj(x)) * scale + self.gate(h) * mask.unsqueeze(-1)
        return out, {"aux": (h * x).sum(-1), "count": (mask > 0).sum()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["remote", "p2p", "local"])
def test_forward_backward_match_local_autograd(dhts, cleanup, where: str) -> None:
    """``remote``: another peer of this machine (its same-host socket); ``p2p``: the same over the p2p daemons."""
    torch.manual_seed(0)
    run_id = _run_id("exact")
    simple = nn.Sequential(nn.Linear(16, 32), nn.GELU())
    mixed = MixedStage()
    reference = [nn.Sequential(nn.Linear(16, 32), nn.GELU()), MixedStage()]
    reference[0].load_state_dict(simple.state_dict())
    reference[1].load_state_dict(mixed.state_dict())
    host = dhts["trainer"] if where == "local" else dhts["server1"]
    servers = [_serve(cleanup, host, run_id, simple, stage=0), _serve(cleanup, host, run_id, mixed, stage=1)]
    local = {0: servers[0], 1: servers[1]} if where == "local" else None
    client = _client(
        cleanup, dhts["trainer"], run_id, num_stages=2, local_servers=local, same_host=where != "p2p"
    )

    x = torch.randn(4, 16, requires_grad=True)
    h = torch.randn(4, 8, requires_grad=True)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    extra = {"k": [1, None]}

    y = client.call_stage(0, x)
    out, aux = client.call_stage(1, y[:, :8], h, 0.5, mask=mask, mode="mul", extra=extra)
    loss = out.pow(2).sum() + aux["aux"].sum()
    loss.backward()

    x_ref, h_ref = x.detach().clone().requires_grad_(), h.detach().clone().requires_grad_()
    y_ref = reference[0](x_ref)
    out_ref, aux_ref = reference[1](y_ref[:, :8], h_ref, 0.5, mask=mask, mode="mul", extra=extra)
    (out_ref.pow(2).sum() + aux_ref["aux"].sum()).backward()

    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=0)
    assert aux["count"].item() == 3 and not aux["count"].requires_grad
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(h.grad, h_ref.grad, atol=1e-5, rtol=0)
    # parameter gradients were accumulated on the servers (and consumed by the hivemind optimizer)
    assert servers[1].backend.samples_processed == 4 and servers[0].backend.samples_processed == 4
    stats = client.stats()
    if where != "local":
        accepted = sum(server._same_host.accepted for server in servers)
        assert accepted == (0 if where == "p2p" else 2)  # a channel to each stage's server
        assert stats["swarm/stage1/forward_bytes_sent"] > 0 and stats["swarm/stage1/backward_bytes_recv"] > 0
        assert stats["swarm/bytes_sent"] == sum(
            v for k, v in stats.items() if k.endswith("/bytes_sent") and "/stage" in k
        )
        # the calls' float tensors as fp32: at least x and h sent, x's and h's gradients received
        assert stats["swarm/fp32_bytes"] >= 4 * 2 * (x.numel() + h.numel())
    else:  # short-circuited, nothing serialised (nor counted as fp32: no boundary was crossed)
        assert stats.get("swarm/bytes_sent", 0) == 0 and stats.get("swarm/fp32_bytes", 0) == 0

    with torch.no_grad():  # eval path: no autograd function, same numbers
        torch.testing.assert_close(client.call_stage(0, x), y_ref, atol=1e-5, rtol=0)


@pytest.mark.timeout(120)
def test_stage_without_differentiable_inputs_still_trains(dhts, cleanup) -> None:
    torch.manual_seed(0)
    run_id = _run_id("embed")
    embedding = nn.Embedding(10, 4)
    before = embedding.weight.detach().clone()
    _serve(cleanup, dhts["server1"], run_id, embedding, optimizer_factory=_sgd(1.0), target_batch_size=3)
    client = _client(cleanup, dhts["trainer"], run_id)
    tokens = torch.tensor([1, 2, 3])
    out = client.call_stage(0, tokens)
    assert out.requires_grad
    out.sum().backward()
    after = client.fetch_stage_state(0)["weight"]
    assert not torch.equal(after[1:4], before[1:4]) and torch.equal(after[4:], before[4:])


@pytest.mark.timeout(120)
def test_8bit_and_large_payloads_use_streaming(dhts, cleanup) -> None:
    torch.manual_seed(0)
    run_id = _run_id("large")
    expand = nn.Linear(64, 8192, bias=False)  # 100 KiB in, 3 MiB out: the response is streamed
    _serve(cleanup, dhts["server1"], run_id, expand, stage=0)
    _serve(cleanup, dhts["server1"], run_id, nn.Identity(), stage=1, compression="8bit")
    client = _client(cleanup, dhts["trainer"], run_id, num_stages=2, request_timeout=30.0)
    x = torch.randn(96, 64, requires_grad=True)
    y = client.call_stage(0, x)
    torch.testing.assert_close(y, expand(x), atol=1e-5, rtol=0)
    big = torch.randn(160, 4096, requires_grad=True)  # 2.5 MiB request in fp32: streamed
    z = client.call_stage(1, big)
    assert ((z - big).norm() / big.norm()).item() < 0.02  # server replies in 8-bit
    (z.sum() + y.sum()).backward()
    assert big.grad is not None and ((big.grad - 1).abs().max()).item() < 0.02
    assert x.grad is not None and x.grad.shape == x.shape
    client8 = _client(cleanup, dhts["trainer"], run_id, num_stages=2, compression="8bit")
    client8.call_stage(1, big.detach())
    assert client8.stats()["swarm/stage1/forward_bytes_sent"] < 0.27 * big.numel() * 4


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, a, b):
        return a * self.scale + b, a - b * self.scale


@pytest.mark.timeout(120)
def test_several_tensors_below_the_split_size_travel_as_one_message_each_way(dhts, cleanup) -> None:
    """Two 128 KB tensors (no tensor split): forward and backward each make one round trip."""
    run_id = _run_id("pair")
    module = Pair()
    _serve(cleanup, dhts["server1"], run_id, module)
    client = _client(cleanup, dhts["trainer"], run_id)
    a = torch.randn(64, 512, requires_grad=True)
    b = torch.randn(64, 512, requires_grad=True)
    u, v = client.call_stage(0, a, b)
    torch.testing.assert_close(u, a * 2 + b, atol=1e-5, rtol=0)
    (u.sum() + 2 * v.sum()).backward()
    torch.testing.assert_close(a.grad, torch.full_like(a, 4.0), atol=1e-5, rtol=0)
    torch.testing.assert_close(b.grad, torch.full_like(b, -3.0), atol=1e-5, rtol=0)
    stats = client.stats()
    assert stats["swarm/stage0/forward_calls"] == 1 and stats["swarm/stage0/backward_calls"] == 1
    assert "swarm/bans" not in stats


class RefusingBackend(StageBackend):
    """Cannot serve any call (it replies with an "unavailable" error)."""

    def _forward(self, inputs):
        raise MemoryError("this peer is out of memory")

    _backward = _forward


class RefusingServer(StageServer):
    """A peer that announces itself but cannot serve any call (it replies with an "unavailable" error)."""

    backend_class = RefusingBackend


@pytest.mark.timeout(120)
def test_failing_and_dead_peers_are_banned_and_calls_retried(dhts, cleanup) -> None:
    torch.manual_seed(0)
    module = nn.Linear(4, 4)
    for scenario in ("refusing", "dead"):
        run_id = _run_id(scenario)
        good = _serve(cleanup, dhts["server1"], run_id, module)
        if scenario == "refusing":
            bad = _serve(cleanup, dhts["server2"], run_id, nn.Linear(4, 4), cls=RefusingServer)
        else:
            bad = _serve(cleanup, dhts["server2"], run_id, nn.Linear(4, 4))
            bad.shutdown()  # its DHT record stays until it expires
        client = _client(cleanup, dhts["trainer"], run_id, request_timeout=5.0)
        assert {p.peer_id for p in client.peers(0)} == {good.peer_id, bad.peer_id}
        for _ in range(4):
            x = torch.randn(2, 4, requires_grad=True)
            y = client.call_stage(0, x)
            torch.testing.assert_close(y, module(x), atol=1e-5, rtol=0)
            y.sum().backward()
        stats = client.stats()
        assert stats["swarm/bans"] == 1 and stats["swarm/retries"] == 1, (scenario, stats)
        assert client.routers[0].is_banned(bad.peer_id) and not client.routers[0].is_banned(good.peer_id)


class BadBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("user backward exploded")


class UserBugs(nn.Module):
    """A stage whose own code fails: a shape mismatch in forward, or a ValueError in its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, explode_backward: bool = False):
        y = self.linear(x)
        return BadBackward.apply(y) if explode_backward else y


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["remote", "local"])
def test_errors_of_the_stage_code_reach_the_trainer_at_once(dhts, cleanup, where: str) -> None:
    """An error raised by the user's block is the user's error: raised at once with the remote type and message,
    and no healthy peer is banned (before, every peer was banned in turn and NoPeersError came a minute later)."""
    run_id = _run_id(f"user-error-{where}")
    host = dhts["server1"] if where == "remote" else dhts["trainer"]
    servers = [_serve(cleanup, host, run_id, torch.manual_seed(0) and UserBugs())]
    if where == "remote":
        servers.append(_serve(cleanup, dhts["server2"], run_id, torch.manual_seed(0) and UserBugs()))
    local = {0: servers[0]} if where == "local" else None
    client = _client(cleanup, dhts["trainer"], run_id, local_servers=local, no_peers_timeout=30.0)
    assert len(client.peers(0)) == len(servers)
    start = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"Stage 0 raised RuntimeError: mat1 and mat2 shapes cannot be multiplied"
    ):
        client.call_stage(0, torch.randn(2, 5))  # wrong width for the Linear
    x = torch.randn(2, 4, requires_grad=True)
    y = client.call_stage(0, x, explode_backward=True)
    with pytest.raises(ValueError, match="user backward exploded") as info:
        y.sum().backward()
    assert isinstance(info.value, RemoteStageError) and info.value.is_compute_error and info.value.stage == 0
    from lightning_swarm.swarm.wire.codec import CodecError

    with pytest.raises(CodecError, match="cannot cross a stage boundary"):  # the caller's own mistake
        client.call_stage(0, torch.zeros(2, 4, dtype=torch.float8_e4m3fn))
    with pytest.raises(CodecError, match="Cannot send a object"):
        client.call_stage(0, torch.zeros(2, 4), object())
    assert time.monotonic() - start < 10.0
    assert "swarm/bans" not in client.stats() and client.routers[0].num_live() == len(servers)
    x = torch.randn(2, 4)  # the peers still serve
    torch.testing.assert_close(client.call_stage(0, x), servers[0].module.linear(x), atol=1e-5, rtol=0)


@pytest.mark.timeout(60)
def test_no_peers_raises_after_bounded_wait(dhts, cleanup) -> None:
    client = _client(cleanup, dhts["trainer"], _run_id("empty"), num_stages=2, no_peers_timeout=1.0)
    with pytest.raises(NoPeersError, match=r"stage 1 of run 'empty-\d+': 0 known.*Waited 1\.0 s"):
        client.call_stage(1, torch.randn(2, 3))


def _request_message(run_id: str, inputs: Payload, kind: str = "forward", uid: str | None = None, **header):
    """One channel request message, built the way the client builds it (then tampered with by the caller)."""
    from lightning_swarm.swarm.wire.transport import encode_request

    request = StageRequest(kind, uid or stage_uid(run_id, 0), inputs, request_id=header.pop("request_id", 7))
    metadata, encoded = encode_request(request, "none")
    tensors = [part for payload in encoded for part in payload.parts()]
    return runtime_pb2.ExpertRequest(tensors=tensors, metadata=metadata)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("same_host", [True, False], ids=["same-host", "p2p"])
def test_every_bad_request_gets_an_error_reply_and_the_channel_survives(
    dhts, cleanup, same_host: bool
) -> None:
    import msgpack

    from lightning_swarm.swarm.wire.transport import _Channel

    run_id = _run_id("channel")
    module = nn.Linear(3, 3)
    server = _serve(cleanup, dhts["server1"], run_id, module)
    client = _client(cleanup, dhts["trainer"], run_id, same_host=same_host)
    client.peers(0)
    channel = _Channel(client.transport(server.peer_id, 0).stub)
    assert server._same_host is not None and isinstance(channel.stub, SameHostStub) is same_host
    x0 = torch.randn(2, 3)
    good = _request_message(run_id, Payload.call((x0,), {}))
    header = msgpack.unpackb(good.metadata)

    def with_header(**changes) -> runtime_pb2.ExpertRequest:
        fields = dict(
            zip(
                [
                    "version",
                    "kind",
                    "request_id",
                    "uid",
                    "inputs",
                    "grads",
                    "commit_by",
                    "forward_id",
                    "training",
                    "seed",
                    "epoch",
                    "buffers",
                ],
                header,
                strict=True,
            )
        )
        fields.update(changes)
        return runtime_pb2.ExpertRequest(tensors=good.tensors, metadata=msgpack.packb(list(fields.values())))

    truncated = runtime_pb2.Tensor()
    truncated.CopyFrom(good.tensors[0])
    truncated.buffer = truncated.buffer[:5]
    bad_requests = {
        # another peer of the stage may take these: the trainer retries there
        "unavailable": [
            with_header(uid="other.stage0"),  # a stage this peer does not serve
            with_header(version=99),
        ],
        # the request's own content: every peer would refuse it
        "request": [
            runtime_pb2.ExpertRequest(tensors=good.tensors, metadata=b"\xc1garbage"),
            with_header(kind="explode"),
            runtime_pb2.ExpertRequest(tensors=[], metadata=good.metadata),  # a tensor missing
            runtime_pb2.ExpertRequest(tensors=[truncated], metadata=good.metadata),
            with_header(kind="backward"),  # a backward without output gradients
            with_header(forward_id="7"),  # the forward id must be an integer
            with_header(training=1),  # the mode is a bool
            with_header(seed=-1),  # the seed is a 63-bit non-negative integer
            with_header(seed=1 << 63),
            with_header(epoch=-1),  # the stage's epoch as the trainer saw it: a non-negative integer or None
            with_header(epoch="3"),
            with_header(buffers="yes"),  # whether a train-mode forward updates the buffers: true or false
        ],
        "compute": [_request_message(run_id, Payload.call((torch.randn(2, 5),), {}))],  # wrong width
    }
    for category, requests in bad_requests.items():
        for request in requests:  # each gets an error reply over the one channel, which stays open
            reply_header, tensors, _, _ = channel.call(iter([request]), timeout=15)
            reply = parse_reply(reply_header, tensors)
            assert reply.error is not None and reply.error.category == category, (
                request.metadata[:40],
                reply,
            )
    reply = parse_reply(*channel.call(iter([good]), timeout=15)[:2])
    assert reply.error is None and reply.request_id == 7 and reply.outputs is not None
    torch.testing.assert_close(reply.outputs.rebuild(), module(x0), atol=1e-6, rtol=0)
    channel.close()
    # the other RPCs refuse a wrong stage too
    from lightning_swarm.swarm.wire.transport import TransportError, decode_payload_stream

    stub = client.transport(server.peer_id, 0).stub
    wrong = runtime_pb2.ExpertUID(uid="other.stage0")
    with pytest.raises(P2PHandlerError, match="serves"):
        run_coroutine(stub.rpc_info(wrong, timeout=10), timeout=15)

    async def fetch():
        return [message async for message in await stub.rpc_state(wrong)]

    with pytest.raises(TransportError, match="ended before its last message"):
        decode_payload_stream(run_coroutine(fetch(), timeout=15))

    # the client keeps one channel per peer and stage across calls ...
    for _ in range(3):
        x = torch.randn(2, 3, requires_grad=True)
        client.call_stage(0, x).sum().backward()
    transport = client.transport(server.peer_id, 0)
    (kept,) = transport._idle
    assert kept.calls == 6 and transport.channels_opened == 1  # 3 forwards and 3 backwards

    # ... and replaces one that broke after it had worked (e.g. the daemon dropped it), without banning the peer
    async def broken():
        raise ConnectionError("stream reset")
        yield  # pragma: no cover

    kept._replies = broken()
    x = torch.randn(2, 3)
    torch.testing.assert_close(client.call_stage(0, x), module(x), atol=1e-5, rtol=0)
    assert client.stats().get("swarm/bans", 0) == 0 and transport.channels_opened == 2
    infos = client.stage_info(0)
    assert len(infos) == 1 and infos[0]["stage"] == 0 and infos[0]["throughput"] > 0


@pytest.mark.timeout(120)
def test_concurrent_calls_to_one_peer_open_more_channels(dhts, cleanup) -> None:
    from concurrent.futures import ThreadPoolExecutor

    run_id = _run_id("concurrent")

    class Slow(nn.Module):  # slow enough that calls from two threads overlap
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.05)
            return self.linear(x)

    module = Slow()
    _serve(cleanup, dhts["server1"], run_id, module)
    client = _client(cleanup, dhts["trainer"], run_id)
    inputs = [torch.randn(4, 8) for _ in range(8)]
    with ThreadPoolExecutor(4) as pool, torch.no_grad():
        outputs = list(pool.map(lambda x: client.call_stage(0, x), inputs))
    for x, y in zip(inputs, outputs, strict=True):
        torch.testing.assert_close(y, module.linear(x), atol=1e-5, rtol=0)
    (transport,) = client._transports.values()
    assert 2 <= transport.channels_opened <= 4  # one per thread at most, reused afterwards
    assert client.stats()["swarm/stage0/forward_calls"] == len(inputs) and "swarm/bans" not in client.stats()


@pytest.mark.timeout(120)
def test_state_and_optimizer_step_after_target_batch(dhts, cleanup) -> None:
    torch.manual_seed(0)
    run_id = _run_id("optim")
    module = nn.Linear(5, 3)
    initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
    lr, batch, target = 0.5, 4, 8
    server = _serve(
        cleanup, dhts["server1"], run_id, module, optimizer_factory=_sgd(lr), target_batch_size=target
    )
    client = _client(cleanup, dhts["trainer"], run_id)

    state = client.fetch_stage_state(0)
    assert state.keys() == initial.keys() and all(torch.equal(state[k], initial[k]) for k in initial)

    reference = nn.Linear(5, 3)
    reference.load_state_dict(initial)
    inputs = [torch.randn(batch, 5) for _ in range(target // batch)]
    for i, x in enumerate(inputs):
        client.call_stage(0, x).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
        if i < len(inputs) - 1:  # not yet at the target batch size: the parameters must not move
            assert all(torch.equal(v, initial[k]) for k, v in client.fetch_stage_state(0).items())
    # hivemind averages the microbatch gradients (equal sizes: their mean), then SGD steps once
    expected = {k: initial[k] - lr * p.grad / len(inputs) for k, p in reference.named_parameters()}
    after = client.fetch_stage_state(0)
    for k in expected:
        torch.testing.assert_close(after[k], expected[k], atol=1e-5, rtol=0)
    assert server.info()["epoch"] == 1


def test_starting_a_stage_never_leaves_this_process_ignoring_ctrl_c(dhts, cleanup) -> None:
    """hivemind's averagers set SIGINT to be ignored in the process that starts them, for as long as they start: a
    Ctrl-C then is lost. Starting a stage (two averagers) leaves this process's SIGINT as it is throughout, and
    the forked averagers ignore SIGINT themselves."""
    assert threading.current_thread() is threading.main_thread()
    # Python's own Ctrl-C handler, even where this process started with SIGINT ignored (a background CI job)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    seen: set = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.add(signal.getsignal(signal.SIGINT))
            time.sleep(0.0002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        server = _serve(cleanup, dhts["server1"], _run_id("sigint"), nn.Linear(3, 3), target_batch_size=4)
    finally:
        done.set()
        watcher.join()
        after = signal.signal(signal.SIGINT, previous)
    assert seen == {signal.default_int_handler} and after is signal.default_int_handler
    averagers = [server.optimizer.state_averager, server.optimizer.grad_averager]
    assert all(a is not None and a.is_alive() for a in averagers)
    for averager in averagers:
        with open(f"/proc/{averager.pid}/status") as f:
            ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
        assert ignored & (1 << (signal.SIGINT - 1)), f"averager {averager.pid} does not ignore SIGINT"


@pytest.mark.timeout(120)
def test_backwards_that_pile_up_between_steps_count_once_each(dhts, cleanup) -> None:
    """Three backwards served while the stage's optimizer is busy reach it as one summed gradient, a fourth
    alone: the epoch's update is still the mean of the four (before, the three counted three times over and the
    fourth a third)."""
    torch.manual_seed(1)
    run_id = _run_id("pileup")
    module = nn.Linear(5, 3)
    initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
    lr, batch, n = 0.5, 4, 4
    server = _serve(
        cleanup, dhts["server1"], run_id, module, optimizer_factory=_sgd(lr), target_batch_size=n * batch
    )
    client = _client(cleanup, dhts["trainer"], run_id)
    reference = nn.Linear(5, 3)
    reference.load_state_dict(initial)
    inputs = [torch.randn(batch, 5) for _ in range(n)]
    with server.stepper.step_lock:  # the stepper cannot take the gradients until all three are in
        for x in inputs[:3]:
            client.call_stage(0, x).pow(2).mean().backward()
    server.flush(timeout=30)
    assert all(torch.equal(v, initial[k]) for k, v in client.fetch_stage_state(0).items())
    client.call_stage(0, inputs[3]).pow(2).mean().backward()
    for x in inputs:
        reference(x).pow(2).mean().backward()
    expected = {k: initial[k] - lr * p.grad / n for k, p in reference.named_parameters()}
    after = client.fetch_stage_state(0)
    for k in expected:
        torch.testing.assert_close(after[k], expected[k], atol=1e-5, rtol=0)
    assert server.info()["epoch"] == 1


def test_the_served_parameters_follow_in_place_writes_and_unchanged_ones_are_not_compared(
    dhts, cleanup, monkeypatch
) -> None:
    """A swarm-driven stage serves copies of its optimizer's parameters, refreshed after every backward. The refresh
    compares the two only when an in-place write (the optimizer's step, hivemind's averaging ``copy_``) bumped a
    parameter's version counter: comparing every element cost two reads of the stage's parameters a backward."""
    server = _serve(cleanup, dhts["server1"], _run_id("versions"), nn.Linear(8, 8), stage_steps="async")
    assert not server.shared.shared_master  # swarm-driven: the served parameters are copies
    compared = []
    real_equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: compared.append(1) or real_equal(a, b))

    def refresh() -> int:
        compared.clear()
        with server.stepper.step_lock:
            server.stepper.refresh_parameters()
        return len(compared)

    refresh()  # the first refresh compares (nothing known yet)
    assert refresh() == 0
    with torch.no_grad():
        server.shared.master[0].copy_(
            torch.full_like(server.shared.master[0], 0.5)
        )  # as an averaging round writes them
    assert refresh() == 2  # both parameters compared, the changed one copied
    torch.testing.assert_close(server.module.weight.detach(), torch.full((8, 8), 0.5))
    assert refresh() == 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["remote", "local"])
def test_a_backward_reuses_its_kept_forward_unless_the_parameters_changed(dhts, cleanup, where: str) -> None:
    """The backward goes to the peer that served its forward, which answers it from the kept graph (the module
    runs once for both); after a parameter refresh in between, or with ``keep_activations=0``, it recomputes. The
    gradients are those of local autograd in every case."""
    torch.manual_seed(3)
    run_id = _run_id(f"kept{where}")
    module = MixedStage()
    reference = copy.deepcopy(module)  # the server's stepper writes its module's parameters
    server = _serve(cleanup, dhts["server1"], run_id, module, throughput=1e6)
    other = _serve(cleanup, dhts["server2"], run_id, copy.deepcopy(module), throughput=1e6)
    local = {0: server} if where == "local" else None
    client = _client(  # one call per batch: this counts the module's runs per call (see test_microbatches.py)
        cleanup,
        dhts["trainer" if where == "remote" else "server1"],
        run_id,
        local_servers=local,
        microbatches=1,
    )
    assert len(client.peers(0)) == 2

    def call(refresh: bool = False) -> None:
        x, h = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
        mask = torch.rand(3)
        kwargs = {"mask": mask, "mode": "mul", "extra": {"k": [1, None]}}
        out, aux = client.call_stage(0, x, h, 0.5, **kwargs)
        if refresh:  # as after an optimizer step: the kept forward saw other values
            for s in (server, other):
                with torch.no_grad():
                    s.shared.master[0].add_(1.0)
                s.stepper.refresh_parameters()
                with torch.no_grad():
                    s.shared.master[0].sub_(1.0)
                s.stepper.refresh_parameters()
        (out.sum() + aux["aux"].pow(2).sum()).backward()
        rx, rh = x.detach().requires_grad_(True), h.detach().requires_grad_(True)
        rout, raux = reference(rx, rh, 0.5, **kwargs)
        (rout.sum() + raux["aux"].pow(2).sum()).backward()
        torch.testing.assert_close(x.grad, rx.grad, atol=1e-5, rtol=0)
        torch.testing.assert_close(h.grad, rh.grad, atol=1e-5, rtol=0)

    def runs() -> tuple[int, int]:
        return (
            server.backend.computations + other.backend.computations,
            server.backend.kept_hits + other.backend.kept_hits,
        )

    for _ in range(4):
        before, hits = runs()
        call()
        assert runs() == (before + 1, hits + 1)  # one run of the module, and the backward used it
    before, hits = runs()
    call(refresh=True)
    assert runs() == (before + 2, hits)  # recomputed
    assert not server.shared.kept and not other.shared.kept  # every kept forward was taken by its backward
    client.settings = client.settings.replace(keep_activations=0)
    before, hits = runs()
    call()
    assert runs() == (before + 2, hits)


@pytest.mark.timeout(180)
def test_new_parameters_wait_for_the_backwards_of_kept_forwards(dhts, cleanup) -> None:
    """Two microbatches in flight across an optimizer step: the step's new parameters are served only after the
    second backward, which reuses its kept forward (a gradient at the parameters its forward saw); both steps
    are applied in the end."""
    torch.manual_seed(4)
    run_id = _run_id("defer")
    module = nn.Linear(6, 6)
    initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
    lr, rows = 0.5, 3
    server = _serve(
        cleanup, dhts["server1"], run_id, module, optimizer_factory=_sgd(lr), target_batch_size=rows
    )
    client = _client(cleanup, dhts["trainer"], run_id)
    reference = nn.Linear(6, 6)
    reference.load_state_dict(initial)
    xa, xb = torch.randn(rows, 6), torch.randn(rows, 6)
    ya, yb = client.call_stage(0, xa), client.call_stage(0, xb)  # both forwards kept, same parameters
    ya.pow(2).sum().backward()  # one epoch: the optimizer steps, and its parameters wait for b's backward
    deadline = time.monotonic() + 60
    while server.shared.refresh_pending_since is None:
        assert time.monotonic() < deadline, "the stage never stepped"
        time.sleep(0.05)
    served = {k: v.detach().clone() for k, v in module.state_dict().items()}
    assert all(torch.equal(served[k], initial[k]) for k in initial)  # still the parameters b's forward saw
    yb.pow(2).sum().backward()
    assert server.backend.kept_hits == 2
    ga = torch.autograd.grad(reference(xa).pow(2).sum(), list(reference.parameters()))
    gb = torch.autograd.grad(reference(xb).pow(2).sum(), list(reference.parameters()))
    expected = {
        name: initial[name] - lr * (a + b)
        for (name, _), a, b in zip(reference.named_parameters(), ga, gb, strict=True)
    }
    server.flush(timeout=30)
    deadline = time.monotonic() + 30
    while server.optimizer.local_epoch < 2:
        assert time.monotonic() < deadline, "the second step never came"
        time.sleep(0.05)
    after = client.fetch_stage_state(0)
    for k in expected:
        torch.testing.assert_close(after[k], expected[k], atol=1e-5, rtol=0)
    assert server.shared.refresh_pending_since is None


class _Aliasing(nn.Module):
    """``x + p + q.sum()``: autograd hands ``x`` and ``p`` the very same gradient tensor, and ``q`` an expanded
    one; the server's pending sum adds into the first backward's gradients in place, so it must copy these."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(4, 5))
        self.q = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.p + self.q.sum()


@pytest.mark.timeout(120)
def test_gradients_shared_between_inputs_and_parameters_are_not_summed_into_the_reply(dhts, cleanup) -> None:
    torch.manual_seed(2)
    run_id = _run_id("alias")
    module = _Aliasing()
    initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
    lr, n = 0.5, 3
    server = _serve(
        cleanup, dhts["server1"], run_id, module, optimizer_factory=_sgd(lr), target_batch_size=4 * n
    )
    client = _client(cleanup, dhts["trainer"], run_id)
    reference = _Aliasing()
    reference.load_state_dict(initial)
    xs = [torch.randn(4, 5, requires_grad=True) for _ in range(n)]
    weights = [torch.randn(4, 5) for _ in range(n)]
    with server.stepper.step_lock:  # the backwards pile up in the pending sum
        for x, w in zip(xs, weights, strict=True):
            (client.call_stage(0, x) * w).sum().backward()
            torch.testing.assert_close(x.grad, w)  # the input gradient is this call's own, nothing added
    for x, w in zip(xs, weights, strict=True):
        (reference(x.detach()) * w).sum().backward()
    expected = {k: initial[k] - lr * p.grad / n for k, p in reference.named_parameters()}
    after = client.fetch_stage_state(0)
    for k in expected:
        torch.testing.assert_close(after[k], expected[k], atol=1e-5, rtol=0)


@pytest.mark.timeout(120)
def test_stage_output_is_forwarded_without_requantizing(dhts, cleanup) -> None:
    run_id = _run_id("reuse")
    _serve(cleanup, dhts["server1"], run_id, nn.Identity(), stage=0, compression="8bit")
    _serve(cleanup, dhts["server1"], run_id, nn.Identity(), stage=1, compression="none")
    client = _client(cleanup, dhts["trainer"], run_id, num_stages=2, compression="8bit")
    x = torch.randn(64, 256, requires_grad=True)
    y = client.call_stage(0, x)  # quantized by the client, then by the stage-0 server
    calls = quantize.quantizations.calls
    z = client.call_stage(1, y)  # y is sent as the very message it arrived in
    assert quantize.quantizations.calls == calls
    assert torch.equal(z, y)  # stage 1 replies losslessly: it received exactly y
    z.sum().backward()
    assert x.grad is not None and ((x.grad - 1).abs().max()).item() < 0.02


@pytest.mark.timeout(60)
def test_malformed_and_expired_records_are_skipped(dhts) -> None:
    from hivemind.utils.timed_storage import get_dht_time

    from lightning_swarm.swarm.dht.records import declare_stage_peer, get_stage_peers
    from lightning_swarm.swarm.dht.validation import stage_key

    run_id = _run_id("records")
    dht = dhts["server1"]
    now = get_dht_time()
    assert declare_stage_peer(dht, run_id, 2, dht.peer_id, 12.5, now + 30)
    key = stage_key(run_id, 2)
    dht.store(key, subkey="not-a-peer-id!", value=[1.0], expiration_time=now + 30)
    dht.store(key, subkey=dhts["server2"].peer_id.to_base58(), value="fast", expiration_time=now + 30)
    dht.store(key, subkey=dhts["trainer"].peer_id.to_base58(), value=[-3.0], expiration_time=now + 30)
    peers = get_stage_peers(dhts["trainer"], run_id, 2)
    assert [(p.peer_id, p.stage, p.throughput) for p in peers] == [(dht.peer_id, 2, 12.5)]
    assert get_stage_peers(dhts["trainer"], run_id, 3) == []

    # an entry whose expiration has passed (the DHT may still hand it out) is not a live peer
    from hivemind.utils.timed_storage import ValueWithExpiration

    from lightning_swarm.swarm.dht.records import parse_stage_peers

    listing = ValueWithExpiration(
        {
            dht.peer_id.to_base58(): ValueWithExpiration([2.0], now + 30),
            dhts["server2"].peer_id.to_base58(): ValueWithExpiration([2.0], now - 1),
        },
        now + 30,
    )
    assert [p.peer_id for p in parse_stage_peers(listing, 2, now=now)] == [dht.peer_id]
    assert parse_stage_peers(ValueWithExpiration("garbage", now + 30), 2) == []


@pytest.mark.timeout(120)
def test_stage_server_steps_with_the_users_parameter_groups(dhts, cleanup) -> None:
    """Each of the user's parameter groups keeps its own hyper-parameters on the stage server (before, every
    parameter was stepped with ``optimizer.defaults``)."""
    from lightning_swarm.swarm.training.optimizer_template import stage_optimizer

    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    decay = {"params": [whole[0].weight, whole[1].weight], "weight_decay": 0.5}
    no_decay = {"params": [whole[0].bias, whole[1].bias], "lr": 1.0, "weight_decay": 0.0}
    users = torch.optim.SGD([decay, no_decay], lr=0.1)
    stage = whole[1:]  # the stage serves the second Linear only
    reference = copy.deepcopy(stage)
    factory, groups = stage_optimizer(users, stage)
    assert [(g["lr"], g["weight_decay"], len(g["params"])) for g in groups] == [(0.1, 0.5, 1), (1.0, 0.0, 1)]
    run_id = _run_id("groups")
    _serve(
        cleanup,
        dhts["server1"],
        run_id,
        stage,
        optimizer_factory=factory,
        param_groups=groups,
        target_batch_size=4,
    )
    client = _client(cleanup, dhts["trainer"], run_id)
    x = torch.randn(4, 4)
    client.call_stage(0, x).pow(2).sum().backward()
    ref_opt = torch.optim.SGD(
        [
            {"params": [reference[0].weight], "weight_decay": 0.5},
            {"params": [reference[0].bias], "lr": 1.0, "weight_decay": 0.0},
        ],
        lr=0.1,
    )
    reference(x).pow(2).sum().backward()
    ref_opt.step()
    after = client.fetch_stage_state(0)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(after[key], value, atol=1e-5, rtol=0)


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.1)
        return grad


class TimedStage(nn.Module):
    """A stage whose forward is fast and whose backward takes 0.1 s."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return SlowBackward.apply(self.linear(x))


@pytest.mark.timeout(120)
def test_throughput_is_announced_in_samples_per_second_of_forward_and_backward(dhts, cleanup) -> None:
    """One unit from the first estimate onwards: forward-only calls do not move it, and the first measured
    forward + backward replaces the estimate (before, forward-only timings were averaged into it)."""
    from lightning_swarm.swarm.dht.records import get_stage_peers

    run_id = _run_id("throughput")
    server = _serve(cleanup, dhts["server1"], run_id, TimedStage(), throughput=1000.0)
    client = _client(cleanup, dhts["trainer"], run_id)
    with torch.no_grad():
        for _ in range(3):
            client.call_stage(0, torch.randn(4, 8))
    assert server.info()["throughput"] == 1000.0  # the estimate, not a forward-only figure
    x = torch.randn(4, 8, requires_grad=True)
    client.call_stage(0, x).sum().backward()
    measured = server.info()["throughput"]
    assert 4 / 1.0 < measured < 4 / 0.1  # 4 samples, forward + backward >= 0.1 s
    server._announce()
    assert get_stage_peers(dhts["trainer"], run_id, 0)[0].throughput == pytest.approx(measured)


@pytest.mark.timeout(180)
def test_an_optimizer_state_larger_than_one_message_travels_in_parts(dhts, cleanup) -> None:
    """Adam's state of a 1024 x 1024 stage is ~8 MB, beyond hivemind's 2 MiB message cap: a trainer fetches it
    from one peer and restores it on another in parts, and the other peer then holds the same moments."""
    torch.manual_seed(0)
    run_id = _run_id("optstate")
    adam = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731
    first = _serve(cleanup, dhts["server1"], run_id, nn.Linear(1024, 1024), optimizer_factory=adam)
    client = _client(cleanup, dhts["trainer"], run_id, microbatches=1)
    client.call_stage(0, torch.randn(4, 1024, requires_grad=True)).pow(2).sum().backward()
    first.flush()
    data = client.commands.fetch_optimizer_state(0)
    assert len(data) > 4 * (1 << 20)
    first.set_state(
        "leaving"
    )  # as a peer leaving the swarm does: trainers route elsewhere at their next refresh
    first.shutdown()
    second = _serve(cleanup, dhts["server2"], run_id, nn.Linear(1024, 1024), optimizer_factory=adam)
    deadline = time.monotonic() + 30
    while [p.peer_id for p in client.peers(0)] != [second.peer_id]:
        assert time.monotonic() < deadline, "the second peer never replaced the first"
        time.sleep(0.5)
    checkpoint = torch.load(io.BytesIO(data), weights_only=False)
    for moments in checkpoint["optimizer"]["state"].values():  # moments a trained stage would hold
        moments["exp_avg"].normal_()
        moments["exp_avg_sq"].uniform_()
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    assert client.commands.load_optimizer_state(0, buffer.getvalue()) == 1
    sent = checkpoint["optimizer"]["state"]
    held = torch.load(io.BytesIO(client.commands.fetch_optimizer_state(0)), weights_only=False)["optimizer"][
        "state"
    ]
    assert sent.keys() == held.keys()
    for key in sent:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sent[key][name], held[key][name]), (key, name)


class _SharedBlock(nn.Module):
    """ALBERT's shared layers: one block applied twice."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.block(x))


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "weight-used-twice"])
def test_a_trainer_driven_stage_replies_before_its_parameter_gradients(dhts, cleanup, shared) -> None:
    """Stage 1 of a trainer-driven run replies to a backward with the input gradients and computes the parameter
    gradients after (lightning_swarm/swarm/server/weight_grads.py); a stage that uses a weight twice runs its
    backwards whole, and stops trying to split them. Either way the trainer's input gradients and the step's
    pending parameter gradients are local autograd's."""
    torch.manual_seed(0)
    run_id = _run_id("split")
    module = _SharedBlock() if shared else nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    reference = copy.deepcopy(module)
    server = _serve(cleanup, dhts["server1"], run_id, module, stage=1, stage_steps="trainer")
    client = _client(cleanup, dhts["trainer"], run_id, num_stages=2, stage_steps="trainer")
    xs = [torch.randn(3, 4, requires_grad=True) for _ in range(2)]
    for x in xs:
        client.call_stage(1, x).pow(2).sum().backward()
    weights = server.shared.weights
    assert weights is not None and weights.unsplittable == shared
    assert weights.deferred == (0 if shared else 2)
    assert weights.drain() is None
    expected = [torch.zeros_like(p) for p in reference.parameters()]
    for x in xs:
        ref_x = x.detach().requires_grad_(True)
        grads = torch.autograd.grad(reference(ref_x).pow(2).sum(), [ref_x, *reference.parameters()])
        torch.testing.assert_close(x.grad, grads[0], rtol=1e-5, atol=1e-6)
        expected = [e + g for e, g in zip(expected, grads[1:], strict=True)]
    with server.shared.grads_lock:
        pending = list(server.shared.pending_sums() or [])
    assert len(pending) == len(expected)
    for got, want in zip(pending, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
