"""D-SLIDE model parallelism on CPU clusters as a Lightning strategy.

Every rank runs the same batches. The wide sparse layers of the LightningModule (``SparseInputLinear`` by
input features, ``SparseLSHLinear`` by output neurons) are replaced by sharded versions: each rank owns a
contiguous range of input features, resp. output neurons with its own hash tables
(``lightning_swarm.layers.sharded``). Per step the ranks exchange only small per-batch tensors: the partial
hidden activations (all-reduce ``[B, H]``: each rank sums the batch's pairs of its own features), the LSH query
codes (all-gather ``[B, L]`` int32, each rank hashing its slice of the batch, only where hashing the whole batch
would cost more than the collective), the active-set priorities (all-gather ``[1, k]`` float64 per rank, so that the active set is exactly the single-process one),
each shard's per-sample softmax max and sum of exponentials packed with the logits of the labels it owns
(all-gather ``[B, 2 + Ymax]`` per rank), and the gradient with respect to the hidden activations (all-reduce
``[B, H]``).
Parameters outside the sharded layers are replicated and their gradients are summed over ranks after backward.

Every rank computes the value of the whole network's loss; its gradient reaches only the rank's own logits,
and the sum over ranks is the single-process gradient. A loss term that does not go through the sharded
``SparseLSHLinear`` (a regulariser on a replicated parameter, say) is therefore counted once per rank: divide
it by ``trainer.world_size``.

Data: every rank loads the same batch: each rank needs the labels of the whole batch for its part of the
active set and the softmax, and picks the pairs of its own input features out of it. Like for DDP, Lightning injects a shuffling
``DistributedSampler`` for training, here with one replica (``distributed_sampler_kwargs``), so every rank draws
the same permutation (seeded with ``PL_GLOBAL_SEED``). Each batch is checked across ranks (one all-reduce of
three integers: "have a batch" and a fingerprint of its contents): when one rank runs out of data all ranks
end the epoch together, and ranks that were given different batches stop with an error instead of training
on garbage.

Process group lifetime: the gloo group is created in ``setup_environment`` and lives until the process ends,
because collectives still run after ``fit`` (``trainer.save_checkpoint`` gathers the shards, the sharded top-k
merges every rank's). It is destroyed explicitly at interpreter exit (a gloo group left to the interpreter's
teardown can abort the process with "terminate called without an active exception" after a successful run), and
at once when ``fit`` fails, so that the other ranks, blocked in a collective, fail fast instead of waiting for the
timeout. Rank 0 of a ``devices=N`` run also waits (up to ``child_exit_timeout`` seconds) for the ranks Lightning's
launcher started before it exits: it hosts the rendezvous store they use, and a parent should not leave orphans.

Memory: wide layers created in ``LightningModule.configure_model`` are born sharded (each rank allocates and
initialises only its rows, with the values a single process would give them, ``lightning_swarm.layers.init``);
layers created in ``__init__`` exist whole on every rank until ``setup`` keeps each rank's rows (fine for small
models). Gradients are row-sparse and the optimizer state is per shard.

Checkpoints: ``trainer.save_checkpoint`` writes one ordinary Lightning checkpoint, the one a single-process run
would write (full layers and optimizer state), streamed shard by shard to rank 0's file
(``lightning_swarm.layers.checkpoint``): saving needs no whole layer in any process. It loads into the plain
LightningModule, and a sharded run on any number of ranks resumes from it (memory-mapped: each rank reads its
rows). With ``checkpoint_every_n_steps`` the strategy also writes sharded checkpoints (a folder, each rank its own
part), and with ``max_restarts`` a ``devices=N`` job comes back from the last one when a rank dies
(``lightning_swarm.strategy.dslide_restarts``).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import subprocess
import threading
import time
import warnings
import weakref
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_swarm.layers.checkpoint import load_sharded, save_sharded, save_streamed
from lightning_swarm.layers.distributed import CommStats, ShardGroup
from lightning_swarm.layers.init import sharded_init
from lightning_swarm.layers.mesh import SocketMesh, reachable_address
from lightning_swarm.layers.optim import LazyAdam
from lightning_swarm.layers.shard_plan import (
    LockStepLoader,
    ShardPlan,
    shard_lightning_module,
    shard_optimizer_state,
    streamed_optimizer_state,
)
from lightning_swarm.layers.sparse_linear import SparseLSHLinear
from lightning_swarm.strategy.dslide_restarts import (
    FAILED_AT_ENV,
    RESTART_ENV,
    AutoCheckpoint,
    RestartingLauncher,
)
from lightning_swarm.strategy.loop_state import gradients_fixed_after_backward, logs_written_this_step

log = logging.getLogger(__name__)


class DSlideStrategy(DDPStrategy):
    """D-SLIDE: shard the wide sparse layers across CPU processes, exchange only per-batch tensors.

    Processes are started like DDP's (Lightning's launchers; ``devices``, ``num_nodes``, ``MASTER_ADDR`` /
    ``MASTER_PORT`` or ``torchrun``) and set up over ``torch.distributed`` (gloo); a step's collectives travel
    over direct sockets between the ranks (``collectives``). Bytes moved per training step are counted and logged
    as ``dslide/bytes_per_step``.

    Args:
        accelerator: the accelerator; D-SLIDE is meant for CPUs.
        parallel_devices: the devices of this node (one process each); set by the Trainer.
        cluster_environment: how ranks and the main address are found; set by the Trainer.
        checkpoint_io: how checkpoints are written; ``trainer.save_checkpoint`` writes one ordinary checkpoint
            with the full (gathered) layers, loadable without this strategy.
        precision_plugin: the precision plugin; only 32-bit precision is tested.
        process_group_backend: ``torch.distributed`` backend; ``"gloo"`` (the only one tested on CPU).
        timeout: how long a collective may wait for the other ranks before failing.
        start_method: ``"popen"`` runs the script once per process (like ``strategy="ddp"``); ``"spawn"``,
            ``"fork"`` or ``"forkserver"`` start processes from the calling one (like ``"ddp_spawn"``).
        log_bytes: log the bytes sent per step (``dslide/bytes_per_step``) through ``LightningModule.log``, at the
            steps whose logs the logger writes (every ``log_every_n_steps``).
        child_exit_timeout: seconds rank 0 waits at exit for the processes Lightning's launcher started (then it
            kills them).
        overlap_updates: update the sharded output layers' parameters while the backward's hidden-gradient
            all-reduce is in flight (their part of the step's ``LazyAdam`` update, the same update), instead of
            after the backward. Used only where nothing between backward and step can change their gradients: one
            ``LazyAdam``, automatic optimization, 32-bit precision, no gradient clipping, no
            ``on_after_backward``, ``on_before_optimizer_step``, ``optimizer_step`` or
            ``configure_gradient_clipping`` of the module's own or ``on_after_backward`` /
            ``on_before_optimizer_step`` of a callback; elsewhere the step is as before.
        pin_cores: with several ranks on this machine (``devices=N``), give each rank its own share of the cores
            it may run on (CPU affinity, set before the process group starts, so gloo's threads share it), as
            separate machines would have: a rank's threads then stay on its cores, next to the data it works on.
            Nothing is pinned with one rank per machine, or with fewer cores than ranks.
        spin_wait: seconds a rank waiting for a collective keeps its core busy (yielding it to any other thread
            ready to run) before it blocks. A blocked rank lets its core go idle, and waking an idle core when
            the other ranks' data arrives can cost milliseconds (a virtual machine's halted vCPU, a deep C-state;
            ``benchmarks/collective_latency.py`` times a gloo all-reduce blocking and spinning); MPI libraries poll the same way. ``None`` (default): 0.2 where this rank has a core for
            each of its torch threads, else 0. Whatever the value, a rank whose thread keeps waiting for a CPU
            (cores shared with other busy processes, such as more ranks than cores) blocks instead.
        collectives: ``"socket"`` (default): the step's collectives travel over direct TCP connections between
            every pair of ranks, sent and received by the calling thread itself (``lightning_swarm.layers.mesh``;
            ``benchmarks/collective_latency.py`` times it against the gloo path); ``"gloo"``: through the process
            group, waited for as ``spin_wait`` says. Checkpoints and setup use gloo either way.
        checkpoint_every_n_steps: write a sharded checkpoint every this many optimizer steps (each rank its own
            rows and optimizer state, in parallel, to ``checkpoint_dir/step=<step>/rank<r>.ckpt``; the last two
            are kept), for restarts; ``None``: none.
        checkpoint_dir: the folder of those checkpoints, on a file system every rank reads; ``None``:
            ``<Trainer(default_root_dir)>/dslide_checkpoints``.
        max_restarts: with ``devices=N`` on one machine, how many times the job comes back by itself when a rank
            dies (rank 0 included): the process you started then runs no rank itself but supervises all N, as
            torchrun's agent does; it kills what is left of the ranks, starts them again and every rank resumes
            from the job's last sharded checkpoint (each restart logged with what was lost, and appended to
            ``checkpoint_dir/restarts.jsonl``). 0: a dead rank ends the job. Under ``torchrun --max-restarts``
            leave it 0: torchrun restarts the ranks, and they resume from the job's last checkpoint.
    """

    strategy_name = "dslide"

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str = "gloo",
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        log_bytes: bool = True,
        child_exit_timeout: float = 120.0,
        overlap_updates: bool = True,
        pin_cores: bool = True,
        spin_wait: float | None = None,
        collectives: Literal["socket", "gloo"] = "socket",
        checkpoint_every_n_steps: int | None = None,
        checkpoint_dir: _PATH | None = None,
        max_restarts: int = 0,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._log_bytes = log_bytes
        self._child_exit_timeout = child_exit_timeout
        self._shard_group = ShardGroup()
        self._plan: ShardPlan | None = None
        self._last_step_bytes: dict[str, int] = {}
        self._loaders: weakref.WeakSet[LockStepLoader] = weakref.WeakSet()
        self._sigterm_received = False
        self._overlap_updates = overlap_updates
        self._early = _EarlyUpdates()
        if spin_wait is not None and spin_wait < 0:
            raise ValueError(
                f"DSlideStrategy(spin_wait={spin_wait}): give seconds >= 0, or None (automatic)."
            )
        if collectives not in ("socket", "gloo"):
            raise ValueError(f"DSlideStrategy(collectives={collectives!r}): use 'socket' or 'gloo'.")
        self._pin_cores = pin_cores
        self._spin_wait = spin_wait
        self._collectives = collectives
        if checkpoint_every_n_steps is not None and checkpoint_every_n_steps < 1:
            raise ValueError(
                f"DSlideStrategy(checkpoint_every_n_steps={checkpoint_every_n_steps}): give a number of steps >= 1, "
                "or None for no automatic checkpoints."
            )
        if max_restarts < 0:
            raise ValueError(f"DSlideStrategy(max_restarts={max_restarts}): give a number >= 0.")
        self._checkpoint_every = checkpoint_every_n_steps
        self._checkpoint_dir = checkpoint_dir
        self._max_restarts = max_restarts
        self._saving_sharded = False  # writing a sharded checkpoint (each rank its own part)
        self._loaded_sharded = False  # the checkpoint being restored is a sharded one
        self._resume_in_epoch = False  # the training epoch resumes where a sharded checkpoint left it

    @property
    @override
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Model parallel: every rank must see the whole batch, so Lightning's sampler gets one replica.
        return {"num_replicas": 1, "rank": 0}

    @property
    def comm_stats(self) -> CommStats:
        """The byte counter of this rank's collectives (since the start of the current step)."""
        return self._shard_group.stats

    @property
    def last_step_bytes(self) -> dict[str, int]:
        """Bytes of the last finished training step, per kind of collective (logical payload sizes)."""
        return dict(self._last_step_bytes)

    @property
    def shard_plan(self) -> ShardPlan | None:
        """Which layers are sharded and how; ``None`` before ``setup``."""
        return self._plan

    @property
    def checkpoint_dir(self) -> Path:
        """The folder of the automatic sharded checkpoints (``checkpoint_dir``, or under the Trainer's
        ``default_root_dir``)."""
        return self._checkpoint_folder(self._trainer())

    @override
    def _configure_launcher(self) -> None:
        if self._start_method != "popen" or (self._max_restarts == 0 and self._checkpoint_every is None):
            super()._configure_launcher()
            return
        assert self.cluster_environment is not None
        self._launcher = RestartingLauncher(
            self.cluster_environment,
            self.num_processes,
            self.num_nodes,
            max_restarts=self._max_restarts,
            checkpoint_dir=self._checkpoint_folder,
            child_exit_timeout=self._child_exit_timeout,
        )

    @override
    def setup_environment(self) -> None:
        if self.root_device.type != "cpu":
            raise ValueError(
                f"The DSlideStrategy runs on CPUs (gloo), got device {self.root_device}. "
                "Use `Trainer(strategy='dslide', accelerator='cpu')`."
            )
        if self._process_group_backend not in (None, "gloo"):
            raise ValueError(
                f"The DSlideStrategy supports the 'gloo' backend only, got {self._process_group_backend!r}. "
                "Use `DSlideStrategy(process_group_backend='gloo')`."
            )
        cores = _own_cores(self.local_rank, self.num_processes) if self._pin_cores else None
        if cores:  # before the process group: the threads gloo starts inherit this rank's cores
            _pin_process(cores)
        self._shard_group.spin_s = _spin_seconds(self._spin_wait, self.num_processes if not cores else 1)
        super().setup_environment()
        _EXIT.watch(self)
        if self._collectives == "socket" and self.world_size > 1:
            env, group = self.cluster_environment, self._shard_group
            assert env is not None
            timeout = (self._timeout or default_pg_timeout).total_seconds()
            group.mesh = SocketMesh(
                self.global_rank,
                self.world_size,
                dist.distributed_c10d._get_default_store(),
                reachable_address(env.main_address, env.main_port),
                timeout_s=timeout,
                spin_s=group.spin_now,
            )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        self.accelerator.setup(trainer)
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "norm":
            raise ValueError(
                "When using the DSlideStrategy, gradient clipping by norm is not supported (each rank holds a "
                "shard of the gradients). Use `Trainer(gradient_clip_algorithm='value')` or no clipping."
            )
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._ensure_plan().sync_replicated()
        if self._checkpoint_every is not None and trainer.training:
            if not any(isinstance(c, AutoCheckpoint) for c in trainer.callbacks):  # type: ignore[attr-defined]
                trainer.callbacks.append(  # type: ignore[attr-defined]
                    AutoCheckpoint(self._checkpoint_every, self.checkpoint_dir, self._save_sharded)
                )
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @override
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        # Wide layers created in `LightningModule.configure_model` are born as this rank's shard.
        with sharded_init(self._shard_group):
            yield

    @override
    def _setup_model(self, model: Module) -> Module:  # type: ignore[override]  # no DDP wrapper
        # No DistributedDataParallel: sharded layers talk through their own collectives and the replicated
        # parameters are reduced in `post_backward`.
        return model

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        # The other ranks are (or soon will be) blocked in a collective with this one: closing this rank's
        # connections makes theirs fail now rather than after the timeout.
        if self._shard_group.mesh is not None:
            self._shard_group.mesh.close()
        _destroy_process_group()

    @override
    def process_dataloader(self, dataloader: object) -> object:
        loader = LockStepLoader(
            dataloader,
            self._shard_group,
            stop_requested=lambda: self._sigterm_received,
            skip=self._batches_done_in_epoch,
        )
        self._loaders.add(loader)
        return loader

    def _batches_done_in_epoch(self) -> int:
        """Batches of the current training epoch already trained on, when it resumes from a sharded checkpoint
        saved in its middle (the loop's progress, restored from it); else 0. A full checkpoint resumes as in a
        plain Lightning run: its epoch starts over (Lightning warns), so that both runs stay the same."""
        trainer = self._trainer()
        if trainer is None or not trainer.training or not self._resume_in_epoch:
            return 0
        self._resume_in_epoch = False
        return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)  # type: ignore[attr-defined]

    def _trainer(self) -> pl.Trainer | None:
        return self.lightning_module.trainer if self.lightning_module is not None else None

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._early.start(self)
        self._note_resumed()
        epoch_loop = getattr(getattr(self._trainer(), "fit_loop", None), "epoch_loop", None)
        if self.world_size < 2 or not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
            return
        # Lightning's SIGTERM protocol is a broadcast from rank 0 at the start of every training step (matched, on
        # a rank that receives the signal, by a broadcast inside the signal handler). For D-SLIDE that is one
        # more synchronisation point per step, and a rank other than 0 receiving the signal would issue a
        # collective the others do not. The lock-step check of each batch carries the request instead: the rank
        # that received SIGTERM says so when it fetches its next batch, and every rank raises Lightning's
        # SIGTERMException at the same step, a step or two later.
        self._sigterm_received = False
        epoch_loop._broadcast_sigterm_tensor = self._raise_if_sigterm_agreed  # type: ignore[union-attr]
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    @override
    def on_train_end(self) -> None:
        self._early.stop(self)
        epoch_loop = getattr(getattr(self._trainer(), "fit_loop", None), "epoch_loop", None)
        if epoch_loop is not None and "_broadcast_sigterm_tensor" in vars(epoch_loop):
            del epoch_loop._broadcast_sigterm_tensor
        super().on_train_end()

    def _note_resumed(self) -> None:
        """After a restart (rank 0's), say how long the job was down: from the failure to training again."""
        failed_at = os.environ.pop(FAILED_AT_ENV, None)
        if failed_at is None or self.global_rank != 0:
            return
        trainer = self._trainer()
        record = {
            "restart": int(os.environ.get(RESTART_ENV, "0")),
            "resumed_at_step": trainer.global_step if trainer is not None else None,
            "down_s": round(time.time() - float(failed_at), 3),
            "time": time.time(),
        }
        log.warning(
            "DSlideStrategy: restart %d is training again at step %s, %.1f s after the failure.",
            record["restart"],
            record["resumed_at_step"],
            record["down_s"],
        )
        with open(self.checkpoint_dir / "restarts.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """This process received SIGTERM: the next lock-step check asks every rank to stop (Lightning restores
        its handlers after ``fit``)."""
        log.info(
            "DSlideStrategy: rank %d received SIGTERM; every rank stops at the same step.", self.global_rank
        )
        if not self._sigterm_received and self.launcher is not None:
            # the ranks Lightning's launcher started get it too, as Lightning's own handler does
            self.launcher.kill(signum)
        self._sigterm_received = True
        connector = getattr(self._trainer(), "_signal_connector", None)
        original = getattr(connector, "_original_handlers", {}).get(signal.SIGTERM)
        if callable(original):
            original(signum, frame)  # a handler the user installed before fit, as Lightning's chain calls it

    def _raise_if_sigterm_agreed(self) -> None:
        if any(loader.stop_agreed for loader in self._loaders):
            connector = getattr(self._trainer(), "_signal_connector", None)
            if connector is not None:
                connector.received_sigterm = True  # Lightning's later checks (end of batch, epoch) agree
            raise SIGTERMException()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        stats = self._shard_group.stats
        if stats.total_calls:
            self._last_step_bytes = stats.snapshot()
        stats.reset()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        output = super().training_step(*args, **kwargs)
        # Logged at the steps whose logs the logger writes (`log_every_n_steps`): a `LightningModule.log` call costs
        # about as much as the rest of Lightning's per-step work, and it would be a cost the ranks pay on top of
        # what a single process pays.
        if (
            self._log_bytes
            and self._last_step_bytes
            and self.lightning_module is not None
            and logs_written_this_step(self.lightning_module)
        ):
            self.lightning_module.log(
                "dslide/bytes_per_step",
                float(sum(self._last_step_bytes.values())),
                on_step=True,
                batch_size=1,
            )
        return output

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        super().pre_backward(closure_loss)
        self._early.arrived.clear()

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        assert self._plan is not None
        self._early.check()
        self._plan.all_reduce_replicated_grads()

    @property
    def early_updates(self) -> int:
        """Parameter updates done while the hidden-gradient all-reduce was in flight (see ``overlap_updates``)."""
        return self._early.updates

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        if self._plan is None or self._saving_sharded:  # sharded: this rank's rows, as held
            return self.lightning_module.state_dict()
        # The sharded tensors stay where they are: `save_checkpoint` streams them into the file.
        return self._plan.streamed_state_dict()

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # Lightning restores the model before `setup`: shard it first (collective) if that has not happened yet.
        plan = self._ensure_plan()
        if self._loaded_sharded:  # this rank's own rows, saved by this rank's predecessor
            assert self.lightning_module is not None
            self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)
        else:
            plan.load_full_state_dict(checkpoint["state_dict"], strict=strict)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._plan is None or self._saving_sharded:
            return super().optimizer_state(optimizer)
        return streamed_optimizer_state(optimizer, self._plan)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Collective: rank 0 writes one ordinary ``torch.save`` file, receiving each sharded tensor from its
        owners a few MB at a time; no process ever holds a whole wide layer."""
        if storage_options is not None:
            raise TypeError(
                "When using the DSlideStrategy, `storage_options` are not supported by `save_checkpoint`: the "
                "strategy writes the checkpoint itself (streamed). Save without them."
            )
        if self._saving_sharded:
            save_sharded(checkpoint, filepath, self._shard_group)
        else:
            save_streamed(checkpoint, filepath, self._shard_group)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        # A folder: a sharded checkpoint, each rank reads its own part. A file: memory-mapped, each rank reads only
        # the rows it keeps, never the whole file into memory.
        self._loaded_sharded = self._resume_in_epoch = os.path.isdir(checkpoint_path)
        if self._loaded_sharded:
            # Lightning warns that a loader without `state_dict` cannot resume an epoch in its middle: this one
            # does (`_batches_done_in_epoch`). It keeps no state of its own, so that a full checkpoint of a D-SLIDE
            # run still resumes in a plain run, whose loader has none either.
            warnings.filterwarnings(
                "ignore", message="You're resuming from a checkpoint that ended before the epoch"
            )
            return load_sharded(checkpoint_path, self.global_rank, self.world_size)
        return torch.load(checkpoint_path, map_location="cpu", mmap=True, weights_only=bool(weights_only))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self._plan is not None
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            optimizer.load_state_dict(
                state if self._loaded_sharded else shard_optimizer_state(state, optimizer, self._plan)
            )

    def _save_sharded(self, trainer: pl.Trainer, folder: Path) -> None:
        """Collective: a sharded checkpoint of the run in ``folder`` (each rank writes its own part)."""
        self._saving_sharded = True
        try:
            trainer.save_checkpoint(folder, weights_only=False)
        finally:
            self._saving_sharded = False

    def _checkpoint_folder(self, trainer: pl.Trainer | None) -> Path:
        if self._checkpoint_dir is not None:
            return Path(self._checkpoint_dir)
        return Path(trainer.default_root_dir if trainer is not None else os.getcwd()) / "dslide_checkpoints"

    def _ensure_plan(self) -> ShardPlan:
        assert self.lightning_module is not None
        if self._plan is None or not self._plan.is_applied_to(self.lightning_module):
            self._plan = shard_lightning_module(self.lightning_module, self._shard_group)
        return self._plan

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="D-SLIDE: sparse layers sharded across CPU processes (gloo)",
        )


