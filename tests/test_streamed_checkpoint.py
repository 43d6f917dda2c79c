"""Writing a checkpoint stage by stage (``lightning_swarm.swarm.peer.checkpoint``): the file is what
``torch.save`` writes, loads with plain and memory-mapped ``torch.load``, and the writer holds one stage's tensors
at a time (the previous stage's are freed before the next is fetched)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from lightning_swarm.swarm.peer.checkpoint import Deferred, resolve_deferred, save_deferred


def _stages() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        ("stage", 0): {"l.0.w": torch.randn(64, 32, generator=g), "l.0.n": torch.arange(7)},
        ("stage", 1): {"l.1.w": torch.randn(3, dtype=torch.float16, generator=g), "l.1.e": torch.empty(0, 4)},
        ("optimizer", 0): {"state": torch.frombuffer(bytearray(b"adam moments"), dtype=torch.uint8)},
    }


def _checkpoint() -> dict:
    return {
        "epoch": 3,
        "state_dict": {
            "inp.weight": torch.ones(2, 2),
            "l.0.w": Deferred(("stage", 0), "l.0.w"),
            "l.0.n": Deferred(("stage", 0), "l.0.n"),
            "l.1.w": Deferred(("stage", 1), "l.1.w"),
            "l.1.e": Deferred(("stage", 1), "l.1.e"),
        },
        "swarm_stages": {"optimizer_states": {0: Deferred(("optimizer", 0), "state")}},
    }


@pytest.mark.parametrize("mmap", [False, True])
def test_a_streamed_checkpoint_loads_with_torch_load(tmp_path, mmap):
    stages, path = _stages(), tmp_path / "x.ckpt"
    save_deferred(_checkpoint(), path, lambda group: stages[group])
    loaded = torch.load(path, mmap=mmap)  # weights_only (torch's default)
    assert loaded["epoch"] == 3 and torch.equal(loaded["state_dict"]["inp.weight"], torch.ones(2, 2))
    for group, state in stages.items():
        for key, value in state.items():
            got = (
                loaded["swarm_stages"]["optimizer_states"][0]
                if group[0] == "optimizer"
                else loaded["state_dict"][key]
            )
            assert got.dtype == value.dtype and torch.equal(got, value), key
    assert list(loaded["state_dict"]) == list(_checkpoint()["state_dict"])
    assert not (tmp_path / "x.ckpt.partial").exists()


def test_the_writer_holds_one_stage_at_a_time(tmp_path):
    fetched: list = []
    alive: list[weakref.ref] = []

    def fetch(group):
        gc.collect()
        # every tensor fetched for an earlier group is gone by now
        assert all(ref() is None for ref in alive), f"{group}: an earlier stage's tensors are still held"
        fetched.append(group)
        state = _stages()[group]
        alive.extend(weakref.ref(t) for t in state.values())
        return state

    save_deferred(_checkpoint(), tmp_path / "x.ckpt", fetch)
    assert fetched == [("stage", 0), ("stage", 1), ("optimizer", 0)]  # each group once, in order


def test_a_missing_tensor_is_an_error_and_leaves_no_file(tmp_path):
    with pytest.raises(KeyError, match="l.0.n"):
        save_deferred(_checkpoint(), tmp_path / "x.ckpt", lambda group: {"l.0.w": torch.ones(1)})
    assert list(tmp_path.iterdir()) == []


def test_resolve_and_plain_pickling():
    stages = _stages()
    resolved = resolve_deferred(_checkpoint(), lambda group: stages[group])
    assert torch.equal(resolved["state_dict"]["l.0.w"], stages[("stage", 0)]["l.0.w"])
    with pytest.raises(TypeError, match="save_deferred"):
        torch.save(_checkpoint(), "/dev/null")
