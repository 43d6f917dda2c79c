"""Start the tests' job scripts without paying for ``import torch, lightning, hivemind`` each time.

A local swarm test starts Python processes, and each spends about 4 s of CPU importing torch, Lightning and
hivemind before it does anything: on the 2-core box that was about half of the suite's CPU. Each pytest worker
therefore keeps one *zygote*: a process that imported those modules once and then only forks. ``Popen`` below is a
``subprocess.Popen`` whose child is forked by the zygote instead of started afresh; it runs the same script with
the same arguments, working directory, environment and standard streams, in its own session when asked, and its
exit status reaches ``wait``/``poll`` as a real child's would.

What a job then does is unchanged: it is the same script in a process with the same modules. The ranks its
Lightning launcher starts (``SwarmLauncher``'s, and D-SLIDE's ``RestartingLauncher``'s, started and restarted)
are forked by the same zygote too (``_fork_ranks_here``; each watches the job's pid, as a launched rank's
``PR_SET_PDEATHSIG`` would), unless the job runs in its own session (the tests that signal a job's process group)
or ``LIGHTNING_SWARM_TEST_ZYGOTE_RANKS=0``. So are the ranks of Lightning's own launcher (the DDP baselines), which
then end with their job too; the other processes (DHTs, p2p daemons) are started as before. ``test_launcher.py``
starts its jobs with ``subprocess`` and so checks the launcher's own start, signals and process groups; a test
that measures a job process's memory, or that is about how a process starts, uses ``subprocess`` directly.

Anything the zygote cannot reproduce falls back to ``subprocess.Popen``: a command that is not
``[sys.executable, SCRIPT, ...]`` or ``[sys.executable, "-m", MODULE, ...]``, an environment that changes what
happens at import (``OMP_*``, ``PYTHON*``, ``HIVEMIND_*``, ...), options other than the ones handled here, or a
zygote that could not start.
``LIGHTNING_SWARM_TEST_ZYGOTE=0`` turns it off.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

# environment variables read while the preloaded modules are imported (or by the interpreter at start-up): a job
# that sets them differently from the zygote is started afresh
_IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "PYTHON", "HIVEMIND_", "TORCH", "CUDA_",
                         "LD_", "MALLOC", "BNB_", "LIGHTNING_SWARM_TEST")  # fmt: skip
_PRELOAD = ("numpy", "torch", "lightning.pytorch", "lightning.pytorch.cli", "hivemind", "lightning_swarm",
            "lightning_swarm.strategy.swarm")  # fmt: skip
_RANKS_ENV = "LIGHTNING_SWARM_TEST_ZYGOTE_SOCKET"  # set in a forked job: where its launcher forks its ranks
_HEADER = struct.Struct("!Q")
_STATUS = struct.Struct("!qi")


# ---------------------------------------------------------------------------------------------------------------
# the client side: used in the pytest worker


class _Zygote:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.path = ""
        self.env: dict[str, str] = {}
        self.broken = os.environ.get("LIGHTNING_SWARM_TEST_ZYGOTE", "1") == "0"
        self.external = False
        atexit.register(self.stop)

    def address(self) -> str | None:
        """The zygote's socket, started on first use; ``None`` if it cannot be used."""
        with self.lock:
            if self.broken:
                return None
            if self.external:  # in a job the zygote forked: its zygote's socket
                return self.path
            if self.proc is not None and self.proc.poll() is None:
                return self.path
            self.path = os.path.join(tempfile.mkdtemp(prefix="zygote-"), "sock")
            self.env = dict(os.environ)
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), self.path, str(os.getpid())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            )
            ready = self.proc.stdout.readline().strip()  # type: ignore[union-attr]
            if ready != b"ready":
                self.broken = True  # e.g. the preloaded modules started threads: forking would not be safe
                self.proc.kill()
                self.proc.wait()
                return None
            return self.path

    def stop(self) -> None:
        """End the zygote and reap it (so that the CPU time of the jobs it forked counts in this process's)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()

    def usable_for(self, args: Any, env: dict[str, str] | None) -> bool:
        if isinstance(args, (str, bytes)) or len(args) < 2 or str(args[0]) != sys.executable:
            return False
        if str(args[1]) == "-m":
            if len(args) < 3:
                return False
        elif str(args[1]).startswith("-") or not os.path.isfile(str(args[1])):
            return False
        wanted = dict(os.environ if env is None else env)
        if self.address() is None:
            return False
        for key in set(wanted) | set(self.env):
            if key.startswith(_IMPORT_TIME_PREFIXES) and wanted.get(key) != self.env.get(key):
                if key in ("PYTHONUNBUFFERED", "PYTHONPATH", "OMP_NUM_THREADS"):
                    continue  # the child sets up its streams, path and torch threads again
                return False
        return True


_ZYGOTE = _Zygote()


class Popen(subprocess.Popen):
    """``subprocess.Popen`` for ``[sys.executable, script, *args]``; the child is forked by this worker's zygote
    when it can be (see the module's docstring), else started as usual."""

    def __init__(self, args: Any, **kwargs: Any) -> None:
        handled = {"stdin", "stdout", "stderr", "cwd", "env", "text", "universal_newlines", "encoding", "errors",
                   "bufsize", "start_new_session"}  # fmt: skip
        self._zygote_conn: socket.socket | None = None
        self._use_zygote = set(kwargs) <= handled and _ZYGOTE.usable_for(args, kwargs.get("env"))
        super().__init__(args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,  # type: ignore[override]
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, *rest):  # fmt: skip
        path = _ZYGOTE.address() if self._use_zygote else None
        if path is None:
            preexec_fn = preexec_fn or getattr(self, "_rank_preexec", None)
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                                          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                                          errwrite, restore_signals, gid, gids, uid, umask, start_new_session,
                                          *rest)  # fmt: skip
        child_env = {str(k): str(v) for k, v in (os.environ if env is None else env).items()}
        if not start_new_session and os.environ.get("LIGHTNING_SWARM_TEST_ZYGOTE_RANKS", "1") != "0":
            child_env[_RANKS_ENV] = path  # the job's launcher forks its ranks here too (see _fork_ranks_here)
        request = json.dumps({
            "argv": [str(a) for a in args],
            "cwd": os.path.abspath(cwd if cwd is not None else os.getcwd()),
            "env": child_env,
            "new_session": bool(start_new_session),
            "watch_pid": getattr(self, "_watch_pid", None),
        }).encode()  # fmt: skip
        fds = [
            p2cread if p2cread != -1 else 0,
            c2pwrite if c2pwrite != -1 else 1,
            errwrite if errwrite != -1 else 2,
        ]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            socket.send_fds(conn, [_HEADER.pack(len(request))], fds)
            conn.sendall(request)
            pid = _HEADER.unpack(_recv_exactly(conn, _HEADER.size))[0]
        except BaseException:
            conn.close()
            raise
        finally:
            devnull = getattr(self, "_devnull", None)
            for write_end, read_end in ((p2cread, p2cwrite), (c2pwrite, c2pread), (errwrite, errread)):
                if write_end != -1 and read_end != -1 and write_end != devnull:
                    os.close(write_end)
            if devnull is not None:
                os.close(devnull)
        self._zygote_conn = conn
        self.pid = pid
        self._child_created = True

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        if self._zygote_conn is None:
            return super()._try_wait(wait_flags)
        if wait_flags & os.WNOHANG and not _readable(self._zygote_conn):
            return 0, 0
        data = _recv_exactly(self._zygote_conn, _STATUS.size)
        self._zygote_conn.close()
        self._zygote_conn = None
        pid, status = _STATUS.unpack(data)
        return pid, status

    def _internal_poll(self, _deadstate: Any = None, **_: Any) -> int | None:
        if self._zygote_conn is None:
            return (
                super()._internal_poll(_deadstate=_deadstate) if self.returncode is None else self.returncode
            )
        if not self._waitpid_lock.acquire(False):
            return None
        try:
            if self.returncode is not None:
                return self.returncode
            pid, status = self._try_wait(os.WNOHANG)
            if pid == self.pid:
                self._handle_exitstatus(status)
        finally:
            self._waitpid_lock.release()
        return self.returncode


