"""Trainer-driven stage steps: what a trainer tells a stage's peers when its own optimizer steps.

With one trainer (``stage_steps="trainer"``, the default then), a stage's parameters step exactly when the
trainer's optimizer steps, with the hyper-parameters the trainer's parameter groups have at that moment (so an
LR scheduler, a warm-up or ``ReduceLROnPlateau`` acting on the trainer's optimizer drives the stages too), the
trainer's gradient clipping and its loss scale. The trainer sends a :class:`StepCommand` to every live peer of
every stage and waits for their replies, so the next forward sees the new parameters: the step of one process.

A step has up to two phases with the same ``step_id``:

- ``"norm"`` (only for clipping by norm): each peer takes the gradients the stage received for this step
  (the backwards it served since the last step), sums them with the stage's other peers (an all-reduce, when the
  trainer commanded more than one peer), unscales them and replies with their squared norm; the trainer adds the
  stages' squared norms to its own to get the whole model's norm, as ``clip_grad_norm_`` would.
- ``"apply"``: the peer (preparing the gradients first if no ``"norm"`` phase did) clips them (by the trainer's
  coefficient, or by value), sets the trainer's hyper-parameters on its parameter groups and steps.

With manual optimization, ``optimizer.zero_grad()`` on the trainer is mirrored too (phase ``"zero"``): the
stages drop the gradients they hold for that optimizer's parameters. (With automatic optimization every
backward is followed by a step, which consumes them.) A ``"zero"`` is applied once per ``step_id`` like a step:
with several trainers every trainer sends the same one (see :mod:`.trainer_sync`), and only the first drops
gradients.

With several trainers (``stage_steps="async"``) the stages step on their own, every ``target_batch_size``
samples; a trainer's optimizer step then only sends its groups' hyper-parameters when they changed (phase
``"hyper"``), which the stages use from their next step: the schedule of the trainer that stepped last.

Commands are idempotent per ``step_id`` (a retried command is answered again, never applied twice).

The wire form is a msgpack dict in ``runtime_pb2.ExpertInfo.serialized_info`` (``rpc_step``); every field is
validated by :func:`parse_command` (a malformed command is refused, never crashes a peer).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

__all__ = ["PHASES", "StepCommand", "hyper_parameters", "parse_command", "parse_step_reply"]

PHASES = ("norm", "apply", "zero", "hyper")
_MAX_GROUPS = 4096
_MAX_KEYS = 64
_MAX_KEY_LEN = 64
_MAX_GROUP_PEERS = 1024
_MAX_PEER_ID_BYTES = 128


@dataclass
class StepCommand:
    """One optimizer step of a stage, commanded by the trainer.

    Args:
        uid: the stage's uid (see :func:`~.protocol.stage_uid`).
        step_id: the trainer's id of this step (random start, then counted): the same for both phases and for
            every peer of the stage; a peer applies each id once.
        phase: ``"norm"``, ``"apply"``, ``"zero"`` or ``"hyper"``.
        optimizer: index of the trainer's optimizer that steps (``configure_optimizers`` order); only the stage's
            parameters in that optimizer's groups step.
        groups: that optimizer's parameter groups' hyper-parameters, by group index (``lr``, ``betas``,
            ``weight_decay``... as they are at the trainer's step, after its schedulers acted).
        grad_scale: the stage's gradients are multiplied by this before anything else (the inverse of the
            trainer's loss scale with ``16-mixed``; 1.0 otherwise).
        clip_coef: clipping by norm: the coefficient the trainer computed from the whole model's norm (<= 1).
        clip_value: clipping by value: each gradient element is clamped to ``[-clip_value, clip_value]``.
        skip: the trainer skipped this step (non-finite gradients with a loss scaler): drop the gradients.
        peers: how many peers of the stage the trainer commands: more than one means their gradients are summed
            among them (all-reduce) before the step.
        epoch: the stage's epoch as the trainer last saw it; a peer behind it missed steps and first loads the
            stage's state from its peers.
        attempt: how many times this phase was sent before: a peer that found none of the other commanded peers
            to sum its gradients with replies ``retry`` and keeps them for the next attempt.
        group: the commanded peers' ids (``PeerID.to_bytes()``, the same order for every peer): with several, they
            sum their gradients in one all-reduce among exactly these peers, without matchmaking (empty: a peer
            finds the others by hivemind's matchmaking).
    """

    uid: str
    step_id: int
    phase: str = "apply"
    optimizer: int = 0
    groups: dict[int, dict[str, Any]] = field(default_factory=dict)
    grad_scale: float = 1.0
    clip_coef: float | None = None
    clip_value: float | None = None
    skip: bool = False
    peers: int = 1
    epoch: int = 0
    attempt: int = 0
    group: list[bytes] = field(default_factory=list)

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "uid": self.uid,
                "step_id": self.step_id,
                "phase": self.phase,
                "optimizer": self.optimizer,
                "groups": {int(k): v for k, v in self.groups.items()},
                "grad_scale": self.grad_scale,
                "clip_coef": self.clip_coef,
                "clip_value": self.clip_value,
                "skip": self.skip,
                "peers": self.peers,
                "epoch": self.epoch,
                "attempt": self.attempt,
                "group": list(self.group),
            },
            use_bin_type=True,
        )


def _number(value: Any, name: str, allow_none: bool = False, positive: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"step command: {name} must be a finite number, got {value!r}")
    if positive and value < 0:
        raise ValueError(f"step command: {name} must be >= 0, got {value!r}")
    return float(value)


def _int(value: Any, name: str, low: int = 0) -> int:
    if type(value) is not int or value < low:
        raise ValueError(f"step command: {name} must be an integer >= {low}, got {value!r}")
    return value


def _hyper_value(value: Any) -> bool:
    if value is None or isinstance(value, (bool, str)):
        return True
    if isinstance(value, (int, float)):
        return math.isfinite(value) or math.isinf(value)  # NaN never; inf is a legitimate bound
    if isinstance(value, (list, tuple)):
        return len(value) <= 16 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v) for v in value
        )
    return False


def parse_command(data: bytes, expected_uid: str) -> StepCommand:
    """A received step command, validated; raises ``ValueError`` saying what is wrong."""
    try:
        fields = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:
        raise ValueError(f"step command: malformed msgpack ({type(e).__name__})") from None
    if not isinstance(fields, dict):
        raise ValueError("step command: expected a map")
    if fields.get("uid") != expected_uid:
        raise ValueError(
            f"This peer serves {expected_uid!r}, but the step command was for {fields.get('uid')!r}"
        )
    phase = fields.get("phase")
    if phase not in PHASES:
        raise ValueError(f"step command: phase must be one of {PHASES}, got {phase!r}")
    groups = fields.get("groups")
    if not isinstance(groups, dict) or len(groups) > _MAX_GROUPS:
        raise ValueError("step command: groups must be a map of group index -> hyper-parameters")
    parsed: dict[int, dict[str, Any]] = {}
    for index, hyper in groups.items():
        _int(index, "a group index")
        if not isinstance(hyper, dict) or len(hyper) > _MAX_KEYS:
            raise ValueError(f"step command: group {index}'s hyper-parameters must be a map")
        for key, value in hyper.items():
            if not isinstance(key, str) or not key or len(key) > _MAX_KEY_LEN or key == "params":
                raise ValueError(f"step command: bad hyper-parameter name {key!r}")
            if not _hyper_value(value):
                raise ValueError(f"step command: hyper-parameter {key!r} has an unusable value {value!r}")
        parsed[index] = {k: tuple(v) if isinstance(v, list) else v for k, v in hyper.items()}
    clip_coef = _number(fields.get("clip_coef"), "clip_coef", allow_none=True, positive=True)
    if clip_coef is not None and clip_coef > 1.0:
        raise ValueError(f"step command: clip_coef must be in [0, 1], got {clip_coef}")
    skip = fields.get("skip")
    if not isinstance(skip, bool):
        raise ValueError("step command: skip must be a boolean")
    group = fields.get("group", [])
    if (
        not isinstance(group, list)
        or len(group) > _MAX_GROUP_PEERS
        or not all(isinstance(p, bytes) and 0 < len(p) <= _MAX_PEER_ID_BYTES for p in group)
        or len(set(group)) != len(group)
    ):
        raise ValueError("step command: group must be a list of distinct peer ids (bytes)")
    return StepCommand(
        uid=expected_uid,
        step_id=_int(fields.get("step_id"), "step_id"),
        phase=phase,
        optimizer=_int(fields.get("optimizer"), "optimizer"),
        groups=parsed,
        grad_scale=_number(fields.get("grad_scale"), "grad_scale", positive=True),  # type: ignore[arg-type]
        clip_coef=clip_coef,
        clip_value=_number(fields.get("clip_value"), "clip_value", allow_none=True, positive=True),
        skip=skip,
        peers=_int(fields.get("peers"), "peers", low=1),
        epoch=_int(fields.get("epoch"), "epoch"),
        attempt=_int(fields.get("attempt", 0), "attempt"),
        group=group,
    )


def parse_step_reply(data: bytes) -> dict[str, Any]:
    """A peer's reply to a step command: ``{"epoch": int, "sq_norm": float, "finite": bool, ...}``."""
    try:
        reply = msgpack.unpackb(data, raw=False)
    except Exception as e:
        raise ValueError(f"malformed step reply ({type(e).__name__})") from None
    if not isinstance(reply, dict) or type(reply.get("epoch")) is not int:
        raise ValueError(f"malformed step reply {str(reply)[:100]}")
    if "error" in reply:
        if not isinstance(reply["error"], str) or not isinstance(reply.get("fatal", False), bool):
            raise ValueError("malformed step reply: error must be a string, fatal a boolean")
        return reply
    norm = reply.get("sq_norm")
    if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float))):
        raise ValueError("malformed step reply: sq_norm must be a number")
    norms = reply.get("sq_norms")
    if norms is not None and (
        not isinstance(norms, list)
        or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in norms)
    ):
        raise ValueError("malformed step reply: sq_norms must be a list of numbers")
    return reply


