"""Averaging at scale: 4 peers per stage sum their gradients through hivemind at every step, and a peer's memory
stays flat over the run.

One local swarm of 2 stages x 4 peers on 127.0.0.1 (``devices=8``) trains the fidelity matrix's GPT family
(``testbed/families.py``; ``--family``) with ``--trainers`` of its peers feeding batches (the default synchronous
steps: one global step per global batch). ``same_host=False``: the 4 peers of a stage sum each step's gradients in
one all-reduce round of their hivemind gradient averagers (over their p2p daemons), as peers on 4 machines do, not
through this machine's shared memory. Every ``--sample-s`` seconds the benchmark reads the resident memory of each
peer with its helper processes (its DHT's process and p2p daemon, its averagers).

Figures:

- ``stage_steps`` and ``trainer_steps``: every stage stepped once per global step (``stage_steps_equal``);
- ``rounds_per_step``: averaging rounds with the stage's other peers per stage step, the least over the stages
  (target 1.0: every step's gradients were summed with the other peers);
- ``peers_per_stage``: 4; ``steps_per_s``; ``held_out`` (the final model's held-out loss);
- ``pss_mb_after_warmup_and_at_end``: each peer's memory (the proportional set sizes of its process and helpers) at
  the first and the last sample of the window: while peer 0 trains, after its first quarter of steps (set-up,
  warm-up and the end of the run, when helpers exit, are left out); ``rss_growth_mb_per_hour``: the largest slope
  over the peers of a least-squares line through each peer's samples in that window (target <= ``GROWTH_TARGET``:
  hivemind's averager has been reported to grow by gigabytes per hour).

    python benchmarks/swarm_averaging.py [--quick]

Last stdout line: one JSON object; also written, with commit, date and load, to
``runs/swarm_averaging/swarm_averaging.json``. ``--quick``: 300 steps (about 5 minutes on 2 cores); default: 2000
steps (about 25 minutes). Reading the peers' memory costs CPU: ``--sample-s`` sets how often.
"""

from __future__ import annotations

import subprocess
import threading
import time
from typing import Any

import _harness
from _harness.memory import GROWTH_TARGET_MB_PER_HOUR as GROWTH_TARGET
from _harness.memory import descendants, growth_in_window, pss_kb

from testbed.fidelity_job import launch

PEERS_PER_STAGE = 4


def _local_rank(pid: int) -> str | None:
    """The ``LOCAL_RANK`` a process started with: the launcher gives each peer its own, and a peer's helpers (forked,
    or started by it) inherit it. The first peer has none (``"0"``); ``None``: the process is gone."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    return next((v.split(b"=", 1)[1].decode() for v in env if v.startswith(b"LOCAL_RANK=")), "0")


def peer_tree_pss(root: int) -> dict[str, float]:
    """The memory of each peer of the local swarm that ``root`` (peer 0) started, with its helper processes (MB, by
    local rank): proportional set sizes, so that the pages a forked helper shares with its peer count once."""
    pss: dict[str, float] = {}
    for pid in descendants(root):
        rank = _local_rank(pid)
        if rank is not None:
            pss[rank] = pss.get(rank, 0.0) + pss_kb(pid) / 1024.0
    return pss


class Sampler:
    """``run`` for :func:`testbed.fidelity_job.launch`: starts the swarm's first peer and samples the memory of every
    peer every ``period`` seconds until it ends."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.samples: dict[str, list[tuple[float, float]]] = {}

    def __call__(self, cmd: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
        kwargs.pop("capture_output", None)
        proc = _harness.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
        started = time.monotonic()
        out: dict[str, str] = {}

        def drain(name: str, stream: Any) -> None:
            out[name] = stream.read()

        readers = [
            threading.Thread(target=drain, args=(n, s), daemon=True)
            for n, s in (("o", proc.stdout), ("e", proc.stderr))
        ]
        for reader in readers:
            reader.start()
        while proc.poll() is None:
            if time.monotonic() - started > timeout:
                _harness.kill_group(proc)
                break
            now = time.monotonic()  # the clock of time.perf_counter in the peers (CLOCK_MONOTONIC)
            for rank, mb in peer_tree_pss(proc.pid).items():
                if mb > 0:
                    self.samples.setdefault(rank, []).append((now, mb))
            time.sleep(self.period)
        proc.wait()
        for reader in readers:
            reader.join(10)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.get("o", ""), out.get("e", ""))


