"""Stage partitioning and proxies (no network: the proxies call stages through a local function)."""

import pytest
import torch
from torch import nn

from lightning_swarm.swarm.peer.partition import Partition, StageBlocks, find_pipeline, split_stages
from lightning_swarm.swarm.settings import SwarmSettings


class Scale(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.width = d

    def forward(self, x, memory, *, gate: float = 1.0, mask=None):
        out = torch.tanh(self.lin(x)) * gate + memory
        return out if mask is None else out.masked_fill(~mask, 0.0)


class Parent(nn.Module):
    def __init__(self, container: str) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 8)
        if container == "seq":
            self.body = nn.Module()
            self.body.layers = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(5)))
        else:
            self.body = nn.Module()
            self.body.layers = nn.ModuleList(Scale(8) for _ in range(5))


def test_split_stages_is_contiguous_and_even():
    assert [list(r) for r in split_stages(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [len(r) for r in split_stages(7, 3)] == [3, 2, 2]
    with pytest.raises(ValueError, match="at least one block"):
        split_stages(2, 3)
    with pytest.raises(ValueError, match="at least 1"):
        split_stages(2, 0)


def test_bad_pipeline_paths_have_clear_errors():
    model = Parent("seq")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        Partition(model, "body.nope", 2)
    with pytest.raises(ValueError, match="must be an nn.Sequential or nn.ModuleList"):
        Partition(model, "embed", 2)
    assert find_pipeline(model) == "body.layers"
    with pytest.raises(ValueError, match="no nn.Sequential or nn.ModuleList"):
        find_pipeline(nn.Linear(2, 2))


def test_sequential_proxy_runs_every_stage_and_restores():
    torch.manual_seed(0)
    model = Parent("seq")
    x = torch.randn(4, 8)
    expected = model.body.layers(x)
    part = Partition(model, "body.layers", 2)
    calls = []

    def call_stage(k, *args, swarm_training, **kwargs):
        calls.append((k, swarm_training))
        return part.stage_module(k)(*args, **kwargs)

    proxy = part.install_proxy(call_stage)
    assert model.body.layers is proxy and len(proxy) == 5
    assert not any(n.startswith("body.layers") for n, _ in model.named_parameters())
    torch.testing.assert_close(model.body.layers(x), expected)
    assert calls == [(0, True), (1, True)]
    model.eval()  # the proxy is a submodule: its calls carry the mode
    model.body.layers(x)
    assert calls[2:] == [(0, False), (1, False)]
    # a stage's state maps back to the container's keys
    state = {k: v + 1 for k, v in part.stage_module(1).state_dict().items()}
    full = part.full_state_keys({1: state})
    assert set(full) == {f"body.layers.{i}.0.{p}" for i in (3, 4) for p in ("weight", "bias")}
    part.restore({1: state})
    assert isinstance(model.body.layers, nn.Sequential)
    torch.testing.assert_close(model.body.layers[3][0].weight, state["0.0.weight"])


def test_module_list_proxy_passes_args_and_kwargs_and_keeps_block_surface():
    torch.manual_seed(0)
    model = Parent("list")
    x, memory = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    mask = torch.rand(4, 8) > 0.2

    def run(layers):
        h = x
        for layer in layers:
            h = layer(h, memory, gate=0.5, mask=mask)
        return h

    expected = run(model.body.layers)
    part = Partition(model, "body.layers", 2)
    modes = []

    def call_stage(k, *args, swarm_training, **kwargs):
        modes.append(swarm_training)
        return part.stage_module(k)(*args, **kwargs)

    proxy = part.install_proxy(call_stage)
    assert len(proxy) == 2 and proxy.num_blocks == 5 and len(proxy[0]) == 3 and len(proxy[1]) == 2
    assert proxy[0].width == 8  # attribute reads fall through to the stage's first block
    got = run(proxy)
    torch.testing.assert_close(got, expected)
    assert modes == [True, True]
    model.eval()
    run(proxy)
    assert modes[2:] == [False, False]
    got.sum().backward()
    assert x.grad is not None and memory.grad is not None
    assert proxy[-1] is proxy[1]
    with pytest.raises(IndexError, match=r"stage index 4 is out of range.*2 stages \(its 5 blocks"):
        proxy[4]  # a block index: the blocks are grouped into stages


def test_stage_blocks_chain_tuple_outputs():
    class Pair(nn.Module):
        def forward(self, x, bias):
            return x + bias, x.sum()

    out = StageBlocks([Pair(), Pair()])(torch.zeros(2), torch.ones(2))
    torch.testing.assert_close(out[0], torch.full((2,), 2.0))


def test_a_module_shared_between_stages_or_with_the_trainer_is_refused_with_what_to_do():
    """A module reused in blocks of two stages (one BatchNorm put in every block), or a pipeline tensor also held
    outside the pipeline, cannot be split: each side releases the other's tensors to ``meta``. Refused when the
    partition is made, naming both places; sharing inside one stage, and parameterless modules shared by every
    block, are fine."""

    class Net(nn.Module):
        def __init__(self, norm: nn.Module | None = None, act: nn.Module | None = None) -> None:
            super().__init__()
            act = act or nn.Tanh()
            self.layers = nn.Sequential(
                *(nn.Sequential(nn.Linear(4, 4), norm or nn.BatchNorm1d(4), act) for _ in range(4))
            )

    Partition(Net(act=nn.GELU()), "layers", 2)  # one GELU in every block: no tensor, nothing shared
    with pytest.raises(
        ValueError, match=r"`layers.0.1.weight` \(stage 0\) and `layers.2.1.weight` \(stage 1\)"
    ):
        Partition(Net(norm=nn.BatchNorm1d(4)), "layers", 2)
    shared = Net(norm=nn.BatchNorm1d(4))
    Partition(shared, "layers", 1)  # one stage holds every block
    tied = Net()
    tied.head = tied.layers[3][0]  # a head tied to the last block's layer
    with pytest.raises(
        ValueError, match=r"`head.weight`, outside the pipeline `layers`.*`layers.3.0.weight`"
    ):
        Partition(tied, "layers", 2)


def test_settings_validation_messages():
    with pytest.raises(ValueError, match="role='boss'"):
        SwarmSettings(role="boss")
    with pytest.raises(ValueError, match="compression='4bit'"):
        SwarmSettings(compression="4bit")
    with pytest.raises(ValueError, match="stage=3"):
        SwarmSettings(num_stages=2, stage=3)
    with pytest.raises(ValueError, match="run_id"):
        SwarmSettings(run_id="a.b")
    with pytest.raises(ValueError, match="compression='zip'"):  # changes are validated as well
        SwarmSettings().replace(compression="zip")
    with pytest.raises(ValueError, match="expiration"):
        SwarmSettings(announce_period=10.0, expiration=5.0)


def test_sequential_proxy_refuses_to_run_its_blocks_locally():
    """Iterating or indexing a Sequential proxy would run local, untrained copies: it raises and says why."""
    model = Parent("seq")
    calls = []
    part = Partition(model, "body.layers", 2)
    part.install_proxy(lambda k, x, swarm_training: calls.append(k) or x)
    x = torch.randn(2, 8)
    with pytest.raises(TypeError, match=r"runs in the swarm.*cannot be iterated over.*Call it as a whole"):
        for block in model.body.layers:
            x = block(x)
    with pytest.raises(TypeError, match=r"cannot be indexed.*nn.ModuleList"):
        model.body.layers[0](x)
    with pytest.raises(TypeError, match="cannot be indexed"):
        model.body.layers[1:3]
    assert calls == []  # nothing ran anywhere
    model.body.layers(x)  # calling it as a whole goes through every stage
    assert calls == [0, 1]


class _Rotary(nn.Module):
    """A bare parameter (no ``reset_parameters()``) and a non-persistent buffer computed in ``__init__``."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(8))
        self.register_buffer("inv_freq", torch.linspace(1.0, 0.01, 8), persistent=False)
        self.register_buffer("count", torch.zeros(()))  # persistent: it travels in the stage's state

    def forward(self, x):
        return x * self.gain * torch.cos(self.inv_freq)


def test_released_blocks_get_their_non_persistent_buffers_back():
    """No peer sends a non-persistent buffer (it is in no state_dict): a released block keeps it aside and gets it
    back when allocated again and when the trained pipeline is put back from gathered states."""
    parent = nn.Module()
    parent.layers = nn.Sequential(*(_Rotary() for _ in range(4)))
    original = {i: parent.layers[i].inv_freq.clone() for i in range(4)}
    partition = Partition(parent, "layers", 2)
    trained = {
        k: v.detach() + 1 for k, v in partition.stage_module(1).state_dict().items()
    }  # what a peer sends
    partition.release(keep=[0])
    assert parent.layers[2].inv_freq.is_meta and parent.layers[3].gain.is_meta
    assert partition.materialize(1, "cpu", seed=0)
    # the bare parameters cannot be initialised here: they must come from a peer of the stage
    assert partition.uninitialised[1] == ["gain", "gain"]
    with pytest.raises(ValueError, match=r"\['gain', 'gain'\].*without reset_parameters\(\)"):
        partition.check_initialised(1)
    for i in (2, 3):
        assert torch.equal(parent.layers[i].inv_freq, original[i])
    partition.release(keep=[0])
    partition.restore({1: trained})
    for i in (2, 3):
        assert torch.equal(parent.layers[i].inv_freq, original[i])
        assert torch.equal(parent.layers[i].gain, trained[f"{i - 2}.gain"])
    assert torch.isfinite(parent.layers(torch.randn(2, 8))).all()
