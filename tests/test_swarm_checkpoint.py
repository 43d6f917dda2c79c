"""The swarm's model comes home: ``trainer.save_checkpoint`` on a trainer gathers every stage from the live peers
into an ordinary Lightning checkpoint that the plain module loads without any swarm, and a swarm started from it
serves exactly its weights. Real peers (DHT, P2P) on 127.0.0.1: a Lightning trainer hosting stage 0 and a
server-only peer hosting stage 1."""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_swarm
from lightning_swarm.swarm import SwarmPeer, SwarmSettings

_runs = itertools.count()


class Net(LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.inp = nn.Linear(6, 16)
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layers(self.inp(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=4)


def _settings(run_id: str) -> dict:
    return dict(
        pipeline="layers",
        num_stages=2,
        compression="none",
        target_batch_size=4,
        run_id=run_id,
        matchmaking_time=0.5,
        request_timeout=10.0,
        no_peers_timeout=10.0,
        linger_timeout=30.0,
        rebalance_period=0.0,
    )


def _server(run_id: str, module: Net) -> tuple[SwarmPeer, threading.Thread]:
    """A server-only peer of stage 1 that stays until the trainer has finished: its ``leave`` runs in a thread,
    started once the trainer is in the swarm (see :class:`LeaveWhenDone`)."""
    peer = SwarmPeer(SwarmSettings(**_settings(run_id), role="server", stage=1))
    peer.start_dht()
    peer.join(module, [module.configure_optimizers()], training=True)
    return peer, threading.Thread(target=peer.leave, daemon=True)


class LeaveWhenDone(Callback):
    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread

    def on_train_start(self, trainer, pl_module) -> None:
        self.thread.start()


def _trainer(run_id: str, server: SwarmPeer, tmp_path: Path, max_steps: int, callbacks: list) -> Trainer:
    maddrs = [str(m) for m in server.dht.get_visible_maddrs()]
    strategy = lightning_swarm.SwarmStrategy(**_settings(run_id), stage=0, initial_peers=maddrs)
    return Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=callbacks,
    )


class SaveDuringTraining(Callback):
    """At batch 2: save a checkpoint, then run the swarm's forward on a fixed input."""

    def __init__(self, path: Path, x: torch.Tensor) -> None:
        self.path, self.x, self.swarm_output = path, x, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 2:
            trainer.save_checkpoint(self.path)
            with torch.no_grad():
                self.swarm_output = pl_module(self.x)


class CheckSeeded(Callback):
    """When training starts, the stage servers hold the checkpoint's pipeline."""

    def __init__(self, expected: dict[str, torch.Tensor], server: SwarmPeer) -> None:
        self.expected, self.server, self.checked = expected, server, False

    def on_train_start(self, trainer, pl_module) -> None:
        for peer, offset in ((trainer.strategy.peer, 0), (self.server, 2)):
            for key, value in peer.server.state_dict_local().items():
                index, rest = key.split(".", 1)
                assert torch.equal(value, self.expected[f"layers.{int(index) + offset}.{rest}"]), key
        self.checked = True


@pytest.mark.timeout(300)
def test_checkpoint_round_trip(tmp_path: Path) -> None:
    run_id = f"ckpt-{os.getpid()}-{next(_runs)}"
    torch.manual_seed(0)
    model = Net()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    server, thread = _server(run_id, Net())
    x = torch.randn(5, 6)
    saver = SaveDuringTraining(tmp_path / "during.ckpt", x)
    try:
        trainer = _trainer(run_id, server, tmp_path, max_steps=6, callbacks=[saver, LeaveWhenDone(thread)])
        trainer.fit(model, _data())
    finally:
        if thread.is_alive():
            thread.join(timeout=90)
        server.shutdown()
    assert saver.swarm_output is not None

    # during training: an ordinary checkpoint, loaded without any swarm, computes what the swarm computed
    plain = Net.load_from_checkpoint(tmp_path / "during.ckpt")
    assert isinstance(plain.layers, nn.Sequential)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), saver.swarm_output, rtol=0, atol=1e-6)
    changed = [
        k for k, v in plain.state_dict().items() if k.startswith("layers.") and not torch.equal(v, initial[k])
    ]
    assert len(changed) == 8, "both stages trained before the checkpoint"

    # after training: the module is whole again and saves like any other
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    after = Net.load_from_checkpoint(tmp_path / "after.ckpt")
    for key, value in model.state_dict().items():
        assert torch.equal(after.state_dict()[key], value), key

    # a swarm started from the checkpoint serves its weights: the trainer resumes with ckpt_path, the server is
    # built from the loaded module
    ckpt = torch.load(tmp_path / "during.ckpt", weights_only=False)["state_dict"]
    run_id2 = f"{run_id}-resumed"
    server2, thread2 = _server(run_id2, Net.load_from_checkpoint(tmp_path / "during.ckpt"))
    check = CheckSeeded(ckpt, server2)
    try:
        torch.manual_seed(123)  # other initial weights: they must not survive
        trainer2 = _trainer(
            run_id2, server2, tmp_path, max_steps=5, callbacks=[check, LeaveWhenDone(thread2)]
        )
        trainer2.fit(Net(), _data(), ckpt_path=tmp_path / "during.ckpt")
    finally:
        if thread2.is_alive():
            thread2.join(timeout=90)
        server2.shutdown()
    assert check.checked
