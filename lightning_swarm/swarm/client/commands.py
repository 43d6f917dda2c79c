"""A trainer's commands to a stage's peers, beside its calls (a part of :class:`~.client.SwarmClient`): optimizer
step commands (agreeing on a step's sum first, see :mod:`.stepping`), and the stage optimizer's state, fetched and
restored in parts."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import msgpack
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from lightning_swarm.swarm.client.discovery import StageDiscovery
from lightning_swarm.swarm.client.routing import NoPeersError, StageRouter
from lightning_swarm.swarm.dht.records import PeerInfo
from lightning_swarm.swarm.lifetime import PeerStopping
from lightning_swarm.swarm.loop import run_coroutine
from lightning_swarm.swarm.settings import SwarmSettings
from lightning_swarm.swarm.training.stepping import StepCommand, parse_step_reply
from lightning_swarm.swarm.wire.errors import ProtocolError
from lightning_swarm.swarm.wire.protocol import (
    OPTIMIZER_PART_BYTES,
    stage_uid,
)

logger = logging.getLogger(__name__)

MAX_SUM_ATTEMPTS = 6  # rounds a multi-peer stage step tries before its peers step with sums they disagree on
SUM_AGREEMENT = 1e-5  # relative difference of the peers' squared norms of one sum taken as agreement


T = TypeVar("T")


class CommandedClient(Protocol):
    """What the commands need from the client that owns them (:class:`~.client.SwarmClient`): its routers, its
    transports and its calls with retries."""

    settings: SwarmSettings
    run_id: str
    peer_id: PeerID
    routers: list[StageRouter]
    router_lock: threading.Lock
    local_servers: dict[int, Any]
    discovery: StageDiscovery
    should_stop: Callable[[], bool]

    def check_stage(self, stage: int) -> None: ...

    def peers(self, stage: int) -> list[PeerInfo]: ...

    def live_peers(self, stage: int) -> list[PeerID]: ...

    def most_current_peer(self, stage: int) -> PeerID | None: ...

    def transport(self, peer_id: PeerID, stage: int) -> Any: ...

    def run_rpc(self, coro: Any) -> Any: ...

    def with_retries(
        self,
        stage: int,
        task_size: float,
        attempt: Callable[[PeerID], T],
        timed: bool = True,
        prefer: PeerID | None = None,
    ) -> T: ...


class StageCommands:
    """A ``SwarmClient``'s step and optimizer-state commands to the peers of a stage.

    Args:
        client: the client that owns them, whose routers, transports and retries they use.
    """

    def __init__(self, client: CommandedClient) -> None:
        self.client, self.settings = client, client.settings

    def step_stage(self, stage: int, command: StepCommand) -> list[dict[str, Any]]:
        """Send a trainer's step command (see :mod:`.stepping`) to every live peer of ``stage`` at once and wait
        for their replies; returns the replies of the peers that answered (a peer that fails is banned and
        logged; it catches up from the others at the next step). Raises ``NoPeersError`` if none answered.

        With several live peers, the step's gradients are first summed among them (phase ``"norm"``) and the
        sums are checked before anything is applied: every peer must report the whole group and the same sum
        (the same squared norm, bit for bit: an all-reduce gives every member the same result). A round that
        formed without one of them, or that some member saw fail half-way (hivemind then keeps the local values
        of the parts it missed), is redone from the peers' own gradients, up to ``MAX_SUM_ATTEMPTS`` times."""
        self.client.check_stage(stage)
        deadline = time.monotonic() + self.settings.no_peers_timeout
        peers = None
        if command.phase in ("norm", "apply"):
            peers, replies = self._agree_on_sum(stage, command, deadline)
            if command.phase == "norm" and replies:
                return replies
        while True:
            # (given the agreed peers, the replies are aligned with them: None for one that failed since)
            replies = [r for r in self._step_once(stage, command, peers) if r is not None]
            if replies and any(r.get("retry") for r in replies):
                command.attempt += 1  # the stage's peers missed each other's averaging round: again
                continue
            if replies:
                return replies
            peers = None  # every peer it agreed with failed: whoever lives now
            # every peer failed (e.g. the stage's only peer died): wait for a live one, as calls do
            if self.client.should_stop():
                raise PeerStopping(f"stage {stage} step abandoned: this peer is stopping")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NoPeersError(
                    f"No peer of stage {stage} took the trainer's optimizer step {command.step_id} within "
                    f"no_peers_timeout ({self.settings.no_peers_timeout:.1f} s)"
                )
            self.client.discovery.refresh(
                stage, block=True, max_wait=min(self.settings.refresh_period, remaining)
            )

    def _agree_on_sum(
        self, stage: int, command: StepCommand, deadline: float
    ) -> tuple[list[PeerID] | None, list[dict[str, Any]]]:
        """Phase ``"norm"`` until the stage's live peers agree on the step's summed gradients (see
        :meth:`step_stage`); returns those peers (``None``: whoever lives) and their replies."""
        prepare = dataclasses.replace(command, phase="norm")
        replies: list[dict[str, Any]] = []
        for attempt in range(MAX_SUM_ATTEMPTS):
            prepare.attempt = attempt
            peers = self.client.live_peers(stage)
            if len(peers) <= 1 and command.phase == "apply":
                return None, []  # nothing to agree on: the apply phase sums nothing
            replies = self._step_once(stage, prepare, peers) if peers else []
            answered = [p for p, r in zip(peers, replies, strict=True) if r is not None]
            got = [r for r in replies if r is not None]
            if not got:
                if time.monotonic() > deadline:
                    break
                self.client.discovery.refresh(stage, block=True, max_wait=self.settings.refresh_period)
                continue
            norms = [float(r.get("sq_norm", 0.0)) for r in got if r.get("finite", True)]
            groups = {int(r.get("group", 1)) for r in got}
            # hivemind hands each peer the average as its own values plus a delta (x + (avg - x)): the peers' sums
            # agree to float rounding, not bit for bit; a half-failed round differs by far more
            agree = not norms or max(norms) - min(norms) <= SUM_AGREEMENT * max(abs(n) for n in norms)
            agree = agree and _tensors_agree([r.get("sq_norms") for r in got if r.get("finite", True)])
            if groups == {len(answered)} and agree and len(answered) == len(peers):
                return answered, got
            logger.info(
                f"Stage {stage}: the peers' sums of step {command.step_id} disagree (groups {sorted(groups)}, "
                f"{len(norms)} distinct norms, {len(answered)} of {len(peers)} answered); summing again"
            )
        logger.warning(
            f"Stage {stage}: its peers could not agree on the sum of step {command.step_id}'s gradients in "
            f"{MAX_SUM_ATTEMPTS} rounds; each steps with its own sum (a peer left behind catches up later)"
        )
        return None, [r for r in replies if r is not None]

    def _step_once(
        self, stage: int, command: StepCommand, peers: list[PeerID] | None = None
    ) -> list[dict[str, Any]]:
        """Send ``command`` to ``peers`` (default: the stage's live peers); the replies of those that answered.
        Given ``peers``, the list is aligned with them instead, ``None`` for a peer that failed."""
        aligned = peers is not None
        if peers is None:
            peers = self.client.live_peers(stage)
        if not peers:
            return []
        router = self.client.routers[stage]
        command.peers = max(1, len(peers))
        # the peers sum their gradients among exactly these (no matchmaking round), in this order
        command.group = [p.to_bytes() for p in peers] if len(peers) > 1 else []
        data = command.encode()
        timeout = (
            self.settings.averaging_timeout + self.settings.matchmaking_time + self.settings.request_timeout
        )

        local = self.client.local_servers.get(stage)
        # the channels are made here, not on the event loop (making one may wait for the loop)
        stubs = {
            p: self.client.transport(p, stage).stub
            for p in peers
            if p != self.client.peer_id or local is None
        }

        async def one(peer_id: PeerID) -> dict[str, Any]:
            if peer_id not in stubs:
                assert local is not None
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(None, local.step_command, command)
            reply = await stubs[peer_id].rpc_step(
                runtime_pb2.ExpertInfo(serialized_info=data), timeout=timeout
            )
            return parse_step_reply(reply.serialized_info)

        async def every() -> list[Any]:
            return await asyncio.gather(*(one(p) for p in peers), return_exceptions=True)

        results = run_coroutine(every(), timeout=timeout + 5)
        replies: list[Any] = []
        for peer_id, result in zip(peers, results, strict=True):
            if isinstance(result, dict) and "error" not in result:
                replies.append(result)
                continue
            if aligned:
                replies.append(None)
            error = result.get("error") if isinstance(result, dict) else repr(result)
            if isinstance(result, dict) and result.get(
                "fatal"
            ):  # a misconfigured run or an optimizer that raises
                raise RuntimeError(f"SwarmStrategy: peer {peer_id}: {error}")
            if peer_id not in stubs and isinstance(
                result, Exception
            ):  # this process's own server: not a peer fault
                raise result
            with self.client.router_lock:
                router.ban(peer_id)
            logger.warning(f"Stage {stage} peer {peer_id} did not take step {command.step_id}: {error}")
        return replies

    def fetch_optimizer_state(self, stage: int) -> bytes:
        """The optimizer state of stage ``stage`` (see ``StageServer.optimizer_state``), from a live peer: with
        trainer-driven steps the one with the newest epoch, if it answers."""
        self.client.check_stage(stage)

        def attempt(peer_id: PeerID) -> bytes:
            if peer_id == self.client.peer_id and stage in self.client.local_servers:
                return self.client.local_servers[stage].optimizer_state()
            parts: list[bytes] = []
            token: int | None = None
            total: int | None = None
            while total is None or sum(map(len, parts)) < total:
                offset = sum(map(len, parts))
                reply = self._optimizer_rpc(peer_id, stage, {"op": "get", "offset": offset, "token": token})
                token, total = reply.get("token"), reply.get("total")
                if type(total) is not int or total < 0 or type(token) is not int:
                    raise ProtocolError(
                        f"Peer {peer_id} sent a malformed optimizer state part of stage {stage}"
                    )
                if not reply["state"] and offset < total:
                    raise ProtocolError(f"Peer {peer_id} sent an empty optimizer state part of stage {stage}")
                parts.append(reply["state"])
            return b"".join(parts)

        # the newest peer first, as for the parameters (see SwarmClient.fetch_stage_state)
        prefer = self.client.most_current_peer(stage)
        return self.client.with_retries(stage, 1.0, attempt, timed=False, prefer=prefer)

    def load_optimizer_state(self, stage: int, data: bytes) -> int:
        """Restore the optimizer state of stage ``stage`` on every live peer of it; returns how many took it.

        Raises:
            ValueError: a peer refused the state (it does not fit the stage).
        """
        self.client.check_stage(stage)
        self.client.peers(stage)
        with self.client.router_lock:
            router = self.client.routers[stage]
            peers = [p for p in router.peers if not router.is_banned(p)]
        for peer_id in peers:
            if peer_id == self.client.peer_id and stage in self.client.local_servers:
                self.client.local_servers[stage].load_optimizer_state(data)
            else:
                token = secrets.randbits(62)
                for offset in range(0, max(1, len(data)), OPTIMIZER_PART_BYTES):
                    part = data[offset : offset + OPTIMIZER_PART_BYTES]
                    fields = {
                        "op": "set",
                        "state": part,
                        "offset": offset,
                        "total": len(data),
                        "token": token,
                    }
                    self._optimizer_rpc(peer_id, stage, fields)
        return len(peers)

    def _optimizer_rpc(self, peer_id: PeerID, stage: int, fields: dict[str, Any]) -> dict[str, Any]:
        request = runtime_pb2.ExpertInfo(
            serialized_info=msgpack.packb(
                {"uid": stage_uid(self.client.run_id, stage), **fields}, use_bin_type=True
            )
        )
        stub = self.client.transport(peer_id, stage).stub
        reply = msgpack.unpackb(self.client.run_rpc(stub.rpc_optimizer(request)).serialized_info, raw=False)
        if not isinstance(reply, dict):
            raise ProtocolError(f"Peer {peer_id} sent a malformed optimizer reply")
        if "error" in reply:
            raise ValueError(f"Peer {peer_id} of stage {stage}: {reply['error']}")
        if fields["op"] == "get" and not isinstance(reply.get("state"), bytes):
            raise ProtocolError(f"Peer {peer_id} sent a malformed optimizer state of stage {stage}")
        return reply


def _tensors_agree(per_peer: list[Any]) -> bool:
    """Whether the peers' squared norms of each tensor of their sums agree (to ``SUM_AGREEMENT``): the whole
    norm can agree while a small tensor differs (a part of it that a peer missed in the round). Peers that do not
    report them (``None``) are not compared; a malformed report disagrees."""
    reported = [p for p in per_peer if p is not None]
    if len(reported) < 2:
        return True
    try:
        rows = [[float(v) for v in p] for p in reported]
    except (TypeError, ValueError):
        return False
    if any(len(row) != len(rows[0]) for row in rows):
        return False
    for values in zip(*rows, strict=True):
        top = max(abs(v) for v in values)
        if not all(math.isfinite(v) for v in values) or max(values) - min(values) > SUM_AGREEMENT * top:
            return False
    return True
