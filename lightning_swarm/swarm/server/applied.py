"""At most once: the ids of the backwards a stage server applied (remembered for a while, bounded), and the error of a
backward that ended after its caller stopped counting on it."""

from __future__ import annotations

import time
from collections import OrderedDict

_APPLIED_TTL_S = 600.0  # how long a peer remembers the id of a backward it applied


_APPLIED_MAX = 100_000  # ... and how many ids at most (16 bytes each, plus the dict's overhead)


class TooLate(RuntimeError):
    """A backward finished after its caller's commit deadline, so its gradients were not applied."""


class AppliedRequests:
    """The ids of the backward requests a peer applied: bounded (oldest forgotten first) and expiring.

    :param ttl: seconds an id is remembered; a caller retries a request within its ``request_timeout`` times the
        number of peers it tries, far less than the default 10 minutes.
    :param max_size: ids remembered at most.
    """

    def __init__(self, ttl: float = _APPLIED_TTL_S, max_size: int = _APPLIED_MAX) -> None:
        self.ttl, self.max_size = ttl, max_size
        self._seen: OrderedDict[int, float] = OrderedDict()

    def add(self, request_id: int, now: float | None = None) -> bool:
        """Remember ``request_id``; returns False if it was already known (not thread-safe: callers lock)."""
        now = time.monotonic() if now is None else now
        while self._seen and (len(self._seen) >= self.max_size or next(iter(self._seen.values())) < now):
            self._seen.popitem(last=False)
        if request_id in self._seen:
            return False
        self._seen[request_id] = now + self.ttl
        return True

    def known(self, request_id: int, now: float | None = None) -> bool:
        """Whether ``request_id`` was added and has not expired (not thread-safe: callers lock)."""
        expires = self._seen.get(request_id)
        return expires is not None and expires >= (time.monotonic() if now is None else now)

    def __len__(self) -> int:
        return len(self._seen)
