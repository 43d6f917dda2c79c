"""Chaos: servers SIGKILLed mid-forward, mid-backward and mid-averaging while a trainer trains through the swarm.

Peers are real processes on 127.0.0.1 (``testbed/stage_peer.py``); the trainer runs here with a :class:`SwarmClient`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import hivemind
import pytest
import torch
from torch import nn

from lightning_swarm.swarm.client.client import SwarmClient
from lightning_swarm.swarm.settings import SwarmSettings
from tests import _zygote
from tests._helpers import SMALL_SWARM_STRATEGY, alive

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / "testbed" / "stage_peer.py"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGKILL chaos on Linux")


def _descendants(pid: int) -> list[int]:
    out = []
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for child in map(int, children):
        out += [child, *_descendants(child)]
    return out


class Peer:
    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.proc = _zygote.Popen(
            [sys.executable, str(PEER), json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        self.info = json.loads(self.proc.stdout.readline() or "null")
        assert self.info is not None, self.proc.stderr.read()[-3000:]
        self.pids = [self.proc.pid, *_descendants(self.proc.pid)]

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.stderr.read()


@pytest.mark.timeout(600)
def test_servers_killed_mid_forward_backward_and_averaging_cost_retries_not_the_run() -> None:
    torch.manual_seed(0)
    width, steps, max_steps, batch = (
        16,
        40,
        100,
        8,
    )  # at least `steps`; more until every planned kill happened
    timeouts = {"request_timeout": 5.0, "matchmaking_time": 1.0, "averaging_timeout": 5.0}
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    base = {
        "run_id": "chaos",
        "num_stages": 2,
        "width": width,
        "blocks": 2,
        "lr": 1e-2,
        "target_batch_size": 32,
        "initial_peers": [str(a) for a in dht.get_visible_maddrs()],
        **timeouts,
    }
    peers: list[Peer] = []
    stderr = ""
    try:
        # stage 0: one peer dies during its first averaging round; stage 1: one peer dies mid-forward, comes back,
        # then dies mid-backward, and comes back again
        plan = {"flaky": ["forward", "backward", None]}
        peers.append(Peer({**base, "stage": 0, "kill": "averaging", "kill_delay": 0.3}))
        peers.append(Peer({**base, "stage": 0}))
        flaky = Peer({**base, "stage": 1, "kill": plan["flaky"].pop(0), "kill_after": 3})
        peers += [flaky, Peer({**base, "stage": 1})]
        settings = SwarmSettings(
            run_id="chaos",
            num_stages=2,
            compression="none",
            no_peers_timeout=30.0,
            ban_base_s=2.0,
            **timeouts,
        )
        client = SwarmClient(dht, settings)
        head, tail = nn.Linear(6, width), nn.Linear(width, 1)
        optimizer = torch.optim.Adam([*head.parameters(), *tail.parameters()], lr=1e-2)
        x_all = torch.randn(max_steps * batch, 6)
        y_all = torch.sin(x_all[:, :1] * 2) + x_all[:, 1:2]
        losses, durations, kills = [], [], []
        for step in range(max_steps):
            killed_all = not plan["flaky"] and flaky.cfg["kill"] is None and peers[0].proc.poll() is not None
            if step >= steps and killed_all:
                break  # the kills' timing depends on the routing and on the box's load
            if flaky.proc.poll() is not None:  # restart the flaky peer with its next way to die
                kills.append((flaky.cfg["kill"], flaky.proc.returncode, step))
                stderr += flaky.stop()
                kill = plan["flaky"].pop(0)
                flaky = Peer({**base, "stage": 1, "kill": kill, "kill_after": 3})
                peers.append(flaky)
            x, y = x_all[step * batch : (step + 1) * batch], y_all[step * batch : (step + 1) * batch]
            start = time.monotonic()
            h = client.call_stage(1, client.call_stage(0, head(x)))
            loss = nn.functional.mse_loss(tail(h), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            durations.append(time.monotonic() - start)
            losses.append(loss.item())
            time.sleep(0.2)  # a trainer's data pace: the stage's peers find each other and average meanwhile
        if flaky.proc.poll() is not None:
            kills.append((flaky.cfg["kill"], flaky.proc.returncode, len(losses)))
        kills += [(p.cfg.get("kill"), p.proc.returncode) for p in peers[:2] if p.proc.poll() is not None]
        stats = client.stats()
        client.shutdown()
    finally:
        for peer in peers:
            stderr += peer.stop()
        dht.shutdown()
    # mid-forward, mid-backward, mid-averaging
    assert sorted(k[:2] for k in kills) == [
        (w, -signal.SIGKILL) for w in ("averaging", "backward", "forward")
    ], (
        kills,
        stats,
    )
    assert len(losses) >= steps
    first, last = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    assert last < 0.7 * first, (first, last)
    assert stats["swarm/retries"] >= 2  # the calls in flight at the kills went to the other peer
    # no step waited longer than a request timeout and a retry per stage call (plus slack for a loaded box)
    assert max(durations) < 4 * timeouts["request_timeout"], max(durations)
    leftovers = [pid for peer in peers for pid in peer.pids if alive(pid)]
    deadline = time.monotonic() + 15
    while leftovers and time.monotonic() < deadline:
        time.sleep(0.2)
        leftovers = [pid for pid in leftovers if alive(pid)]
    assert leftovers == [], "processes of killed or stopped peers are still running"
    assert "Traceback" not in stderr and "ERROR" not in stderr, stderr[-3000:]


@pytest.mark.timeout(600)
def test_killing_one_peer_of_a_local_swarm_leaves_the_others_training_to_the_end(tmp_path) -> None:
    """``devices=4`` on this machine: peer 3 (a trainer serving stage 1) is SIGKILLed at its 8th step; the
    launcher reports it once, the other three train all their steps, and no process of the run is left."""
    from tests.test_swarm_strategy import run_job

    steps = 30
    cfg = {
        "model": "seq",
        "devices": 4,
        "max_steps": steps,
        "out": str(tmp_path / "out.pt"),
        "pids_dir": str(tmp_path),
        "kill": {"rank": 3, "step": 8},
        "strategy": {
            **SMALL_SWARM_STRATEGY,
            "linger_timeout": 60.0,
            "run_id": "chaos_local",
        },
    }
    start = time.monotonic()
    result = run_job(cfg, timeout=560)
    assert len(result["losses"]) == steps  # peer 0 trained to the end
    assert result["deaths"] == [[3, -signal.SIGKILL]] or result["deaths"] == [(3, -signal.SIGKILL)]
    assert result["stderr"].count("died (signal 9)") == 1
    assert "Traceback" not in result["stderr"] and "ERROR" not in result["stderr"], result["stderr"][-5000:]
    pids = [int(p) for f in tmp_path.glob("pids?") for p in f.read_text().split()]
    assert len(list(tmp_path.glob("pids?"))) == 4 and len(pids) >= 4 * 3  # each peer: itself, DHT, p2pd...
    deadline = time.monotonic() + 15
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in pids if alive(p)] == [], "processes of the local swarm outlived it"
    print(f"local swarm with a killed peer: {time.monotonic() - start:.0f} s")
