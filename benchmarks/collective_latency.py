"""What one of D-SLIDE's per-step collectives costs over the socket mesh and through gloo, the strategy's two paths.

    python benchmarks/collective_latency.py [--quick]

Two processes, each pinned to its own core with one torch thread (two one-core machines on loopback), run the
pattern of a D-SLIDE step: some compute (a 5 ms busy loop of small matmuls), then an all-reduce of the step's
largest tensor (the hidden activations, 256 x 128 float32: 128 KB), again and again. Three ways to wait, in
interleaved rounds of 100 collectives:

- ``gloo_spin``: ``dist.all_reduce`` (gloo) started with ``async_op=True`` and waited for by spinning on
  ``sched_yield``: what ``DSlideStrategy(collectives="gloo")`` does (``lightning_swarm/layers/distributed.py``
  spins for ``spin_wait`` seconds, far longer than one collective, before it blocks);
- ``mesh``: ``lightning_swarm.layers.mesh.SocketMesh`` (D-SLIDE's default, ``collectives="socket"``), which sends
  and receives on the calling thread and spins while it waits;
- ``gloo_block``: plain ``dist.all_reduce``, the caller blocked until it is done (what a user of
  ``torch.distributed`` gets by default; for reference).

Reported: the mean time of one collective per round (``ms_rounds``) and the median of the rounds (``ms``), per
way. The headline, ``mesh_speedup_vs_gloo_spin`` = gloo_spin / mesh, compares the strategy's two paths;
``mesh_speedup_vs_gloo_block`` = gloo_block / mesh. The last stdout line is one JSON object, also written to
``runs/collective_latency/collective_latency.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import _harness

WAYS = ("gloo_block", "gloo_spin", "mesh")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker(rank: int, port: int, rounds: int, per_round: int) -> None:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, [cores[rank % len(cores)]])
    import torch
    import torch.distributed as dist

    from lightning_swarm.layers.mesh import SocketMesh

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    mesh = SocketMesh(rank, 2, store, "127.0.0.1", timeout_s=60.0, spin_s=0.2)
    x, a = torch.randn(256, 128), torch.randn(512, 512)
    ms: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(rounds):
        for way in WAYS:
            total = 0.0
            for _ in range(per_round):
                start = time.perf_counter()
                while time.perf_counter() - start < 0.005:
                    a @ a[:64].T
                start = time.perf_counter()
                if way == "gloo_block":
                    dist.all_reduce(x)
                elif way == "gloo_spin":
                    work = dist.all_reduce(x, async_op=True)
                    while not work.is_completed():
                        os.sched_yield()
                    work.wait()
                else:
                    mesh.start_all_reduce(x, lambda acc, part: acc.add_(part)).wait()
                total += time.perf_counter() - start
                x.div_(2)  # keep the values bounded
            ms[way].append(round(1000 * total / per_round, 3))
    mesh.close()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(ms), flush=True)


def main() -> None:
    parser = _harness.parser("collective_latency", __doc__, quick="3 rounds instead of 7", raw=True)
    parser.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    per_round = 100
    if args.worker >= 0:
        worker(args.worker, args.port, args.rounds, per_round)
        return
    _harness.exit_on_sigterm()
    report = _harness.Report("collective_latency", args.out)
    rounds = 3 if args.quick else 7
    port = _free_port()
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--port",
        str(port),
        "--rounds",
        str(rounds),
        "--worker",
    ]
    procs = [_harness.popen([*cmd, str(rank)], stdout=subprocess.PIPE, text=True) for rank in range(2)]
    try:
        out, _ = procs[0].communicate(timeout=600)
        procs[1].wait(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                _harness.kill_group(proc)
    if procs[0].returncode or procs[1].returncode:
        raise SystemExit(f"a worker failed (exit codes {procs[0].returncode}, {procs[1].returncode})")
    ms_rounds = json.loads(out.strip().splitlines()[-1])
    ms = {way: round(statistics.median(v), 3) for way, v in ms_rounds.items()}
    report.finish(
        {
            "ms": ms,
            "ms_rounds": ms_rounds,
            "mesh_speedup_vs_gloo_spin": round(ms["gloo_spin"] / ms["mesh"], 2),
            "mesh_speedup_vs_gloo_block": round(ms["gloo_block"] / ms["mesh"], 2),
            "tensor": "256 x 128 float32 (128 KB), all-reduce (sum) of 2 ranks after 5 ms of compute",
            "collectives_per_round": per_round,
            "cpu_count": os.cpu_count(),
        }
    )


if __name__ == "__main__":
    main()
