"""A model built on meta is replayed, not re-initialised: every tensor a peer keeps gets what the model's own code
gives it in one process (``lightning_swarm/swarm/peer/deferred_init.py``), whatever that code does - init hooks after
the build, bare parameters, buffers computed in ``__init__``, tied weights, ``nn.MultiheadAttention``, and the
``torch.nn.init`` functions that do nothing on meta (``trunc_normal_``, ``orthogonal_``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_swarm.swarm.peer.deferred_init import InitRecorder, replay
from lightning_swarm.swarm.peer.materialize import RngSnapshot


class Block(nn.Module):
    def __init__(self, d: int, context: int = 8) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)  # no reset_parameters(): _reset_parameters
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.scale = nn.Parameter(torch.randn(d) * 0.1)  # a bare parameter
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask)  # a causal mask computed in __init__
        self.register_buffer("positions", torch.arange(context))  # ints

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        n = x.shape[1]
        h, _ = self.attn(h, h, h, attn_mask=self.mask[:n, :n], need_weights=False)
        x = x + h
        return x + self.scale * self.out(torch.relu(self.fc(x)))


class LM(nn.Module):
    """Written the way Hugging Face writes models: layers, tied embeddings, then an init hook over everything."""

    def __init__(self, d: int = 16, blocks: int = 4, vocab: int = 50) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.Sequential(*(Block(d) for _ in range(blocks)))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        nn.init.orthogonal_(self.layers[0].fc.weight)  # a no-op on meta: recorded as a call
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.02)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            nn.init.trunc_normal_(module.weight, std=0.02)  # a no-op on meta too

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.emb(tokens)))


def _meta_build(seed: int) -> tuple[LM, InitRecorder, RngSnapshot]:
    torch.manual_seed(seed)
    rng = RngSnapshot.capture()
    recorder = InitRecorder()
    with torch.device("meta"), recorder:
        model = LM()
    return model, recorder, rng


@pytest.mark.parametrize("kept_blocks", [(), (0,), (1, 3), (2,), (0, 1, 2, 3)])
def test_each_peers_share_gets_the_values_one_process_gives_it(kept_blocks):
    torch.manual_seed(5)
    reference = LM()
    drawn_next = torch.rand(4)
    model, recorder, rng = _meta_build(5)
    keep = {id(m) for i in kept_blocks for m in model.layers[i].modules()} | {id(model.emb), id(model.head)}
    kept, skipped = replay(recorder, model, lambda m: id(m) in keep, "cpu", rng)
    assert kept > 0 and skipped == 4 * 6 - kept + 2  # the embedding and head, and 6 modules per block
    # the generator is where one process's would be after its build: what draws next draws the same
    assert torch.equal(torch.rand(4), drawn_next)
    expected = reference.state_dict()
    for name, value in model.state_dict().items():
        block = int(name.split(".")[1]) if name.startswith("layers.") else None
        if block is None or block in kept_blocks:
            assert not value.is_meta, name
            assert value.dtype == expected[name].dtype, name
            assert torch.equal(value, expected[name]), name
        else:
            assert value.is_meta, name  # never allocated on this peer
    assert model.head.weight is model.emb.weight  # still tied
    if kept_blocks == (0, 1, 2, 3):
        tokens = torch.randint(0, 50, (2, 8))
        torch.testing.assert_close(model(tokens), reference(tokens), rtol=0, atol=0)


def test_the_init_hook_is_what_is_replayed_not_the_layers_defaults():
    """Without the recording, a meta build would get each layer's reset_parameters() values; the hook's differ."""
    model, recorder, rng = _meta_build(9)
    replay(recorder, model, lambda m: True, "cpu", rng)
    std = model.layers[2].fc.weight.std().item()
    assert abs(std - 0.02) < 0.005  # normal(0, 0.02), not nn.Linear's kaiming uniform (std ~0.14 here)
    assert torch.count_nonzero(model.layers[2].fc.bias) == 0


def test_a_kept_tensor_computed_from_another_stages_tensor_is_refused_with_its_operation():
    class Crossed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            with torch.no_grad():
                self.layers[1].weight.copy_(self.layers[0].weight * 2)

    torch.manual_seed(0)
    rng = RngSnapshot.capture()
    recorder = InitRecorder()
    with torch.device("meta"), recorder:
        model = Crossed()
    keep = {id(model.layers[1])}
    with pytest.raises(ValueError, match="stage it does not serve"):
        replay(recorder, model, lambda m: id(m) in keep, "cpu", rng)


def test_the_recorder_leaves_torch_nn_init_as_it_was():
    originals = [torch.nn.init.orthogonal_, torch.nn.init._no_grad_trunc_normal_, torch.nn.init.dirac_]
    with torch.device("meta"), InitRecorder():
        assert torch.nn.init.orthogonal_ is not originals[0]
    assert [
        torch.nn.init.orthogonal_,
        torch.nn.init._no_grad_trunc_normal_,
        torch.nn.init.dirac_,
    ] == originals
    w = torch.empty(4, 4)
    nn.init.orthogonal_(w)  # outside a recording: the real thing
    torch.testing.assert_close(w @ w.T, torch.eye(4), atol=1e-5, rtol=0)
