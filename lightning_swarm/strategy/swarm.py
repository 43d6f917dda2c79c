"""``SwarmStrategy``: SWARM parallelism for Lightning (stochastic pipelines of hivemind peers)."""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from typing_extensions import override

from lightning_swarm.strategy.launcher import _SwarmLauncher
from lightning_swarm.swarm import SwarmPeer, SwarmSettings
from lightning_swarm.swarm.lifetime import (
    die_with_parent,
    interrupt_handled,
    latch_interrupts,
    raise_pending_interrupt,
)

log = logging.getLogger(__name__)

Role = Literal["both", "trainer", "server"]
Compression = Literal["8bit", "fp16", "none"]
_DEFAULTS = SwarmSettings()  # the one source of the defaults below


class SwarmStrategy(ParallelStrategy):
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
        target_batch_size: samples a stage's swarm (and the trainers, for their local parameters) accumulates
            before its peers average gradients and step together.
        request_timeout: seconds before a call to a peer counts as failed and is retried on another peer.
        no_peers_timeout: seconds to wait for a stage that has no live peers before raising an error.
        matchmaking_time: seconds peers of a stage spend finding each other before averaging gradients.
        averaging_timeout: seconds an averaging round may take before it is abandoned.
        linger_timeout: at the end of a run, seconds a peer keeps serving while other peers still train.
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
            (batch normalisation is detected and never merged).
        batch_wait_ms: how long a group of merged calls waits for more before it runs; a lone call never waits.
        keep_activations: a stage server keeps the activations of up to this many forwards (served alone, not
            merged) for their backward, which the trainer sends to the same peer while it lives: that backward
            skips recomputing the forward. A backward that reaches another peer, or comes after the stage's
            parameters were updated, recomputes the forward as before. Each kept forward holds its activations in
            the server's memory until its backward or until newer ones push it out; 0 turns this off.
    """

    strategy_name = "swarm"

    def __init__(
        self,
        pipeline: str | None = None,
        num_stages: int = _DEFAULTS.num_stages,
        role: Role = _DEFAULTS.role,
        stage: int | None = None,
        num_trainers: int | None = None,
        initial_peers: list[str] | None = None,
        host_maddrs: list[str] | None = None,
        run_id: str = _DEFAULTS.run_id,
        compression: Compression = _DEFAULTS.compression,
        target_batch_size: int = _DEFAULTS.target_batch_size,
        request_timeout: float = _DEFAULTS.request_timeout,
        no_peers_timeout: float = _DEFAULTS.no_peers_timeout,
        matchmaking_time: float = _DEFAULTS.matchmaking_time,
        averaging_timeout: float = _DEFAULTS.averaging_timeout,
        linger_timeout: float = _DEFAULTS.linger_timeout,
        restart_peers: int = 0,
        rebalance_period: float = _DEFAULTS.rebalance_period,
        rebalance_min_gain: float = _DEFAULTS.rebalance_min_gain,
        secret: str | None = None,
        allowed_peers: list[str] | None = None,
        identity_path: str | None = None,
        max_batch_rows: int = _DEFAULTS.max_batch_rows,
        batch_wait_ms: float = _DEFAULTS.batch_wait_ms,
        keep_activations: int = _DEFAULTS.keep_activations,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
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
            target_batch_size=target_batch_size,
            request_timeout=request_timeout,
            no_peers_timeout=no_peers_timeout,
            matchmaking_time=matchmaking_time,
            averaging_timeout=averaging_timeout,
            linger_timeout=linger_timeout,
            rebalance_period=rebalance_period,
            rebalance_min_gain=rebalance_min_gain,
            secret=secret,
            allowed_peers=tuple(allowed_peers or ()),
            identity_path=identity_path,
            max_batch_rows=max_batch_rows,
            batch_wait_ms=batch_wait_ms,
            keep_activations=keep_activations,
        )
        if restart_peers < 0:
            raise ValueError(f"SwarmStrategy(restart_peers={restart_peers}) must be 0 or more.")
        self.restart_peers = restart_peers
        self.num_nodes = 1
        self._peer: SwarmPeer | None = None
        self._failed = False
        self._runs = 0  # fit/validate/test/predict calls so far: each one starts a fresh swarm

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

    @property
    def peer(self) -> SwarmPeer:
        """The running swarm peer (DHT, stage server, client); available between setup and teardown."""
        if self._peer is None:
            raise RuntimeError(
                "The SwarmStrategy's peer runs only between `setup_environment` and `teardown`."
            )
        return self._peer

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally and self.num_processes > 1:
            self._launcher = _SwarmLauncher(
                self.cluster_environment,
                self.num_processes,
                self.num_nodes,
                restart_peers=self.restart_peers,
                exit_timeout=self.settings.linger_timeout + 30.0,
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
        self._peer = SwarmPeer(
            self.settings,
            peer_index=self.global_rank,
            local_swarm_size=local_swarm,
            rendezvous_path=rendezvous,
            device=self.root_device,
            should_stop=self._stop_requested,
        )
        self._runs += 1
        self._peer.start_dht()

    def _stop_requested(self) -> bool:
        """Whether this process got SIGTERM during the run (Lightning's flag): the peer's waits end at once, and
        Lightning stops the run after the current step. A Ctrl-C that Python swallowed (in a weakref callback) is
        raised here, on the main thread (see ``lifetime.latch_interrupts``); so is the error of a local peer process
        that failed before it could tell the swarm (see ``_SwarmLauncher.raise_failed_child``). The peer polls this
        through ``SwarmPeer.should_stop``, which also raises another peer's published failure."""
        raise_pending_interrupt()
        if isinstance(self._launcher, _SwarmLauncher):
            self._launcher.raise_failed_child()
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        return bool(trainer is not None and trainer.received_sigterm)

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        optimizers = self.peer.join(
            self.lightning_module, self.optimizers if fitting else [], training=fitting
        )
        if fitting:
            self.optimizers = optimizers
        self.setup_precision_plugin()

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
        elif self.peer.local_swarm_size is not None:
            self.peer.wait_for_stages()  # the other local peers may still be starting

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        self.peer.should_stop()  # raises another peer's failure between steps, too
        if args:
            self.peer.note_batch_size(extract_batch_size(args[0]))
        output = super().training_step(*args, **kwargs)
        assert self.lightning_module is not None
        for name, value in self.peer.stats().items():
            self.lightning_module.log(name, value, on_step=True, on_epoch=False, reduce_fx="max")
        return output

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        return super().optimizer_step(
            optimizer, closure, model, **self.peer.optimizer_step_kwargs(), **kwargs
        )

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Any:
        """Peers of a swarm never wait for each other, so values are not reduced across peers: each peer logs its
        own figures."""
        return tensor

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
        """The whole model, with every stage's current parameters gathered from the swarm."""
        assert self.lightning_module is not None
        if self._peer is None or not self._peer.joined:
            return self.lightning_module.state_dict()
        return self._peer.full_state_dict(self.lightning_module)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """The run raised ``exception``: an error of this peer (not another's, not Ctrl-C or SIGTERM) is published
        to every peer of the swarm, which raise it too, as DDP's processes stop with a failed rank."""
        self._failed = True
        if isinstance(exception, KeyboardInterrupt):
            interrupt_handled()
        published = self._peer is not None and self._peer.publish_failure(exception)
        if published and isinstance(self._launcher, _SwarmLauncher):
            self._launcher.swarm_failed = True  # its children stop too: it need not wait long for them

    @override
    def teardown(self) -> None:
        peer, self._peer = self._peer, None
        failed, self._failed = self._failed, False
        if peer is not None:
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
        strategy_registry.register(cls.strategy_name, cls, description=cls.__doc__.splitlines()[0])
