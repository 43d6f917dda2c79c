"""Does a swarm train ALBERT as well as one process? The same model, data, seed, global batch and number of
optimizer steps, trained (a) in one process with plain Lightning and (b) in a local swarm with 8-bit boundaries,
side by side; both evaluated with the same held-out masked-LM loss.

The swarm: 2 server peers (one per stage, each in its own process) and 1 trainer peer, started by
``examples/albert/run_swarm.py``; the global batch is 4 microbatches of 32, the trainer accumulates them
(``accumulate_grad_batches=4``) and ``target_batch_size`` is 128, so every optimizer step of the stages and of the
trainer uses the samples of one single-process step (the single process accumulates the same 4 microbatches; the
JSON's ``stage_steps`` shows the stages' own step count). One microbatch per step is not used: hivemind's progress
tracker learns of a finished epoch from the DHT a moment later, so back-to-back one-microbatch epochs merge. What differs
from single-process training is only what the swarm does to the tensors crossing stage boundaries (8-bit blockwise
quantization of activations and gradients) and the server-side recomputation of the forward pass (the same
arithmetic). Held-out loss: ``Albert.evaluate`` on the data module's validation windows (from the last 5% of the
text, never trained on), computed in each trainer process on the final, whole model.

    python benchmarks/albert_fidelity.py [--quick]

Last stdout line: one JSON object with ``steps``, ``loss_single``, ``loss_swarm``, ``relative_gap`` (target <= 0.03),
also written to ``runs/albert_fidelity/albert_fidelity.json`` (``--out``: that folder, which also gets the swarm
half's ``summary.json`` and logs).
"""

from __future__ import annotations

import time

import _harness

from examples.albert import run_swarm

TARGET = 0.03


def main() -> None:
    p = _harness.parser(
        "albert_fidelity", __doc__.split("\n\n")[0], quick="fewer steps (under 5 minutes on 2 cores)"
    )
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=32, help="microbatch size")
    p.add_argument("--accumulate", type=int, default=4, help="microbatches per optimizer step")
    p.add_argument("--compression", default="8bit", choices=["8bit", "fp16", "none"])
    args = p.parse_args()
    report = _harness.Report("albert_fidelity", args.out)
    steps = args.steps or (20 if args.quick else 60)
    b = args.batch
    overrides = [
        f"--data.batch_size={b}",
        f"--trainer.accumulate_grad_batches={args.accumulate}",
        f"--trainer.strategy.init_args.target_batch_size={b * args.accumulate}",
        f"--trainer.strategy.init_args.compression={args.compression}",
        "--trainer.val_check_interval=1000000",  # no validation during training: the comparison is at the end
        "--trainer.limit_val_batches=0",
    ]
    launcher_args, extra = run_swarm.parse_args(
        [
            "--stages",
            "2",
            "--peers-per-stage",
            "1",
            "--trainers",
            "1",
            "--steps",
            str(steps),
            "--out",
            str(report.dir),
        ]
        + ["--", *overrides]
    )
    started = time.monotonic()
    swarm = run_swarm.run_swarm(launcher_args, extra)
    swarm_s = time.monotonic() - started
    started = time.monotonic()
    single = run_swarm.run_baseline(launcher_args, extra, steps)
    single_s = time.monotonic() - started
    h = swarm["histories"][0]
    loss_swarm, loss_single = h["eval_loss"], single["eval_loss"]
    gap = abs(loss_swarm - loss_single) / loss_single
    sent = h["swarm"].get("swarm/bytes_sent", 0.0) + h["swarm"].get("swarm/bytes_recv", 0.0)
    result = {
        "steps": steps,
        "steps_swarm": h["step"][-1],
        "steps_single": single["step"][-1],
        "global_batch": b * args.accumulate,
        "microbatch": b,
        "stage_steps": h.get("stage_steps"),
        "compression": args.compression,
        "loss_single": round(loss_single, 4),
        "loss_swarm": round(loss_swarm, 4),
        "relative_gap": round(gap, 4),
        "target": TARGET,
        "meets_target": gap <= TARGET,
        "initial_train_loss": round(single["loss"][0], 3),
        "final_train_loss_single": round(sum(single["loss"][-10:]) / 10, 3),
        "final_train_loss_swarm": round(sum(h["loss"][-10:]) / 10, 3),
        "wire_bytes_swarm": sent,
        "fp32_boundary_bytes": h.get("fp32_boundary_bytes"),
        "swarm_seconds": round(swarm_s, 1),
        "single_seconds": round(single_s, 1),
    }
    report.finish(result)


if __name__ == "__main__":
    main()
