"""One background asyncio event loop per process, shared by every SWARM component.

hivemind's ``P2P`` objects are bound to the event loop they were created in, so the stage servers and the
swarm client of a process all live on one loop running in a daemon thread. Sync code (the trainer, the
server's compute thread) submits coroutines to it with :func:`run_coroutine`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_pid: int | None = None


def get_loop() -> asyncio.AbstractEventLoop:
    """Return this process's background event loop, starting its thread on first use (and after a fork)."""
    global _loop, _thread, _pid
    with _lock:
        if _loop is None or _pid != os.getpid() or _thread is None or not _thread.is_alive():
            from lightning_swarm.swarm.logs import loop_exception_handler

            loop = asyncio.new_event_loop()
            loop.set_exception_handler(loop_exception_handler)
            ready = threading.Event()

            def _run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            thread = threading.Thread(target=_run, name="lightning-swarm-loop", daemon=True)
            thread.start()
            ready.wait()
            _loop, _thread, _pid = loop, thread, os.getpid()
        return _loop


def in_loop_thread() -> bool:
    """True when called from the background loop's own thread (where blocking on it would deadlock)."""
    return _thread is not None and threading.current_thread() is _thread


STOP_POLL_S = 0.25  # how often a wait with a ``stop`` predicate polls it


def run_coroutine(
    coro: Coroutine[Any, Any, T], timeout: float | None = None, stop: Callable[[], bool] | None = None
) -> T:
    """Run ``coro`` on the background loop and wait for its result.

    Args:
        coro: the coroutine to run.
        timeout: seconds to wait; ``None`` waits forever. On timeout the coroutine is cancelled and
            ``TimeoutError`` is raised.
        stop: polled every ``STOP_POLL_S`` seconds while waiting; once it returns True the coroutine is cancelled
            and :class:`~.routing.PeerStopping` is raised, and what it raises (another peer's failure) is raised
            after cancelling the coroutine. A peer that is stopping does not wait out a call in flight.
    """
    if in_loop_thread():
        coro.close()
        raise RuntimeError(
            "run_coroutine() was called from the swarm event-loop thread; await the coroutine instead"
        )
    future = asyncio.run_coroutine_threadsafe(coro, get_loop())
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        wait = left if stop is None else (STOP_POLL_S if left is None else min(left, STOP_POLL_S))
        try:
            return future.result(wait)
        except concurrent.futures.TimeoutError:
            if future.done() and not future.cancelled():
                raise  # the coroutine itself raised TimeoutError
            if deadline is not None and time.monotonic() >= deadline:
                future.cancel()
                raise TimeoutError(f"swarm operation did not finish within {timeout} s") from None
        try:
            stopping = stop is not None and stop()
        except BaseException:
            future.cancel()
            raise
        if stopping:
            future.cancel()
            from lightning_swarm.swarm.lifetime import PeerStopping

            raise PeerStopping("a swarm call was abandoned: this peer is stopping")


async def replicate_p2p(dht: Any) -> Any:
    """A new ``hivemind.P2P`` connected to ``dht``'s daemon (same peer id), owned by the caller.

    Unlike ``dht.replicate_p2p()``, which caches one replica per process, every call opens its own connection,
    so a component may shut its replica down without breaking the others.
    """
    from hivemind import DHT
    from hivemind.p2p import P2P

    loop = asyncio.get_running_loop()
    # a blocking call into the DHT process: keep it off the event loop
    maddr = await loop.run_in_executor(None, dht.run_coroutine, DHT._get_p2p_daemon_listen_maddr)
    return await P2P.replicate(maddr)
