"""A job for the training-contract tests: one small module trained with a chosen Lightning setting, either in one
plain process or in a local swarm (one trainer, 2 stages, compression "none").

``python tests/_contract_job.py '<json>'``; peer 0 saves ``{"state", "losses", "stage_steps", "lrs"}`` to ``out``.
Config keys: ``swarm`` (bool), ``steps``, ``scheduler`` (None, "warmup", "decay", "step_epoch", "onecycle", "plateau"),
``clip`` (None or [value, "norm"|"value"]), ``precision``, ``accumulate``, ``manual`` (two optimizers, manual
optimization), ``manual_clip`` (with ``manual``: clip the first optimizer's
gradients by norm to this value), ``zero_after_backward`` (with ``manual``: the second optimizer's ``zero_grad()``
after the backward), ``optimizer`` ("sgd"|"adamw"), ``fp16_scaler`` ("16-mixed" with a CPU loss scaler), ``residual`` (the input layer's output added to the
pipeline's), ``batchnorm`` (BatchNorm1d in every block), ``dropout`` (float), ``trainers`` (in a swarm: that many trainers,
the local swarm's first peers), ``ddp`` (not in a swarm: Lightning's DDP with that many devices), ``out``.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_swarm  # noqa: E402


class Net(LightningModule):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg
        p = cfg.get("dropout", 0.0)
        self.inp = nn.Linear(6, 16)
        # a trainer-side BatchNorm (outside the pipeline): its buffers are the trainers' own
        self.own_norm = nn.BatchNorm1d(16) if cfg.get("own_batchnorm") else nn.Identity()
        bn = cfg.get("batchnorm")
        self.layers = nn.Sequential(
            *(
                nn.Sequential(
                    nn.Linear(16, 16), *([nn.BatchNorm1d(16)] if bn else []), nn.Tanh(), nn.Dropout(p)
                )
                for _ in range(4)
            )
        )
        self.out = nn.Linear(16, 1)
        self.automatic_optimization = not cfg.get("manual", False)
        self.cfg_step_s = float(cfg.get("step_s", 0.0))

    def forward(self, x):
        h = self.own_norm(self.inp(x))
        z = self.layers(h)
        return self.out(z + h if self.cfg.get("residual") else z)

    def training_step(self, batch, batch_idx):
        if self.cfg_step_s:  # a step that takes this long at least (see test_contract's schedule test)
            time.sleep(self.cfg_step_s)
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=False)
        if self.automatic_optimization:
            return loss
        first, second = self.optimizers()
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        if self.cfg.get("zero_after_backward"):
            second.zero_grad()
        if self.cfg.get("manual_clip"):  # clipping by the norm of the first optimizer's parameters
            self.clip_gradients(
                first, gradient_clip_val=self.cfg["manual_clip"], gradient_clip_algorithm="norm"
            )
        first.step()
        if batch_idx % 2 == 1:  # the pipeline's second half steps every other batch
            second.step()
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):
        cfg = self.cfg
        if cfg.get("manual"):
            half = list(self.layers[2:].parameters())
            rest = [p for p in self.parameters() if all(p is not q for q in half)]
            return torch.optim.SGD(rest, lr=0.05), torch.optim.SGD(half, lr=0.2, momentum=0.5)
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        other = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        groups = [{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}]
        if cfg.get("optimizer") == "lbfgs":
            opt = torch.optim.LBFGS(self.parameters(), lr=0.1)
        elif cfg.get("optimizer", "sgd") == "adamw":
            opt = torch.optim.AdamW(groups, lr=0.01)
        else:
            opt = torch.optim.SGD(groups, lr=0.05 * cfg.get("lr_scale", 1.0), momentum=0.9)
        kind = cfg.get("scheduler")
        steps = cfg["steps"]
        if kind is None:
            return opt
        if kind == "warmup":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 5))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if kind == "decay":  # changes at every step: shows which step count drives it
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if kind == "step_epoch":
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.3)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}
        if kind == "onecycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if kind == "plateau":
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.2, patience=0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}
        raise ValueError(kind)


class SaveAtEpochEnd(Callback):
    """Saves a full checkpoint (with optimizer states) at the end of the first epoch, on the trainer."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module):
        if self.path and trainer.current_epoch == 0 and trainer.global_rank == 0:
            trainer.save_checkpoint(self.path)


class DumpStage(Callback):
    """At the end of training, every peer writes the parameters of the stage it serves to ``<out>.peer<rank>``."""

    def __init__(self, out: str, enabled: bool) -> None:
        self.out, self.enabled = out, enabled

    def on_train_end(self, trainer, pl_module):
        server = trainer.strategy.peer.server if self.enabled else None
        if server is not None:
            lrs = (
                [float(g["lr"]) for g in server.optimizer.param_groups]
                if server.optimizer is not None
                else []
            )
            state = {
                "stage": server.stage,
                "state": server.state_dict_local(),
                "info": server.info(),
                "kept_hits": server.backend.kept_hits,  # whole backwards that reused a kept forward
                "lrs": lrs,
            }
            torch.save(state, f"{self.out}.peer{trainer.global_rank}")


