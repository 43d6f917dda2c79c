"""Trainer-driven stage steps (``swarm/training/stepping.py``) on real stage servers over hivemind's P2P on 127.0.0.1:
a remote peer steps exactly as a local torch optimizer with the commanded hyper-parameters, a retried command is
applied once, malformed commands are refused without harm, and a server that steps on its own says so."""

from __future__ import annotations

import io
import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator

import hivemind
import msgpack
import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from torch import nn

from lightning_swarm.swarm.client.client import SwarmClient
from lightning_swarm.swarm.client.commands import _tensors_agree
from lightning_swarm.swarm.loop import run_coroutine
from lightning_swarm.swarm.server import StageServer
from lightning_swarm.swarm.settings import SwarmSettings
from lightning_swarm.swarm.states import LEAVING
from lightning_swarm.swarm.training.stepping import (
    StepCommand,
    hyper_parameters,
    parse_command,
    parse_step_reply,
)
from lightning_swarm.swarm.wire.protocol import stage_uid
from tests._helpers import local_dhts

_ids = itertools.count()


@pytest.fixture(scope="module")
def dhts() -> Iterator[tuple[hivemind.DHT, hivemind.DHT]]:
    trainer, server = local_dhts(2)
    yield trainer, server
    server.shutdown()
    trainer.shutdown()


def _setup(dhts, cleanup, stage_steps: str = "trainer") -> tuple[StageServer, SwarmClient, nn.Module, str]:
    trainer_dht, server_dht = dhts
    run_id = f"step-{next(_ids)}"
    settings = SwarmSettings(
        run_id=run_id,
        num_stages=1,
        compression="none",
        stage_steps=stage_steps,
        request_timeout=10.0,
        no_peers_timeout=5.0,
    )
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    reference = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    reference.load_state_dict(module.state_dict())
    groups = [
        {"params": [module[0].weight, module[2].weight], "weight_decay": 0.1, "swarm_group": 0},
        {"params": [module[0].bias, module[2].bias], "weight_decay": 0.0, "swarm_group": 1},
    ]
    server = StageServer(
        0,
        module,
        dht=server_dht,
        settings=settings,
        param_groups=groups,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        throughput=1.0,
    )
    cleanup.append(server)
    server.start()
    client = SwarmClient(trainer_dht, settings)
    cleanup.append(client)
    client.peers(0)
    return server, client, reference, run_id


def test_a_remote_stage_steps_as_a_torch_optimizer_with_the_commanded_hyper_parameters(dhts, cleanup):
    server, client, reference, run_id = _setup(dhts, cleanup)
    opt = torch.optim.SGD(
        [
            {"params": [reference[0].weight, reference[2].weight], "weight_decay": 0.1},
            {"params": [reference[0].bias, reference[2].bias], "weight_decay": 0.0},
        ],
        lr=0.1,
        momentum=0.9,
    )
    x = torch.randn(8, 4)
    for step, lr in enumerate([0.0, 0.05, 0.2]):  # a schedule: the server was built with lr 0.1
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        reference(x).pow(2).sum().backward()
        opt.step()
        # the swarm: a differentiable call, then the trainer's step command with its groups' hyper-parameters
        inputs = x.clone().requires_grad_()
        client.call_stage(0, inputs).pow(2).sum().backward()
        command = StepCommand(
            stage_uid(run_id, 0),
            1000 + step,
            groups={g: hyper_parameters(h) for g, h in enumerate(opt.param_groups)},
        )
        replies = client.commands.step_stage(0, command)
        assert replies[0]["epoch"] == step + 1
        again = client.commands.step_stage(0, command)  # a retried command is answered, not applied twice
        assert again[0]["epoch"] == step + 1
    served = server.state_dict_local()
    for key, value in reference.state_dict().items():
        assert torch.allclose(served[key], value, atol=1e-6), key
    assert server.stepper.steps == 3


