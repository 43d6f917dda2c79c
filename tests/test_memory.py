"""Models larger than one peer: each peer allocates only its stage (and the trainer-local modules), whichever of
Lightning's three ways built the model, with the values one process seeded alike gives them."""

import json
import os
import sys

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from torch import nn

from lightning_swarm import SwarmStrategy
from lightning_swarm.swarm.peer.materialize import RngSnapshot, has_meta, materialize
from testbed import memory_job as _memory_job
from tests import _zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "testbed", "memory_job.py")


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32)),
        nn.Embedding(10, 4),
        nn.Linear(32, 3),
    )


def test_meta_build_materialised_equals_a_seeded_build_and_leaves_the_generator_where_it_would_be():
    torch.manual_seed(7)
    expected = _net().state_dict()
    after_build = torch.rand(3)
    torch.manual_seed(7)
    rng = RngSnapshot.capture()
    with torch.device("meta"):
        net = _net()
    assert has_meta(net)
    assert materialize(net, lambda m: True, "cpu", rng) == (5, 0)
    assert not has_meta(net)
    for key, value in expected.items():
        assert torch.equal(net.state_dict()[key], value), key
    assert torch.equal(torch.rand(3), after_build)  # the generator continues as after one process's build


def test_materialising_a_share_keeps_the_others_on_meta_with_the_same_values_for_the_share():
    torch.manual_seed(3)
    expected = _net().state_dict()
    torch.manual_seed(3)
    rng = RngSnapshot.capture()
    with torch.device("meta"):
        net = _net()
    share = set(net[1].modules()) | {net[3]}
    kept, skipped = materialize(net, lambda m: m in share, "cpu", rng)
    assert (kept, skipped) == (3, 2)  # the LayerNorm, both Linears of the share; the first Linear, Embedding
    assert net[0].weight.is_meta and net[2].weight.is_meta
    for key in ("1.0.weight", "1.1.weight", "1.1.bias", "3.weight", "3.bias"):
        assert torch.equal(net.state_dict()[key], expected[key]), key


class _RawParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))  # initialised here, not in a reset_parameters()


def test_a_module_without_reset_parameters_is_refused_rather_than_served_uninitialised():
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(4, 4), _RawParameter())
    with pytest.raises(ValueError, match=r"\['1'\].*no reset_parameters\(\)"):
        materialize(net, lambda m: True, "cpu", RngSnapshot.capture())


@pytest.mark.parametrize("empty_init", [True, None])
def test_init_module_under_the_swarm_strategy_builds_on_meta(empty_init):
    trainer = Trainer(strategy=SwarmStrategy(num_stages=2), accelerator="cpu", devices=1, logger=False)
    with trainer.init_module(empty_init=empty_init):
        net = nn.Linear(4, 4)
    assert net.weight.is_meta  # no storage, in particular no uninitialised storage that could be served
    with trainer.init_module(empty_init=False):
        net = nn.Linear(4, 4)
    assert not net.weight.is_meta


def _reference_first_output(seed: int, sizes: dict, init_hook: bool = False) -> torch.Tensor:
    seed_everything(seed, verbose=False)
    model = _memory_job.MLPPipeline(init_hook=init_hook, **sizes)
    x, _ = next(iter(_memory_job.data(sizes["width"], 8, 2)))
    with torch.no_grad():
        return model(x)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("way", ["init", "init_module", "configure_model"])
