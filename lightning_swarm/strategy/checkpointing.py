"""The SwarmStrategy's checkpoints, stage by stage (see :mod:`lightning_swarm.swarm.peer.checkpoint`).

Saving: the module's ``state_dict`` names every pipeline tensor with a ``Deferred`` leaf, and the stages' optimizer
states likewise; the file is written fetching one stage at a time from the swarm, so that no peer ever holds the
whole model (nor every stage's optimizer state). Loading: ``torch.load(..., mmap=True)``, so that the tensors of a
stage a peer does not serve are never read into its memory.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_swarm.swarm import SwarmPeer
from lightning_swarm.swarm.peer.checkpoint import Deferred
from lightning_swarm.swarm.peer.partition import stage_state_keys

_STAGE = "stage"
_OPTIMIZER = "optimizer"
_OPTIMIZER_KEY = "state"


def local_state_dict(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` outside a run; refused while some of its tensors are on ``meta`` (a model larger
    than one peer whose other stages were never gathered here)."""
    state = module.state_dict()
    absent = [k for k, v in state.items() if isinstance(v, Tensor) and v.is_meta]
    if absent:
        raise RuntimeError(
            f"SwarmStrategy: the module's {len(absent)} tensors such as {absent[0]!r} are not in this process "
            "(built on meta, the pipeline's other stages were never gathered here: the model is taken to be "
            "larger than one peer), so a checkpoint saved now would lack them. Save checkpoints during fit "
            "(ModelCheckpoint, or trainer.save_checkpoint in a hook): they are streamed from the swarm stage "
            "by stage. Or pass SwarmStrategy(gather_on_end=True) to gather the whole model when fit ends."
        )
    return state


def deferred_state_dict(peer: SwarmPeer, module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` as if the pipeline were local, each pipeline tensor a ``Deferred`` leaf of its
    stage (fetched when the checkpoint is written)."""
    partition = peer.partition
    assert partition is not None
    state: dict[str, Any] = dict(module.state_dict())
    for stage, blocks in enumerate(partition.stages):
        for key in stage_state_keys(partition.container, blocks).values():
            full = f"{partition.path}.{key}"
            state[full] = Deferred((_STAGE, stage), full)
    return state


def deferred_optimizer_states(num_stages: int) -> dict[int, Deferred]:
    """Every stage's optimizer state (serialised, as a ``uint8`` tensor), fetched when the checkpoint is written."""
    return {k: Deferred((_OPTIMIZER, k), _OPTIMIZER_KEY) for k in range(num_stages)}


def fetcher(peer: SwarmPeer) -> Callable[[Hashable], dict[str, Tensor]]:
    """What a ``Deferred`` group of this module's checkpoint is, fetched from the swarm: one stage's tensors (under
    the module's keys), or one stage's optimizer state."""

    def fetch(group: Hashable) -> dict[str, Tensor]:
        kind, stage = cast(tuple[str, int], group)
        if kind == _OPTIMIZER:
            assert peer.client is not None
            data = peer.client.commands.fetch_optimizer_state(stage)
            return {_OPTIMIZER_KEY: torch.frombuffer(bytearray(data), dtype=torch.uint8)}
        partition = peer.partition
        assert partition is not None
        return partition.full_state_keys(peer.stage_states.gather_stage_states(stages=[stage]))

    return fetch


def optimizer_state_bytes(state: Any) -> bytes:
    """A stage's optimizer state as saved: ``bytes`` (checkpoints written before streaming) or a ``uint8`` tensor."""
    if isinstance(state, Tensor):
        return state.numpy().tobytes()
    return bytes(state)