class _NaNForLargeInputs(torch.autograd.Function):
    """``x * w``, whose gradient of ``w`` is NaN when an input exceeds 50 (its output and input gradient stay finite)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_w = (grad * x).sum(0)
        return grad * w, grad_w * float("nan") if bool((x > 50).any()) else grad_w


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return _NaNForLargeInputs.apply(x, self.w)


def test_a_trainer_driven_step_whose_gradients_are_not_finite_is_skipped_whole(dhts, cleanup, caplog):
    """As one process with GradScaler skips a step whose gradients overflowed: the stage does not step on the
    finite rest of them (the swarm-driven path drops the one backward instead: tests/test_hostile.py)."""
    trainer_dht, server_dht = dhts
    run_id = f"step-{next(_ids)}"
    settings = SwarmSettings(run_id=run_id, num_stages=1, compression="none", stage_steps="trainer")
    server = StageServer(
        0, _Scale(), dht=server_dht, settings=settings, optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1)
    )
    cleanup.append(server)
    server.start()
    client = SwarmClient(trainer_dht, settings)
    cleanup.append(client)
    client.peers(0)
    before = server.state_dict_local()["w"].clone()
    for x in (torch.full((2, 4), 100.0), torch.ones(2, 4)):  # a non-finite backward, then a finite one
        client.call_stage(0, x.requires_grad_()).sum().backward()
    with caplog.at_level(logging.WARNING, logger="lightning_swarm.swarm.server"):
        (reply,) = client.commands.step_stage(0, StepCommand(stage_uid(run_id, 0), 1))
    assert reply["finite"] is False and server.stepper.steps == 0
    assert torch.equal(server.state_dict_local()["w"], before)
    assert any("not finite; this stage skips the step" in r.getMessage() for r in caplog.records)
    client.call_stage(
        0, torch.ones(2, 4, requires_grad=True)
    ).sum().backward()  # the next step is whole again
    (reply,) = client.commands.step_stage(0, StepCommand(stage_uid(run_id, 0), 2))
    assert reply["finite"] is True and server.stepper.steps == 1
    torch.testing.assert_close(server.state_dict_local()["w"], before - 0.1 * 2.0)


def test_malformed_step_commands_are_refused_and_the_server_keeps_serving(dhts, cleanup):
    server, client, _, run_id = _setup(dhts, cleanup)
    uid = stage_uid(run_id, 0)
    good = msgpack.unpackb(StepCommand(uid, 1).encode(), strict_map_key=False)
    bad = [
        b"\x00garbage",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({**good, "uid": "other.stage0"}),
        msgpack.packb({**good, "phase": "explode"}),
        msgpack.packb({**good, "grad_scale": float("nan")}),
        msgpack.packb({**good, "clip_coef": 3.0}),
        msgpack.packb({**good, "groups": {0: {"lr": "x" * 10, "params": [1]}}}),
        msgpack.packb({**good, "groups": {0: {"lr": [float("nan")]}}}),
        msgpack.packb({**good, "step_id": -1}),
        msgpack.packb({**good, "group": "everyone"}),
        msgpack.packb({**good, "group": [b"a", b"a"]}),
        msgpack.packb({**good, "group": [b"x" * 4096]}),
    ]
    stub = client.transport(server.peer_id, 0).stub
    for data in bad:
        reply = run_coroutine(stub.rpc_step(runtime_pb2.ExpertInfo(serialized_info=data)), timeout=10)
        parsed = msgpack.unpackb(reply.serialized_info)
        assert parsed["epoch"] == -1 and parsed["error"], data
    with pytest.raises(ValueError, match="phase"):
        parse_command(msgpack.packb({**good, "phase": "explode"}), uid)
    assert server.stepper.steps == 0
    # still serving and stepping
    client.call_stage(0, torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert client.commands.step_stage(0, StepCommand(uid, 7))[0]["epoch"] == 1


def test_a_server_that_steps_on_its_own_refuses_commands_with_the_fix(dhts, cleanup):
    _, client, _, run_id = _setup(dhts, cleanup, stage_steps="async")
    with pytest.raises(RuntimeError, match="start every peer of the run with the same stage_steps"):
        client.commands.step_stage(0, StepCommand(stage_uid(run_id, 0), 1))


def test_with_several_trainers_the_stages_take_the_trainers_schedule_for_their_next_step(dhts, cleanup):
    """stage_steps="async": the stage steps on its own, with the hyper-parameters a trainer last sent."""
    server, client, _, run_id = _setup(dhts, cleanup, stage_steps="async")
    groups = {0: {"lr": 0.025, "weight_decay": 0.1}, 1: {"lr": 0.5, "weight_decay": 0.0}}
    client.commands.step_stage(0, StepCommand(stage_uid(run_id, 0), 3, phase="hyper", groups=groups))
    assert server.optimizer is not None
    stage_groups = server.optimizer.state_averager.optimizer.param_groups
    assert [g["lr"] for g in stage_groups] == [0.025, 0.5]
    assert server.stepper.steps == 0  # a hyper-parameter update is no step


def _block(batchnorm: bool) -> nn.Module:
    norm = [nn.BatchNorm1d(4)] if batchnorm else []
    return nn.Sequential(nn.Linear(4, 4), *norm, nn.Tanh(), nn.Linear(4, 2))


def _two_peer_stage(
    dhts,
    cleanup,
    matchmaking_time: float,
    averaging_timeout: float,
    same_host: bool = True,
    batchnorm: bool = False,
):
    """Two server peers of one stage (on the module's server DHT and a third DHT), a client, the modules' common
    initial weights in a reference module, and the run id. ``same_host``: the peers sum named rounds through
    shared memory (``swarm/wire/same_host_sum.py``), else through hivemind's all-reduce. ``batchnorm``: a
    BatchNorm1d after the first layer."""
    trainer_dht, server_dht = dhts
    third = hivemind.DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=trainer_dht.get_visible_maddrs()
    )
    cleanup.append(third)
    run_id = f"step-{next(_ids)}"
    settings = SwarmSettings(
        run_id=run_id,
        num_stages=1,
        compression="none",
        stage_steps="trainer",
        request_timeout=10.0,
        no_peers_timeout=20.0,
        matchmaking_time=matchmaking_time,
        averaging_timeout=averaging_timeout,
        same_host=same_host,
    )
    torch.manual_seed(0)
    module, reference = _block(batchnorm), _block(batchnorm)
    reference.load_state_dict(module.state_dict())
    servers = []
    for dht in (server_dht, third):
        copy = _block(batchnorm)
        copy.load_state_dict(module.state_dict())
        server = StageServer(
            0,
            copy,
            dht=dht,
            settings=settings,
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            throughput=1.0,
        )
        cleanup.append(server)
        server.start()
        servers.append(server)
    client = SwarmClient(trainer_dht, settings)
    cleanup.append(client)
    deadline = time.monotonic() + 30
    while len(client.peers(0)) < 2:
        assert time.monotonic() < deadline, "the second peer never appeared"
        time.sleep(0.5)
    return servers, client, reference, settings, run_id


def _backwards_on_both(client, servers, reference) -> None:
    """Six calls spread over the two peers, and the same batches through ``reference`` (one SGD step)."""
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x in [torch.randn(8, 4) for _ in range(6)]:
        reference(x).pow(2).sum().backward()
        client.call_stage(0, x.clone().requires_grad_()).pow(2).sum().backward()
    opt.step()
    assert all(s.shared.pending_backwards > 0 for s in servers), "the calls did not reach both peers"


def _assert_stepped_as_one(servers, reference) -> None:
    for server in servers:
        served = server.state_dict_local()
        for key, value in reference.state_dict().items():
            assert torch.allclose(served[key], value, atol=1e-6), key
        assert server.stepper.steps == 1 and server.stepper.averaged_rounds >= 1


@pytest.mark.parametrize("same_host", [True, False], ids=["shared-memory", "hivemind"])
def test_a_peer_that_summed_alone_sums_again_with_the_peers_a_trainer_names(dhts, cleanup, same_host):
    """Two peers of one stage; the first is commanded alone once, by a command that names no peers (as from a
    trainer that does not name them, when its partner missed the round): it looks for a group by matchmaking and
    finds nobody within a few matchmaking periods, not ``averaging_timeout``. The trainer's step then names both:
    the first peer's sum was made with another group, so it sums again from its own gradients (its partner would
    otherwise wait for it in vain), and both step with the sum of every backward: the parameters of one SGD step
    over the whole batch, identical on both peers."""
    servers, client, reference, settings, run_id = _two_peer_stage(
        dhts, cleanup, matchmaking_time=1.0, averaging_timeout=60.0, same_host=same_host
    )
    _backwards_on_both(client, servers, reference)
    uid = stage_uid(run_id, 0)
    started = time.monotonic()
    alone = servers[0].step_command(StepCommand(uid, 42, phase="norm", peers=2))
    assert alone["group"] == 1 and time.monotonic() - started < 3 * settings.matchmaking_time + 6
    assert len(alone["sq_norms"]) > 1 and sum(alone["sq_norms"]) == pytest.approx(alone["sq_norm"])
    replies = client.commands.step_stage(0, StepCommand(uid, 42, groups={0: {"lr": 0.1}}))
    assert len(replies) == 2 and {r["group"] for r in replies} == {2}
    _assert_stepped_as_one(servers, reference)


@pytest.mark.parametrize("same_host", [True, False], ids=["shared-memory", "hivemind"])
def test_two_peers_of_a_stage_redo_a_sum_they_disagree_on_and_step_as_one(dhts, cleanup, same_host):
    """The first peer of a stage is commanded alone with the step's named group, and its partner does not come: it
    keeps its own gradients (group 1) for that attempt. The trainer's step, naming both for the same attempt,
    gets that reply again from it while the partner waits for it in vain: the sums disagree, the trainer has both
    sum again (the next attempt, through hivemind even where the first went through shared memory), and both
    step as one."""
    servers, client, reference, settings, run_id = _two_peer_stage(
        dhts, cleanup, matchmaking_time=60.0, averaging_timeout=3.0, same_host=same_host
    )
    _backwards_on_both(client, servers, reference)
    uid = stage_uid(run_id, 0)
    group = [p.to_bytes() for p in client.live_peers(0)]
    assert len(group) == 2
    first = next(s for s in servers if s.peer_id.to_bytes() == group[0])
    alone = first.step_command(StepCommand(uid, 42, phase="norm", peers=2, group=group))
    assert alone["group"] == 1
    replies = client.commands.step_stage(0, StepCommand(uid, 42, groups={0: {"lr": 0.1}}))
    assert len(replies) == 2 and {r["group"] for r in replies} == {2}
    _assert_stepped_as_one(servers, reference)
    # the redo (the second attempt) went through hivemind in both cases: it works where the peers failed to meet
    assert [s.stepper.same_host_rounds for s in servers] == [0, 0] and all(
        s.stepper.averaged_rounds == 1 for s in servers
    )


@pytest.mark.parametrize("same_host", [True, False], ids=["shared-memory", "hivemind"])
def test_the_peers_a_trainer_names_sum_without_matchmaking(dhts, cleanup, same_host):
    """The trainer names a stage's peers in its step command: they sum their gradients among exactly them, under
    an id they derive from the command, without hivemind's matchmaking (which would wait ``matchmaking_time``,
    here longer than the whole step is given). A named peer that never joins fails the round within
    ``averaging_timeout``, and the other steps with its own gradients after the trainer drops it."""
    servers, client, reference, settings, run_id = _two_peer_stage(
        dhts, cleanup, matchmaking_time=60.0, averaging_timeout=5.0, same_host=same_host
    )
    _backwards_on_both(client, servers, reference)
    uid = stage_uid(run_id, 0)
    started = time.monotonic()
    replies = client.commands.step_stage(0, StepCommand(uid, 42, groups={0: {"lr": 0.1}}))
    assert time.monotonic() - started < settings.matchmaking_time / 2
    assert len(replies) == 2 and {r["group"] for r in replies} == {2}
    _assert_stepped_as_one(servers, reference)
    assert [s.stepper.same_host_rounds for s in servers] == ([1, 1] if same_host else [0, 0])
    # a named partner that never comes: the round fails within averaging_timeout, not matchmaking_time
    absent = PeerID.from_base58("QmUF1j7CVgoe7s3PsFxon3eEQFGBBgRWDkB4sq2UMgCEYA")
    client.call_stage(0, torch.randn(8, 4, requires_grad=True)).sum().backward()
    server = next(s for s in servers if s.shared.pending_backwards > 0)
    group = [server.peer_id.to_bytes(), absent.to_bytes()]
    started = time.monotonic()
    reply = server.step_command(StepCommand(uid, 43, phase="norm", peers=2, group=group))
    assert reply["group"] == 1 and time.monotonic() - started < settings.averaging_timeout + 10


def _a_step_without_the_second_peer(dhts, cleanup, batchnorm: bool = False):
    """A stage of two peers whose second the trainer has banned, one call (reaching the first only) and one step,
    and the same batch through the reference (one SGD step): the peers, the client, the reference, the run id and
    the step's replies."""
    servers, client, reference, _, run_id = _two_peer_stage(
        dhts, cleanup, matchmaking_time=1.0, averaging_timeout=5.0, batchnorm=batchnorm
    )
    first, second = servers
    with client.router_lock:
        client.routers[0].ban(second.peer_id)
    x = torch.randn(8, 4)
    reference(x).pow(2).sum().backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    client.call_stage(0, x.clone().requires_grad_()).pow(2).sum().backward()
    assert first.shared.pending_backwards == 1 and second.shared.pending_backwards == 0
    replies = client.commands.step_stage(0, StepCommand(stage_uid(run_id, 0), 42, groups={0: {"lr": 0.1}}))
    return first, second, client, reference, run_id, replies


