"""A D-SLIDE job that survives a rank's death (``DSlideStrategy(checkpoint_every_n_steps=..., max_restarts=...)``).

Real processes: ``testbed/dslide_fault_job.py`` with ``devices=4`` (the process started supervises ranks 0-3, each
a run of the same script), real gloo and socket mesh on 127.0.0.1; a rank (2, or 0, the rendezvous store's host)
sends itself SIGKILL in the middle of the first epoch. Side by side, the same job's uninterrupted reference in one
plain process. The job and the ranks its launcher starts and restarts are forked by the worker's zygote
(``tests/_zygote.py``: the same script, without importing torch and Lightning afresh each time); the torchrun test
starts real processes throughout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_swarm.layers.checkpoint import load_sharded
from lightning_swarm.strategy.dslide_restarts import join_torchrun_job
from tests import _zygote

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "testbed" / "dslide_fault_job.py"
EVERY, KILL_AT, STEPS = 5, 13, 30


def _job(
    out: Path, ranks: int, kill_steps: str, kill_rank: int = 2, steps: int = STEPS, max_restarts: int = 2
) -> subprocess.Popen:
    """The fault job, its output in ``out.log``."""
    cmd = [sys.executable, str(JOB), "--out", str(out), "--ranks", str(ranks), "--steps", str(steps)]
    cmd += ["--every", str(EVERY), "--kill-rank", str(kill_rank), "--kill-steps", kill_steps]
    cmd += ["--max-restarts", str(max_restarts)]
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 (closed with the process's output)
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # warnings on: a test looks for Lightning's in the log
    return _zygote.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)


def _ours(out: Path) -> list[str]:
    """The processes still running this job (none may be left): those whose command line names ``out``, or that
    write to its log (a rank forked by the zygote has the zygote's command line)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            files = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        if str(out) in cmdline or str(out.with_suffix(".log")) in files:
            found.append(f"{pid}: {cmdline}")
    return found


def _wait(procs: dict[str, subprocess.Popen], logs: Path) -> None:
    try:
        for name, proc in procs.items():
            assert proc.wait(timeout=540) == 0, f"{name}:\n" + Path(f"{logs / name}.log").read_text()[-5000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()  # its ranks die with it
                proc.wait()


@pytest.mark.timeout(600)
def test_the_death_of_rank_0_which_hosts_the_rendezvous_brings_the_job_back_too(tmp_path: Path) -> None:
    """Rank 0 (the rendezvous store's host and the writer of the results) is SIGKILLed at step 7, and again at step
    18 of the restarted job: the process the user started supervises the ranks and is none of them, so it starts
    them again both times; the job completes ``max_steps``, redoes at most ``K`` steps each time and ends with the
    uninterrupted run's parameters and P@1."""
    killed, reference = tmp_path / "killed", tmp_path / "reference"
    procs = {"killed": _job(killed, 4, "7,18", kill_rank=0), "reference": _job(reference, 1, "")}
    _wait(procs, tmp_path)
    assert _ours(killed) == [], "a rank of the job outlived it"
    log = Path(f"{killed}.log").read_text()
    result, plain = (json.loads((out / "result.json").read_text()) for out in (killed, reference))
    assert result["global_step"] == plain["global_step"] == STEPS and result["world_size"] == 4
    lost = [r for r in result["restarts"] if "lost" in r]
    assert [(r["restart"], r["lost"], r["failed_at_step"], r["resumed_from_step"]) for r in lost] == [
        (1, "rank 0 died (signal SIGKILL)", 7, 5),
        (2, "rank 0 died (signal SIGKILL)", 18, 15),
    ], result["restarts"]
    assert all(0 < r["steps_redone"] <= EVERY for r in lost)
    assert [r["resumed_at_step"] for r in result["restarts"] if "resumed_at_step" in r] == [5, 15]
    assert "rank 0 died (signal SIGKILL) at step 18; restart 2 of 2 from the checkpoint of step 15" in log
    assert result["p_at_1"] == plain["p_at_1"]
    final = torch.load(killed / "final.ckpt", weights_only=True)["state_dict"]
    for name, tensor in torch.load(reference / "final.ckpt", weights_only=True)["state_dict"].items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.timeout(600)
def test_a_sigkilled_rank_brings_the_job_back_from_its_last_sharded_checkpoint(tmp_path: Path) -> None:
    """The job completes ``max_steps``, redoes the 3 steps since its last checkpoint (at most ``K``), logs what it
    lost, and ends with the parameters and P@1 of the uninterrupted run (the resumed epoch skips the batches it had
    trained on, and LSH tables rebuild on the same steps); every rank wrote only its own rows."""
    killed, reference = tmp_path / "killed", tmp_path / "reference"
    procs = {"killed": _job(killed, 4, str(KILL_AT)), "reference": _job(reference, 1, "")}
    _wait(procs, tmp_path)
    assert _ours(killed) == [], "a rank of the job outlived it"
    log = Path(f"{killed}.log").read_text()
    result, plain = (json.loads((out / "result.json").read_text()) for out in (killed, reference))

    assert result["global_step"] == plain["global_step"] == STEPS and result["world_size"] == 4
    lost, back = result["restarts"]
    assert lost == {
        "restart": 1,
        "lost": "rank 2 died (signal SIGKILL)",
        "failed_at_step": KILL_AT,
        "resumed_from_step": 10,
        "steps_redone": 3,
        "checkpoint": str(killed / "checkpoints" / "step=000000010"),
        "time": lost["time"],
    }
    assert back["restart"] == 1 and back["resumed_at_step"] == 10 and 0 < back["down_s"] < 300
    assert "rank 2 died (signal SIGKILL) at step 13; restart 1 of 2 from the checkpoint of step 10" in log
    assert "resuming from a checkpoint that ended before the epoch ended" not in log

    assert result["p_at_1"] == plain["p_at_1"]
    final = torch.load(killed / "final.ckpt", weights_only=True)["state_dict"]
    for name, tensor in torch.load(reference / "final.ckpt", weights_only=True)["state_dict"].items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-4, atol=1e-5, msg=name)

    # the last two sharded checkpoints are kept; each rank's file holds its quarter of the wide layers
    kept = sorted(p.name for p in (killed / "checkpoints").glob("step=*"))
    assert kept == ["step=000000025", "step=000000030"], kept
    for rank in range(4):
        part = load_sharded(killed / "checkpoints" / "step=000000030", rank, 4)["state_dict"]
        assert part["output_layer.weight"].shape == (100, 16)  # 400 labels / 4 ranks
        assert part["input_layer.weight"].shape == (75, 16)  # 300 features / 4 ranks
        torch.testing.assert_close(
            part["output_layer.weight"], final["output_layer.weight"][100 * rank : 100 * (rank + 1)]
        )


def test_a_sharded_checkpoint_resumes_only_on_as_many_ranks(tmp_path: Path) -> None:
    (tmp_path / "meta.json").write_text(json.dumps({"world_size": 4, "global_step": 10}))
    with pytest.raises(
        ValueError, match=r"written by 4 ranks; it resumes only on 4 ranks, not 2.*full checkpoint"
    ):
        load_sharded(tmp_path, 0, 2)
    (tmp_path / "meta.json").unlink()
    with pytest.raises(ValueError, match="not a complete sharded D-SLIDE checkpoint"):
        load_sharded(tmp_path, 0, 4)


@pytest.mark.timeout(600)
def test_a_job_that_keeps_losing_ranks_stops_after_max_restarts(tmp_path: Path) -> None:
    """``max_restarts=1``: rank 2 dies at step 6, the job comes back from step 5, rank 2 dies again at step 7 and
    the job ends with an error that says so; no rank is left behind."""
    out = tmp_path / "job"
    proc = _job(out, 4, "6,7", steps=12, max_restarts=1)
    try:
        proc.wait(timeout=540)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = out.with_suffix(".log").read_text()
    assert proc.returncode != 0, log[-3000:]
    assert "rank 2 died (signal SIGKILL) at step 6; restart 1 of 1 from the checkpoint of step 5" in log
    assert (
        "rank 2 died (signal SIGKILL); the job was restarted 1 times already (max_restarts=1): it stops."
        in log
    )
    records = [json.loads(line) for line in (out / "checkpoints" / "restarts.jsonl").read_text().splitlines()]
    assert [r["restart"] for r in records] == [1, 1] and records[0]["steps_redone"] == 1
    assert not (out / "result.json").exists()
    assert _ours(out) == [], "a rank of the job outlived it"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(600)
def test_under_torchrun_on_two_nodes_a_sigkilled_rank_brings_the_job_back(tmp_path: Path) -> None:
    """Two torchrun agents (two "nodes" of 2 ranks, a c10d rendezvous on 127.0.0.1, ``--max-restarts=2``); rank 2
    SIGKILLs itself at step 13. The agents restart their ranks (each counts the restart differently: the other
    node's ranks were still healthy when it saw the rendezvous change), the ranks agree that the job restarted and
    resume from its checkpoint of step 10: ``max_steps`` completed, 3 steps redone, the uninterrupted run's P@1."""
    out, reference = tmp_path / "killed", tmp_path / "reference"
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PYTHONWARNINGS": "ignore",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "LOGLEVEL": "INFO",
    }
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2"]
    torchrun += ["--max-restarts=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    torchrun += ["--rdzv-id=dslide-test", "--monitor-interval=0.2", str(JOB), "--out", str(out)]
    torchrun += ["--ranks", "4", "--nodes", "2", "--steps", str(STEPS), "--every", str(EVERY)]
    torchrun += ["--kill-rank", "2", "--kill-steps", str(KILL_AT), "--max-restarts", "0"]
    procs = {"reference": _job(reference, 1, "")}
    for node in range(2):
        log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115 (closed with the process's output)
        procs[f"node{node}"] = subprocess.Popen(
            torchrun, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
        )
    _wait(procs, tmp_path)
    assert _ours(out) == [], "a rank of the job outlived it"
    logs = "".join((tmp_path / f"node{node}.log").read_text() for node in range(2))
    assert "restart_count=1" in logs  # torchrun restarted the ranks (not the strategy)
    result, plain = (json.loads((o / "result.json").read_text()) for o in (out, reference))
    assert result["global_step"] == STEPS and result["world_size"] == 4
    (record,) = result["restarts"]
    assert record == {
        "restart": 1,
        "lost": "rank 2 ended without a report (killed, or its node lost)",
        "failed_at_step": KILL_AT,
        "resumed_from_step": 10,
        "steps_redone": 3,
        "checkpoint": str(out / "checkpoints" / "step=000000010"),
        "time": record["time"],
    }
    assert "rank 2 ended without a report (killed, or its node lost) at step 13; restart 1 of 2" in logs
    assert result["p_at_1"] == plain["p_at_1"]
    final = torch.load(out / "final.ckpt", weights_only=True)["state_dict"]
    for name, tensor in torch.load(reference / "final.ckpt", weights_only=True)["state_dict"].items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def test_under_torchrun_a_shared_rendezvous_store_is_refused_with_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun's shared store keeps the keys of the attempt before: a restarted rank would read stale addresses.
    The strategy says what to set instead of failing in gloo."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    with pytest.raises(RuntimeError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        join_torchrun_job(SimpleNamespace(global_rank=0, world_size=2), tmp_path)  # type: ignore[arg-type]
