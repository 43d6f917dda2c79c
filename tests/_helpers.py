"""Helpers shared by tests and the processes they start (importable from both: ``from tests._helpers import ...``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import hivemind

from tests import _zygote

ROOT = Path(__file__).resolve().parents[1]

# the strategy of the small local swarms (2 stages, fast timeouts) of the failure, launcher and chaos tests
SMALL_SWARM_STRATEGY: dict[str, Any] = {
    "pipeline": "layers",
    "num_stages": 2,
    "compression": "none",
    "matchmaking_time": 1.0,
    "averaging_timeout": 5.0,
    "request_timeout": 10.0,
}


def run_launcher_job(out_dir: Path, mode: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``tests/_launcher_job.py OUT_DIR MODE`` to its end: the process and what it printed last (JSON)."""
    res = _zygote.run(
        [sys.executable, str(ROOT / "tests" / "_launcher_job.py"), str(out_dir), mode],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res, json.loads(res.stdout.strip().splitlines()[-1])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_dhts(count: int) -> list[hivemind.DHT]:
    """``count`` DHT nodes on 127.0.0.1, the later ones bootstrapped from the first: the peers' ``SwarmDHT``
    (hivemind's, surviving a request whose sender exited: see ``swarm/dht/process.py``)."""
    from lightning_swarm.swarm.dht.process import SwarmDHT

    first = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    nodes = [first]
    try:
        for _ in range(count - 1):
            nodes.append(
                SwarmDHT(
                    start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs()
                )
            )
    except BaseException:
        for node in nodes:
            node.shutdown()
        raise
    return nodes


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie is dead, just not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:  # gone (or going) between the listing and the read
        return False


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, whichever of its threads started it (hivemind forks from several)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found
