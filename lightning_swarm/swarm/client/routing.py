"""Stochastic wiring: which peer of a stage gets the next microbatch.

SWARM routes each microbatch to one peer per stage in proportion to the peers' measured throughput, using
interleaved weighted round robin: every peer has an *expected busy time* (virtual seconds of work already
assigned to it); the peer with the smallest one gets the task and its busy time grows by
``task_size / throughput``. Peers that join (or come back from a ban) enter at the current minimum, so they
are probed right away without being flooded. When the throughput believed of a peer changes, its lead over the
least busy peer is re-expressed at the new figure (a newcomer probed at its first estimate is not starved).
Failing peers are banned with exponential backoff.

Announced throughputs are claims. Once the client has timed ``MEASURED_CALLS`` successful calls to a peer
(:meth:`StageRouter.observe`: samples per second of the peer's busy time as the client sees it, calls in flight
to it counted once, see :meth:`StageRouter.call_ended`), its measured rate
bounds what the router believes: ``believed = min(announced, r * measured)``, where ``r`` is the smallest
``announced / measured`` ratio among the stage's measured peers, i.e. the most modest peer calibrates what an
announced figure is worth in this client's measurements (per-call timings include the network and queueing, so
they are not in the same units as a server's own figure), and at most ``MAX_CLAIM_RATIO`` (8: so that a liar
measured before anyone else leaves the others enough calls to be measured too). An honest peer is bounded by about
its own claim; a peer announcing 1e12 samples/s is believed as fast as it measured, so it gets its measured share
of the microbatches.

:class:`StageRouter` handles one stage and is a pure function of the announced peers, the reported failures
and the clock, so it is unit-tested without a network. The :class:`~.client.SwarmClient` keeps one per stage.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from hivemind.p2p import PeerID

from lightning_swarm.swarm.dht.records import PeerInfo

__all__ = ["MEASURED_CALLS", "NoPeersError", "StageRouter"]

_MIN_THROUGHPUT = 1e-6
MEASURED_CALLS = 3  # timed calls to a peer before its measurements bound its announced throughput
_MEASURE_EMA = 0.3  # weight of the newest timing in a peer's measured rate
MAX_CLAIM_RATIO = 8.0  # an announced figure is never believed above this many times the measured rate


class NoPeersError(RuntimeError):
    """No live peer serves a stage (all unknown, banned or excluded)."""


@dataclass
class _Ban:
    failures: int = 0
    until: float = 0.0


class StageRouter:
    """Interleaved weighted round robin over the peers of one stage, with bans.

    Args:
        stage: the stage index (used in error messages).
        run_id: the swarm's run id (used in error messages).
        ban_base_s: the first ban of a peer lasts this many seconds; every further consecutive failure
            doubles it.
        ban_max_s: bans never last longer than this many seconds.
    """

    def __init__(self, stage: int, *, run_id: str = "", ban_base_s: float = 15.0, ban_max_s: float = 600.0):
        if ban_base_s < 0 or ban_max_s < ban_base_s:
            raise ValueError(f"Need 0 <= ban_base_s <= ban_max_s, got {ban_base_s} and {ban_max_s}")
        self.stage, self.run_id = stage, run_id
        self.ban_base_s, self.ban_max_s = ban_base_s, ban_max_s
        self._claimed: dict[PeerID, float] = {}  # announced throughputs (samples/s)
        self._throughput: dict[PeerID, float] = {}  # what the router believes (see the module docstring)
        # peer -> (EMA of the samples of its timed calls, EMA of the busy seconds they took, timed calls)
        self._measured: dict[PeerID, tuple[float, float, int]] = {}
        self._flight: dict[
            PeerID, list[float]
        ] = {}  # peer -> [calls in flight, when its busy time was last charged]
        self._busy: dict[PeerID, float] = {}  # peers in the heap (not banned) -> current busy time
        # lazy min-heap of (busy, 0 for a newcomer to probe first on ties else 1, insertion order, peer);
        # stale entries (the peer was charged again, left or was banned) are skipped when popped
        self._heap: list[tuple[float, int, int, PeerID]] = []
        self._counter = itertools.count()
        self._bans: dict[PeerID, _Ban] = {}

    @property
    def peers(self) -> dict[PeerID, float]:
        """Known peers and the throughputs (samples/s) the router believes, banned ones included."""
        return dict(self._throughput)

    @property
    def measured(self) -> dict[PeerID, float]:
        """Measured samples/s of the peers timed at least ``MEASURED_CALLS`` times."""
        return {
            p: samples / seconds
            for p, (samples, seconds, n) in self._measured.items()
            if n >= MEASURED_CALLS and seconds > 0
        }

    def update_peers(self, peers: Iterable[PeerInfo]) -> None:
        """Replace the known peers with ``peers`` (the latest DHT listing); ban history is kept."""
        new = {}
        for info in peers:
            throughput = info.throughput if math.isfinite(info.throughput) else _MIN_THROUGHPUT
            new[info.peer_id] = max(throughput, _MIN_THROUGHPUT)
        for peer_id in list(self._busy):
            if peer_id not in new:
                del self._busy[peer_id]
        for peer_id in list(self._measured):
            if peer_id not in new:
                del self._measured[peer_id]
        for peer_id in list(self._flight):
            if peer_id not in new:
                del self._flight[peer_id]
        self._claimed = new
        self._believe()

    def call_started(self, peer_id: PeerID, now: float | None = None) -> None:
        """A call to ``peer_id`` was sent (pair with :meth:`call_ended`)."""
        now = time.monotonic() if now is None else now
        flight = self._flight.get(peer_id)
        if flight is None or flight[0] <= 0:
            self._flight[peer_id] = [1, now]
        else:
            flight[0] += 1

    def call_ended(self, peer_id: PeerID, now: float | None = None) -> float:
        """A call to ``peer_id`` ended; returns the seconds of the peer's busy time it accounts for: the time
        since the peer's previous call ended, or since it became busy. Calls in flight to one peer overlap (they
        queue there): charging each its whole duration would count the queue's wait once per call and make
        the busiest peer look the slowest; this way the peer's measured rate is its samples per busy second."""
        now = time.monotonic() if now is None else now
        flight = self._flight.get(peer_id)
        if flight is None or flight[0] <= 0:
            return 0.0
        seconds = max(0.0, now - flight[1])
        flight[0] -= 1
        flight[1] = now
        return seconds

    def observe(self, peer_id: PeerID, samples: float, seconds: float) -> None:
        """Record a successful call to ``peer_id`` that processed ``samples`` in ``seconds`` of the peer's busy
        time (see :meth:`call_ended`; 0 for a call that ended with another); after ``MEASURED_CALLS`` of them
        the peer's measured rate (the ratio of the two averages) bounds its announced throughput."""
        if not (samples > 0 and seconds >= 0 and math.isfinite(samples) and math.isfinite(seconds)):
            return
        old = self._measured.get(peer_id)
        if old is None:
            new = (samples, seconds, 1)
        else:
            a = _MEASURE_EMA
            new = ((1 - a) * old[0] + a * samples, (1 - a) * old[1] + a * seconds, old[2] + 1)
        self._measured[peer_id] = new
        if new[2] >= MEASURED_CALLS:
            self._believe()

    def _believe(self) -> None:
        measured = {p: rate for p, rate in self.measured.items() if p in self._claimed}
        scale = min((self._claimed[p] / rate for p, rate in measured.items()), default=None)
        scale = None if scale is None else min(scale, MAX_CLAIM_RATIO)
        believed = dict(self._claimed)
        if scale is not None:
            for p, rate in measured.items():
                believed[p] = max(min(believed[p], scale * rate), _MIN_THROUGHPUT)
        before, self._throughput = self._throughput, believed
        self._rescale_leads(before)

    def _rescale_leads(self, before: dict[PeerID, float]) -> None:
        """Re-express each peer's lead over the least busy peer at the throughput now believed.

        A lead is work charged at the figure believed then. A newcomer's probe is charged at the estimate a server
        announces before it has measured a backward (:mod:`.throughput`), often far below its peers' measured
        figures: left as it was, the lead would starve the newcomer until the others had caught up with it, long
        after it announced its real figure. Conversely a peer found slower than believed falls back at once.
        """
        if len(self._busy) < 2:
            return
        floor = min(self._busy.values())
        for peer_id, busy in list(self._busy.items()):
            old, new = before.get(peer_id), self._throughput.get(peer_id)
            if busy > floor and old and new and old != new:
                self._set_busy(peer_id, floor + (busy - floor) * old / new)

    def is_banned(self, peer_id: PeerID, now: float | None = None) -> bool:
        """Whether ``peer_id`` is banned at time ``now``."""
        ban = self._bans.get(peer_id)
        return ban is not None and ban.until > (time.monotonic() if now is None else now)

    def choose(
        self,
        task_size: float,
        now: float | None = None,
        exclude: Collection[PeerID] = (),
        prefer: PeerID | None = None,
    ) -> PeerID:
        """Pick the peer for a task of ``task_size`` samples and charge it ``task_size / throughput``.

        Args:
            task_size: the amount of work (e.g. microbatch size), positive.
            now: the current ``time.monotonic()`` (for bans); defaults to the clock.
            exclude: peers not to pick (e.g. those that already failed this call).
            prefer: the peer to pick if it is known, live and not excluded (a backward goes to the peer that
                kept its forward's activations); otherwise the least busy one, as without it.

        Raises:
            NoPeersError: no known peer is live (all banned or excluded, or none announced).
        """
        now = time.monotonic() if now is None else now
        self._admit_new_peers(now)
        if (
            prefer is not None
            and prefer in self._busy
            and prefer not in exclude
            and not self.is_banned(prefer, now)
        ):
            self._set_busy(prefer, self._busy[prefer] + max(task_size, 0.0) / self._throughput[prefer])
            return prefer
        skipped: list[tuple[float, int, int, PeerID]] = []
        chosen = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            busy, _, _, peer_id = entry
            if self._busy.get(peer_id) != busy:
                continue
            if peer_id in exclude or self.is_banned(peer_id, now):
                skipped.append(entry)
                continue
            chosen = peer_id
            break
        queue = self._in_flight(chosen) + 1 if chosen is not None else 1
        if queue > 1:
            # the fair share's peer is still serving: a peer of the stage that is idle takes the task instead if
            # it would finish it no later (its time for the task against the chosen one's queue plus the task),
            # so that the chunks of one batch do not queue at one peer while another waits
            idle = [
                p
                for p in self._busy
                if p != chosen
                and p not in exclude
                and self._in_flight(p) == 0
                and not self.is_banned(p, now)
                and self._throughput[p] * queue >= self._throughput[chosen]
            ]
            if idle:
                skipped.append(entry)
                chosen = min(idle, key=lambda p: self._busy[p])
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if chosen is None:
            raise NoPeersError(self._no_peers_message(now, exclude))
        self._set_busy(chosen, self._busy[chosen] + max(task_size, 0.0) / self._throughput[chosen])
        return chosen

    def calls_in_flight(self) -> int:
        """How many calls of this client to the stage's peers are in flight."""
        return sum(self._in_flight(peer_id) for peer_id in self._flight)

    def _in_flight(self, peer_id: PeerID) -> int:
        flight = self._flight.get(peer_id)
        return int(flight[0]) if flight is not None and flight[0] > 0 else 0

    def ban(self, peer_id: PeerID, now: float | None = None) -> float:
        """Ban ``peer_id`` after a failed call; returns the ban duration in seconds.

        The ban lasts ``ban_base_s * 2 ** (consecutive_failures - 1)``, capped at ``ban_max_s``.
        """
        now = time.monotonic() if now is None else now
        ban = self._bans.setdefault(peer_id, _Ban())
        ban.failures += 1
        duration = min(self.ban_base_s * 2 ** min(ban.failures - 1, 60), self.ban_max_s)
        ban.until = now + duration
        self._busy.pop(peer_id, None)  # re-enters at the current minimum when the ban ends
        return duration

    def report_success(self, peer_id: PeerID, samples: float = 0.0, seconds: float = 0.0) -> None:
        """Forget the failures of ``peer_id`` (its next ban starts again at ``ban_base_s``); with ``samples`` and
        ``seconds``, also :meth:`observe` the call."""
        self._bans.pop(peer_id, None)
        if samples:
            self.observe(peer_id, samples, seconds)

    def num_live(self, now: float | None = None) -> int:
        """How many known peers are not banned."""
        now = time.monotonic() if now is None else now
        return sum(not self.is_banned(peer_id, now) for peer_id in self._throughput)

    def _admit_new_peers(self, now: float) -> None:
        newcomers = [p for p in self._throughput if p not in self._busy and not self.is_banned(p, now)]
        if not newcomers:
            return
        start = min(self._busy.values(), default=0.0)
        for peer_id in newcomers:
            self._set_busy(peer_id, start, probe=True)

    def _set_busy(self, peer_id: PeerID, busy: float, probe: bool = False) -> None:
        self._busy[peer_id] = busy
        heapq.heappush(self._heap, (busy, 0 if probe else 1, next(self._counter), peer_id))
        if len(self._heap) > 4 * len(self._busy) + 16:  # drop stale entries now and then
            self._heap = [entry for entry in self._heap if self._busy.get(entry[3]) == entry[0]]
            heapq.heapify(self._heap)

    def _no_peers_message(self, now: float, exclude: Collection[PeerID]) -> str:
        known = len(self._throughput)
        banned = [p for p in self._throughput if self.is_banned(p, now)]
        excluded = [p for p in self._throughput if p in exclude and p not in banned]
        where = f"stage {self.stage}" + (f" of run '{self.run_id}'" if self.run_id else "")
        message = (
            f"No live peers serve {where}: {known} known, {len(banned)} banned, {len(excluded)} excluded."
        )
        if banned:
            next_unban = min(self._bans[p].until for p in banned) - now
            message += f" The next ban ends in {next_unban:.1f} s."
        if known == 0:
            message += (
                f" Start a server for stage {self.stage} (e.g. a peer with role='server'), and check that this "
                f"peer joined the same DHT (same initial_peers and run_id)."
            )
        else:
            message += (
                f" The peers of stage {self.stage} are failing or unreachable: check their logs, and check that "
                f"peers behind NAT or firewalls can reach each other (announce public addresses or use relays)."
            )
        return message
