"""SwarmStrategy end to end: real peer processes on 127.0.0.1 started by Lightning's launcher."""

import json
import os
import sys

import pytest
import torch
import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI

import lightning_swarm
from lightning_swarm import SwarmStrategy
from lightning_swarm.swarm import SwarmSettings
from tests import _zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALBERT_SMALL = {"embedding_size": 16, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64}
JOB = os.path.join(ROOT, "tests", "swarm_job.py")


def run_job(cfg: dict, timeout: float) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)
    proc = _zygote.run(
        [sys.executable, JOB, json.dumps(cfg)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"swarm job failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    result = torch.load(cfg["out"], weights_only=False)
    result["stderr"] = proc.stderr
    return result


def test_registered_names_and_defaults():
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    assert "swarm" in StrategyRegistry and "swarm" in AcceleratorRegistry
    trainer = Trainer(strategy="swarm", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, SwarmStrategy)
    assert trainer.strategy.settings.compression == "8bit"
    # the strategy's defaults are the engine's: one source of defaults
    assert SwarmStrategy().settings == SwarmSettings()
    trainer = Trainer(strategy="swarm", accelerator="swarm", devices=1, logger=False)
    assert isinstance(trainer.accelerator, lightning_swarm.SwarmAccelerator)


def test_bad_arguments_fail_early_with_the_fix():
    with pytest.raises(ValueError, match="compression='zip'"):
        SwarmStrategy(compression="zip")
    with pytest.raises(ValueError, match="num_stages"):
        SwarmStrategy(num_stages=0)


def test_lightning_cli_yaml_builds_the_strategy(tmp_path):
    from examples.albert.data import AlbertDataModule
    from examples.albert.model import Albert

    config = {
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "strategy": {
                "class_path": "lightning_swarm.SwarmStrategy",
                "init_args": {"pipeline": "layers", "num_stages": 2, "compression": "fp16", "run_id": "cli"},
            },
        }
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = LightningCLI(Albert, AlbertDataModule, run=False, args=["--config", str(path)])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, SwarmStrategy)
    assert (strategy.settings.compression, strategy.settings.run_id, strategy.settings.pipeline) == (
        "fp16",
        "cli",
        "layers",
    )


def reference_state(model_kind: str, steps: int) -> dict:
    """The same job in plain single-process Lightning."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import swarm_job

    model, data = swarm_job.build({"model": model_kind})
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    return model.state_dict()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model_kind", ["seq", "list"])
def test_one_step_through_a_two_stage_swarm_equals_plain_lightning(tmp_path, model_kind):
    cfg = {
        "model": model_kind,
        "devices": 2,
        "max_steps": 1,
        "out": str(tmp_path / "out.pt"),
        "threads_dir": str(tmp_path),
        "strategy": {
            "pipeline": "layers",
            "num_stages": 2,
            "num_trainers": 1,
            "compression": "none",
            "target_batch_size": 16,
            "run_id": f"eq_{model_kind}",
        },
    }
    swarm = run_job(cfg, timeout=280)["state"]
    expected = reference_state(model_kind, steps=1)
    assert set(swarm) == set(expected)
    initial = swarm_initial_state(model_kind)
    changed = 0
    for key, value in expected.items():
        torch.testing.assert_close(swarm[key], value, atol=1e-5, rtol=0, msg=f"{key} differs")
        changed += int(not torch.equal(value, initial[key]))
    assert changed == len(expected)  # every parameter moved, in the swarm as in the reference
    # one trainer, one peer per stage, whole calls: the peers take turns, so each computes on all the cores
    assert peer_threads(tmp_path, 2) == [expected_threads(1)] * 2


@pytest.mark.timeout(300)
def test_the_default_progress_bar_shows_the_swarms_figures_with_no_callback(tmp_path):
    """Lightning's own TQDM bar, as a user gets it: the strategy's logged figures are on it (samples/s, live peers
    per stage, bytes on the wire, averaging rounds), with no callback of the project's."""
    cfg = {
        "model": "seq",
        "devices": 2,
        "max_steps": 12,
        "progress_bar": True,
        "out": str(tmp_path / "out.pt"),
        "strategy": {
            "pipeline": "layers",
            "num_stages": 2,
            "num_trainers": 1,
            "target_batch_size": 16,
            "run_id": "progress_bar",
        },
    }
    bars = run_job(cfg, timeout=280)["bar"]
    assert len(bars) == 12 and all(bar["bar"] == "TQDMProgressBar" for bar in bars)
    last = bars[-1]
    assert float(last["swarm/samples_per_s"]) > 0
    # one peer per stage: rank 0 trains and serves stage 0, rank 1 serves stage 1
    assert float(last["swarm/stage0/peers"]) == 1 and float(last["swarm/stage1/peers"]) == 1
    # stage 1 is another process: its calls cross the wire, and the count only grows
    wire = [float(bar["swarm/wire_mb"]) for bar in bars]
    assert wire[-1] > 0 and wire == sorted(wire)
    # a stage alone averages with nobody: 0 rounds, shown rather than left out
    assert float(last["swarm/stage0/rounds"]) == 0 and float(last["swarm/stage1/rounds"]) == 0
    assert "swarm/bytes_sent" not in last  # the rest of the counters go to the logger only


def expected_threads(computing_at_once: int) -> int:
    """The torch threads of each peer of a local swarm in which ``computing_at_once`` peers compute at once."""
    from lightning.fabric.utilities.distributed import _suggested_max_num_threads

    omp = os.environ.get("OMP_NUM_THREADS")
    return int(omp) if omp else _suggested_max_num_threads(computing_at_once)


def peer_threads(directory, peers: int) -> list[int]:
    return [json.loads((directory / f"peer{r}.json").read_text())["threads"] for r in range(peers)]


def swarm_initial_state(model_kind: str) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import swarm_job

    model, _ = swarm_job.build({"model": model_kind})
    return model.state_dict()


def lm_job(tmp_path, compression: str) -> dict:
    cfg = {
        "model": "albert",
        "devices": 4,
        "max_steps": 30,
        "out": str(tmp_path / f"lm_{compression}.pt"),
        "threads_dir": str(tmp_path),
        # 4 unshared blocks (4 groups of 1 layer), 2 per stage
        "model_args": {
            **ALBERT_SMALL,
            "hidden_size": 64,
            "num_groups": 4,
            "layers_per_group": 1,
            "seq_len": 64,
            "lr": 5e-3,  # 30 steps at 5e-3: 8.21 -> 6.19 (mean of the first 5 -> last 10); 40: 5.70
        },
        "data_args": {"seq_len": 64, "batch_size": 16, "vocab_size": 1000},
        "strategy": {
            "pipeline": "layers",
            "num_stages": 2,
            "compression": compression,
            "matchmaking_time": 2.0,
            "averaging_timeout": 10.0,
            "request_timeout": 60.0,
            "linger_timeout": 60.0,
            "run_id": f"lm_{compression}",
        },
    }
    return run_job(cfg, timeout=580)


@pytest.mark.timeout(1200)
def test_four_peers_train_a_transformer_lm_and_8bit_matches_uncompressed(tmp_path):
    """2 stages x 2 peers, all 4 feeding data, 30 steps each: the loss falls clearly, and with 8-bit boundaries
    it ends within 5% of the uncompressed run."""
    finals = {}
    for compression in ("none", "8bit"):
        result = lm_job(tmp_path, compression)
        losses = result["losses"]
        assert len(losses) == 30
        first, last = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
        print(f"{compression}: loss (mean of first 5 -> last 10 steps) {first:.3f} -> {last:.3f}")  # for -s
        assert first > 5.0  # ~ln(4096) at the start
        # masked-LM loss (measured: 8.21 -> 6.19 / 6.20 in 30 steps at lr 5e-3, without / with 8-bit boundaries)
        assert last < 0.8 * first, f"{compression}: loss went from {first:.3f} to {last:.3f}"
        finals[compression] = last
        # 4 trainers compute at once: the cores are divided among the peers, every peer alike
        assert peer_threads(tmp_path, 4) == [expected_threads(4)] * 4
        # the gathered model is whole again: every block of the pipeline came back from the swarm
        assert sum(k.startswith("layers.") for k in result["state"]) == 4 * 12
        # ... and trained: every block's weights moved from their initialisation (a loss that falls through the
        # trainer-side embeddings and output bias alone would leave the stages where they started)
        for block in range(4):
            keys = [k for k in result["initial"] if k.startswith(f"layers.{block}.") and k.endswith("weight")]
            before = torch.cat([result["initial"][k].flatten() for k in keys])
            after = torch.cat([result["state"][k].flatten() for k in keys])
            assert float((after - before).norm()) > 0.01 * float(before.norm()), (
                f"block {block} did not train"
            )
        # a healthy run is quiet: no tracebacks, no ERROR lines (from any of the 4 peers or their helpers)
        assert "Traceback" not in result["stderr"] and "ERROR" not in result["stderr"], result["stderr"][
            -5000:
        ]
    assert abs(finals["8bit"] - finals["none"]) <= 0.05 * finals["none"], finals


@pytest.mark.timeout(400)
def test_lightning_cli_yaml_trains_and_validates_through_the_swarm(tmp_path):
    """The example's LightningCLI entry point, a YAML that selects the strategy by class path, 2 peers."""
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "max_steps": 6,
            "val_check_interval": 6,
            "limit_val_batches": 2,
            "log_every_n_steps": 1,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "default_root_dir": str(tmp_path),
            "strategy": {
                "class_path": "lightning_swarm.SwarmStrategy",
                "init_args": {
                    "pipeline": "layers",
                    "num_stages": 2,
                    "target_batch_size": 16,  # 2 trainers x batch 8: a global step (refused otherwise)
                    "run_id": "cli_fit",
                },
            },
        },
        "model": {**ALBERT_SMALL, "num_groups": 2},
        "data": {"seq_len": 32, "batch_size": 8, "train_samples": 400, "val_samples": 32, "vocab_size": 1000},
    }
    path = tmp_path / "swarm.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ}
    env.pop("LOCAL_RANK", None)
    proc = _zygote.run(
        [sys.executable, "examples/albert/train.py", "fit", "--config", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    header = metrics.splitlines()[0].split(",")
    assert "val_loss" in header and "train_loss" in header and "swarm/bytes_sent" in header


@pytest.mark.timeout(400)
def test_fit_then_test_and_predict_through_the_swarm_on_the_same_trainer(tmp_path):
    """fit, test and predict on one Trainer: each call starts a fresh swarm, and the forward-only loops give the
    same results as the gathered whole model run locally."""
    cfg = {
        "model": "albert",
        "devices": 2,
        "max_steps": 5,
        "evaluate": True,
        "out": str(tmp_path / "eval.pt"),
        "model_args": {**ALBERT_SMALL, "num_groups": 2, "seq_len": 32, "vocab_size": 1000},
        "data_args": {
            "seq_len": 32,
            "batch_size": 8,
            "train_samples": 200,
            "val_samples": 16,
            "vocab_size": 1000,
        },
        "strategy": {
            "pipeline": "layers",
            "num_stages": 2,
            "num_trainers": 1,
            "compression": "none",
            "run_id": "evaluate",
        },
    }
    result = run_job(cfg, timeout=380)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import swarm_job

    model, data = swarm_job.build(cfg)
    model.load_state_dict(result["state"])
    data.setup("test")
    batches = list(data.test_dataloader())
    with torch.no_grad():
        expected_loss = sum(float(model.mlm_loss(b)) * len(b[0]) for b in batches) / sum(
            len(b[0]) for b in batches
        )
        expected_pred = torch.cat([model.mlm_logits(model(b[0])).argmax(-1) for b in batches])
    assert result["test"][0]["test_loss"] == pytest.approx(expected_loss, rel=1e-4)
    assert torch.equal(torch.cat(result["predictions"]), expected_pred)


def test_a_trainer_whose_stages_never_come_up_says_which_and_what_to_start(tmp_path):
    """A trainer of a swarm started beside it waits for the stages' peers before its first batch (not inside it:
    the first step's time does not include the swarm's start-up); if a stage has none within no_peers_timeout,
    fit fails at once with the stages that are missing and what to start."""
    cfg = {
        "model": "seq",
        "max_steps": 1,
        "out": str(tmp_path / "never.pt"),
        "strategy": {"role": "trainer", "num_stages": 2, "run_id": "lonely", "no_peers_timeout": 2.0},
    }
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)
    proc = _zygote.run(
        [sys.executable, JOB, json.dumps(cfg)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert (
        "no peer of stage(s) [0, 1] of run 'lonely' appeared within no_peers_timeout (2.0 s)" in proc.stderr
    )
    assert "start a server for each" in proc.stderr
    assert not os.path.exists(cfg["out"])
