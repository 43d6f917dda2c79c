"""Churn: peers come and go on a schedule, as preemptible and volunteered machines do.

:class:`Churn` SIGKILLs one of the peers it manages every ``kill_every`` seconds (the oldest first, or a random
one) and starts a new one ``rejoin_after`` seconds after each kill, through ``start(slot)``: a callable that starts a
peer for a slot and returns its ``subprocess.Popen`` (e.g. ``VirtualCluster.popen`` in the slot's namespace). It
runs in a thread; :meth:`Churn.stop` ends it and returns the log of what happened. The processes it started are the
caller's to stop (the ones it killed are reaped here).

From a shell, ``python -m testbed.churn --kill-every 60 --rejoin-after 30 --peers 3 -- CMD ...`` runs ``CMD`` (with
``{slot}`` replaced by the slot's number) as ``--peers`` processes under that schedule for ``--seconds`` seconds,
then kills them all; every process it started ends with it (SIGINT, SIGTERM or the end of the schedule).
"""

from __future__ import annotations

import argparse
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from testbed.netns import kill_group


@dataclass
class ChurnEvent:
    """One thing the schedule did: ``kind`` is ``"kill"`` or ``"start"``, ``at`` seconds after it began."""

    kind: str
    slot: int
    at: float
    pid: int


@dataclass
class Churn:
    """Kill one managed peer every ``kill_every`` s (at ``kill_every``, twice that... after :meth:`begin`), start a
    new one ``rejoin_after`` s after each kill (see the module).

    Args:
        start: starts a peer for a slot and returns its process (it should lead its own process group: the kill
            goes to the group, so the peer's helpers go with it, as when a machine is preempted).
        procs: the running peers at the start, by slot.
        kill_every: seconds between kills (the first one after that long).
        rejoin_after: seconds from a kill to the start of its replacement in the same slot.
        order: ``"oldest"`` (the peer started longest ago) or ``"random"``.
        seed: of the random choice.
    """

    start: Callable[[int], subprocess.Popen[Any]]
    procs: dict[int, subprocess.Popen[Any]]
    kill_every: float = 60.0
    rejoin_after: float = 30.0
    order: str = "oldest"
    seed: int = 0
    events: list[ChurnEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.order not in ("oldest", "random"):
            raise ValueError(f"Churn(order={self.order!r}): use 'oldest' or 'random'.")
        if not 0 < self.rejoin_after < self.kill_every:
            raise ValueError("Churn: rejoin_after must be positive and shorter than kill_every.")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._started_at = {slot: 0.0 for slot in self.procs}
        self._rng = random.Random(self.seed)
        self._thread = threading.Thread(target=self._run, name="churn", daemon=True)
        self._t0 = 0.0

    def begin(self) -> Churn:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> list[ChurnEvent]:
        """End the schedule (a start that is due is not made) and return its events."""
        self._stop.set()
        self._thread.join()
        return list(self.events)

    def running(self) -> dict[int, subprocess.Popen[Any]]:
        with self._lock:
            return dict(self.procs)

    def _run(self) -> None:
        kills = 0
        while not self._stop.wait(max(0.0, self._t0 + (kills + 1) * self.kill_every - time.monotonic())):
            kills += (
                1  # on the clock of the schedule: a slow start of a replacement does not delay the next kill
            )
            with self._lock:
                alive = [slot for slot, proc in self.procs.items() if proc.poll() is None]
                if not alive:
                    continue
                if self.order == "oldest":
                    slot = min(alive, key=lambda s: self._started_at[s])
                else:
                    slot = self._rng.choice(alive)
                proc = self.procs.pop(slot)
            kill_group(proc)
            self.events.append(ChurnEvent("kill", slot, time.monotonic() - self._t0, proc.pid))
            if self._stop.wait(self.rejoin_after):
                return
            new = self.start(slot)
            with self._lock:
                self.procs[slot] = new
                self._started_at[slot] = time.monotonic() - self._t0
            self.events.append(ChurnEvent("start", slot, time.monotonic() - self._t0, new.pid))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m testbed.churn", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kill-every", type=float, default=60.0)
    parser.add_argument("--rejoin-after", type=float, default=30.0)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--order", choices=["oldest", "random"], default="oldest")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS ({slot} is replaced)")
    args = parser.parse_args(argv)
    cmd = [c for c in args.cmd if c != "--"] if args.cmd[:1] == ["--"] else list(args.cmd)
    if not cmd:
        parser.error("give the peer's command after --")

    def start(slot: int) -> subprocess.Popen[Any]:
        return subprocess.Popen([c.replace("{slot}", str(slot)) for c in cmd], start_new_session=True)

    procs = {slot: start(slot) for slot in range(args.peers)}
    churn = Churn(start, procs, args.kill_every, args.rejoin_after, args.order)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    churn.begin()
    try:
        done.wait(args.seconds)
    finally:
        events = churn.stop()
        for proc in churn.running().values():
            kill_group(proc)
    for event in events:
        print(f"{event.at:8.1f} s  {event.kind:<5}  slot {event.slot}  pid {event.pid}")


if __name__ == "__main__":
    main(sys.argv[1:])
