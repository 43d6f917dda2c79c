"""The DHT process of a swarm peer: hivemind's, skipping a request it cannot read at once.

Every call a process makes on a ``hivemind.DHT`` is pickled into the pipe of the DHT's process together with its
future, whose state lives in a shared-memory tensor of the calling process. If that process exits before the DHT
process reads the request (a hivemind averager shut down at the end of a run had requests queued), the tensor can
no longer be fetched and unpickling raises (``FileNotFoundError``). hivemind 1.1.12 logs that and then sleeps
``wait_timeout`` (3 s) before reading the next request. At the end of a run such requests pile up: in a 4-peer run
(2 stages x 2 peers) the DHT processes met 53 of them, ~40 s in which every DHT read and write of the peers timed
out, so the end-of-run handshake waited out its timeouts (about a minute per run). :class:`SwarmDHT` drops such a
request at once (its sender is gone and waits for no answer) and reads the next one.

Unpickling such a request can also fail otherwise: fetching a tensor from a sender that exits during the transfer
raises ``EOFError`` (``multiprocessing.resource_sharer``'s socket closes under ``recv_handle``) or an
``AuthenticationError``, which hivemind's loop does not catch: the DHT process dies with exit code 1, and with it
the peer. :class:`SwarmDHT` reads the message's bytes first (a broken pipe raises there, to hivemind's handling
as before) and drops a message whose bytes cannot be unpickled, whatever the error.

hivemind waits for a new DHT's process to be ready without a deadline, so a process that died or hung while
starting hung its peer. :class:`SwarmDHT` waits :data:`START_TIMEOUT` at most and ends at once when the process
exits before it is ready, with an error that says which.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

import hivemind

from lightning_swarm.swarm.lifetime import robust_helper_locks

logger = logging.getLogger(__name__)

_SKIP = "_skip_unreadable_request"
START_TIMEOUT = 120.0  # s: a DHT's process that is not ready by then is stopped, and the start fails


class _SkipUnreadable:
    """The DHT process's end of its request pipe; a request that cannot be unpickled becomes a no-op request."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def recv(self) -> Any:
        # as ``Connection.recv``: the message's bytes (a broken pipe raises here, to hivemind's handling), then
        # its unpickling, where the tensors of the request's future are fetched from the sender
        message = self._pipe.recv_bytes()
        try:
            return ForkingPickler.loads(message)
        except Exception as e:  # its sender has exited (FileNotFoundError, EOFError, AuthenticationError...)
            logger.debug(f"DHT: dropped a request whose sender has exited: {e!r}")
            return (_SKIP, [], {})


class SwarmDHT(hivemind.DHT):
    """``hivemind.DHT`` whose process drops an unreadable request without pausing, and whose start has a deadline
    (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        robust_helper_locks()  # before the DHT's process is forked
        super().__init__(*args, **kwargs)

    def wait_until_ready(self, timeout: float | None = None) -> None:
        limit = START_TIMEOUT if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            try:
                return self._ready.result(timeout=min(0.5, max(deadline - time.monotonic(), 0.0)))
            except concurrent.futures.TimeoutError:
                pass
            if not self.is_alive():
                try:  # an error it sent before exiting says more than its exit code
                    return self._ready.result(timeout=1.0)
                except concurrent.futures.TimeoutError:
                    raise RuntimeError(
                        f"The DHT's process exited (code {self.exitcode}) before it was ready; see the lines above."
                    ) from None
            if time.monotonic() >= deadline:
                self.kill()
                self.join(5)
                raise TimeoutError(f"The DHT's process was not ready within {limit:.0f} s; it was stopped.")

    def run(self) -> None:  # in the DHT's own process
        self._inner_pipe: Any = _SkipUnreadable(self._inner_pipe)
        super().run()

    async def _skip_unreadable_request(self) -> None:
        return None