def run(args: Any, *, input: Any = None, capture_output: bool = False, timeout: float | None = None,
        check: bool = False, **kwargs: Any) -> subprocess.CompletedProcess:  # fmt: skip
    """``subprocess.run`` with :class:`Popen`."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with Popen(args, **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(input, timeout=timeout)
        except BaseException:
            proc.kill()
            proc.communicate()
            raise
        code = proc.poll()
    if check and code:
        raise subprocess.CalledProcessError(code, args, stdout, stderr)
    return subprocess.CompletedProcess(args, code, stdout, stderr)  # type: ignore[arg-type]


class _RankPopen(Popen):
    """The ``Popen`` of a job's launcher (``SwarmLauncher``, ``RestartingLauncher``) when the zygote forked the job:
    its ranks are forked by the same zygote. A rank started by the launcher asks the kernel to kill it with the job
    (``preexec_fn``: ``PR_SET_PDEATHSIG``); a forked rank's parent is the zygote, so it watches the job's pid
    instead (:func:`_watch`). Anything the zygote cannot start goes the launcher's way, ``preexec_fn`` included."""

    def __init__(self, args: Any, **kwargs: Any) -> None:
        self._rank_preexec = kwargs.pop("preexec_fn", None)
        self._watch_pid = os.getpid()
        super().__init__(args, **kwargs)


