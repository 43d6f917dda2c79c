"""Batched stage servers: samples/s of several trainers calling one stage peer, with and without batching.

One stage server (this process) hosts a stack of Transformer MLP blocks; ``--trainers`` trainer processes (each
its own DHT node, p2p daemon and ``SwarmClient``) call it as fast as they can, forward + backward of microbatches
of ``--rows`` rows x ``--seq`` tokens, over loopback. Run once with ``max_batch_rows=0`` (batching off) and once
with the default (256), interleaved ``--repeats`` times. The last stdout line is one JSON object: samples/s (rows of
forward + backward completed per second, all trainers together) of each setting, their ratio, and how many
stage computations the batched server ran per request.

``max_batch_rows=1`` is measured too: serving threads and one compute thread, as with batching, but no call is
ever merged (each has more than one row); it tells the effect of merging apart from that of the threads.

Usage: ``python benchmarks/batched_stage.py [--quick] [--trainers 4] [--rows 4] [--seq 32] [--hidden 512]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import hivemind
import torch
from torch import nn

from lightning_swarm.swarm import StageServer, SwarmClient, SwarmSettings

RUN_ID = "batched_stage_bench"


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def _trainer(maddrs: list[str], args: argparse.Namespace, start: Any, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs)
    settings = SwarmSettings(run_id=RUN_ID, num_stages=1, request_timeout=60.0, no_peers_timeout=60.0)
    client = SwarmClient(dht, settings)
    done: list[float] = []
    results.put("ready")
    start.wait(600)
    start_at = time.time()
    try:
        end = start_at + args.warmup + args.seconds
        while time.time() < end:
            x = torch.randn(args.rows, args.seq, args.hidden, requires_grad=True)
            client.call_stage(0, x).pow(2).mean().backward()
            done.append(time.time())
    finally:
        client.shutdown()
        dht.shutdown()
    window = [t for t in done if start_at + args.warmup <= t < end]
    if args.verbose:
        print(f"trainer: {len(done)} calls, first at {done[0] - start_at if done else None}", flush=True)
    results.put(len(window) * args.rows)


def _run(server_dht: hivemind.DHT, module: nn.Module, args: argparse.Namespace, max_batch_rows: int) -> dict:
    settings = SwarmSettings(
        run_id=RUN_ID, num_stages=1, target_batch_size=10**9, max_batch_rows=max_batch_rows
    )
    server = StageServer(
        0,
        module,
        dht=server_dht,
        settings=settings,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=1e-4),
        throughput=1.0,
    ).start()
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    start = ctx.Event()
    maddrs = [str(m) for m in server_dht.get_visible_maddrs()]
    procs = [ctx.Process(target=_trainer, args=(maddrs, args, start, results)) for _ in range(args.trainers)]
    try:
        for p in procs:
            p.start()
        for _ in procs:  # importing torch and starting a DHT takes a while on a busy machine
            assert results.get(timeout=600) == "ready"
        start.set()
        time.sleep(args.warmup)
        requests0, computations0 = server.requests_served, server.computations
        time.sleep(args.seconds)
        requests, computations = server.requests_served - requests0, server.computations - computations0
        samples = sum(results.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(60)
    finally:
        server.shutdown()
    return {
        "samples_per_s": samples / args.seconds,
        "computations_per_request": computations / max(1, requests),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one repeat of 10 s per setting")
    parser.add_argument("--trainers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.repeats = 10.0, 1
    if args.rows < 2:
        parser.error("--rows must be at least 2 (max_batch_rows=1 must merge nothing)")
    torch.manual_seed(0)
    module = nn.Sequential(*(Block(args.hidden) for _ in range(args.blocks)))
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    # "threads": max_batch_rows=1 serves in several threads and one compute thread but merges nothing (every
    # call has more rows), which separates the effect of merging from that of the serving threads
    runs: dict[str, list[dict]] = {"off": [], "threads": [], "on": []}
    try:
        for _ in range(args.repeats):
            for name, rows in (("off", 0), ("threads", 1), ("on", SwarmSettings().max_batch_rows)):
                runs[name].append(_run(dht, module, args, rows))
                print(name, runs[name][-1], flush=True)
    finally:
        dht.shutdown()
    off, threads, on = (
        statistics.median(r["samples_per_s"] for r in runs[k]) for k in ("off", "threads", "on")
    )
    print(
        json.dumps(
            {
                "trainers": args.trainers,
                "microbatch": [args.rows, args.seq, args.hidden],
                "blocks": args.blocks,
                "samples_per_s_unbatched": round(off, 2),
                "samples_per_s_threads_no_merging": round(threads, 2),
                "samples_per_s_batched": round(on, 2),
                "speedup": round(on / off, 3),
                "speedup_of_merging": round(on / threads, 3),
                "computations_per_request_batched": round(
                    statistics.median(r["computations_per_request"] for r in runs["on"]), 3
                ),
                "load_average": os.getloadavg()[0],
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
