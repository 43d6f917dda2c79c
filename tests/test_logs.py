"""What a swarm prints: routine hivemind records are lowered, real failures are left as they are."""

from __future__ import annotations

import logging
import sys

from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

from lightning_swarm.swarm.logs import RoutineFilter


def _record(name: str, msg: str, error: BaseException | None) -> logging.LogRecord:
    exc_info = None
    if error is not None:
        try:
            raise error
        except type(error):
            exc_info = sys.exc_info()
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, (), exc_info)


def test_a_state_download_from_a_dead_donor_is_one_warning_line_and_real_errors_stay() -> None:
    error = ControlFailure(
        "Connect failed. msg=failed to dial: failed to dial 12D3KooWQm: all dials failed\n"
        "  * [/ip4/127.0.0.1/tcp/46733] dial tcp4 127.0.0.1:46733: connect: connection refused"
    )
    record = _record(
        "hivemind.averaging.averager", f"Failed to download state from 12D3KooWQm - {error!r}", error
    )
    assert RoutineFilter().filter(record)
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert "\n" not in record.getMessage() and "12D3KooWQm" in record.getMessage()

    other = _record(
        "hivemind.averaging.averager", "Failed to download state from X - ValueError('bad')", None
    )
    other.exc_info = _record("x", "", ValueError("corrupt state")).exc_info
    assert RoutineFilter().filter(other)
    assert other.levelno == logging.ERROR and other.exc_info is not None  # not routine: left as it is
