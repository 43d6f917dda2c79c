"""Two trainers' step exchange (``swarm/training/trainer_sync.py``) over real hivemind P2P on 127.0.0.1: the step
ids the stages get are the same on every trainer, and trainers that step different optimizers are stopped."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lightning_swarm.swarm.training.trainer_sync import TrainersDiverged, TrainerSync, stage_step_id
from tests._helpers import local_dhts

RUN = "sync_test"


def test_stage_step_ids_depend_on_the_step_the_optimizer_and_the_kind_only():
    ids = {
        stage_step_id(RUN, step, optimizer, kind, count)
        for step in range(50)
        for optimizer in range(3)
        for kind in ("step", "zero")
        for count in range(2)
    }
    assert len(ids) == 50 * 3 * 2 * 2  # all different
    assert all(0 <= i < 2**62 for i in ids)
    assert stage_step_id(RUN, 7, 1) == stage_step_id(RUN, 7, 1)
    assert stage_step_id(RUN, 7, 1) != stage_step_id("another_run", 7, 1)


@pytest.fixture
def two_trainers():
    dhts = local_dhts(2)
    names = [dht.peer_id.to_base58() for dht in dhts]
    syncs = [
        TrainerSync(dht, RUN, name, lambda: set(names), expected=2, timeout=20.0)
        for dht, name in zip(dhts, names, strict=True)
    ]
    try:
        for sync in syncs:
            sync.start()
        yield syncs
    finally:
        for sync in syncs:
            sync.shutdown()
        for dht in dhts:
            dht.shutdown()


def test_trainers_get_the_same_average_and_step_ids_and_stop_on_different_optimizers(two_trainers):
    a, b = two_trainers
    # before the first step: every trainer's first zero_grad of an optimizer has one id, its second another
    assert a.zero_step_id(1) == b.zero_step_id(1) == stage_step_id(RUN, 0, 1, "zero", 0)
    assert a.zero_step_id(1) == b.zero_step_id(1) == stage_step_id(RUN, 0, 1, "zero", 1)
    grads = {a: [torch.tensor([1.0, 2.0]), None], b: [torch.tensor([3.0, 6.0]), None]}
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda s: s.exchange(grads[s], optimizer=1), (a, b)))
    for result in results:
        assert result.step == 0 and result.trainers == 2
        assert result.step_id == stage_step_id(RUN, 0, 1)
        assert torch.equal(result.grads[0], torch.tensor([2.0, 4.0])) and result.grads[1] is None
    # the step reset the count of zero_grad calls: the next step's first has its own id
    assert a.zero_step_id(1) == b.zero_step_id(1) == stage_step_id(RUN, 1, 1, "zero", 0)

    # the second global step: one trainer steps optimizer 0, the other optimizer 1 (their code differs): both stop
    def step(sync: TrainerSync, optimizer: int) -> str:
        with pytest.raises(TrainersDiverged) as e:
            sync.exchange([torch.zeros(2), None], optimizer=optimizer)
        return str(e.value)

    with ThreadPoolExecutor(2) as pool:
        errors = list(pool.map(step, (a, b), (0, 1)))
    for error in errors:
        assert "The trainers stepped different optimizers at global step 1 (indices [0, 1])" in error
