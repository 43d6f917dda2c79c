"""The test bed's churn schedule (``testbed.churn``): SIGKILLs a peer's whole process group on time, starts its
replacement later, and leaves nothing running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from testbed.churn import Churn

# a "peer" with a helper in its process group, as a swarm peer has its DHT and p2p daemon
PEER = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"


def _start(slot: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PEER], start_new_session=True)


def _group_alive(pgid: int, wait: float = 5.0) -> bool:
    """Whether process group ``pgid`` still has members after up to ``wait`` s (a SIGKILLed helper is reaped by
    init a moment after its leader)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.1)


@pytest.mark.timeout(60)
def test_churn_kills_a_peer_with_its_helpers_and_starts_a_new_one_later() -> None:
    procs = {slot: _start(slot) for slot in range(2)}
    first = {slot: p.pid for slot, p in procs.items()}
    churn = Churn(_start, dict(procs), kill_every=1.5, rejoin_after=0.5).begin()
    try:
        time.sleep(4.0)  # two kills (at 1.5 s, 3.5 s) and the first replacement (at 2.0 s)
        events = churn.stop()
    finally:
        running = churn.running()
        for proc in running.values():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    kinds = [(e.kind, e.slot) for e in events]
    assert kinds[:3] == [("kill", 0), ("start", 0), ("kill", 1)], kinds  # the oldest goes first
    assert 1.3 < events[0].at < 2.5 and events[1].at - events[0].at >= 0.5
    assert events[0].pid == first[0] and events[1].pid != first[0]
    for pid in (first[0], first[1]):  # killed: the peer and its helper (same group)
        assert procs[0 if pid == first[0] else 1].returncode == -signal.SIGKILL
        assert not _group_alive(pid), "a killed peer's helper outlived it"
    assert all(not _group_alive(p.pid) for p in running.values())


def test_churn_refuses_a_schedule_that_never_rejoins() -> None:
    with pytest.raises(ValueError, match="rejoin_after"):
        Churn(_start, {}, kill_every=10, rejoin_after=20)
