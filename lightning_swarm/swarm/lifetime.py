"""Process lifetime: every process a peer starts ends with that peer, on every exit path.

hivemind runs its DHT and every averager in forked helper processes. When the peer that forked them exits
normally, hivemind stops them; when the peer is SIGKILLed (preemption, OOM killer, ``kill -9``) nothing runs in
the peer any more, and the helpers would live on as orphans holding memory and ports. Only the kernel can act
at that moment: ``prctl(PR_SET_PDEATHSIG)`` asks it to signal a child when its parent dies.

:func:`die_with_parent` installs a fork hook in this process, so that every child forked from now on gets
that signal when this process dies. The kernel sends it when the *thread* that forked the child ends, so a child
forked by a thread other than the main thread instead watches its parent's pid with a light daemon thread.
Processes started with ``exec`` do not run Python fork hooks: hivemind starts its ``p2pd`` daemon with
``asyncio.subprocess.create_subprocess_exec``, which :func:`die_with_parent` wraps so that the daemon gets the
same parent-death signal (it would otherwise outlive a killed peer by hivemind's 30 s idle timeout).

Every forked helper also moves to its own process group. A signal sent to the peer's process group (Ctrl-C in a
terminal, ``kill -TERM -PGID``, a job runner stopping the job) then reaches the peers, which stop their helpers
in order while leaving the swarm, and not the helpers themselves: a DHT process or an averager killed under a
peer that is still leaving turned a clean stop into a minute of failed calls and tracebacks. Children that run
another program (``subprocess`` with a ``preexec_fn``, e.g. the launcher's peers) are left in their group when
started inside :func:`exec_children`.

A Ctrl-C must not be lost either. Python raises ``KeyboardInterrupt`` wherever the main thread happens to be; when
that is a weakref callback or a ``__del__`` (the garbage collector runs them at any allocation), Python prints
"Exception ignored in ..." with a traceback and carries on: the peer trains on while its neighbours stop.
:func:`latch_interrupts` makes the SIGINT handler also set a flag, which the peer's waits poll
(:func:`raise_pending_interrupt`, on every stage call and while waiting for peers): a swallowed Ctrl-C is raised
again there, and its "ignored" report is not printed. :func:`interrupt_handled` clears it once the interrupt has
reached the trainer.

A peer must also end when one of its helpers died under it (killed by hand, or by the OOM killer): hivemind then
waits on pipes and futures that nobody will ever answer. Every step of a peer's shutdown runs under
:func:`bounded`, which gives up on a step that hangs and leaves it to a daemon thread, and
:func:`settle_dead_helpers` reports the helpers that died and keeps hivemind from shutting them down (or, when the
p2p daemon they talk through died, stops the live ones at once).

A helper that dies must not take its peer's other helpers with it, either. hivemind's futures (``MPFuture``, how
every call to a DHT or an averager process gets its answer) share two locks with every process forked from the
peer: one around each write of an answer into the pipe back to the caller, one around allocating a future's shared
state. A helper SIGKILLed while it held either left it held forever, and from then on every answer of every helper
waited on it: the peer's next DHT call, or the next DHT it started, waited forever. :func:`robust_helper_locks`
replaces them: the allocation lock becomes a lock of each process (its state is per process anyway), and the pipe
lock records its holder, so that a waiter takes it over, with a warning, once that holder is dead.

Linux only, except the Ctrl-C latch and the bounded shutdown; elsewhere the other functions do nothing.
"""

from __future__ import annotations

import asyncio.subprocess
import ctypes
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning_swarm.children import dies_with_this_process
from lightning_swarm.swarm.footprint import p2pd_env

__all__ = [
    "bounded",
    "describe_exit",
    "die_with_parent",
    "dies_with_this_process",
    "exec_children",
    "interrupt_handled",
    "latch_interrupts",
    "raise_pending_interrupt",
    "robust_helper_locks",
    "running_parent",
    "set_parent_death_signal",
    "settle_dead_helpers",
    "start_bounded",
    "wait_bounded",
]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_installed_in_pid: int | None = None
_forked_from_main_thread = True
_parent_pid = 0
_child_will_exec = False
_local = threading.local()


