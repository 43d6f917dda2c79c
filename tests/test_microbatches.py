"""Several microbatches in flight (``microbatches``, see ``lightning_swarm/swarm/client/chunking.py``): a stage call cut
into row chunks sent at once gives the result of the same chunks sent one after another, spreads over the peers of
a stage, and is refused for a pipeline with batch normalisation. Real stage servers and clients over hivemind's
DHT/P2P on 127.0.0.1 (the helpers of ``test_stage_server``), and a local swarm of Lightning peers."""

from __future__ import annotations

import contextlib
import copy
import threading
import time

import pytest
import torch
from torch import nn

from lightning_swarm.swarm.client.chunking import chunk_bounds, rows_mixing_module, split_plan
from lightning_swarm.swarm.peer.partition import Partition
from lightning_swarm.swarm.wire.payload import Payload
from tests.test_contract import TOLERANCE, run
from tests.test_stage_calls import SEQ, VOCAB, Decoder
from tests.test_stage_server import _client, _run_id, _serve


def test_which_tensors_are_split_and_where():
    x, causal, padding = torch.zeros(6, 40, 8), torch.zeros(40, 40), torch.zeros(6, 40, dtype=torch.bool)
    assert split_plan([x, causal, padding]) == [
        True,
        False,
        True,
    ]  # the causal mask goes whole to every chunk
    assert split_plan([torch.zeros(6, 8), torch.zeros(6, 6)]) is None  # [B, B]: ambiguous, sent whole
    assert split_plan([torch.zeros(1, 8)]) is None and split_plan([]) is None
    assert chunk_bounds(10, 4) == [0, 3, 6, 8, 10] and chunk_bounds(3, 8) == [0, 1, 2, 3]
    assert (
        rows_mixing_module(nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.BatchNorm1d(2))))
        == "1.0 (BatchNorm1d)"
    )
    assert rows_mixing_module(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))) is None


@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore:Support for mismatched")
def test_a_modulelist_pipeline_with_masks_in_chunks_trains_as_in_one_process(dhts, cleanup) -> None:
    """4 chunks of a batch of 8 through a 2-stage ModuleList decoder (float causal mask shared by the chunks,
    boolean padding mask split with them), compression "none": the loss and every gradient (the trainer's, and
    the stages' pending on their servers) are those of one process, within float summation order (1e-4
    relative); each stage served 4 forwards and 4 backwards."""
    torch.manual_seed(0)
    run_id = _run_id("chunks")
    model = Decoder()
    reference = copy.deepcopy(model)
    part = Partition(model, "layers", 2)
    servers = [_serve(cleanup, dhts["server1"], run_id, part.stage_module(k), stage=k) for k in range(2)]
    client = _client(cleanup, dhts["trainer"], run_id, 2, microbatches=4)
    part.install_proxy(client.call_stage)

    tokens = torch.randint(0, VOCAB, (8, SEQ))
    padding = torch.zeros(8, SEQ, dtype=torch.bool)
    padding[0, -7:] = padding[5, -15:] = True
    target = torch.randint(0, VOCAB, (8, SEQ))
    with contextlib.ExitStack() as held:
        for server in servers:  # the stepper does not take the pending gradients meanwhile
            held.enter_context(server.stepper.step_lock)
        loss = nn.functional.cross_entropy(model(tokens, padding).flatten(0, 1), target.flatten())
        loss.backward()
        pending = [server.shared.pending_sums() for server in servers]
    expected = nn.functional.cross_entropy(reference(tokens, padding).flatten(0, 1), target.flatten())
    expected.backward()

    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    for name in ("embed.weight", "head.weight"):
        got, want = model.get_parameter(name).grad, reference.get_parameter(name).grad
        assert float((got - want).norm() / want.norm()) < 1e-4, name
    for stage, grads in enumerate(pending):
        blocks = [reference.layers[i] for i in part.stages[stage]]
        want = torch.cat([p.grad.flatten() for block in blocks for p in block.parameters()])
        got = torch.cat([g.flatten() for g in grads])
        assert float((got - want).norm() / want.norm()) < 1e-4, stage
    stats = client.stats()
    for stage in range(2):
        assert (
            stats[f"swarm/stage{stage}/forward_calls"] == 4
            and stats[f"swarm/stage{stage}/backward_calls"] == 4
        )
    # evaluation (no grad) is chunked the same way and equals one process too
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, padding), reference(tokens, padding), atol=1e-5, rtol=0)


