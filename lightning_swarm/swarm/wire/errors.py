"""The errors of a stage call, on both sides: what a server refuses (``BadRequest``, ``Misrouted``), what a trainer
refuses (``ProtocolError``), the error reply's categories, and the exceptions a trainer raises for an error reply
(``RemoteStageError`` and its built-in-typed variants, ``RequestRefused``)."""

from __future__ import annotations

import builtins
import functools
from dataclasses import dataclass
from typing import Any, cast

from lightning_swarm.swarm.wire.codec import CodecError

COMPUTE, REQUEST, UNAVAILABLE = "compute", "request", "unavailable"


MAX_MESSAGE = 4096


class BadRequest(ValueError):
    """A received request is malformed: its own content is refused (every peer of the stage would refuse it)."""


class Misrouted(BadRequest):
    """A request this peer cannot take but another peer of the stage may: it names a stage this peer does not
    serve (it migrated), or speaks another protocol version. Replied as ``"unavailable"``."""


class NotKept(Misrouted):
    """A backward sent without its inputs (see :mod:`.protocol`) reached a peer that no longer keeps its forward:
    the trainer sends it again with them. Replied as ``"unavailable"``."""


class ProtocolError(CodecError):
    """A received reply is malformed (the peer, not the caller, is at fault)."""


@dataclass
class ErrorReply:
    """Why a call failed: ``category`` (compute/request/unavailable), the exception's type name and message."""

    category: str
    type_name: str
    message: str

    @classmethod
    def from_exception(cls, error: BaseException, category: str) -> ErrorReply:
        return cls(category, type(error).__name__, str(error)[:MAX_MESSAGE])


class RemoteStageError(RuntimeError):
    """A peer replied to a stage call with an error (see :class:`ErrorReply`).

    Errors raised by the stage's own code (category ``"compute"``) reach the trainer as an exception that is
    both a ``RemoteStageError`` and, where the remote type is a Python built-in (``RuntimeError``,
    ``ValueError``, ``TypeError``...), an instance of that type.
    """

    def __init__(
        self, message: str, error: ErrorReply | None = None, stage: int | None = None, peer: Any = None
    ):
        super().__init__(message)
        self.error, self.stage, self.peer = error, stage, peer

    @property
    def is_compute_error(self) -> bool:
        """Whether the stage's own code raised (retrying on another peer would fail the same way)."""
        return self.error is not None and self.error.category == COMPUTE

    @property
    def is_caller_error(self) -> bool:
        """Whether another peer would fail the same way (the stage's code raised, or the request was refused):
        such an error is raised to the trainer at once, never retried elsewhere."""
        return self.error is not None and self.error.category in (COMPUTE, REQUEST)


class RequestRefused(RemoteStageError):
    """A peer refused a stage call for the request's own content (error category ``"request"``: malformed, a
    schema mismatch, NaN in an input, an infinity in an activation or gradient, beyond the size limits): every
    peer of the stage would, so it is raised at once with the server's message."""


@functools.cache
def remote_class(
    type_name: str, origin: type[RuntimeError] = RemoteStageError, prefix: str = "Remote"
) -> type[RuntimeError]:
    """``origin`` (the kind of remote error), combined with the built-in exception type ``type_name`` if it is one
    (named ``prefix + type_name``): ``except ValueError`` catches a ``ValueError`` raised elsewhere in the swarm."""
    base = getattr(builtins, type_name, None)
    if not isinstance(base, type) or not issubclass(base, Exception) or base in (RuntimeError, Exception):
        return origin
    try:
        return type(f"{prefix}{type_name}", (origin, base), {"__module__": origin.__module__})
    except TypeError:  # a built-in whose instance layout differs (OSError, SyntaxError...)
        return origin


def remote_exception(error: ErrorReply, stage: int, peer: Any) -> RemoteStageError:
    """The exception a trainer raises for an error reply from ``peer`` serving ``stage``."""
    if error.category == COMPUTE:
        message = f"Stage {stage} raised {error.type_name}: {error.message} (on peer {peer})"
        cls = remote_class(error.type_name)
    elif error.category == REQUEST:
        message = f"Peer {peer} refused the call of stage {stage}: {error.type_name}: {error.message}"
        cls = RequestRefused
    else:
        message = f"Peer {peer} could not serve stage {stage} ({error.category}): {error.type_name}: {error.message}"
        cls = RemoteStageError
    return cast(type[RemoteStageError], cls)(message, error, stage, peer)
