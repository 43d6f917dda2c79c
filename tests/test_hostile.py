"""Hostile peers against a stage server, its trainers and its averaging (real DHT and P2P on 127.0.0.1).

The hostile client is built on hivemind's P2P directly (``iterate_protobuf_handler`` with hand-made
``runtime_pb2`` messages), not on the project's client. One stage server serves the whole module; each case
gets an error reply or has its stream cut, and a well-formed request from another peer is served correctly
afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Iterable, Iterator

import hivemind
import pytest
import torch
from hivemind.optim.grad_averager import GradientAverager
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.utils import P2PHandlerError
from hivemind.proto import runtime_pb2
from torch import nn

from lightning_swarm.swarm.client.client import SwarmClient
from lightning_swarm.swarm.loop import run_coroutine
from lightning_swarm.swarm.server import StageServer
from lightning_swarm.swarm.settings import SwarmSettings
from lightning_swarm.swarm.training.averaging import StageGradientAverager
from lightning_swarm.swarm.wire.errors import RequestRefused
from lightning_swarm.swarm.wire.guards import BadPeers
from lightning_swarm.swarm.wire.payload import Payload
from lightning_swarm.swarm.wire.protocol import StageReply, StageRequest, StageService, parse_reply, stage_uid
from lightning_swarm.swarm.wire.transport import MessageReceiver, encode_request

RUN_ID = "hostile"
UID = stage_uid(RUN_ID, 0)
LIMIT = 1 << 20  # the server's max_request_bytes in this module


@pytest.fixture(scope="module")
def swarm() -> Iterator[dict]:
    """One DHT, one stage server (Linear 8 -> 8), a hostile and an honest raw P2P peer."""
    torch.manual_seed(0)
    things: dict = {}
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    module = nn.Linear(8, 8)
    server = StageServer(
        0,
        module,
        dht=dht,
        settings=SwarmSettings(run_id=RUN_ID, num_stages=1, compression="none", target_batch_size=10**6),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        throughput=1.0,
        max_request_bytes=LIMIT,
        bad_peers=BadPeers(limit=10**9),  # the ban has its own test
    )
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    try:
        server.start()

        async def create() -> P2P:
            return await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])

        things.update(dht=dht, module=module, server=server, maddrs=maddrs)
        things["hostile"] = run_coroutine(create(), timeout=60)
        things["honest"] = run_coroutine(create(), timeout=60)
        yield things
    finally:
        for name in ("hostile", "honest"):
            if name in things:
                run_coroutine(things[name].shutdown(), timeout=30)
        server.shutdown()
        dht.shutdown()


def _call(p2p: P2P, server: StageServer, messages: Iterable[runtime_pb2.ExpertRequest]) -> StageReply | None:
    """Send one call's messages on a fresh channel; the reply, or ``None`` if the server closed the stream."""
    return run_coroutine(_acall(p2p, server, messages), timeout=60)


async def _acall(
    p2p: P2P, server: StageServer, messages: Iterable[runtime_pb2.ExpertRequest]
) -> StageReply | None:
    async def outgoing() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        for message in messages:
            yield message
            await asyncio.sleep(0)

    handle = StageService._get_handle_name(UID, "rpc_channel")
    stream = await p2p.iterate_protobuf_handler(
        server.peer_id, handle, outgoing(), runtime_pb2.ExpertResponse
    )
    receiver = MessageReceiver()
    try:
        async for reply in stream:
            if receiver.feed(reply):
                return parse_reply(*receiver.result())
    except Exception:  # a stream the server reset
        return None
    finally:
        await stream.aclose()
    return None


def _message(inputs: Payload, grads: Payload | None = None, uid: str = UID, request_id: int = 7):
    kind = "forward" if grads is None else "backward"
    request = StageRequest(kind, uid, inputs, grads, request_id=request_id)
    metadata, encoded = encode_request(request, "none")
    return runtime_pb2.ExpertRequest(tensors=[p for e in encoded for p in e.parts()], metadata=metadata)