class KillAt(Callback):
    """``kill: [rank, step]``: the peer of that rank SIGKILLs itself when its training reaches that global step."""

    def __init__(self, kill: list | None) -> None:
        self.kill = kill

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.kill and trainer.global_rank == self.kill[0] and trainer.global_step >= self.kill[1]:
            os.kill(os.getpid(), 9)


class DelayStart(Callback):
    """``delay: [rank, seconds]``: the peer of that rank starts training that much later (a trainer that joins a run
    in progress)."""

    def __init__(self, delay: list | None) -> None:
        self.delay = delay

    def on_train_start(self, trainer, pl_module):
        if self.delay and trainer.global_rank == self.delay[0]:
            time.sleep(float(self.delay[1]))


class Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.owns_buffers: bool | None = None
        self.batches: list[torch.Tensor] = []  # the inputs of every training batch (see replay)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch[0].clone())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))

    def on_train_end(self, trainer, pl_module):
        # with several trainers: whether this trainer's stage calls updated the stages' buffers at the end (it led)
        peer = getattr(trainer.strategy, "peer", None)
        client = peer.client if peer is not None else None
        self.owns_buffers = client.updates_buffers if client is not None else None


def data(n: int = 64, batch: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 6, generator=g)
    y = x[:, :1] * 2 - x[:, 1:2] + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def replay(cfg: dict, model: Net) -> None:
    """``replay: path``: no training, only train-mode forwards of the batches a trainer recorded (the ``batches`` of
    its ``.rank<r>`` file): the buffers its batches give when the parameters do not move (the reference of the
    buffer semantics)."""
    batches = torch.load(cfg["replay"], weights_only=False)["batches"]
    model.train()
    with torch.no_grad():
        for x in batches:
            model(x)
    torch.save({"state": model.state_dict()}, cfg["out"])


def main() -> None:
    cfg = json.loads(sys.argv[1])
    seed_everything(cfg.get("seed", 0))
    model = Net(cfg)
    if cfg.get("replay"):
        return replay(cfg, model)
    record = Record()
    swarm = cfg.get("swarm", False)
    peers_per_stage = cfg.get("peers_per_stage", 1)
    trainers = int(cfg.get("trainers", 1))
    strategy = (
        lightning_swarm.SwarmStrategy(
            **{
                "pipeline": "layers",
                "num_stages": 2,
                "num_trainers": trainers,
                "compression": "none",
                **cfg.get("strategy", {}),
            }
        )
        if swarm
        else ("ddp" if cfg.get("ddp") else "auto")
    )
    clip = cfg.get("clip")
    loader = data(batch=int(cfg.get("batch", 8)))
    plugins = []
    if cfg.get(
        "fp16_scaler"
    ):  # "16-mixed" with a loss scaler on the CPU (Lightning alone would pick bf16 there)
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugins.append(
            MixedPrecision(
                "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=float(cfg["fp16_scaler"]))
            )
        )
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=max(2 * peers_per_stage, trainers) if swarm else int(cfg.get("ddp") or 1),
        max_steps=cfg["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2 if cfg.get("scheduler") == "plateau" else 0,
        precision=None if plugins else cfg.get("precision", "32-true"),
        plugins=plugins or None,
        accumulate_grad_batches=cfg.get("accumulate", 1),
        gradient_clip_val=clip[0] if clip else None,
        gradient_clip_algorithm=clip[1] if clip else None,
        callbacks=[
            record,
            KillAt(cfg.get("kill")),
            DelayStart(cfg.get("delay")),
            SaveAtEpochEnd(cfg.get("save")),
            DumpStage(cfg["out"], swarm),
        ],
    )
    val = loader if cfg.get("scheduler") == "plateau" else None
    trainer.fit(model, loader, val, ckpt_path=cfg.get("resume"))
    stage_steps = dict(trainer.strategy.stage_steps) if swarm else {}
    early = trainer.strategy.early_stage_steps if swarm else 0
    deferred = trainer.strategy.deferred_backwards if swarm else 0
    configs = trainer.lr_scheduler_configs
    schedule_steps = int(configs[0].scheduler.last_epoch) if configs else None
    if cfg.get("all_ranks") and swarm and trainer.global_rank < trainers:
        own = {k: v for k, v in model.state_dict().items() if not k.startswith("layers.")}
        torch.save(
            {
                "own": own,
                "sync": trainer.strategy.trainer_sync_stats,
                # whether this trainer's stage calls updated the stages' buffers at the end (it led the steps)
                "owns_buffers": record.owns_buffers,
                "batches": record.batches,
                "global_step": trainer.global_step,
                "lr": float(trainer.optimizers[0].param_groups[0]["lr"]),
            },
            f"{cfg['out']}.rank{trainer.global_rank}",
        )
    if trainer.global_rank == 0:
        torch.save(
            {
                "state": model.state_dict(),
                "losses": record.losses,
                "lrs": record.lrs,
                "stage_steps": stage_steps,
                "early_stage_steps": early,
                "deferred_backwards": deferred,
                "global_step": trainer.global_step,
                "schedule_steps": schedule_steps,
            },
            cfg["out"],
        )


if __name__ == "__main__":
    main()
