"""Adaptive rebalancing: a badly placed swarm of peers of unequal speed finds the optimal placement by itself.

Four server-only peers (each its own process, DHT node, p2p daemon and hivemind averagers) serve a 2-stage
pipeline. Their speeds differ: every block sleeps ``cost`` seconds per sample in its forward (sleeping, not
spinning, so that the 2 CPUs of the test box do not decide who is fast), with ``cost`` twice as long on the
slow peers. Speeds in "units" (1 = a slow peer): A=2, B=1, C=1 start on stage 0 and D=2 alone on stage 1, so the
pipeline runs at stage 1's 2 units while the best placement ({A,B} / {C,D}, or {A,C} / {B,D}) runs at 3. A slow
peer's block sleeps ``UNIT_COST`` = 0.1 s per sample, slow enough that the peers' speeds, not the trainer in this
process or the 2 CPUs, decide the pipeline's rate (with 0.02 s both placements ran at the trainer's ~23 samples/s).

A trainer in this process keeps ``--inflight`` microbatches in flight through the swarm (forward and backward
through both stages, throughput-weighted routing) and counts the samples that complete, over time:

1. ``rebalancing``: the bad placement with rebalancing on (a check every ``--period`` s on average); the peers
   measure their speeds from the trainer's calls, and the policy moves B or C to stage 1;
2. ``initial``: a fresh swarm in the bad placement, rebalancing off, the same trainer;
3. ``optimal``: a fresh swarm placed optimally from the start, rebalancing off, the same trainer.

Every placement is measured in steady state: a fresh swarm's routers first learn the peers' speeds (about 20 s).

Usage: ``python benchmarks/swarm_rebalance.py [--quick]``. The last stdout line is one JSON object with
``throughput_initial`` (the bad placement from 20 s on), ``throughput_rebalanced`` (after the placement has
settled, and not before 20 s), ``throughput_optimal`` (from 20 s on), ``throughput_before_first_move`` (the
rebalancing run before its first move, routers still learning: for information), ``optimal_over_initial`` (the speed model binds: target >= 1.3),
``speedup_from_rebalancing`` (rebalanced / initial; target >= 1.3) and ``fraction_of_optimal`` (rebalanced /
optimal; target 0.9-1.1), ``meets_target``, the moves and placements seen, and the load average; it is also written to ``runs/swarm_rebalance/swarm_rebalance.json``, with
``swarm_rebalance.png`` (throughput over time) next to it (``--out``).
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
import torch
from torch import nn

WIDTH = 32
BATCH = 4
UNIT_COST = 0.1  # seconds per sample per block on a slow peer (2 blocks per stage): slow 5 samples/s


class Delay(nn.Module):
    """Sleeps ``cost`` seconds per sample: a peer's speed, set per process."""

    def __init__(self) -> None:
        super().__init__()
        self.cost = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.cost * x.shape[0])
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), Delay()) for _ in range(4))
        )


def _settings(run_id: str, **changes):
    from lightning_swarm.swarm import SwarmSettings

    return SwarmSettings(
        pipeline="layers",
        num_stages=2,
        compression="none",
        target_batch_size=10**9,  # no averaging rounds: this measures placement, not averaging
        run_id=run_id,
        request_timeout=30.0,  # calls queue at the bottleneck stage for seconds: that is not a hang
        no_peers_timeout=30.0,
        announce_period=1.0,
        expiration=6.0,
        refresh_period=1.0,
        ban_base_s=1.0,
        **changes,
    )


def worker(spec: dict) -> None:
    """One server-only peer: serve ``spec['stage']`` at ``spec['speed']`` units until SIGTERM."""
    from lightning_swarm.swarm import SwarmPeer

    torch.manual_seed(0)
    model = Net()
    for m in model.modules():
        if isinstance(m, Delay):
            m.cost = UNIT_COST / spec["speed"]
    settings = _settings(
        spec["run_id"],
        role="server",
        stage=spec["stage"],
        rebalance_period=spec["period"],
        initial_peers=tuple(spec["initial_peers"]),
    )
    peer = SwarmPeer(settings)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    peer.start_dht()
    try:
        peer.join(model, [torch.optim.SGD(model.parameters(), lr=0.01)], training=True)
        print("MADDRS " + " ".join(str(a) for a in peer.dht.get_visible_maddrs()), flush=True)
        stop.wait()
    finally:
        moves = [[m.src, m.dst, round(m.before, 1), round(m.after, 1)] for m in peer.host.migrations]
        served = peer.server.backend.samples_processed if peer.server is not None else None
        stage = peer.stage
        peer.shutdown()
        print("MOVES " + json.dumps(moves), flush=True)
        print(
            "SERVED " + json.dumps([stage, served]), flush=True
        )  # backward samples served on its last stage


