"""SLIDE output layer vs dense output layer on Amazon-670K-shaped data: speed per step and time to accuracy.

Both variants train the same network, ``SparseInputLinear(135909 -> 128) -> ReLU -> output``, batch 256,
``torch.set_num_threads(2)``:

- ``sparse``: output ``SparseLSHLinear`` (LSH active set) + ``active_set_loss`` + ``LazyAdam``;
- ``dense``: output ``nn.Linear`` + full softmax with the same soft targets (``1/|Y|``) + ``torch.optim.Adam``
  (the input layer uses ``LazyAdam`` in both).

Step times (``step_ms_*``, ``speedup``) come from one child process that holds both networks at full size and
interleaves 10 sparse steps with 1 dense step, so load from other processes on the box hits both alike; the
sparse steps include the table rebuilds at their amortised rate.

Quality is time to accuracy, each variant in its own child process: first a learning-rate sweep (``--lrs``, or
``--lrs-dense`` / ``--lrs-sparse``, a short wall-clock budget each, best held-out P@1 wins), then a run with the best
rate that evaluates P@1 on held-out points (evaluation time not counted). Evaluations happen at training times
growing geometrically (``--first-eval-s``, ``--eval-growth``) up to one every ``--max-eval-interval-s``, the same for
both. A run stops at the first of: a plateau (after ``--min-train-s``, the best P@1 rose by less than 0.002 over the
last third of its training time, with at least 3 evaluations in that third), ``--patience`` evaluations in a row
without a new best (a rate that peaks and falls), the budget ``--train-s``, or the wall-clock limit ``--max-wall-s``
of the whole quality part (the run's ``stopped`` then says ``deadline``). ``--parallel 2`` runs two quality runs side
by side with one torch thread each; their training clock is then process CPU time (equal to wall time on an idle
box, and not inflated by other jobs on a shared one; ``quality_clock``). ``sweep_runs`` lists every swept rate's best
P@1, why it stopped, its training seconds and epochs.
``time_to_p1_dense`` / ``time_to_p1_sparse``: training seconds each needed to reach the dense model's best P@1
(``null`` if it never did); ``time_to_p1_ratio`` their ratio.

Data: synthetic, with Amazon-670K's shape and label skew (``examples/amazon670k/data.py: make_synthetic``); it is
easier than the real data set, so its P@1 values say that both variants learn, not how good either is on
Amazon-670K. With ``--data-dir`` the quality part reads the real files instead (``train.txt``/``test.txt`` in the
Extreme Classification Repository format). ``--quick`` (< 5 min on an idle box) sweeps two rates for 12 s each and trains 60 s per
variant, evaluating on 256 held-out points: an early-training comparison. The last stdout line is one JSON
object, with the load average.

Convergence and tuning (``--labels 20000``, where the dense softmax converges in minutes on 2 cores): a best rate on
an edge of the sweep makes the sweep go on past that edge (up to 3 more rates, x3 apart), and
``dense_lr_interior`` / ``sparse_lr_interior`` say whether the chosen rate ended inside the swept range;
``dense_converged`` / ``sparse_converged`` whether the best held-out P@1 rose by less than 0.002 over the last third
of the final run's training time (``gain_last_third_*``). ``--sweep-s`` and ``--train-s`` set the two budgets;
``--full-sweep`` trains every swept rate for the final budget and keeps the best run. That is the fair tuning: with
a short sweep budget the dense model's sweep picks a rate that learns fast and then falls (on 20k labels: 0.03,
best P@1 0.733 at 43 s, 0.640 at 180 s), while 0.01 reaches 0.938 in 180 s. The timing part (``speedup``) stays at
670,091 labels.

Usage: ``python benchmarks/sparse_vs_dense.py [--quick] [--labels 20000] [--data-dir /path/to/Amazon-670K]``. The
JSON is also written to ``runs/sparse_vs_dense/sparse_vs_dense.json`` (``--out``). Quality parity on 20k labels, every
rate to its plateau, two runs at a time (about 35 minutes on 2 cores): ``--quick --labels 20000 --full-sweep
--skip-timing --parallel 2 --lrs-dense 0.003,0.01,0.03 --lrs-sparse 0.001,0.003,0.01 --train-s 1500 --max-wall-s 3900
--patience 12`` (with the default patience of 6 the dense model stopped while still creeping up).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time

import _harness
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.amazon670k.data import XCData, collate_sparse, make_synthetic
from lightning_swarm.layers import LazyAdam, SparseInputLinear, SparseLSHLinear, active_set_loss
from lightning_swarm.layers.metrics import PrecisionAtK

FEATURES, LABELS, HIDDEN, BATCH = 135_909, 670_091, 128, 256
MAX_SWEEP_EXTENSIONS = 3  # rates added past an edge of the sweep when the best one sits on it
CONVERGED_GAIN = 0.002  # P@1 gain over the last third of training below which a run counts as converged


def batches(data: XCData, order: Tensor) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """The data in batches of ``BATCH`` rows, in ``order`` (last partial batch dropped)."""
    out = []
    for lo in range(0, len(order) - BATCH + 1, BATCH):
        out.append(collate_sparse([data.row(int(i)) for i in order[lo : lo + BATCH]]))
    return out


def dense_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Full softmax cross-entropy with target mass ``1/|Y|`` on each label (rows with labels)."""
    valid = labels >= 0
    n = valid.sum(1)
    picked = logits.gather(1, labels.clamp(min=0)).masked_fill(~valid, 0.0).sum(1)
    per_row = logits.logsumexp(1) - picked / n.clamp(min=1)
    return per_row[n > 0].mean()


