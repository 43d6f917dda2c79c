"""The training contract with one trainer: a swarm step is the single-process step.

Each case trains the same small module (4 blocks, 2 stages of one peer each) with a Lightning setting in a local
swarm (``compression="none"``) and in one plain process, and compares the parameters after the run. With
compression off and one peer per stage, the stage servers compute the same float operations in the same order
as the single process (the step's gradient is the sum of the backwards the stage served, summed in arrival
order, which is the order of the single process's backward passes), so the tolerance is float32 rounding:
1e-6 absolute on parameters of magnitude ~0.3.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests import _zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "_contract_job.py")
TOLERANCE = 1e-6


def start(cfg: dict, tmp_path, name: str) -> tuple[subprocess.Popen, str]:
    out = str(tmp_path / f"{name}.pt")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)
    proc = _zygote.Popen(
        [sys.executable, JOB, json.dumps({**cfg, "out": out})],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, out


def finish(started: tuple[subprocess.Popen, str], expect_failure: bool = False) -> dict | str:
    proc, out = started
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if expect_failure:
        assert proc.returncode != 0, stdout[-2000:]
        return stderr
    assert proc.returncode == 0, f"{stdout[-3000:]}\n{stderr[-6000:]}"
    return torch.load(out, weights_only=False)


def run(cfg: dict, tmp_path, name: str, expect_failure: bool = False) -> dict | str:
    return finish(start(cfg, tmp_path, name), expect_failure)


def run_pair(cfg: dict, swarm_cfg: dict, tmp_path, single_cfg: dict | None = None) -> tuple[dict, dict]:
    """The single-process run (``cfg`` updated by ``single_cfg``) and the swarm run (``cfg`` updated by
    ``swarm_cfg``) side by side: the single process is small, and its start-up overlaps the swarm's."""
    single = start({**cfg, "swarm": False, **(single_cfg or {})}, tmp_path, "single")
    swarm = start({**cfg, "swarm": True, **swarm_cfg}, tmp_path, "swarm")
    try:
        return finish(single), finish(swarm)
    finally:
        if swarm[0].poll() is None:  # the single run failed: the swarm run goes too
            swarm[0].kill()
            swarm[0].communicate()


