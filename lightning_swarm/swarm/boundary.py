"""Compression-aware stage boundaries (SWARM, Ryabinin et al. 2023, section 4.3): shrink the tensor that crosses
the network between two pipeline stages, on top of 8-bit quantization.

The sending stage ends with a *compress* layer (hidden width ``d`` -> ``d / factor``) and the receiving stage starts
with an *expand* layer (``d / factor`` -> ``d``), so every hop between stages (stage -> trainer -> next stage) carries
``factor`` times fewer values. Two kinds:

- ``"maxout"``: LayerNorm, a ``d x d`` linear map, then the maximum over each group of ``factor`` consecutive units;
- ``"bottleneck"``: LayerNorm and a low-rank linear map ``d -> d / factor``.

Both end with values of unit scale, which blockwise 8-bit quantization handles well. :func:`compression_aware`
wraps any list of stage modules; nothing here knows about the swarm.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

BoundaryKind = Literal["maxout", "bottleneck"]
BOUNDARY_KINDS = ("maxout", "bottleneck")

__all__ = [
    "BOUNDARY_KINDS",
    "BottleneckCompress",
    "BoundaryExpand",
    "BoundaryStage",
    "MaxoutCompress",
    "boundary_pair",
    "compression_aware",
    "end_boundaries",
]


def _check(width: int, factor: int, owner: str) -> int:
    if factor < 1 or width < 1 or width % factor:
        raise ValueError(
            f"{owner}: the width {width} must be a positive multiple of the compression factor {factor}; "
            "choose a factor that divides the hidden size."
        )
    return width // factor


class MaxoutCompress(nn.Module):
    """``[..., width]`` -> ``[..., width // factor]``: LayerNorm, linear, then max over groups of ``factor`` units.

    Args:
        width: hidden size ``d`` of the stage's output.
        factor: how many times fewer values cross the boundary.
    """

    def __init__(self, width: int, factor: int) -> None:
        super().__init__()
        self.factor = factor
        self.out_features = _check(width, factor, "MaxoutCompress")
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(self.norm(x))
        return y.view(*y.shape[:-1], self.out_features, self.factor).amax(dim=-1)


class BottleneckCompress(nn.Module):
    """``[..., width]`` -> ``[..., width // factor]``: LayerNorm, then a low-rank linear map.

    Args:
        width: hidden size ``d`` of the stage's output.
        factor: how many times fewer values cross the boundary.
    """

    def __init__(self, width: int, factor: int) -> None:
        super().__init__()
        self.factor = factor
        self.out_features = _check(width, factor, "BottleneckCompress")
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class BoundaryExpand(nn.Module):
    """``[..., width // factor]`` -> ``[..., width]``: the receiving side of a boundary (one linear map).

    Args:
        width: hidden size ``d`` the next stage works in.
        factor: the compression factor of the matching compress layer.
    """

    def __init__(self, width: int, factor: int) -> None:
        super().__init__()
        self.factor = factor
        self.proj = nn.Linear(_check(width, factor, "BoundaryExpand"), width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def boundary_pair(kind: BoundaryKind, width: int, factor: int) -> tuple[nn.Module, nn.Module]:
    """``(compress, expand)`` for one boundary of the given kind (``"maxout"`` or ``"bottleneck"``)."""
    if kind == "maxout":
        return MaxoutCompress(width, factor), BoundaryExpand(width, factor)
    if kind == "bottleneck":
        return BottleneckCompress(width, factor), BoundaryExpand(width, factor)
    raise ValueError(f"Unknown boundary kind {kind!r}; use one of {BOUNDARY_KINDS}.")


class BoundaryStage(nn.Module):
    """A stage with its boundaries: ``expand`` (if any) -> ``body`` -> ``compress`` (if any).

    Extra positional and keyword arguments (masks, flags) go to ``body`` unchanged; if ``body`` returns a tuple,
    only its first element passes through ``compress``.
    """

    def __init__(
        self, body: nn.Module, expand: nn.Module | None = None, compress: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.expand, self.body, self.compress = expand, body, compress

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.expand is not None:
            x = self.expand(x)
        out = self.body(x, *args, **kwargs)
        if self.compress is None:
            return out
        if isinstance(out, tuple):
            return (self.compress(out[0]), *out[1:])
        return self.compress(out)


def compression_aware(
    stages: Sequence[nn.Module],
    width: int,
    kind: BoundaryKind = "maxout",
    factor: int = 4,
    ends: bool = False,
) -> nn.ModuleList:
    """Put a compress/expand boundary between every two consecutive ``stages``, so the tensors passed between them
    are ``factor`` times narrower. Use the result as the pipeline with one stage per element (e.g.
    ``SwarmStrategy(pipeline=..., num_stages=len(stages))``).

    With ``ends``, the first stage also starts with an expand and the last one ends with a compress: the trainer's
    own hops (its input to the first stage, the last stage's output back to it) shrink too. The trainer then
    compresses what it feeds the pipeline and expands what comes out, with the modules of :func:`end_boundaries`.
    """
    if not stages:
        raise ValueError("compression_aware needs at least one stage module.")
    inner = len(stages) - 1 + (2 if ends else 0)
    pairs = [boundary_pair(kind, width, factor) for _ in range(inner)]
    offset = 1 if ends else 0  # pairs[0] is the entry boundary with ends (its compress lives on the trainer)
    wrapped = []
    for k, body in enumerate(stages):
        expand = pairs[k - 1 + offset][1] if k > 0 or ends else None
        compress = pairs[k + offset][0] if k < len(stages) - 1 or ends else None
        wrapped.append(BoundaryStage(body, expand=expand, compress=compress))
    return nn.ModuleList(wrapped)


def end_boundaries(kind: BoundaryKind, width: int, factor: int) -> tuple[nn.Module, nn.Module]:
    """The trainer's side of ``compression_aware(..., ends=True)``: ``(compress, expand)``, to apply to the tensor
    it feeds the first stage and to the tensor the last stage returns."""
    return boundary_pair(kind, width, factor)[0], BoundaryExpand(width, factor)
