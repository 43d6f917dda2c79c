"""A small Amazon-670K-style run for tests/test_dslide.py: ``python tests/_dslide_worker.py --devices N ...``.

With ``--devices > 1`` (or ``--strategy dslide``) Lightning's own launcher starts the other ranks by running
this script again, exactly as a user's ``train.py`` would be. Rank 0 writes what it saw to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

import lightning_swarm  # noqa: E402,F401
from examples.amazon670k.data import XCData, XCDataModule, XCDataset, collate_sparse  # noqa: E402
from examples.amazon670k.model import XCModel  # noqa: E402
from lightning_swarm.strategy.dslide import DSlideStrategy  # noqa: E402

if "dslide" not in StrategyRegistry:
    DSlideStrategy.register_strategies(StrategyRegistry)

MODEL = {
    "num_features": 300,
    "num_labels": 400,
    "hidden": 16,
    "num_active": 48,
    "num_bits": 4,
    "num_tables": 6,
    "bucket_cap": None,  # with a cap each shard caps its own part of a bucket: not bit-identical
    "rebuild_every": 3,
    "lr": 1e-2,
}
BATCH = 16


class OrderedXCData(XCDataModule):
    """The example's data, shuffled by the sampler Lightning would inject under the DSlideStrategy (one replica,
    seed 0), so that the plain single-process reference run sees the batches in the same order."""

    def _loader(self, data: XCData, shuffle: bool) -> DataLoader:
        dataset = XCDataset(data)
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=0)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, collate_fn=collate_sparse)


def data_module() -> OrderedXCData:
    return OrderedXCData(
        synthetic_samples=400,
        synthetic_test_samples=64,
        num_features=MODEL["num_features"],
        num_labels=MODEL["num_labels"],
        batch_size=BATCH,
        seed=0,
    )


class Recorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.bytes: list[dict[str, int]] = []
        self.label_widths: list[int] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))
        self.label_widths.append(int(batch[3].shape[1]))
        if isinstance(trainer.strategy, DSlideStrategy):
            self.bytes.append(trainer.strategy.last_step_bytes)


def predictions(model: XCModel) -> tuple[torch.Tensor, torch.Tensor]:
    dm = data_module()
    dm.setup()
    indices, offsets, values, _ = next(iter(dm.test_dataloader()))
    model.eval()
    with torch.no_grad():
        return model.top_labels(indices, offsets, values, k=5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="dslide")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    seed_everything(0)
    model = XCModel(**MODEL)
    recorder = Recorder()
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[recorder],
    )
    trainer.fit(model, data_module(), ckpt_path=args.resume)
    out = Path(args.out)
    trainer.save_checkpoint(out / "model.ckpt")
    scores, ids = predictions(model)
    if trainer.global_rank == 0:
        result = {
            "losses": recorder.losses,
            "bytes": recorder.bytes,
            "label_widths": recorder.label_widths,
            "logged_loss": float(trainer.callback_metrics["train/loss"]),
            "scores": scores.tolist(),
            "ids": ids.tolist(),
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
        }
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
