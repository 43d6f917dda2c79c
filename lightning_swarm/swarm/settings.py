"""Settings of a swarm peer: one dataclass, one source of defaults, validated once when it is built.

``SwarmStrategy``, ``lightning-swarm serve``, :class:`~.peer.SwarmPeer`, :class:`~.server.StageServer` and
:class:`~.client.SwarmClient` all read their knobs from a :class:`SwarmSettings`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hivemind.p2p import PeerID

from lightning_swarm.swarm.wire.codec import COMPRESSIONS
from lightning_swarm.swarm.wire.protocol import check_run_id

__all__ = ["ROLES", "SwarmSettings"]

ROLES = ("both", "trainer", "server")
STAGE_STEPS = ("auto", "trainer", "async")


@dataclass(frozen=True)
class SwarmSettings:
    """Everything a peer needs to know about its swarm; raises ``ValueError`` naming the bad field if invalid.

    The fields that ``SwarmStrategy`` exposes are documented there (same names). The others:

    Args:
        announce_period: seconds between a stage server's DHT announcements.
        expiration: seconds an announcement stays valid (more than ``announce_period``).
        ban_base_s: first ban of a failing peer in seconds, doubled on each consecutive failure.
        refresh_period: seconds between a trainer's DHT lookups of a stage's peers.
        rebalance_period: mean seconds between a training server's checks for a better stage (each wait is drawn
            uniformly from half to one and a half times this); 0 turns adaptive rebalancing off.
        rebalance_min_gain: relative gain of the pipeline's throughput a migration must bring (0.2: 20 %; measured
            throughputs are noisy).
        secret: private swarm: only peers that prove this shared secret may talk to this peer (see
            :mod:`.auth`); ``None`` reads ``LIGHTNING_SWARM_SECRET``, unset means an open swarm.
        allowed_peers: private swarm: base58 ids of the only peers that may talk to this peer (empty: any).
        autocast: the dtype (``"bfloat16"``/``"float16"``) stage servers compute in under ``torch.autocast``, as
            the trainer does with Lightning's mixed precision; ``None``: no autocast.
        same_host: stage calls between peers of one machine (and network namespace) go over a Unix socket
            instead of through the p2p daemons (see :mod:`.same_host`); off for a private swarm's servers.
        identity_path: file holding this peer's private key (created if missing), for a peer id that stays the
            same across restarts (needed to be on other peers' ``allowed_peers``); ``None``: a new key per run.
    """

    pipeline: str | None = None
    num_stages: int = 2
    role: str = "both"
    stage: int | None = None
    num_trainers: int | None = None
    initial_peers: tuple[str, ...] = field(default_factory=tuple)
    host_maddrs: tuple[str, ...] = field(default_factory=tuple)
    run_id: str = "lightning_swarm"
    compression: str = "8bit"
    target_batch_size: int = 256
    request_timeout: float = 30.0
    no_peers_timeout: float = 60.0
    matchmaking_time: float = 3.0
    averaging_timeout: float = 30.0
    linger_timeout: float = 300.0
    gather_on_end: bool | None = None
    announce_period: float = 5.0
    expiration: float = 30.0
    ban_base_s: float = 15.0
    refresh_period: float = 2.0
    rebalance_period: float = 60.0
    rebalance_min_gain: float = 0.2
    secret: str | None = field(default=None, repr=False)
    allowed_peers: tuple[str, ...] = field(default_factory=tuple)
    identity_path: str | None = None
    max_batch_rows: int = 256
    batch_wait_ms: float = 0.0
    keep_activations: int = 16
    microbatches: int | str = "auto"
    stage_steps: str = "auto"
    trainer_timeout: float = 60.0
    autocast: str | None = None
    same_host: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "initial_peers", tuple(self.initial_peers))
        object.__setattr__(self, "host_maddrs", tuple(self.host_maddrs))
        object.__setattr__(self, "allowed_peers", tuple(str(p) for p in self.allowed_peers))
        self._validate()

    def replace(self, **changes: object) -> SwarmSettings:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]  # validated by __post_init__

    def _validate(self) -> None:
        name = "SwarmStrategy"
        if self.role not in ROLES:
            raise ValueError(f"{name}(role={self.role!r}) is not supported; use one of {ROLES}.")
        if self.stage_steps not in STAGE_STEPS:
            raise ValueError(
                f"{name}(stage_steps={self.stage_steps!r}) is not supported; use one of {STAGE_STEPS}."
            )
        if self.autocast not in (None, "bfloat16", "float16"):
            raise ValueError(
                f"{name}: autocast must be None, 'bfloat16' or 'float16', got {self.autocast!r}."
            )
        if not isinstance(self.same_host, bool):
            raise ValueError(f"{name}(same_host={self.same_host!r}) must be True or False.")
        if self.compression not in COMPRESSIONS:
            raise ValueError(
                f"{name}(compression={self.compression!r}) is not supported; use one of {COMPRESSIONS}."
            )
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"{name}(num_stages={self.num_stages}) must be at least 1.")
        if self.stage is not None and not 0 <= self.stage < self.num_stages:
            raise ValueError(f"{name}(stage={self.stage}) must be in [0, num_stages={self.num_stages}).")
        if self.num_trainers is not None and self.num_trainers < 1:
            raise ValueError(
                f"{name}(num_trainers={self.num_trainers}) must be at least 1 (or None for all peers)."
            )
        if self.target_batch_size < 1:
            raise ValueError(f"{name}(target_batch_size={self.target_batch_size}) must be at least 1.")
        check_run_id(self.run_id, f"{name}(run_id={self.run_id!r})")
        for key in (
            "request_timeout",
            "no_peers_timeout",
            "matchmaking_time",
            "averaging_timeout",
            "linger_timeout",
            "announce_period",
            "refresh_period",
            "trainer_timeout",
        ):
            if getattr(self, key) <= 0:
                raise ValueError(f"{name}({key}={getattr(self, key)}) must be positive.")
        if self.expiration <= self.announce_period:
            raise ValueError(f"{name}: expiration ({self.expiration} s) must exceed announce_period.")
        if self.rebalance_period < 0:
            raise ValueError(f"{name}(rebalance_period={self.rebalance_period}) must be >= 0 (0: off).")
        if self.rebalance_min_gain < 0:
            raise ValueError(f"{name}(rebalance_min_gain={self.rebalance_min_gain}) must be >= 0.")
        if self.ban_base_s < 0:
            raise ValueError(f"{name}(ban_base_s={self.ban_base_s}) must be >= 0.")
        if self.secret is not None and (not isinstance(self.secret, str) or len(self.secret) < 8):
            raise ValueError(
                f"{name}(secret=...) must be a string of at least 8 characters (or None: no secret)."
            )
        if type(self.max_batch_rows) is not int or self.max_batch_rows < 0:
            raise ValueError(
                f"{name}(max_batch_rows={self.max_batch_rows!r}) must be a non-negative integer: the most rows a "
                "stage server merges into one computation (0 turns batching off)."
            )
        if (
            isinstance(self.batch_wait_ms, bool)
            or not isinstance(self.batch_wait_ms, (int, float))
            or not 0 <= self.batch_wait_ms <= 1000
        ):
            raise ValueError(
                f"{name}(batch_wait_ms={self.batch_wait_ms!r}) must be a number of milliseconds in [0, 1000]: how "
                "long a batch of merged calls waits for more (0: never waits)."
            )
        if type(self.keep_activations) is not int or self.keep_activations < 0:
            raise ValueError(
                f"{name}(keep_activations={self.keep_activations!r}) must be a non-negative integer: how many "
                "forwards a stage server keeps the activations of, for their backward (0: recompute every forward)."
            )
        if self.microbatches != "auto" and (type(self.microbatches) is not int or self.microbatches < 1):
            raise ValueError(
                f"{name}(microbatches={self.microbatches!r}) must be a positive integer or 'auto': how many chunks a "
                "trainer cuts a stage call's batch into, sent to the stage's peers at once (1: one call per batch)."
            )
        for peer in self.allowed_peers:
            try:
                PeerID.from_base58(peer)
            except Exception:
                raise ValueError(
                    f"{name}(allowed_peers=[..., {peer!r}, ...]): not a base58 peer id; list the ids peers print "
                    "at start-up (give each a fixed identity_path so that its id stays the same)."
                ) from None
