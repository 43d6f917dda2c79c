"""Does a swarm train every kind of model as one process does? The fidelity matrix of issue 23.

Each model family of ``examples/families.py`` (a GPT decoder with a float causal mask and weight tying; a ViT with
cls token and position embedding on the trainer; an encoder over padded sequences with dropout 0.1, a linear LR
warm-up and gradient clipping at norm 1; a CNN with BatchNorm; ALBERT) trains twice from the same seed, data,
global batch and number of optimizer steps:

- in one plain Lightning process;
- in a local swarm of 2 peer processes on 127.0.0.1 (``Trainer(strategy=SwarmStrategy(...), devices=2)``): one
  trainer, 2 stages, the default 8-bit boundaries. ``target_batch_size`` is the global batch (with one trainer
  the stages step with its optimizer, and a ``--target-batch-size`` other than the batch is refused at setup),
  and the timeouts are short so that a run that fails ends in seconds (one peer per stage: no averaging partner).

Both runs validate every quarter of the run (through the swarm in the swarm run) and end with the held-out loss
of the final model, computed in the trainer's process in eval mode (``held_out_loss``). The gap of a family is
``|held_out_swarm - held_out_single| / held_out_single``; ``parameter_gaps`` adds the distance between the two
trained pipelines' parameters over the distance training moved the single-process one's (``buffer_gaps``: the
same for BatchNorm's running statistics; see ``fidelity_job.parameter_gap``). ``seed_gaps`` is the noise floor:
the same relative gap between two single-process runs that differ only in the seed (initialisation and dropout
masks): the scale against which a gap is read.
A family whose swarm run fails has ``null`` gaps and its error in ``failed``; ``max_relative_gap`` is then
``null`` too (``max_relative_gap_completed`` covers the others).

    python benchmarks/fidelity_matrix.py [--quick] [--families vit,cnn]

Last stdout line: one JSON object with ``families``, ``max_relative_gap``, ``gaps``, ``stage_steps_equal``,
``held_out_single``, ``held_out_swarm``, ``stage_steps``, ``trainer_steps``, ... (targets: gap <= 0.02, stage
steps equal). Also written, with commit, date and load average, to ``runs/fidelity_matrix/fidelity_matrix.json``
(``--out``), and the loss curves to ``runs/fidelity_matrix/loss_curves.png``. ``--quick``: 40 steps of batch 32 (under 5
minutes on 2 idle cores); default: 200 steps of batch 64 (issue 23's ViT report).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import _harness

from examples.albert.plot import smooth
from examples.families import FAMILIES
from examples.fidelity_job import buffer_gap, launch, parameter_gap, run

TARGET_GAP = 0.02
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w]*\.)*[A-Za-z_]\w*(Error|Exception|Interrupt): ")


def swarm_settings(family: str, target_batch_size: int, compression: str) -> dict[str, Any]:
    return {
        "num_stages": 2,
        "num_trainers": 1,
        "compression": compression,
        "target_batch_size": target_batch_size,
        "no_peers_timeout": 20.0,
        "request_timeout": 20.0,
        "linger_timeout": 30.0,
        "matchmaking_time": 1.0,
        "averaging_timeout": 5.0,
        "run_id": f"fidelity_matrix_{family}_{os.getpid()}",
    }


def compare(family: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``family`` in one process and in a swarm; the figures of both."""
    cfg = {
        "family": family,
        "batch_size": args.batch,
        "steps": args.steps,
        "seed": args.seed,
        "val_every": max(1, args.steps // 4),
    }
    started = time.monotonic()
    single = run(cfg)
    assert single is not None
    single_s = time.monotonic() - started
    # the noise floor: one process again, another seed (initialisation and dropout), same data and schedule
    other_seed = run({**cfg, "seed": args.seed + 1})
    assert other_seed is not None
    started = time.monotonic()
    target = args.target_batch_size or args.batch
    out: dict[str, Any] = {"single": single, "single_s": single_s, "other_seed": other_seed}
    try:
        out["swarm"] = launch(
            {**cfg, "devices": 2, "swarm": swarm_settings(family, target, args.compression)},
            timeout=args.timeout,
        )
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        lines = [line for line in str(e).splitlines() if line.strip()]
        # the first "pkg.SomeError: message" line is the cause; later ones come from the run's shutdown
        causes = [line.strip() for line in lines if _EXCEPTION_LINE.match(line.strip())]
        out["error"] = causes[0] if causes else (lines[-1] if lines else repr(e))
    out["swarm_s"] = time.monotonic() - started
    return out


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Training loss (smoothed) and validation loss per optimizer step of both runs of every family, with the
    held-out loss at the end as a marker; one panel per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    rows = -(-len(results) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, (family, r) in zip(axes.flat, results.items(), strict=False):
        runs = {"one process": r["single"], "swarm": r.get("swarm")}
        for i, (name, h) in enumerate(runs.items()):
            if h is None:
                continue
            color = f"C{i}"
            steps = list(range(1, len(h["loss"]) + 1))
            ax.plot(steps, smooth(h["loss"], 5), color=color, alpha=0.9, label=f"{name}: train")
            if h["val"]:
                vs, vl = zip(*h["val"], strict=True)
                ax.plot(vs, vl, "o--", color=color, ms=3, alpha=0.7, label=f"{name}: validation")
            ax.plot(
                [steps[-1]],
                [h["held_out"]],
                "*",
                color=color,
                ms=11,
                label=f"{name}: held-out {h['held_out']:.3f}",
            )
        title = family if "error" not in r else f"{family} (swarm failed)"
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(results) :]:
        ax.axis("off")
    fig.suptitle(
        "Fidelity matrix: swarm (1 trainer, 2 stages, 8-bit) vs one process, same seed, data, batch, steps"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = _harness.parser(
        "fidelity_matrix",
        __doc__.split("\n\n")[0],
        quick="40 steps of batch 32 (under 5 minutes on 2 cores)",
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 200; --quick: 40)")
    p.add_argument("--batch", type=int, default=None, help="global batch (default 64; --quick: 32)")
    p.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated subset of {FAMILIES}")
    p.add_argument("--compression", default="8bit", choices=["8bit", "fp16", "none"])
    p.add_argument(
        "--target-batch-size",
        type=int,
        default=None,
        help="the stages' target_batch_size (default: the batch)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one swarm run may take")
    args = p.parse_args()
    args.steps = args.steps or (40 if args.quick else 200)
    args.batch = args.batch or (32 if args.quick else 64)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        p.error(f"unknown families {unknown}; choose from {FAMILIES}")

    report = _harness.Report("fidelity_matrix", args.out)
    started = time.monotonic()
    results = {family: compare(family, args) for family in families}
    png = report.path("loss_curves.png")
    plot(results, png)

    gaps: dict[str, float | None] = {}
    parameter_gaps: dict[str, float | None] = {}
    buffer_gaps: dict[str, float | None] = {}
    held_single: dict[str, float] = {}
    seed_gaps: dict[str, float] = {}
    held_swarm: dict[str, float | None] = {}
    stage_steps: dict[str, list[int] | None] = {}
    trainer_steps: dict[str, int | None] = {}
    last_val_swarm: dict[str, float | None] = {}
    seconds: dict[str, dict[str, float]] = {}
    failed: dict[str, str] = {}
    for family, r in results.items():
        single, swarm = r["single"], r.get("swarm")
        held_single[family] = round(single["held_out"], 4)
        seed_gaps[family] = round(
            abs(r["other_seed"]["held_out"] - single["held_out"]) / single["held_out"], 4
        )
        seconds[family] = {"single": round(r["single_s"], 1), "swarm": round(r["swarm_s"], 1)}
        if swarm is None:
            failed[family] = r["error"]
            gaps[family] = parameter_gaps[family] = buffer_gaps[family] = None
            held_swarm[family] = last_val_swarm[family] = None
            stage_steps[family] = trainer_steps[family] = None
            continue
        gaps[family] = round(abs(swarm["held_out"] - single["held_out"]) / single["held_out"], 4)
        parameter_gaps[family] = round(parameter_gap(single, swarm), 4)
        buffers = buffer_gap(single, swarm)
        buffer_gaps[family] = None if buffers is None else round(buffers, 4)
        held_swarm[family] = round(swarm["held_out"], 4)
        stage_steps[family] = swarm["stage_steps"]
        trainer_steps[family] = swarm["trainer_steps"]
        last_val_swarm[family] = round(swarm["val"][-1][1], 4) if swarm["val"] else None
    completed = [g for g in gaps.values() if g is not None]
    steps_equal = all(
        s is not None and all(k == trainer_steps[f] == args.steps for k in s) for f, s in stage_steps.items()
    )
    result = {
        "families": len(families),
        "max_relative_gap": None if failed else max(completed, default=None),
        "max_relative_gap_completed": max(completed, default=None),
        "gaps": gaps,
        "seed_gaps": seed_gaps,
        "stage_steps_equal": steps_equal,
        "held_out_single": held_single,
        "held_out_swarm": held_swarm,
        "last_validation_through_swarm": last_val_swarm,
        "parameter_gaps": parameter_gaps,
        "buffer_gaps": buffer_gaps,
        "stage_steps": stage_steps,
        "trainer_steps": trainer_steps,
        "failed": failed,
        "target": TARGET_GAP,
        "meets_target": bool(not failed and completed and max(completed) <= TARGET_GAP and steps_equal),
        "steps": args.steps,
        "global_batch": args.batch,
        "target_batch_size": args.target_batch_size or args.batch,
        "compression": args.compression,
        "seed": args.seed,
        "seconds": seconds,
        "total_seconds": round(time.monotonic() - started, 1),
        "plot": str(png),
    }
    report.finish(result)


if __name__ == "__main__":
    main()
