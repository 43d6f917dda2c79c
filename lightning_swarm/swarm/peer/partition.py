"""Stage partitioning: cut a user's ``nn.Sequential`` / ``nn.ModuleList`` of blocks into contiguous stages and
stand proxies in its place.

A *stage* is a group of consecutive blocks served by a swarm of peers. The trainer keeps everything outside the
pipeline; the container itself is swapped for a proxy with the same calling interface, whose calls go through
``call_stage(stage, *args, swarm_training=..., **kwargs)`` (the
:class:`~lightning_swarm.swarm.client.client.SwarmClient`, or anything with that signature). The proxies are submodules
of the root, so ``root.train()``/``root.eval()`` sets their ``.training``, which every call passes on as the
keyword-only ``swarm_training`` (a name no block argument may use): the stages run in the trainer's mode. The
original container is kept aside (not registered as a submodule, so its parameters are not the trainer's) so it
can be put back with the trained weights when the swarm run ends.

Memory: a peer keeps only the blocks of the stage it hosts. :meth:`Partition.release` moves every other block's
tensors to PyTorch's ``meta`` device (shape and dtype, no storage), :meth:`Partition.materialize` allocates a
stage's blocks again (a peer that migrates, or blocks that were built on ``meta`` in the first place), and
:meth:`Partition.restore` fills released blocks from gathered states.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from lightning_swarm.swarm.peer.materialize import mark_released, unmark_released

CallStage = Callable[..., Any]


Blocks = nn.Sequential | nn.ModuleList
"""What a pipeline is: the container of its blocks."""


def resolve_attribute(root: nn.Module, path: str) -> tuple[nn.Module, str, Blocks]:
    """Find ``root.<path>`` and return ``(parent, attribute_name, container)``.

    Raises:
        ValueError: if the path does not exist or does not name an ``nn.Sequential`` / ``nn.ModuleList``.
    """
    if not path or not isinstance(path, str):
        raise ValueError(f"`pipeline` must be an attribute path such as 'model.layers', got {path!r}.")
    parts = path.split(".")
    parent = root
    for i, name in enumerate(parts[:-1]):
        if not hasattr(parent, name):
            raise ValueError(
                f"`pipeline={path!r}`: {type(parent).__name__} has no attribute {name!r} "
                f"(resolved so far: {'.'.join(parts[:i]) or '<module>'}). Point `pipeline` at the attribute "
                "that holds the nn.Sequential or nn.ModuleList of blocks."
            )
        parent = getattr(parent, name)
    name = parts[-1]
    container = getattr(parent, name, None)
    if container is None:
        raise ValueError(
            f"`pipeline={path!r}`: {type(parent).__name__} has no attribute {name!r}. Point `pipeline` at the "
            "attribute that holds the nn.Sequential or nn.ModuleList of blocks."
        )
    if isinstance(container, (SwarmSequential, SwarmModuleList)):
        raise ValueError(f"`pipeline={path!r}` is already partitioned into a swarm; call `restore` first.")
    if not isinstance(container, (nn.Sequential, nn.ModuleList)):
        raise ValueError(
            f"`pipeline={path!r}` is a {type(container).__name__}; it must be an nn.Sequential or nn.ModuleList "
            "of blocks."
        )
    return parent, name, container


def split_stages(num_blocks: int, num_stages: int) -> list[range]:
    """Contiguous, as-even-as-possible ranges of block indices, one per stage (earlier stages get the extra)."""
    if num_stages < 1:
        raise ValueError(f"`num_stages` must be at least 1, got {num_stages}.")
    if num_blocks < num_stages:
        raise ValueError(
            f"Cannot split {num_blocks} blocks into {num_stages} stages: every stage needs at least one block. "
            f"Use `num_stages <= {num_blocks}`."
        )
    base, extra = divmod(num_blocks, num_stages)
    ranges, start = [], 0
    for k in range(num_stages):
        size = base + (1 if k < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def check_nothing_shared(root: nn.Module, path: str, container: Blocks, stages: list[range]) -> None:
    """Refuse a pipeline whose stages share a tensor (a parameter or buffer of one module reused in blocks of two
    stages), or share one with the modules outside the pipeline: each stage lives on its own peers, and the trainer
    keeps only what is outside the pipeline, so a shared tensor would be released (to ``meta``) on the peers of
    one side and fail there, or silently stop being shared.

    Raises:
        ValueError: naming both places of the first shared tensor and what to do.
    """
    owner: dict[int, tuple[int, str]] = {}  # id(tensor) -> (stage, its name)
    for stage, blocks in enumerate(stages):
        for i in blocks:
            named = [
                *container[i].named_parameters(prefix=f"{path}.{i}", remove_duplicate=False),
                *container[i].named_buffers(prefix=f"{path}.{i}", remove_duplicate=False),
            ]
            for name, tensor in named:
                first = owner.setdefault(id(tensor), (stage, name))
                if first[0] != stage:
                    raise ValueError(
                        f"SwarmStrategy: the pipeline `{path}` shares a tensor between stages: `{first[1]}` (stage "
                        f"{first[0]}) and `{name}` (stage {stage}) are one {type(tensor).__name__}. Each stage runs on "
                        "its own peers, so a module cannot belong to two stages: give every block its own modules "
                        "(create them inside the loop that builds the blocks), or choose `num_stages` so that the "
                        "blocks that share it fall in one stage."
                    )
    for name, tensor in [
        *root.named_parameters(remove_duplicate=False),
        *root.named_buffers(remove_duplicate=False),
    ]:
        if name.startswith(f"{path}.") or id(tensor) not in owner:
            continue
        stage, inside = owner[id(tensor)]
        raise ValueError(
            f"SwarmStrategy: `{name}`, outside the pipeline `{path}`, is the same tensor as `{inside}` of stage "
            f"{stage}. The trainer keeps what is outside the pipeline and the stage's peers keep the stage, so a "
            "tensor cannot be in both: move the shared module into the pipeline's blocks, or out of them."
        )


class StageBlocks(nn.Module):
    """The module a server runs for one stage of a ModuleList pipeline.

    Every block is called with the same extra ``*args, **kwargs`` that the parent passes to each block; a block's
    output (its first element, if it returns a tuple) replaces the first positional argument for the next block,
    and the last block's output is returned as it is.
    """

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not args:
            raise TypeError("A swarm stage needs the hidden state as its first positional argument.")
        out: Any = None
        for block in self.blocks:
            out = block(*args, **kwargs)
            hidden = out[0] if isinstance(out, (tuple, list)) else out
            args = (hidden, *args[1:])
        return out


def build_stage_module(container: Blocks, blocks: range) -> nn.Module:
    """The module that serves stage ``blocks`` of ``container`` (shares parameters with the container)."""
    chosen = [container[i] for i in blocks]
    if isinstance(container, nn.Sequential):
        return nn.Sequential(*chosen)
    return StageBlocks(chosen)


def stage_state_keys(container: Blocks, blocks: range) -> dict[str, str]:
    """Map a stage module's ``state_dict`` keys to the container's keys (``'0.weight'`` -> ``'3.weight'``)."""
    stage = build_stage_module(container, blocks)
    prefix = "blocks." if isinstance(stage, StageBlocks) else ""
    mapping = {}
    for key in stage.state_dict():
        local = key[len(prefix) :]
        index, rest = local.split(".", 1)
        mapping[key] = f"{blocks[int(index)]}.{rest}"
    return mapping


def _non_persistent_buffers(block: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of every non-persistent buffer in ``block`` (names relative to it)."""
    found = []
    for module_name, module in block.named_modules():
        for name in module._non_persistent_buffers_set:
            buffer = module._buffers.get(name)
            if buffer is not None:
                found.append((f"{module_name}.{name}" if module_name else name, buffer))
    return found