def test_each_peer_allocates_only_its_stage_and_the_first_forward_equals_one_process(tmp_path, way):
    sizes = {"width": 32, "ffn": 128, "blocks": 8}
    cfg = {
        "way": way,
        "devices": 4,
        "steps": 2,
        "seed": 11,
        "out_dir": str(tmp_path),
        "run_id": f"mem_{way}",
        "init_hook": True,  # Hugging Face style: self.apply(self._init_weights) after the layers are built
        **sizes,
    }
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)
    proc = _zygote.run(
        [sys.executable, JOB, json.dumps(cfg)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "Traceback" not in proc.stderr
    peers = [json.loads((tmp_path / f"peer{rank}.json").read_text()) for rank in range(4)]
    assert sorted(p["stage"] for p in peers) == [0, 1, 2, 3]
    whole = _memory_job.MLPPipeline(**sizes)
    whole_bytes = _memory_job.storage_bytes([*whole.parameters(), *whole.buffers()])
    for peer in peers:
        # storage for its stage (a quarter of the blocks) and the trainer-local layers, counted in bytes: no more
        assert peer["model_bytes"] == peer["expected_bytes"], peer
        assert peer["model_bytes"] < 0.3 * whole_bytes, (peer, whole_bytes)
        # no hidden copies on its stage server (one trainer: trainer-driven steps): Adam's two moments, nothing
        # else (no master copy, no averaged parameters, no accumulators, and hivemind's averaged gradients not
        # written: a stage with one peer has no round to average in), and Adam's step counters (a scalar each)
        assert 0 <= peer["server_extra_bytes"] - 2 * peer["stage_bytes"] < 1024, peer
    output = torch.tensor(peers[0]["first_output"])
    torch.testing.assert_close(output, _reference_first_output(11, sizes, init_hook=True), rtol=0, atol=1e-6)
    # when fit returns, a model built in __init__ is whole again in the trainer; one built on meta (taken to be
    # larger than one peer) is not gathered: the trainer keeps its own stage, the others stay on meta
    trainer = next(p for p in peers if "first_output" in p)
    if way == "init":
        assert trainer["meta_tensors_after_fit"] == 0, trainer
    else:
        assert trainer["meta_tensors_after_fit"] > 0, trainer


def test_a_checkpoint_loaded_into_a_meta_build_is_taken_not_dropped():
    torch.manual_seed(0)
    saved = _memory_job.MLPPipeline(width=8, ffn=16, blocks=4).state_dict()
    strategy = SwarmStrategy(num_stages=2)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False)
    with trainer.init_module(empty_init=True):
        model = _memory_job.MLPPipeline(width=8, ffn=16, blocks=4)
    strategy.connect(model)
    strategy.load_model_state_dict({"state_dict": saved})
    for key, value in model.state_dict().items():
        assert not value.is_meta and torch.equal(value, saved[key]), key
    assert all(p.requires_grad for p in model.parameters())


def _run_job(cfg: dict) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)
    proc = _zygote.run(
        [sys.executable, JOB, json.dumps(cfg)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "Traceback" not in proc.stderr and "ERROR" not in proc.stderr, proc.stderr[-6000:]


@pytest.mark.timeout(600)
def test_a_swarm_checkpoint_streams_to_a_plain_checkpoint_and_resuming_reads_only_each_peers_stage(tmp_path):
    # a stage's Adam state stays under hivemind's 2 MB unary message limit (see docs/design/memory.md)
    sizes = {"width": 64, "ffn": 512, "blocks": 8}
    ckpt = tmp_path / "end.ckpt"
    base = {"way": "init_module", "devices": 4, **sizes}
    (tmp_path / "a").mkdir()
    # the trainer wrote it while the swarm ran (stage by stage); a plain process loads it, every stage trained
    _run_job(
        {
            **base,
            "steps": 3,
            "seed": 5,
            "out_dir": str(tmp_path / "a"),
            "run_id": "mem_save2",
            "save_path": str(ckpt),
        }
    )
    plain = _memory_job.MLPPipeline.load_from_checkpoint(ckpt, **sizes)
    seed_everything(5, verbose=False)
    initial = _memory_job.MLPPipeline(**sizes)
    for key, value in initial.state_dict().items():
        assert not torch.equal(plain.state_dict()[key], value), f"{key} did not come home trained"

    # resuming a 4-peer swarm from it: each peer reads its own stage's tensors of the file, not the others'
    (tmp_path / "b").mkdir()
    _run_job(
        {
            **base,
            "steps": 5,
            "seed": 7,
            "out_dir": str(tmp_path / "b"),
            "run_id": "mem_resume",
            "ckpt_path": str(ckpt),
        }
    )
    peers = [json.loads((tmp_path / "b" / f"peer{rank}.json").read_text()) for rank in range(4)]
    assert sorted(p["stage"] for p in peers) == [0, 1, 2, 3]
    pipeline_bytes = _memory_job.storage_bytes(plain.layers.parameters())
    for peer in peers:
        assert peer["model_bytes"] == peer["expected_bytes"], peer
        # the file's pages this peer read: its stage and the trainer-local layers, rounded up to pages (and the
        # kernel's fault-around of 64 KiB), not the other three stages
        assert peer["expected_bytes"] <= peer["ckpt_rss_bytes"] <= peer["expected_bytes"] + (128 << 10), peer
        assert peer["ckpt_rss_bytes"] < 0.4 * pipeline_bytes, (peer, pipeline_bytes)
    # every stage serves the checkpoint's weights: the resumed trainer's first forward is the plain module's
    x, _ = next(iter(_memory_job.data(sizes["width"], 8, 5)))
    with torch.no_grad():
        expected = plain(x)
    torch.testing.assert_close(torch.tensor(peers[0]["first_output"]), expected, rtol=0, atol=1e-6)


def test_saving_a_model_whose_stages_were_never_gathered_is_refused_not_written_without_them():
    """After fit, a model built on meta keeps only its trainer's stage (no end-of-fit gather): a checkpoint saved
    then would silently lack the other stages, so it is an error that says what to do instead."""
    strategy = SwarmStrategy(num_stages=2)
    model = _memory_job.MLPPipeline(width=8, ffn=16, blocks=2)
    model.layers[1]._apply(lambda t: torch.empty_like(t, device="meta"))
    strategy.connect(model)
    with pytest.raises(RuntimeError, match="gather_on_end=True"):
        strategy.lightning_module_state_dict()
    model.layers[1].to_empty(device="cpu")  # every tensor here again: saved as usual
    assert set(strategy.lightning_module_state_dict()) == set(model.state_dict())