def hyper_parameters(group: dict[str, Any]) -> dict[str, Any]:
    """The hyper-parameters of a torch optimizer's parameter group that travel in a :class:`StepCommand`:
    numbers, booleans, strings, ``None`` and short tuples of numbers (``betas``); tensors (a ``capturable`` lr)
    become numbers; anything else stays with the stage's own value."""
    hyper: dict[str, Any] = {}
    for key, value in group.items():
        if key == "params" or len(key) > _MAX_KEY_LEN:
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, numbers.Number) and not isinstance(value, (bool, int, float)):
            value = float(value)  # type: ignore[arg-type]  # numpy scalars
        if isinstance(value, tuple):
            value = list(value)
        if _hyper_value(value):
            hyper[key] = value
    return hyper


def read_swarm_epoch(dht: Any, run_id: str, stage: int = 0) -> int | None:
    """The swarm's epoch with ``stage_steps="async"``: how many times stage ``stage``'s peers stepped together, as
    their hivemind progress trackers report it in the DHT (the largest epoch a non-client peer reports, as
    hivemind's ``ProgressTracker`` reads it). ``None`` if nothing valid is found (no peer reported yet, or the DHT
    did not answer); malformed entries are skipped."""
    key = f"{run_id}_stage{stage}_progress"  # the stage optimizer's run id, as the server names it
    try:  # bounded: a DHT whose helper process died never answers
        found = dht.get(key, latest=True, return_future=True).result(timeout=10.0)
    except Exception:
        return None
    entries = getattr(found, "value", None)
    if not isinstance(entries, dict):
        return None
    epochs = []
    for entry in entries.values():
        value = getattr(entry, "value", None)
        if not isinstance(value, dict) or value.get("client_mode") is not False:
            continue
        epoch = value.get("epoch")
        if isinstance(epoch, int) and not isinstance(epoch, bool) and 0 <= epoch < 2**62:
            epochs.append(epoch)
    return max(epochs) if epochs else None
