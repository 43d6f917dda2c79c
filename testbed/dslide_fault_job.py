"""A small D-SLIDE job whose ranks are SIGKILLed on purpose: what ``tests/test_dslide_restarts.py`` and
``benchmarks/dslide_faults.py`` run.

    python testbed/dslide_fault_job.py --out DIR [--ranks 4] [--steps 30] [--every 5] [--kill-rank 2]
        [--kill-steps 13,26] [--max-restarts 3] [--width small|wide] [--nodes 1]

``--ranks N`` > 1 trains with ``Trainer(strategy=DSlideStrategy(checkpoint_every_n_steps=--every,
max_restarts=--max-restarts), devices=N)``: the process started supervises ranks 0..N-1, each a run of this
command, as a user's ``train.py``. In the job's restart number ``r`` (0 for the first run), rank ``--kill-rank`` (or its
``r``-th, cyclically, when it lists several) sends itself SIGKILL at the start of optimizer step ``--kill-steps[r]`` (a real SIGKILL: no handler, no cleanup,
its sockets closed by the kernel); the strategy then brings the job back from its last checkpoint. ``--ranks 1``
is the uninterrupted reference: the same network, data order and steps in one plain process.

Under ``torchrun --nnodes=M --nproc-per-node=N/M --max-restarts=R`` give ``--nodes M --max-restarts 0``:
``devices=N/M, num_nodes=M``, torchrun restarts the ranks (``r`` is then the restart number the ranks agree on).

The job validates before and after ``fit``. Rank 0 writes the trained model to ``DIR/final.ckpt`` and
``DIR/result.json`` at the end: the steps done, the validation P@1 before and after, the wall time from the first
start to the end of ``fit``, and the restarts the strategy recorded (``DIR/checkpoints/restarts.jsonl``).
Every process trains with one torch thread.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

import lightning_swarm  # noqa: E402,F401
from examples.amazon670k.data import XCData, XCDataModule, XCDataset, collate_sparse  # noqa: E402
from examples.amazon670k.model import XCModel  # noqa: E402
from lightning_swarm.strategy.dslide import DSlideStrategy  # noqa: E402
from lightning_swarm.strategy.dslide_restarts import RESTART_ENV  # noqa: E402

WIDTHS = {  # (features, labels, hidden, active, bits, tables, training samples, held-out samples, batch)
    "small": (300, 400, 16, 48, 4, 6, 800, 200, 16),
    "wide": (20_000, 20_000, 64, 512, 8, 8, 8_000, 1_000, 64),
}
STARTED_ENV = "DSLIDE_FAULT_JOB_STARTED"  # when the first run of the job started (kept across restarts)


class OrderedXCData(XCDataModule):
    """The example's data, shuffled by the sampler Lightning injects under the DSlideStrategy (one replica, seed
    0), so that the single-process reference sees the batches in the same order."""

    def _loader(self, data: XCData, shuffle: bool) -> DataLoader:
        dataset = XCDataset(data)
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=0)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, collate_fn=collate_sparse)


class KillAt(Callback):
    """Rank ``ranks[r % len(ranks)]`` sends itself SIGKILL at the start of optimizer step ``steps[r]`` of the job's
    restart ``r``."""

    def __init__(self, ranks: list[int], steps: list[int]) -> None:
        self.ranks, self.steps = ranks, steps

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, i: int) -> None:
        restart = int(os.environ.get(RESTART_ENV) or 0)
        if (
            restart < len(self.steps)
            and trainer.global_rank == self.ranks[restart % len(self.ranks)]
            and trainer.global_step == self.steps[restart]
        ):
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5, help="optimizer steps between sharded checkpoints")
    parser.add_argument(
        "--kill-rank", default="2", help="comma-separated: the rank killed in restart r is the r-th"
    )
    parser.add_argument("--kill-steps", default="13", help="comma-separated; empty: no kill")
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--width", choices=sorted(WIDTHS), default="small")
    parser.add_argument("--nodes", type=int, default=1, help="machines (torchrun's --nnodes)")
    args = parser.parse_args()
    os.environ.setdefault(STARTED_ENV, repr(time.time()))  # the ranks inherit it, restarted ones too
    started = float(os.environ[STARTED_ENV])
    out = Path(args.out)
    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    features, labels, hidden, active, bits, tables, samples, held_out, batch = WIDTHS[args.width]
    model = XCModel(num_features=features, num_labels=labels, hidden=hidden, num_active=active, num_bits=bits,
                    num_tables=tables, bucket_cap=None, rebuild_every=5, lr=1e-2)  # fmt: skip
    data = OrderedXCData(synthetic_samples=samples, synthetic_test_samples=held_out, num_features=features,
                         num_labels=labels, batch_size=batch, seed=0)  # fmt: skip
    kills = [int(s) for s in args.kill_steps.split(",") if s]
    if args.ranks > 1:
        strategy: Any = DSlideStrategy(
            checkpoint_every_n_steps=args.every,
            checkpoint_dir=out / "checkpoints",
            max_restarts=args.max_restarts,
        )
    else:
        strategy = "auto"
    trainer = Trainer(
        accelerator="cpu",
        devices=args.ranks // args.nodes,
        num_nodes=args.nodes,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=10**6,  # validated once, after fit
        callbacks=[KillAt([int(r) for r in args.kill_rank.split(",")], kills)]
        if args.ranks > 1 and kills
        else [],
        default_root_dir=out,
    )
    # a validation first (the ranks start here, before fit; the strategy's restarts must still work in fit)
    first = trainer.validate(model, data, verbose=False)[0]
    trainer.fit(model, data)
    fit_s = time.time() - started
    trainer.save_checkpoint(out / "final.ckpt", weights_only=True)  # the whole model (collective)
    metrics = trainer.validate(model, data, verbose=False)[0]
    if trainer.global_rank == 0:
        restarts_file = out / "checkpoints" / "restarts.jsonl"
        restarts = (
            [json.loads(line) for line in restarts_file.read_text().splitlines()]
            if restarts_file.exists()
            else []
        )
        result = {
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
            "p_at_1": float(metrics["val/p@1"]),
            "p_at_1_first": float(first["val/p@1"]),
            "fit_s": round(fit_s, 2),
            "restarts": restarts,
            "held_out": held_out,
        }
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