def test_a_peer_that_missed_a_step_catches_up_before_it_serves(dhts, cleanup):
    """A stage's second peer is not in a step (the trainer did not know it yet, or had banned it): the first peer
    steps alone. A call the trainer then routes to the second carries the stage's epoch as the trainer saw it
    after the step; the second peer is behind it, so it loads the stage's state from the first before serving,
    and serves the stepped parameters, not the ones from before the step (a stale peer's outputs and gradients
    would train a different model than one process does)."""
    first, second, client, reference, run_id, replies = _a_step_without_the_second_peer(dhts, cleanup)
    router = client.routers[0]
    assert [r["epoch"] for r in replies] == [1] and second.optimizer.local_epoch == 0
    client.stage_epochs[0] = (
        1  # what a trainer peer records from its step's replies (TrainerSteps.step_stages)
    )
    with client.router_lock:
        router.report_success(second.peer_id)
    # a stage's state (a checkpoint, the final model) comes from the peer with the newest epoch, not the stale one
    for _ in range(4):
        fetched = client.fetch_stage_state(0)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(fetched[key], value, atol=1e-6, rtol=0)
        optimizer = torch.load(io.BytesIO(client.commands.fetch_optimizer_state(0)), weights_only=False)
        assert optimizer["epoch"] == 1
    assert second.optimizer.local_epoch == 0
    with client.router_lock:
        router.ban(first.peer_id)
    y = torch.randn(8, 4)
    served = client.call_stage(0, y.clone().requires_grad_())
    assert second.optimizer.local_epoch == 1
    torch.testing.assert_close(served, reference(y), atol=1e-6, rtol=0)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(second.state_dict_local()[key], value, atol=1e-6, rtol=0)
    # a live peer whose rpc_info reply is malformed (a list, another stage) is skipped by stage_info and by the
    # newest-peer choice of a fetch, not fatal to the trainer
    with client.router_lock:
        router.report_success(first.peer_id)
    for garbage in ([1, 2], {"stage": "0", "epoch": 10**6}):
        first.info = lambda garbage=garbage: garbage
        infos = client.stage_info(0)
        assert len(infos) == 1 and infos[0]["epoch"] == 1
        assert client.most_current_peer(0) == second.peer_id
        torch.testing.assert_close(
            client.fetch_stage_state(0)["0.weight"], reference[0].weight, atol=1e-6, rtol=0
        )