@pytest.mark.timeout(180)
def test_the_chunks_of_one_call_spread_over_the_peers_of_a_stage(dhts, cleanup) -> None:
    """Two peers serve the one stage; with microbatches="auto" a call becomes 2 chunks, one per peer, sent at once:
    each peer computes half of the rows of every call, even where weighted round robin would have sent both to the
    same peer to even out its share (when the first call goes whole to one peer because the client has found only
    one so far, round robin alone then queued both chunks of the next call at the other).

    The block takes 0.2 s a call (sleeping): the rule that sends a chunk to an idle peer applies while the other
    chunk is in flight, and a chunk that took a millisecond could end before a busy box's thread pool had picked
    the next one's peer (round robin then rightly sends both to the peer it owes work: seen once in CI)."""
    torch.manual_seed(0)
    run_id = _run_id("spread")
    block = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16), Slow(16, 0.2))
    servers = [
        _serve(cleanup, dhts[name], run_id, copy.deepcopy(block), stage=0) for name in ("server1", "server2")
    ]
    client = _client(cleanup, dhts["trainer"], run_id, 1)  # microbatches: "auto"
    x = torch.randn(32, 16, requires_grad=True)
    served = []
    for _ in range(3):
        client.call_stage(0, x).sum().backward()
        served.append([s.backend.samples_processed for s in servers])
    # the first call is cut by the peers the client has found by then: one (whole) or both (on a busy box the
    # second announcement may already be in)
    assert sorted(served[0]) in ([0, 32], [16, 16]), served
    for before, after in zip(served, served[1:], strict=False):
        assert [b - a for a, b in zip(before, after, strict=True)] == [16, 16], served
    torch.testing.assert_close(x.grad, 3 * torch.autograd.grad(block(x).sum(), x)[0], atol=1e-5, rtol=0)

    # "auto" cuts a call only while no other call of this client is in flight: a call made while another's two
    # chunks are out goes whole
    router = client.routers[0]
    before = [s.backend.samples_processed for s in servers]
    first = threading.Thread(
        target=lambda: client.call_stage(0, x.detach().requires_grad_()).sum().backward()
    )
    first.start()
    deadline = time.monotonic() + 10
    while router.calls_in_flight() < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert client._chunking(0, Payload.call((x,), {}))[0] == 1
    client.call_stage(0, x.detach().requires_grad_()).sum().backward()
    first.join()
    after = [s.backend.samples_processed for s in servers]
    assert sorted(b - a for a, b in zip(before, after, strict=True)) == [16, 48], (before, after)


class _Sleep(torch.autograd.Function):
    """The identity, taking a fixed time forward and backward (sleeping, so that the box's load does not decide
    the schedule)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.seconds)
        return grad, None


class Slow(nn.Module):
    def __init__(self, width: int, seconds: float) -> None:
        super().__init__()
        self.linear, self.seconds = nn.Linear(width, width), seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(_Sleep.apply(x, self.seconds)))


class MaskedSlow(Slow):
    """A ModuleList block with extra arguments: a per-row padding mask (split with the chunks) and a scale shared
    by every row (sent whole to each chunk)."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x + scale * super().forward(x) * keep.unsqueeze(-1)


