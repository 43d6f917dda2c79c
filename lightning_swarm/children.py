"""Child processes that end with the process that started them, on every exit path (SIGKILL included): what both
engines' launchers share.

Free of Lightning and of either engine.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
_libc: ctypes.CDLL | None = None


def dies_with_this_process() -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGKILL when this process dies, however it dies
    (SIGKILL included). For children that ask for their own session, which the fork hook leaves alone."""
    global _libc
    _libc = _libc or ctypes.CDLL(None, use_errno=True)
    return functools.partial(_death_signal_in_child, os.getpid())


def _death_signal_in_child(parent_pid: int) -> None:
    # runs between fork and exec: only a C call through the library loaded beforehand
    if _libc is not None and _libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)