def test_an_incomplete_state_from_a_donor_is_not_loaded_and_is_not_an_error(dhts, cleanup, caplog):
    """A donor whose state download ends early without an error (fewer tensors than the stage's parameters):
    hivemind's state averager logged an ERROR, loaded nothing, and the joining peer took the download for a
    success. It is one warning now, the peer reports that nothing was loaded and keeps its own parameters, and
    the next complete download loads the stage's state."""
    first, second, _, reference, _, _ = _a_step_without_the_second_peer(dhts, cleanup)
    before = {k: v.clone() for k, v in second.state_dict_local().items()}
    # the donor's state averager serves what its optimizer holds (hivemind keeps a reference to its
    # get_current_state): with one parameter left in its first group, it sends fewer tensors than the stage has
    group = first.optimizer.state_averager.optimizer.param_groups[0]
    complete = group["params"]
    try:
        group["params"] = complete[:1]
        with caplog.at_level(logging.WARNING):
            assert second.load_state_from_peers() is False
    finally:
        group["params"] = complete
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for level, m in said if level >= logging.ERROR], said
    assert [m for _, m in said if "A state downloaded from a peer was incomplete" in m], said
    assert second.optimizer.local_epoch == 0
    for key, value in before.items():
        assert torch.equal(second.state_dict_local()[key], value), key
    assert second.load_state_from_peers() is True  # the donor's whole state: loaded
    assert second.optimizer.local_epoch == 1
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(second.state_dict_local()[key], value, atol=1e-6, rtol=0, msg=key)


