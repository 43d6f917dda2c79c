"""Throughput of a swarm while one of its servers is killed and restarted.

The swarm: 2 stages x 2 server peers (``examples/stage_peer.py`` processes); the trainer routes each microbatch
through one peer per stage and retries failed calls on the other peer of the stage. (An earlier version also ran
a "fixed pipeline": the same client with one peer per stage. It is gone: that is not a pipeline a user would
otherwise pick, it reconnected on its own and shared the cores a dead peer freed, so it said nothing about the
alternative. The comparison against torch's GPipe restarted from checkpoints, asked for by issue 25, is not built.)

The trainer keeps ``--concurrency`` microbatches in flight (forward through both stages, then backward). The swarm
is measured without faults, then under faults: one stage-1 server is SIGKILLed, a replacement
process is started at once (a preempted machine coming back: its start-up is the downtime), and once it serves,
the next kill waits three times that downtime, so that one peer in four (in the swarm) is down a quarter of the
time; the fault phase is whole kill cycles (2 with ``--quick``, else 4). ``retained`` = samples/s with faults /
samples/s without. The replacement starts on the same two cores as everything else (on a real swarm it would
start on its own machine), so its start-up also slows the others.

Usage: ``python benchmarks/swarm_faults.py [--quick]``. The last stdout line is one JSON object with
``throughput_no_faults``, ``throughput_with_faults``, ``retained``, ``kills``, the measured ``down_fraction`` and
the load average; it is also written to ``runs/swarm_faults/swarm_faults.json``, with ``swarm_faults.png``
(samples/s over time, downtimes shaded) next to it (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import _harness
import hivemind
import torch

from lightning_swarm.swarm import SwarmClient, SwarmSettings
from lightning_swarm.swarm.lifetime import die_with_parent
from lightning_swarm.swarm.logs import quiet_routine_logs

ROOT = _harness.ROOT
PEER = ROOT / "examples" / "stage_peer.py"
WIDTH, BLOCKS, BATCH = 256, 2, 16
TIMEOUTS = {"request_timeout": 15.0, "matchmaking_time": 1.0, "averaging_timeout": 5.0}


class Peer:
    def __init__(self, cfg: dict) -> None:
        self.proc = _harness.popen(
            [sys.executable, str(PEER), json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None if os.environ.get("SWARM_FAULTS_VERBOSE") else subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
        )

    def wait_ready(self) -> None:
        if not self.proc.stdout.readline():
            raise RuntimeError(f"a stage peer failed to start (exit code {self.proc.poll()})")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            _harness.stop_with_stdin(self.proc, timeout=20)


class Trainer:
    """``concurrency`` threads, each running forward + backward microbatches through both stages."""

    def __init__(self, client: SwarmClient, concurrency: int) -> None:
        self.client, self.concurrency = client, concurrency
        self.done: list[float] = []  # completion time of every microbatch
        self.errors = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(concurrency)]

    def _work(self) -> None:
        torch.set_num_threads(1)
        while not self._stop.is_set():
            x = torch.randn(BATCH, WIDTH, requires_grad=True)
            try:
                self.client.call_stage(1, self.client.call_stage(0, x)).pow(2).mean().backward()
                self.done.append(time.monotonic())
            except Exception:
                self.errors += 1

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def rate(self, start: float, end: float) -> float:
        return sum(start <= t < end for t in self.done) * BATCH / (end - start)


def run_swarm(args: argparse.Namespace, dht: hivemind.DHT, peers_per_stage: int = 2) -> dict:
    run_id = f"faults_swarm_{os.getpid()}"
    base = {
        "run_id": run_id,
        "num_stages": 2,
        "width": WIDTH,
        "blocks": BLOCKS,
        "target_batch_size": 256,
        "initial_peers": [str(a) for a in dht.get_visible_maddrs()],
        **TIMEOUTS,
    }
    peers = {(k, i): Peer({**base, "stage": k}) for k in range(2) for i in range(peers_per_stage)}
    for peer in peers.values():
        peer.wait_ready()
    settings = SwarmSettings(
        run_id=run_id, num_stages=2, compression="8bit", no_peers_timeout=120.0, **TIMEOUTS
    )
    client = SwarmClient(dht, settings)
    trainer = Trainer(client, args.concurrency)
    trainer.start()
    deadline = time.monotonic() + 180  # warm-up: connections open, first steps done (slow on a busy box)
    while len(trainer.done) < 4 * args.concurrency and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(args.warmup)
    t0 = time.monotonic()
    time.sleep(args.phase)
    t1 = time.monotonic()
    downs: list[tuple[float, float]] = []
    victim = (1, 0)
    # the fault phase is whole kill cycles: a kill, the replacement's start-up (the downtime), then three times
    # that downtime up: one peer in four (in the swarm) down a quarter of the time, whatever the start-up costs
    for _ in range(args.cycles):
        killed_at = time.monotonic()
        peers[victim].kill()
        replacement = Peer({**base, "stage": 1})
        replacement.wait_ready()
        peers[victim] = replacement
        back_at = time.monotonic()
        downs.append((killed_at, back_at))
        time.sleep(3 * (back_at - killed_at))
    t2 = time.monotonic()
    trainer.stop()
    stats = client.stats()
    client.shutdown()
    for peer in peers.values():
        peer.stop()
    down = sum(min(b, t2) - a for a, b in downs)
    bins = [(t - t0, trainer.rate(t, t + args.bin)) for t in _frange(t0, t2 - args.bin, args.bin)]
    return {
        "throughput_no_faults": trainer.rate(t0, t1),
        "throughput_with_faults": trainer.rate(t1, t2),
        "kills": len(downs),
        "down_fraction": down / (t2 - t1),
        "downtime_s": [round(b - a, 2) for a, b in downs],
        "retries": stats.get("swarm/retries", 0),
        "failed_microbatches": trainer.errors,
        "series": bins,
        "downs": [(a - t0, b - t0) for a, b in downs],
        "faults_start": t1 - t0,
    }


def _frange(start: float, stop: float, step: float) -> list[float]:
    out, t = [], start
    while t <= stop:
        out.append(t)
        t += step
    return out


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3))
    ax.plot([t for t, _ in r["series"]], [v for _, v in r["series"]], label="swarm samples/s")
    for a, b in r["downs"]:
        ax.axvspan(a, b, color="red", alpha=0.2)
    ax.axvline(r["faults_start"], color="gray", linestyle="--")
    ax.set_ylabel("samples/s")
    ax.set_title(f"swarm: retained {r['retained']:.2f} (one stage-1 server down: shaded)")
    ax.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = _harness.parser(
        "swarm_faults", __doc__.splitlines()[0], quick="short phases (under 5 minutes on 2 cores)"
    )
    parser.add_argument("--concurrency", type=int, default=2, help="microbatches in flight")
    args = parser.parse_args()
    report = _harness.Report("swarm_faults", args.out)
    args.phase = 25.0 if args.quick else 60.0  # the no-fault phase
    args.cycles = 2 if args.quick else 4  # kill cycles in the fault phase
    args.warmup = 2.0 if args.quick else 10.0
    args.bin = 2.0
    die_with_parent()
    quiet_routine_logs()
    torch.set_num_threads(1)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        s = run_swarm(args, dht)
    finally:
        dht.shutdown()
    s["retained"] = s["throughput_with_faults"] / max(s["throughput_no_faults"], 1e-9)
    print(
        f"swarm: {s['throughput_no_faults']:.1f} -> {s['throughput_with_faults']:.1f} samples/s "
        f"(retained {s['retained']:.2f}, {s['kills']} kills, down {s['down_fraction']:.0%})",
        flush=True,
    )
    plot(s, report.png)
    summary = {
        "throughput_no_faults": round(s["throughput_no_faults"], 2),
        "throughput_with_faults": round(s["throughput_with_faults"], 2),
        "retained": round(s["retained"], 3),
        "kills": s["kills"],
        "down_fraction": round(s["down_fraction"], 3),
        "downtime_s": s["downtime_s"],
        "retries": s["retries"],
        "failed_microbatches": s["failed_microbatches"],
        "concurrency": args.concurrency,
        "microbatch": BATCH,
        "width": WIDTH,
        "quick": args.quick,
        "plot": str(report.png),
        "loadavg": os.getloadavg(),
    }
    report.finish(summary)


if __name__ == "__main__":
    main()