class _EarlyUpdates:
    """The sharded output layers' share of the step, done while the hidden-gradient all-reduce is in flight.

    The parameters of the ``SparseLSHLinear`` shards usually get their gradients before the backward reaches the
    input layer's all-reduce (their nodes come later in the forward). A post-accumulate-grad hook marks each when
    its gradient has arrived: autograd runs a parameter's accumulation once per backward, with every
    contribution summed, so a parameter also used elsewhere (a regulariser built before the forward, say) is
    marked only once all of it is there. The all-reduce's backward starts the sum, asks the ``LazyAdam`` to
    update the marked parameters (only inside its ``step(closure)``: not in a microbatch that only accumulates),
    then waits. A gradient that arrives after its parameter's update (a second backward in one closure) stops
    the run with an error rather than train on a partial gradient.
    """

    def __init__(self) -> None:
        self.optimizer: LazyAdam | None = None
        self.params: dict[int, tuple[str, Tensor]] = {}
        self.arrived: set[int] = set()
        self.late: str | None = None
        self.updates = 0
        self._hooks: list[Any] = []

    def start(self, strategy: DSlideStrategy) -> None:
        self.stop(strategy)
        optimizer = _early_update_optimizer(strategy)
        if optimizer is None or strategy._plan is None:
            return
        self.optimizer = optimizer
        for layer_name, layer in strategy._plan.sharded.items():
            if isinstance(layer, SparseLSHLinear):
                for name, param in layer.named_parameters():
                    self.params[id(param)] = (f"{layer_name}.{name}", param)
                    self._hooks.append(param.register_post_accumulate_grad_hook(self._arrive))
        if self.params:
            strategy._shard_group.overlap = self.run

    def stop(self, strategy: DSlideStrategy) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.params.clear()
        self.arrived.clear()
        self.optimizer, self.late = None, None
        strategy._shard_group.overlap = None

    def _arrive(self, param: Tensor) -> None:
        if self.optimizer is not None and self.optimizer.stepped_early(param):
            self.late = self.params[id(param)][0]
        self.arrived.add(id(param))

    def run(self) -> None:
        if self.optimizer is not None:
            self.updates += self.optimizer.step_early(self.params[i][1] for i in self.arrived)

    def check(self) -> None:
        if self.late is not None:
            name, self.late = self.late, None
            raise RuntimeError(
                f"DSlideStrategy: {name} got more gradient after the strategy had updated it (while the hidden "
                "gradient's all-reduce was in flight): a second backward in one optimizer step? Pass "
                "`DSlideStrategy(overlap_updates=False)`."
            )


