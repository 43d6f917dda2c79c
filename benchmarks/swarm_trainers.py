"""Does throughput survive fidelity? Several trainers feeding one swarm, synchronous steps against asynchronous.

One swarm of 2 stages x 2 peers on 127.0.0.1 (``devices=4``; the first K peers also train: ``num_trainers=K``) trains
the fidelity matrix's ALBERT family (``testbed/families.py``; ``--family``), each trainer with the same batch, for
K = 1, 2 and 4:

- ``sync``: ``stage_steps="trainer"``, the default: one global step per global batch (K batches), as DDP's ranks
  (the trainers' own gradients averaged through the step's leader, the stages stepped once by it);
- ``async``: ``stage_steps="async"``: each trainer steps its own parameters every batch and the stages step every
  ``target_batch_size`` samples (K batches, the same global batch) through hivemind's optimizer, without waiting.

A run's throughput is the samples its trainers train while all of them train (from the last trainer's ``--warm``-th
batch to the first trainer's end; the swarm's start-up excluded) over that window's length. ``overlap``: that
window's share of the whole run; ``samples_per_s_per_trainer_sum``: the sum of each trainer's own rate over its own
time, which counts as concurrent what ran one after another. ``sync_vs_async`` is the
synchronous mode's samples/s over the asynchronous mode's at the same K (target >= 0.9 at 2 and at 4 trainers).
The modes alternate within each K, so the box's drift falls on both alike.

    python benchmarks/swarm_trainers.py [--quick]

Last stdout line: one JSON object; also written, with commit, date and load, to
``runs/swarm_trainers/swarm_trainers.json``. ``--quick``: 30 steps per run (under 5 minutes on 2 cores); default: 80
steps, each pair twice.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from typing import Any

import _harness

from testbed.fidelity_job import launch

TARGET = 0.9


def samples_per_s(result: dict[str, Any], batch: int, warm: int) -> float:
    """The run's samples per second while all its trainers train: the samples of every trainer's batches in the
    window from the last trainer's ``warm``-th batch to the first trainer's end, over the window's length (a batch
    that straddles an edge counts for its share inside). Trainers start and end at different times; summing each
    trainer's own rate over its own time would count as concurrent what ran one after another (asynchronous
    trainers, which never wait for each other, drift the most)."""
    runs = list(result["step_starts"].values())
    first, last = max(starts[warm] for starts in runs), min(starts[-1] for starts in runs)
    if last <= first:
        raise RuntimeError(
            f"the trainers never trained at the same time (after {warm} batches): nothing to clock"
        )
    batches = 0.0
    for starts in runs:
        for begin, end in itertools.pairwise(starts):
            inside = min(end, last) - max(begin, first)
            if inside > 0:
                batches += inside / (end - begin)
    return batches * batch / (last - first)


def samples_per_s_per_trainer_sum(result: dict[str, Any], batch: int, warm: int) -> float:
    """The sum over the run's trainers of each one's samples per second after ``warm`` batches, each over its own
    time (for comparison with :func:`samples_per_s`)."""
    total = 0.0
    for starts in result["step_starts"].values():
        steps = len(starts) - 1 - warm
        total += steps * batch / (starts[-1] - starts[warm])
    return total


def overlap(result: dict[str, Any], warm: int) -> float:
    """The common window's share of the span from the first trainer's ``warm``-th batch to the last one's end."""
    runs = list(result["step_starts"].values())
    span = max(starts[-1] for starts in runs) - min(starts[warm] for starts in runs)
    common = min(starts[-1] for starts in runs) - max(starts[warm] for starts in runs)
    return max(common, 0.0) / span


def one_run(trainers: int, mode: str, args: Any) -> dict[str, Any]:
    settings = {
        "num_stages": 2,
        "num_trainers": trainers,
        "stage_steps": mode,
        "target_batch_size": trainers * args.batch,
        "matchmaking_time": 1.0,
        "averaging_timeout": 10.0,
        "rebalance_period": 0,
        "run_id": f"swarm_trainers_{trainers}_{mode}_{os.getpid()}",
    }
    cfg = {
        "family": args.family,
        "batch_size": args.batch,
        "steps": args.steps,
        "seed": 0,
        "devices": 4,
        "swarm": settings,
    }
    started = time.monotonic()
    result = launch(cfg, timeout=args.timeout)
    return {
        "samples_per_s": round(samples_per_s(result, args.batch, args.warm), 1),
        "samples_per_s_per_trainer_sum": round(
            samples_per_s_per_trainer_sum(result, args.batch, args.warm), 1
        ),
        "overlap": round(overlap(result, args.warm), 3),
        "trainers_clocked": len(result["step_starts"]),
        "held_out": round(result["held_out"], 4),
        "stage_steps": result["stage_steps"],
        "seconds": round(time.monotonic() - started, 1),
    }


def main() -> None:
    p = _harness.parser("swarm_trainers", __doc__.split("\n\n")[0], quick="30 steps per run, one pair per K")
    p.add_argument(
        "--steps", type=int, default=None, help="optimizer steps per run (default 80; --quick: 30)"
    )
    p.add_argument("--batch", type=int, default=16, help="each trainer's batch")
    p.add_argument("--warm", type=int, default=5, help="batches not clocked at the start of a run")
    p.add_argument("--pairs", type=int, default=None, help="sync/async pairs per K (default 2; --quick: 1)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument(
        "--family",
        default="albert",
        help="the model family (testbed/families.py); one without gradient clipping, which the async mode refuses",
    )
    args = p.parse_args()
    args.steps = args.steps or (30 if args.quick else 80)
    args.pairs = args.pairs or (1 if args.quick else 2)
    report = _harness.Report("swarm_trainers", args.out)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for k in (1, 2, 4):
        runs[str(k)] = {"sync": [], "async": []}
        for pair in range(args.pairs):
            order = ("trainer", "async") if pair % 2 == 0 else ("async", "trainer")
            for mode in order:
                if k == 1 and mode == "async":
                    continue  # one trainer: the asynchronous mode is for several
                runs[str(k)]["sync" if mode == "trainer" else "async"].append(one_run(k, mode, args))
    figures: dict[str, Any] = {"samples_per_s": {}, "sync_vs_async": {}}
    for k, by_mode in runs.items():
        means = {m: statistics.mean(r["samples_per_s"] for r in rs) for m, rs in by_mode.items() if rs}
        figures["samples_per_s"][k] = {m: round(v, 1) for m, v in means.items()}
        if "async" in means:
            figures["sync_vs_async"][k] = round(means["sync"] / means["async"], 3)
    ratios = [figures["sync_vs_async"][k] for k in ("2", "4")]
    report.finish(
        {
            "sync_vs_async_2": figures["sync_vs_async"]["2"],
            "sync_vs_async_4": figures["sync_vs_async"]["4"],
            "meets_target": all(r >= TARGET for r in ratios),
            "target": TARGET,
            **figures,
            "runs": runs,
            "steps": args.steps,
            "batch_per_trainer": args.batch,
            "family": args.family,
            "warm": args.warm,
            "pairs": args.pairs,
        }
    )


if __name__ == "__main__":
    main()
