"""What the ALBERT example keeps of a run: :class:`TrainingHistory`, per-step losses, samples and traffic, and, when
``fit`` ends, the MLM loss of the whole trained model on the held-out text (evaluated in this process, the same way
for a swarm and a single process), written as JSON for the launcher's summary and plot.

It reads the swarm through what the strategy exposes (``trainer.strategy.peer``: its client's counters) and works
unchanged without a swarm. What a user watches while a swarm trains (samples/s, live peers per stage, bytes on the
wire, averaging rounds) is on Lightning's own progress bar: the strategy logs it.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


def swarm_peer(trainer: Trainer) -> Any:
    """The running swarm peer of ``trainer``, or None without a swarm (or outside a run)."""
    try:
        return trainer.strategy.peer
    except (AttributeError, RuntimeError):
        return None


class TrainingHistory(Callback):
    """Records the run and writes it as JSON to ``path`` when ``fit`` ends (nothing is written if ``path`` is None).

    The JSON holds, per microbatch of this trainer: ``step`` (the optimizer step it belongs to, from 1), ``loss``,
    ``time`` (s since the first batch began) and ``samples`` (so far); every ``progress_every`` microbatches the
    file is also rewritten (``"done": false``) so a launcher can follow the run. At the end: ``eval_loss`` (held-out
    MLM loss of the final model, computed in this process with ``Albert.evaluate``), ``val`` (validation losses
    logged during the run), the swarm's byte and call counters (``swarm``), ``stage_steps`` (optimizer steps of each
    stage) and ``fp32_boundary_bytes`` (what this trainer's remote stage calls would have moved as fp32).

    Args:
        path: where to write the JSON.
        progress_every: rewrite the file every this many microbatches.
    """

    def __init__(self, path: str | None = None, progress_every: int = 10) -> None:
        self.path, self.progress_every = path, progress_every
        self.record: dict[str, Any] = {}
        self._start: float | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # the clock starts with the first batch, after the strategy's start-up (a swarm trainer waits for the
        # stages' peers to come up)
        self._start = None
        self._microbatches = 0
        self.record = {
            "step": [],
            "loss": [],
            "time": [],
            "samples": [],
            "val": [],
            "done": False,
            "max_steps": trainer.max_steps,
        }

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._start is None:
            self._start = time.monotonic()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        loss = float(loss) * trainer.accumulate_grad_batches  # Lightning hands over loss / accumulation
        r = self.record
        self._microbatches += 1
        # the (1-based) optimizer step this microbatch belongs to
        r["step"].append(-(-self._microbatches // trainer.accumulate_grad_batches))
        r["loss"].append(float(loss))
        r["time"].append(time.monotonic() - self._start)
        r["samples"].append((r["samples"][-1] if r["samples"] else 0) + len(batch[0]))
        if self.path and self._microbatches % self.progress_every == 0:
            self._write()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or "val_loss" not in trainer.callback_metrics or not self.record:
            return
        self.record["val"].append([trainer.global_step, float(trainer.callback_metrics["val_loss"])])

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        peer = swarm_peer(trainer)
        if peer is not None and self.record:
            self.record["swarm"] = dict(peer.stats())
            # what this trainer's remote stage calls would have moved as fp32 (its in-process calls move nothing)
            self.record["fp32_boundary_bytes"] = self.record["swarm"].get("swarm/fp32_bytes", 0.0)
            self.record["num_stages"] = peer.settings.num_stages
            self.record["compression"] = peer.settings.compression
            try:  # optimizer steps the stages took (their hivemind epoch), from every live peer of each stage
                self.record["stage_steps"] = [
                    max((int(info.get("epoch", 0)) for info in peer.client.stage_info(k)), default=0)
                    for k in range(peer.settings.num_stages)
                ]
            except Exception:  # a diagnostic only: a stage that does not answer right now is left out
                pass

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # after the strategy's teardown: the pipeline is whole again, with the stages' final parameters
        if not self.record:
            return
        datamodule = trainer.datamodule
        if datamodule is not None and hasattr(pl_module, "evaluate"):
            self.record["eval_loss"] = pl_module.evaluate(datamodule.val_dataloader())
        self.record["done"] = True
        if self.path:
            self._write()

    def _write(self) -> None:
        assert self.path is not None
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.record, f)
        os.replace(tmp, self.path)