def _early_update_optimizer(strategy: DSlideStrategy) -> LazyAdam | None:
    """The ``LazyAdam`` whose output-layer update may run during the backward, or ``None`` where something
    between backward and step could change the gradients (see ``overlap_updates``). ``on_after_backward`` is
    refused too: it runs after the backward, when the update has been done."""
    if (
        not strategy._overlap_updates
        or strategy.world_size < 2
        or type(strategy.precision_plugin) is not Precision
    ):
        return None
    if not gradients_fixed_after_backward(strategy, also=("on_after_backward",)):
        return None
    optimizer = strategy.optimizers[0]
    return optimizer if isinstance(optimizer, LazyAdam) else None


def _own_cores(local_rank: int, local_ranks: int) -> list[int] | None:
    """This rank's equal share of the cores the process may run on, when several ranks share this machine and
    there is at least one core each; else ``None``."""
    if local_ranks < 2 or not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < local_ranks:
        return None
    per = len(cores) // local_ranks
    return cores[local_rank * per : (local_rank + 1) * per]


def _pin_process(cores: list[int]) -> None:
    """Restrict every thread of this process (and those it starts later) to ``cores``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that ended meanwhile
            pass
    log.debug(f"DSlideStrategy: this rank runs on cores {cores}")


def _spin_seconds(spin_wait: float | None, sharing: int) -> float:
    """How long a collective's wait spins: ``spin_wait`` if given, else 0.2 s where the ``sharing`` ranks on
    this rank's cores have a core for each torch thread, else 0."""
    if spin_wait is not None:
        return spin_wait
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 0.2 if sharing * torch.get_num_threads() <= cores else 0.0


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class _ExitHandler:
    """Ends this process's part of a D-SLIDE run at interpreter exit: waits for the ranks Lightning's launcher
    started (killing them after the strategy's timeout), then destroys the process group."""

    def __init__(self) -> None:
        self._children: list[subprocess.Popen] = []
        self._timeout = 0.0
        self._registered = False

    def watch(self, strategy: DSlideStrategy) -> None:
        launcher = strategy.launcher
        if isinstance(launcher, _SubprocessScriptLauncher):
            self._children.extend(p for p in launcher.procs if p not in self._children)
        self._timeout = max(self._timeout, strategy._child_exit_timeout)
        if not self._registered:
            self._registered = True
            atexit.register(self.run)

    def run(self) -> None:
        for proc in self._children:
            try:
                proc.wait(timeout=self._timeout)
            except subprocess.TimeoutExpired:
                log.error(
                    "DSlideStrategy: rank process %d did not exit %.0f s after rank 0 finished; killing it.",
                    proc.pid,
                    self._timeout,
                )
                proc.kill()
                proc.wait()
        self._children.clear()
        _destroy_process_group()


_EXIT = _ExitHandler()