class Net:
    """``SparseInputLinear -> ReLU -> output`` with its optimizers, for one variant."""

    def __init__(self, variant: str, num_labels: int, args: argparse.Namespace) -> None:
        self.variant = variant
        self.hidden = SparseInputLinear(FEATURES, HIDDEN)
        params_sparse = list(self.hidden.parameters())
        if variant == "sparse":
            lsh = dict(num_bits=args.num_bits, num_tables=args.num_tables, rebuild_every=args.rebuild_every)
            self.out: nn.Module = SparseLSHLinear(
                HIDDEN, num_labels, num_active=args.num_active, seed=0, **lsh
            )
            self.optimizers: list[torch.optim.Optimizer] = [
                LazyAdam(params_sparse + list(self.out.parameters()), lr=args.lr)
            ]
        else:
            self.out = nn.Linear(HIDDEN, num_labels)
            self.optimizers = [
                LazyAdam(params_sparse, lr=args.lr),
                torch.optim.Adam(self.out.parameters(), lr=args.lr),
            ]

    def train_step(self, batch: tuple[Tensor, Tensor, Tensor, Tensor]) -> float:
        """One optimizer step; returns the loss."""
        idx, off, val, lab = batch
        h = F.relu(self.hidden(idx, off, val))
        if self.variant == "sparse":
            ids, logits = self.out(h, lab)
            loss = active_set_loss(ids, logits, lab)
        else:
            loss = dense_loss(self.out(h), lab)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in self.optimizers:
            opt.step()
        return float(loss.detach())

    @torch.no_grad()
    def precision(self, data: XCData) -> dict[str, float]:
        """P@1 and P@5 on ``data`` with the exact top-5."""
        metric = PrecisionAtK(ks=(1, 5))
        self.out.eval()
        for lo in range(0, len(data), BATCH):
            idx, off, val, lab = collate_sparse([data.row(i) for i in range(lo, min(lo + BATCH, len(data)))])
            h = F.relu(self.hidden(idx, off, val))
            if self.variant == "sparse":
                _, top = self.out.topk(h, 5, mode="exact")
            else:
                top = self.out(h).topk(5, dim=1).indices
            metric.update(top, lab)
        self.out.train()
        return {k: float(v) for k, v in metric.compute().items()}