def _start(run_id: str, name: str, stage: int, speed: float, period: float, initial: list[str]):
    spec = {"run_id": run_id, "stage": stage, "speed": speed, "period": period, "initial_peers": initial}
    proc = _harness.popen(
        [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
        stdout=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("MADDRS "):
            return proc, line.split()[1:]
        if not line and proc.poll() is not None:
            break
    _harness.kill_group(proc)
    raise RuntimeError(f"peer {name} did not start (exit code {proc.poll()})")


def run_swarm(
    placement: dict[str, tuple[int, float]],
    period: float,
    duration: float,
    inflight: int,
    tag: str,
    settled: list[int] | None = None,
    tail: float = 0.0,
):
    """Start the peers, drive the pipeline for ``duration`` s, or longer: until ``tail`` s after the placement
    first becomes ``settled`` (at most twice ``duration``); returns completion times, placements seen, failed
    calls, moves and the seconds driven."""
    import hivemind

    from lightning_swarm.swarm import SwarmClient
    from lightning_swarm.swarm.dht.records import get_stage_peers

    run_id = f"rebalance-{tag}-{os.getpid()}"
    procs: dict[str, subprocess.Popen] = {}
    initial: list[str] = []
    moves: dict[str, list] = {}
    served: dict[str, list | None] = {}
    try:
        for name, (stage, speed) in placement.items():
            proc, maddrs = _start(run_id, name, stage, speed, period, initial)
            procs[name] = proc
            initial = initial or maddrs
        dht = hivemind.DHT(start=True, initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        # whole calls, routed by throughput: the 12 microbatches in flight already keep the stages busy; chunking a
        # call over every peer of a stage ("auto") would make each call wait for the stage's slowest peer
        client = SwarmClient(dht, _settings(run_id, microbatches=1))
        done: list[float] = []
        stop = threading.Event()
        errors: list[BaseException] = []

        def drive() -> None:
            while not stop.is_set():
                try:
                    x = torch.randn(BATCH, WIDTH, requires_grad=True)
                    y = client.call_stage(1, client.call_stage(0, x))
                    y.sum().backward()
                    done.append(time.monotonic())
                except Exception as e:  # counted; the run goes on
                    errors.append(e)
                    time.sleep(0.5)

        start = time.monotonic()
        threads = [threading.Thread(target=drive, daemon=True) for _ in range(inflight)]
        for t in threads:
            t.start()
        placements: list[tuple[float, list[int]]] = []
        end = duration
        while time.monotonic() - start < end:
            counts = [len(get_stage_peers(dht, run_id, k)) for k in range(2)]
            now = time.monotonic() - start
            if not placements or placements[-1][1] != counts:
                placements.append((round(now, 1), counts))
                if counts == settled:  # a late move still leaves a full window to measure after it
                    end = min(max(end, now + tail), 2 * duration)
            time.sleep(0.5)
        driven = time.monotonic() - start
        stop.set()
        for t in threads:
            t.join(timeout=30)
        client.shutdown()
        dht.shutdown()
        return [t - start for t in done], placements, len(errors), moves, driven, served
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for name, proc in procs.items():
            try:
                out, _ = proc.communicate(timeout=60)
                moves[name] = [json.loads(line[6:]) for line in out.splitlines() if line.startswith("MOVES ")]
                served[name] = next(
                    (json.loads(line[7:]) for line in out.splitlines() if line.startswith("SERVED ")), None
                )
            except subprocess.TimeoutExpired:
                _harness.kill_group(proc)


def rate(times: list[float], lo: float, hi: float) -> float:
    """Samples per second completed in [lo, hi)."""
    return BATCH * sum(lo <= t < hi for t in times) / max(hi - lo, 1e-9)


def main() -> None:
    parser = _harness.parser(
        "swarm_rebalance", __doc__.split("\n\n")[0], quick="shorter runs (under 5 minutes)"
    )
    parser.add_argument("--period", type=float, default=None, help="mean seconds between rebalancing checks")
    parser.add_argument("--inflight", type=int, default=12, help="microbatches the trainer keeps in flight")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    report = _harness.Report("swarm_rebalance", args.out)
    period = args.period or (12.0 if args.quick else 20.0)
    duration = 50.0 if args.quick else 120.0
    warmup = 3.0
    # speeds in units (slow = 1): the bad placement and the best one
    bad = {"A": (0, 2.0), "B": (0, 1.0), "C": (0, 1.0), "D": (1, 2.0)}
    best = {"A": (0, 2.0), "B": (0, 1.0), "C": (1, 1.0), "D": (1, 2.0)}

    tail = 20.0 if args.quick else 40.0  # seconds measured after the placement has settled (+5 s to adapt)
    times, placements, errors, moves, driven, served = run_swarm(
        bad, period, duration, args.inflight, "bad", settled=[2, 2], tail=tail + 5.0
    )
    first_move = next((t for t, c in placements if c != [3, 1]), driven)
    settled = next((t for t, c in placements if c == [2, 2]), None)
    final = placements[-1][1]
    throughput_before_first_move = rate(times, warmup, max(first_move, warmup + 1.0))
    # a fresh swarm's routers first learn the peers' speeds from their calls (its first 20 s ran at 3-10 samples/s
    # in 5 s bins, then 11-17): every placement is measured in steady state, from 20 s on
    opt_warm = 20.0
    after = max((settled if settled is not None else driven) + 5.0, opt_warm)
    throughput_rebalanced = rate(times, after, driven) if after < driven - 2 else 0.0

    # the two fixed placements, rebalancing off, each measured from 20 s on for as long as the rebalanced swarm's
    # window (tail + 5 s): the bad one is the baseline of `speedup_from_rebalancing` (before the first move the
    # rebalancing run is still learning the peers' speeds, which would flatter the speedup)
    optimal_duration = opt_warm + tail + 5.0
    init_times, _, init_errors, _, _, init_served = run_swarm(
        bad, 0.0, optimal_duration, args.inflight, "bad_fixed"
    )
    throughput_initial = rate(init_times, opt_warm, optimal_duration)
    opt_times, opt_placements, opt_errors, _, _, opt_served = run_swarm(
        best, 0.0, optimal_duration, args.inflight, "best"
    )
    throughput_optimal = rate(opt_times, opt_warm, optimal_duration)

    plot = report.png
    _plot(times, opt_times, placements, driven, optimal_duration, plot)
    result = {
        "throughput_initial": round(throughput_initial, 2),
        "throughput_before_first_move": round(throughput_before_first_move, 2),
        "throughput_rebalanced": round(throughput_rebalanced, 2),
        "throughput_optimal": round(throughput_optimal, 2),
        "fraction_of_optimal": round(throughput_rebalanced / throughput_optimal, 3)
        if throughput_optimal
        else 0.0,
        "speedup_from_rebalancing": round(throughput_rebalanced / throughput_initial, 3)
        if throughput_initial
        else 0.0,
        # the speed model binds: the best placement is measurably faster than the bad one (the trainer and the
        # CPUs do not cap both at the same rate)
        "optimal_over_initial": round(throughput_optimal / throughput_initial, 3)
        if throughput_initial
        else 0.0,
        "model_units": {"initial": 2, "optimal": 3},
        "first_move_s": first_move,
        "settled_s": settled,
        "final_placement": final,
        "moves": {name: m[0] if m else [] for name, m in moves.items()},  # [src, dst, before, after] per peer
        "placements": placements,
        # [stage, backward samples served there] per peer at the end: where the trainer's calls went
        "served": served,
        "initial_served": init_served,
        "optimal_served": opt_served,
        "optimal_placements": opt_placements,
        "failed_calls": errors + init_errors + opt_errors,
        "rebalance_period_s": period,
        "duration_s": round(driven, 1),
        "inflight": args.inflight,
        "unit_cost_s_per_sample_per_block": UNIT_COST,
        "loadavg": os.getloadavg(),
        "plot": str(plot),
    }
    result["meets_target"] = (
        result["optimal_over_initial"] >= 1.3
        and result["speedup_from_rebalancing"] >= 1.3
        and 0.9 <= result["fraction_of_optimal"] <= 1.1
    )
    report.finish(result)


def _plot(times, opt_times, placements, duration, optimal_duration, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(ts: list[float], end: float, window: float = 2.0):
        xs = [i * 1.0 for i in range(int(end))]
        return xs, [rate(ts, max(0.0, x - window), x) if x > 0 else 0.0 for x in xs]

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(*series(times, duration), label="bad placement, rebalancing on")
    ax.plot(*series(opt_times, optimal_duration), label="optimal placement", linestyle="--")
    for t, counts in placements[1:]:
        ax.axvline(t, color="grey", linewidth=0.8)
        ax.text(t, ax.get_ylim()[1] * 0.95, f"{counts[0]}/{counts[1]}", fontsize=8)
    ax.set_xlabel("seconds")
    ax.set_ylabel("samples/s (2 s window)")
    ax.set_title("SWARM adaptive rebalancing: 4 peers of speeds 2,1,1 | 2 -> 2,1 | 1,2")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
