"""A D-SLIDE job that survives a rank's death: automatic sharded checkpoints and restarts from the last one.

Every rank of a D-SLIDE job holds rows of the wide layers that no other rank has, so when one rank dies the others
cannot go on without it: the job must come back from a checkpoint. :class:`AutoCheckpoint` (a callback the
strategy adds) writes a sharded checkpoint every ``checkpoint_every_n_steps`` optimizer steps, each rank its own
part (``lightning_swarm.layers.checkpoint.save_sharded``), and keeps the last two. Each checkpoint folder names the
job that wrote it (a random token, :data:`JOB_ENV`), so that a job resumes only from its own checkpoints.

:class:`RestartingLauncher` starts the ranks of a ``devices=N`` job with ``max_restarts`` > 0 the way torchrun's
agent does: the process you started runs no rank itself, it runs all N of them, rank 0 included, as copies of
your script (the command Lightning starts its other ranks with), watches them and ends with them. When a rank
dies (a signal: SIGKILL, the OOM killer, a preemption), the others fail at once in their next collective, whose
connection closed; the supervisor kills what is left, and starts N fresh ranks on a new rendezvous, at most
``max_restarts`` times; every rank resumes ``fit`` from the job's last complete checkpoint. Rank 0 is a rank like
the others: its death, which takes the rendezvous store with it, is survived too. Each restart is logged as a
warning and appended to ``restarts.jsonl`` in the checkpoint folder: which rank died and how, the step it happened
at (the survivors report the step they failed at), the step resumed from, the steps redone. A rank that fails
with an exception of its own (its exit code is not a signal's) ends the job, as in DDP: a restart would fail again.

Under ``torchrun --max-restarts`` (or another launcher that restarts every rank) the strategy restarts nothing
itself: the ranks agree on the job's token through the rendezvous store, which torchrun's agents keep across
restarts (``TORCHELASTIC_USE_AGENT_STORE``), so every rank of a restarted job resumes from the job's last complete
checkpoint, whichever node restarted first; rank 0 records what was lost.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch import Callback
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

from lightning_swarm.children import dies_with_this_process
from lightning_swarm.layers.checkpoint import sharded_meta
from lightning_swarm.layers.mesh import MeshError

log = logging.getLogger(__name__)

RESTART_ENV = "LIGHTNING_SWARM_DSLIDE_RESTART"
"""How many times this job has been restarted (0 in the first run): set in every rank by the supervisor, or under
torchrun agreed by the ranks (the most any of torchrun's agents counted)."""
JOB_ENV = "LIGHTNING_SWARM_DSLIDE_JOB"
"""The job's token: its checkpoints carry it, and a restarted rank resumes from the newest that does."""
FAILED_AT_ENV = "LIGHTNING_SWARM_DSLIDE_FAILED_AT"
"""The wall-clock time (``time.time()``) of the failure a restarted job comes back from."""
KEEP = 2  # complete checkpoints kept: the newest can be the one being written when a rank dies
JOB_FILE = "job"  # in a checkpoint folder: the token of the job that wrote it
FAILURES = "failures"  # in the checkpoint folder: rank<r>.json, the step a rank failed at and why
GRACE_S = (
    5.0  # after a rank's death, the most seconds the others get to fail and report before they are killed
)
_STORE_KEY = "lightning_swarm/dslide_job"  # under torchrun, in the store of an attempt


def checkpoint_folders(directory: Path, world_size: int, job: str | None = None) -> list[tuple[int, Path]]:
    """``(step, folder)`` of the complete sharded checkpoints in ``directory`` written by ``world_size`` ranks (of
    the job ``job``, when given), oldest first."""
    found = []
    for folder in directory.glob("step=*"):
        meta = sharded_meta(folder)
        if meta is None or meta.get("world_size") != world_size:
            continue
        if job is not None and _read(folder / JOB_FILE) != job:
            continue
        found.append((int(meta.get("global_step") or 0), folder))
    return sorted(found)


class AutoCheckpoint(Callback):
    """Writes a sharded checkpoint (``<directory>/step=<global step>``) every ``every`` optimizer steps, and keeps
    the last :data:`KEEP`.

    Args:
        every: optimizer steps between checkpoints.
        directory: the folder of the checkpoints (on a file system every rank reads).
        save: writes the trainer's checkpoint to a folder, sharded (the strategy's).
    """

    def __init__(self, every: int, directory: Path, save: Callable[[pl.Trainer, Path], None]) -> None:
        self.every, self.directory, self._save = every, directory, save
        self._last = -1

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == 0 or step % self.every or step == self._last:
            return
        self._last = step
        folder = self.directory / f"step={step:09d}"
        job = os.environ.get(JOB_ENV)
        if trainer.global_rank == 0 and job:  # before the ranks write: the folder is complete with meta.json
            folder.mkdir(parents=True, exist_ok=True)
            (folder / JOB_FILE).write_text(job)
        self._save(trainer, folder)
        if trainer.global_rank == 0:
            self._prune(trainer.world_size)

    def _prune(self, world_size: int) -> None:
        complete = checkpoint_folders(self.directory, world_size)
        keep = {folder for _, folder in complete[-KEEP:]}
        newest = complete[-1][0] if complete else -1
        for folder in self.directory.glob("step=*"):
            meta = sharded_meta(folder)
            step = int(folder.name.split("=", 1)[1]) if folder.name.split("=", 1)[1].isdigit() else -1
            if folder not in keep and (meta is not None or step < newest):  # never one being written
                shutil.rmtree(folder, ignore_errors=True)


class RestartingLauncher(_SubprocessScriptLauncher):
    """Starts the ranks of a ``devices=N`` job and brings the job back when one dies (see the module docstring);
    in a rank (started by it, by torchrun or by Lightning), resumes ``fit`` from the job's last checkpoint.

    Args:
        cluster_environment: where the ranks run; the other arguments as Lightning's launcher.
        num_processes: ranks on this machine.
        num_nodes: machines.
        max_restarts: how many times a job may be restarted.
        checkpoint_dir: returns where the strategy's sharded checkpoints are for a trainer.
        child_exit_timeout: seconds the ranks get to stop after this process received SIGTERM or SIGINT (passed
            on to them as SIGTERM) before they are killed.
    """

    def __init__(
        self,
        cluster_environment: Any,
        num_processes: int,
        num_nodes: int,
        max_restarts: int,
        checkpoint_dir: Callable[[pl.Trainer | None], Path],
        child_exit_timeout: float = 120.0,
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.max_restarts = max_restarts
        self._checkpoint_dir = checkpoint_dir
        self._child_exit_timeout = child_exit_timeout
        self._starting: bool | None = None  # whether this process starts the ranks (no launcher started it)
        self._resumed = False  # the first fit of this process resumed (or started fresh) already
        self._stop_signal: int | None = None

    @property
    def restarts(self) -> int:
        """How many times this job has been restarted so far (by the supervisor, or by torchrun)."""
        return int(os.environ.get(RESTART_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if self._starting is None:  # before this launcher first set LOCAL_RANK for the ranks it starts
            self._starting = not self.cluster_environment.creates_processes_externally
        if self._starting and self.max_restarts > 0 and self.num_nodes == 1:
            self._supervise(trainer)
        if self._starting and not self.procs:
            # Not Lightning's process observer: it kills this process as soon as a rank dies.
            self._call_children_scripts()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        fitting = getattr(function, "__name__", "") == "_fit_impl"
        if fitting and trainer is not None and not self._resumed:
            self._resumed = True
            args, kwargs = self._resume_arguments(trainer, args, kwargs)
        try:
            return function(*args, **kwargs)
        except BaseException as error:
            if fitting and trainer is not None and os.environ.get(JOB_ENV):
                self._report_failure(trainer, error)
            raise

    # ----------------------------------------------------------------------------------------- in a rank
    def _resume_arguments(
        self, trainer: pl.Trainer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``fit``'s arguments with ``ckpt_path`` set to the job's newest complete checkpoint, if it has one."""
        directory = self._checkpoint_dir(trainer)
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:
            join_torchrun_job(trainer, directory)
        job = os.environ.get(JOB_ENV)
        if job is None:
            return args, kwargs
        complete = checkpoint_folders(directory, trainer.world_size, job)
        if "TORCHELASTIC_RESTART_COUNT" in os.environ and trainer.global_rank == 0:
            _record_torchrun_restart(directory, trainer.world_size, job, complete[-1] if complete else None)
        if not complete:
            return args, kwargs
        resume = str(complete[-1][1])
        if "ckpt_path" in kwargs or len(args) < 5:
            kwargs = {**kwargs, "ckpt_path": resume}
        else:
            args = (*args[:4], resume, *args[5:])
        log.info("DSlideStrategy: restart %d resumes fit from %s", self.restarts, resume)
        return args, kwargs

    def _report_failure(self, trainer: pl.Trainer, error: BaseException) -> None:
        """Write the step this rank failed at and why, for the restart's record (a rank that dies writes none)."""
        lost = error.lost_rank if isinstance(error, MeshError) else None
        report = {
            "job": os.environ.get(JOB_ENV),
            "rank": trainer.global_rank,
            "step": trainer.global_step,
            "error": f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}",
            "lost_rank": lost,
            "time": time.time(),
        }
        try:
            folder = self._checkpoint_dir(trainer) / FAILURES
            folder.mkdir(parents=True, exist_ok=True)
            partial = folder / f".rank{trainer.global_rank}.json.partial"
            partial.write_text(json.dumps(report))
            partial.replace(
                folder / f"rank{trainer.global_rank}.json"
            )  # whole: the supervisor may kill on sight
        except OSError as e:  # the record only: the error itself is what matters
            log.warning("DSlideStrategy: rank %d could not report its failure: %r", trainer.global_rank, e)

    # ----------------------------------------------------------------------------------------- the supervisor
    def _supervise(self, trainer: pl.Trainer | None) -> NoReturn:
        """Run the job's ranks until they all end, restarting them when one dies; then end this process with
        their status (the script goes on in rank 0, not here)."""
        directory = self._checkpoint_dir(trainer)
        job = os.environ.setdefault(JOB_ENV, secrets.token_hex(8))
        world_size = self.num_processes
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_stop_signal)
        restart, failed_at, port = self.restarts, None, self.cluster_environment.main_port
        _take_reports(directory, job)  # none of this job's yet: what is there is an earlier job's
        while True:
            started = time.time()
            self._start_ranks(restart, failed_at, port)
            codes, killed = self._watch(directory / FAILURES)
            if all(code == 0 for code in codes):
                _end(0)
            failed_at = time.time()
            lost = [
                f"rank {rank} died ({_exit_words(code)})"
                for rank, code in enumerate(codes)
                if code is not None and code < 0 and rank not in killed
            ]
            failed_step = _failed_step(directory, job, started)
            if self._stop_signal is not None:
                _end(128 + self._stop_signal)
            if not lost:
                first = next(code for code in codes if code not in (0, None))
                log.error(
                    "DSlideStrategy: a rank failed (%s) with an error of its own; the job stops (only a rank's "
                    "death, a signal, restarts it).",
                    _exit_words(first),
                )
                _end(first if first > 0 else 1)
            if restart >= self.max_restarts:
                log.error(
                    "DSlideStrategy: %s; the job was restarted %d times already (max_restarts=%d): it stops.",
                    ", ".join(lost),
                    restart,
                    self.max_restarts,
                )
                _end(1)
            restart += 1
            complete = checkpoint_folders(directory, world_size, job)
            _record_restart(
                directory, restart, self.max_restarts, ", ".join(lost), failed_step, complete, failed_at
            )
            port = find_free_network_port()  # a new rendezvous: nothing of the old one

    def _start_ranks(self, restart: int, failed_at: float | None, port: int) -> None:
        env = {
            **os.environ,
            "MASTER_ADDR": self.cluster_environment.main_address,
            "MASTER_PORT": str(port),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(self.num_processes),
            RESTART_ENV: str(restart),
        }
        env.pop(FAILED_AT_ENV, None)
        if failed_at is not None:
            env[FAILED_AT_ENV] = repr(failed_at)
        if os.environ.get("PL_GLOBAL_SEED") is None:
            env.pop("PL_GLOBAL_SEED", None)
        command = list(_basic_subprocess_cmd())
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self.procs = [
            subprocess.Popen(
                command, env={**env, "LOCAL_RANK": str(rank)}, preexec_fn=dies_with_this_process()
            )
            for rank in range(self.num_processes)
        ]

    def _watch(self, reports: Path) -> tuple[list[int | None], set[int]]:
        """Wait until every rank has ended: once one fails, the others are killed as soon as each has ended or
        reported its step in ``reports`` (they fail at once in their next collective), after :data:`GRACE_S` at
        most; after SIGTERM or SIGINT here, ``child_exit_timeout``. Returns the ranks' exit codes and the ranks
        killed here."""
        killed: set[int] = set()
        failed: float | None = None
        stopping: float | None = None
        while True:
            codes = [proc.poll() for proc in self.procs]
            if all(code is not None for code in codes):
                return codes, killed
            now = time.monotonic()
            if failed is None and any(code not in (None, 0) for code in codes):
                failed = now
            if stopping is None and self._stop_signal is not None:
                stopping = now
                for proc in self.procs:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
            settled = failed is not None and all(
                code is not None or (reports / f"rank{rank}.json").exists() for rank, code in enumerate(codes)
            )
            if (
                settled
                or (failed is not None and now - failed > GRACE_S)
                or (stopping is not None and now - stopping > self._child_exit_timeout)
            ):
                for rank, proc in enumerate(self.procs):
                    if proc.poll() is None:
                        proc.kill()
                        killed.add(rank)
                for proc in self.procs:
                    proc.wait()
            time.sleep(0.05)

    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        """SIGTERM or SIGINT here: the ranks get SIGTERM (they stop at the same step) and the job is not
        restarted."""
        self._stop_signal = signum


def _record_restart(
    directory: Path,
    restart: int,
    max_restarts: int,
    lost: str,
    failed_step: int | None,
    complete: list[tuple[int, Path]],
    failed_at: float,
) -> None:
    """Log a restart and append it to ``directory/restarts.jsonl``."""
    resume_step, resume = complete[-1] if complete else (0, None)
    redone = failed_step - resume_step if failed_step is not None else None
    record = {
        "restart": restart,
        "lost": lost,
        "failed_at_step": failed_step,
        "resumed_from_step": resume_step,
        "steps_redone": redone,
        "checkpoint": str(resume) if resume else None,
        "time": failed_at,
    }
    log.warning(
        "DSlideStrategy: %s at %s; restart %d of %d from %s: %s steps are redone.",
        lost,
        f"step {failed_step}" if failed_step is not None else "an unknown step (no rank reported one)",
        restart,
        max_restarts,
        f"the checkpoint of step {resume_step} ({resume})" if resume else "the start (no checkpoint yet)",
        redone if redone is not None else "unknown",
    )
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "restarts.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def _failed_step(directory: Path, job: str, since: float) -> int | None:
    """The step the ranks that failed (rather than died) reported, after ``since``; their reports are removed."""
    steps = [report["step"] for report in _take_reports(directory, job) if report.get("time", 0) >= since]
    return max(steps) if steps else None


def _take_reports(directory: Path, job: str) -> list[dict[str, Any]]:
    """The failure reports of job ``job`` in ``directory``; every report there is removed."""
    reports = []
    for path in sorted((directory / FAILURES).glob("rank*.json")):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            report = {}
        if report.get("job") == job:
            reports.append(report)
        path.unlink(missing_ok=True)
    return reports


def _record_torchrun_restart(
    directory: Path, world_size: int, job: str, resume: tuple[int, Path] | None
) -> None:
    """Under torchrun, rank 0 of a restarted job records what was lost: the ranks that failed reported their step;
    the ranks that did not report died (or their node did)."""
    reports = _take_reports(directory, job)
    if not reports and resume is None:
        return  # the job's first run
    reported = {report["rank"] for report in reports}
    silent = [rank for rank in range(world_size) if rank not in reported]
    lost = (
        ", ".join(f"rank {rank} ended without a report (killed, or its node lost)" for rank in silent)
        or "every rank failed with an error"
    )
    steps = [report["step"] for report in reports]
    _record_restart(
        directory,
        int(os.environ.get(RESTART_ENV) or 0),
        int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0),
        lost,
        max(steps) if steps else None,
        [resume] if resume else [],
        max((report.get("time", 0.0) for report in reports), default=time.time()),
    )


def join_torchrun_job(trainer: pl.Trainer, directory: Path) -> None:
    """Under torchrun, set :data:`JOB_ENV` to the job's token on every rank.

    torchrun's agents count restarts each for itself (an agent whose ranks still looked healthy when another node
    restarted does not count it), so the ranks agree through this attempt's store: the job is a restarted one if
    any rank's ``TORCHELASTIC_RESTART_COUNT`` says so. A job's first attempt gets a new token, which rank 0 keeps in
    ``directory/torchrun-job``; a restarted one reads it there.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(
        os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0
    ):
        raise RuntimeError(
            "When using the DSlideStrategy under `torchrun --max-restarts`, give torchrun the environment variable "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: in the store torchrun shares across restarts, a restarted rank "
            "reads the addresses of the attempt before (gloo fails to connect)."
        )
    rank, world_size = trainer.global_rank, trainer.world_size
    # this attempt's store, the one the process group will use (rank 0 hosts it; the group reuses the server)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=rank == 0,
        timeout=timedelta(seconds=300),
        wait_for_workers=False,
        multi_tenant=True,
    )
    store.set(f"{_STORE_KEY}/restart/{rank}", os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0")
    restart = max(int(store.get(f"{_STORE_KEY}/restart/{r}")) for r in range(world_size))
    os.environ[RESTART_ENV] = str(restart)
    if rank == 0:
        kept = directory / "torchrun-job"
        job = _read(kept) if restart else None
        if job is None:
            job = secrets.token_hex(8)
            directory.mkdir(parents=True, exist_ok=True)
            kept.write_text(job)
        store.set(f"{_STORE_KEY}/job", job)
    os.environ[JOB_ENV] = store.get(f"{_STORE_KEY}/job").decode()


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _end(code: int) -> NoReturn:
    """End the supervisor: the user's script went on in rank 0, not here."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    logging.shutdown()
    os._exit(code)


def _exit_words(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