def load_quality_data(args: argparse.Namespace) -> tuple[XCData, XCData]:
    """The training and held-out points of the quality runs: real files or synthetic data."""
    if args.data_dir:
        from examples.amazon670k.data import read_xc_file

        return read_xc_file(os.path.join(args.data_dir, "train.txt")), read_xc_file(
            os.path.join(args.data_dir, "test.txt")
        )
    train = make_synthetic(args.train, FEATURES, args.labels, seed=0)
    test = make_synthetic(args.test, FEATURES, args.labels, seed=0, sample_seed=1)
    return train, test


def run_variant(args: argparse.Namespace) -> dict:
    """Train one variant at one learning rate in this process, evaluating as it goes; returns the curve.

    The training clock counts only the optimizer steps (not batching, not evaluation): process CPU seconds with
    ``--clock cpu`` (with one torch thread that equals idle-box wall time and does not grow with other load on a
    shared box), wall seconds with ``--clock wall``. Evaluations come at clock times growing geometrically
    (``--first-eval-s``, ``--eval-growth``) until their interval reaches ``--max-eval-interval-s``. The run stops at
    the first of: a plateau (at least ``--min-train-s`` trained and the best held-out P@1 rose by less than
    ``CONVERGED_GAIN`` over the last third of the training time, with at least 3 evaluations in it), ``--patience``
    evaluations in a row without a new best (a rate that peaks and falls), the budget ``--budget-s``, or the
    wall-clock ``--deadline`` (seconds since the epoch; 0: none).
    """
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    train, test = load_quality_data(args)
    global FEATURES
    FEATURES = train.num_features
    net = Net(args.variant, train.num_labels, args)
    gen = torch.Generator().manual_seed(0)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    curve: list[tuple[float, float]] = []  # (training seconds, held-out P@1)
    train_s, wall_s, steps, best, since_best = 0.0, 0.0, 0, -1.0, 0
    interval = args.first_eval_s
    next_eval = args.first_eval_s
    losses: list[float] = []
    stopped = ""
    epochs = 0
    while not stopped:
        order = torch.randperm(len(train), generator=gen)
        epochs += 1
        for lo in range(0, len(order) - BATCH + 1, BATCH):
            batch = collate_sparse([train.row(int(i)) for i in order[lo : lo + BATCH]])
            start, wall = clock(), time.perf_counter()
            losses.append(net.train_step(batch))
            train_s += clock() - start
            wall_s += time.perf_counter() - wall
            steps += 1
            past_deadline = bool(args.deadline) and time.time() >= args.deadline
            if train_s >= next_eval or train_s >= args.budget_s or past_deadline:
                interval = min(interval * args.eval_growth, args.max_eval_interval_s)
                next_eval = max(next_eval + interval, train_s)
                p1 = net.precision(test)["p@1"]
                curve.append((round(train_s, 2), round(p1, 4)))
                best, since_best = (p1, 0) if p1 > best else (best, since_best + 1)
                if train_s >= args.budget_s:
                    stopped = "budget"
                elif past_deadline:
                    stopped = "deadline"
                elif since_best >= args.patience:
                    stopped = "patience"
                elif train_s >= args.min_train_s and plateaued(curve):
                    stopped = "plateau"
                if stopped:
                    break
    return {
        "lr": args.lr,
        "steps": steps,
        "epochs": round(steps * BATCH / len(train), 2),
        "clock": args.clock,
        "threads": args.threads,
        "train_s": round(train_s, 1),
        "train_wall_s": round(wall_s, 1),
        "step_ms": round(1000 * train_s / steps, 1),
        "best_p_at_1": round(best, 4),
        "stopped": stopped,
        "curve": curve,
        "first_loss": losses[0],
        "last_loss": sum(losses[-10:]) / len(losses[-10:]),
        "peak_rss_mb": _harness.memory.ru_maxrss_mb(),
        "rebuilds": net.out.num_rebuilds if args.variant == "sparse" else None,
    }


