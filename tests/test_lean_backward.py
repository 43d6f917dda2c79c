"""A backward sent to the peer that kept its forward leaves its inputs home: over real P2P on
127.0.0.1 it moves the output gradients alone, a peer that no longer keeps the forward gets the inputs on request,
and the gradients are those of one process."""

from __future__ import annotations

import copy

import msgpack
import pytest
import torch
from torch import nn

from lightning_swarm.swarm.wire.errors import BadRequest, NotKept, ProtocolError
from lightning_swarm.swarm.wire.payload import Payload
from lightning_swarm.swarm.wire.protocol import (
    StageReply,
    StageRequest,
    encode_reply_header,
    encode_request_header,
    parse_reply,
    parse_request,
    stage_uid,
)
from tests.test_stage_server import _client, _run_id, _serve

WIDTH = 256  # the inputs' bytes dwarf the framing's


def _setup(cleanup, dhts, keep: int):
    torch.manual_seed(0)
    run_id = _run_id("lean")
    block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
    reference = copy.deepcopy(block)
    server = _serve(cleanup, dhts["server1"], run_id, block, keep_activations=keep)
    # over P2P (same_host off: the Unix socket is for peers of one machine)
    client = _client(cleanup, dhts["trainer"], run_id, same_host=False)
    return server, client, reference


@pytest.mark.timeout(120)
def test_a_backward_to_the_peer_that_kept_its_forward_sends_its_output_gradients_alone(dhts, cleanup) -> None:
    server, client, reference = _setup(cleanup, dhts, keep=8)
    x = torch.randn(16, WIDTH, requires_grad=True)
    client.call_stage(0, x).sum().backward()
    stats = client.stats()
    forward_sent = stats["swarm/stage0/forward_bytes_sent"]  # the inputs
    backward_sent = stats["swarm/stage0/backward_bytes_sent"]  # the output gradients, as large as the inputs
    assert backward_sent < 1.2 * forward_sent, (backward_sent, forward_sent)  # with the inputs: ~2x
    x_ref = x.detach().requires_grad_()
    expected = torch.autograd.grad(reference(x_ref).sum(), x_ref)[0]
    torch.testing.assert_close(x.grad, expected, atol=1e-6, rtol=0)
    assert server.backend.samples_processed == 16


@pytest.mark.timeout(120)
def test_a_forward_the_peer_did_not_keep_gets_its_inputs_with_the_backward_at_once(dhts, cleanup) -> None:
    """The forward's reply says whether the server kept it: a server that keeps nothing (``keep_activations=0``,
    every backward recomputes) gets the inputs with the backward in one call, not after a ``NotKept``."""
    server, client, reference = _setup(cleanup, dhts, keep=0)
    x = torch.randn(16, WIDTH, requires_grad=True)
    client.call_stage(0, x).sum().backward()
    stats = client.stats()
    forward_sent, backward_sent = (
        stats["swarm/stage0/forward_bytes_sent"],
        stats["swarm/stage0/backward_bytes_sent"],
    )
    # the inputs and the output gradients, once: a lean try first would add the gradients again (~3x)
    assert 1.6 * forward_sent < backward_sent < 2.4 * forward_sent, (backward_sent, forward_sent)
    x_ref = x.detach().requires_grad_()
    expected = torch.autograd.grad(reference(x_ref).sum(), x_ref)[0]
    torch.testing.assert_close(x.grad, expected, atol=1e-6, rtol=0)


@pytest.mark.timeout(120)
def test_a_peer_that_no_longer_keeps_the_forward_gets_the_inputs_and_is_not_blamed(dhts, cleanup) -> None:
    server, client, reference = _setup(cleanup, dhts, keep=1)  # the second forward pushes the first one out
    xs = [torch.randn(8, WIDTH, requires_grad=True) for _ in range(2)]
    outs = [client.call_stage(0, x) for x in xs]
    torch.autograd.backward([out.sum() for out in outs])
    for x in xs:
        x_ref = x.detach().requires_grad_()
        expected = torch.autograd.grad(reference(x_ref).sum(), x_ref)[0]
        torch.testing.assert_close(x.grad, expected, atol=1e-6, rtol=0)
    stats = client.stats()
    # one backward went lean, the other twice: lean, then with its inputs
    assert stats["swarm/stage0/backward_bytes_sent"] > 1.4 * stats["swarm/stage0/forward_bytes_sent"], stats
    assert not client.routers[0].is_banned(server.peer_id)
    assert stats.get("swarm/retries", 0) == 0, stats
    # the server's side of it: a backward without inputs whose forward it does not keep
    grads = Payload.flatten((torch.ones(8, WIDTH),))
    request = StageRequest("backward", server.uid, None, grads, request_id=7, forward_id=12345)
    reply = server.handle(request)
    assert reply.error is not None and reply.error.type_name == NotKept.__name__, reply


def test_a_reply_says_whether_its_forward_was_kept() -> None:
    outputs = Payload.flatten((torch.ones(2, 3),))
    encoded = outputs.encode("none")
    for kept in (True, False):
        header = encode_reply_header(StageReply(5, outputs=outputs, kept=kept), encoded)
        assert parse_reply(header, list(outputs.tensors)).kept is kept
    header = msgpack.packb(["ok", 5, encoded.metadata, "yes"], use_bin_type=True)
    with pytest.raises(ProtocolError, match="Malformed reply header"):
        parse_reply(header, list(outputs.tensors))


def test_only_a_backward_naming_its_forward_may_leave_its_inputs_out() -> None:
    uid = stage_uid("lean", 0)
    grads = Payload.flatten((torch.ones(2, 3),))
    encoded = grads.encode("none")
    lean = StageRequest("backward", uid, None, grads, request_id=1, forward_id=1)
    request = parse_request(encode_request_header(lean, None, encoded), list(grads.tensors), uid)
    assert request.inputs is None and request.forward_id == 1
    torch.testing.assert_close(request.grad_outputs.tensors[0], torch.ones(2, 3))
    for kind, forward_id in (("backward", None), ("forward", 1)):
        header = msgpack.unpackb(encode_request_header(lean, None, encoded), raw=False)
        header[1], header[7] = kind, forward_id
        if kind == "forward":
            header[5] = None
        with pytest.raises(BadRequest, match="payload metadata"):
            parse_request(msgpack.packb(header, use_bin_type=True), [], uid)
