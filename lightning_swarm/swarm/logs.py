"""What a swarm prints: routine events are not errors.

In a swarm, some things that hivemind logs as errors with a traceback happen all the time and are handled: an
averaging round that finds no partner (the peer steps with its own gradients), a matchmaking attempt retried, a
P2P task abandoned when a peer or stream went away. :func:`quiet_routine_logs` lowers exactly these, at the
source (a filter on hivemind's log handler and on asyncio's logger, inherited by the helper processes hivemind
forks afterwards, and the exception handler of the swarm's event loop): a round without a partner becomes one
concise INFO line, the others DEBUG; a failed state download from a donor that is gone (hivemind tries the next
one), or an incomplete one (hivemind downloads again), becomes one WARNING line without its traceback. Every other
message, and every real failure, is left as it is.

bitsandbytes logs one such notice when imported on a CPU with AVX512-BF16 (its optional ``kernels`` package,
which would fetch a 4-bit kernel from the Hugging Face hub, is missing; nothing here uses 4-bit kernels): the codec
imports bitsandbytes after :func:`quiet_bitsandbytes_import`, which lowers it to DEBUG.

One more source is not a logger: ``multiprocessing``'s resource sharer (the thread that hands a tensor's file
descriptor to the process that receives it through a pipe, as between a peer and its averager) reports a receiver
that died mid-handshake through ``sys.excepthook``, with a traceback. When a peer is killed that is expected;
:func:`quiet_routine_logs` installs a hook that turns exactly that (a connection error raised in the sharer's
serving loop) into one DEBUG line, and passes every other exception to the previous hook.

The receiving side of that race is a hivemind helper process (the DHT, an averager) reading a request whose tensor
was sent by a process that exited before handing the tensor's descriptor over. hivemind skips a request it cannot
read when the error is an ``OSError``, but the sharer's handshake reports a sender that went away mid-handshake as
``EOFError``, which ends the helper process with a traceback. :func:`quiet_routine_logs` makes the sharer report it
as ``ConnectionResetError`` (what it is), so the helper drops that one request and carries on, logged at DEBUG.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
from typing import Any

__all__ = ["quiet_bitsandbytes_import", "quiet_routine_logs", "RoutineFilter"]

_SENDER_GONE = "exited before handing it over"
_BNB_CPU_OPS = "bitsandbytes.backends.cpu.ops"  # the logger of bitsandbytes' CPU kernels

# (logger name prefix, message pattern, level it becomes, concise message or None to keep the text)
_ROUTINE: list[tuple[str, re.Pattern[str], int, str | None]] = [
    (
        "hivemind.averaging",
        re.compile(r"could not find a group"),
        logging.INFO,
        "Averaging round found no partner in time; this peer steps with its own gradients",
    ),
    ("hivemind.averaging", re.compile(r"caught .*, retrying"), logging.DEBUG, None),
    ("hivemind.averaging", re.compile(r"All-reduce group .* did not finish"), logging.DEBUG, None),
    ("hivemind.averaging", re.compile(r"Unable to run All-Reduce|AllreduceException"), logging.DEBUG, None),
    (
        "hivemind.optim",
        re.compile(r"Averaging gradients failed|Proceeding with local gradients"),
        logging.DEBUG,
        None,
    ),
    # a peer with no gradients of its own joins a round with zero weight ("tags along"): that the round found no
    # partner (one was killed) or broke off costs it nothing, yet hivemind logs it as an exception
    (
        "hivemind.optim",
        re.compile(
            r"(could not find a group|AllreduceException|did not finish|TimeoutError|CancelledError)"
            r".*_tag_along_with_zero_weight",
            re.S,
        ),
        logging.DEBUG,
        None,
    ),
    # a downloaded state whose tensors do not match its metadata (fewer optimizer statistics than it lists: hivemind
    # catches only the StopIteration of the opposite case, which it logs as a WARNING); hivemind retries the download
    (
        "hivemind.optim",
        re.compile(r"Failed to load state from peers.*IndexError.*load_optimizer_state", re.S),
        logging.WARNING,
        "A state downloaded from a peer was incomplete (fewer optimizer statistics than it lists); retrying",
    ),
    ("hivemind.averaging", re.compile(r"Averager shutdown has no effect"), logging.DEBUG, None),
    # a joining peer asks a donor that has just died (its DHT record outlives it): hivemind tries the next donor
    (
        "hivemind.averaging",
        re.compile(
            r"Failed to download state from .*(ControlFailure|failed to dial|refused|reset|Timeout)", re.S
        ),
        logging.WARNING,
        None,
    ),
    ("hivemind.averaging", re.compile(r"Another look_for_group is already in progress"), logging.DEBUG, None),
    # a stream whose other end went away mid-request: a peer, or the p2p daemon under a helper, was killed
    (
        "hivemind.p2p",
        re.compile(
            r"Exception while receiving requests.*(ConnectionResetError|BrokenPipeError|IncompleteRead)", re.S
        ),
        logging.DEBUG,
        None,
    ),
    # matchmaking cancelled when a round ends or gives up: its tasks are closed mid-await
    ("hivemind.utils.asyncio", re.compile(r"GeneratorExit|CancelledError"), logging.DEBUG, None),
    ("asyncio", re.compile(r"aclose\(\): asynchronous generator is already running"), logging.DEBUG, None),
    # a request reached the DHT or an averager process from a process that has exited: what it carried (a pipe,
    # a tensor's descriptor) can no longer be fetched; the helper drops that request and goes on
    ("hivemind", re.compile(r"rebuild_connection|resource_sharer|" + _SENDER_GONE), logging.DEBUG, None),
    # hivemind's averager finishing a round that its optimizer had just cancelled (a benign race in 1.1.12)
    ("asyncio", re.compile(r"Can't set_result to a future that is CANCELLED"), logging.DEBUG, None),
    ("asyncio", re.compile(r"Task was destroyed but it is pending.*hivemind", re.S), logging.DEBUG, None),
    # bitsandbytes 0.50 on a CPU with AVX512-BF16 looks for its optional `kernels` package (a 4-bit kernel fetched
    # from the Hugging Face hub) at import and warns where it is missing: this project uses no 4-bit kernel
    (_BNB_CPU_OPS, re.compile(r"kernels-community"), logging.DEBUG, None),
]


class RoutineFilter(logging.Filter):
    """Rewrites routine hivemind records (see the module docstring); drops them below the handler's level."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(("hivemind", "asyncio", "bitsandbytes")):
            return True
        text = _text(record)
        for prefix, pattern, level, concise in _ROUTINE:
            if record.name.startswith(prefix) and pattern.search(text):
                if level < logging.getLogger(record.name).getEffectiveLevel():
                    return False
                record.levelno, record.levelname = level, logging.getLevelName(level)
                record.exc_info, record.exc_text, record.stack_info = None, None, None
                if concise is not None:
                    record.msg, record.args = concise, ()
                elif level >= logging.WARNING:  # kept, as one line without the traceback
                    record.msg, record.args = " ".join(record.getMessage().split()), ()
                return True
        return True