def plateaued(curve: list[tuple[float, float]]) -> bool:
    """The plateau rule: converged (below) with at least 3 evaluations in the last third of the training time."""
    end = curve[-1][0]
    return sum(1 for t, _ in curve if t > end * 2 / 3) >= 3 and converged(curve)


def last_third_gain(curve: list[list[float]]) -> float | None:
    """How much the best held-out P@1 rose in the last third of the training time (``None``: too few evaluations)."""
    if len(curve) < 3:
        return None
    end = curve[-1][0]
    before = [p for t, p in curve if t <= end * 2 / 3]
    if not before:
        return None
    return round(max(p for _, p in curve) - max(before), 4)


def converged(curve: list[list[float]]) -> bool:
    """Converged: the best held-out P@1 rose by less than ``CONVERGED_GAIN`` in the last third of the training."""
    gain = last_third_gain(curve)
    return gain is not None and gain < CONVERGED_GAIN


def time_to(curve: list[list[float]], target: float) -> float | None:
    """Training seconds at the first evaluation whose P@1 reached ``target``."""
    return next((t for t, p in curve if p >= target - 1e-9), None)


def run_timing(args: argparse.Namespace) -> dict:
    """Both variants at full size in one process, steps interleaved so load changes hit both alike.

    After a warm-up (which includes the first, full table build), ``10 * dense_steps`` sparse
    steps are timed: with the default rebuild period of 50 they include the incremental table
    rebuilds at their amortised rate.
    """
    torch.set_num_threads(2)
    torch.manual_seed(0)
    per_dense = 10
    data = make_synthetic(BATCH * 60, FEATURES, LABELS, seed=0)
    data_batches = batches(data, torch.arange(len(data)))
    sparse, dense = Net("sparse", LABELS, args), Net("dense", LABELS, args)
    for b in data_batches[:3]:
        sparse.train_step(b)
    dense.train_step(data_batches[0])
    t_sparse: list[float] = []
    t_dense: list[float] = []
    cpu_sparse = cpu_dense = 0.0  # process CPU seconds: less sensitive to other load on the box
    for i in range(args.dense_steps):
        for j in range(per_dense):
            b = data_batches[(3 + i * per_dense + j) % len(data_batches)]
            start, cpu = time.perf_counter(), time.process_time()
            sparse.train_step(b)
            t_sparse.append(time.perf_counter() - start)
            cpu_sparse += time.process_time() - cpu
        start, cpu = time.perf_counter(), time.process_time()
        dense.train_step(data_batches[i % len(data_batches)])
        t_dense.append(time.perf_counter() - start)
        cpu_dense += time.process_time() - cpu
    return {
        "step_ms_sparse": 1000.0 * sum(t_sparse) / len(t_sparse),
        "step_ms_dense": 1000.0 * sum(t_dense) / len(t_dense),
        "cpu_ms_sparse": 1000.0 * cpu_sparse / len(t_sparse),
        "cpu_ms_dense": 1000.0 * cpu_dense / len(t_dense),
        "timed_steps_sparse": len(t_sparse),
        "timed_steps_dense": len(t_dense),
        "rebuilds_timed": sparse.out.num_rebuilds - 1,
    }


def child(variant: str, **kw: object) -> dict:
    """Run one variant in a fresh process and return its JSON result."""
    cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant]
    for key, value in kw.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    proc = _harness.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"variant {variant} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def reader_speed() -> dict:
    """Lines per second of ``read_xc_file`` (vectorised) and of the line-by-line parser, on the same file."""
    import tempfile

    from examples.amazon670k.xc_format import _read_xc_file_by_lines, read_xc_file, write_xc_file

    data = make_synthetic(20_000, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "train.txt")
        write_xc_file(path, data)
        times = {}
        for name, reader in (("vectorised", read_xc_file), ("line_by_line", _read_xc_file_by_lines)):
            start = time.perf_counter()
            reader(path)
            times[name] = time.perf_counter() - start
        size = os.path.getsize(path)
    return {
        "reader_lines_per_s": round(len(data) / times["vectorised"]),
        "reader_lines_per_s_line_by_line": round(len(data) / times["line_by_line"]),
        "reader_mb_per_s": round(size / 1e6 / times["vectorised"], 1),
    }


