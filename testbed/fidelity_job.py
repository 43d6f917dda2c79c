"""One training run of a model family (``testbed/families.py``), in one plain Lightning process or in a local
swarm, recorded for the fidelity comparisons (``tests/test_fidelity.py``, ``benchmarks/fidelity_matrix.py``).

    python testbed/fidelity_job.py '<json config>'      # what the swarm runs use: every peer re-runs this script

or ``run(config)`` in-process (the single-process runs). The config:

- ``family``, ``model`` (constructor arguments, e.g. ``{"dropout": 0.1}``), ``batch_size``, ``steps``, ``seed``;
- ``swarm``: ``SwarmStrategy`` arguments, or ``None`` for one plain process; ``devices``: peers of the local swarm;
- ``ddp``: without ``swarm``, Lightning's DDP on that many CPU devices (gloo) instead of one process;
- ``val_every``: run Lightning's validation loop (through the swarm, when there is one) every this many steps;
- ``dropout_seed``: reseed the global RNG after the model is built: the same initialisation, other dropout masks
  (the noise floor of a comparison with dropout on);
- ``threads``: ``torch.set_num_threads`` for this process (``None``: torch's default);
- ``settle_s``: a diagnostic: the trainer sleeps this long after every optimizer step, so that the stages' own
  (asynchronous) steps have landed before its next forward;
- ``out``: where peer 0 (the trainer) saves the result with ``torch.save``.

The result: the pipeline's parameters and buffers before and after training (``initial``, ``final``; the names
of the parameters in ``parameters``), per optimizer
step the training loss and the learning rate of the first group (``loss``, ``lr``), ``val`` (``[step, val_loss]``),
``held_out`` (the final model's held-out loss, computed in this process after the run), ``own_hashes`` (with
several trainers: a hash of each trainer's own parameters, the modules outside the pipeline, at the end, by rank;
with DDP: each rank's), ``trainer_steps``
(``trainer.global_step``), ``stage_steps`` (each stage's optimizer steps, read from its servers after they have
applied every gradient they received; ``None`` without a swarm), ``stats`` (the swarm client's counters) and
``seconds``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything  # noqa: E402

import lightning_swarm  # noqa: E402
from testbed.families import TRAINER_ARGS, build  # noqa: E402


def pipeline_state(model: LightningModule) -> dict[str, torch.Tensor]:
    """A CPU copy of the pipeline's entries (parameters and buffers) of ``model.state_dict()``."""
    prefix = f"{model.pipeline}."
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items() if k.startswith(prefix)}


def own_hash(model: LightningModule) -> str:
    """A hash of the parameters outside the pipeline (a trainer's own)."""
    from lightning_swarm.swarm.training.trainer_sync import params_hash

    prefix = f"{model.pipeline}."
    return params_hash([p for name, p in model.named_parameters() if not name.startswith(prefix)])


def stage_steps(trainer: Trainer) -> list[int] | None:
    """Optimizer steps each stage took so far (its servers' hivemind epoch, the most of any live peer), or
    ``None`` without a swarm. Each stage's state is fetched first: a server answers that only after it has handed
    every gradient it received to its optimizer (``StageServer.flush``), so the counts are final."""
    try:
        peer = trainer.strategy.peer  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return None
    steps = []
    for k in range(peer.settings.num_stages):
        peer.client.fetch_stage_state(k)
        steps.append(max((int(info.get("epoch", 0)) for info in peer.client.stage_info(k)), default=-1))
    return steps


class Record(Callback):
    """Per optimizer step: training loss and learning rate; validation losses; the stages' step counts at the end."""

    def __init__(self, settle_s: float = 0.0) -> None:
        self.settle_s = settle_s
        self.loss: list[float] = []
        self.lr: list[float] = []
        self.val: list[list[float]] = []
        self.stage_steps: list[int] | None = None
        self.stats: dict[str, float] = {}
        self.step_starts: list[float] = []  # time.perf_counter() at every batch's start, then at the end

    def on_train_batch_start(self, *_: Any) -> None:
        self.step_starts.append(time.perf_counter())

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.loss.append(float(loss))
        self.lr.append(float(trainer.optimizers[0].param_groups[0]["lr"]))
        if self.settle_s:
            time.sleep(self.settle_s)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking and "val_loss" in trainer.callback_metrics:
            self.val.append([trainer.global_step, float(trainer.callback_metrics["val_loss"])])

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.step_starts.append(time.perf_counter())
        self.stage_steps = stage_steps(trainer)
        try:
            self.stats = dict(trainer.strategy.peer.stats())  # type: ignore[attr-defined]
        except (AttributeError, RuntimeError):
            self.stats = {}


