"""Does a swarm train every kind of model as one process does? The fidelity matrix.

Each model family of ``testbed/families.py`` (a GPT decoder with a float causal mask and weight tying; a ViT with
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

With ``--trainers K`` (several trainers, ``benchmarks/fidelity_matrix.py --trainers 2 [--quick]``), each family
trains under Lightning's DDP on K CPU devices (what a user would pick instead) and in a local swarm of K trainers
(``devices=max(2, K)``, 2 stages, 8-bit), each with batch ``global batch / K``, same seed, data shards and steps:
once with the default synchronous steps (``stage_steps="trainer"``: one global step per global batch, as DDP),
once asynchronously (``stage_steps="async"``, ``target_batch_size`` = the global batch), and once synchronously
with uncompressed boundaries (``compression="none"``: what the synchronous step itself costs, the codec's
rounding aside; ``uncompressed_gaps``). The gap of a family is ``|held_out_swarm - held_out_ddp| / held_out_ddp``; ``trainer_params_identical``: the trainers' own parameters
(outside the pipeline) hash alike on every trainer at the end; ``stage_steps_equal``: the stages stepped once per
global step. The full run (no ``--quick``) adds 4 trainers against DDP on 4 devices. Written to
``runs/fidelity_matrix_trainers/fidelity_matrix_trainers.json`` (the full run:
``runs/fidelity_matrix_trainers_full/fidelity_matrix_trainers_full.json``).

Last stdout line: one JSON object with ``families``, ``max_relative_gap``, ``gaps``, ``stage_steps_equal``,
``held_out_single``, ``held_out_swarm``, ``stage_steps``, ``trainer_steps``, ... (targets: gap <= 0.02, stage
steps equal). Also written, with commit, date and load average, to ``runs/fidelity_matrix/fidelity_matrix.json``
(``--out``), and the loss curves to ``runs/fidelity_matrix/loss_curves.png``. ``--quick``: 40 steps of batch 32 (under 5
minutes on 2 idle cores); default: 200 steps of batch 64.
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
from testbed.families import FAMILIES
from testbed.fidelity_job import buffer_gap, launch, parameter_gap, run

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


def _launch_or_error(cfg: dict[str, Any], timeout: float) -> tuple[dict[str, Any] | None, str | None]:
    """``launch(cfg)``: its result, or ``None`` and the error's cause in one line."""
    try:
        return launch(cfg, timeout=timeout), None
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        lines = [line for line in str(e).splitlines() if line.strip()]
        causes = [line.strip() for line in lines if _EXCEPTION_LINE.match(line.strip())]
        return None, causes[0] if causes else (lines[-1] if lines else repr(e))


