# ruff: noqa: F811 (the fixtures of test_stage_server, imported, are the tests' parameters)
"""What a stage call means: data inputs, refusals, train/eval mode and dropout replay.

Real stage servers and clients over hivemind's DHT/P2P on 127.0.0.1 (the fixtures and helpers of
``test_stage_server``), or in process (``local_servers``), against the same modules run in one process:

- inputs that need no grad are data: a Transformer block's float causal mask (0/-inf) and boolean key padding
  mask pass untouched, through the 8-bit codec too;
- a request the server refuses for its content is raised in the trainer at once, without retry or ban; a peer
  that serves another stage is still retried elsewhere;
- the trainer's mode reaches the stages (dropout off and batch normalisation's running statistics used and
  left alone in eval), and a recomputed backward neither draws new dropout masks nor updates the running
  statistics again.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from lightning_swarm.swarm.peer.partition import Partition
from lightning_swarm.swarm.server.batching import merge_key
from lightning_swarm.swarm.wire.errors import RemoteStageError, RequestRefused
from lightning_swarm.swarm.wire.payload import Payload
from lightning_swarm.swarm.wire.protocol import StageRequest, stage_uid
from tests.test_stage_server import _client, _run_id, _serve

VOCAB, WIDTH, SEQ = 50, 32, 40  # SEQ x SEQ = 1600 mask elements: above the codec's lossless threshold


class Decoder(nn.Module):
    """A GPT-style decoder written the usual PyTorch way: a float causal mask and a boolean padding mask, passed
    to every block of a ModuleList (as keyword arguments, or ``positional``)."""

    def __init__(self, positional: bool = False) -> None:
        super().__init__()
        self.positional = positional
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, 4, 64, dropout=0.0, batch_first=True) for _ in range(4)
        )
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        h = self.embed(tokens)
        for layer in self.layers:
            if self.positional:
                h = layer(h, causal, padding)
            else:
                h = layer(h, src_mask=causal, src_key_padding_mask=padding)
        return self.head(h)


@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore:Support for mismatched")
@pytest.mark.parametrize("where", ["remote", "remote-8bit", "local"])
def test_a_transformer_with_causal_and_padding_masks_trains_as_in_one_process(dhts, cleanup, where) -> None:
    torch.manual_seed(0)
    run_id = _run_id("masks")
    model = Decoder(positional=where == "local")
    reference = copy.deepcopy(model)
    part = Partition(model, "layers", 2)
    host = dhts["trainer"] if where == "local" else dhts["server1"]
    compression = "8bit" if where == "remote-8bit" else "none"
    servers = [
        _serve(cleanup, host, run_id, part.stage_module(k), stage=k, compression=compression)
        for k in range(2)
    ]
    local = dict(enumerate(servers)) if where == "local" else None
    client = _client(cleanup, dhts["trainer"], run_id, 2, local, compression=compression)
    part.install_proxy(client.call_stage)

    tokens = torch.randint(0, VOCAB, (3, SEQ))
    padding = torch.zeros(3, SEQ, dtype=torch.bool)
    padding[0, -7:] = padding[2, -15:] = True  # the ends of two sequences are padding
    target = torch.randint(0, VOCAB, (3, SEQ))
    with contextlib.ExitStack() as held:
        for server in servers:  # the stepper does not take the pending gradients meanwhile
            held.enter_context(server.stepper.step_lock)
        loss = nn.functional.cross_entropy(model(tokens, padding).flatten(0, 1), target.flatten())
        loss.backward()
        pending = [server.shared.pending_sums() for server in servers]
    expected = nn.functional.cross_entropy(reference(tokens, padding).flatten(0, 1), target.flatten())
    expected.backward()

    tolerance = 0.05 if compression == "8bit" else 1e-4  # 8 bits: the boundary's rounding
    torch.testing.assert_close(loss, expected, atol=tolerance, rtol=0)
    for name in (
        "embed.weight",
        "head.weight",
    ):  # the trainer's own parameters, through every stage's backward
        got, want = model.get_parameter(name).grad, reference.get_parameter(name).grad
        assert got is not None and want is not None
        assert float((got - want).norm() / want.norm()) < (0.1 if compression == "8bit" else 1e-4), name
    # the stages' parameter gradients (pending on their servers) are those of the blocks in one process
    for stage, grads in enumerate(pending):
        assert grads is not None
        blocks = [reference.layers[i] for i in part.stages[stage]]
        want = [p.grad for block in blocks for p in block.parameters()]
        got_norm = torch.cat([g.flatten() for g in grads]).norm()
        want_norm = torch.cat([g.flatten() for g in want]).norm()
        assert abs(float(got_norm / want_norm) - 1) < (0.1 if compression == "8bit" else 1e-4), stage
    assert client.stats().get("swarm/retries", 0) == 0


@pytest.mark.timeout(120)
def test_a_refused_request_is_raised_at_once_without_retry_or_ban(dhts, cleanup) -> None:
    torch.manual_seed(0)
    run_id = _run_id("refused")
    servers = [_serve(cleanup, dhts[name], run_id, nn.Linear(8, 8)) for name in ("server1", "server2")]
    # a long no_peers_timeout: a refusal treated as a peer failure would take that long, then NoPeersError
    client = _client(cleanup, dhts["trainer"], run_id, no_peers_timeout=60.0)
    assert len(client.peers(0)) == 2
    for _ in range(20):  # both peers learn the stage's input schema
        if all(server.backend.requests_served for server in servers):
            break
        client.call_stage(0, torch.randn(2, 8))
    assert all(server.backend.requests_served for server in servers)

    activation = torch.randn(2, 8)
    activation[1, 2] = float("nan")
    with pytest.raises(RequestRefused, match="Input tensor 0 holds NaN or infinite values") as info:
        client.call_stage(0, activation.requires_grad_(True))
    assert isinstance(info.value, RemoteStageError) and info.value.is_caller_error
    with pytest.raises(
        RequestRefused, match="input tensor 0 is torch.float64, this stage takes torch.float32"
    ):
        client.call_stage(0, torch.randn(2, 8, dtype=torch.float64))
    stats = client.stats()
    assert stats.get("swarm/retries", 0) == 0 and stats.get("swarm/bans", 0) == 0
    assert client.routers[0].num_live() == 2  # nobody banned: the next call is served
    client.call_stage(0, torch.randn(2, 8))


@pytest.mark.timeout(120)
def test_a_peer_that_serves_another_stage_is_retried_elsewhere(dhts, cleanup) -> None:
    """A peer that migrated (it answers for another stage now) is a peer failure: another peer can serve."""
    torch.manual_seed(0)
    run_id = _run_id("moved")
    module = nn.Linear(8, 8)
    moved = _serve(cleanup, dhts["server1"], run_id, copy.deepcopy(module), throughput=1e6)
    staying = _serve(cleanup, dhts["server2"], run_id, module, throughput=1.0)
    client = _client(cleanup, dhts["trainer"], run_id, microbatches=1)  # one call, counted per peer
    assert len(client.peers(0)) == 2
    client.routers[0].choose(1e6, prefer=staying.peer_id)  # busy: the moved peer is tried first
    moved.handler.uid = moved.backend.uid = stage_uid(
        run_id, 1
    )  # as if it had moved to stage 1 since it announced itself
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(client.call_stage(0, x), module(x), atol=1e-6, rtol=0)
    assert client.stats()["swarm/bans"] == 1 and moved.backend.requests_served == 0


class _Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # stage 0: Linear + BatchNorm, stage 1: Dropout + Linear
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 8))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["remote", "local"])
def test_train_and_eval_mode_reach_the_stages(dhts, cleanup, where) -> None:
    torch.manual_seed(0)
    run_id = _run_id("mode")
    root = _Root()
    reference = copy.deepcopy(root)
    part = Partition(root, "layers", 2)
    host = dhts["trainer"] if where == "local" else dhts["server1"]
    servers = [_serve(cleanup, host, run_id, part.stage_module(k), stage=k) for k in range(2)]
    local = dict(enumerate(servers)) if where == "local" else None
    client = _client(cleanup, dhts["trainer"], run_id, 2, local)
    part.install_proxy(client.call_stage)
    bn = servers[0].module[1]
    x = torch.randn(6, 8)

    root.eval()  # validate/test/predict: dropout off, batch norm from its running statistics, left as they are
    reference.eval()
    with torch.no_grad():
        first, second = root.layers(x), root.layers(x)
        expected = reference.layers(x)
    torch.testing.assert_close(first, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(second, expected, atol=1e-5, rtol=0)
    assert int(bn.num_batches_tracked) == 0 and torch.equal(bn.running_mean, torch.zeros(16))

    root.train()  # dropout on: about half of the outputs' inputs dropped, and one running-statistics update
    reference.train()
    out = root.layers(x)
    reference.layers[:2](x)  # the reference batch norm's one update
    assert not torch.allclose(out, expected, atol=1e-3)
    assert int(bn.num_batches_tracked) == 1
    torch.testing.assert_close(bn.running_mean, reference.layers[1].running_mean, atol=1e-6, rtol=0)

    root.eval()
    with torch.no_grad():
        root.layers(x)
    assert not any(m.training for s in servers for m in s.module.modules())
    for (
        server
    ) in servers:  # the blocks (the trainer's own, in process) are left in the modes they were built in
        server.shutdown()
    assert all(m.training for s in servers for m in s.module.modules())


@pytest.mark.timeout(120)
def test_a_recomputed_backward_updates_batch_norm_statistics_once(dhts, cleanup) -> None:
    torch.manual_seed(0)
    run_id = _run_id("bn-once")
    stage = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16))
    reference = copy.deepcopy(stage)
    server = _serve(cleanup, dhts["server1"], run_id, stage)
    client = _client(cleanup, dhts["trainer"], run_id, keep_activations=0)  # every backward recomputes
    x = torch.randn(6, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    client.call_stage(0, x).pow(2).sum().backward()
    reference(x_ref).pow(2).sum().backward()
    assert server.backend.kept_hits == 0 and server.backend.requests_served == 2
    bn, bn_ref = stage[1], reference[1]
    assert int(bn.num_batches_tracked) == 1
    torch.testing.assert_close(bn.running_mean, bn_ref.running_mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(bn.running_var, bn_ref.running_var, atol=1e-6, rtol=0)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(120)
def test_the_calls_of_a_trainer_that_does_not_own_the_buffers_leave_them_as_they_were(dhts, cleanup) -> None:
    """With several trainers only the leader's train-mode calls update a stage's buffers (DDP: rank 0's). Over the
    wire, a call sent with ``updates_buffers`` off computes what it would (batch statistics, same outputs and input
    gradients) and leaves the running statistics and the batch count untouched; the next owner's call updates
    them once, as in one process."""
    torch.manual_seed(0)
    run_id = _run_id("bn-owner")
    stage = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16))
    reference = copy.deepcopy(stage)
    server = _serve(cleanup, dhts["server1"], run_id, stage)
    client = _client(cleanup, dhts["trainer"], run_id)
    bn = stage[1]
    x, other = torch.randn(6, 8, requires_grad=True), torch.randn(6, 8)
    x_ref = x.detach().clone().requires_grad_(True)

    client.updates_buffers = False  # another trainer's batch
    out = client.call_stage(0, x)
    out.pow(2).sum().backward()
    expected = reference(x_ref)
    expected.pow(2).sum().backward()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    assert int(bn.num_batches_tracked) == 0 and torch.equal(bn.running_mean, torch.zeros(16))
    assert torch.equal(bn.running_var, torch.ones(16))

    reference = copy.deepcopy(stage)  # the buffers as they were, before the owner's call
    client.updates_buffers = True  # the leader's batch: one update, as in one process
    with torch.no_grad():
        client.call_stage(0, other)
        reference(other)
    assert int(bn.num_batches_tracked) == 1
    torch.testing.assert_close(bn.running_mean, reference[1].running_mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(bn.running_var, reference[1].running_var, atol=1e-6, rtol=0)
    assert server.backend.requests_served == 3


@pytest.mark.timeout(120)
def test_another_trainers_forward_between_a_kept_forward_and_its_backward_spoils_nothing(
    dhts, cleanup
) -> None:
    """Batch normalisation saves its running statistics for its backward, and a backward refuses a tensor changed
    in place since. The leader's forward is kept for its backward; another trainer's forward in between leaves
    the statistics' values *and* versions as they were, so the kept forward serves the backward (no recompute;
    a stage's split parameter-gradient pass, which has no recompute to fall back on, failed and skipped the step)
    and the gradients are one process's."""
    torch.manual_seed(0)
    run_id = _run_id("bn-kept")
    stage = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    reference = copy.deepcopy(stage)
    server = _serve(cleanup, dhts["server1"], run_id, stage)
    client = _client(cleanup, dhts["trainer"], run_id)
    x, other = torch.randn(6, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = client.call_stage(0, x)  # the leader's: kept for its backward
    client.updates_buffers = False
    client.call_stage(0, other)  # another trainer's, before the leader's backward
    client.updates_buffers = True
    out.pow(2).sum().backward()
    reference(x_ref).pow(2).sum().backward()
    assert server.backend.kept_hits == 1, "the kept forward could not serve its backward"
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    assert int(stage[1].num_batches_tracked) == 1


@pytest.mark.timeout(120)
def test_a_backward_recomputed_on_another_peer_replays_the_forwards_dropout(dhts, cleanup) -> None:
    torch.manual_seed(0)
    run_id = _run_id("dropout")
    linear = nn.Linear(8, 64)
    reference = copy.deepcopy(linear)
    servers = {
        name: _serve(cleanup, dhts[name], run_id, nn.Sequential(copy.deepcopy(linear), nn.Dropout(0.5)))
        for name in ("server1", "server2")
    }
    client = _client(cleanup, dhts["trainer"], run_id, microbatches=1)  # one call, counted per peer
    assert len(client.peers(0)) == 2
    x = torch.randn(5, 8, requires_grad=True)
    y = client.call_stage(0, x)
    (forward_peer,) = [s for s in servers.values() if s.backend.requests_served == 1]
    (other,) = [s for s in servers.values() if s is not forward_peer]
    client.routers[0].ban(forward_peer.peer_id)  # its backward goes to the other peer, which recomputes
    w = torch.randn(5, 64)
    with other.stepper.step_lock:  # the stepper does not take the pending gradients meanwhile
        (y * w).sum().backward()
        pending = other.shared.pending_sums()
    assert (
        other.backend.requests_served == 1
        and other.backend.kept_hits == 0
        and forward_peer.backend.requests_served == 1
    )

    mask = y.detach() != 0  # the forward's dropout mask (a Linear output is never exactly 0 here)
    assert 0.3 < float(mask.float().mean()) < 0.7
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = reference(x_ref) * mask / 0.5
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=0)
    (y_ref * w).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    assert pending is not None
    weight_grad, bias_grad = pending
    torch.testing.assert_close(weight_grad, reference.weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bias_grad, reference.bias.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(120)
def test_merged_calls_keep_their_own_mode_and_dropout_masks(dhts, cleanup) -> None:
    """Train-mode calls of a stage that draws random numbers are not merged (a merged run would draw one mask
    for all of them, unlike the recompute of each call's backward); eval-mode calls still are, never with
    train-mode ones."""
    torch.manual_seed(0)
    run_id = _run_id("merge-rng")
    server = _serve(cleanup, dhts["server1"], run_id, nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5)))
    uid = stage_uid(run_id, 0)
    xs = [torch.randn(3, 8) for _ in range(3)]

    def forward(x, training, seed, request_id):
        return StageRequest(
            "forward", uid, Payload.call((x,), {}), request_id=request_id, training=training, seed=seed
        )

    train = [forward(x, True, 100 + i, i) for i, x in enumerate(xs)]
    assert len({merge_key(r)[0] for r in train}) == 1  # a stage not known to draw: mergeable
    assert len({merge_key(r, distinct_seeds=True)[0] for r in train}) == 3
    assert merge_key(forward(xs[0], False, 1, 9))[0] != merge_key(train[0])[0]  # modes never merge

    before = server.backend.computations
    merged = server.backend._serve_group(train)  # the merged run draws: discarded, each call served alone
    assert server.backend.draws_rng and server.backend.computations == before + 1 + len(train)
    for request, reply in zip(train, merged, strict=True):
        again = server.backend._serve_one(
            forward(request.inputs.tensors[0], True, request.seed, 50 + request.request_id)
        )
        assert reply.error is None and again.error is None
        torch.testing.assert_close(reply.outputs.rebuild(), again.outputs.rebuild(), atol=0, rtol=0)

    evals = [forward(x, False, 7 + i, 20 + i) for i, x in enumerate(xs)]
    before = server.backend.computations
    replies = server.backend._serve_group(evals)  # eval: no dropout, merged into one run
    assert server.backend.computations == before + 1
    for x, reply in zip(xs, replies, strict=True):
        torch.testing.assert_close(reply.outputs.rebuild(), server.module[0](x), atol=1e-6, rtol=0)