def set_parent_death_signal(sig: int = signal.SIGKILL, parent_pid: int | None = None) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) dies.

    :param sig: the signal to receive; SIGKILL by default (nothing in the child can block it).
    :param parent_pid: the pid the parent had when it forked us; if the parent is already gone by the time this
        runs (the race the man page warns about), the signal is sent to ourselves at once.
    :returns: whether the request was made (False off Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return True


@contextmanager
def exec_children() -> Iterator[None]:
    """Processes this thread starts inside the block run another program and manage their own lifetime (the fork
    hook of :func:`die_with_parent` leaves them alone: same process group, no watcher thread)."""
    previous = getattr(_local, "exec", False)
    _local.exec = True
    try:
        yield
    finally:
        _local.exec = previous


_interrupt_pending = False


def _latched_sigint(signum: int, frame: Any) -> None:
    global _interrupt_pending
    _interrupt_pending = True
    raise KeyboardInterrupt


def latch_interrupts() -> None:
    """Make a Ctrl-C in this process impossible to lose (see the module docstring). Call on the main thread;
    idempotent. A SIGINT handler other than Python's default (one the user set, or SIGINT ignored) is left alone."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _latched_sigint)
    if not isinstance(sys.unraisablehook, _LatchedInterruptHook):
        sys.unraisablehook = _LatchedInterruptHook(sys.unraisablehook)


def raise_pending_interrupt() -> None:
    """On the main thread, raise the ``KeyboardInterrupt`` of a Ctrl-C that has not reached the trainer yet."""
    global _interrupt_pending
    if _interrupt_pending and threading.current_thread() is threading.main_thread():
        _interrupt_pending = False
        raise KeyboardInterrupt


def interrupt_handled() -> None:
    """The pending Ctrl-C has reached the trainer (which is stopping): nothing to raise again."""
    global _interrupt_pending
    _interrupt_pending = False


class _LatchedInterruptHook:
    """``sys.unraisablehook`` that does not print a latched ``KeyboardInterrupt``: it will be raised again.

    Nor does it print CPython 3.11's failure to describe an unclosed ``asyncio.StreamWriter`` whose connection was
    already lost (``StreamWriter.__del__`` formats its ResourceWarning with the transport's ``repr``, which reads
    ``transport._loop._selector`` after ``_loop`` was set to ``None``): seen once in a peer whose p2p daemon had
    been killed, as a traceback from hivemind's daemon connection being collected. It is logged at debug level."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    def __call__(self, unraisable: Any) -> None:
        if _interrupt_pending and isinstance(unraisable.exc_value, KeyboardInterrupt):
            return
        if _is_unclosed_stream_repr_bug(unraisable):
            logger.debug(
                f"Ignored asyncio's failure to describe an unclosed stream: {unraisable.exc_value!r}"
            )
            return
        self.previous(unraisable)


def _is_unclosed_stream_repr_bug(unraisable: Any) -> bool:
    return (
        isinstance(unraisable.exc_value, AttributeError)
        and "_selector" in str(unraisable.exc_value)
        and getattr(unraisable.object, "__qualname__", None) == asyncio.StreamWriter.__del__.__qualname__
    )


def _before_fork() -> None:
    # runs in the forking thread with the GIL held until the fork: the child inherits these globals as set here
    global _forked_from_main_thread, _parent_pid, _child_will_exec
    _forked_from_main_thread = threading.current_thread() is threading.main_thread()
    _parent_pid = os.getpid()
    _child_will_exec = getattr(_local, "exec", False)


def _after_fork_in_child() -> None:
    if _child_will_exec:
        return
    parent = _parent_pid
    try:
        os.setpgid(0, 0)  # out of the peer's process group: signals to the group are for the peer to handle
    except OSError:
        pass
    if _forked_from_main_thread:
        set_parent_death_signal(signal.SIGKILL, parent_pid=parent)
    else:
        # PDEATHSIG would fire when the forking thread ends, which may be long before the parent process does
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="die-with-parent").start()


