"""Kept activations: samples/s of one trainer calling a remote stage peer, with and without ``keep_activations``.

One stage server (this process) hosts a stack of Transformer MLP blocks and steps an Adam optimizer every
``--calls-per-step`` calls (``target_batch_size``); one trainer process (its own DHT node, p2p daemon and
``SwarmClient``) calls it forward + backward as fast as it can, microbatches of ``--rows`` rows x ``--seq`` tokens,
8-bit boundaries, over loopback. Run with ``keep_activations=16`` (the default: the backward reuses the forward's
graph on the same peer) and ``keep_activations=0`` (every backward recomputes the forward), interleaved
``--repeats`` times. A parameter update between a forward and its backward makes that backward recompute, so the
hit rate is about ``1 - 1/calls-per-step`` here.

The last stdout line is one JSON object: samples/s of each setting (medians), their ratio, the share of backwards
that reused a kept forward, and the stage module's runs per forward + backward pair (2.0 when every backward
recomputes its forward, 1.0 when every backward reuses it).

Usage: ``python benchmarks/kept_activations.py [--quick] [--rows 4] [--seq 32] [--hidden 512] [--blocks 4]``. The
JSON is also written to ``runs/kept_activations/kept_activations.json`` (``--out``).
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

RUN_ID = "kept_activations_bench"


def _run(server_dht: hivemind.DHT, module: nn.Module, args, keep: int) -> dict:
    settings = SwarmSettings(
        run_id=RUN_ID,
        num_stages=1,
        target_batch_size=args.rows * args.calls_per_step,
        matchmaking_time=1.0,
        keep_activations=keep,
    )
    server = StageServer(
        0,
        module,
        dht=server_dht,
        settings=settings,
        optimizer_factory=lambda params: torch.optim.Adam(params, lr=1e-5),
        throughput=1.0,
    ).start()
    trainer = {"run_id": RUN_ID, "num_stages": 1, "request_timeout": 60.0, "no_peers_timeout": 60.0}
    samples, grew = drive(
        server,
        server_dht,
        1,
        {**trainer, "keep_activations": keep},
        (args.rows, args.seq, args.hidden),
        args.warmup,
        args.seconds,
        lambda: {
            "requests": server.backend.requests_served,
            "runs": server.backend.computations,
            "hits": server.backend.kept_hits,
        },
    )
    pairs = max(1, grew["requests"] / 2)
    return {
        "samples_per_s": samples / args.seconds,
        "module_runs_per_call": grew["runs"] / pairs,
        "kept_hits_per_backward": grew["hits"] / pairs,
    }


def main() -> None:
    parser = _harness.parser(
        "kept_activations", __doc__.split("\n\n")[0], quick="one repeat of 10 s per setting"
    )
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--calls-per-step", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.repeats = 10.0, 1
    report = _harness.Report("kept_activations", args.out)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = nn.Sequential(*(Block(args.hidden) for _ in range(args.blocks)))
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    runs: dict[int, list[dict]] = {16: [], 0: []}
    try:
        for _ in range(args.repeats):
            for keep in (0, 16):
                runs[keep].append(_run(dht, module, args, keep))
                print(f"keep_activations={keep}", runs[keep][-1], flush=True)
    finally:
        dht.shutdown()

    def median(keep: int, key: str) -> float:
        return statistics.median(r[key] for r in runs[keep])

    report.finish(
        {
            "microbatch": [args.rows, args.seq, args.hidden],
            "blocks": args.blocks,
            "calls_per_optimizer_step": args.calls_per_step,
            "samples_per_s_recompute": round(median(0, "samples_per_s"), 2),
            "samples_per_s_kept": round(median(16, "samples_per_s"), 2),
            "speedup": round(median(16, "samples_per_s") / median(0, "samples_per_s"), 3),
            "module_runs_per_call_recompute": round(median(0, "module_runs_per_call"), 3),
            "module_runs_per_call_kept": round(median(16, "module_runs_per_call"), 3),
            "kept_hits_per_backward": round(median(16, "kept_hits_per_backward"), 3),
            "load_average": os.getloadavg()[0],
            "cpus": os.cpu_count(),
        }
    )


if __name__ == "__main__":
    main()