CASES = {
    # LR schedule by step (warm-up from 0), clipping by the whole model's norm, accumulation, AdamW groups
    "warmup_clipnorm_accumulate_adamw": {
        "scheduler": "warmup",
        "clip": [0.3, "norm"],
        "accumulate": 2,
        "optimizer": "adamw",
        "steps": 8,
    },
    # OneCycle (lr and momentum), clipping by value, bf16 autocast on trainer and servers
    "onecycle_clipvalue_bf16mixed": {
        "scheduler": "onecycle",
        "clip": [0.05, "value"],
        "precision": "bf16-mixed",
        "steps": 10,
    },
    # epoch-interval schedule and ReduceLROnPlateau on a validation metric
    "plateau": {"scheduler": "plateau", "steps": 12},
    "step_epoch": {"scheduler": "step_epoch", "steps": 12},
    # two optimizers, manual optimization: the second steps every other batch, zero_grad in between
    "manual_two_optimizers": {"manual": True, "steps": 12},
    # the same with the first optimizer's gradients clipped by norm (self.clip_gradients before its step)
    "manual_two_optimizers_clipnorm": {"manual": True, "manual_clip": 0.3, "steps": 9},
    # "16-mixed" with a loss scaler (a CPU GradScaler: Lightning would pick bf16 on the CPU), clipping by norm:
    # the stages unscale their gradients and clip by the whole model's norm
    "fp16_mixed_scaler_clipnorm": {"fp16_scaler": 2.0**10, "clip": [0.3, "norm"], "steps": 8},
    # the same with accumulation: the deferred input gradients are scaled ones, added before the unscale
    "fp16_mixed_scaler_accumulate": {
        "fp16_scaler": 2.0**10,
        "clip": [0.3, "norm"],
        "accumulate": 2,
        "steps": 6,
    },
    # a model converted to bf16 by Lightning ("bf16-true"): the stages are converted too
    "bf16_true": {"precision": "bf16-true", "steps": 6},
    # LR warm-up by step and accumulation without clipping: the stages step as soon as their backwards of the
    # step are done (early steps), with the LR of that step, and only on the batch that steps
    "warmup_accumulate_adamw_early": {
        "scheduler": "warmup",
        "accumulate": 2,
        "optimizer": "adamw",
        "steps": 8,
    },
    # a residual around the pipeline and accumulation over 3 batches: the stage calls of the first two batches
    # hand the input layer its gradient after the next batch started (deferred), the residual path during the
    # backward; the stages step early
    "residual_accumulate_early": {"residual": True, "accumulate": 3, "optimizer": "adamw", "steps": 6},
    # the same through a run of 2 chunks (both stages chained in one autograd node), with clipping by norm
    "residual_accumulate_chunks_clipnorm": {
        "residual": True,
        "accumulate": 2,
        "clip": [0.3, "norm"],
        "strategy": {"microbatches": 2},
        "steps": 6,
    },
}
# the cases where nothing between the backward and the step can change the stages' step: they step early
EARLY = {"plateau", "step_epoch", "bf16_true", "warmup_accumulate_adamw_early", "residual_accumulate_early"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_swarm_step_is_the_single_process_step(case, tmp_path):
    cfg = CASES[case]
    single, swarm = run_pair(cfg, {}, tmp_path)
    assert swarm["global_step"] == single["global_step"] == cfg["steps"]
    # every stage stepped exactly as often as the trainer's optimizers did
    assert swarm["stage_steps"] == {0: cfg["steps"], 1: cfg["steps"]}, swarm["stage_steps"]
    # every stage step of the early cases was taken early; none of the others (clipping, scaler, manual)
    assert swarm["early_stage_steps"] == (2 * cfg["steps"] if case in EARLY else 0), swarm[
        "early_stage_steps"
    ]
    # every batch that did not step (inside an accumulation window) deferred its stage calls' backwards: both
    # stages' whole calls (the first reached from the second's deferred backward), or one run of chained chunks
    accumulating = 0 if cfg.get("manual") else len(swarm["losses"]) - cfg["steps"]
    per_batch = 1 if cfg.get("strategy", {}).get("microbatches", 1) > 1 else 2
    assert swarm["deferred_backwards"] == per_batch * accumulating, swarm["deferred_backwards"]
    assert swarm["lrs"] == pytest.approx(single["lrs"])
    moved = max(float((single["state"][k] - swarm["state"][k]).abs().max()) for k in single["state"])
    tolerance = 1e-2 if "bf16" in case else TOLERANCE  # bf16: one rounding step of 2^-8 relative
    assert moved <= tolerance, {
        k: float((single["state"][k] - swarm["state"][k]).abs().max()) for k in single["state"]
    }
    # the run trained something: the pipeline moved away from its initialisation
    assert swarm["losses"][-1] != swarm["losses"][0]


def test_with_16_mixed_a_step_whose_gradients_overflowed_is_skipped_everywhere(tmp_path):
    """A loss scale of 2^18 overflows float16 gradients for the first steps: GradScaler skips them and halves the
    scale. In the swarm the stages skip the same steps (an overflowed gradient never reaches them, or theirs
    overflowed) and the run equals the single process's, skipped steps included."""
    cfg = {"fp16_scaler": 2.0**18, "steps": 12}
    single, swarm = run_pair(cfg, {}, tmp_path)
    steps = swarm["stage_steps"]
    assert steps[0] == steps[1] and 0 < steps[0] < cfg["steps"], steps  # some steps skipped, not all
    assert swarm["losses"] == pytest.approx(single["losses"], rel=1e-6)
    moved = max(float((single["state"][k] - swarm["state"][k]).abs().max()) for k in single["state"])
    assert moved <= TOLERANCE


def test_a_target_batch_size_that_the_trainer_does_not_step_with_is_refused(tmp_path):
    stderr = run(
        {"swarm": True, "steps": 2, "strategy": {"target_batch_size": 64}},
        tmp_path,
        "refused",
        expect_failure=True,
    )
    assert "SwarmStrategy(target_batch_size=64) but a global step is 8 samples" in stderr


def test_resuming_restores_the_stages_optimizer_state(tmp_path):
    """A checkpoint saved at the end of the first epoch holds the stages' AdamW moments and step; resuming from it
    in a swarm continues exactly as resuming the same checkpoint in one process (without the stages' optimizer
    state, their moments would restart from zero and the parameters part)."""
    cfg = {"optimizer": "adamw"}
    run_pair(  # the first epoch, saved
        cfg,
        {"steps": 8, "save": str(tmp_path / "swarm.ckpt")},
        tmp_path,
        single_cfg={"steps": 8, "save": str(tmp_path / "single.ckpt")},
    )
    checkpoint = torch.load(tmp_path / "swarm.ckpt", weights_only=False)
    assert sorted(checkpoint["swarm_stages"]["optimizer_states"]) == [0, 1]
    single, swarm = run_pair(
        cfg,
        {"steps": 16, "resume": str(tmp_path / "swarm.ckpt")},
        tmp_path,
        single_cfg={"steps": 16, "resume": str(tmp_path / "single.ckpt")},
    )
    assert len(swarm["losses"]) == len(single["losses"]) == 8
    moved = max(float((single["state"][k] - swarm["state"][k]).abs().max()) for k in single["state"])
    assert moved <= TOLERANCE


def test_two_peers_per_stage_sum_their_gradients_and_end_identical(tmp_path):
    """One trainer, 2 stages of 2 peers each: each batch is cut into one chunk per peer of a stage (microbatches
    "auto"), and the peers' gradients are summed in an averaging round at each step. The peers of a stage end with
    the same parameters at the trainer's step count, to float rounding (hivemind gives each peer the average as its
    own values plus a delta, x + (avg - x), which is the average to the last bit only where the rounding allows:
    1e-6 here), and the result is the single process's (up to the all-reduce's float summation order: 1e-5)."""
    cfg = {"steps": 6, "strategy": {"matchmaking_time": 1.0, "rebalance_period": 0}}
    single, swarm = run_pair(cfg, {"peers_per_stage": 2}, tmp_path)
    peers = [torch.load(f"{tmp_path / 'swarm.pt'}.peer{rank}", weights_only=False) for rank in range(4)]
    by_stage: dict[int, list[dict]] = {}
    for peer in peers:
        by_stage.setdefault(peer["stage"], []).append(peer)
    assert sorted(by_stage) == [0, 1] and all(len(p) == 2 for p in by_stage.values())
    for stage, (a, b) in by_stage.items():
        assert a["state"].keys() == b["state"].keys()
        for key in a["state"]:
            torch.testing.assert_close(a["state"][key], b["state"][key], atol=1e-6, rtol=0, msg=(stage, key))
        # averaging happened (the first steps may find one peer only: the trainer learns of the second a DHT
        # refresh later, and that peer then catches up by downloading the stage's state)
        assert a["info"]["averaged_rounds"] >= 1 and b["info"]["averaged_rounds"] >= 1
        assert a["info"]["epoch"] == b["info"]["epoch"] == cfg["steps"]
    # no clipping, no scaler: every stage step was commanded early, the peers' sum included
    assert swarm["early_stage_steps"] == 2 * cfg["steps"], swarm["early_stage_steps"]
    moved = max(float((single["state"][k] - swarm["state"][k]).abs().max()) for k in single["state"])
    assert moved <= 1e-5


def test_callbacks_that_copy_the_weights_are_refused_with_one_line():
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging

    from lightning_swarm.strategy.swarm import refuse_weight_copies

    for callback in (StochasticWeightAveraging(swa_lrs=0.01), EMAWeightAveraging()):
        trainer = Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[callback])
        with pytest.raises(ValueError, match=f"the {type(callback).__name__} callback is not supported") as e:
            refuse_weight_copies(trainer)
        assert "\n" not in str(e.value)


