"""A small Amazon-670K-style run for tests/test_dslide.py: ``python tests/_dslide_worker.py --devices N ...``.

With ``--devices > 1`` (or ``--strategy dslide``) Lightning's own launcher starts the other ranks by running
this script again, exactly as a user's ``train.py`` would be. Rank 0 writes what it saw to ``--out``.

``--repeat N`` runs the two-rank training ``N`` times as two "nodes" (``num_nodes=2``, ``NODE_RANK``), each rank a
child forked from this process after the imports (so a run costs the training, not 10 s of imports), each child
leaving through the normal interpreter exit like a user's script. The exit status of every rank is written to
``--out``/repeat.json; ``--fail-rank R`` makes rank ``R`` raise in its second training step, and ``--sigterm-rank R``
adds a run in which rank ``R`` receives SIGTERM in its second training step (of 8).

``--suite`` runs, from one import, the runs that tests/test_dslide.py compares (each in a child forked after the
imports, results in ``--out``/<run>/result.json): ``plain`` (one process, 6 steps) side by side with ``dslide2``
(``devices=2``: Lightning's own launcher starts rank 1 by running this command again, as a user's ``train.py``) and
``dslide2_gloo`` (2 ranks started as 2 nodes, ``DSlideStrategy(collectives="gloo")``);
then, from ``dslide2``'s checkpoint, ``dslide3`` (3 ranks started as 3 nodes) side by side with ``plain_resumed``, both
with a model whose output bias gets a second (zero) gradient (``ZeroRegularisedXCModel``).

Every process trains with one torch thread (the ranks of a 2-core box share it; more threads only add OpenMP
spinning when the box is busy).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

import lightning_swarm  # noqa: E402,F401
from examples.amazon670k.data import XCData, XCDataModule, XCDataset, collate_sparse  # noqa: E402
from examples.amazon670k.model import XCModel  # noqa: E402
from lightning_swarm.strategy.dslide import DSlideStrategy  # noqa: E402

if "dslide" not in StrategyRegistry:
    DSlideStrategy.register_strategies(StrategyRegistry)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (not tests._helpers': that imports hivemind)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


class FailingXCModel(XCModel):
    """Raises in the second training step on one rank (the other ranks are then waiting in a collective), or
    sends itself SIGTERM there."""

    fail_rank = -1
    sigterm_rank = -1

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1 and self.global_rank == self.fail_rank:
            raise ValueError(f"deliberate failure on rank {self.global_rank}")
        if batch_idx == 1 and self.global_rank == self.sigterm_rank:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)


class ZeroRegularisedXCModel(XCModel):
    """Adds ``0 * output_layer.bias.sum()``, built before the forward: the bias then gets a second gradient,
    which reaches it after the input layer's all-reduce (its node is older). The loss and the training are the
    plain model's; D-SLIDE must leave the bias's update to the step (one gradient is not all of it)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        zero = 0.0 * self.output_layer.bias.sum()
        return super().training_step(batch, batch_idx) + zero


def repeated_rank(rank: int, port: int, out: Path, fail_rank: int, sigterm_rank: int = -1) -> None:
    """One rank of a two-node run: train 2 steps, gather a checkpoint, predict with the sharded top-k (with
    ``sigterm_rank``: train up to 8 steps, and write the step at which the rank stopped)."""
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0"
    )
    # Registered before the strategy's own exit handler, so it runs after it (atexit is last in, first out).
    atexit.register(_record_group_state_at_exit, out / f"rank{rank}.exit.json")
    seed_everything(0, verbose=False)
    FailingXCModel.fail_rank = fail_rank
    FailingXCModel.sigterm_rank = sigterm_rank
    model = FailingXCModel(**MODEL)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        strategy="dslide",
        max_steps=2 if sigterm_rank < 0 else 8,
        logger=CSVLogger(out, name="logs", version=0),  # rank 0 writes: dslide/bytes_per_step at every step
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    try:
        trainer.fit(model, data_module())
    except SystemExit:  # Lightning's SIGTERMException: record where this rank stopped, then leave as it would
        (out / f"rank{rank}.stopped.json").write_text(json.dumps({"global_step": trainer.global_step}))
        raise
    trainer.save_checkpoint(out / "model.ckpt")  # collective: gathers the shards
    predictions(model)  # collective: the sharded top-k


def _record_group_state_at_exit(path: Path) -> None:
    path.write_text(json.dumps({"process_group_alive": torch.distributed.is_initialized()}))


def _freeze_imports() -> None:
    """Move the objects of the imports to the garbage collector's permanent generation before forking.

    A forked child's interpreter exit otherwise walks (and, through reference counts, copies) the ~400 MB of
    objects that ``import torch, lightning`` made: about 1.2 s of CPU per child, more than its training. The child
    still leaves through the normal interpreter exit (atexit handlers, finalisation, the collection of everything
    it created itself: the model, the Trainer, the process group), which is what the exit test is about.
    """
    gc.collect()
    gc.freeze()


