"""The launcher of a local swarm (``Trainer(strategy="swarm", devices=N)``): N peer processes on this machine.

Lightning's ``_SubprocessScriptLauncher`` re-runs the user's script N - 1 times, then watches the children and
SIGKILLs every process, itself included, as soon as one child exits with an error: right for DDP, where one lost
rank hangs every collective, and wrong for a swarm, whose whole point is to carry on when a peer dies. This
launcher starts the children the same way (same command, same environment variables), but:

- a child that dies is reported once and the others carry on; with ``restart_peers=K`` it is started again (at
  most K times per peer) and the new process joins the running swarm as a replacement;
- a child that *fails* (exits with an error status: its run raised an exception) ends the swarm, as in DDP. The
  failing peer tells every peer through the DHT (see ``swarm/dht/presence.py``), and they raise its error; a child that
  exits with an error before it could (e.g. in the user's script before ``fit``) is raised in this process by
  :meth:`SwarmLauncher.raise_failed_child`, which passes it on to the others. It is not restarted;
- every child dies with the launching process, on every exit path: the kernel SIGKILLs it if the launcher dies
  (``PR_SET_PDEATHSIG``), and a launcher that exits normally first waits a bounded time for its children to
  finish their run, then stops the ones still running.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override

from lightning_swarm.swarm.allocator import allocator_env
from lightning_swarm.swarm.dht.identity import RANK_IDENTITY_ENV, PeerIdentity
from lightning_swarm.swarm.dht.presence import PeerFailure
from lightning_swarm.swarm.lifetime import describe_exit, exec_children, set_parent_death_signal

log = logging.getLogger(__name__)

RESTART_ENV = "LIGHTNING_SWARM_RESTART"  # set in a replacement peer: how many times its slot was restarted
# a child that failed usually published its error in the DHT before it exited: the launching peer raises it from
# there (with its message) within a presence period; after this many seconds it raises the bare exit status
FAILED_CHILD_GRACE_S = 6.0
FAILED_EXIT_TIMEOUT_S = 15.0  # after the swarm failed, seconds this process waits for its children to stop


def computing_at_once(peers: int, trainers: int, settings: Any) -> int:
    """How many of a local swarm's ``peers`` compute at the same time: 1 when they take turns (one trainer, one peer
    per stage, whole stage calls: a chunked batch keeps several stages busy at once), so that each gets all the
    cores' threads; otherwise all of them, and the cores are divided among them (Lightning's rule for DDP ranks)."""
    takes_turns = trainers == 1 and peers <= settings.num_stages and settings.microbatches in ("auto", 1)
    return 1 if takes_turns else peers


class SwarmLauncher(_SubprocessScriptLauncher):
    """Starts the N - 1 other peers of a local swarm as copies of this script; survives their deaths.

    Args:
        cluster_environment: provides the node rank and the main address/port, as for Lightning's launcher.
        num_processes: peers on this machine, this process included.
        num_nodes: must be 1 (a local swarm; peers on other machines join through ``initial_peers``).
        restart_peers: how many times a peer process that died is started again (per peer); 0: never.
        exit_timeout: when this process exits normally, seconds it waits for its children to finish before it
            stops them (SIGTERM, then SIGKILL 10 s later); once the swarm failed, ``FAILED_EXIT_TIMEOUT_S`` at most.
        poll_interval: seconds between two checks of the children's health.
        precheck: called with the model (``fit``'s first argument) before the children start: the user's errors
            found there come before any other peer runs.
        computing_at_once: how many of the peers compute at the same time, which sets each peer's torch threads
            (the machine's cores divided by it; ``OMP_NUM_THREADS``, when set, wins): see :func:`computing_at_once`.
    """

    def __init__(
        self,
        cluster_environment: ClusterEnvironment,
        num_processes: int,
        num_nodes: int,
        restart_peers: int = 0,
        exit_timeout: float = 330.0,
        poll_interval: float = 1.0,
        precheck: Callable[[Any], None] | None = None,
        computing_at_once: int | None = None,
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.computing_at_once = computing_at_once or num_processes
        self.restart_peers = restart_peers
        self.exit_timeout = exit_timeout
        self.poll_interval = poll_interval
        self.precheck = precheck
        self.restarts: dict[int, int] = {}  # local rank -> times restarted
        self._identity_dir: str | None = None  # the local ranks' identities (see _rank_identities)
        self.deaths: list[tuple[int, int]] = []  # (local rank, exit code) of every child that died
        self._by_rank: dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._observer: threading.Thread | None = None
        self._closing = threading.Event()
        # set by the strategy: this process's run raised an error the whole swarm fails with
        self.swarm_failed = False
        self._failed_child: tuple[int, int, int, float] | None = None  # local rank, pid, exit code, when seen
        self._failed_child_raised = False

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        # before the children start, so that they inherit it (``OMP_NUM_THREADS``: a value already set wins)
        _set_num_threads_if_needed(num_processes=self.computing_at_once)
        if not self.cluster_environment.creates_processes_externally:
            if self.precheck is not None and args:
                self.precheck(args[0])
            self._call_children_scripts()
            self._observer = threading.Thread(target=self._observe, daemon=True, name="swarm-launcher")
            self._observer.start()
            atexit.register(self.close)
        return function(*args, **kwargs)

    @override
    def _call_children_scripts(self) -> None:
        self._check_can_spawn_children()
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        self._rank_identities()
        os.environ[RANK_IDENTITY_ENV] = self._identity_file(0)  # this process's peer (rank 0) reads it too
        self.procs = []
        for local_rank in range(1, self.num_processes):
            self._start(local_rank)

    def _rank_identities(self) -> None:
        """One peer identity per local rank, given in the order of their peer ids: rank 0 gets the smallest. The
        trainers' step leader is the trainer with the smallest peer id (see ``swarm/training/trainer_sync.py``),
        so in a local swarm it is rank 0, whose batches the buffers follow, as in DDP (``broadcast_buffers``)."""
        self._identity_dir = tempfile.mkdtemp(prefix="swarm-ranks-")  # readable by this user only
        identities = sorted(
            (PeerIdentity() for _ in range(self.num_processes)), key=lambda i: i.peer_id.to_base58()
        )
        for local_rank, identity in enumerate(identities):
            identity.save(self._identity_file(local_rank))

    def _identity_file(self, local_rank: int) -> str:
        assert self._identity_dir is not None
        return os.path.join(self._identity_dir, f"rank{local_rank}.key")

    def _start(self, local_rank: int) -> subprocess.Popen:
        env = os.environ.copy()
        env.update(allocator_env(env))  # glibc reads them at the start (see swarm.allocator)
        env["LOCAL_RANK"] = str(local_rank)
        if os.environ.get("PL_GLOBAL_SEED") is None:
            env.pop("PL_GLOBAL_SEED", None)
        restarts = self.restarts.get(local_rank, 0)
        if restarts:
            env[RESTART_ENV] = str(restarts)
            env.pop(RANK_IDENTITY_ENV, None)  # a replacement is a new peer: a new identity (it joins late)
        else:
            env[RANK_IDENTITY_ENV] = self._identity_file(local_rank)
        parent = os.getpid()
        # the kernel SIGKILLs the child when this process dies, however it dies (Lightning starts the children
        # from the main thread, which lives as long as the process)
        with exec_children():  # a peer stays in this process group: Ctrl-C and group signals reach it
            proc = subprocess.Popen(
                _basic_subprocess_cmd(),
                env=env,
                preexec_fn=lambda: set_parent_death_signal(parent_pid=parent),
            )
        with self._lock:
            old = self._by_rank.get(local_rank)
            if old is not None and old in self.procs:
                self.procs.remove(old)
            self._by_rank[local_rank] = proc
            self.procs.append(proc)
        return proc

    def _observe(self) -> None:
        reported: set[int] = set()
        while not self._closing.wait(self.poll_interval):
            with self._lock:
                items = list(self._by_rank.items())
            for local_rank, proc in items:
                code = proc.poll()
                if code is None or code == 0 or proc.pid in reported:
                    continue
                reported.add(proc.pid)
                self.deaths.append((local_rank, code))
                how = describe_exit(code)
                if self._closing.is_set():
                    return
                done = self.restarts.get(local_rank, 0)
                if code > 0:  # an error, not a kill: the swarm stops with it
                    if self._failed_child is None:
                        self._failed_child = (local_rank, proc.pid, code, time.monotonic())
                    log.warning(
                        f"Swarm peer {local_rank} (pid {proc.pid}) failed ({how}): the swarm stops with its error, as "
                        "a DDP run does (restart_peers restarts only peers that were killed)."
                    )
                elif done < self.restart_peers:
                    self.restarts[local_rank] = done + 1
                    new = self._start(local_rank)
                    log.warning(
                        f"Swarm peer {local_rank} (pid {proc.pid}) died ({how}); started a replacement (pid "
                        f"{new.pid}, restart {done + 1} of {self.restart_peers}). The other peers carry on."
                    )
                else:
                    log.warning(
                        f"Swarm peer {local_rank} (pid {proc.pid}) died ({how}); the other peers carry on without "
                        f"it (restart_peers={self.restart_peers})."
                    )

    @override
    def kill(self, signum: Any) -> None:
        self._closing.set()
        super().kill(signum)

    def raise_failed_child(self) -> None:
        """Raise, once, a :class:`~lightning_swarm.swarm.dht.presence.PeerFailure` for a child that exited with an error
        ``FAILED_CHILD_GRACE_S`` seconds ago or more (by then, an error it published has reached this peer)."""
        failed = self._failed_child
        if failed is None or self._failed_child_raised or time.monotonic() - failed[3] < FAILED_CHILD_GRACE_S:
            return
        self._failed_child_raised = True
        local_rank, pid, code, _ = failed
        raise PeerFailure(
            "an exception",
            f"its process exited with exit code {code} before it could tell the swarm why (its traceback is in its "
            "output)",
            f"Swarm peer {local_rank} (pid {pid})",
        )

    def close(self) -> None:
        """Wait up to ``exit_timeout`` (``FAILED_EXIT_TIMEOUT_S`` once the swarm failed) for the children to end
        their run, then stop the ones still running."""
        self._closing.set()
        timeout = min(self.exit_timeout, FAILED_EXIT_TIMEOUT_S) if self.swarm_failed else self.exit_timeout
        deadline = time.monotonic() + timeout
        for proc in list(self.procs):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning(
                    f"Swarm peer (pid {proc.pid}) still running {timeout:.0f} s after the launcher finished; "
                    "stopping it."
                )
                proc.send_signal(signal.SIGTERM)
        for proc in list(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._identity_dir is not None:  # the peers read their identity when they started
            shutil.rmtree(self._identity_dir, ignore_errors=True)
            self._identity_dir = None
            os.environ.pop(RANK_IDENTITY_ENV, None)

    def alive(self) -> int:
        """Number of child peers running now (the launching peer not included)."""
        with self._lock:
            return sum(1 for p in self._by_rank.values() if p.poll() is None)