def test_top_k_checkpointing_decides_on_each_peers_own_value():
    """ModelCheckpoint(save_top_k=k) asks the strategy whether all ranks agree to save; swarm peers do not wait
    for each other, so each decides for itself (a sum compared with the world size would never agree)."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_swarm import SwarmStrategy

    strategy = SwarmStrategy(
        parallel_devices=[torch.device("cpu")] * 4, cluster_environment=LightningEnvironment()
    )
    strategy.set_world_ranks()
    assert strategy.world_size == 4
    assert strategy.reduce_boolean_decision(True) is True
    assert strategy.reduce_boolean_decision(False) is False


def test_with_several_trainers_the_swarms_epoch_drives_the_lr_schedule(tmp_path):
    """Two trainers (stage_steps="async"), batch 8 each, target_batch_size 32: the stages step once per two batches
    of each trainer. A per-step LambdaLR (1 / (1 + s)) must count the swarm's epochs, not a trainer's own steps:
    at the end each trainer's schedule is at the stages' epoch (within the epochs that finish after a trainer's
    last read), far below the 16 steps the trainer took itself, and the stages run with the schedule's lr."""
    cfg = {
        "steps": 16,
        "scheduler": "decay",
        # steps of at least 0.3 s: the stages' progress reaches the DHT, and the trainers' schedules, within a
        # step (with the bare steps of this tiny model, ~0.1 s, the schedule lags the swarm by the DHT's delay)
        "step_s": 0.3,
        "swarm": True,
        "strategy": {
            "num_trainers": 2,
            "stage_steps": "async",
            "target_batch_size": 32,
            "matchmaking_time": 1.0,
            "rebalance_period": 0,
        },
    }
    swarm = run(cfg, tmp_path, "swarm")
    assert swarm["global_step"] == 16
    peers = [torch.load(f"{tmp_path / 'swarm.pt'}.peer{rank}", weights_only=False) for rank in range(2)]
    epoch = max(p["info"]["epoch"] for p in peers)
    # 2 trainers x 16 batches x 8 samples = 256 samples = 8 epochs of 32 (the last may not complete); hivemind
    # also ends an epoch once its estimated time has passed (`ProgressTracker.ready_to_update_epoch`: on a loaded
    # box, with reports late, an epoch may end short: a ninth or, seen once in a full suite on 2 cores, a tenth
    # begins); still far from the 16 steps a schedule counting the trainer's own steps would reach
    assert 6 <= epoch <= 12, epoch
    steps = swarm["schedule_steps"]
    assert epoch - 2 <= steps <= epoch, (steps, epoch)
    assert swarm["lrs"][-1] == pytest.approx(0.05 / (1 + steps))
    # the stages use the lr the trainers sent at their last step: the schedule at some epoch near the end
    for p in peers:
        assert p["lrs"][0] in [pytest.approx(0.05 / (1 + s)) for s in range(epoch - 3, epoch + 1)], p["lrs"]
    # the schedule moved with the swarm along the way: lr changes at most once per trainer step and not at every one
    changes = sum(a != b for a, b in zip(swarm["lrs"], swarm["lrs"][1:], strict=False))
    assert 3 <= changes <= 13, swarm["lrs"]  # 15 if it changed at every step