def repeat(times: int, out: Path, fail_rank: int, sigterm_rank: int = -1, timeout: float = 120.0) -> None:
    """Run the two-node training ``times`` times, then once more with a failure on ``fail_rank`` (if >= 0), then
    once more with SIGTERM to ``sigterm_rank`` (if >= 0).

    Records every rank's exit status (negative: killed by that signal; ``None``: hung and killed).
    """
    runs, seconds, started = [], [], time.monotonic()
    _freeze_imports()
    extra = ["fail"] * (fail_rank >= 0) + ["sigterm"] * (sigterm_rank >= 0)
    for run in range(times + len(extra)):
        run_started = time.monotonic()
        kind = extra[run - times] if run >= times else ""
        failing = fail_rank if kind == "fail" else -1
        terminated = sigterm_rank if kind == "sigterm" else -1
        run_dir = out / f"run{run}"
        run_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:  # the child: this rank's whole life, then the ordinary interpreter exit
                log = os.open(run_dir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(log, 1)
                os.dup2(log, 2)
                repeated_rank(rank, port, run_dir, failing, terminated)
                sys.exit(0)
            pids.append(pid)
        statuses: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        while len(statuses) < len(pids) and time.monotonic() < deadline:
            for rank, pid in enumerate(pids):
                if rank not in statuses:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        statuses[rank] = os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        for rank, pid in enumerate(pids):  # a hung rank is killed and reported as None
            if rank not in statuses:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                statuses[rank] = None  # type: ignore[assignment]
        runs.append([statuses[0], statuses[1]])
        seconds.append(round(time.monotonic() - run_started, 2))
    (out / "repeat.json").write_text(json.dumps(runs))
    (out / "seconds.json").write_text(json.dumps(seconds))
    print(f"{len(runs)} runs in {time.monotonic() - started:.1f} s", flush=True)


def train(
    out: Path,
    devices: int = 1,
    strategy: str = "dslide",
    steps: int = 6,
    resume: str | None = None,
    num_nodes: int = 1,
    model_cls: type[XCModel] = XCModel,
    collectives: str | None = None,
) -> None:
    """One Trainer run of the small model; rank 0 writes what it saw to ``out``/result.json. ``collectives``:
    ``DSlideStrategy(collectives=...)`` instead of the ``strategy`` name."""
    torch.set_num_threads(1)
    seed_everything(0)
    model = model_cls(**MODEL)
    recorder = Recorder()
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy if collectives is None else DSlideStrategy(collectives=collectives),  # type: ignore[arg-type]
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[recorder],
    )
    trainer.fit(model, data_module(), ckpt_path=resume)
    trainer.save_checkpoint(out / "model.ckpt")
    group = getattr(trainer.strategy, "_shard_group", None)
    if group is not None:  # where this rank ran and how it waited for collectives
        placement = {"cores": sorted(os.sched_getaffinity(0)), "spin_s": group.spin_s}
        (out / f"rank{trainer.global_rank}.placement.json").write_text(json.dumps(placement))
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
            "early_updates": getattr(trainer.strategy, "early_updates", 0),
        }
        (out / "result.json").write_text(json.dumps(result))


def _fork(log: Path, env: dict[str, str], fn: Any, **kwargs: Any) -> int:
    """Run ``fn(**kwargs)`` in a child forked from this process (after the imports), output to ``log``."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.update(env)
            fn(**kwargs)
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        sys.exit(code)  # the ordinary interpreter exit (the strategy's exit handler runs)
    return pid


def _wait(children: dict[str, tuple[int, Path]]) -> None:
    """Wait for the children; if one failed, raise with the end of its log."""
    failed = []
    for name, (pid, log) in children.items():
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            failed.append(f"{name} ({os.waitstatus_to_exitcode(status)}):\n{log.read_text()[-3000:]}")
    if failed:
        raise RuntimeError("suite runs failed: " + "\n".join(failed))


def suite(out: Path) -> None:
    """The runs tests/test_dslide.py compares, from one import (see the module docstring)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":  # rank 1 of `dslide2`, started by Lightning's launcher
        train(out / "dslide2", devices=2)
        return
    for name in ("plain", "dslide2", "dslide2_gloo", "dslide3", "plain_resumed"):
        (out / name).mkdir(parents=True, exist_ok=True)
    _freeze_imports()
    local = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    gloo_port = str(free_port())
    _wait({
        "plain": (_fork(out / "plain.log", {}, train, out=out / "plain", strategy="auto"), out / "plain.log"),
        "dslide2": (_fork(out / "dslide2.log", local, train, out=out / "dslide2", devices=2), out / "dslide2.log"),
        **{  # the same run with the step's collectives through gloo (2 ranks started as 2 nodes)
            f"dslide2_gloo rank {rank}": (
                _fork(out / f"dslide2_gloo_rank{rank}.log",
                      {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": gloo_port, "NODE_RANK": str(rank),
                       "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
                      train, out=out / "dslide2_gloo", num_nodes=2, collectives="gloo"),
                out / f"dslide2_gloo_rank{rank}.log",
            )
            for rank in range(2)
        },
    })  # fmt: skip
    ckpt = str(out / "dslide2" / "model.ckpt")
    port = str(free_port())
    children = {
        f"dslide3 rank {rank}": (
            _fork(
                out / f"dslide3_rank{rank}.log",
                {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(rank), "WORLD_SIZE": "3",
                 "LOCAL_RANK": "0"},
                train, out=out / "dslide3", steps=10, resume=ckpt, num_nodes=3, model_cls=ZeroRegularisedXCModel,
            ),
            out / f"dslide3_rank{rank}.log",
        )
        for rank in range(3)
    }  # fmt: skip
    log = out / "plain_resumed.log"
    children["plain_resumed"] = (
        _fork(
            log,
            {},
            train,
            out=out / "plain_resumed",
            strategy="auto",
            steps=10,
            resume=ckpt,
            model_cls=ZeroRegularisedXCModel,
        ),
        log,
    )
    _wait(children)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="dslide")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeat", type=int, default=0)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--sigterm-rank", type=int, default=-1)
    parser.add_argument("--suite", action="store_true")
    args = parser.parse_args()
    if args.repeat:
        repeat(args.repeat, Path(args.out), args.fail_rank, args.sigterm_rank)
        return
    if args.suite:
        suite(Path(args.out))
        return
    train(Path(args.out), devices=args.devices, strategy=args.strategy, steps=args.steps, resume=args.resume)


if __name__ == "__main__":
    main()
