"""Two trainers' step exchange (``swarm/training/trainer_sync.py``) over real hivemind P2P on 127.0.0.1: the step
ids the stages get are the same on every trainer, and trainers that step different optimizers are stopped."""

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

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


@contextmanager
def trainers(count: int, timeout: float = 20.0, start: int = 0, live: set[str] | None = None):
    """``count`` trainers' exchanges on their own DHTs on 127.0.0.1, sorted by name, all of them live (or those in
    ``live``, a set the test may change); the first ``start`` are not started (their training has not begun)."""
    dhts = local_dhts(count)
    try:
        names = sorted(dht.peer_id.to_base58() for dht in dhts)
        if live is not None:
            live.update(names)
        alive = live if live is not None else set(names)
        by_name = {dht.peer_id.to_base58(): dht for dht in dhts}
        syncs = [
            TrainerSync(by_name[n], RUN, n, lambda: set(alive), expected=count, timeout=timeout)
            for n in names
        ]
        try:
            for sync in syncs[start:]:
                sync.start()
            yield syncs
        finally:
            for sync in syncs:
                sync.shutdown()
    finally:
        for dht in dhts:
            dht.shutdown()


@pytest.fixture
def two_trainers():
    with trainers(2) as syncs:
        yield syncs


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


def _leader_and_follower(syncs: list[TrainerSync]) -> tuple[TrainerSync, TrainerSync]:
    leader = min(syncs, key=lambda s: s.name)  # the live trainer with the smallest name leads
    return leader, next(s for s in syncs if s is not leader)


def test_a_leader_that_fails_requests_for_a_while_but_still_trains_is_waited_for_not_passed_over(
    two_trainers,
):
    """After a first step, the leader's answers fail for 4 s (a loaded machine: its handlers error out), while its
    presence record says it trains. The follower keeps asking it instead of leading the step itself: one step of both trainers, led by
    one. (Before, the follower led its own step after three failed requests, the leader went on without it, and
    from then on each trainer led its own steps: two models.)"""
    leader, follower = _leader_and_follower(two_trainers)
    grads = {leader: [torch.tensor([1.0])], follower: [torch.tensor([3.0])]}
    with ThreadPoolExecutor(
        2
    ) as pool:  # a first step together (at the first, a trainer not answering is starting)
        list(pool.map(lambda s: s.exchange(grads[s]), (leader, follower)))
    real, failing_until = leader._wait_result, time.monotonic() + 4.0

    def failing(*args):
        if time.monotonic() < failing_until:
            raise RuntimeError("the leader's handler fails (injected)")
        return real(*args)

    leader._wait_result = failing
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda s: s.exchange(grads[s]), (leader, follower)))
    for result in results:
        assert result.leader == leader.name and result.trainers == 2 and result.missing == []
        assert torch.equal(result.grads[0], torch.tensor([2.0]))
    assert time.monotonic() >= failing_until  # the follower's requests did fail
    assert leader.missed_steps == follower.missed_steps == 0 and not follower.late_steps
    assert follower.leads_next() is False and leader.leads_next() is True
    # and the next step goes to the same leader
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda s: s.exchange(grads[s]), (leader, follower)))
    assert {(r.leader, r.trainers) for r in results} == {(leader.name, 2)}


def test_a_leader_whose_record_says_it_no_longer_trains_is_passed_over_within_seconds():
    """A leader that is gone (its exchange shut down, its presence record gone): the follower leads the step
    itself within seconds, with its own part alone."""
    live: set[str] = set()
    with trainers(2, live=live) as syncs:
        leader, follower = _leader_and_follower(syncs)
        with ThreadPoolExecutor(2) as pool:  # a first step together
            list(pool.map(lambda s: s.exchange([torch.ones(1)]), syncs))
        leader.shutdown()
        live.discard(leader.name)
        started = time.monotonic()
        result = follower.exchange([torch.tensor([5.0])])
        assert time.monotonic() - started < 10.0
        assert result.leader == follower.name and result.trainers == 1 and result.step == 1
        assert torch.equal(result.grads[0], torch.tensor([5.0]))


def test_a_live_trainer_that_never_answered_is_passed_over_after_trainer_timeout():
    """Three live trainers; the one with the smallest name has not started its training (it sleeps in a callback):
    it never answered anyone. The two others pass over it after trainer_timeout and step together, under one
    leader (it joins later with their state)."""
    with trainers(3, timeout=2.0, start=1) as syncs:
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda s: s.exchange([torch.tensor([1.0])]), syncs[1:]))
        assert {(r.leader, r.trainers) for r in results} == {(syncs[1].name, 2)}
        assert time.monotonic() - started < 3 * 2.0 + 10.0


def test_a_late_part_whose_parameters_differ_is_an_error_on_its_trainer():
    """A part that comes after its step was taken is not averaged; its hash is still checked: a trainer whose
    parameters differ from the others' stops with TrainersDiverged even if its parts are always late (it would
    otherwise train another model unseen)."""
    with trainers(2, timeout=1.0) as syncs:
        leader, follower = _leader_and_follower(syncs)
        alone = leader.exchange([torch.ones(2)], params=[torch.zeros(2)])  # step 0, without the follower
        assert alone.trainers == 1 and alone.step == 0
        with pytest.raises(TrainersDiverged, match="late part carries another hash"):
            follower.exchange([torch.ones(2)], params=[torch.ones(2)])