@pytest.mark.parametrize("stage_steps", ["trainer", "async"])
def test_what_several_trainers_cannot_do_with_several_optimizers_is_refused(stage_steps, tmp_path):
    """Synchronous steps take several optimizers (see test_several_trainers_step_as_ddp) but not a zero_grad()
    after a backward of the same step (the stages hold one sum of every trainer's gradients); the asynchronous
    mode takes one optimizer only."""
    stderr = run(
        {
            "manual": True,
            "zero_after_backward": stage_steps == "trainer",
            "steps": 2,
            "swarm": True,
            "strategy": {"num_trainers": 2, "stage_steps": stage_steps},
        },
        tmp_path,
        "refused",
        expect_failure=True,
    )
    if stage_steps == "trainer":
        line = (
            "ValueError: When using the SwarmStrategy with 2 trainers, optimizer.zero_grad() after a "
            "manual_backward() of the same step is not supported"
        )
    else:
        line = "configure_optimizers must return one optimizer (got 2)"
    assert line in stderr, stderr[-3000:]


def test_an_optimizer_whose_step_needs_a_closure_is_refused_at_setup(tmp_path):
    stderr = run({"optimizer": "lbfgs", "steps": 2, "swarm": True}, tmp_path, "refused", expect_failure=True)
    assert "When using the SwarmStrategy, LBFGS is not supported" in stderr
    assert "Exception ignored" not in stderr


# Several trainers against Lightning's DDP with as many devices: same global batch, data shards and seed.
SEVERAL = {
    # LR warm-up by step, clipping by the whole model's norm, accumulation, AdamW with two parameter groups
    "2_warmup_clipnorm_accumulate_adamw": (
        2,
        {"scheduler": "warmup", "clip": [0.3, "norm"], "accumulate": 2, "optimizer": "adamw", "steps": 10},
    ),
    # a schedule that changes at every step, SGD with momentum; stage 0 has two peers (their sums all-reduced)
    "3_decay_sgd": (3, {"scheduler": "decay", "steps": 10}),
    # "16-mixed" with a loss scaler (a CPU GradScaler) and clipping by norm: the trainers unscale and clip the same
    # averaged gradients, the stages theirs
    "2_fp16_mixed_scaler_clipnorm": (2, {"fp16_scaler": 2.0**10, "clip": [0.3, "norm"], "steps": 8}),
    # manual optimization, two optimizers (the second steps every other batch, both zero_grad before the backward):
    # every optimizer.step() is a global step of its own, with the same stage step ids on every trainer; the first
    # optimizer's gradients clipped by norm (self.clip_gradients before its step: the exchange comes first)
    "2_manual_two_optimizers_clipnorm": (2, {"manual": True, "manual_clip": 0.3, "steps": 10}),
    # batch normalisation in every block, each stage on two peers (their running statistics summed with the
    # gradients at each step): DDP's running statistics are rank 0's, and so are the swarm's, on both peers
    "2_batchnorm_two_peers_per_stage": (2, {"batchnorm": True, "peers_per_stage": 2, "steps": 8}),
}


