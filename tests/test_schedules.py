"""The wrapper that makes the swarm's epoch drive a trainer's LR schedule with several trainers (the end-to-end
check, two trainers in a local swarm, is ``tests/test_contract.py::test_with_several_trainers_the_swarms_epoch_drives_the_lr_schedule``)."""

import pytest
import torch

from lightning_swarm.strategy.schedules import SwarmEpochScheduler, follow_swarm_epochs


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)


def test_the_schedule_steps_once_per_swarm_epoch_however_often_it_is_called():
    epoch = [0]
    opt = _optimizer()
    sched = SwarmEpochScheduler(
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)), lambda: epoch[0]
    )
    for swarm_epoch in [0, 0, 1, 1, 1, 4, 4, 3]:  # a stale read (3 after 4) never steps back
        epoch[0] = swarm_epoch
        sched.step()
    assert sched.last_epoch == 4 and opt.param_groups[0]["lr"] == pytest.approx(1 / 5)
    assert sched.get_last_lr() == [pytest.approx(1 / 5)]


def test_frequency_counts_swarm_epochs_and_lightning_then_calls_every_step():
    from lightning.pytorch.utilities.types import LRSchedulerConfig

    epoch = [0]
    opt = _optimizer()
    config = LRSchedulerConfig(
        torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), interval="step", frequency=3
    )
    by_epoch = LRSchedulerConfig(torch.optim.lr_scheduler.StepLR(_optimizer(), 1), interval="epoch")
    follow_swarm_epochs([config, by_epoch], lambda: epoch[0])
    assert isinstance(config.scheduler, SwarmEpochScheduler) and config.frequency == 1
    assert not isinstance(by_epoch.scheduler, SwarmEpochScheduler)  # data epochs stay the trainer's own
    for swarm_epoch in range(8):
        epoch[0] = swarm_epoch
        config.scheduler.step()
    assert config.scheduler.last_epoch == 2  # epochs 3 and 6


def test_a_plateau_scheduler_sees_a_metric_once_however_many_epochs_passed():
    epoch = [0]
    opt = _optimizer()
    inner = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1)
    sched = SwarmEpochScheduler(inner, lambda: epoch[0])
    epoch[0] = 5
    sched.step(1.0)
    sched.step(1.0)  # no epoch passed: not an observation
    epoch[0] = 6
    sched.step(1.0)
    assert inner.num_bad_epochs == 1 and opt.param_groups[0]["lr"] == 1.0


def test_the_swarm_epoch_reached_travels_with_the_checkpoint():
    epoch = [7]
    sched = SwarmEpochScheduler(
        torch.optim.lr_scheduler.LambdaLR(_optimizer(), lambda s: 1 / (1 + s)), lambda: epoch[0]
    )
    sched.step()
    state = sched.state_dict()
    resumed = SwarmEpochScheduler(
        torch.optim.lr_scheduler.LambdaLR(_optimizer(), lambda s: 1 / (1 + s)), lambda: epoch[0]
    )
    resumed.load_state_dict(state)
    resumed.step()  # same swarm epoch: the resumed schedule does not replay it
    assert resumed.last_epoch == sched.last_epoch == 7
