"""D-SLIDE vs DDP on an Amazon-670K-shaped network over simulated 1 Gbit/s Ethernet.

    python benchmarks/dslide_vs_ddp.py [--quick]      (as root: creates network namespaces)

Every rank runs in its own network namespace, joined to the others by a veth pair through a bridge (in a
namespace of its own), each link limited with ``tc`` (token bucket) to ``--rate-mbit`` in both directions.
The full run measures 4 and 2 ranks, each at that rate and with no limit; ``--quick`` measures 4 ranks at that
rate only, with batch 128 and fewer steps. The processes are started the way several machines would be: one
process per "node" (``num_nodes=ranks``, ``NODE_RANK``/``MASTER_ADDR``/``MASTER_PORT``), no launcher.

The same network (135,909 sparse features -> 128 ReLU -> 670,091 labels, ~103M parameters, batch 256) is
trained with ``strategy="dslide"`` (SparseLSHLinear output, sharded) and with Lightning's ``"ddp"`` (gloo,
dense ``nn.Linear`` output, the gradients of all parameters all-reduced every step), with the same global
batch per optimizer step (every D-SLIDE rank works on the whole batch; each DDP rank on ``batch / ranks``).
Step time is the mean interval between consecutive batches after the warm-up steps; bytes per step are the
logical payload of the collectives (the strategy's own count for D-SLIDE; every gradient's size for DDP) and,
measured, the bytes each rank sent on its veth (``/sys/class/net/eth0/statistics/tx_bytes``) per step.

The last stdout line is one JSON object: the 4-rank figures at the top level, all runs in ``runs``.
Note: on a small machine all ranks share its cores, so compute is oversubscribed for both strategies.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HIDDEN = 128


# ----------------------------------------------------------------------------------- worker (one rank)
def _tx_bytes() -> int | None:
    try:
        return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())
    except OSError:
        return None


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO))
    import torch
    import torch.nn.functional as F
    from lightning.pytorch import Callback, Trainer, seed_everything

    import lightning_swarm  # noqa: F401
    from examples.amazon670k.data import XCDataModule
    from examples.amazon670k.model import XCModel
    from lightning_swarm.layers import SparseInputLinear
    from lightning_swarm.strategy.dslide import DSlideStrategy

    class StepClock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.tx: list[int | None] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.times.append(time.perf_counter())
            self.tx.append(_tx_bytes())

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.times.append(time.perf_counter())
            self.tx.append(_tx_bytes())

    class DenseGradInputLinear(SparseInputLinear):
        """The same input layer with a dense gradient: DDP cannot all-reduce sparse gradients."""

        def forward(self, indices: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
            out = F.embedding_bag(indices, self.weight, offsets, mode="sum", per_sample_weights=values)
            return out + self.bias

    seed_everything(0)
    dslide = args.strategy == "dslide"
    model = XCModel(output="sparse" if dslide else "dense", hidden=HIDDEN, num_active=4096, lr=1e-4)
    if not dslide:
        dense_input = DenseGradInputLinear(model.input_layer.in_features, HIDDEN)
        dense_input.load_state_dict(model.input_layer.state_dict())
        model.input_layer = dense_input
    data = XCDataModule(data_dir=args.data_dir, batch_size=args.batch)
    clock = StepClock()
    strategy = DSlideStrategy() if dslide else "ddp"
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=args.ranks,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[clock],
    )
    trainer.fit(model, data)
    warm = args.warmup
    steps = len(clock.times) - 1 - warm
    step_s = (clock.times[-1] - clock.times[warm]) / steps
    tx = clock.tx
    tx_per_step = (tx[-1] - tx[warm]) / steps if tx[-1] is not None and tx[warm] is not None else None
    if dslide:
        payload = sum(trainer.strategy.last_step_bytes.values())
    else:  # DDP all-reduces the gradient of every parameter; sparse ones as indices + values
        payload = sum(p.numel() * p.element_size() for p in model.parameters())
    result = {
        "rank": trainer.global_rank,
        "step_ms": 1000 * step_s,
        "timed_steps": steps,
        "payload_bytes_per_step": payload,
        "tx_bytes_per_step": tx_per_step,
        "threads": torch.get_num_threads(),
    }
    (Path(args.out) / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


# ----------------------------------------------------------------------------------- harness
def make_data(directory: Path, num_samples: int) -> None:
    """Amazon-670K-shaped synthetic points, written once in the repository format for every rank to read."""
    sys.path.insert(0, str(REPO))
    from examples.amazon670k.data import make_synthetic, write_xc_file

    write_xc_file(directory / "train.txt", make_synthetic(num_samples, sample_seed=0))
    write_xc_file(directory / "test.txt", make_synthetic(16, sample_seed=1))


def run_one(
    net: Any,
    strategy: str,
    ranks: int,
    steps: int,
    warmup: int,
    batch: int,
    data_dir: Path,
    out: Path,
    timeout: float,
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // ranks)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--strategy", strategy]
    cmd += ["--ranks", str(ranks), "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
    # Same global batch for both: D-SLIDE ranks all work on the whole batch, DDP ranks on 1/ranks of it each.
    per_rank_batch = batch if strategy == "dslide" else batch // ranks
    cmd += ["--batch", str(per_rank_batch), "--data-dir", str(data_dir)]
    procs = []
    logs = []
    try:
        for rank in range(ranks):
            env = {
                "MASTER_ADDR": net.address(0),
                "MASTER_PORT": "29533",
                "NODE_RANK": str(rank),
                "LOCAL_RANK": "0",
                "WORLD_SIZE": str(ranks),
                "OMP_NUM_THREADS": str(threads),
                "PYTHONWARNINGS": "ignore",
            }
            log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 (closed below)
            logs.append(log)
            procs.append(net.popen(rank, cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(
            f"{strategy} with {ranks} ranks did not finish in {timeout:.0f} s; logs in {out}"
        ) from exc
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tail = (out / f"rank{failed[0]}.log").read_text()[-3000:]
        raise RuntimeError(f"{strategy} rank {failed[0]} failed:\n{tail}")
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    tx = [r["tx_bytes_per_step"] for r in per_rank]
    return {
        "step_ms": max(r["step_ms"] for r in per_rank),
        "timed_steps": per_rank[0]["timed_steps"],
        "payload_bytes_per_step": per_rank[0]["payload_bytes_per_step"],
        "tx_bytes_per_step_per_rank": (sum(tx) / len(tx)) if all(t is not None for t in tx) else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="4 ranks at --rate-mbit only, batch 128, fewer steps (under 5 minutes)",
    )
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help="link rate of the limited runs")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default 256; 128 with --quick)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="dslide", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _netns import VirtualCluster

    if args.quick:
        settings = [(4, args.rate_mbit)]  # the headline only; the full run adds 2 ranks and unlimited links
        steps = {"dslide": (8, 2), "ddp": (2, 1)}
    else:
        settings = [(4, args.rate_mbit), (2, args.rate_mbit), (4, None), (2, None)]
        steps = {"dslide": (40, 3), "ddp": (6, 2)}
    batch = args.batch or (128 if args.quick else 256)
    runs = []
    with tempfile.TemporaryDirectory(prefix="dslide_vs_ddp_") as tmp:
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        make_data(data_dir, batch * (max(n for n, _ in steps.values()) + 1))
        for index, (ranks, rate) in enumerate(settings):
            with VirtualCluster(ranks, rate_mbit=rate, net=index) as net:
                row: dict[str, Any] = {"ranks": ranks, "link_mbit": rate}
                for strategy in ("dslide", "ddp"):
                    n, warm = steps[strategy]
                    started = time.monotonic()
                    out = Path(tmp) / f"{index}-{strategy}"
                    res = run_one(net, strategy, ranks, n, warm, batch, data_dir, out, timeout=900)
                    print(
                        f"[{ranks} ranks, {rate or 'unlimited'} Mbit/s] {strategy}: {res['step_ms']:.0f} ms/step, "
                        f"{res['payload_bytes_per_step']:,} B/step payload, "
                        f"{(res['tx_bytes_per_step_per_rank'] or 0):,.0f} B/step sent per rank "
                        f"({time.monotonic() - started:.0f} s)",
                        flush=True,
                    )
                    row[f"step_ms_{strategy}"] = round(res["step_ms"], 1)
                    row[f"bytes_per_step_{strategy}"] = res["payload_bytes_per_step"]
                    row[f"tx_bytes_per_step_per_rank_{strategy}"] = res["tx_bytes_per_step_per_rank"]
                    row[f"timed_steps_{strategy}"] = res["timed_steps"]
                row["speedup"] = round(row["step_ms_ddp"] / row["step_ms_dslide"], 2)
                row["comm_reduction"] = round(1 - row["bytes_per_step_dslide"] / row["bytes_per_step_ddp"], 6)
                tx_d, tx_p = row["tx_bytes_per_step_per_rank_dslide"], row["tx_bytes_per_step_per_rank_ddp"]
                row["comm_reduction_measured"] = round(1 - tx_d / tx_p, 6) if tx_d and tx_p else None
                runs.append(row)
    headline = next(r for r in runs if r["ranks"] == 4 and r["link_mbit"] == args.rate_mbit)
    summary = {**headline, "batch": batch, "cpu_cores": os.cpu_count(), "quick": args.quick, "runs": runs}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