def test_a_peer_that_catches_up_takes_the_stages_running_statistics_with_its_parameters(dhts, cleanup):
    """With batch normalisation: a peer that missed a step loads the stage's running statistics with its parameters
    and optimizer state, so the call it then serves updates the statistics the stage holds, as one process's
    forwards do (not the ones it had before the step)."""
    first, second, client, reference, run_id, _ = _a_step_without_the_second_peer(
        dhts, cleanup, batchnorm=True
    )
    router = client.routers[0]
    client.stage_epochs[0] = 1  # what a trainer peer records from its step's replies
    with client.router_lock:
        router.report_success(second.peer_id)
        router.ban(first.peer_id)
    y = torch.randn(8, 4)
    torch.testing.assert_close(client.call_stage(0, y.clone()), reference(y), atol=1e-6, rtol=0)
    assert second.optimizer.local_epoch == 1
    served = second.state_dict_local()
    assert served["1.num_batches_tracked"] == 2
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(served[key], value, atol=1e-6, rtol=0, msg=key)


def test_a_stage_steps_early_only_once_every_call_of_the_step_had_its_backward():
    """The bookkeeping behind early stage steps (swarm/training/early_steps.py): a stage fires once its open calls all
    returned while armed, once per step; a call without a backward (its output unused, or a chunk sent ahead)
    keeps its stage from firing; calls that returned before the arming (outside the step's backward) never fire;
    a second backward of a call (retain_graph) does not count, nor does the backward of a call opened before the
    step began (deferred from the accumulation window, see swarm/client/deferred_grads.py)."""
    from lightning_swarm.swarm.training.early_steps import OpenGradCalls

    fired: list[int] = []
    calls = OpenGradCalls()
    before = calls.opened(0)
    calls.closed(0, before)  # before the backward of the step: not armed
    earlier = calls.opened(1)  # its backward is deferred past the step's start
    calls.reset()
    now = [calls.opened(stage) for stage in (0, 0, 1, 1, 2)]
    assert set(now) == {earlier + 1}
    calls.arm(fired.append)
    calls.closed(1, earlier)  # the earlier step's call: stage 1's two calls of this step still wait
    calls.closed(1, now[2])
    assert fired == []  # one call of stage 1 still waits for its backward
    calls.closed(1, now[3])
    calls.closed(0, now[0])
    calls.closed(0, now[1])
    calls.closed(0, now[1])  # a second backward of a call: no second step
    assert fired == [1, 0]  # stage 2's call never had a backward: it steps after the trainer's backward
    calls.disarm()
    calls.closed(2, now[4])
    assert fired == [1, 0]
    calls.reset()
    calls.arm(fired.append)
    calls.closed(2, calls.opened(2))
    assert fired == [1, 0, 2]  # a new step


