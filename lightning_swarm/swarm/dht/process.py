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
"""

from __future__ import annotations

import logging
from multiprocessing.reduction import ForkingPickler
from typing import Any

import hivemind

logger = logging.getLogger(__name__)

_SKIP = "_skip_unreadable_request"


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
    """``hivemind.DHT`` whose process drops an unreadable request without pausing (see the module docstring)."""

    def run(self) -> None:  # in the DHT's own process
        self._inner_pipe: Any = _SkipUnreadable(self._inner_pipe)
        super().run()

    async def _skip_unreadable_request(self) -> None:
        return None