def _on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


class RemoteStage(nn.Module):
    """Stands for one stage: calling it runs the stage's blocks on a peer of that stage's swarm.

    Attribute reads that the proxy does not have fall through to the stage's first block (kept on the trainer
    only as a description, off the parameter list), so parents that inspect their blocks keep working.
    """

    _blocks: list[nn.Module]
    _call_stage: CallStage

    def __init__(self, stage: int, blocks: list[nn.Module], call_stage: CallStage) -> None:
        super().__init__()
        self.stage = stage
        object.__setattr__(self, "_blocks", list(blocks))
        object.__setattr__(self, "_call_stage", call_stage)

    @property
    def blocks(self) -> list[nn.Module]:
        return self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._call_stage(self.stage, *args, swarm_training=self.training, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            blocks = self.__dict__.get("_blocks")
            if blocks:
                return getattr(blocks[0], name)
            raise

    def extra_repr(self) -> str:
        return f"stage={self.stage}, blocks={len(self._blocks)}"


class SwarmModuleList(nn.Module):
    """Stands for a ModuleList pipeline: a list of :class:`RemoteStage` proxies, one per stage.

    ``len(proxy)`` and iteration are over stages (a parent's ``for block in self.layers`` runs one remote call per
    stage); ``proxy.num_blocks`` and ``proxy.blocks`` describe the original blocks.
    """

    _original: Blocks

    def __init__(self, stages: list[RemoteStage], original: Blocks) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        object.__setattr__(self, "_original", original)

    @property
    def num_blocks(self) -> int:
        return len(self._original)

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self._original)

    def __len__(self) -> int:
        return len(self.stages)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.stages)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, int) and not -len(self.stages) <= index < len(self.stages):
            raise IndexError(
                f"stage index {index} is out of range: this ModuleList pipeline runs in the swarm as "
                f"{len(self.stages)} stages (its {self.num_blocks} blocks are grouped into them), and indexing or "
                "iterating over it gives stages. Iterate over it (`for stage in self.layers: x = stage(x)`)."
            )
        return self.stages[index]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("A ModuleList pipeline is not callable; iterate over it and call each stage.")