def test_peers_sums_must_agree_tensor_by_tensor():
    """The trainer's check of a stage's peers' sums: the whole squared norm can agree to 1e-5 while a small tensor
    differs (a part of the sum that one peer missed in the round and replaced by its own values); the peers then
    sum again. Rounding differences agree; a malformed report disagrees; peers that report none are not compared."""
    big, small = 1e6, 1e-3
    assert _tensors_agree([[big, small], [big * (1 + 1e-7), small * (1 + 1e-7)]])
    assert not _tensors_agree([[big, small], [big, small * 2]])  # the whole norms agree to 1e-9
    assert not _tensors_agree([[big, small], [big]])
    assert not _tensors_agree([[big, small], ["x", small]])
    assert not _tensors_agree([[big, float("nan")], [big, small]])
    assert _tensors_agree([None, [big, small]]) and _tensors_agree([])
    ok = {"epoch": 1, "sq_norm": 2.0, "sq_norms": [1.0, 1.0]}
    assert parse_step_reply(msgpack.packb(ok))["sq_norms"] == [1.0, 1.0]
    for bad in ({"sq_norms": "1"}, {"sq_norms": [1.0, True]}, {"sq_norms": [[1.0]]}):
        with pytest.raises(ValueError, match="sq_norms"):
            parse_step_reply(msgpack.packb({"epoch": 1, **bad}))


