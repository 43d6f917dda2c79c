"""Compression-aware stage boundaries (maxout, bottleneck): they shrink what crosses a boundary by the configured
factor, on the wire of a real swarm stage too, and a pipeline with them trains."""

from __future__ import annotations

import hivemind
import pytest
import torch
from torch import nn

from lightning_swarm.swarm.boundary import (
    BottleneckCompress,
    BoundaryExpand,
    BoundaryStage,
    MaxoutCompress,
    compression_aware,
    end_boundaries,
)
from lightning_swarm.swarm.client.client import SwarmClient
from lightning_swarm.swarm.server import StageServer
from lightning_swarm.swarm.settings import SwarmSettings


@pytest.mark.parametrize("kind", ["maxout", "bottleneck"])
@pytest.mark.parametrize("factor", [2, 4, 8])
def test_boundary_shrinks_the_tensor_between_stages_by_the_factor(kind, factor):
    width = 64
    stages = [nn.Linear(width, width) for _ in range(3)]
    pipeline = compression_aware(stages, width, kind=kind, factor=factor)
    x = torch.randn(5, 7, width)
    shapes = []
    for stage in pipeline:
        x = stage(x)
        shapes.append(x.shape[-1])
    # stage 0 and 1 end with a compress layer; the last stage ends at full width
    assert shapes == [width // factor, width // factor, width]
    assert pipeline[0].expand is None and pipeline[-1].compress is None
    assert isinstance(pipeline[0].compress, MaxoutCompress if kind == "maxout" else BottleneckCompress)
    assert isinstance(pipeline[1].expand, BoundaryExpand)


def test_maxout_takes_the_max_over_groups_of_factor_units():
    compress = MaxoutCompress(8, factor=4)
    with torch.no_grad():
        compress.proj.weight.copy_(torch.eye(8))
        compress.proj.bias.zero_()
    x = torch.randn(3, 8)
    normed = nn.functional.layer_norm(x, (8,))
    expected = normed.view(3, 2, 4).amax(-1)
    torch.testing.assert_close(compress(x), expected)


def test_bad_factor_is_a_clear_error():
    with pytest.raises(ValueError, match="multiple of the compression factor"):
        compression_aware([nn.Identity(), nn.Identity()], 30, kind="maxout", factor=4)
    with pytest.raises(ValueError, match="Unknown boundary kind"):
        compression_aware([nn.Identity(), nn.Identity()], 32, kind="lowrank", factor=4)


def test_extra_arguments_reach_the_body_and_tuples_pass_through():
    class Body(nn.Module):
        def forward(self, x, mask, *, scale):
            return x * mask * scale, mask

    stage = BoundaryStage(Body(), compress=MaxoutCompress(8, 2))
    out, mask = stage(torch.ones(2, 8), torch.ones(2, 8), scale=2.0)
    assert out.shape == (2, 4) and mask.shape == (2, 8)


@pytest.mark.parametrize("kind", ["maxout", "bottleneck"])
def test_pipeline_with_boundaries_trains(kind):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread avoids OpenMP contention on a busy machine
    try:
        _train_with_boundaries(kind)
    finally:
        torch.set_num_threads(threads)


def _train_with_boundaries(kind: str) -> None:
    torch.manual_seed(0)
    width = 32
    stages = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(2)]
    model = nn.Sequential(*compression_aware(stages, width, kind=kind, factor=4), nn.Linear(width, 1))
    x = torch.randn(128, width)
    y = x[:, :4].sum(-1, keepdim=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(60):
        loss = nn.functional.mse_loss(model(x), y)
        first = first if first is not None else float(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss) < 0.25 * first


def test_boundary_bytes_on_the_wire_of_a_swarm_stage_shrink_by_the_factor():
    """A real stage server and client over hivemind P2P: the stage's output crosses the network; with a maxout
    boundary of factor 4 the reply carries a quarter of the bytes (8-bit codec on both)."""
    width, factor = 256, 4
    trainer = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    server_dht = hivemind.DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=trainer.get_visible_maddrs()
    )
    things = []
    try:
        replies = {}
        for name, stage in [
            ("plain", BoundaryStage(nn.Linear(width, width))),
            ("maxout", compression_aware([nn.Linear(width, width)] * 2, width, "maxout", factor)[0]),
        ]:
            run_id = f"boundary-{name}"
            server = StageServer(
                0,
                stage,
                dht=server_dht,
                settings=SwarmSettings(run_id=run_id, target_batch_size=10**6, compression="8bit"),
                optimizer_factory=None,
            ).start()
            things.append(server)
            client = SwarmClient(
                trainer,
                SwarmSettings(
                    run_id=run_id, num_stages=1, compression="8bit", no_peers_timeout=20, request_timeout=20
                ),
            )
            things.append(client)
            x = torch.randn(8, 32, width, requires_grad=True)
            out = client.call_stage(0, x)
            out.sum().backward()
            assert x.grad is not None and x.grad.shape == x.shape
            stats = client.stats()
            replies[name] = stats["swarm/stage0/forward_bytes_recv"]
            assert out.shape[-1] == (width if name == "plain" else width // factor)
        ratio = replies["maxout"] / replies["plain"]
        assert 0.9 / factor < ratio < 1.1 / factor, replies
    finally:
        for thing in reversed(things):
            thing.shutdown()
        server_dht.shutdown()
        trainer.shutdown()


@pytest.mark.parametrize("kind", ["maxout", "bottleneck"])
def test_with_ends_every_hop_of_the_pipeline_is_narrow(kind):
    """``ends=True``: the first stage takes, and the last one returns, tensors ``factor`` times narrower; the trainer
    compresses before the pipeline and expands after it (``end_boundaries``), and gradients reach every part."""
    torch.manual_seed(0)
    width, factor = 32, 4
    stages = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(3)]
    pipeline = compression_aware(stages, width, kind=kind, factor=factor, ends=True)
    enter, leave = end_boundaries(kind, width, factor)
    x = torch.randn(5, 7, width, requires_grad=True)
    h = enter(x)
    widths = [h.shape[-1]]
    for stage in pipeline:
        h = stage(h)
        widths.append(h.shape[-1])
    assert widths == [width // factor] * 4  # every tensor between trainer and stages, and between stages
    y = leave(h)
    assert y.shape == x.shape
    y.square().mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for module in (enter, leave, *pipeline):
        assert all(p.grad is not None for p in module.parameters())
    with pytest.raises(ValueError, match="multiple of the compression factor"):
        end_boundaries(kind, 30, 4)