class LoopModel(nn.Module):
    """The ModuleList way: the model's own loop calls the stages with its extra arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(16, 16), nn.Linear(16, 1)
        self.layers = nn.ModuleList([MaskedSlow(16, 0.05) for _ in range(2)])

    def forward(self, x: torch.Tensor, keep: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h, keep, scale)
        return self.head(h)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["sequential", "modulelist"])
def test_chunks_flow_through_the_pipeline_and_the_stages_compute_at_once(dhts, cleanup, kind) -> None:
    """2 stages of one peer each, microbatches=4: stage 1 works on a chunk while stage 0 works on the next, in the
    forward and in the backward (asserted from the servers' recorded compute intervals, not from wall time); the
    loss and every gradient are those of one process (compression "none"), and evaluation equals it too. For an
    nn.Sequential pipeline, and for an nn.ModuleList one called by the model's own loop with a split boolean mask
    and a shared tensor that requires grad."""
    torch.manual_seed(0)
    run_id = _run_id(f"pipelined_{kind}")
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    if kind == "sequential":
        model: nn.Module = nn.Sequential(
            nn.Linear(16, 16), nn.Sequential(Slow(16, 0.05), Slow(16, 0.05)), nn.Linear(16, 1)
        )
        path, args = "1", (x,)
    else:
        model = LoopModel()
        keep = torch.ones(8, dtype=torch.bool)
        keep[[1, 6]] = False
        path, args = "layers", (x, keep, torch.tensor(0.5, requires_grad=True))
    reference = copy.deepcopy(model)
    ref_args = tuple(a.detach().requires_grad_(a.requires_grad) for a in args)
    part = Partition(model, path, 2)
    servers = [
        _serve(cleanup, dhts[f"server{k + 1}"], run_id, part.stage_module(k), stage=k) for k in range(2)
    ]
    client = _client(cleanup, dhts["trainer"], run_id, 2, microbatches=4)
    part.install_proxy(client.call_stage)
    with contextlib.ExitStack() as held:
        for server in servers:  # the stepper does not take the pending gradients meanwhile
            held.enter_context(server.stepper.step_lock)
        loss = nn.functional.mse_loss(model(*args), y)
        loss.backward()
        pending = [server.shared.pending_sums() for server in servers]
    expected = nn.functional.mse_loss(reference(*ref_args), y)
    expected.backward()
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=0)
    for name, got in model.named_parameters():  # the trainer's own (the pipeline's are on the servers)
        torch.testing.assert_close(got.grad, reference.get_parameter(name).grad, atol=1e-6, rtol=1e-5)
    for got, want in zip(args, ref_args, strict=True):  # the shared scale's gradient sums both stages'
        if want.requires_grad:
            torch.testing.assert_close(got.grad, want.grad, atol=1e-6, rtol=1e-5)
    blocks = reference[1] if kind == "sequential" else reference.layers
    for stage, grads in enumerate(pending):
        want = [p.grad for p in blocks[stage].parameters()]
        for g, w in zip(grads, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
    for kind_ in ("forward", "backward"):
        first, second = ([(a, b) for k, a, b in s.backend.compute_log if k == kind_] for s in servers)
        # 4 chunks each; a call retried under load (seen once in a suite run: stage 0 computed 5 forwards, with
        # every loss and gradient still exact) may add one, a systematic waste would add more
        assert 4 <= len(first) <= 5 and 4 <= len(second) <= 5, (kind_, first, second)
        # stage by stage, one stage would finish every chunk before the other starts any
        overlapping = [(a, b) for a, b in first for c, d in second if a < d and c < b]
        assert overlapping, (kind_, first, second)
    with torch.no_grad():
        torch.testing.assert_close(model(*args), reference(*ref_args), atol=1e-6, rtol=0)


def test_a_sequential_pipeline_in_4_chunks_steps_as_one_process(tmp_path):
    """The training contract (one trainer, 2 stages, compression "none", AdamW, clipping by norm) with each batch
    of 8 cut into 4 chunks: the parameters after 6 steps are the single process's."""
    cfg = {"steps": 6, "optimizer": "adamw", "clip": [0.3, "norm"]}
    single = run({**cfg, "swarm": False}, tmp_path, "single")
    swarm = run({**cfg, "swarm": True, "strategy": {"microbatches": 4}}, tmp_path, "swarm")
    assert swarm["stage_steps"] == {0: 6, 1: 6}
    moved = max(float((single["state"][k] - swarm["state"][k]).abs().max()) for k in single["state"])
    assert moved <= 10 * TOLERANCE  # the chunks' gradients are summed in another order than one batch's
    # stage 1 replied to its backwards with the input gradients first (lightning_swarm/swarm/server/weight_grads.py)
    # wherever its forward was kept: chunks that reach it together are merged into one forward, which keeps
    # nothing, and their backwards recompute it whole (a CI run saw 22 of 24 split)
    stage1 = torch.load(f"{tmp_path / 'swarm.pt'}.peer1", weights_only=False)
    assert stage1["stage"] == 1 and stage1["kept_hits"] == 0, stage1  # no kept forward went unsplit
    assert 6 * 4 // 2 <= stage1["info"]["split_backwards"] <= 6 * 4, stage1["info"]


def test_chunking_a_pipeline_with_batch_normalisation_is_refused(tmp_path):
    stderr = run(
        {"swarm": True, "steps": 2, "batchnorm": True, "strategy": {"microbatches": 2}},
        tmp_path,
        "refused",
        expect_failure=True,
    )
    assert "SwarmStrategy(microbatches=2) cannot cut this pipeline's batches into chunks" in stderr
    assert "BatchNorm1d" in stderr


@pytest.mark.timeout(120)
def test_threads_sharing_a_client_each_pipeline_their_own_calls(dhts, cleanup) -> None:
    """Four threads drive one client through 2 stages (microbatches=2), as a benchmark's trainer threads do: each
    thread's second call continues the run its first call opened, and no thread closes another's run (which left
    the other waiting forever for chunks that had stopped). Every output and input gradient is one process's."""
    import threading

    torch.manual_seed(0)
    run_id = _run_id("threads")
    model = nn.Sequential(nn.Identity(), nn.Sequential(Slow(16, 0.01), Slow(16, 0.01)))
    blocks = copy.deepcopy(model[1])
    part = Partition(model, "1", 2)
    servers = [
        _serve(cleanup, dhts[f"server{k + 1}"], run_id, part.stage_module(k), stage=k) for k in range(2)
    ]
    client = _client(cleanup, dhts["trainer"], run_id, 2, microbatches=2)
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def drive(i: int) -> None:
        try:
            done = []
            for _ in range(3):
                x = torch.randn(4, 16, requires_grad=True)
                out = client.call_stage(1, client.call_stage(0, x))
                run = client._pipeline_run  # this thread's: opened by its first call, continued by its second
                joined = run is not None and run.first_stage == 0
                out.pow(2).sum().backward()
                done.append((x.detach(), out.detach(), x.grad, joined))
            results[i] = done
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=drive, args=(i,), daemon=True) for i in range(4)]
    with contextlib.ExitStack() as held:
        for server in servers:  # no step meanwhile: every call sees the same parameters
            held.enter_context(server.stepper.step_lock)
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung waiting for its run's chunks"
    assert not errors, errors
    assert len(results) == 4
    for done in results.values():
        for x, out, grad, joined in done:
            assert joined, "a thread's second call did not continue the run of its first"
            xr = x.clone().requires_grad_(True)
            want = blocks(xr)
            want.pow(2).sum().backward()
            torch.testing.assert_close(out, want.detach(), atol=1e-5, rtol=0)
            torch.testing.assert_close(grad, xr.grad, atol=1e-5, rtol=1e-4)