def test_a_peer_whose_gradient_averager_dies_mid_round_leaves_the_stage_and_nothing_waits_on_it(
    dhts, cleanup, caplog
):
    """The gradient averager of one of a stage's two peers is SIGKILLed during an averaging round, while it holds
    the averaged tensors' lock (its partner never comes): the peer's step command is answered with an error within
    a poll period of the death, not after the round's timeout (nor never, on the lock). The peer says so once and
    leaves the stage (announced, calls refused, its optimizer shut down, nothing waiting on the dead helper), and
    the trainer steps the stage's other peer alone."""
    caplog.set_level(logging.WARNING)
    servers, client, reference, settings, run_id = _two_peer_stage(
        dhts, cleanup, matchmaking_time=1.0, averaging_timeout=30.0, same_host=False
    )
    _backwards_on_both(client, servers, reference)
    uid = stage_uid(run_id, 0)
    victim, other = servers
    averager = victim.optimizer.grad_averager
    absent = PeerID.from_base58("QmUF1j7CVgoe7s3PsFxon3eEQFGBBgRWDkB4sq2UMgCEYA")
    group = [victim.peer_id.to_bytes(), absent.to_bytes()]
    threading.Timer(1.0, os.kill, (averager.pid, signal.SIGKILL)).start()
    started = time.monotonic()
    reply = victim.step_command(StepCommand(uid, 42, phase="norm", peers=2, group=group))
    assert "error" in reply and "died" in reply["error"], reply
    assert time.monotonic() - started < 10.0  # the round would have waited 30 s for the absent partner
    assert "error" in victim.step_command(StepCommand(uid, 43, phase="norm", peers=2, group=group))
    deadline = time.monotonic() + 30
    while victim.optimizer is not None:  # announced leaving, drained, shut its optimizer down
        assert time.monotonic() < deadline, "the peer did not leave the stage"
        time.sleep(0.2)
    assert victim.state == LEAVING and not victim.backend.accepting
    replies = client.commands.step_stage(0, StepCommand(uid, 44, groups={0: {"lr": 0.1}}))
    assert len(replies) == 1 and other.stepper.steps == 1
    started = time.monotonic()
    victim.release_training_state()
    victim.shutdown()
    assert time.monotonic() - started < 10.0
    deaths = [r for r in caplog.records if "died during the run" in r.getMessage()]
    assert len(deaths) == 1 and deaths[0].levelno == logging.WARNING, [r.getMessage() for r in deaths]
