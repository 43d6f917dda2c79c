"""Batched stage servers: samples/s of several trainers calling one stage peer, with and without batching.

One stage server (this process) hosts a stack of Transformer MLP blocks; ``--trainers`` trainer processes (each
its own DHT node, p2p daemon and ``SwarmClient``) call it as fast as they can, forward + backward of microbatches
of ``--rows`` rows x ``--seq`` tokens, over loopback. Run once with ``max_batch_rows=0`` (batching off) and once
with the default (256), interleaved ``--repeats`` times. The last stdout line is one JSON object: samples/s (rows of
forward + backward completed per second, all trainers together) of each setting, their ratio, and how many
stage computations the batched server ran per request.

``max_batch_rows=1`` is measured too: serving threads and one compute thread, as with batching, but no call is
ever merged (each has more than one row); it tells the effect of merging apart from that of the threads.

Usage: ``python benchmarks/batched_stage.py [--quick] [--trainers 4] [--rows 4] [--seq 32] [--hidden 512]``. The
JSON is also written to ``runs/batched_stage/batched_stage.json`` (``--out``).
"""

from __future__ import annotations

import os
import statistics

import _harness
import hivemind
import torch
from _harness.stage_load import Block, drive
from torch import nn

from lightning_swarm.swarm import StageServer, SwarmSettings

RUN_ID = "batched_stage_bench"


def _run(server_dht: hivemind.DHT, module: nn.Module, args, max_batch_rows: int) -> dict:
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
    samples, grew = drive(
        server,
        server_dht,
        args.trainers,
        {"run_id": RUN_ID, "num_stages": 1, "request_timeout": 60.0, "no_peers_timeout": 60.0},
        (args.rows, args.seq, args.hidden),
        args.warmup,
        args.seconds,
        lambda: {"requests": server.backend.requests_served, "computations": server.backend.computations},
        verbose=args.verbose,
    )
    return {
        "samples_per_s": samples / args.seconds,
        "computations_per_request": grew["computations"] / max(1, grew["requests"]),
    }


def main() -> None:
    parser = _harness.parser(
        "batched_stage", __doc__.split("\n\n")[0], quick="one repeat of 10 s per setting"
    )
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
    report = _harness.Report("batched_stage", args.out)
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
    report.finish(
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


if __name__ == "__main__":
    main()