def run(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Train ``cfg`` (see the module docstring); returns the result on peer 0 (and saves it to ``cfg["out"]`` if
    given), ``None`` on the other peers."""
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))
    seed_everything(cfg.get("seed", 0), verbose=False)
    steps, family = int(cfg["steps"]), cfg["family"]
    model = build(family, batch_size=cfg["batch_size"], steps=steps, **cfg.get("model", {}))
    initial = pipeline_state(model)
    parameters = [name for name, _ in model.named_parameters() if name.startswith(f"{model.pipeline}.")]
    if cfg.get("dropout_seed") is not None:
        torch.manual_seed(int(cfg["dropout_seed"]))
    swarm = cfg.get("swarm")
    strategy: Any = "ddp" if cfg.get("ddp") else "auto"
    if swarm is not None:
        strategy = lightning_swarm.SwarmStrategy(pipeline=model.pipeline, **swarm)
    record = Record(cfg.get("settle_s", 0.0))
    val_every = cfg.get("val_every")
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=cfg.get("devices", 2) if swarm is not None else int(cfg.get("ddp") or 1),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1.0 if val_every else 0,
        val_check_interval=val_every or None,
        callbacks=[record],
        **{**TRAINER_ARGS[family], **cfg.get("trainer", {})},
    )
    started = time.monotonic()
    trainer.fit(model)
    seconds = time.monotonic() - started
    trainers = int((swarm or {}).get("num_trainers") or cfg.get("devices", 2)) if swarm is not None else 1
    if cfg.get("out") and 0 < trainer.global_rank < max(trainers, int(cfg.get("ddp") or 1)):
        torch.save(
            {"own_hash": own_hash(model), "step_starts": record.step_starts},
            f"{cfg['out']}.rank{trainer.global_rank}",
        )
    if trainer.global_rank != 0:
        return None
    result = {
        "family": family,
        "initial": initial,
        "parameters": parameters,
        "final": pipeline_state(model),
        "loss": record.loss,
        "lr": record.lr,
        "val": record.val,
        "held_out": model.held_out_loss(),
        "trainer_steps": trainer.global_step,
        "stage_steps": record.stage_steps,
        "stats": record.stats,
        "seconds": seconds,
        "own_hashes": {0: own_hash(model)},
        "step_starts": {0: record.step_starts},
        "trainer_sync": getattr(trainer.strategy, "trainer_sync_stats", {}),
    }
    if cfg.get("out"):
        torch.save(result, cfg["out"])
    return result


def launch(
    cfg: dict[str, Any], timeout: float, run: Callable[..., subprocess.CompletedProcess] = subprocess.run
) -> dict[str, Any]:
    """Run ``cfg`` (a swarm run) as its own program, ``python testbed/fidelity_job.py '<cfg>'`` (Lightning's
    launcher starts the other peers from it), and return peer 0's result. ``run`` starts it (``subprocess.run``
    or one with the same arguments).

    Raises:
        RuntimeError: the run failed; the message holds the end of its output.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)  # a run started from inside a peer must start its own swarm
    with tempfile.TemporaryDirectory(prefix="fidelity-") as tmp:
        out = os.path.join(tmp, "result.pt")
        proc = run(
            [sys.executable, os.path.abspath(__file__), json.dumps({**cfg, "out": out})],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(
                f"The swarm run of {cfg['family']!r} failed ({proc.returncode}):\n{proc.stderr[-8000:]}"
            )
        result = torch.load(out, weights_only=False)
        for name in sorted(os.listdir(tmp)):  # the other ranks' hashes of their own parameters
            if name.startswith("result.pt.rank"):
                rank = int(name.rsplit("rank", 1)[1])
                saved = torch.load(os.path.join(tmp, name), weights_only=False)
                result["own_hashes"][rank] = saved["own_hash"]
                result["step_starts"][rank] = saved["step_starts"]
        result["stderr"] = proc.stderr
        return result


def _gap(reference: dict[str, Any], other: dict[str, Any], keys: list[str]) -> float:
    def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([state[k].detach().flatten().double() for k in keys])

    initial, ref, oth = flat(reference["initial"]), flat(reference["final"]), flat(other["final"])
    return float((oth - ref).norm() / (ref - initial).norm())


def parameter_gap(reference: dict[str, Any], other: dict[str, Any]) -> float:
    """How far ``other``'s trained pipeline parameters are from ``reference``'s, relative to how far training moved
    the reference's: ``|final_other - final_ref| / |final_ref - initial|`` over every parameter of the pipeline."""
    return _gap(reference, other, reference["parameters"])


def buffer_gap(reference: dict[str, Any], other: dict[str, Any]) -> float | None:
    """:func:`parameter_gap` of the pipeline's floating buffers (BatchNorm's running statistics); ``None`` if it
    has none."""
    names = set(reference["parameters"])
    keys = [k for k, v in sorted(reference["final"].items()) if k not in names and v.is_floating_point()]
    return _gap(reference, other, keys) if keys else None


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
