"""A swarm training job run by the end-to-end tests as a real multi-process program.

``python tests/swarm_job.py '<json>'``: every peer process re-runs this script (Lightning's launcher); peer 0
writes the results (final state dict, per-step losses, swarm stats) to ``out`` when the run ends.
"""

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_swarm  # noqa: E402,F401
from examples.albert.data import AlbertDataModule  # noqa: E402
from examples.albert.model import Albert  # noqa: E402


class SeqModel(LightningModule):
    """Embedding-free regression model whose blocks are an nn.Sequential."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)))
        self.out = nn.Linear(16, 1)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.out(self.layers(self.inp(x))), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        # two parameter groups with their own hyper-parameters: the stage servers must keep them apart
        weights = [p for name, p in self.named_parameters() if name.endswith("weight")]
        others = [p for name, p in self.named_parameters() if not name.endswith("weight")]
        groups = [
            {"params": weights, "weight_decay": 0.05},
            {"params": others, "lr": 3 * self.lr, "weight_decay": 0.0},
        ]
        return torch.optim.SGD(groups, lr=self.lr)


class ArgBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, memory, *, scale: float, mask: torch.Tensor):
        return torch.tanh(self.lin(x) + memory * scale) * mask


class ListModel(SeqModel):
    """Blocks in an nn.ModuleList; the parent passes a memory tensor (needing grad), a float and a mask."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr)
        self.layers = nn.ModuleList(ArgBlock() for _ in range(4))
        self.mem = nn.Linear(6, 16)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h, memory = self.inp(x), self.mem(x)
        mask = (torch.arange(16) % 5 != 0).float().expand_as(h)
        for layer in self.layers:
            h = layer(h, memory, scale=0.5, mask=mask)
        loss = nn.functional.mse_loss(self.out(h), y)
        self.log("train_loss", loss)
        return loss


def regression_data(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(n, 6, generator=g)
    y = x[:, :1] * 2 - x[:, 1:2]
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)


class Chaos(Callback):
    """Writes this peer's process tree to ``pids_dir`` once training runs; SIGKILLs peer ``rank`` at ``step``."""

    def __init__(self, pids_dir: str | None, kill: dict | None) -> None:
        self.pids_dir, self.kill = pids_dir, kill or {}

    def on_train_start(self, trainer, pl_module):
        if self.pids_dir:
            pids = [os.getpid(), *_descendants(os.getpid())]
            with open(os.path.join(self.pids_dir, f"pids{trainer.global_rank}"), "w") as f:
                f.write(" ".join(map(str, pids)))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.kill.get("rank") and trainer.global_step == self.kill.get("step"):
            os.kill(os.getpid(), signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return []
    return [d for c in children for d in (c, *_descendants(c))]


class RecordLoss(Callback):
    def __init__(self) -> None:
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


class RecordBar(Callback):
    """What the default progress bar (Lightning's TQDM bar) shows after each batch."""

    def __init__(self) -> None:
        self.metrics: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        bar = trainer.progress_bar_callback
        self.metrics.append({"bar": type(bar).__name__, **bar.get_metrics(trainer, pl_module)})


def build(cfg: dict):
    seed_everything(cfg.get("seed", 0))
    if cfg["model"] == "albert":
        return Albert(**cfg.get("model_args", {})), AlbertDataModule(**cfg.get("data_args", {}))
    model = (SeqModel if cfg["model"] == "seq" else ListModel)(lr=cfg.get("lr", 0.1))
    return model, regression_data()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    model, data = build(cfg)
    strategy = lightning_swarm.SwarmStrategy(**cfg["strategy"]) if cfg.get("strategy") is not None else "auto"
    record, bar = RecordLoss(), RecordBar()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("layers.")}
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=cfg.get("devices", 1),
        max_steps=cfg["max_steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=bool(cfg.get("progress_bar")),
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[record, Chaos(cfg.get("pids_dir"), cfg.get("kill"))]
        + ([bar] if cfg.get("progress_bar") else []),
    )
    if isinstance(data, DataLoader):
        trainer.fit(model, data)
    else:
        trainer.fit(model, datamodule=data)
    if cfg.get("threads_dir"):  # every peer: the torch threads it computed with
        with open(os.path.join(cfg["threads_dir"], f"peer{trainer.global_rank}.json"), "w") as f:
            json.dump({"threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}, f)
    result = {"losses": record.losses, "initial": initial, "bar": bar.metrics}
    launcher = getattr(trainer.strategy, "_launcher", None)
    result["deaths"] = list(getattr(launcher, "deaths", []))
    if cfg.get(
        "evaluate"
    ):  # a second and third run of the same Trainer: test and predict through a new swarm
        result["test"] = trainer.test(model, datamodule=data, verbose=False)
        result["predictions"] = trainer.predict(model, datamodule=data)
    if trainer.global_rank == 0:
        torch.save({"state": model.state_dict(), **result}, cfg["out"])


if __name__ == "__main__":
    main()
