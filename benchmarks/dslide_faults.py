"""A D-SLIDE job of 4 ranks with one rank SIGKILLed every N steps, against the same job uninterrupted.

    python benchmarks/dslide_faults.py [--quick]

The job is ``testbed/dslide_fault_job.py``: ``Trainer(strategy=DSlideStrategy(checkpoint_every_n_steps=K,
max_restarts=...), devices=4)`` on synthetic Amazon-670K-shaped data (``--width wide``: 20,000 features -> 64 ReLU
-> 20,000 labels, batch 64; ``small`` with ``--quick``: 300 -> 16 -> 400, batch 16), one torch thread per rank, all
ranks on this box's cores over loopback. In the job's restart ``r``, a rank sends itself SIGKILL at the start of
step ``(r + 1) x N``: rank 2, then rank 0 (which hosts the rendezvous store), in turn (``--kill-ranks 2,0``); the
strategy's supervisor (the process started) kills what is left of the job and starts it again, and every rank
resumes from the last sharded checkpoint (each rank wrote its own rows). What a user of plain Lightning would do
instead is the same by hand: notice, restart, pass ``ckpt_path``.

Three runs, one after the other: ``killed`` (the kills), ``uninterrupted`` (the same 4-rank job, no kill) and
``single`` (one plain process: the network D-SLIDE must equal). Figures:

- ``completed``: the killed job reached ``max_steps`` (target true); ``kills`` and ``restarts``;
- ``steps_redone``: steps trained twice, summed over the kills (each at most K), and ``steps_redone_per_kill``;
- ``time_lost_per_kill_s``: (``fit`` wall time of the killed job - the uninterrupted one's) / kills, from the first
  start to the end of ``fit``; ``down_s_per_kill``: from a kill to training again (the job's own record: killing the
  rest, a new interpreter per rank, imports, rendezvous, the checkpoint's load), each kill;
- ``p_at_1_killed``, ``p_at_1_uninterrupted``, ``p_at_1_single`` (on ``held_out`` synthetic points) and
  ``max_abs_param_diff_vs_single`` of the killed job (the resumed epoch skips the batches it had trained on, and
  its tables rebuild at the same steps: it should equal the single process up to float rounding, as the
  uninterrupted job does, ``max_abs_param_diff_uninterrupted_vs_single``).

The last stdout line is one JSON object, also written to ``runs/dslide_faults/dslide_faults.json`` (``--out``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import _harness

JOB = _harness.ROOT / "testbed" / "dslide_fault_job.py"


def run_job(
    name: str,
    tmp: Path,
    ranks: int,
    steps: int,
    every: int,
    kills: list[int],
    width: str,
    kill_ranks: str = "2",
) -> dict:
    out = tmp / name
    cmd = [sys.executable, str(JOB), "--out", str(out), "--ranks", str(ranks), "--steps", str(steps)]
    cmd += ["--every", str(every), "--kill-rank", kill_ranks, "--kill-steps", ",".join(map(str, kills))]
    cmd += ["--max-restarts", str(len(kills) + 1), "--width", width]
    with _harness.Launcher(tmp / "logs", what=f"{name}: ") as launcher:
        launcher.start(name, cmd, env={"PYTHONWARNINGS": "ignore", "PYTHONPATH": str(_harness.ROOT)})
        launcher.wait(3000)
    result = json.loads((out / "result.json").read_text())
    result["final"] = out / "final.ckpt"
    return result


def max_abs_diff(a: Path, b: Path) -> float:
    import torch

    x = torch.load(a, weights_only=True, map_location="cpu")["state_dict"]
    y = torch.load(b, weights_only=True, map_location="cpu")["state_dict"]
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in y if y[k].is_floating_point())


def main() -> None:
    parser = _harness.parser("dslide_faults", __doc__, quick="the small network, 40 steps, 2 kills", raw=True)
    parser.add_argument(
        "--width", choices=["small", "wide"], default=None, help="default: wide (small: --quick)"
    )
    parser.add_argument("--steps", type=int, default=None, help="default 120 (40 with --quick)")
    parser.add_argument(
        "--every", type=int, default=None, help="K: steps between checkpoints (default 10; 5)"
    )
    parser.add_argument(
        "--kill-every", type=int, default=None, help="N: steps between kills (default 35; 14)"
    )
    parser.add_argument(
        "--kill-ranks",
        default="2,0",
        help="the ranks killed, in turn (default 2,0: rank 0 hosts the rendezvous)",
    )
    args = parser.parse_args()
    _harness.exit_on_sigterm()
    report = _harness.Report("dslide_faults", args.out)
    width = args.width or ("small" if args.quick else "wide")
    steps = args.steps or (40 if args.quick else 120)
    every = args.every or (5 if args.quick else 10)
    kill_every = args.kill_every or (14 if args.quick else 35)
    kills = list(range(kill_every, steps, kill_every))
    with tempfile.TemporaryDirectory(prefix="dslide_faults_") as name:
        tmp = Path(name)
        killed = run_job("killed", tmp, 4, steps, every, kills, width, args.kill_ranks)
        uninterrupted = run_job("uninterrupted", tmp, 4, steps, every, [], width)
        single = run_job("single", tmp, 1, steps, every, [], width)
        diff_killed = max_abs_diff(killed["final"], single["final"])
        diff_uninterrupted = max_abs_diff(uninterrupted["final"], single["final"])
    lost = [r for r in killed["restarts"] if "steps_redone" in r]
    back = [r for r in killed["restarts"] if "down_s" in r]
    redone = [r["steps_redone"] for r in lost]
    summary: dict[str, Any] = {
        "completed": killed["global_step"] == steps,
        "kills": len(kills),
        "restarts": len(lost),
        "steps_redone": sum(redone),
        "steps_redone_per_kill": redone,
        "checkpoint_every_n_steps": every,
        "time_lost_per_kill_s": round((killed["fit_s"] - uninterrupted["fit_s"]) / max(1, len(lost)), 1),
        "down_s_per_kill": [r["down_s"] for r in back],
        "fit_s_killed": killed["fit_s"],
        "fit_s_uninterrupted": uninterrupted["fit_s"],
        "p_at_1_killed": round(killed["p_at_1"], 4),
        "p_at_1_uninterrupted": round(uninterrupted["p_at_1"], 4),
        "p_at_1_single": round(single["p_at_1"], 4),
        "held_out": killed["held_out"],
        "max_abs_param_diff_vs_single": diff_killed,
        "max_abs_param_diff_uninterrupted_vs_single": diff_uninterrupted,
        "killed_at_steps": kills,
        "killed_ranks": [
            int(args.kill_ranks.split(",")[i % len(args.kill_ranks.split(","))]) for i in range(len(kills))
        ],
        "lost": [r["lost"] for r in lost],
        "ranks": 4,
        "steps": steps,
        "width": width,
        "quick": args.quick,
        "threads_per_rank": 1,
        "cpu_cores": os.cpu_count(),
    }
    report.finish(summary)


if __name__ == "__main__":
    main()