def compare_trainers(family: str, trainers: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``family`` under DDP on ``trainers`` devices and in swarms of as many trainers (synchronous and
    asynchronous steps), global batch ``args.batch``; the figures of each."""
    cfg = {
        "family": family,
        "batch_size": args.batch // trainers,
        "steps": args.steps,
        "seed": args.seed,
        "val_every": max(1, args.steps // 4),
    }
    out: dict[str, Any] = {"errors": {}, "seconds": {}}
    runs: dict[str, tuple[dict[str, Any], bool]] = {
        "ddp": ({**cfg, "ddp": trainers}, True),
        "other_seed": ({**cfg, "ddp": trainers, "seed": args.seed + 1}, True),
    }
    for name, mode, compression in (
        ("trainer", "trainer", args.compression),
        ("async", "async", args.compression),
        ("uncompressed", "trainer", "none"),
    ):
        settings = {
            **swarm_settings(family, args.batch, compression),
            "num_trainers": trainers,
            "stage_steps": mode,
            "run_id": f"fidelity_trainers_{family}_{name}_{os.getpid()}",
        }
        wanted = name != "uncompressed" or args.compression != "none"
        runs[name] = ({**cfg, "devices": max(2, trainers), "swarm": settings}, wanted)
    for name, (run_cfg, wanted) in runs.items():
        if not wanted:
            out[name] = None
            continue
        started = time.monotonic()
        out[name], error = _launch_or_error(run_cfg, args.timeout)
        out["seconds"][name] = round(time.monotonic() - started, 1)
        if error is not None:
            out["errors"][name] = error
    out["runs"] = {
        f"DDP x{trainers}": out["ddp"],
        "swarm, sync": out["trainer"],
        "swarm, async": out["async"],
        "swarm, sync, uncompressed": out["uncompressed"],
    }
    return out


def trainers_report(args: argparse.Namespace, families: list[str], counts: list[int]) -> None:
    """The several-trainers matrix (see the module's docstring)."""
    # the full run (200 steps of batch 64) keeps its own report beside the quick one's
    report = _harness.Report("fidelity_matrix_trainers" + ("" if args.quick else "_full"), args.out)
    started = time.monotonic()
    rows: dict[str, dict[str, Any]] = {}
    for k in counts:
        results = {family: compare_trainers(family, k, args) for family in families}
        plot(
            results,
            report.path(f"loss_curves_{k}_trainers.png"),
            f"Fidelity matrix: {k} trainers in a swarm (2 stages, 8-bit; sync and async steps) vs DDP on {k} "
            "devices, same seed, data, global batch, steps",
        )

        def gap(run: dict[str, Any] | None, ref: dict[str, Any] | None) -> float | None:
            if run is None or ref is None:
                return None
            return round(abs(run["held_out"] - ref["held_out"]) / ref["held_out"], 4)

        row: dict[str, Any] = {
            "gaps": {},
            "async_gaps": {},
            "uncompressed_gaps": {},
            "seed_gaps": {},
            "held_out": {},
            "stage_steps": {},
        }
        identical, steps_equal = True, True
        for family, r in results.items():
            ddp, sync, asyn = r.get("ddp"), r.get("trainer"), r.get("async")
            row["gaps"][family] = gap(sync, ddp)
            row["async_gaps"][family] = gap(asyn, ddp)
            row["uncompressed_gaps"][family] = gap(r.get("uncompressed"), ddp)
            row["seed_gaps"][family] = gap(r.get("other_seed"), ddp)
            row["held_out"][family] = {
                name: None if h is None else round(h["held_out"], 4)
                for name, h in (("ddp", ddp), ("sync", sync), ("async", asyn))
            }
            if sync is None:
                identical = steps_equal = False
                continue
            hashes = sync["own_hashes"]
            identical = identical and len(hashes) == k and len(set(hashes.values())) == 1
            row["stage_steps"][family] = sync["stage_steps"]
            steps_equal = steps_equal and sync["trainer_steps"] == args.steps
            steps_equal = steps_equal and all(s == args.steps for s in sync["stage_steps"] or [-1])
        completed = [g for g in row["gaps"].values() if g is not None]
        row.update(
            {
                "max_relative_gap": max(completed) if len(completed) == len(families) else None,
                "async_max_relative_gap": max(
                    (g for g in row["async_gaps"].values() if g is not None), default=None
                ),
                "uncompressed_max_relative_gap": max(
                    (g for g in row["uncompressed_gaps"].values() if g is not None), default=None
                ),
                "trainer_params_identical": identical,
                "stage_steps_equal": steps_equal,
                "errors": {f: r["errors"] for f, r in results.items() if r["errors"]},
                "seconds": {f: r["seconds"] for f, r in results.items()},
            }
        )
        row["meets_target"] = bool(
            row["max_relative_gap"] is not None
            and row["max_relative_gap"] <= TARGET_GAP
            and identical
            and steps_equal
        )
        rows[str(k)] = row
    first = rows[str(counts[0])]
    report.finish(
        {
            "trainers": counts,
            "max_relative_gap": first["max_relative_gap"],
            "trainer_params_identical": all(r["trainer_params_identical"] for r in rows.values()),
            "stage_steps_equal": all(r["stage_steps_equal"] for r in rows.values()),
            "async_max_relative_gap": first["async_max_relative_gap"],
            "uncompressed_max_relative_gap": first["uncompressed_max_relative_gap"],
            "meets_target": all(r["meets_target"] for r in rows.values()),
            "by_trainers": rows,
            "target": TARGET_GAP,
            "steps": args.steps,
            "global_batch": args.batch,
            "compression": args.compression,
            "seed": args.seed,
            "families": families,
            "total_seconds": round(time.monotonic() - started, 1),
        }
    )


def plot(
    results: dict[str, dict[str, Any]],
    path: Path,
    title: str = "Fidelity matrix: swarm (1 trainer, 2 stages, 8-bit) vs one process, same seed, data, batch, steps",
) -> None:
    """Training loss (smoothed) and validation loss per optimizer step of both runs of every family, with the
    held-out loss at the end as a marker; one panel per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    rows = -(-len(results) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, (family, r) in zip(axes.flat, results.items(), strict=False):
        runs = r.get("runs") or {"one process": r["single"], "swarm": r.get("swarm")}
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
    fig.suptitle(title)
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
    p.add_argument(
        "--trainers",
        default=None,
        help="several trainers against DDP on as many devices, e.g. 2 or 2,4 (the full run adds 4)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one swarm run may take")
    args = p.parse_args()
    args.steps = args.steps or (40 if args.quick else 200)
    args.batch = args.batch or (32 if args.quick else 64)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        p.error(f"unknown families {unknown}; choose from {FAMILIES}")
    if args.trainers:
        counts = sorted({int(k) for k in args.trainers.split(",")} | (set() if args.quick else {4}))
        if any(k < 2 or args.batch % k for k in counts):
            p.error(
                f"--trainers {args.trainers}: each count must be >= 2 and divide the global batch {args.batch}"
            )
        trainers_report(args, families, counts)
        return

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