def _watch_parent(parent_pid: int, period: float = 0.5) -> None:
    stop = threading.Event()
    while not stop.wait(period):
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent() -> None:
    """Make every child this process forks from now on die when this process dies (idempotent, per process:
    a forked child that forks again must call it itself, which hivemind's helpers never do)."""
    global _installed_in_pid, _libc
    robust_helper_locks()
    if _installed_in_pid == os.getpid() or not sys.platform.startswith("linux"):
        return
    _libc = _libc or ctypes.CDLL(None, use_errno=True)
    # a child forked from a process that installed the hook inherits the registration: `_installed_in_pid`
    # keeps a second call in that child from registering twice
    if _installed_in_pid is None:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _wrap_subprocess_exec()
        _keep_new_sessions()
    _installed_in_pid = os.getpid()


def running_parent(pid: int) -> int | None:
    """The parent of process ``pid`` while it runs; ``None`` once it has died (a helper that died is a zombie until
    its peer reaps it) or where ``/proc`` cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, parent = f.read().rsplit(")", 1)[1].split()[:2]
    except (OSError, IndexError, ValueError):
        return None
    return None if state in ("Z", "X") else int(parent)


class _ProcessLock:
    """A lock of this process's threads, fresh in every forked child (a thread that held it at the fork does not
    exist in the child)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._renew)

    def _renew(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class _TakeoverLock:
    """A lock shared by the processes forked after its creation, which a waiter takes over from a holder that died
    holding it (checked every ``poll`` s). Its holder's pid lives in shared memory beside the semaphore."""

    def __init__(self, poll: float = 1.0) -> None:
        import multiprocessing as mp

        self._lock = mp.Lock()
        self._guard = mp.Lock()  # held only to compare and set the holder (a few instructions)
        self._holder = mp.Value("q", 0, lock=False)
        self._poll = poll

    def __enter__(self) -> bool:
        while not self._lock.acquire(timeout=self._poll):
            holder = self._holder.value
            if holder and holder != os.getpid() and running_parent(holder) is None:
                with self._guard:
                    taken = self._holder.value == holder
                    if taken:
                        self._holder.value = os.getpid()
                if taken:
                    logger.warning(
                        f"A hivemind helper process (pid {holder}) died holding the lock of its answers' pipe; "
                        "this process takes it over."
                    )
                    return True
        self._holder.value = os.getpid()
        return True

    def __exit__(self, *exc: object) -> None:
        self._holder.value = 0
        self._lock.release()


_robust_locks_installed = False


def robust_helper_locks() -> None:
    """Replace the locks that hivemind's futures share between a peer and its helper processes by locks that a
    helper's death does not leave held (see the module docstring). Idempotent; call it before the first helper is
    forked."""
    global _robust_locks_installed
    if _robust_locks_installed:
        return
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    MPFuture._update_lock = _TakeoverLock()
    SharedBytes._lock = _ProcessLock()
    _robust_locks_installed = True


def _wrap_subprocess_exec() -> None:
    """Processes that asyncio starts (hivemind's ``p2pd``) die with the process that started them."""
    original = asyncio.subprocess.create_subprocess_exec
    if getattr(original, "_dies_with_parent", False):
        return

    @functools.wraps(original)
    async def create_subprocess_exec(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("preexec_fn") is None:
            kwargs["preexec_fn"] = dies_with_this_process()
        if args:
            kwargs["env"] = p2pd_env(args[0], kwargs.get("env"))
        return await original(*args, **kwargs)

    create_subprocess_exec._dies_with_parent = True  # type: ignore[attr-defined]
    asyncio.subprocess.create_subprocess_exec = create_subprocess_exec


def _keep_new_sessions() -> None:
    """A ``subprocess.Popen`` that asks for its own session or process group places its child itself: the fork hook
    leaves that child alone. (With a ``preexec_fn`` Python runs the fork hooks in the child, and the hook's
    ``setpgid`` made the child a group leader, so the ``setsid`` that ``start_new_session`` asks for failed with
    EPERM: any such ``Popen`` in a peer's process raised ``PermissionError``.)"""
    original = subprocess.Popen.__init__
    if getattr(original, "_sessions_kept", False):
        return

    @functools.wraps(original)
    def __init__(self: subprocess.Popen, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("start_new_session") or kwargs.get("process_group") is not None:
            with exec_children():
                original(self, *args, **kwargs)
        else:
            original(self, *args, **kwargs)

    __init__._sessions_kept = True  # type: ignore[attr-defined]
    subprocess.Popen.__init__ = __init__  # type: ignore[method-assign]


_libc: Any = None


def describe_exit(code: int | None) -> str:
    """A process's exit status in words: ``"signal 9"`` or ``"exit code 1"``."""
    return f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"


def bounded(what: str, step: Callable[[], Any], timeout: float) -> bool:
    """Run one shutdown ``step``, waiting at most ``timeout`` seconds; returns whether it finished. A step that hangs
    (hivemind talking to a helper process that died) is left to its daemon thread, which the interpreter does not
    wait for; its exception, if any, is logged at DEBUG."""
    return wait_bounded(what, start_bounded(what, step), timeout)


def start_bounded(what: str, step: Callable[[], Any]) -> threading.Event:
    """Start ``step`` in a daemon thread; the event is set once it has returned or raised (see :func:`bounded`)."""
    done = threading.Event()

    def run() -> None:
        try:
            step()
        except Exception as e:
            logger.debug(f"{what} failed: {e!r}")
        finally:
            done.set()

    threading.Thread(target=run, name="swarm-shutdown", daemon=True).start()
    return done


def wait_bounded(what: str, done: threading.Event, timeout: float) -> bool:
    """Wait at most ``timeout`` seconds for a step started by :func:`start_bounded`; warn if it has not finished."""
    if done.wait(timeout):
        return True
    logger.warning(f"Swarm peer: {what} did not finish within {timeout:.0f} s; not waiting for it.")
    return False


def settle_dead_helpers(helpers: list[tuple[str, Any]], daemon_gone: bool = False) -> list[str]:
    """The hivemind helper processes among ``helpers`` (``(name, process)``) that died, as ``"name (pid N, signal
    S)"``. A helper that exited with status 0 ended by itself (hivemind knows) and is not listed, nor is one settled
    by an earlier call (each death is reported once). Dead helpers are made to skip hivemind's shutdown, which
    would log an error for a process already gone. ``daemon_gone``: the p2p daemon the helpers talk through died
    (with the DHT's process); the live ones are then stopped at once, since asked to shut down they would fail on
    the dead daemon and print tracebacks."""
    dead = []
    for name, process in helpers:
        if (
            process is None
            or getattr(process, "pid", None) is None
            or getattr(process, "shutdown", None) is _nothing
        ):
            continue  # (settled already: reported once)
        try:
            alive = process.is_alive()
        except (AssertionError, ValueError):  # not this process's child
            continue
        if alive and daemon_gone:
            process.terminate()
            process.join(timeout=5)
            process.shutdown = _nothing
        elif not alive and process.exitcode != 0:
            dead.append(f"{name} (pid {process.pid}, {describe_exit(process.exitcode)})")
            process.shutdown = _nothing
    return dead


def _nothing() -> None:
    pass


class PeerStopping(SystemExit):
    """This peer was asked to stop (SIGTERM) while a call waited for a stage: unwind at once, quietly.

    A ``SystemExit`` (exit status 0, like Lightning's ``SIGTERMException``), so that no ``except Exception`` on
    the way retries it and the interpreter ends without a traceback.
    """

    def __init__(self, message: str = "") -> None:
        super().__init__()
        self.message = message

    def __str__(self) -> str:
        return self.message