@pytest.mark.parametrize("case", sorted(SEVERAL))
def test_several_trainers_step_as_ddp(case, tmp_path):
    """K trainers of batch 8 train what DDP on K devices trains: after 10 steps every parameter (the stages' and
    the trainers' own) equals DDP's within 1e-5 (compression "none"), every stage stepped once per global step, the
    trainers' own parameters are identical on every trainer, and no step went without a trainer."""
    trainers, cfg = SEVERAL[case]
    ddp, swarm = run_pair(
        cfg, {"trainers": trainers, "all_ranks": True}, tmp_path, single_cfg={"ddp": trainers}
    )
    steps = cfg["steps"]
    assert swarm["global_step"] == ddp["global_step"] == steps
    assert swarm["stage_steps"] == {0: steps, 1: steps}, swarm["stage_steps"]
    assert swarm["lrs"] == pytest.approx(ddp["lrs"])
    gaps = {k: float((ddp["state"][k] - swarm["state"][k]).abs().max()) for k in ddp["state"]}
    assert max(gaps.values()) <= 1e-5, gaps
    ranks = [torch.load(f"{tmp_path / 'swarm.pt'}.rank{r}", weights_only=False) for r in range(trainers)]
    for other in ranks[1:]:
        assert all(torch.equal(ranks[0]["own"][k], other["own"][k]) for k in ranks[0]["own"])
    for r in ranks:
        assert r["sync"] == {"steps": steps, "missed_trainer_steps": 0, "late_steps": 0, "joined_at": 0}, r[
            "sync"
        ]
    assert swarm["losses"][-1] != swarm["losses"][0]


@pytest.mark.parametrize(
    "layout",
    [
        {},
        # two peers per stage, whose sums go through hivemind's all-reduce (not the same-host sum)
        {"peers_per_stage": 2, "strategy": {"same_host": False}},
    ],
    ids=["one_peer_per_stage", "two_peers_per_stage_through_hivemind"],
)
def test_with_several_trainers_every_buffer_follows_one_trainers_batches_as_in_ddp(layout, tmp_path):
    """DDP's buffers (batch normalisation's running statistics) follow rank 0's batches: its forwards update them, and
    every rank takes rank 0's before each forward (``broadcast_buffers``). With 2 trainers, the stages' buffers and
    the trainers' own (a BatchNorm outside the pipeline) follow the batches of one trainer, the leader: with the
    parameters held still (lr 0), they equal those that trainer's batches give when replayed in one process, within
    1e-6, on every trainer. (Before, every trainer's forwards updated a stage's buffers, and each trainer kept its own.)
    The leader is rank 0, as DDP's buffers follow rank 0's batches. With two peers per stage, the leader's calls go
    to either peer, and the peers' sum of each step carries the changes of their running statistics: the gathered
    model's are those of all of the leader's batches, whichever peer it is gathered from."""
    cfg = {"batchnorm": True, "own_batchnorm": True, "lr_scale": 0.0, "steps": 6, **layout}
    swarm = run({**cfg, "swarm": True, "trainers": 2, "all_ranks": True}, tmp_path, "swarm")
    ranks = [torch.load(f"{tmp_path / 'swarm.pt'}.rank{r}", weights_only=False) for r in range(2)]
    owners = [r for r in range(2) if ranks[r]["owns_buffers"]]
    # the leader is rank 0, as in DDP: the launcher gives the local ranks their peer ids in order
    assert owners == [0], [r["owns_buffers"] for r in ranks]
    reference = run({**cfg, "replay": f"{tmp_path / 'swarm.pt'}.rank{owners[0]}"}, tmp_path, "replay")[
        "state"
    ]
    buffers = [k for k in reference if "running_" in k or "num_batches_tracked" in k]
    assert any(k.startswith("layers.") for k in buffers) and any(k.startswith("own_norm.") for k in buffers)
    gaps = {k: float((reference[k].double() - swarm["state"][k].double()).abs().max()) for k in buffers}
    assert max(gaps.values()) <= 1e-6, gaps
    for r in ranks:
        own = {
            k: float((reference[k].double() - r["own"][k].double()).abs().max())
            for k in r["own"]
            if k in buffers
        }
        assert own and max(own.values()) <= 1e-6, own
    # and every peer of a stage holds them, not only the one the model was gathered from
    peers = [
        torch.load(f"{tmp_path / 'swarm.pt'}.peer{rank}", weights_only=False)
        for rank in range(2 * layout.get("peers_per_stage", 1))
    ]
    for a in peers:
        for b in peers:
            if a["stage"] == b["stage"]:
                for key in (k for k in a["state"] if "running_" in k or "num_batches_tracked" in k):
                    torch.testing.assert_close(a["state"][key], b["state"][key], atol=1e-6, rtol=0, msg=key)