def _good(swarm: dict, p2p: P2P | None = None) -> None:
    x = torch.randn(3, 8)
    reply = _call(p2p or swarm["honest"], swarm["server"], [_message(Payload.call((x,), {}), request_id=11)])
    assert reply is not None and reply.error is None and reply.request_id == 11, reply
    torch.testing.assert_close(reply.outputs.rebuild(), swarm["module"](x), atol=1e-6, rtol=0)


def _refused(reply: StageReply | None, match: str | None = None, category: str = "request") -> None:
    """An error reply of ``category`` (matching ``match``), or a stream the server cut. "request": the request's
    own content is refused; "unavailable": this peer does not take it (another stage, ignored peer)."""
    if reply is None:
        return
    assert reply.error is not None and reply.error.category == category, reply
    if match is not None:
        assert match in reply.error.message, reply.error.message


@pytest.mark.timeout(180)
def test_hostile_requests_are_refused_and_the_server_keeps_serving(swarm) -> None:
    server, hostile = swarm["server"], swarm["hostile"]
    _good(swarm)  # the stage learns its input schema: one 2-dimensional float32 tensor
    x = Payload.call((torch.randn(2, 8),), {})
    good = _message(x)

    garbage = runtime_pb2.Tensor(buffer=b"\x00\xff" * 50, size=[7, 7], dtype="float32", chunks=3)
    _refused(
        _call(hostile, server, [runtime_pb2.ExpertRequest(tensors=[garbage], metadata=b"\xc1\x00garbage")])
    )
    _refused(_call(hostile, server, [runtime_pb2.ExpertRequest(metadata=b"\x93\x01\x02")]), "Malformed")
    truncated = runtime_pb2.Tensor()
    truncated.CopyFrom(good.tensors[0])
    truncated.buffer = truncated.buffer[:5]
    _refused(_call(hostile, server, [runtime_pb2.ExpertRequest(tensors=[truncated], metadata=good.metadata)]))
    wrong_dtype = _message(Payload.call((torch.randn(2, 8, dtype=torch.float64),), {}))
    _refused(_call(hostile, server, [wrong_dtype]), "torch.float64, this stage takes torch.float32")
    wrong_ndim = _message(Payload.call((torch.randn(2, 8, 1),), {}))
    _refused(_call(hostile, server, [wrong_ndim]), "this stage takes 2-dimensional tensors")
    # sizes are not part of the schema (sequence lengths vary): the module's own error comes back, and the
    # server serves on
    wrong_size = _call(hostile, server, [_message(Payload.call((torch.randn(2, 5),), {}))])
    assert wrong_size is not None and wrong_size.error is not None and wrong_size.error.category == "compute"
    extra_tensor = _message(Payload.call((torch.randn(2, 8), torch.randn(2, 8)), {}))
    _refused(_call(hostile, server, [extra_tensor]), "2 tensors sent, this stage takes 1")

    # a huge declared size is refused from the first part, before anything is allocated for it
    huge = runtime_pb2.Tensor(buffer=b"\x00" * 64, size=[1 << 20, 1 << 20], dtype="float32", chunks=1 << 20)
    _refused(
        _call(hostile, server, [runtime_pb2.ExpertRequest(tensors=[huge], metadata=good.metadata)]), "limit"
    )
    # 8-bit parts count with their decoded size (4 bytes per element), not their wire size
    x8 = Payload.call((torch.randn(LIMIT // 4 + 4096),), {})
    metadata, encoded = encode_request(StageRequest("forward", UID, x8, request_id=3), "8bit")
    parts = [p for e in encoded for p in e.parts()]
    assert sum(len(p.buffer) for p in parts) < LIMIT // 2
    _refused(_call(hostile, server, [runtime_pb2.ExpertRequest(tensors=parts, metadata=metadata)]), "limit")

    # an endless stream (parts, never a header) is cut off once it passes the size limit
    sent = [0]

    def endless() -> Iterator[runtime_pb2.ExpertRequest]:
        part = Payload.call((torch.randn(16, 1024),), {}).encode("none")
        while sent[0] < 10_000:
            sent[0] += 1
            yield runtime_pb2.ExpertRequest(tensors=list(part.parts()))

    _refused(_call(hostile, server, endless()), "limit")
    assert sent[0] < 10_000  # the server stopped reading long before

    # NaN and Inf in activations (inputs that require grad) or output gradients (an infinity in an input that
    # needs no grad is data, e.g. a float mask: see test_stage_server)
    for bad in (math.nan, math.inf, -math.inf):
        poisoned = torch.randn(2, 8)
        poisoned[1, 3] = bad
        activation = Payload.call((poisoned.clone().requires_grad_(True),), {})
        _refused(_call(hostile, server, [_message(activation)]), "NaN or infinite")
        grads = Payload.flatten((poisoned,))
        inputs = Payload.call((torch.randn(2, 8, requires_grad=True),), {})
        _refused(_call(hostile, server, [_message(inputs, grads)]), "NaN or infinite")

    # an unknown stage, over every RPC (a call: "unavailable", since another peer may serve that stage)
    _refused(_call(hostile, server, [_message(x, uid="other.stage3")]), "other.stage3", "unavailable")
    wrong = runtime_pb2.ExpertUID(uid="other.stage3")
    with pytest.raises(P2PHandlerError, match="serves"):
        run_coroutine(
            hostile.call_protobuf_handler(
                server.peer_id, StageService._get_handle_name(UID, "rpc_info"), wrong, runtime_pb2.ExpertInfo
            ),
            timeout=30,
        )

    async def state() -> list[runtime_pb2.ExpertResponse]:
        handle = StageService._get_handle_name(UID, "rpc_state")
        stream = await hostile.iterate_protobuf_handler(
            server.peer_id, handle, wrong, runtime_pb2.ExpertResponse
        )
        return [message async for message in stream]

    assert not any(m.metadata for m in run_coroutine(state(), timeout=30))  # no state handed out

    # a flood: 64 concurrent channels, each with a few bad requests; every call is answered or cut
    async def flood() -> list:
        calls = [_acall(hostile, server, [wrong_ndim] * 3 + [_message(x, uid=f"x{i}")]) for i in range(64)]
        return await asyncio.gather(*calls)

    for reply in run_coroutine(flood(), timeout=120):
        assert reply is None or reply.error is not None
    assert (
        server.backend.schemas._schemas and len(server.backend.schemas._schemas) == 1
    )  # nothing hostile was learned
    _good(swarm)
    _good(swarm, hostile)  # the hostile peer is not ignored here (limit 10**9): a good call is served


@pytest.mark.timeout(120)
def test_a_peer_that_keeps_sending_bad_requests_is_ignored_for_a_while(swarm) -> None:
    server, hostile = swarm["server"], swarm["hostile"]
    previous, server.handler.bad_peers = server.handler.bad_peers, BadPeers(limit=5, window=60.0, ban_s=300.0)
    try:
        garbage = runtime_pb2.ExpertRequest(metadata=b"\xc1")
        for _ in range(5):
            _refused(_call(hostile, server, [garbage]))
        x = torch.randn(2, 8)
        # even a good one ("unavailable": this peer does not serve the caller; another peer of the stage may)
        _refused(_call(hostile, server, [_message(Payload.call((x,), {}))]), "ignores peer", "unavailable")
        with pytest.raises(P2PHandlerError, match="ignores you"):
            run_coroutine(
                hostile.call_protobuf_handler(
                    server.peer_id,
                    StageService._get_handle_name(UID, "rpc_info"),
                    runtime_pb2.ExpertUID(uid=UID),
                    runtime_pb2.ExpertInfo,
                ),
                timeout=30,
            )
        _good(swarm)  # everyone else is still served
    finally:
        server.handler.bad_peers = previous


@pytest.mark.timeout(120)
def test_a_trainer_whose_request_is_too_large_is_told_why(swarm) -> None:
    """At once, with the server's message: every peer would refuse it (no retry, no ban)."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=swarm["maddrs"])
    settings = SwarmSettings(run_id=RUN_ID, num_stages=1, compression="none", no_peers_timeout=1.0)
    client = SwarmClient(dht, settings)
    try:
        with pytest.raises(RequestRefused, match="exceed the receiver's limit of 1048576 bytes"):
            with torch.no_grad():
                client.call_stage(0, torch.randn(40_000, 8))  # 1.28 MB
        assert client.stats().get("swarm/bans", 0) == 0
        _good(swarm)
    finally:
        client.shutdown()
        dht.shutdown()


class _Sqrt(nn.Module):
    """Finite outputs and input gradients, but an infinite parameter gradient (d sqrt(w) / dw at w = 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return x * torch.sqrt(self.w)


@pytest.mark.timeout(120)
def test_non_finite_parameter_gradients_never_reach_the_optimizer(swarm, caplog) -> None:
    settings = SwarmSettings(run_id="sqrt", num_stages=1, compression="none", target_batch_size=10**6)
    server = StageServer(0, _Sqrt(), dht=swarm["dht"], settings=settings, optimizer_factory=torch.optim.SGD)
    try:
        server.start()
        x = torch.randn(2, 4, requires_grad=True)
        request = StageRequest(
            "backward", stage_uid("sqrt", 0), Payload.call((x,), {}), Payload.flatten((x,)), 5
        )
        with caplog.at_level(logging.WARNING, logger="lightning_swarm.swarm.server"):
            reply = server.handle(request)
        assert reply.error is None and torch.equal(reply.outputs.rebuild()[0], torch.zeros(2, 4))
        assert (
            server.backend.dropped_contributions == 1
            and server.shared.pending is None
            and server.backend.samples_processed == 2
        )
        (record,) = [r for r in caplog.records if "contribution was dropped" in r.getMessage()]
        assert record.levelno == logging.WARNING
    finally:
        server.shutdown()


class _LyingServer(StageServer):
    """A hostile stage server: its replies have NaN values, or the wrong shape."""

    lie, lied = "nan", 0

    def handle(self, request: StageRequest) -> StageReply:
        reply = super().handle(request)
        if reply.outputs is not None:
            self.lied += 1
            (t,) = reply.outputs.tensors
            bad = torch.full_like(t, math.nan) if self.lie == "nan" else torch.zeros(t.shape[0], 3)
            reply.outputs = Payload(reply.outputs.skeleton, [bad])
        return reply


@pytest.mark.timeout(180)
def test_a_malformed_or_non_finite_reply_is_a_peer_failure(swarm) -> None:
    run_id = "liar"
    dhts = [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=swarm["maddrs"])]
    servers, client = [], None
    try:
        dhts.append(
            hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=swarm["maddrs"])
        )
        module = nn.Linear(8, 8)
        settings = SwarmSettings(
            run_id=run_id, num_stages=1, compression="none", target_batch_size=10**6, request_timeout=10.0
        )
        honest = StageServer(
            0, module, dht=swarm["dht"], settings=settings, optimizer_factory=None, throughput=1.0
        )
        liar = _LyingServer(
            0, nn.Linear(8, 8), dht=dhts[0], settings=settings, optimizer_factory=None, throughput=1e6
        )
        servers = [honest.start(), liar.start()]
        client = SwarmClient(dhts[1], settings.replace(no_peers_timeout=20.0))
        assert len(client.peers(0)) == 2
        for lie in ("nan", "shape", "nan"):
            liar.lie = lie
            client.routers[0] = type(client.routers[0])(0, run_id=run_id, ban_base_s=0.0)  # forget bans
            client.peers(0)
            # the honest peer is busy: the liar goes first
            client.routers[0].choose(1e6, prefer=honest.peer_id)
            x = torch.randn(2, 8, requires_grad=True)
            y = client.call_stage(
                0, x
            )  # the liar (1e6 samples/s) is tried first, fails, then the honest peer
            torch.testing.assert_close(y, module(x), atol=1e-5, rtol=0)
            y.sum().backward()  # backward replies are checked the same way
            assert x.grad is not None and bool(torch.isfinite(x.grad).all())
        assert liar.lied >= 1 and client.stats()["swarm/bans"] == liar.lied
    finally:
        if client is not None:
            client.shutdown()
        for server in servers:
            server.shutdown()
        for dht in dhts:
            dht.shutdown()


@pytest.mark.timeout(480)
@pytest.mark.parametrize("role", ["sender", "reducer", "huge"])
def test_averaging_with_a_nan_peer_equals_averaging_without_it(swarm, role: str) -> None:
    """Stage peers (our guarded gradient averager) and a hostile one (plain hivemind under the same protocol name)
    average together. Sending NaN gradients as a sender only (client mode), its part is dropped: the honest peers
    end with the average of their own gradients. As a reducer too, the NaN average it returns for its slice is
    refused: the honest peers keep their own values there, finite. Sending gradients a million times larger than
    the group's (three honest peers), its part is dropped as an outlier."""
    torch.manual_seed(1)
    hostile_cls = type(
        "StageGradientAverager", (GradientAverager,), {}
    )  # the name is part of hivemind's protocol
    honest_count = 3 if role == "huge" else 2
    dhts = [
        hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=swarm["maddrs"])
        for _ in range(honest_count)
    ]
    averagers: list = []
    grads = [torch.randn(30, 1000) for _ in range(honest_count)]
    grads.append(torch.randn(30, 1000) * 1e6 if role == "huge" else torch.full((30, 1000), math.nan))
    classes = [StageGradientAverager] * honest_count + [hostile_cls]
    try:
        # hivemind's matchmaking sometimes fails to assemble a full group on a loaded box ("could not find a
        # group", or a step that never resolves): such a round is not what this test is about, so a round that
        # does not complete is retried with fresh averagers (a new prefix), up to 3 rounds
        for attempt in range(3):
            for averager in averagers:
                averager.shutdown()
            averagers = []
            for dht, grad, cls in zip([swarm["dht"], *dhts], grads, classes, strict=True):
                param = nn.Parameter(torch.zeros(30, 1000))
                param.grad = grad.clone()
                averagers.append(
                    cls(
                        [param],
                        dht=dht,
                        prefix=f"nan_{role}_{attempt}",
                        target_group_size=honest_count + 1,
                        min_group_size=honest_count + 1,
                        min_matchmaking_time=3.0,
                        request_timeout=1.0,
                        client_mode=cls is hostile_cls and role != "reducer",
                        # as a reducer, the hostile peer takes the whole vector
                        bandwidth=1e6 if cls is hostile_cls else 1.0,
                        start=True,
                    )
                )
            for averager in averagers:
                averager.accumulate_grads_(batch_size=1)
            futures = [averager.step(wait=False, timeout=40) for averager in averagers]
            try:
                for future in futures:
                    future.result(timeout=60)
                break
            except Exception as e:  # noqa: BLE001 (any failure of hivemind's round: retried)
                print(f"averaging round {attempt} did not complete: {e!r}")
        else:
            raise AssertionError("no averaging round completed in 3 attempts")
        results = []
        for averager in averagers[:honest_count]:
            with averager.get_tensors() as (averaged,):
                results.append(averaged.clone())
        assert all(bool(torch.isfinite(r).all()) for r in results)
        expected = sum(grads[:honest_count]) / honest_count
        for result, own in zip(results, grads, strict=False):
            # each element is either the honest average, or (only in the hostile reducer's slice) the own value
            honest = torch.isclose(result, expected, atol=1e-5, rtol=0)
            if role != "reducer":
                assert bool(honest.all())
            else:
                assert bool((honest | torch.isclose(result, own, atol=1e-6, rtol=0)).all())
                assert bool(torch.isclose(result, own, atol=1e-6, rtol=0).any())  # the hostile peer reduced
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