class SwarmSequential(nn.Module):
    """Stands for an nn.Sequential pipeline: calling it runs every stage in turn through the swarm.

    Its blocks live on the stages' servers, not here: iterating or indexing it raises a ``TypeError`` that says
    how to call the pipeline (running the local copies would silently use untrained weights).
    """

    _original: Blocks
    _call_stage: CallStage

    def __init__(self, num_stages: int, original: Blocks, call_stage: CallStage) -> None:
        super().__init__()
        self.num_stages = num_stages
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_call_stage", call_stage)

    @property
    def num_blocks(self) -> int:
        return len(self._original)

    def __len__(self) -> int:
        return len(self._original)

    def __getitem__(self, index: int | slice) -> Any:
        raise TypeError(self._not_local(f"indexed (`[{index}]`)"))

    def __iter__(self) -> Iterator[nn.Module]:
        raise TypeError(self._not_local("iterated over"))

    def forward(self, x: torch.Tensor) -> Any:
        for stage in range(self.num_stages):
            x = self._call_stage(stage, x, swarm_training=self.training)
        return x

    def extra_repr(self) -> str:
        return f"stages={self.num_stages}, blocks={len(self._original)}"

    def _not_local(self, what: str) -> str:
        return (
            f"This nn.Sequential pipeline runs in the swarm ({self.num_stages} stages on other peers), so it cannot "
            f"be {what}: its blocks are not on this peer. Call it as a whole (`self.layers(x)`), or make the "
            "pipeline an nn.ModuleList, whose proxy is a list of stages that can each be called with any arguments."
        )