def main() -> None:
    p = _harness.parser("swarm_averaging", __doc__.split("\n\n")[0], quick="300 steps (about 5 minutes)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 2000; --quick: 300)")
    p.add_argument("--trainers", type=int, default=2, help="peers that also feed batches")
    p.add_argument("--batch", type=int, default=16, help="each trainer's batch")
    p.add_argument("--family", default="gpt", help="the model family (testbed/families.py)")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between memory samples")
    args = p.parse_args()
    args.steps = args.steps or (300 if args.quick else 2000)
    report = _harness.Report("swarm_averaging", args.out)
    settings = {
        "num_stages": 2,
        "num_trainers": args.trainers,
        "same_host": False,
        "target_batch_size": args.trainers * args.batch,
        "matchmaking_time": 1.0,
        "averaging_timeout": 20.0,
        "rebalance_period": 0,
        "run_id": "swarm_averaging",
    }
    cfg = {
        "family": args.family,
        "batch_size": args.batch,
        "steps": args.steps,
        "seed": 0,
        "devices": 2 * PEERS_PER_STAGE,
        "swarm": settings,
    }
    sampler = Sampler(args.sample_s)
    started = time.monotonic()
    result = launch(cfg, timeout=60.0 * 60 * 3, run=sampler)
    seconds = time.monotonic() - started
    stats = result["stats"]
    stage_steps = result["stage_steps"]
    rounds = [stats.get(f"swarm/stage{k}/rounds", 0.0) for k in range(2)]
    # the samples taken while peer 0 trained, after its first quarter (set-up, warm-up and the end excluded)
    starts = result["step_starts"][0]
    first, last = starts[0] + (starts[-1] - starts[0]) / 4, starts[-1]
    by_rank = dict(sorted(sampler.samples.items(), key=lambda item: int(item[0])))
    growth, rss, in_window = growth_in_window(by_rank, first, last)
    worst = max(growth.values()) if growth else None
    trainer_steps = result["trainer_steps"]
    rounds_per_step = (
        min(r / s for r, s in zip(rounds, stage_steps, strict=True)) if all(stage_steps) else 0.0
    )
    report.finish(
        {
            "rounds_per_step": round(rounds_per_step, 3),
            "rss_growth_mb_per_hour": worst,
            "meets_target": rounds_per_step >= 1.0
            and stage_steps == [trainer_steps] * 2
            and worst is not None
            and worst <= GROWTH_TARGET,
            "growth_target_mb_per_hour": GROWTH_TARGET,
            "stage_steps": stage_steps,
            "trainer_steps": trainer_steps,
            "stage_steps_equal": stage_steps == [trainer_steps] * 2,
            "rounds": rounds,
            "peers_per_stage": PEERS_PER_STAGE,
            "peers_sampled": len(sampler.samples),
            "steps_per_s": round((len(starts) - 1) / (starts[-1] - starts[0]), 3),
            "held_out": round(result["held_out"], 4),
            "pss_mb_after_warmup_and_at_end": rss,
            "samples_in_window": min(in_window.values(), default=0),
            "rss_growth_mb_per_hour_by_rank": growth,
            "missed_trainer_steps": stats.get("swarm/missed_trainer_steps"),
            "errors": [
                line for line in result["stderr"].splitlines() if "ERROR" in line or "Traceback" in line
            ][:5],
            "run_s": round(seconds, 1),
            "family": args.family,
            "trainers": args.trainers,
            "batch_per_trainer": args.batch,
            "steps": args.steps,
            "note": "8 peers and their helpers share this box's 2 cores; same_host=False: the stage's peers sum "
            "through hivemind's all-reduce",
        }
    )


if __name__ == "__main__":
    main()