def _fork_ranks_here(path: str) -> None:
    """In a job the zygote forked: the job's ``SwarmLauncher`` or D-SLIDE ``RestartingLauncher`` starts its ranks
    through the zygote at ``path``.

    What differs from a launcher's own start is only how a rank's process begins (forked from a process that
    imported torch, Lightning and hivemind, as the job itself was): each rank runs the same script with the same
    environment and streams, and its exit status reaches the launcher as a child's would. Tests of how ranks are
    started and signalled (``test_launcher.py``) and jobs in their own session keep the launcher's ``Popen``."""
    import types

    from lightning.pytorch.strategies.launchers import subprocess_script

    from lightning_swarm.strategy import dslide_restarts, launcher

    _ZYGOTE.path, _ZYGOTE.env, _ZYGOTE.external = path, dict(os.environ), True
    forking = types.SimpleNamespace(**{**vars(subprocess), "Popen": _RankPopen})
    launcher.subprocess = forking  # type: ignore[attr-defined]
    dslide_restarts.subprocess = forking  # type: ignore[attr-defined]
    # Lightning's own launcher (the DDP baselines' ranks): these ranks ask for no PR_SET_PDEATHSIG, but a forked one
    # watches its job all the same, so that a failed baseline leaves no rank waiting in gloo behind the test
    subprocess_script.subprocess = forking  # type: ignore[attr-defined]


def _watch(pid: int, period: float = 0.2) -> None:
    """End this process (SIGKILL, as ``PR_SET_PDEATHSIG`` would) once process ``pid`` is gone (the zygote reaps the
    jobs it forked within 0.05 s, so a dead job does not linger as a zombie)."""
    import signal

    def wait() -> None:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(period)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, daemon=True, name="zygote-watch-job").start()


def _readable(conn: socket.socket) -> bool:
    """Whether ``conn`` has data (or its end) now: ``poll``, as a worker may hold file descriptors above 1023."""
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    return bool(poller.poll(0))


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        part = conn.recv(size - len(data))
        if not part:
            raise ConnectionError("the zygote closed the connection")
        data += part
    return data


# ---------------------------------------------------------------------------------------------------------------
# the zygote itself: ``python tests/_zygote.py SOCKET PARENT_PID``


