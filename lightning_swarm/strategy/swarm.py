"""``SwarmStrategy``: SWARM parallelism for Lightning (stochastic pipelines of hivemind peers)."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from typing_extensions import override

from lightning_swarm.strategy.checkpointing import (
    deferred_optimizer_states,
    deferred_state_dict,
    fetcher,
    local_state_dict,
    optimizer_state_bytes,
)
from lightning_swarm.strategy.launcher import SwarmLauncher, computing_at_once
from lightning_swarm.strategy.loop_state import logs_written_this_step
from lightning_swarm.strategy.progress import SwarmProgress
from lightning_swarm.strategy.refusals import (
    grad_scaler,
    refuse_before_launch,
    refuse_closure_optimizers,
    refuse_for_swarm_steps,
    refuse_weight_copies,
)
from lightning_swarm.strategy.schedules import follow_swarm_epochs
from lightning_swarm.strategy.trainer_steps import TrainerDrivenSteps, groups_hyper
from lightning_swarm.swarm import SwarmPeer, SwarmSettings
from lightning_swarm.swarm.allocator import tune_allocator
from lightning_swarm.swarm.lifetime import (
    die_with_parent,
    interrupt_handled,
    latch_interrupts,
    raise_pending_interrupt,
)
from lightning_swarm.swarm.peer.checkpoint import resolve_deferred, save_deferred
from lightning_swarm.swarm.peer.deferred_init import InitRecorder
from lightning_swarm.swarm.peer.materialize import RngSnapshot

log = logging.getLogger(__name__)

Role = Literal["both", "trainer", "server"]
Compression = Literal["8bit", "fp16", "none"]
StageSteps = Literal["auto", "trainer", "async"]
_STAGES_KEY = "swarm_stages"  # a checkpoint's entry with the stages' optimizer states
_DEFAULTS = SwarmSettings()  # the one source of the defaults below


class SwarmStrategy(TrainerDrivenSteps):
    """SWARM parallelism: the model's pipeline of blocks is cut into stages, each served by a swarm of hivemind
    peers; every microbatch takes a throughput-weighted random path through one peer per stage.

    Every process that runs ``Trainer(strategy=...).fit(...)`` is a peer. ``Trainer(strategy="swarm",
    accelerator="cpu", devices=N)`` starts N peers on this machine (peer 0 bootstraps the DHT); on several machines,
    give each process ``initial_peers`` or set ``LIGHTNING_SWARM_INITIAL_PEERS``.

    Args:
        pipeline: attribute path (from the LightningModule) of the ``nn.Sequential`` or ``nn.ModuleList`` of blocks
            to run in the swarm, e.g. ``"model.layers"``. ``None`` picks the Sequential/ModuleList with the most
            parameters.
        num_stages: number of contiguous stages the blocks are cut into.
        role: ``"both"`` (feed data and serve a stage), ``"trainer"`` (feed data only) or ``"server"`` (serve a
            stage only; the peer's training loop runs no steps and ends when the trainers are done).
        stage: stage this peer serves; ``None`` picks one: peer ``i`` of a local swarm serves ``i % num_stages``,
            a peer joining from elsewhere takes the stage with the least announced throughput.
        num_trainers: in a local swarm (``devices=N``), how many of the N peers feed data (the first ones); the
            others serve only. ``None`` means all of them.
        initial_peers: multiaddrs of peers already in the swarm. Empty: take ``LIGHTNING_SWARM_INITIAL_PEERS``
            (comma-separated), else this peer bootstraps a new swarm.
        host_maddrs: multiaddrs this peer listens on; default loopback only (``/ip4/127.0.0.1/tcp/0``). Use
            ``/ip4/0.0.0.0/tcp/<port>`` to accept peers from other machines.
        run_id: name of the swarm; peers with the same ``run_id`` train together.
        compression: codec for activations and gradients crossing stage boundaries: ``"8bit"`` (blockwise
            quantization, 1/4 of fp32 bytes), ``"fp16"`` or ``"none"``.
        stage_steps: when the stages' optimizers step. ``"trainer"`` (``"auto"``, the default): exactly when the
            trainers' optimizers step, as in one process with one trainer and as DDP's ranks with several (one
            global step per global batch: the trainers' own gradients averaged, the stages' summed and divided by
            the number of trainers; the LR schedule, gradient clipping, loss scale and accumulation reach the
            stages). ``"async"``: every ``target_batch_size`` samples the swarm processed, asynchronously
            (hivemind's optimizer; throughput over fidelity: the stages' gradients are stale by up to a step).
        target_batch_size: with ``stage_steps="async"``: samples a stage's swarm (and the trainers, for their
            local parameters) accumulates before its peers average gradients and step together (``None``: 256).
            With ``"trainer"`` a step is the trainers' batch times ``accumulate_grad_batches`` times the number
            of trainers; a value given here must equal that.
        trainer_timeout: with several trainers and ``stage_steps="trainer"``: seconds the trainers of a global step
            wait for each other's gradients; a trainer that dies or lags longer is left out of that step (logged
            and counted, ``swarm/missed_trainer_steps``).
        request_timeout: seconds before a call to a peer counts as failed and is retried on another peer.
        no_peers_timeout: seconds to wait for a stage that has no live peers before raising an error.
        matchmaking_time: seconds peers of a stage spend finding each other before averaging gradients.
        averaging_timeout: seconds an averaging round may take before it is abandoned.
        linger_timeout: at the end of a run, seconds a peer that serves a stage keeps serving while other trainers
            still train (a trainer that serves no stage leaves at once).
        gather_on_end: whether a trainer gathers every stage's final parameters into its module when ``fit`` ends.
            ``None`` (default): yes, unless the pipeline was built on ``meta`` (``trainer.init_module()`` or
            ``configure_model``): such a model is taken to be larger than one peer, and its trainer's module keeps
            only its own stage after ``fit`` (save checkpoints during ``fit``: they are streamed stage by stage).
        restart_peers: in a local swarm (``devices=N``), how many times a peer process that died is started again
            (per peer). A dead peer never stops the others; 0 (default) leaves it dead.
        rebalance_period: mean seconds between a serving peer's checks whether moving to another stage would speed
            up the pipeline by more than ``rebalance_min_gain``; 0 turns adaptive rebalancing off.
        rebalance_min_gain: relative gain in the pipeline's throughput that a migration must bring.
        secret: makes the swarm private: only peers started with the same secret (at least 8 characters) can join
            its DHT, call its stages (including state downloads) or average with it. ``None`` reads the
            ``LIGHTNING_SWARM_SECRET`` environment variable (better than a secret in a config file); unset: open.
        allowed_peers: makes the swarm private to these base58 peer ids (each peer prints its id at start-up;
            give peers a fixed ``identity_path``); combined with ``secret``, a peer needs both.
        identity_path: file with this peer's private key (created if missing), so that its peer id stays the same
            across runs. ``None``: a new key per run.
        max_batch_rows: a stage server merges calls that wait for it while it computes (same structure, tensors
            with the batch dimension first) into one forward or backward of at most this many rows. 0 turns
            batching off: do so for a stage whose output for one row depends on the other rows of its batch
            (batch normalisation is detected and never merged). With trainer-driven steps (the default), a
            stage's training calls are not merged, so that runs are reproducible: eval forwards are.
        batch_wait_ms: how long a group of merged calls waits for more before it runs; a lone call never waits.
        keep_activations: a stage server keeps the activations of up to this many forwards (served alone, not
            merged) for their backward, which the trainer sends to the same peer while it lives: that backward
            skips recomputing the forward. A backward that reaches another peer, or comes after the stage's
            parameters were updated, recomputes the forward as before. Each kept forward holds its activations in
            the server's memory until its backward or until newer ones push it out; 0 turns this off.
        microbatches: a trainer cuts each stage call's batch into this many chunks (along dim 0), which flow
            through the stages on their own: stage k+1 works on one chunk while stage k works on the next, and the
            peers of a stage serve chunks at once, forward and backward (``"auto"``, the default: one chunk per
            online peer of the stage, or whole calls while other calls of the trainer are in flight, and always
            with several trainers, whose calls keep the peers busy and whose runs are then reproducible; 1: one
            call per batch). The result is the one of the same chunks sent one
            after another. A pipeline with batch normalisation (whose output for a row depends on the other rows)
            is not chunked: refused when set above 1.
        same_host: stage calls between peers on one machine (same user, same network namespace) go over a Unix
            socket instead of through hivemind's p2p daemons, which saves their CPU; calls to other machines, and
            every call of a private swarm (``secret``/``allowed_peers``), go over P2P. Turn it off to send every
            call through the network (a benchmark that shapes loopback, for example).
        reachability: how the other peers reach this one. ``"auto"`` (default): a peer joining initial peers off
            this machine asks one of them to dial it back, and if that fails (behind NAT, or listening on loopback
            only) it is reached through a circuit relay at its initial peers (any public peer of the swarm relays);
            ``"direct"``: dialled at its own addresses (a public host, or a forwarded port); ``"relay"``: always
            through the relays, without asking. A relayed peer says so in its stage record; trainers weigh it by
            the throughput they measure through the relay. ``lightning-swarm doctor`` tells which applies here.
    """

    strategy_name = "swarm"

    def __init__(
        self,
        pipeline: str | None = None,
        num_stages: int = _DEFAULTS.num_stages,
        role: Role = "both",
        stage: int | None = None,
        num_trainers: int | None = None,
        initial_peers: list[str] | None = None,
        host_maddrs: list[str] | None = None,
        run_id: str = _DEFAULTS.run_id,
        compression: Compression = "8bit",
        target_batch_size: int | None = None,
        request_timeout: float = _DEFAULTS.request_timeout,
        no_peers_timeout: float = _DEFAULTS.no_peers_timeout,
        matchmaking_time: float = _DEFAULTS.matchmaking_time,
        averaging_timeout: float = _DEFAULTS.averaging_timeout,
        linger_timeout: float = _DEFAULTS.linger_timeout,
        gather_on_end: bool | None = None,
        restart_peers: int = 0,
        rebalance_period: float = _DEFAULTS.rebalance_period,
        rebalance_min_gain: float = _DEFAULTS.rebalance_min_gain,
        secret: str | None = None,
        allowed_peers: list[str] | None = None,
        identity_path: str | None = None,
        max_batch_rows: int = _DEFAULTS.max_batch_rows,
        batch_wait_ms: float = _DEFAULTS.batch_wait_ms,
        keep_activations: int = _DEFAULTS.keep_activations,
        microbatches: int | str = _DEFAULTS.microbatches,
        stage_steps: StageSteps = "auto",
        trainer_timeout: float = _DEFAULTS.trainer_timeout,
        same_host: bool = _DEFAULTS.same_host,
        reachability: str = _DEFAULTS.reachability,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        tune_allocator()  # early: the threads of the peer started later share one arena (see swarm.allocator)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.settings = SwarmSettings(
            pipeline=pipeline,
            num_stages=num_stages,
            role=role,
            stage=stage,
            num_trainers=num_trainers,
            initial_peers=tuple(initial_peers or ()),
            host_maddrs=tuple(host_maddrs or ()),
            run_id=run_id,
            compression=compression,
            target_batch_size=_DEFAULTS.target_batch_size if target_batch_size is None else target_batch_size,
            request_timeout=request_timeout,
            no_peers_timeout=no_peers_timeout,
            matchmaking_time=matchmaking_time,
            averaging_timeout=averaging_timeout,
            linger_timeout=linger_timeout,
            gather_on_end=gather_on_end,
            rebalance_period=rebalance_period,
            rebalance_min_gain=rebalance_min_gain,
            secret=secret,
            allowed_peers=tuple(allowed_peers or ()),
            identity_path=identity_path,
            max_batch_rows=max_batch_rows,
            batch_wait_ms=batch_wait_ms,
            keep_activations=keep_activations,
            microbatches=microbatches,
            stage_steps=stage_steps,
            trainer_timeout=trainer_timeout,
            same_host=same_host,
            reachability=reachability,
        )
        self._target_batch_size = target_batch_size  # as given: checked against the trainer's step
        if restart_peers < 0:
            raise ValueError(f"SwarmStrategy(restart_peers={restart_peers}) must be 0 or more.")
        self.restart_peers = restart_peers
        self.num_nodes = 1
        self._peer: SwarmPeer | None = None
        self._failed = False
        self._runs = 0  # fit/validate/test/predict calls so far: each one starts a fresh swarm
        self._step_id = None  # the trainer's optimizer step in progress (see swarm/training/stepping.py)
        # how the step in progress clipped: (optimizer index, "norm", coef) or (optimizer index, "value", v)
        self._clip = None
        # with several trainers: the optimizer whose global step was exchanged and not taken yet (manual clipping
        # exchanges before the step), and this trainer's backwards since its last exchange
        self._synced = None
        self._backwards_since_sync = 0
        self._batch_checked = False
        self._progress = SwarmProgress()
        self._early_step = None  # (step id, optimizer, its hyper-parameters) while allowed
        self._meta_build: RngSnapshot | None = None  # generators' states when a meta build began (see below)
        self._meta_recorder: InitRecorder | None = (
            None  # what the meta build did (see swarm/peer/deferred_init.py)
        )
        self.stage_steps: dict[
            int, int
        ] = {}  # optimizer steps each stage took in the last run, as it replied
        self.early_stage_steps = 0  # of those, commanded before the trainer's backward ended
        # with several trainers: global steps taken, trainer-steps missed in the steps this trainer led, and steps
        # this trainer's own part came too late for (see swarm/training/trainer_sync.py)
        self.trainer_sync_stats: dict[str, int] = {}
        self.deferred_backwards = 0  # stage-call backwards whose input gradients came after the next forward

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # Several local trainers split the data like DDP ranks do; collectives stay local (see `reduce`).
        return self._local_trainers > 1

    @property
    def _local_trainers(self) -> int:
        return min(self.settings.num_trainers or self.world_size, self.world_size)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        trainers = self._local_trainers
        return {"num_replicas": trainers, "rank": min(self.global_rank, trainers - 1)}

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally and self.num_processes > 1:
            self._launcher = SwarmLauncher(
                self.cluster_environment,
                self.num_processes,
                self.num_nodes,
                restart_peers=self.restart_peers,
                exit_timeout=self.settings.linger_timeout + 30.0,
                precheck=lambda model: refuse_before_launch(model, self.settings),
                computing_at_once=computing_at_once(self.num_processes, self._local_trainers, self.settings),
            )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        die_with_parent()  # hivemind's helper processes (DHT, averagers) must not outlive this peer
        latch_interrupts()  # a Ctrl-C swallowed by a weakref callback is raised again at the next stage call
        local_swarm = self.world_size if self.world_size > 1 else None
        rendezvous = None
        if local_swarm is not None:
            port = os.environ.get("MASTER_PORT", "0")
            name = f"lightning_swarm_{port}_{self.settings.run_id}_{self._runs}"
            rendezvous = os.path.join(tempfile.gettempdir(), name)
        settings = self.settings
        autocast = _autocast_dtype(self.precision_plugin)
        if autocast is not None:  # the servers compute the stages in the trainer's mixed precision
            settings = settings.replace(autocast=autocast)
        self._peer = SwarmPeer(
            settings,
            peer_index=self.global_rank,
            local_swarm_size=local_swarm,
            rendezvous_path=rendezvous,
            device=self.root_device,
            should_stop=self._stop_requested,
        )
        self._runs += 1
        module = self.lightning_module
        if (
            module is not None
            and self._peer.stage_known_offline
            and not is_overridden("configure_model", module)
        ):
            # the model is built already: keep only this peer's share before the DHT forks its helper process
            # (a fork taken with the whole model allocated would keep the released pages alive in the helper)
            self._prepare(module)
        self._peer.start_dht()

    def _stop_requested(self) -> bool:
        """Whether this process got SIGTERM during the run (Lightning's flag): the peer's waits end at once, and
        Lightning stops the run after the current step. A Ctrl-C that Python swallowed (in a weakref callback) is
        raised here, on the main thread (see ``lifetime.latch_interrupts``); so is the error of a local peer process
        that failed before it could tell the swarm (see ``SwarmLauncher.raise_failed_child``). The peer polls this
        through ``SwarmPeer.should_stop``, which also raises another peer's published failure."""
        raise_pending_interrupt()
        if isinstance(self._launcher, SwarmLauncher):
            self._launcher.raise_failed_child()
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        return bool(trainer is not None and trainer.received_sigterm)

    @override
    def setup(self, trainer: Trainer) -> None:
        refuse_weight_copies(trainer)
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        assert self.lightning_module is not None
        if self.peer.partition is None:  # before the conversion below: a meta build is replayed as recorded
            self._prepare(self.lightning_module)
        # "bf16-true"/"16-true": the stages are converted with the rest, before they are cut out and served
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
            refuse_closure_optimizers(self.optimizers)
        optimizers = self.peer.join(
            self.lightning_module, self.optimizers if fitting else [], training=fitting
        )
        if fitting:
            self.optimizers = optimizers
        self.setup_precision_plugin()
        self._step_id, self._clip, self._batch_checked = None, None, False
        self._synced, self._backwards_since_sync = None, 0
        if fitting and self.peer.is_trainer and not self.peer.drives_stages:
            refuse_for_swarm_steps(trainer, self.precision_plugin, self.optimizers)
            follow_swarm_epochs(self.lr_scheduler_configs, self.peer.steps.swarm_epoch)
        if fitting and self.peer.drives_stages:
            self._install_clipping()
            self._install_loss_scaling()
            if not self.lightning_module.automatic_optimization:
                self._mirror_zero_grad()

    def _prepare(self, module: LightningModule) -> None:
        """Keep only what this peer hosts; blocks built on meta get their initial values here (see
        ``SwarmPeer.prepare``)."""
        rng, self._meta_build = self._meta_build, None
        recorder, self._meta_recorder = self._meta_recorder, None
        self.peer.prepare(module, rng, recorder)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module()`` and ``configure_model``: the model is built on the ``meta`` device (no
        storage) while its build is recorded, and at setup each peer gives storage to what it hosts only (its
        stage's blocks and the modules outside the pipeline) and replays the build for them: they get the values
        the model's own code gives them in one process seeded alike, init hooks included (see
        ``swarm/peer/deferred_init.py``). ``empty_init=False`` builds everything on the device, initialised, as
        Lightning does."""
        if empty_init is False:
            with super().tensor_init_context(empty_init=False):
                yield
            return
        if self._meta_build is None:  # the first meta build since the last setup: where the generators start
            self._meta_build = RngSnapshot.capture(self.root_device)
            self._meta_recorder = InitRecorder()
        assert self._meta_recorder is not None
        with torch.device("meta"), self.precision_plugin.tensor_init_context(), self._meta_recorder:
            yield

    @override
    def model_to_device(self) -> None:
        """Move what is allocated; blocks on the ``meta`` device stay there (the peer allocates only its stage)."""
        assert self.model is not None
        device = self.root_device
        self.model._apply(lambda t: t if t.is_meta else t.to(device))

    @override
    def on_train_start(self) -> None:
        if not self.peer.is_trainer:
            self.peer.serve_until_trainers_finish()
            assert self.lightning_module is not None
            self.lightning_module.trainer.should_stop = True
        else:
            assert self.lightning_module is not None
            loader = getattr(self.lightning_module.trainer, "train_dataloader", None)
            batch_size = getattr(loader, "batch_size", None)
            if isinstance(batch_size, int) and not self._batch_checked:  # before any stage call
                self._check_target_batch_size(batch_size)
            self.peer.stage_states.wait_for_stages_at_start()
            self._join_in_progress()
            settings = self.peer.settings
            self._progress.start(self.peer.dht, settings.run_id, settings.num_stages)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        self.peer.should_stop()  # raises another peer's failure between steps, too
        batch_size = None
        if args:
            batch_size = extract_batch_size(args[0])
            if not self._batch_checked:
                self._check_target_batch_size(batch_size)
        output = super().training_step(*args, **kwargs)
        self._progress.step_done(batch_size)
        self._log_swarm_metrics()
        return output

    def _log_swarm_metrics(self) -> None:
        """Log the progress-bar figures (``progress.py``: samples/s, live peers per stage, bytes on the wire,
        averaging rounds) at every step, so that any Lightning progress bar shows them; the rest of the peer's
        counters only at the steps whose logs the logger writes (~30 of them: logged at every step they would cost
        the trainer ~3 ms per step)."""
        module = self.lightning_module
        assert module is not None
        stats = self.peer.stats()
        bar = self._progress.metrics(stats)
        for name, value in bar.items():
            module.log(name, value, on_step=True, on_epoch=False, reduce_fx="max", prog_bar=True)
        if logs_written_this_step(module):
            for name, value in stats.items():
                if name not in bar:
                    module.log(name, value, on_step=True, on_epoch=False, reduce_fx="max")

    @override
    def optimizer_step(self, optimizer: Optimizable, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The trainer's step; with ``stage_steps="trainer"``, then every stage's step with the same optimizer's
        hyper-parameters, clipping and loss scale (the stages serve the new parameters before this returns)."""
        peer = self.peer
        if peer.drives_stages:
            return self._driven_optimizer_step(super().optimizer_step, optimizer, closure, model, **kwargs)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        raw = getattr(optimizer, "_optimizer", optimizer)
        index = 0 if len(self.optimizers) == 1 else self._optimizer_index(optimizer)
        peer.steps.send_stage_hyper(index, groups_hyper(raw))
        return output

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Any:
        """Peers of a swarm never wait for each other, so values are not reduced across peers: each peer logs its
        own figures."""
        return tensor

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Each peer decides for itself (peers do not wait for each other): e.g. ``ModelCheckpoint`` top-k
        compares the monitored value this peer logged."""
        return bool(decision)

    @override
    def barrier(self, name: str | None = None) -> None:
        """No-op: swarm peers run asynchronously."""

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return tensor.unsqueeze(0)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model: during a run, each stage's parameters stand for its current ones on the swarm
        (``Deferred`` leaves), fetched one stage at a time when :meth:`save_checkpoint` writes the file."""
        assert self.lightning_module is not None
        if self._peer is None or not self._peer.joined:
            return local_state_dict(self.lightning_module)
        return deferred_state_dict(self._peer, self.lightning_module)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """A checkpoint loaded into a model built on ``meta`` (``init_module``, ``configure_model``): its tensors
        are taken as they are (copying into ``meta`` would drop them, and the blocks would then be initialised
        afresh); each peer then keeps its own stage of them."""
        module = self.lightning_module
        assert module is not None
        if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            module.load_state_dict(checkpoint["state_dict"], strict=strict, assign=True)
            return
        super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """A full checkpoint (with optimizer states) also holds every stage's optimizer state and epoch, gathered
        from the swarm, so that resuming is resuming; the file stays an ordinary Lightning checkpoint."""
        peer = self._peer
        if "optimizer_states" in checkpoint and peer is not None and peer.joined and peer.is_trainer:
            checkpoint[_STAGES_KEY] = {
                "num_stages": self.settings.num_stages,
                "optimizer_states": deferred_optimizer_states(self.settings.num_stages),
            }
        if not self.is_global_zero:
            return  # as Lightning's strategies: only global rank 0 writes
        if peer is None or not peer.joined:  # nothing is deferred outside a run
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        elif type(self.checkpoint_io) is TorchCheckpointIO and storage_options is None:
            # stage by stage to disk: the whole model is never in this peer's memory
            save_deferred(checkpoint, filepath, fetcher(peer))
        else:  # a CheckpointIO of the user's (or storage options for it) gets the whole checkpoint
            super().save_checkpoint(resolve_deferred(checkpoint, fetcher(peer)), filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Memory-mapped: a peer reads only the tensors it keeps (its stage and the trainer-local modules)."""
        if type(self.checkpoint_io) is not TorchCheckpointIO:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        return torch.load(checkpoint_path, map_location="cpu", mmap=True, weights_only=bool(weights_only))

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """The trainer's optimizers, and the stages' optimizers on their peers (see :meth:`save_checkpoint`)."""
        super().load_optimizer_state_dict(checkpoint)
        stages = checkpoint.get(_STAGES_KEY)
        if stages is not None and self.peer.is_trainer:
            states = stages["optimizer_states"]
            self.peer.stage_states.load_stage_optimizer_states(
                {k: optimizer_state_bytes(v) for k, v in states.items()}
            )

    @override
    def on_exception(self, exception: BaseException) -> None:
        """The run raised ``exception``: an error of this peer (not another's, not Ctrl-C or SIGTERM) is published
        to every peer of the swarm, which raise it too, as DDP's processes stop with a failed rank."""
        self._failed = True
        if isinstance(exception, KeyboardInterrupt):
            interrupt_handled()
        published = self._peer is not None and self._peer.publish_failure(exception)
        if published and isinstance(self._launcher, SwarmLauncher):
            self._launcher.swarm_failed = True  # its children stop too: it need not wait long for them

    @override
    def teardown(self) -> None:
        self.precision_plugin.__dict__.pop(
            "clip_gradients", None
        )  # our clipping hook (see _install_clipping)
        for optimizer in (*self.optimizers, *self._lightning_optimizers):
            optimizer.__dict__.pop("zero_grad", None)  # see _mirror_zero_grad
        scaler = grad_scaler(self.precision_plugin)
        if scaler is not None:
            scaler.__dict__.pop("unscale_", None)  # see _install_loss_scaling
        peer, self._peer = self._peer, None
        failed, self._failed = self._failed, False
        if peer is not None:
            self.stage_steps = dict(peer.steps.stage_steps)
            self.early_stage_steps = peer.steps.early_stage_steps
            sync = peer.trainer_sync
            if sync is not None:
                self.trainer_sync_stats = {
                    "steps": sync.step,
                    "missed_trainer_steps": sync.missed_steps,
                    "late_steps": sync.late_steps,
                    "joined_at": sync.joined_at,
                }
            self.deferred_backwards = peer.client.deferred_grads.backwards if peer.client is not None else 0
            peer.leave(
                failed=failed
            )  # may raise another peer's failure, which arrived while this one lingered
        module = self.lightning_module
        if module is not None and any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            # a server-only peer never gathers the stages it did not host: they stay unallocated, and
            # `Strategy.teardown` would fail to move them to the CPU
            module._apply(lambda t: t if t.is_meta else t.cpu())
            self._lightning_module = None
            try:
                super().teardown()
            finally:
                self._lightning_module = module
            return
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description=(cls.__doc__ or "").splitlines()[0])


def _autocast_dtype(plugin: Any) -> str | None:
    """The dtype Lightning's mixed precision autocasts to (``"bfloat16"``/``"float16"``), or ``None``."""
    precision = getattr(plugin, "precision", None)
    if precision == "bf16-mixed":
        return "bfloat16"
    if precision == "16-mixed":
        return "float16"
    return None
