"""SLIDE output layer vs dense output layer on Amazon-670K-shaped data, side by side.

Both variants train the same network, ``SparseInputLinear(135909 -> 128) -> ReLU -> output``,
on the same generated data (``examples/amazon670k/data.py: make_synthetic``) for the same
number of steps, batch 256, ``torch.set_num_threads(2)``:

- ``sparse``: output ``SparseLSHLinear`` (LSH active set) + ``active_set_loss`` + ``LazyAdam``;
- ``dense``: output ``nn.Linear`` + full softmax with the same soft targets (``1/|Y|``)
  + ``torch.optim.Adam`` (the input layer uses ``LazyAdam`` in both).

Step times (``step_ms_*``, ``speedup``) come from one child process that holds both networks
at full size and interleaves 10 sparse steps with 1 dense step, so load from other
processes on the box hits both alike; the sparse steps include the table rebuilds at their
amortised rate. ``speedup_cpu_time`` is the same ratio in process CPU time, and
``load_average_1min`` says how busy the box was. Quality runs each variant in its own child
process (same data, same steps), which also gives the peak RSS per variant. P@1/P@5 are
measured on held-out points with the exact top-k. ``--quick`` (< 5 min) times steps at
full size but measures P@k on a 20,000-label version of the data (reported as
``quality_labels``), because a dense 670k-way model needs far more steps than 5 minutes
allow to learn anything. The last stdout line is one JSON object.

Usage: ``python benchmarks/sparse_vs_dense.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from examples.amazon670k.data import XCData, collate_sparse, make_synthetic  # noqa: E402
from lightning_swarm.layers import LazyAdam, SparseInputLinear, SparseLSHLinear, active_set_loss  # noqa: E402
from lightning_swarm.layers.metrics import PrecisionAtK  # noqa: E402

FEATURES, LABELS, HIDDEN, BATCH = 135_909, 670_091, 128, 256


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
        for idx, off, val, lab in batches(data, torch.arange(len(data))):
            h = F.relu(self.hidden(idx, off, val))
            if self.variant == "sparse":
                _, top = self.out.topk(h, 5, mode="exact")
            else:
                top = self.out(h).topk(5, dim=1).indices
            metric.update(top, lab)
        self.out.train()
        return {k: float(v) for k, v in metric.compute().items()}


def run_variant(args: argparse.Namespace) -> dict:
    """Train and evaluate one variant in this process; returns its figures."""
    torch.set_num_threads(2)
    torch.manual_seed(0)
    train = make_synthetic(args.train, FEATURES, args.labels, seed=0)
    test = make_synthetic(args.test, FEATURES, args.labels, seed=0, sample_seed=1)
    net = Net(args.variant, args.labels, args)
    step_times: list[float] = []
    losses: list[float] = []
    gen = torch.Generator().manual_seed(0)
    for _epoch in range(args.epochs):
        for batch in batches(train, torch.randperm(len(train), generator=gen)):
            start = time.perf_counter()
            losses.append(net.train_step(batch))
            step_times.append(time.perf_counter() - start)
    warm = step_times[3:] if len(step_times) > 6 else step_times
    p = net.precision(test)
    result = {
        "step_ms": 1000.0 * sum(warm) / len(warm),
        "steps": len(step_times),
        "p_at_1": p["p@1"],
        "p_at_5": p["p@5"],
        "first_loss": losses[0],
        "last_loss": sum(losses[-10:]) / len(losses[-10:]),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
    }
    if args.variant == "sparse":
        result["rebuilds"] = net.out.num_rebuilds
    return result


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
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"variant {variant} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="finish in < 5 minutes (quality on 20k labels)")
    parser.add_argument("--variant", choices=["sparse", "dense", "timing"], help=argparse.SUPPRESS)
    parser.add_argument("--labels", type=int, default=LABELS, help=argparse.SUPPRESS)
    parser.add_argument("--train", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--test", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--dense-steps", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--num-active", type=int, default=4096, help="active neurons per sample (sparse)")
    parser.add_argument("--lr", type=float, default=2e-3, help="learning rate of both variants")
    parser.add_argument("--num-bits", type=int, default=14, help="K: bits per hash code")
    parser.add_argument("--num-tables", type=int, default=8, help="L: hash tables")
    parser.add_argument("--rebuild-every", type=int, default=50, help="steps between table rebuilds")
    args = parser.parse_args()
    if args.variant == "timing":
        print(json.dumps(run_timing(args)))
        return
    if args.variant:
        print(json.dumps(run_variant(args)))
        return

    result: dict = {
        "labels": LABELS,
        "features": FEATURES,
        "hidden": HIDDEN,
        "batch": BATCH,
        "quick": args.quick,
    }
    active = args.num_active
    lsh = dict(
        num_bits=args.num_bits, num_tables=args.num_tables, rebuild_every=args.rebuild_every, lr=args.lr
    )
    timing = child("timing", num_active=active, dense_steps=6 if args.quick else 12, **lsh)
    if args.quick:  # quality on a 20k-label problem: a 670k-way dense model learns little in 5 minutes
        quality = dict(labels=20_000, train=BATCH * 100, test=4096, epochs=2, num_active=1024)
    else:
        quality = dict(labels=LABELS, train=BATCH * 200, test=4096, epochs=1, num_active=active)
    q_sparse = child("sparse", **quality, **lsh)
    q_dense = child("dense", **quality, **lsh)
    result.update(
        step_ms_dense=round(timing["step_ms_dense"], 1),
        step_ms_sparse=round(timing["step_ms_sparse"], 1),
        speedup=round(timing["step_ms_dense"] / timing["step_ms_sparse"], 2),
        cpu_ms_per_step_dense=round(timing["cpu_ms_dense"], 1),
        cpu_ms_per_step_sparse=round(timing["cpu_ms_sparse"], 1),
        speedup_cpu_time=round(timing["cpu_ms_dense"] / timing["cpu_ms_sparse"], 2),
        load_average_1min=round(os.getloadavg()[0], 2),
        active_fraction=round(active / LABELS, 5),
        num_active=active,
        num_bits=args.num_bits,
        num_tables=args.num_tables,
        timed_steps_dense=timing["timed_steps_dense"],
        timed_steps_sparse=timing["timed_steps_sparse"],
        rebuilds_in_timed_sparse_steps=timing["rebuilds_timed"],
        quality_labels=quality["labels"],
        quality_num_active=quality["num_active"],
        quality_train_steps=q_sparse["steps"],
        p_at_1_dense=round(q_dense["p_at_1"], 4),
        p_at_1_sparse=round(q_sparse["p_at_1"], 4),
        p_at_5_dense=round(q_dense["p_at_5"], 4),
        p_at_5_sparse=round(q_sparse["p_at_5"], 4),
        loss_first_last_dense=[round(q_dense["first_loss"], 3), round(q_dense["last_loss"], 3)],
        loss_first_last_sparse=[round(q_sparse["first_loss"], 3), round(q_sparse["last_loss"], 3)],
        training_step_ms_dense=round(q_dense["step_ms"], 1),
        training_step_ms_sparse=round(q_sparse["step_ms"], 1),
        peak_rss_mb_sparse=round(q_sparse["peak_rss_mb"], 1),
        peak_rss_mb_dense=round(q_dense["peak_rss_mb"], 1),
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