def main() -> None:
    parser = _harness.parser(
        "sparse_vs_dense", __doc__.split("\n")[0], quick="finish in < 5 minutes (quality on 20k labels)"
    )
    parser.add_argument("--data-dir", default="", help="real data for the quality part (train.txt, test.txt)")
    parser.add_argument("--variant", choices=["sparse", "dense", "timing"], help=argparse.SUPPRESS)
    parser.add_argument(
        "--labels",
        type=int,
        default=LABELS,
        help="labels of the quality part (synthetic data; e.g. 20000, where the dense model converges in minutes)",
    )
    parser.add_argument("--sweep-s", type=float, default=0.0, help="training seconds per swept learning rate")
    parser.add_argument(
        "--full-sweep",
        action="store_true",
        help="train every swept rate for the final budget and keep the best run (the fair tuning; slow)",
    )
    parser.add_argument(
        "--train-s", type=float, default=0.0, help="training-seconds budget of the final runs"
    )
    parser.add_argument("--train", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--test", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--dense-steps", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--budget-s", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--first-eval-s", type=float, default=0.5, help="training seconds before the first evaluation"
    )
    parser.add_argument(
        "--eval-growth", type=float, default=1.5, help="each evaluation interval is this much longer"
    )
    parser.add_argument(
        "--patience", type=int, default=6, help="evaluations in a row without a new best P@1 before stopping"
    )
    parser.add_argument(
        "--max-eval-interval-s",
        type=float,
        default=20.0,
        help="longest training-clock interval between evaluations",
    )
    parser.add_argument(
        "--min-train-s",
        type=float,
        default=30.0,
        help="training seconds before the plateau rule may stop a run",
    )
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="",
        help="training clock of the quality runs: process CPU seconds (default with one thread per run) or wall seconds",
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="quality runs side by side (each then gets 2 // N torch threads)",
    )
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--max-wall-s",
        type=float,
        default=0.0,
        help="wall-clock limit of the whole quality part: runs still going then stop (stopped: deadline)",
    )
    parser.add_argument(
        "--skip-timing",
        action="store_true",
        help="leave out the 670,091-label step timing (quality part only)",
    )
    parser.add_argument(
        "--lrs",
        default="",
        help="learning rates swept for both variants (0.001,0.003,0.01,0.03; --quick: 0.001,0.003,0.01)",
    )
    parser.add_argument(
        "--lrs-dense", default="", help="learning rates swept for the dense model (default: --lrs)"
    )
    parser.add_argument(
        "--lrs-sparse", default="", help="learning rates swept for the sparse model (default: --lrs)"
    )
    parser.add_argument("--num-active", type=int, default=4096, help="active neurons per sample (sparse)")
    parser.add_argument("--lr", type=float, default=2e-3, help=argparse.SUPPRESS)
    parser.add_argument("--num-bits", type=int, default=14, help="K: bits per hash code")
    parser.add_argument("--num-tables", type=int, default=8, help="L: hash tables")
    parser.add_argument("--rebuild-every", type=int, default=50, help="steps between table rebuilds")
    args = parser.parse_args()
    if args.variant == "timing":
        print(json.dumps(run_timing(args)))
        return
    if args.variant:
        args.threads = args.threads or 2
        args.clock = args.clock or "wall"
        print(json.dumps(run_variant(args)))
        return
    report = _harness.Report("sparse_vs_dense", args.out)
    load_before = [round(v, 2) for v in os.getloadavg()]  # the box is shared: its load before this run
    result: dict = {
        "labels": LABELS,
        "features": FEATURES,
        "hidden": HIDDEN,
        "batch": BATCH,
        "quick": args.quick,
    }
    lsh = dict(num_bits=args.num_bits, num_tables=args.num_tables, rebuild_every=args.rebuild_every)
    quality_start = time.time()
    result.update(reader_speed())
    timing = (
        None
        if args.skip_timing
        else child(
            "timing", num_active=args.num_active, dense_steps=6 if args.quick else 12, lr=args.lr, **lsh
        )
    )
    if args.quick:  # short budgets, few held-out points (exact top-k over 670k labels is costly)
        held_out = 256 if args.labels == LABELS else 2048  # exact top-k over 20k labels is cheap
        quality = dict(labels=args.labels, train=BATCH * 400, test=held_out, num_active=args.num_active)
        sweep_s, budget_s, lrs = 12.0, 60.0, [0.001, 0.003, 0.01]
        lrs = [float(x) for x in args.lrs.split(",")] if args.lrs else lrs
    else:
        quality = dict(labels=args.labels, train=BATCH * 2000, test=2048, num_active=args.num_active)
        sweep_s, budget_s, lrs = (
            60.0,
            900.0,
            [float(x) for x in (args.lrs or "0.001,0.003,0.01,0.03").split(",")],
        )
    lrs_of = {
        v: [float(x) for x in getattr(args, f"lrs_{v}").split(",")] if getattr(args, f"lrs_{v}") else lrs
        for v in ("dense", "sparse")
    }
    sweep_s, budget_s = args.sweep_s or sweep_s, args.train_s or budget_s
    quality["num_active"] = min(quality["num_active"], args.labels)
    if args.data_dir:
        quality["data_dir"] = args.data_dir
    threads = max(1, 2 // args.parallel)
    clock = args.clock or ("cpu" if threads == 1 else "wall")
    deadline = quality_start + args.max_wall_s if args.max_wall_s else 0.0
    common = dict(
        **quality,
        **lsh,
        patience=args.patience,
        eval_growth=args.eval_growth,
        max_eval_interval_s=args.max_eval_interval_s,
        min_train_s=args.min_train_s,
        threads=threads,
        clock=clock,
        deadline=deadline,
    )
    chosen, sweeps, runs, interior = {}, {}, {}, {}
    # --full-sweep: every swept rate trains for the final budget (to its plateau) and the best of those runs is the
    # result, so a rate that learns fast but peaks low cannot win on a short sweep budget.
    full = args.full_sweep

    def sweep_run(variant: str, lr: float) -> dict:
        if full:
            return child(variant, lr=lr, budget_s=budget_s, first_eval_s=args.first_eval_s, **common)
        return child(variant, lr=lr, budget_s=sweep_s, first_eval_s=sweep_s, **common)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel)
    swept_runs: dict[str, dict[float, dict]] = {"sparse": {}, "dense": {}}

    def sweep_all(jobs: list[tuple[str, float]]) -> None:
        futures = {job: pool.submit(sweep_run, *job) for job in jobs}
        for (variant, lr), future in futures.items():
            swept_runs[variant][lr] = future.result()

    # Dense runs first: they are the longest (the pool starts jobs in this order).
    sweep_all([(v, lr) for v in ("dense", "sparse") for lr in lrs_of[v]])
    # A best rate at the edge of the sweep is not tuned: extend the sweep past that edge (x3 steps).
    for _ in range(MAX_SWEEP_EXTENSIONS):
        more = []
        for variant in ("dense", "sparse"):
            swept = sorted(swept_runs[variant])
            best_lr = max(swept, key=lambda lr: swept_runs[variant][lr]["best_p_at_1"])
            if not swept[0] < best_lr < swept[-1]:
                more.append((variant, best_lr * 3 if best_lr == swept[-1] else best_lr / 3))
        if not more or (deadline and time.time() >= deadline):
            break
        sweep_all(more)
    pool.shutdown()
    for variant in ("sparse", "dense"):
        swept = sorted(swept_runs[variant])
        sweeps[variant] = {lr: swept_runs[variant][lr]["best_p_at_1"] for lr in swept}
        chosen[variant] = max(swept, key=lambda lr: sweeps[variant][lr])
        interior[variant] = swept[0] < chosen[variant] < swept[-1]
        runs[variant] = (
            swept_runs[variant][chosen[variant]]
            if full
            else child(
                variant, lr=chosen[variant], budget_s=budget_s, first_eval_s=args.first_eval_s, **common
            )
        )
    target = runs["dense"]["best_p_at_1"]
    t_sparse, t_dense = time_to(runs["sparse"]["curve"], target), time_to(runs["dense"]["curve"], target)
    if timing:
        result.update(
            step_ms_dense=round(timing["step_ms_dense"], 1),
            step_ms_sparse=round(timing["step_ms_sparse"], 1),
            speedup=round(timing["step_ms_dense"] / timing["step_ms_sparse"], 2),
            cpu_ms_per_step_dense=round(timing["cpu_ms_dense"], 1),
            cpu_ms_per_step_sparse=round(timing["cpu_ms_sparse"], 1),
            speedup_cpu_time=round(timing["cpu_ms_dense"] / timing["cpu_ms_sparse"], 2),
            active_fraction=round(args.num_active / LABELS, 5),
            timed_steps_dense=timing["timed_steps_dense"],
            timed_steps_sparse=timing["timed_steps_sparse"],
            rebuilds_in_timed_sparse_steps=timing["rebuilds_timed"],
        )
    result.update(
        num_active=args.num_active,
        quality_clock=clock,
        quality_threads_per_run=threads,
        quality_runs_side_by_side=args.parallel,
        sweep_runs={
            v: {
                str(lr): {
                    k: r[k] for k in ("best_p_at_1", "stopped", "train_s", "train_wall_s", "epochs", "steps")
                }
                for lr, r in sorted(swept_runs[v].items())
            }
            for v in swept_runs
        },
        quality_data="real files" if args.data_dir else "synthetic, Amazon-670K-shaped",
        quality_labels=quality["labels"],
        load_average_before=load_before,
        quality_num_active=quality["num_active"],
        lr_sweep={v: {str(lr): p for lr, p in sweeps[v].items()} for v in sweeps},
        lr_sparse=chosen["sparse"],
        lr_dense=chosen["dense"],
        sweep_budget_s=budget_s if full else sweep_s,
        full_sweep=full,
        budget_s=budget_s,
        best_p_at_1_sparse=runs["sparse"]["best_p_at_1"],
        best_p_at_1_dense=runs["dense"]["best_p_at_1"],
        p_at_1_sparse_best=runs["sparse"]["best_p_at_1"],
        p_at_1_dense_best=runs["dense"]["best_p_at_1"],
        dense_lr_interior=interior["dense"],
        sparse_lr_interior=interior["sparse"],
        dense_converged=converged(runs["dense"]["curve"]),
        sparse_converged=converged(runs["sparse"]["curve"]),
        gain_last_third_dense=last_third_gain(runs["dense"]["curve"]),
        gain_last_third_sparse=last_third_gain(runs["sparse"]["curve"]),
        time_to_p1_sparse=t_sparse,
        time_to_p1_dense=t_dense,
        time_to_p1_ratio=round(t_dense / t_sparse, 2) if t_sparse and t_dense else None,
        stopped_dense=runs["dense"]["stopped"],
        stopped_sparse=runs["sparse"]["stopped"],
        epochs_dense=runs["dense"]["epochs"],
        epochs_sparse=runs["sparse"]["epochs"],
        curve_sparse=runs["sparse"]["curve"],
        curve_dense=runs["dense"]["curve"],
        training_step_ms_dense=runs["dense"]["step_ms"],
        training_step_ms_sparse=runs["sparse"]["step_ms"],
        peak_rss_mb_sparse=round(runs["sparse"]["peak_rss_mb"], 1),
        peak_rss_mb_dense=round(runs["dense"]["peak_rss_mb"], 1),
        load_average_1min=round(os.getloadavg()[0], 2),
    )
    report.finish(result)


if __name__ == "__main__":
    main()
