"""Guards on what crosses the wire: finite gradients, values a stage accepts (NaN nowhere, infinities only in what
carries no gradient: masks), outputs and output gradients that match, per-stage input schemas, and per-peer strikes
and bans of peers that send malformed requests."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from lightning_swarm.swarm.wire.codec import all_finite
from lightning_swarm.swarm.wire.errors import (
    BadRequest,
)
from lightning_swarm.swarm.wire.quantize import one_thread


def check_finite(tensors: list[torch.Tensor], what: str, error: type[Exception]) -> None:
    """Raise ``error`` if a floating tensor among ``tensors`` holds a NaN or an infinity (for gradients).

    Runs on one OpenMP thread, as the codec does (see :mod:`.quantize`): a parallel region's spinning workers
    would starve the p2p daemons sharing the cores, on every call."""
    with one_thread():
        for i, t in enumerate(tensors):
            if not all_finite(t):
                raise error(
                    f"{what.capitalize()} tensor {i} holds NaN or infinite values; only finite values are accepted"
                )


def check_values(tensors: list[torch.Tensor], what: str, error: type[Exception]) -> None:
    """Raise ``error`` if a floating tensor among ``tensors`` holds a NaN, or an infinity while it requires grad.

    A tensor that does not require grad is data, not an activation: a float attention mask holds ``-inf`` by
    design (``nn.Transformer.generate_square_subsequent_mask``). Finite tensors cost one pass, as in
    :func:`check_finite`; only a non-finite one is scanned again for NaN."""
    with one_thread():
        for i, t in enumerate(tensors):
            if all_finite(t):
                continue
            if t.requires_grad:
                raise error(
                    f"{what.capitalize()} tensor {i} holds NaN or infinite values; an input that requires grad "
                    "(an activation) must be finite"
                )
            if bool(torch.isnan(t).any()):
                raise error(f"{what.capitalize()} tensor {i} holds NaN values; only numbers are accepted")


def check_outputs(
    outputs: list[torch.Tensor], inputs: list[torch.Tensor], what: str, error: type[Exception]
) -> None:
    """Raise ``error`` if a floating tensor among a call's ``outputs`` holds a NaN, or an infinity unless it is
    one of the call's data ``inputs`` (one that does not require grad, e.g. a mask a block passes through)
    returned as it is: equal in dtype, shape and values. Checked by the server before it replies and by the
    trainer on receipt; finite outputs cost one pass each."""
    with one_thread():
        for i, t in enumerate(outputs):
            if all_finite(t):
                continue
            if not bool(torch.isnan(t).any()) and any(_same_data(t, x) for x in inputs):
                continue
            raise error(
                f"{what.capitalize()} tensor {i} holds NaN or infinite values; only finite values are accepted"
            )


def _same_data(output: torch.Tensor, data: torch.Tensor) -> bool:
    if output is data:
        return not data.requires_grad
    if data.requires_grad or data.dtype != output.dtype or data.shape != output.shape:
        return False
    return bool(torch.equal(output.detach().to(data.device), data))


@dataclass(frozen=True)
class InputSchema:
    """What a stage's calls look like: per tensor (in payload order) its dtype and number of dimensions. Sizes are
    not part of it: batch sizes, sequence lengths and even feature sizes may legitimately vary from call to call (a
    request whose sizes the module cannot take gets the module's own error, a ``compute`` error reply; the size
    limits bound what such a request can cost)."""

    specs: tuple[tuple[torch.dtype, int], ...]

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> InputSchema:
        return cls(tuple((t.dtype, t.dim()) for t in tensors))

    def mismatch(self, tensors: list[torch.Tensor]) -> str | None:
        """Why ``tensors`` do not fit this schema, or ``None`` if they do."""
        if len(tensors) != len(self.specs):
            return f"{len(tensors)} tensors sent, this stage takes {len(self.specs)}"
        for i, (t, (dtype, ndim)) in enumerate(zip(tensors, self.specs, strict=True)):
            if t.dtype != dtype:
                return f"input tensor {i} is {t.dtype}, this stage takes {dtype}"
            if t.dim() != ndim:
                return (
                    f"input tensor {i} has shape {list(t.shape)}, this stage takes {ndim}-dimensional tensors"
                )
        return None


class StageSchemas:
    """The input schemas a stage server has served successfully (at most ``max_schemas``; thread-safe).

    Until the first call succeeds anything well-formed is tried on the module; afterwards a request whose tensors
    match none of the learned schemas is refused before it reaches the module (:meth:`check`).
    """

    def __init__(self, max_schemas: int = 4) -> None:
        self.max_schemas = max_schemas
        self._schemas: list[InputSchema] = []
        self._lock = threading.Lock()

    def check(self, tensors: list[torch.Tensor]) -> None:
        schemas = self._schemas
        if not schemas:
            return
        reasons = [schema.mismatch(tensors) for schema in schemas]
        if all(reasons):
            raise BadRequest(f"The request does not fit this stage: {reasons[0]}")

    def learn(self, tensors: list[torch.Tensor]) -> None:
        """Remember the schema of a call the stage served successfully."""
        schema = InputSchema.of(tensors)
        with self._lock:
            if schema not in self._schemas and len(self._schemas) < self.max_schemas:
                self._schemas = [*self._schemas, schema]


class BadPeers:
    """Peers that sent too many bad requests, ignored for a while (thread-safe, bounded).

    A peer that sends ``limit`` bad requests within ``window`` seconds is ignored for ``ban_s`` seconds.
    """

    def __init__(self, limit: int = 20, window: float = 60.0, ban_s: float = 60.0, max_peers: int = 10_000):
        self.limit, self.window, self.ban_s, self.max_peers = limit, window, ban_s, max_peers
        self._strikes: OrderedDict[Any, list[float]] = OrderedDict()
        self._banned: OrderedDict[Any, float] = OrderedDict()
        self._lock = threading.Lock()

    def strike(self, peer: Any, now: float | None = None) -> bool:
        """Count one bad request of ``peer``; returns whether it is ignored from now on."""
        now = time.monotonic() if now is None else now
        with self._lock:
            times = [t for t in self._strikes.pop(peer, []) if t > now - self.window]
            times.append(now)
            if len(times) < self.limit:
                self._strikes[peer] = times
                while len(self._strikes) > self.max_peers:
                    self._strikes.popitem(last=False)
                return False
            self._banned.pop(peer, None)
            self._banned[peer] = now + self.ban_s
            while len(self._banned) > self.max_peers:
                self._banned.popitem(last=False)
            return True

    def ignored_for(self, peer: Any, now: float | None = None) -> float:
        """Seconds ``peer`` is still ignored (0: not ignored)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            until = self._banned.get(peer)
            if until is None:
                return 0.0
            if until <= now:
                del self._banned[peer]
                return 0.0
            return until - now


def check_grad_outputs(grads: tuple, outputs: list[torch.Tensor]) -> None:
    """Check a backward request's output gradients against the recomputed outputs; raises ``BadRequest``."""
    if len(grads) != len(outputs):
        raise BadRequest(
            f"The stage produced {len(outputs)} output tensors but {len(grads)} gradients were sent"
        )
    for i, (out, grad) in enumerate(zip(outputs, grads, strict=True)):
        if grad is not None and grad.shape != out.shape:
            raise BadRequest(
                f"Output gradient {i} has shape {list(grad.shape)}; the output has {list(out.shape)}"
            )
        if grad is not None and not grad.is_floating_point():
            raise BadRequest(f"Output gradient {i} is {grad.dtype}; gradients must be floating point")