class Partition:
    """The stages of one pipeline inside a module, and the swap between the container and its proxy.

    Args:
        root: the module that holds the pipeline (e.g. the LightningModule).
        path: attribute path of the ``nn.Sequential`` / ``nn.ModuleList`` (e.g. ``"model.layers"``).
        num_stages: number of contiguous stages to cut it into.
    """

    def __init__(self, root: nn.Module, path: str, num_stages: int) -> None:
        self.root = root
        self.path = path
        self.parent, self.name, self.container = resolve_attribute(root, path)
        self.stages = split_stages(len(self.container), num_stages)
        check_nothing_shared(root, path, self.container, self.stages)
        # the non-persistent buffers of released blocks (a rotary embedding's frequencies, a causal mask): no
        # peer sends them (they are not in a state_dict), so they are kept here and put back when the block is
        # allocated again or the trained pipeline is put back
        self._kept_buffers: dict[int, dict[str, torch.Tensor]] = {}
        # per stage, the parameters that materialize() could not initialise (their modules have no
        # reset_parameters()): they must come from a peer of the stage (see check_initialised)
        self.uninitialised: dict[int, list[str]] = {}
        # the pipeline's parameters as the partition found them, before release() and materialize() give the
        # blocks new ones: (parameter, owning module id, name); an optimizer made before still holds them (weak
        # references: a released block's tensors are freed)
        self._original = [
            (weakref.ref(p), id(m), name)
            for m in self.container.modules()
            for name, p in m.named_parameters(recurse=False)
        ]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def is_sequential(self) -> bool:
        return isinstance(self.container, nn.Sequential)

    def original_parameters(self) -> dict[int, tuple[int, str]]:
        """``id(parameter) -> (id(owning module), name)`` of the pipeline's parameters from when this partition was
        made that are still alive (held by an optimizer made before the blocks were reallocated)."""
        live = {}
        for ref, owner, name in self._original:
            p = ref()
            if p is not None:
                live[id(p)] = (owner, name)
        return live

    def stage_module(self, stage: int) -> nn.Module:
        return build_stage_module(self.container, self.stages[stage])

    def stage_blocks(self, stage: int) -> list[nn.Module]:
        return [self.container[i] for i in self.stages[stage]]

    def is_materialized(self, stage: int) -> bool:
        """Whether every tensor of the stage's blocks has storage (none is on the ``meta`` device)."""
        return not any(_on_meta(block) for block in self.stage_blocks(stage))

    def release(self, keep: Iterable[int] = ()) -> None:
        """Free the blocks of every stage not in ``keep``: their parameters and buffers move to the ``meta``
        device (new tensors without storage; the old ones are freed once nothing else holds them)."""
        kept = {i for stage in keep for i in self.stages[stage]}
        for i, block in enumerate(self.container):
            if i not in kept:
                buffers = {name: b for name, b in _non_persistent_buffers(block) if not b.is_meta}
                if buffers:
                    self._kept_buffers[i] = buffers
                block.to("meta")
                mark_released(block)

    def _put_back_buffers(self, i: int) -> None:
        """Give block ``i`` back the non-persistent buffers it had when it was released (see ``release``)."""
        for name, buffer in self._kept_buffers.get(i, {}).items():
            module_name, _, buffer_name = name.rpartition(".")
            module = self.container[i].get_submodule(module_name) if module_name else self.container[i]
            current = module._buffers.get(buffer_name)
            if current is not None and not current.is_meta and current.shape == buffer.shape:
                with torch.no_grad():
                    current.copy_(buffer)
            else:
                module._buffers[buffer_name] = buffer

    def materialize(self, stage: int, device: torch.device | str, seed: int | None = None) -> bool:
        """Allocate the stage's blocks on ``device`` if any of their tensors is on ``meta``; returns whether it
        did. The new tensors are initialised by the blocks' own ``reset_parameters()`` under ``torch.manual_seed(
        seed)`` (so every peer that does this for a stage gets the same values) and are meant to be overwritten
        by the stage's current state from a peer. Non-persistent buffers the blocks had before they were released
        come back as they were. Parameters of modules without ``reset_parameters()`` (a bare ``nn.Parameter``)
        are listed in :attr:`uninitialised`: they must come from a peer (:meth:`check_initialised`).
        """
        blocks = self.stage_blocks(stage)
        if not any(_on_meta(block) for block in blocks):
            return False
        uncovered = []
        for block in blocks:
            block.to_empty(device=device)
            unmark_released(block)
            for name, module in block.named_modules():
                if not hasattr(module, "reset_parameters"):
                    uncovered += [
                        f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)
                    ]
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            with torch.no_grad():
                for block in blocks:
                    for module in block.modules():
                        if hasattr(module, "reset_parameters"):
                            cast(Any, module).reset_parameters()
        for i in self.stages[stage]:
            self._put_back_buffers(i)
        if uncovered:
            self.uninitialised[stage] = uncovered
        else:
            self.uninitialised.pop(stage, None)
        return True

    def check_initialised(self, stage: int) -> None:
        """Raise if the stage holds parameters that :meth:`materialize` could not initialise and no peer sent.

        Raises:
            ValueError: names them and says what to do.
        """
        uncovered = self.uninitialised.get(stage)
        if uncovered:
            raise ValueError(
                f"Stage {stage}'s blocks were not allocated on this peer (meta device), no peer of the stage could "
                f"send their values, and the parameters {uncovered[:5]} belong to modules without "
                "reset_parameters(), so they cannot be initialised here. Give those modules a reset_parameters() "
                "method, or build the pipeline's blocks on a real device."
            )

    def install_proxy(self, call_stage: CallStage) -> nn.Module:
        """Replace the container with its proxy inside ``root``; the container's parameters leave ``root``."""
        if self.is_sequential:
            proxy: nn.Module = SwarmSequential(self.num_stages, self.container, call_stage)
        else:
            remote = [
                RemoteStage(k, [self.container[i] for i in blocks], call_stage)
                for k, blocks in enumerate(self.stages)
            ]
            proxy = SwarmModuleList(remote, self.container)
        setattr(self.parent, self.name, proxy)
        return proxy

    def restore(self, stage_states: dict[int, dict[str, torch.Tensor]] | None = None) -> None:
        """Put the original container back, loading the given per-stage ``state_dict``s into it first."""
        for stage, state in (stage_states or {}).items():
            # released (meta) blocks take the gathered tensors themselves; allocated ones copy them in place
            assign = not self.is_materialized(stage)
            self.container.load_state_dict(self.to_container_state(stage, state), strict=False, assign=assign)
            if assign:
                for i in self.stages[stage]:
                    self._put_back_buffers(i)
        setattr(self.parent, self.name, self.container)

    def to_container_state(self, stage: int, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        mapping = stage_state_keys(self.container, self.stages[stage])
        unknown, missing = set(state) - set(mapping), set(mapping) - set(state)
        if unknown or missing:
            raise ValueError(
                f"Stage {stage} sent a state with unexpected keys {sorted(unknown)[:5]} and without the keys "
                f"{sorted(missing)[:5]}."
            )
        return {mapping[key]: value for key, value in state.items()}

    def full_state_keys(self, stage_states: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Stage states as entries of ``root.state_dict()`` (``'<path>.<block>.<param>'``)."""
        out = {}
        for stage, state in stage_states.items():
            for key, value in self.to_container_state(stage, state).items():
                out[f"{self.path}.{key}"] = value
        return out


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
