"""One swarm peer's life: join the DHT, host a stage, route the trainer's microbatches, leave cleanly.

This is the glue between the pieces of the engine (DHT, :class:`StageServer`, :class:`SwarmClient`,
:class:`Partition`, :class:`Presence`) and is free of Lightning: the ``SwarmStrategy`` and the
``lightning-swarm serve`` command both drive a :class:`SwarmPeer`.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import hivemind
import torch
from torch import nn

from lightning_swarm.swarm.codec import COMPRESSIONS
from lightning_swarm.swarm.partition import Partition
from lightning_swarm.swarm.presence import FINISHED, LEAVING, Presence

logger = logging.getLogger(__name__)

INITIAL_PEERS_ENV = "LIGHTNING_SWARM_INITIAL_PEERS"
ROLES = ("both", "trainer", "server")


@dataclass
class SwarmSettings:
    """Everything a peer needs to know about its swarm (see ``SwarmStrategy`` for the meaning of each field)."""

    pipeline: str | None = None
    num_stages: int = 2
    role: str = "both"
    stage: int | None = None
    num_trainers: int | None = None
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=list)
    run_id: str = "lightning_swarm"
    compression: str = "8bit"
    target_batch_size: int = 256
    request_timeout: float = 30.0
    no_peers_timeout: float = 60.0
    matchmaking_time: float = 3.0
    averaging_timeout: float = 30.0
    linger_timeout: float = 300.0

    def validate(self) -> None:
        name = "SwarmStrategy"
        if self.role not in ROLES:
            raise ValueError(f"{name}(role={self.role!r}) is not supported; use one of {ROLES}.")
        if self.compression not in COMPRESSIONS:
            raise ValueError(
                f"{name}(compression={self.compression!r}) is not supported; use one of {COMPRESSIONS}."
            )
        if self.num_stages < 1:
            raise ValueError(f"{name}(num_stages={self.num_stages}) must be at least 1.")
        if self.stage is not None and not 0 <= self.stage < self.num_stages:
            raise ValueError(f"{name}(stage={self.stage}) must be in [0, num_stages={self.num_stages}).")
        if self.num_trainers is not None and self.num_trainers < 1:
            raise ValueError(
                f"{name}(num_trainers={self.num_trainers}) must be at least 1 (or None for all peers)."
            )
        if self.target_batch_size < 1:
            raise ValueError(f"{name}(target_batch_size={self.target_batch_size}) must be at least 1.")
        if "." in self.run_id or not self.run_id:
            raise ValueError(f"{name}(run_id={self.run_id!r}) must be a non-empty name without dots.")
        for key in (
            "request_timeout",
            "no_peers_timeout",
            "matchmaking_time",
            "averaging_timeout",
            "linger_timeout",
        ):
            if getattr(self, key) <= 0:
                raise ValueError(f"{name}({key}={getattr(self, key)}) must be positive.")


def find_pipeline(module: nn.Module) -> str:
    """Attribute path of the ``nn.Sequential`` / ``nn.ModuleList`` holding the most parameters in ``module``."""
    best, best_params = None, -1
    for name, sub in module.named_modules():
        if name and isinstance(sub, (nn.Sequential, nn.ModuleList)) and len(sub) > 1:
            params = sum(p.numel() for p in sub.parameters())
            if params > best_params:
                best, best_params = name, params
    if best is None:
        raise ValueError(
            "The SwarmStrategy found no nn.Sequential or nn.ModuleList of blocks in the model; pass "
            "`SwarmStrategy(pipeline='<attribute path>')` naming the container of blocks to run in the swarm."
        )
    return best


class SwarmPeer:
    """A peer of the swarm: DHT node, optionally a stage server, and (for trainers) the client of the stages.

    Args:
        settings: the swarm's settings.
        peer_index: this peer's index among the peers started together on this machine (0 bootstraps).
        local_swarm_size: number of peers started together on this machine, or ``None`` when peers join from
            anywhere through ``initial_peers``.
        rendezvous_path: file where peer 0 of a local swarm writes its multiaddrs for the others.
        device: where this peer computes.
    """

    def __init__(
        self,
        settings: SwarmSettings,
        peer_index: int = 0,
        local_swarm_size: int | None = None,
        rendezvous_path: str | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.settings = settings
        self.peer_index = peer_index
        self.local_swarm_size = local_swarm_size
        self.rendezvous_path = rendezvous_path
        self.device = device or torch.device("cpu")
        self.dht: hivemind.DHT | None = None
        self.presence: Presence | None = None
        self.partition: Partition | None = None
        self.server: Any = None
        self.client: Any = None
        self.stage: int | None = None
        self.joined = False
        self._trainer_optimizer: hivemind.Optimizer | None = None
        self._batch_size = 1

    # ------------------------------------------------------------------ roles
    @property
    def is_trainer(self) -> bool:
        if self.settings.role == "server":
            return False
        if self.local_swarm_size is not None and self.settings.num_trainers is not None:
            return self.peer_index < self.settings.num_trainers
        return True

    @property
    def is_server(self) -> bool:
        return self.settings.role != "trainer"

    @property
    def num_trainers(self) -> int | None:
        if self.local_swarm_size is None:
            return None
        return min(self.settings.num_trainers or self.local_swarm_size, self.local_swarm_size)

    # ------------------------------------------------------------------ DHT
    def start_dht(self) -> hivemind.DHT:
        """Start this peer's DHT node: bootstrap (local peer 0 or no known peers) or join the given peers."""
        s = self.settings
        host_maddrs = s.host_maddrs or ["/ip4/127.0.0.1/tcp/0"]
        initial_peers = list(s.initial_peers) or _env_peers()
        if self.local_swarm_size is not None and self.peer_index > 0 and not initial_peers:
            initial_peers = self._wait_rendezvous()
        try:
            self.dht = hivemind.DHT(start=True, initial_peers=initial_peers, host_maddrs=host_maddrs)
        except Exception as e:
            raise RuntimeError(
                f"SwarmStrategy: the hivemind DHT did not start ({e!r}). If it says the P2P daemon failed to start, "
                f"check that the listen addresses {host_maddrs} are free and valid on this machine; if it could not "
                f"reach initial_peers {initial_peers}, check that they are reachable from here (peers behind NAT "
                "need a public relay or an open port)."
            ) from e
        if self.local_swarm_size is not None and self.peer_index == 0 and self.rendezvous_path:
            tmp = f"{self.rendezvous_path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write("\n".join(str(a) for a in self.dht.get_visible_maddrs()))
            os.replace(tmp, self.rendezvous_path)
        self.presence = Presence(self.dht, s.run_id, str(self.dht.peer_id))
        self.presence.start()
        logger.info(f"Swarm peer {self.peer_index} is up: {[str(a) for a in self.dht.get_visible_maddrs()]}")
        return self.dht

    def _wait_rendezvous(self, timeout: float = 120.0) -> list[str]:
        assert self.rendezvous_path is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(self.rendezvous_path):
                with open(self.rendezvous_path) as f:
                    peers = [line.strip() for line in f if line.strip()]
                if peers:
                    return peers
            time.sleep(0.1)
        raise TimeoutError(
            f"SwarmStrategy: peer {self.peer_index} waited {timeout:.0f} s for peer 0 to start the swarm "
            f"({self.rendezvous_path} never appeared). Check that peer 0 is running and did not fail."
        )

    # ------------------------------------------------------------------ join
    def join(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], training: bool
    ) -> list[torch.optim.Optimizer]:
        """Cut ``module``'s pipeline into stages, serve this peer's stage, put the proxy in place and return the
        trainer's optimizers (see :meth:`trainer_optimizers`)."""
        from lightning_swarm.strategy.accelerator import SwarmAccelerator
        from lightning_swarm.swarm.client import SwarmClient
        from lightning_swarm.swarm.server import StageServer

        s = self.settings
        assert self.dht is not None, "start_dht() first"
        self.partition = Partition(module, s.pipeline or find_pipeline(module), s.num_stages)
        self.stage = self._choose_stage()
        optimizer = optimizers[0] if training and optimizers else None
        factory = optimizer_factory(optimizer) if optimizer is not None else None
        # hivemind optimizers fork their averager processes: create them all before this process starts the
        # event-loop thread of its P2P calls (a fork taken while that thread holds a lock can hang the child)
        optimizers = self.trainer_optimizers(optimizers) if training else optimizers
        local_servers = {}
        if self.is_server:
            stage_module = self.partition.stage_module(self.stage).to(self.device)
            self.server = StageServer(
                self.stage,
                stage_module,
                dht=self.dht,
                run_id=s.run_id,
                optimizer_factory=factory,
                target_batch_size=s.target_batch_size,
                compression=s.compression,
                throughput=SwarmAccelerator.estimate_throughput(stage_module, self.device),
                matchmaking_time=s.matchmaking_time,
                averaging_timeout=s.averaging_timeout,
            )
            self.server.start()
            local_servers[self.stage] = self.server
        self.client = SwarmClient(
            self.dht,
            s.run_id,
            s.num_stages,
            compression=s.compression,
            local_servers=local_servers,
            request_timeout=s.request_timeout,
            no_peers_timeout=s.no_peers_timeout,
        )
        self.partition.install_proxy(self.client.call_stage)
        self.joined = True
        return optimizers

    def _choose_stage(self) -> int:
        s = self.settings
        if s.stage is not None:
            return s.stage
        if self.local_swarm_size is not None:
            return self.peer_index % s.num_stages
        from lightning_swarm.swarm.records import get_stage_peers

        totals = [
            sum(p.throughput for p in get_stage_peers(self.dht, s.run_id, k)) for k in range(s.num_stages)
        ]
        return min(range(s.num_stages), key=lambda k: totals[k])

    # ------------------------------------------------------------------ trainer-side optimisation
    def trainer_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
        """Drop the pipeline's parameters from the trainer's optimizers (the stages' servers own them) and, when
        several trainers feed the swarm, average the remaining (trainer-local) parameters' gradients among them."""
        assert self.partition is not None
        pipeline = {id(p) for p in self.partition.container.parameters()}
        for opt in optimizers:
            for group in opt.param_groups:
                group["params"] = [p for p in group["params"] if id(p) not in pipeline]
        if not self.is_trainer or self.num_trainers == 1 or len(optimizers) != 1:
            return optimizers
        if not any(g["params"] for g in optimizers[0].param_groups):
            return optimizers
        self._trainer_optimizer = hivemind.Optimizer(
            dht=self.dht,
            run_id=f"{self.settings.run_id}_trainers",
            target_batch_size=self.settings.target_batch_size,
            optimizer=optimizers[0],
            # step locally every batch and average parameters in the background every `target_batch_size`
            # samples: a trainer never blocks on the others' averaging rounds
            use_local_updates=True,
            matchmaking_time=self.settings.matchmaking_time,
            averaging_timeout=self.settings.averaging_timeout,
            verbose=False,
        )
        return [self._trainer_optimizer]

    def note_batch_size(self, batch_size: int) -> None:
        self._batch_size = max(1, int(batch_size))

    def optimizer_step_kwargs(self) -> dict[str, Any]:
        return {"batch_size": self._batch_size} if self._trainer_optimizer is not None else {}

    def stats(self) -> dict[str, float]:
        return self.client.stats() if self.client is not None else {}

    # ------------------------------------------------------------------ state
    def gather_stage_states(self) -> dict[int, dict[str, torch.Tensor]]:
        assert self.client is not None
        return {k: self.client.fetch_stage_state(k) for k in range(self.settings.num_stages)}

    def full_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """``module.state_dict()`` as if the pipeline were local, with the stages' parameters from the swarm."""
        assert self.partition is not None
        state = dict(module.state_dict())
        state.update(self.partition.full_state_keys(self.gather_stage_states()))
        return state

    # ------------------------------------------------------------------ leave
    def serve_until_trainers_finish(self) -> None:
        """For server-only peers: serve until every live peer has finished training."""
        assert self.presence is not None
        self.presence.set_phase(FINISHED)
        self.presence.wait_for(FINISHED, self.local_swarm_size, timeout=float("inf"))

    def leave(self, failed: bool = False) -> None:
        """End of a run: keep serving until the others are done, put the trained pipeline back into the module,
        then shut everything down. After a failure, restore the container and leave at once."""
        s = self.settings
        if failed:
            try:
                if self.partition is not None and self.joined:
                    self.partition.restore()
            finally:
                self.shutdown()
            return
        try:
            if self.presence is not None:
                self.presence.set_phase(FINISHED)
                self.presence.wait_for(FINISHED, self.local_swarm_size, timeout=s.linger_timeout)
            if self.joined and self.partition is not None:
                states = None
                if self.is_trainer:
                    try:
                        states = self.gather_stage_states()
                    except Exception as e:
                        logger.warning(f"Could not gather the stages' final parameters from the swarm: {e!r}")
                self.partition.restore(states)
            if self.presence is not None:
                self.presence.set_phase(LEAVING)
                self.presence.wait_for(LEAVING, self.local_swarm_size, timeout=min(60.0, s.linger_timeout))
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        for name in ("_trainer_optimizer", "client", "server"):
            obj = getattr(self, name)
            if obj is not None:
                try:
                    obj.shutdown()
                except Exception as e:
                    logger.debug(f"{name}.shutdown failed: {e!r}")
                setattr(self, name, None)
        if self.presence is not None:
            self.presence.shutdown()
            self.presence = None
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None
        if self.peer_index == 0 and self.rendezvous_path and os.path.exists(self.rendezvous_path):
            os.remove(self.rendezvous_path)
        self.joined = False


def optimizer_factory(
    optimizer: torch.optim.Optimizer,
) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """A factory that builds the same kind of optimizer, with the same hyper-parameters, for a stage's
    parameters (the stage servers step with the module's own ``configure_optimizers`` choice)."""
    if isinstance(optimizer, hivemind.Optimizer):
        raise TypeError(
            "configure_optimizers must return a torch optimizer; the SwarmStrategy wraps it itself."
        )
    cls = type(optimizer)
    # `defaults` may hold entries the constructor does not take (AdamW's `decoupled_weight_decay`)
    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    defaults = {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}

    def make(params: Any) -> torch.optim.Optimizer:
        return cls(params, **defaults)

    return make


def _env_peers() -> list[str]:
    raw = os.environ.get(INITIAL_PEERS_ENV, "")
    return [p for p in raw.replace(",", " ").split() if p]