def _text(record: logging.LogRecord) -> str:
    try:
        text = record.getMessage()
    except Exception:
        text = str(record.msg)
    if record.exc_info and record.exc_info[1] is not None:
        error = record.exc_info[1]
        text += f" {type(error).__name__}: {error}"
        frames = traceback.extract_tb(error.__traceback__)
        text += " " + " ".join(f"{os.path.basename(f.filename)}:{f.name}" for f in frames)
    return text


_FILTER = RoutineFilter()


def quiet_routine_logs() -> None:
    """Install the filter on hivemind's log handlers and loggers (idempotent; call before the DHT starts, so
    that the processes hivemind forks inherit it)."""
    from hivemind.utils import logging as hivemind_logging

    hivemind_logging.get_logger("hivemind")  # creates hivemind's handler if it does not exist yet
    asyncio_logger = logging.getLogger("asyncio")  # asyncio logs on its own logger: filter it there
    if _FILTER not in asyncio_logger.filters:
        asyncio_logger.addFilter(_FILTER)
    for logger in (logging.getLogger("hivemind"), logging.getLogger()):
        for handler in logger.handlers:
            if _FILTER not in handler.filters:
                handler.addFilter(_FILTER)
    if not isinstance(sys.excepthook, _SharerExceptHook):
        sys.excepthook = _SharerExceptHook(sys.excepthook)
    _sender_gone_is_a_connection_error()


def quiet_bitsandbytes_import() -> None:
    """Install the filter on bitsandbytes' CPU-kernel logger (idempotent; call before bitsandbytes is imported: its
    notice about the optional ``kernels`` package is logged at import)."""
    source = logging.getLogger(_BNB_CPU_OPS)
    if _FILTER not in source.filters:
        source.addFilter(_FILTER)


def _sender_gone_is_a_connection_error() -> None:
    """Make ``multiprocessing``'s resource sharer report a sender that vanished mid-handshake as
    ``ConnectionResetError`` instead of ``EOFError`` (see the module docstring); idempotent."""
    from multiprocessing import resource_sharer

    detach = resource_sharer.DupFd.detach
    if getattr(detach, "_lightning_swarm", False):
        return

    def _detach(self: Any) -> Any:
        try:
            return detach(self)
        except EOFError as error:
            raise ConnectionResetError(
                f"The process that sent this shared resource {_SENDER_GONE}"
            ) from error

    _detach._lightning_swarm = True  # type: ignore[attr-defined]
    resource_sharer.DupFd.detach = _detach  # type: ignore[method-assign]


def _in_resource_sharer(tb: Any) -> bool:
    return any(
        os.path.basename(frame.filename) == "resource_sharer.py" and frame.name == "_serve"
        for frame in traceback.extract_tb(tb)
    )


class _SharerExceptHook:
    """``sys.excepthook`` that lowers a dead receiver in ``multiprocessing``'s resource sharer to DEBUG."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    def __call__(self, kind: type[BaseException], error: BaseException, tb: Any) -> None:
        if issubclass(kind, (EOFError, ConnectionError, OSError)) and _in_resource_sharer(tb):
            logging.getLogger(__name__).debug(f"A process died while receiving a shared resource: {error!r}")
            return
        self.previous(kind, error, tb)


def loop_exception_handler(loop: Any, context: dict[str, Any]) -> None:
    """The swarm event loop's exception handler: a P2P task garbage-collected while pending (its stream or peer
    went away) is routine and logged at DEBUG; everything else goes to asyncio's default handler."""
    if str(context.get("message", "")).startswith("Task was destroyed but it is pending"):
        logging.getLogger(__name__).debug(f"Abandoned swarm task: {context.get('task')!r}")
        return
    loop.default_exception_handler(context)
