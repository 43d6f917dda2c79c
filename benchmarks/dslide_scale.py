"""D-SLIDE at the paper's scale: the Amazon-670K shape with a 1024-wide hidden layer (~825M parameters) on 4 or 8 ranks.

    python benchmarks/dslide_scale.py [--ranks 8] [--quick]

The network 135,909 sparse features -> 1024 ReLU -> 670,091 labels (``examples/amazon670k/configs/dslide_825m.yaml``,
here without a bucket cap)
trains with ``Trainer(strategy="dslide")`` and LazyAdam on synthetic Amazon-670K-shaped data, ``--ranks`` ranks
started like as many machines (one thread each), for ``--steps`` steps at batch 256. Every rank builds only its shard of
the wide layers (``configure_model`` under the strategy's sharded init). Measured:

- ``step_ms``: mean step time after the warm-up steps (max over ranks);
- ``rebuild_ms``: a full rebuild of a rank's hash tables (all its rows re-hashed: the first build and every new
  hash function), max over ranks, and ``rebuild_ms_incremental`` (the periodic rebuild, rows active since the last
  one), against ``steps_between_rebuilds`` x ``step_ms``;
- ``p_at_1_first`` / ``p_at_1_last``: exact P@1 on held-out synthetic points before and after training;
- ``checkpoint_mb``: ``trainer.save_checkpoint`` (streamed shard by shard to rank 0; weights only, the optimizer
  state would triple it), then loaded back memory-mapped and checked against the ranks' rows;
- ``peak_rss_mb_per_rank``: the largest ``ru_maxrss`` over the ranks; ``peak_rss_mb_single``: the same network
  in one process (2 threads, the same steps), or ``null`` when it would not fit in the memory this machine has free;
- ``exact``: every step's loss of every rank (each computes the whole network's) against the single process's, same
  seeds and batches: the first 5 steps equal to float rounding (relative 1e-6: ``steps_equal_to_1e-6`` leading
  steps) and every step within 1e-4 (``max_rel_loss_diff``: the ranks add the hidden sums and the softmax
  normaliser in another order, and Adam and the LSH choices amplify that rounding over the steps); ``null`` when
  the single process was not run;
- ``model_rss_ratio_<ranks>_ranks``: what the model adds to a rank in training (``VmHWM`` of ``fit``, counted
  from after the validation before it, minus the process right after its imports, the largest over the ranks) over
  what it adds to the single process (target <= 0.16 at 8 ranks: 1/8 and
  the per-rank extras);
- ``bytes_per_step``: the strategy's count of a step's collectives (logical payload), against
  ``bytes_per_step_ddp_dense``, the gradient bytes DDP of the dense model would all-reduce per step (every
  parameter, fp32; computed, not run: a whole copy of this network per rank does not fit this machine), and
  ``tx_bytes_per_step_per_rank``, what a rank really sent on its link per step (ranks in namespaces only).

``--ranks 8`` runs every rank in a network namespace of its own (``testbed/netns.py``; root), each joined to a
bridge by a veth shaped to ``--rate-mbit`` (1 Gbit/s) in both directions with ``tc``, started like 8 machines;
``--ranks 4`` (the default) runs on loopback. No latency is added: this kernel has no netem, and holding packets in
user space (``testbed/nfqueue_delay.py``) costs more CPU and jitter than the 0.2 ms it would model
(``link_delay_note``; ``docs/limitations.md``).

``--quick`` (< 5 min) uses a quarter of the hidden size (256, ~206M parameters) and says so (``hidden``). The last
stdout line is one JSON object, with the load average, also written to ``runs/dslide_scale/dslide_scale.json``
(``runs/dslide_scale_8ranks/dslide_scale_8ranks.json`` with ``--ranks 8``; ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness
from _harness.memory import available_mb, ru_maxrss_mb, vm_hwm_mb

FEATURES, LABELS = 135_909, 670_091


def worker(args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything

    import lightning_swarm  # noqa: F401
    from examples.amazon670k.model import XCModel
    from lightning_swarm.strategy.dslide import DSlideStrategy
    from testbed.dslide_fault_job import OrderedXCData

    torch.set_num_threads(args.threads)
    rss_after_imports = vm_hwm_mb()
    seed_everything(0)
    # No bucket cap: with one, each shard caps its own part of a bucket, and the sharded network's buckets differ
    # from one process's by design; without, a step must equal the process's (``exact``).
    model = XCModel(
        hidden=args.hidden,
        num_active=4096,
        num_bits=14,
        num_tables=8,
        lr=1e-3,
        rebuild_every=50,
        bucket_cap=None,
    )
    # the batches in the order of the sampler the DSlideStrategy injects, in the single process too
    data = OrderedXCData(
        synthetic_samples=args.batch * args.steps, synthetic_test_samples=args.test, batch_size=args.batch
    )
    clock = _harness.lightning_clock(tx=lambda: _harness.counters.link_bytes(("tx",)))
    single = args.ranks == 1

    class Recorder(Callback):
        """Every step's loss (each rank computes the whole network's) and the strategy's bytes of the step."""

        def __init__(self) -> None:
            self.losses: list[float] = []
            self.step_bytes: list[int] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            self.losses.append(float(outputs["loss"]))
            self.step_bytes.append(sum(getattr(trainer.strategy, "last_step_bytes", {}).values()))

    recorder = Recorder()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=args.ranks,
        strategy="auto" if single else DSlideStrategy(),
        max_steps=args.steps,
        **_harness.QUIET_TRAINER,
        check_val_every_n_epoch=10**6,  # no validation inside fit: P@1 is measured before and after
        callbacks=[clock, recorder],
    )
    result: dict[str, Any] = {}
    if not single:
        result["p_at_1_first"] = float(trainer.validate(model, data, verbose=False)[0]["val/p@1"])
        # the model's memory is compared in training, on equal terms with the single process (which validates
        # nothing): the peak is counted from here (the validation's score matrix is freed)
        Path("/proc/self/clear_refs").write_text("5")
    trainer.fit(model, data)
    result["vm_hwm_fit_mb"] = vm_hwm_mb()
    warm = min(args.warmup, len(clock.times) - 2)
    result["step_ms"] = 1000 * (clock.times[-1] - clock.times[warm]) / (len(clock.times) - 1 - warm)
    window = clock.window(warm)
    result["tx_bytes_per_step"] = window["tx_per_step"]
    result["losses"] = recorder.losses
    # the strategy's count of a step's collectives (logical payload), the last full step's
    result["bytes_per_step"] = recorder.step_bytes[-1] if recorder.step_bytes else 0
    layer = model.output_layer
    start = time.perf_counter()
    layer._built_at = None  # force the periodic (incremental) rebuild now: the rows active since the last one
    layer.maybe_rebuild()
    result["rebuild_ms_incremental"] = 1000 * (time.perf_counter() - start)
    start = time.perf_counter()
    layer.invalidate_tables()
    layer.maybe_rebuild()  # every row of this rank re-hashed
    result["rebuild_ms"] = 1000 * (time.perf_counter() - start)
    if not single:
        result["p_at_1_last"] = float(trainer.validate(model, data, verbose=False)[0]["val/p@1"])
        path = Path(args.rank_dir) / "model.ckpt"
        start = time.perf_counter()
        trainer.save_checkpoint(path, weights_only=True)
        result["checkpoint_s"] = time.perf_counter() - start
        if trainer.global_rank == 0:
            result["checkpoint_mb"] = path.stat().st_size / 1e6
        lo = layer.row_offset
        rows = layer.weight.detach()[:3].clone()
        loaded = torch.load(path, mmap=True, weights_only=True, map_location="cpu")["state_dict"]
        result["checkpoint_rows_match"] = bool(torch.equal(loaded["output_layer.weight"][lo : lo + 3], rows))
        result["checkpoint_shape"] = list(loaded["output_layer.weight"].shape)
        del loaded
    result["params"] = sum(p.numel() for p in model.parameters()) * (1 if single else args.ranks)
    result["peak_rss_mb"] = ru_maxrss_mb()
    result["vm_hwm_mb"] = vm_hwm_mb()
    result["rss_after_imports_mb"] = rss_after_imports
    (Path(args.rank_dir) / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def launch(
    args: argparse.Namespace, ranks: int, threads: int, steps: int, out: Path, timeout: float, net: Any = None
) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--ranks",
        str(ranks),
        "--threads",
        str(threads),
    ]
    cmd += ["--hidden", str(args.hidden), "--steps", str(steps), "--warmup", str(args.warmup)]
    cmd += ["--batch", str(args.batch), "--test", str(args.test), "--rank-dir", str(out)]
    port = str(29600 + os.getpid() % 300)
    master = net.address(0) if net is not None else "127.0.0.1"
    with _harness.Launcher(out) as launcher:
        for rank in range(ranks):
            env = {"OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
            if ranks > 1:
                env.update(_harness.rank_env(rank, ranks, master, port))
            launcher.start(f"rank{rank}", cmd, env=env, cwd=_harness.ROOT, net=net, rank=rank)
        launcher.wait(timeout)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def main() -> None:
    parser = _harness.parser(
        "dslide_scale", __doc__, quick="a quarter of the hidden size (256), fewer steps", raw=True
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="training steps (default 60; 24 with --quick)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--ranks", type=int, default=4, help="D-SLIDE ranks (default 4; 8: each in its own namespace)"
    )
    parser.add_argument(
        "--rate-mbit",
        type=float,
        default=None,
        help="ranks in network namespaces joined by veths shaped to this rate (root; default 1000 with --ranks 8, "
        "else loopback)",
    )
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, default=1024, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=256, help=argparse.SUPPRESS)
    parser.add_argument("--test", type=int, default=256, help=argparse.SUPPRESS)
    parser.add_argument("--rank-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    # SIGTERM unwinds like an exception, so the `finally` blocks kill the rank processes started so far.
    _harness.exit_on_sigterm()
    report = _harness.Report(
        "dslide_scale" if args.ranks == 4 else f"dslide_scale_{args.ranks}ranks", args.out
    )
    if args.quick:
        args.hidden = 256
    steps = args.steps or (24 if args.quick else 60)
    params = FEATURES * args.hidden + args.hidden + (args.hidden + 1) * LABELS
    n = args.ranks
    rate = args.rate_mbit if args.rate_mbit is not None else (1000.0 if n >= 8 else None)
    with tempfile.TemporaryDirectory(prefix="dslide_scale_") as tmp:
        with _harness.link(n, rate) as net:
            ranks = launch(args, n, 1, steps, Path(tmp) / "dslide", timeout=3000, net=net if rate else None)
        # One process: weights, LazyAdam's two moments, the interpreter (~0.5 GB) and room to spare. It trains as
        # many steps as the ranks, on the same batches: its losses are the exactness check.
        need_mb = params * 12 / 1e6 + 1500
        single = None
        if need_mb < available_mb() - 2000:
            single = launch(args, 1, 2, steps, Path(tmp) / "single", timeout=3000)[0]
    rank0 = ranks[0]
    peak = max(r["peak_rss_mb"] for r in ranks)
    # what the model adds to a process (peak minus the process after its imports): the part ranks divide
    model_mb = max(r["vm_hwm_fit_mb"] - r["rss_after_imports_mb"] for r in ranks)
    model_mb_single = single["vm_hwm_fit_mb"] - single["rss_after_imports_mb"] if single else None
    losses = [r["losses"] for r in ranks]
    exact, steps_equal, max_rel = None, None, None
    if (
        single is not None
    ):  # every rank computes the whole network's loss: each against the process's, step by step
        rel = [[abs(a - b) / abs(b) for a, b in zip(mine, single["losses"], strict=True)] for mine in losses]
        max_rel = max(max(r) for r in rel)
        steps_equal = min(next((i for i, x in enumerate(r) if x > 1e-6), len(r)) for r in rel)
        # The first steps agree to float rounding (the ranks add the hidden sums and the softmax normaliser in
        # another order); Adam and the LSH choices amplify that rounding over the steps, to ~1e-5.
        exact = steps_equal >= min(5, steps) and max_rel <= 1e-4
    ddp_bytes = params * 4  # DDP of the dense model all-reduces every gradient, fp32: the logical payload
    tx = [r["tx_bytes_per_step"] for r in ranks]
    summary = {
        "params": params,  # F*H + H + (H + 1) * labels: every parameter of the network once
        "params_counted_on_rank0_times_ranks": rank0["params"],
        "hidden": args.hidden,
        "quick": args.quick,
        "ranks": n,
        "link_rate_mbit": rate,
        "link_delay_ms": 0.0,
        "link_delay_note": (
            "no added latency: no netem in this kernel; an NFQUEUE packet holder (testbed/nfqueue_delay.py "
            "--measure) costs 27-77 us of CPU per packet and ms-long p99 tails on these 2 cores, more than the "
            "~1 ms per step that 0.2 ms would add (docs/limitations.md)"
        ),
        f"model_rss_ratio_{n}_ranks": round(model_mb / model_mb_single, 3) if model_mb_single else None,
        "model_rss_mb_per_rank": round(model_mb),
        "model_rss_mb_single": round(model_mb_single) if model_mb_single else None,
        "exact": exact,
        "max_rel_loss_diff": max_rel,
        "steps_equal_to_1e-6": steps_equal,
        "losses_rank0": [round(x, 6) for x in losses[0]],
        "losses_single": [round(x, 6) for x in single["losses"]] if single else None,
        "bytes_per_step": ranks[0]["bytes_per_step"],
        "bytes_per_step_ddp_dense": ddp_bytes,
        "bytes_vs_ddp": round(ranks[0]["bytes_per_step"] / ddp_bytes, 6),
        "tx_bytes_per_step_per_rank": round(sum(tx) / len(tx)) if all(t is not None for t in tx) else None,
        "threads_per_rank": 1,
        "batch": args.batch,
        "steps": steps,
        "step_ms": round(max(r["step_ms"] for r in ranks), 1),
        "rebuild_ms": round(max(r["rebuild_ms"] for r in ranks), 1),
        "rebuild_ms_incremental": round(max(r["rebuild_ms_incremental"] for r in ranks), 1),
        "steps_between_rebuilds": 50,
        "p_at_1_first": round(rank0["p_at_1_first"], 4),
        "p_at_1_last": round(rank0["p_at_1_last"], 4),
        "held_out_points": args.test,
        "checkpoint_mb": round(rank0["checkpoint_mb"], 1),
        "checkpoint_weights_only": True,
        "checkpoint_s": round(rank0["checkpoint_s"], 1),
        "checkpoint_rows_match": all(r["checkpoint_rows_match"] for r in ranks),
        "checkpoint_shape_output_weight": rank0["checkpoint_shape"],
        "peak_rss_mb_per_rank": round(peak),
        "peak_rss_mb_single": round(single["peak_rss_mb"]) if single else None,
        "single_not_run_reason": None
        if single
        else f"needs ~{need_mb:.0f} MB, {available_mb():.0f} MB available",
        "step_ms_single": round(single["step_ms"], 1) if single else None,
        "peak_rss_ratio": round(peak / single["peak_rss_mb"], 3) if single else None,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "cpu_cores": os.cpu_count(),
    }
    report.finish(summary)


if __name__ == "__main__":
    main()