def test_several_trainers_are_reproducible_under_a_seed(tmp_path):
    """Under seed_everything, two runs of 2 trainers (8-bit boundaries, AdamW) end with the same parameters, bit for
    bit, as two runs of DDP do. The runs go side by side: their calls reach the stages in different orders."""
    cfg = {
        "swarm": True,
        "trainers": 2,
        "steps": 10,
        "optimizer": "adamw",
        "all_ranks": True,
        "strategy": {"compression": "8bit"},
    }
    first, second = start(cfg, tmp_path, "first"), start(cfg, tmp_path, "second")
    runs = [finish(first), finish(second)]
    assert runs[0]["global_step"] == runs[1]["global_step"] == 10
    differ = {k: float((runs[0]["state"][k] - runs[1]["state"][k]).abs().max()) for k in runs[0]["state"]}
    assert all(torch.equal(runs[0]["state"][k], runs[1]["state"][k]) for k in runs[0]["state"]), differ
    assert runs[0]["losses"] == runs[1]["losses"]


def test_a_trainer_killed_mid_run_costs_its_own_samples_only(tmp_path):
    """Three trainers; the third SIGKILLs itself at global step 4 of 12. The two others finish every step and exit
    0; the steps after the death went on without it (the leader counts the missing trainer-steps), and the two
    survivors' own parameters are identical."""
    cfg = {
        "swarm": True,
        "trainers": 3,
        "steps": 12,
        "all_ranks": True,
        "kill": [2, 4],
        "strategy": {"trainer_timeout": 20.0, "rebalance_period": 0},
    }
    swarm = run(cfg, tmp_path, "swarm")
    assert swarm["global_step"] == 12
    ranks = [torch.load(f"{tmp_path / 'swarm.pt'}.rank{r}", weights_only=False) for r in range(2)]
    assert all(torch.equal(ranks[0]["own"][k], ranks[1]["own"][k]) for k in ranks[0]["own"])
    assert all(r["sync"]["steps"] == 12 for r in ranks), [r["sync"] for r in ranks]
    # the leader of the steps after the death waited for the dead trainer at least once, then went on without it
    missed = sum(r["sync"]["missed_trainer_steps"] for r in ranks)
    assert 1 <= missed <= 12 - 4, [r["sync"] for r in ranks]


def test_a_trainer_that_joins_late_trains_from_the_current_parameters_and_schedule_step(tmp_path):
    """Three trainers; the third starts 12 s late (the others go on without it after trainer_timeout). It joins with
    the leader's state at a step boundary: its own parameters, optimizer and LR schedule (a per-step decay) and
    Lightning's step count. Every trainer ends at the same global step, lr and own parameters, and the stages
    stepped once per global step."""
    cfg = {
        "swarm": True,
        "trainers": 3,
        "steps": 40,
        "step_s": 0.5,
        "scheduler": "decay",
        "all_ranks": True,
        "delay": [2, 12],
        "strategy": {"trainer_timeout": 3.0, "rebalance_period": 0},
    }
    swarm = run(cfg, tmp_path, "swarm")
    ranks = [torch.load(f"{tmp_path / 'swarm.pt'}.rank{r}", weights_only=False) for r in range(3)]
    assert [r["sync"]["joined_at"] for r in ranks][:2] == [0, 0]
    assert 0 < ranks[2]["sync"]["joined_at"] < 40, ranks[2]["sync"]
    assert [r["global_step"] for r in ranks] == [40, 40, 40]
    assert len({r["lr"] for r in ranks}) == 1 and ranks[0]["lr"] == pytest.approx(0.05 / (1 + 40))
    for other in ranks[1:]:
        assert all(torch.equal(ranks[0]["own"][k], other["own"][k]) for k in ranks[0]["own"])
    assert swarm["stage_steps"] == {0: 40, 1: 40}, swarm["stage_steps"]
