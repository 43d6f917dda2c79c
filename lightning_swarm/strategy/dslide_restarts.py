"""A D-SLIDE job that survives a rank's death: automatic sharded checkpoints and restarts from the last one.

Every rank of a D-SLIDE job holds rows of the wide layers that no other rank has, so when one rank dies the others
cannot go on without it: the job must come back from a checkpoint. :class:`AutoCheckpoint` (a callback the
strategy adds) writes a sharded checkpoint every ``checkpoint_every_n_steps`` optimizer steps, each rank its own
part (``lightning_swarm.layers.checkpoint.save_sharded``), and keeps the last two. :class:`RestartingLauncher`
is Lightning's ``devices=N`` launcher with one difference: when a rank dies during ``fit`` (the others fail at
once in their next collective, whose connection closed), rank 0, which started the others, kills what is left of
them and restarts the job, at most ``max_restarts`` times: it runs the script again in its own process (``exec``,
the command Lightning starts the other ranks with), which starts fresh ranks, and every rank resumes ``fit`` from
the last complete checkpoint. Each restart is logged as a warning and appended to ``restarts.jsonl`` in the
checkpoint folder: which rank died and how, the step it happened at, the step resumed from, the steps redone.

Under ``torchrun --max-restarts`` (or another launcher that restarts every rank) the strategy restarts nothing
itself: every rank resumes from the last complete checkpoint when ``TORCHELASTIC_RESTART_COUNT`` says it is a
restart.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch import Callback
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

from lightning_swarm.layers.checkpoint import sharded_meta
from lightning_swarm.layers.mesh import MeshError

log = logging.getLogger(__name__)

RESTART_ENV = "LIGHTNING_SWARM_DSLIDE_RESTART"
"""How many times rank 0 has restarted this job (set by :class:`RestartingLauncher` before it runs the script
again)."""
RESUME_ENV = "LIGHTNING_SWARM_DSLIDE_RESUME"
"""The checkpoint a restarted job resumes ``fit`` from (a sharded checkpoint's folder)."""
FAILED_AT_ENV = "LIGHTNING_SWARM_DSLIDE_FAILED_AT"
"""The wall-clock time (``time.time()``) of the failure a restarted job comes back from."""
KEEP = 2  # complete checkpoints kept: the newest can be the one being written when a rank dies


def checkpoint_folders(directory: Path, world_size: int) -> list[tuple[int, Path]]:
    """``(step, folder)`` of the complete sharded checkpoints in ``directory`` written by ``world_size`` ranks,
    oldest first."""
    found = []
    for folder in directory.glob("step=*"):
        meta = sharded_meta(folder)
        if meta is not None and meta.get("world_size") == world_size:
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
        self._save(trainer, self.directory / f"step={step:09d}")
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
    """Lightning's launcher of ``devices=N`` ranks (``strategy="ddp"``'s), which brings the job back when a rank
    dies during ``fit`` (see the module docstring).

    Args:
        cluster_environment: where the ranks run; the other arguments as Lightning's launcher.
        num_processes: ranks on this machine.
        num_nodes: machines.
        max_restarts: how many times a job may be restarted.
        checkpoint_dir: returns where the strategy's sharded checkpoints are (resumed from the newest complete
            one of as many ranks).
        on_failure: called with the exception before rank 0 restarts the job (the strategy closes its
            connections and process group).
    """

    def __init__(
        self,
        cluster_environment: Any,
        num_processes: int,
        num_nodes: int,
        max_restarts: int,
        checkpoint_dir: Callable[[], Path],
        on_failure: Callable[[BaseException], None],
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.max_restarts = max_restarts
        self._checkpoint_dir = checkpoint_dir
        self._on_failure = on_failure
        self._supervising: bool | None = None  # whether this process started the other ranks

    @property
    def restarts(self) -> int:
        """How many times this job has been restarted so far (by rank 0, or by torchrun)."""
        return int(os.environ.get(RESTART_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if self._supervising is None:  # before this launcher first set LOCAL_RANK for the ranks it starts
            self._supervising = not self.cluster_environment.creates_processes_externally
        supervising = self._supervising
        if supervising and not self.procs:
            # Not Lightning's process observer: it kills this process as soon as a rank dies.
            self._call_children_scripts()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        fitting = getattr(function, "__name__", "") == "_fit_impl"
        if fitting:
            args, kwargs = self._resume_arguments(trainer, args, kwargs)
        try:
            return function(*args, **kwargs)
        except BaseException as error:
            if fitting and supervising and self.num_nodes == 1 and trainer is not None:
                lost = self._lost_ranks(error)
                if lost and self.restarts < self.max_restarts:
                    self._restart(trainer, error, lost)  # does not return
                if lost:
                    log.error(
                        "DSlideStrategy: %s; the job was restarted %d times already (max_restarts=%d): it stops.",
                        lost,
                        self.restarts,
                        self.max_restarts,
                    )
            raise

    def _resume_arguments(
        self, trainer: pl.Trainer | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``fit``'s arguments with ``ckpt_path`` set to the checkpoint a restarted job resumes from."""
        resume = os.environ.pop(RESUME_ENV, None)  # the first fit of a restarted script only
        if (
            resume is None
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
            and trainer is not None
        ):
            complete = checkpoint_folders(self._checkpoint_dir(), trainer.world_size)
            resume = str(complete[-1][1]) if complete else None
        if resume is None:
            return args, kwargs
        if "ckpt_path" in kwargs or len(args) < 5:
            kwargs = {**kwargs, "ckpt_path": resume}
        else:
            args = (*args[:4], resume, *args[5:])
        log.info("DSlideStrategy: restart %d resumes fit from %s", self.restarts, resume)
        return args, kwargs

    def _lost_ranks(self, error: BaseException, grace_s: float = 5.0) -> str | None:
        """Which ranks died, in words (``None``: none did, the error is this rank's own). A rank that loses a peer
        fails at once, so the peer's process may still be exiting: wait up to ``grace_s`` for it."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [
                (rank, p.poll()) for rank, p in enumerate(self.procs, start=1) if p.poll() not in (None, 0)
            ]
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        words = [f"rank {rank} died ({_exit_words(code)})" for rank, code in dead]
        if not words and isinstance(error, MeshError) and error.lost_rank is not None:
            words = [f"rank {error.lost_rank}'s connection closed"]
        return ", ".join(words) or None

    def _restart(self, trainer: pl.Trainer, error: BaseException, lost: str) -> None:
        failed_at, step = time.time(), trainer.global_step
        self._on_failure(error)
        for proc in self.procs:  # what is left of the job: its state goes back to the checkpoint anyway
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
        directory = self._checkpoint_dir()
        complete = checkpoint_folders(directory, trainer.world_size)
        resume_step, resume = complete[-1] if complete else (0, None)
        restart = self.restarts + 1
        record = {
            "restart": restart,
            "lost": lost,
            "failed_at_step": step,
            "resumed_from_step": resume_step,
            "steps_redone": step - resume_step,
            "checkpoint": str(resume) if resume else None,
            "time": failed_at,
        }
        log.warning(
            "DSlideStrategy: %s at step %d; restart %d of %d from %s: %d steps are redone.",
            lost,
            step,
            restart,
            self.max_restarts,
            f"the checkpoint of step {resume_step} ({resume})" if resume else "the start (no checkpoint yet)",
            step - resume_step,
        )
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / "restarts.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        os.environ[RESTART_ENV] = str(restart)
        os.environ[FAILED_AT_ENV] = repr(failed_at)
        os.environ.pop(RESUME_ENV, None)
        if resume is not None:
            os.environ[RESUME_ENV] = str(resume)
        os.environ["MASTER_PORT"] = str(find_free_network_port())  # a new rendezvous: nothing of the old one
        os.environ.pop(
            "LOCAL_RANK", None
        )  # set by Lightning's launcher here; without it this process launches
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        command = list(_basic_subprocess_cmd())
        os.execv(command[0], command)


def _exit_words(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
