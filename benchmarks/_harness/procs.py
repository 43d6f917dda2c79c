"""Child processes and rank launchers that end with the benchmark, on every exit path.

Every process a benchmark starts goes through :func:`popen` (or :func:`run`, or a :class:`Launcher`), which
starts it so that:

- it dies when the benchmark dies, however the benchmark ends: the kernel sends it SIGKILL when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``, set between ``fork`` and ``exec``, and kept through ``ip netns exec`` and
  ``taskset``, which ``exec`` the command). That covers a crash and a SIGKILL of the benchmark;
- it leads a process group of its own (a session where it can), so that a Ctrl-C in the terminal reaches only
  the benchmark, which then stops its children in order (``finally`` blocks, :meth:`Launcher.stop`) instead of
  every process printing a traceback at once; :meth:`Launcher.stop` signals each child's whole group;
- SIGTERM unwinds the benchmark like an exception once :func:`exit_on_sigterm` is called, so the same
  ``finally`` blocks run (the shaped links' namespaces are deleted likewise, ``testbed/netns.py``);
- a rank that dies under the others (a crash, a SIGKILL) ends the run: :meth:`Launcher.wait` stops the other
  ranks at once and raises with the dead rank's log, rather than leaving them waiting for it until a timeout.

The kernel sends the death signal when the *thread* that started the child ends, so a child started from another
thread than the main thread does not get it (it still gets its own group and :meth:`Launcher.stop`). Processes
that the children start themselves are their business: the library's peers make their helpers die with them
(``lightning_swarm/swarm/lifetime.py``). Linux only, like the benchmarks.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1
_libc: Any = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def set_parent_death_signal(parent_pid: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; if the parent (``parent_pid``) is
    already gone, send it now (the race the man page warns about). Returns whether the request was made."""
    if _libc is None or _libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return True


def _in_child(parent_pid: int, death_signal: bool) -> None:
    # between fork and exec: a session of its own (or, when a fork hook already made the child a group leader,
    # e.g. lightning_swarm's die_with_parent in the benchmark, the group it leads), then the death signal
    try:
        os.setsid()
    except OSError:
        pass
    if death_signal:
        set_parent_death_signal(parent_pid)


def dies_with_me() -> dict[str, Any]:
    """Keyword arguments for ``subprocess.Popen`` (or ``VirtualCluster.popen``, which passes them on): the child
    leads its own session and dies with this process (see the module docstring)."""
    main = threading.current_thread() is threading.main_thread()
    return {"preexec_fn": functools.partial(_in_child, os.getpid(), main)}


def popen(cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kwargs)``, started to end with this process."""
    return subprocess.Popen(list(cmd), **dies_with_me(), **kwargs)


def run(cmd: Sequence[str], timeout: float | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, **kwargs)``, started to end with this process; on any exception (a timeout,
    Ctrl-C) the child's group is killed before the exception goes on."""
    with popen(cmd, **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException:
            kill_group(proc)
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group ``proc`` leads (nothing if it is gone)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s group (its helpers still in it too) and reap ``proc``."""
    signal_group(proc, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def stop_with_stdin(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Stop a child that serves until its stdin closes: close it, wait, kill the group after ``timeout``."""
    if proc.stdin is not None and not proc.stdin.closed:
        try:
            proc.stdin.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like an exception (``SystemExit(128 + 15)``): the ``finally`` blocks stop the children
    started so far and delete the namespaces."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def rank_env(rank: int, world_size: int, master_addr: str, master_port: int | str) -> dict[str, str]:
    """The environment of rank ``rank`` of a job started like ``world_size`` machines of one process each
    (Lightning's ``num_nodes``; torch.distributed's rendezvous at ``master_addr:master_port``)."""
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "NODE_RANK": str(rank),
        "LOCAL_RANK": "0",
        "WORLD_SIZE": str(world_size),
    }


def describe_exit(code: int | None) -> str:
    return f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"


class Launcher:
    """The processes of one run (ranks, peers, workers), each started with :func:`dies_with_me` and logged to
    ``log_dir/<name>.log``; a context manager whose exit stops what is still running.

    Args:
        log_dir: where the logs go (created).
        what: a prefix for error messages (e.g. ``"dslide with 2 ranks: "``).
        grace: seconds between the SIGTERM and the SIGKILL of :meth:`stop`.
    """

    def __init__(self, log_dir: Path, what: str = "", grace: float = 15.0) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.what, self.grace = what, grace
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._logs: list[Any] = []

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(
        self,
        name: str,
        cmd: Sequence[str],
        env: dict[str, str] | None = None,
        net: Any = None,
        rank: int = 0,
        **kwargs: Any,
    ) -> subprocess.Popen:
        """Start ``cmd`` as ``name``: with ``env`` added to this process's environment, in rank ``rank``'s
        namespace of ``net`` (a ``VirtualCluster`` or ``Loopback``; None: here), output to ``<name>.log``."""
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 (closed in stop)
        self._logs.append(log)
        kwargs = {"stdout": log, "stderr": subprocess.STDOUT, **dies_with_me(), **kwargs}
        if net is None:
            proc = subprocess.Popen(list(cmd), env={**os.environ, **(env or {})}, **kwargs)
        else:
            proc = net.popen(rank, list(cmd), env=env or {}, **kwargs)
        self.procs.append((name, proc))
        return proc

    def log_tail(self, name: str, chars: int = 3000) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")[-chars:]

    def wait(self, timeout: float) -> None:
        """Wait until every process has exited. The first one that fails (non-zero exit, or a signal) stops the
        others at once and raises with its log's tail; so does the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            failed = [(n, p.returncode) for n, p in self.procs if p.poll() not in (None, 0)]
            if failed:
                name, code = failed[0]
                self.stop()
                raise RuntimeError(
                    f"{self.what}{name} failed ({describe_exit(code)}):\n{self.log_tail(name)}"
                )
            running = [p for _, p in self.procs if p.returncode is None]
            if not running:
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.what}did not finish in {timeout:.0f} s; logs in {self.log_dir}")
            try:
                running[0].wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass

    def stop(self) -> None:
        """SIGTERM the group of every process still running, SIGKILL every group ``grace`` s later (helpers left
        in it too); close the logs. Idempotent."""
        alive = [p for _, p in self.procs if p.poll() is None]
        for proc in alive:
            signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        for proc in alive:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for _, proc in self.procs:
            kill_group(proc)
        for log in self._logs:
            log.close()
        self._logs.clear()