def _serve(path: str, parent: int) -> int | None:
    """Accept requests and fork; returns in a forked child (its exit code comes from running the script), never in
    the zygote, which ends when its parent does."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    waiting: dict[int, socket.socket] = {}
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)  # the worker reads only "ready" from this pipe
    while os.getppid() == parent:
        ready = select.select([listener], [], [], 0.05)[0]
        while waiting:  # report ended children
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(_STATUS.pack(pid, status))
                except OSError:
                    pass
                conn.close()
        if not ready:
            continue
        conn, _ = listener.accept()
        conn.settimeout(
            5.0
        )  # a client that died mid-request does not hold the zygote (it watches its parent)
        try:
            msg, fds, _flags, _addr = socket.recv_fds(conn, _HEADER.size, 3)
            request = json.loads(_recv_exactly(conn, _HEADER.unpack(msg)[0]))
        except Exception:
            conn.close()
            continue
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            for other in waiting.values():
                other.close()
            os.close(devnull)
            return _become(request, fds)
        for fd in fds:
            os.close(fd)
        waiting[pid] = conn
        try:
            conn.sendall(_HEADER.pack(pid))
        except OSError:
            pass  # the client is gone: its job runs on, reaped like the others
    return None


def _own_hivemind_locks() -> None:
    """Give this job hivemind's process-shared locks of its own, as a fresh process has. hivemind makes them when it
    is imported (``MPFuture``'s update and initialization locks, ``SharedBytes``', the process-wide executor's), here
    in the zygote, so every job forked from it would share them with every other job: one SIGKILLed while one of its
    processes held a lock (the chaos tests kill peers mid-call) blocked every other job's next ``MPFuture`` update
    for good (seen once: a peer's DHT process stuck in ``MPFuture._send_update``, the next peer's DHT never ready)."""
    import multiprocessing

    mpfuture = sys.modules.get("hivemind.utils.mpfuture")
    if mpfuture is not None:
        mpfuture.MPFuture.reset_backend()  # hivemind's own reset: fresh locks, no backend yet in this process
    aio = sys.modules.get("hivemind.utils.asyncio")
    if aio is not None:
        aio._AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()


def _become(request: dict, fds: list[int]) -> int:
    """In the forked child: take the job's streams, directory, environment and arguments, and run its script."""
    import io
    import runpy
    import traceback

    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # read when torch was imported: the job's value, not the zygote's
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    if request.get("watch_pid"):
        _watch(int(request["watch_pid"]))
    if os.environ.get(_RANKS_ENV):
        _fork_ranks_here(os.environ[_RANKS_ENV])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                  write_through=unbuffered, line_buffering=os.isatty(1))  # fmt: skip
    sys.__stdin__, sys.__stdout__ = sys.stdin, sys.stdout
    import numpy

    numpy.random.seed()  # a fresh process draws its own seed (Python's `random` reseeds itself after a fork)
    _own_hivemind_locks()
    argv = request["argv"]
    module = argv[2] if argv[1] == "-m" else None
    extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if module is None:  # python SCRIPT ARGS: the script's folder first on the path
        sys.argv = argv[1:]
        sys.path[:1] = [os.path.dirname(os.path.abspath(argv[1])), *extra]
    else:  # python -m MODULE ARGS: the working directory first, argv[0] the module's file (set by runpy)
        sys.argv = [argv[2], *argv[3:]]
        sys.path[:1] = [os.getcwd(), *extra]
    try:
        if module is None:
            runpy.run_path(argv[1], run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _main() -> None:
    path, parent = sys.argv[1], int(sys.argv[2])
    import importlib

    # No PR_SET_PDEATHSIG here: it fires when the *thread* that started the zygote ends, and a test may start it
    # from a thread of its own (jobs in flight then lost their zygote). The zygote ends with its pytest worker
    # through its serving loop instead, which checks its parent every 0.05 s.
    sys.path[0] = os.getcwd()  # the repository: ``lightning_swarm`` and ``tests`` import as they do in a job
    for name in _PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:  # a thread would not survive the fork: do not fork at all
        sys.stdout.write("threads\n")
        sys.stdout.flush()
        return
    code = _serve(path, parent)
    if code is not None:  # a forked child: end as the script's process would
        _exit(code)


def _exit(code: int) -> None:
    """End the child the way the interpreter ends a script (wait for its non-daemon threads, run its ``atexit``
    functions, flush its streams), without tearing down every module: in a forked child that teardown writes to
    every page it shares with the zygote, which took 1.2 s per job."""
    import atexit

    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(code)


if __name__ == "__main__":
    _main()
